"""Model backends: where the policy lives, how it is sharded, and how it is updated.

A backend gives the trainer: ``logprobs(batch, grad=, entropy=, reference=, support=)``,
``set_gradient_sync``, ``backward``, ``optimizer_step``, ``lr``, ``updates``, and the state
for checkpoints (rollshard.train.checkpoint): ``save_state`` / ``load_state`` (sharded weights
and optimizer state, each rank its own), ``export_model`` (the engines' model folder) and
``load_optimizer_state`` (a whole optimizer state, for format-1 checkpoints). ``hf``
(transformers, one device or FSDP2 under torchrun) is the one built in.
"""

from __future__ import annotations

from pathlib import Path

from rollshard.train.backends.distributed import DistEnv
from rollshard.train.config import TrainConfig

BACKENDS = ("hf",)


def build_backend(
    config: TrainConfig, *, env: DistEnv, total_updates: int | None, weights_from: str | Path | None = None
):
    """The backend named by ``config.model.backend``."""
    name = config.model.backend
    if name == "hf":
        from rollshard.train.backends.hf import HFBackend

        return HFBackend(
            config.model,
            config.optim,
            env=env,
            total_updates=total_updates,
            weights_from=weights_from,
            need_reference=config.loss.kl_coef > 0,
        )
    raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
