"""The seam between the trainer (and the audit) and a model backend: :class:`Backend`.

A backend holds the policy (and, for a KL term, a frozen reference), computes packed logprobs, runs backward
and AdamW updates, and moves its state in and out of checkpoints. The trainer and ``rollshard-train audit``
use this class's methods and attributes only: ``hf`` (:mod:`.hf`: transformers, FSDP2 under torchrun) and
``megatron`` (:mod:`.megatron.backend`: megatron-core, TP/PP/EP) implement it.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any

import torch

from rollshard.store.format.routing import RoutingShape
from rollshard.train.backends.distributed import DistEnv
from rollshard.train.backends.schedule import lr_factor
from rollshard.train.config import ModelConfig, OptimConfig


class Backend(abc.ABC):
    """A policy model, its optimizer and its learning-rate schedule (see the module docstring).

    Set by :meth:`__init__`: ``cfg``, ``optim_cfg``, ``env``, ``source`` (the model folder), ``device``,
    ``total_updates`` and ``updates``; by the subclass: ``bf16`` (the compute runs under bf16 autocast),
    ``routing_shape`` (the model's MoE routing, train/routing.py; None for a dense model) and ``routing`` (the
    policy's routing replay, with its ``replay`` switch and ``agreement``; None for a dense model)."""

    bf16: bool
    routing_shape: RoutingShape | None
    routing: Any

    def __init__(self, model_cfg: ModelConfig, optim_cfg: OptimConfig, *, env: DistEnv,
                 total_updates: int | None) -> None:
        self.cfg, self.optim_cfg, self.env = model_cfg, optim_cfg, env
        self.source = Path(model_cfg.path)
        self.device = env.device()
        self.total_updates, self.updates = total_updates, 0

    # -- compute ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def logprobs(self, batch: Any, *, grad: bool, entropy: bool = False, reference: bool = False,
                 support: bool = False) -> tuple:
        """``(logp [T], entropy [T] | None)`` of one packed micro-batch under the policy (or the reference); with
        ``support``, a third element: the batch's ``SupportLogprobs``, or None when it has no sampling supports."""

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of this rank's share of the global loss."""

    @abc.abstractmethod
    def set_gradient_sync(self, sync: bool) -> None:
        """Whether this micro-batch's backward reduces gradients across ranks (the last of an update does)."""

    @abc.abstractmethod
    def optimizer_step(self) -> dict[str, float]:
        """Clip, step and zero the gradients: ``optim/grad_norm``, ``optim/lr``, ``optim/skipped``."""

    @abc.abstractmethod
    def routing_agreement(self) -> tuple[float, float]:
        """(pairs whose own top-k equals the stored one, pairs with stored routing) of the policy's forwards since
        the last call (train/routing.py); (0, 0) for a dense model or data without routing. Every rank calls it."""

    def set_routing_replay(self, on: bool) -> bool:
        """Force the stored routing in the policy's forwards from now on (or not); returns the previous setting.
        A dense model has nothing to replay: False."""
        if self.routing is None:
            return False
        previous, self.routing.replay = self.routing.replay, on
        return previous

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Token ids the model's embedding takes."""

    def lr(self, update: int | None = None) -> float:
        """The learning rate of update ``update`` (default: the next one) on the configured schedule."""
        o = self.optim_cfg
        total = o.decay_steps if o.decay_steps is not None else self.total_updates
        u = self.updates if update is None else update
        return o.lr * lr_factor(u, warmup=o.warmup_steps, total=total, decay=o.lr_decay, min_ratio=o.min_lr_ratio)

    # -- state -----------------------------------------------------------------------------------

    # True where :meth:`export_model` writes the weights exactly as held (every one, same names and values), so a
    # checkpoint keeps them once, in its model folder, and a resume builds the model from it (train/checkpoint.py).
    exports_held_weights: bool = False

    @abc.abstractmethod
    def save_state(self, folder: Path, *, weights: bool = True) -> None:
        """Optimizer state, and the weights unless ``weights`` is False, of every rank into a checkpoint folder."""

    @abc.abstractmethod
    def load_state(self, folder: Path, *, weights: bool = True) -> None:
        """Optimizer state, and the weights unless ``weights`` is False, from :meth:`save_state`'s folder."""

    @abc.abstractmethod
    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """A full (unsharded) optimizer state keyed by parameter name: checkpoints of format 1 (hf only)."""

    @abc.abstractmethod
    def export_model(self, folder: Path) -> None:
        """The engines' model folder (Hugging Face safetensors, the source's tokenizer and configs)."""
