"""Worker of tests/train/test_fsdp_epochs.py: a whole two-epoch run of the trainer, each rank's steps recorded.

    torchrun --standalone --nproc_per_node 2 fsdp_epochs_worker.py DATA MODEL OUT

Each rank reads its own share of the blocks and drops the zero-variance groups in it, so the ranks' shares
hold different numbers of steps; the trainer's agreement callback ends each epoch on both ranks at once.
Writes ``OUT/epochs-RANK.json``: the epoch of every step this rank trained, in order; and from rank 0
``OUT/history.json``, the merged metrics of every step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rollshard.train.backends.distributed import close_distributed, init_distributed
from rollshard.train.config import TrainConfig
from rollshard.train.trainer import Trainer


def main(data: str, model: str, out: str) -> None:
    env = init_distributed()
    config = TrainConfig.from_dict(
        {
            "data": {"path": data, "groups_per_step": 1, "num_epochs": 2, "drop_zero_variance": True, "shuffle_window": 4},
            "model": {"path": model},
            "optim": {"lr": 1e-6},
            "trainer": {"out": out, "progress": False, "tensorboard": False, "save_every": 0},
        }
    ).validate()
    trainer = Trainer(config, env=env)
    epochs: list[int] = []
    real_step = trainer.train_step

    def record(step):
        epochs.append(step.epoch)
        return real_step(step)

    trainer.train_step = record
    trainer.run()
    trainer.close()
    Path(out, f"epochs-{env.rank}.json").write_text(json.dumps(epochs))
    if env.is_main:
        Path(out, "history.json").write_text(json.dumps(trainer.history))
    close_distributed(env)


if __name__ == "__main__":
    main(*sys.argv[1:4])
