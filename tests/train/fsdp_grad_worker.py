"""Worker of tests/train/test_fsdp.py: one trainer step, the full gradient written before the update.

    torchrun --standalone --nproc_per_node 2 fsdp_grad_worker.py DATA MODEL OUT GROUPS_PER_RANK BUDGET

Run under torchrun the model is FSDP2-sharded (gloo on CPU); run in process with one
rank it is not. The loss is decoupled with a KL term, so the no-grad proximal and
reference forwards run too. Writes ``OUT/grads.safetensors`` (full gradients,
transformers names) and ``OUT/metrics.json`` from rank 0, and each rank's micro-batch
count to ``OUT/micro_batches-RANK``. Then it saves a checkpoint (each rank its shards, the
model folder gathered tensor by tensor), resumes from it in a new trainer (each rank loads its
shards) and writes ``OUT/resume.json``: the largest difference between the saved (model folder,
shards read whole) and the reloaded (gathered) weights and optimizer moments.
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
from rollshard.train.checkpoint import SHARDS_DIR
from rollshard.train.sharded import read_sharded
from rollshard.train.trainer import Trainer


def one_step_gradients(data: str, model: str, out: str, groups_per_rank: int, budget: int, env: DistEnv) -> None:
    """One training step; the gradients, metrics and resume check land in ``out``, the run in ``out/run`` (a run
    folder refuses files it does not write)."""
    run = str(Path(out) / "run")
    config = TrainConfig.from_dict(
        {
            "data": {"path": data, "groups_per_step": groups_per_rank, "micro_batch_tokens": budget},
            "model": {"path": model},
            "loss": {"mode": "decoupled", "kl_coef": 0.05},
            "trainer": {"out": run, "max_steps": 1, "progress": False, "tensorboard": False},
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
    weights, moments = full_state(resumed.backend)  # collective; the full tensors land on rank 0
    resumed.close()
    if env.is_main:
        ckpt = latest_checkpoint(run)
        saved = load_file(str(ckpt.path / "model.safetensors"))
        shards, _ = read_sharded(ckpt.path / SHARDS_DIR)
        report = {
            "step": resumed.step,
            "weights": max((weights[k] - v).abs().max().item() for k, v in saved.items()),
            "moments": max(
                (moments[name.removeprefix("optim/")] - v).abs().max().item()
                for name, v in shards.items() if name.startswith("optim/") and "/exp_avg" in name
            ),
        }
        (Path(out) / "resume.json").write_text(json.dumps(report))


def full_state(backend) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The whole weights (transformers names) and AdamW moments (``name/state``) gathered from the shards to rank 0
    (empty on the other ranks)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, optim = get_state_dict(
        backend.policy, backend.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    weights = {k.removeprefix("model."): v for k, v in model.items()}
    moments = {
        f"{p.removeprefix('model.')}/{k}": v for p, entry in optim.get("state", {}).items() for k, v in entry.items()
    }
    return weights, moments


if __name__ == "__main__":
    env = init_distributed()
    try:
        one_step_gradients(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), env)
    finally:
        close_distributed(env)
