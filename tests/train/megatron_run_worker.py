"""Worker of tests/train/test_megatron_run.py: ``rollshard-train`` under torchrun, optionally dying while saving.

    torchrun --standalone --nproc_per_node 2 megatron_run_worker.py plain|crash ARGS...

``plain`` runs the command line (``rollshard.train.cli.main(ARGS)``). ``crash`` does the same, but rank 1
SIGKILLs itself as soon as its shard file of the second checkpoint is written (before the model export and
the barrier), so rank 0 fails in the next collective and torchrun stops it: the checkpoint of step 1 stays
the latest, and the torn save of step 2 is left behind.
"""

from __future__ import annotations

import os
import signal
import sys

from rollshard.train.backends.megatron.backend import MegatronBackend
from rollshard.train.cli import main

CRASH_AT_SAVE = 2


def crash_on_rank1_after_its_shards() -> None:
    real = MegatronBackend.save_state
    calls = {"n": 0}

    def save_state(self, folder, **kw):
        real(self, folder, **kw)
        calls["n"] += 1
        if self.env.global_rank == 1 and calls["n"] == CRASH_AT_SAVE:
            os.kill(os.getpid(), signal.SIGKILL)

    MegatronBackend.save_state = save_state


if __name__ == "__main__":
    if sys.argv[1] == "crash":
        crash_on_rank1_after_its_shards()
    sys.exit(main(sys.argv[2:]))
