"""Worker of tests/train/test_fsdp.py: one trainer step, the full gradient written before the update.

    torchrun --standalone --nproc_per_node 2 fsdp_grad_worker.py DATA MODEL OUT GROUPS_PER_RANK

Run under torchrun the model is FSDP2-sharded (gloo on CPU); run in process with one
rank it is not. Writes ``OUT/grads.safetensors`` (full gradients, transformers names)
and ``OUT/metrics.json`` from rank 0.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from rollshard.train.backends.distributed import DistEnv, close_distributed, init_distributed
from rollshard.train.config import TrainConfig
from rollshard.train.trainer import Trainer


def one_step_gradients(data: str, model: str, out: str, groups_per_rank: int, env: DistEnv) -> None:
    config = TrainConfig.from_dict(
        {
            "data": {"path": data, "groups_per_step": groups_per_rank, "micro_batch_tokens": 96},
            "model": {"path": model},
            "trainer": {"out": out, "max_steps": 1, "progress": False, "tensorboard": False},
        }
    ).validate()
    trainer = Trainer(config, env=env)
    backend = trainer.backend
    grads: dict[str, torch.Tensor] = {}
    real_step = backend.optimizer_step

    def capture():
        for name, p in backend.policy.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name.removeprefix("model.")] = g.detach().cpu().clone()
        return real_step()

    backend.optimizer_step = capture
    metrics = trainer.train_step(next(iter(trainer.loader)))
    trainer.close()
    if env.is_main:
        Path(out).mkdir(parents=True, exist_ok=True)
        save_file(grads, str(Path(out) / "grads.safetensors"))
        (Path(out) / "metrics.json").write_text(json.dumps(metrics))


if __name__ == "__main__":
    env = init_distributed()
    try:
        one_step_gradients(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), env)
    finally:
        close_distributed(env)
