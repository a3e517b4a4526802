"""Worker of tests/train/test_fsdp.py: sharded checkpoints under FSDP2, a crash while saving, exact resume.

    torchrun --standalone --nproc_per_node 2 fsdp_resume_worker.py first DATA MODEL OUT STEPS
    torchrun --standalone --nproc_per_node 2 fsdp_resume_worker.py resume DATA MODEL OUT STEPS
    torchrun --standalone --nproc_per_node 2 fsdp_resume_worker.py unshared DATA MODEL OUT STEPS
    torchrun --standalone --nproc_per_node 2 fsdp_resume_worker.py dcp DATA MODEL OUT STEPS

``first`` trains STEPS steps straight into ``OUT/straight`` (one checkpoint, at the end), then the
same run into ``OUT/resumed`` saving every step, and dies while saving step 2: rank 1 SIGKILLs
itself as soon as its shards of step 2 are written, before the model export and the barrier, so
rank 0 fails in the next collective and torchrun stops it (the run exits non-zero). Step 1 is
then the latest checkpoint and ``.tmp-step_00000002`` holds the torn save (both ranks' shards, no
model folder or state file).

``resume`` continues ``OUT/resumed`` from there to STEPS. Each rank records the bytes it read
from each shard file while resuming (``OUT/reads-RANK.json``: file name -> bytes), by wrapping
``safetensors.safe_open``, which DCP's safetensors reader opens the files with.

``unshared`` trains one step into ``OUT/unshared`` and saves it, rank 1's shard files lost as they would be on
a disk of its own (an ``--out`` not shared): rank 1 deletes them once written. Every rank raises the refusal;
each writes its message to ``OUT/refused-RANK.txt`` (the run exits non-zero).

``dcp`` trains STEPS steps into ``OUT/own`` in checkpoint format 2 (the weights in the shards beside the moments;
each rank writes its shard files itself; the calls of ``dcp.save`` it made go to ``OUT/dcp-saves-RANK.txt``), then
saves the same state through ``dcp.save`` with DCP's safetensors storage into ``OUT/dcp``: the files the test
compares them with.

``signal-at-end`` trains into ``OUT/signalled`` with ``--final-checkpoint model`` until its one epoch ends (before
``--max-steps`` 100); rank 0 alone gets a SIGTERM as its loader says the data ended (after the step boundary's
agreement, before the data-end one). Each rank writes how its run ended to ``OUT/stopped-RANK.txt``.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
from pathlib import Path

import safetensors

from rollshard.train.backends.distributed import close_distributed, init_distributed
from rollshard.train.backends.hf import HFBackend
from rollshard.train.config import TrainConfig
from rollshard.train.trainer import Trainer

CRASH_AT_SAVE = 2


def config(data: str, model: str, out: str, steps: int | None, *, save_every: int, resume: bool = False,
           epochs: int = 2, final: str = "full") -> TrainConfig:
    return TrainConfig.from_dict(
        {
            "data": {"path": data, "groups_per_step": 2, "micro_batch_tokens": 96, "num_epochs": epochs},
            "model": {"path": model},
            # A schedule that depends on the update count, so a resume that lost it would step differently.
            "optim": {"lr": 1e-3, "lr_decay": "linear", "min_lr_ratio": 0.1},
            "trainer": {"out": out, "max_steps": steps, "save_every": save_every, "resume": resume,
                        "progress": False, "tensorboard": False, "final_checkpoint": final},
        }
    ).validate()


def run(cfg: TrainConfig, env) -> None:
    trainer = Trainer(cfg, env=env)
    try:
        trainer.run()
    finally:
        trainer.close()


def crash_on_rank1_after_its_shards(env) -> None:
    real = HFBackend.save_state
    calls = {"n": 0}

    def save_state(self, folder, **kw):
        real(self, folder, **kw)
        calls["n"] += 1
        if env.rank == 1 and calls["n"] == CRASH_AT_SAVE:
            os.kill(os.getpid(), signal.SIGKILL)

    HFBackend.save_state = save_state


def lose_rank1_shards(env) -> None:
    real = HFBackend.save_state

    def save_state(self, folder, **kw):
        real(self, folder, **kw)
        if env.rank == 1:
            for f in Path(folder).glob("shard-00002-*.safetensors"):
                f.unlink()

    HFBackend.save_state = save_state


def record_reads(out: Path, env) -> None:
    """Count the bytes each tensor slice read takes from each file (DCP reads with ``get_slice(name)[...]``)."""
    real_open = safetensors.safe_open
    reads: dict[str, int] = {}

    class Slice:
        def __init__(self, inner, file):
            self.inner, self.file = inner, file

        def __getitem__(self, index):
            t = self.inner[index]
            reads[self.file] = reads.get(self.file, 0) + t.numel() * t.element_size()
            return t

        def __getattr__(self, name):
            return getattr(self.inner, name)

    class File:
        def __init__(self, inner, file):
            self.inner, self.file = inner, file

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def get_slice(self, name):
            return Slice(self.inner.get_slice(name), self.file)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    def safe_open(filename, *args, **kw):
        f = real_open(filename, *args, **kw)
        return File(f, Path(filename).name) if Path(filename).parent.name == "shards" else f

    safetensors.safe_open = safe_open
    atexit.register(lambda: (out / f"reads-{env.rank}.json").write_text(json.dumps(reads)))


def save_through_dcp(backend: HFBackend, folder: Path, env) -> None:
    from rollshard.train.backends.hf import POLICY_PREFIX
    from rollshard.train.sharded import file_buckets, state_tensors, write_with_dcp

    tensors, _ = state_tensors(backend.policy, backend.optimizer, strip=POLICY_PREFIX)
    write_with_dcp(folder, tensors, file_buckets(tensors, world_size=env.world_size), env=env)


if __name__ == "__main__":
    mode, data, model, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4]), int(sys.argv[5])
    env = init_distributed()
    try:
        if mode == "first":
            run(config(data, model, str(out / "straight"), steps, save_every=0), env)
            crash_on_rank1_after_its_shards(env)
            run(config(data, model, str(out / "resumed"), steps, save_every=1), env)
        elif mode == "unshared":
            lose_rank1_shards(env)
            try:
                run(config(data, model, str(out / "unshared"), 1, save_every=1), env)
            except ValueError as e:
                (out / f"refused-{env.rank}.txt").write_text(str(e))
                raise
        elif mode == "signal-at-end":
            trainer = Trainer(config(data, model, str(out / "signalled"), 100, save_every=0, epochs=1,
                                     final="model"), env=env)
            real_next = trainer._next_step

            def next_step(it):
                step = real_next(it)
                if step is None and env.rank == 0:
                    signal.raise_signal(signal.SIGTERM)  # the trainer's handler: a stop rank 1 does not see
                return step

            trainer._next_step = next_step
            try:
                trainer.run()
                (out / f"stopped-{env.rank}.txt").write_text(f"{trainer.stopped_by} {trainer.exit_status}")
            finally:
                trainer.close()
        elif mode == "dcp":
            import torch.distributed.checkpoint as dcp

            real_save, saves = dcp.save, []
            dcp.save = lambda *a, **kw: saves.append(1) or real_save(*a, **kw)
            HFBackend.exports_held_weights = False  # format 2: the weights through the shard writer too
            trainer = Trainer(config(data, model, str(out / "own"), steps, save_every=0), env=env)
            try:
                trainer.run()
                (out / f"dcp-saves-{env.rank}.txt").write_text(str(len(saves)))
                dcp.save = real_save
                save_through_dcp(trainer.backend, out / "dcp", env)
            finally:
                trainer.close()
        else:
            record_reads(out, env)
            run(config(data, model, str(out / "resumed"), steps, save_every=1, resume=True), env)
    finally:
        close_distributed(env)
