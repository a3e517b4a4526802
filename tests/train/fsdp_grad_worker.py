"""Worker of tests/train/test_fsdp.py: one trainer step, the full gradient written before the update.

    torchrun --standalone --nproc_per_node 2 fsdp_grad_worker.py DATA MODEL OUT GROUPS_PER_RANK BUDGET

Run under torchrun the model is FSDP2-sharded (gloo on CPU); run in process with one
rank it is not. The loss is decoupled with a KL term, so the no-grad proximal and
reference forwards run too. Writes ``OUT/grads.safetensors`` (full gradients,
transformers names) and ``OUT/metrics.json`` from rank 0, and each rank's micro-batch
count to ``OUT/micro_batches-RANK``. Then it saves a checkpoint (gathered from the
shards), resumes from it in a new trainer (loaded into the shards) and writes
``OUT/resume.json``: the largest difference between the saved and the reloaded weights
and optimizer moments.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rollshard.train.backends.distributed import DistEnv, close_distributed, init_distributed
from rollshard.train.checkpoint import latest_checkpoint
from rollshard.train.config import TrainConfig
from rollshard.train.trainer import Trainer


def one_step_gradients(data: str, model: str, out: str, groups_per_rank: int, budget: int, env: DistEnv) -> None:
    config = TrainConfig.from_dict(
        {
            "data": {"path": data, "groups_per_step": groups_per_rank, "micro_batch_tokens": budget},
            "model": {"path": model},
            "loss": {"mode": "decoupled", "kl_coef": 0.05},
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
    step = next(iter(trainer.loader))
    metrics = trainer.train_step(step)
    trainer.step = 1
    trainer.save()
    trainer.close()
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"micro_batches-{env.rank}").write_text(str(len(step.micro_batches)))
    if env.is_main:
        save_file(grads, str(Path(out) / "grads.safetensors"))
        (Path(out) / "metrics.json").write_text(json.dumps(metrics))

    resumed = Trainer(dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, resume=True)), env=env)
    weights = resumed.backend.model_state()  # collective; the full tensors land on rank 0
    moments = resumed.backend.optimizer_state()
    resumed.close()
    if env.is_main:
        ckpt = latest_checkpoint(out)
        saved = load_file(str(ckpt.path / "model.safetensors"))
        saved_moments = ckpt.optimizer_state()["state"]
        report = {
            "step": resumed.step,
            "weights": max((weights[k] - v).abs().max().item() for k, v in saved.items()),
            "moments": max(
                (moments["state"][p][k] - v).abs().max().item()
                for p, entry in saved_moments.items() for k, v in entry.items() if k.startswith("exp_avg")
            ),
        }
        (Path(out) / "resume.json").write_text(json.dumps(report))


if __name__ == "__main__":
    env = init_distributed()
    try:
        one_step_gradients(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), env)
    finally:
        close_distributed(env)
