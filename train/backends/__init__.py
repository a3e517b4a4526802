"""Model backends: where the policy lives, how it is sharded, and how it is updated.

A backend gives the trainer: ``logprobs(batch, grad=, entropy=, reference=, support=)``,
``set_gradient_sync``, ``backward``, ``optimizer_step``, ``lr``, ``updates``, and the state
for checkpoints (rollshard.train.checkpoint): ``save_state`` / ``load_state`` (sharded weights
and optimizer state, each rank its own), ``export_model`` (the engines' model folder) and
``load_optimizer_state`` (a whole optimizer state, for format-1 checkpoints). ``hf``
(transformers, one device or FSDP2 under torchrun) and ``megatron`` (megatron-core with tensor, pipeline
and data parallelism, rollshard.train.backends.megatron; the ``megatron`` extra) are built in.
:func:`parallel_env` turns the torchrun world into the one the trainer sees (for ``megatron``: the
data-parallel ranks), before the trainer is built.
"""

from __future__ import annotations

from pathlib import Path

from rollshard.train.backends.distributed import DistEnv
from rollshard.train.config import TrainConfig

BACKENDS = ("hf", "megatron")


def build_backend(
    config: TrainConfig, *, env: DistEnv, total_updates: int | None, weights_from: str | Path | None = None
):
    """The backend named by ``config.model.backend``."""
    name = config.model.backend
    if name == "hf":
        from rollshard.train.backends.hf import HFBackend as backend
    elif name == "megatron":
        from rollshard.train.backends.megatron.backend import MegatronBackend as backend
    else:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
    return backend(
        config.model,
        config.optim,
        env=env,
        total_updates=total_updates,
        weights_from=weights_from,
        need_reference=config.loss.kl_coef > 0,
    )


def parallel_env(config: TrainConfig, env: DistEnv) -> DistEnv:
    """The trainer's view of the world for the configured backend: ``env`` itself for ``hf``; for ``megatron``
    megatron-core's groups are set up and the trainer sees the data-parallel ranks (ValueError, one line, when
    megatron-core is not installed or the world does not split into --tp x --pp)."""
    m = config.model
    if m.backend != "megatron":
        return env
    from rollshard.train.backends.megatron import compat

    compat.quiet()
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise ValueError("--backend megatron needs megatron-core: pip install 'rollshard[megatron]'") from e
    from rollshard.train.backends.megatron.parallel import init_parallel

    return init_parallel(env, tp=m.tp, pp=m.pp, ep=m.ep)


def close_env(env: DistEnv) -> None:
    """Undo :func:`parallel_env` (megatron-core's groups, and the one-process group it created)."""
    from rollshard.train.backends.megatron.parallel import ParallelEnv

    if isinstance(env, ParallelEnv):
        from rollshard.train.backends.megatron.parallel import close_parallel

        close_parallel()
