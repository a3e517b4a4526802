"""Routing replay (R3) from the dataset: the trainer's MoE layers use the experts the engine chose.

A row of a MoE model may store its routing (schema 1.2 ``routed_experts``, store/format/routing.py): each MoE layer's
top-k expert ids at every position the engine forwarded. The loader packs them per micro-batch
(``PackedBatch.routed_experts [T, layers x top_k]``, ``routed_valid [T]``: a row's last position, which no
engine forward fed, and rows without routing are not valid). With replay on, each router's top-k at a valid
position is replaced by the stored one; the gate weights are still the router's, computed over the forced set
(Qwen3-MoE and Mixtral: the softmax over every expert gathered at the forced ids, renormalized over them when the
router renormalizes its top-k), so gradients reach the router. Elsewhere the router's own choice stands: nothing
scored depends on a row's last position.

``--routing-replay auto|on|off``: auto forces the stored routing wherever a batch has it; on also refuses at
start a dense model, a MoE it cannot replay and a dataset without routing, and any trained row without routing
(one line naming the row); off never forces. In every mode, a batch with routing measures the **routing agreement**: the share of (valid
position, MoE layer) pairs where the trainer's own top-k set equals the stored one (``routing/agreement`` in the
step metrics: the forwards the loss is computed on, each micro-batch once; and the audit, without replay). Under
replay each layer's own top-k is taken on the output of the layers before it, which ran the stored experts.

:class:`StoredRouting` holds what both backends share (the micro-batch's stored routing, the replay switch, the
agreement); :class:`HFRouting` applies it to transformers models by wrapping each top-k router's ``forward``, the
megatron backend through the replay hook of megatron-core's routers (train/backends/megatron/routing.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rollshard.store.format.routing import RoutingShape, RoutingShapeError, find_routers, shape_of_model_folder


class RoutingReplayError(ValueError):
    """Routing replay cannot run as asked (a dense model, a row without routing, another routing shape)."""


def model_routing(model_path: str | Path) -> RoutingShape | None:
    """The routing shape of the model folder's ``config.json`` (None: a dense model, or a folder without a readable
    config, which the backend's own loading names)."""
    try:
        return shape_of_model_folder(model_path)
    except RoutingShapeError as e:
        if not (Path(model_path) / "config.json").is_file():
            return None
        raise RoutingReplayError(str(e)) from e


# transformers routers whose gate math HFRouting reproduces over a forced set: the softmax over every expert, the
# top-k of it, renormalized over the k when the router does (Mixtral always; the others with norm_topk_prob).
REPLAYABLE_ROUTERS = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "OlmoeTopKRouter", "MixtralTopKRouter")


def replay_shape(model_path: str | Path, mode: str) -> RoutingShape | None:
    """The routing shape a backend replays: the model's; None for a dense model, and under ``auto``/``off`` for a
    MoE whose routing rollshard does not replay (dense layers between the MoE ones), which ``on`` refuses in one
    line."""
    try:
        shape = model_routing(model_path)
    except RoutingReplayError as e:
        if mode == "on":
            raise RoutingReplayError(f"--routing-replay on: {e}") from e
        return None
    check_mode(mode, shape, str(model_path))
    return shape


def reads_routing(model_path: str | Path) -> bool:
    """Whether a trainer of this model reads the rows' stored routing: a MoE model, in every mode (off measures
    the agreement); a model the backend will refuse reads none (the backend says why)."""
    try:
        return model_routing(model_path) is not None
    except RoutingReplayError:
        return False


def check_mode(mode: str, shape: RoutingShape | None, model_path: str) -> None:
    if mode == "on" and shape is None:
        raise RoutingReplayError(
            f"--routing-replay on: model {model_path} is not a mixture of experts (its config.json names no "
            "num_experts and num_experts_per_tok); use --routing-replay auto or off"
        )


def check_datasets(datasets: list[Any] | None, shape: RoutingShape | None, mode: str = "auto") -> None:
    """Refuse a dataset whose rows store the routing of another model (another layer count, top-k or expert count
    in its run config) than the MoE model trained, and under mode ``on`` one whose writers stored none (a dataset
    being written, with no writer yet, is judged by its rows); a dense model ignores stored routing."""
    if shape is None:
        return
    for ds in datasets or []:
        try:
            shapes = [RoutingShape.from_config(m.config) for m in ds.manifests]
        except RoutingShapeError as e:
            raise RoutingReplayError(f"dataset {ds.storage.uri}: {e}") from e
        if mode == "on" and shapes and not any(shapes):
            raise RoutingReplayError(
                f"--routing-replay on: dataset {ds.storage.uri} stores no routed experts (its run config names no "
                "routed_experts); generate it with --routed-experts on, or use --routing-replay auto or off"
            )
        for stored in shapes:
            if stored is not None and stored != shape:
                raise RoutingReplayError(
                    f"dataset {ds.storage.uri} stores the routing of {stored.layers} layers x top-{stored.top_k} of "
                    f"{stored.experts} experts; the model routes {shape.layers} x top-{shape.top_k} of "
                    f"{shape.experts}: train the model that generated it"
                )


def batch_routing(batch: Any, shape: RoutingShape, mode: str, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(ids [T, layers, top_k] int64, valid [T] bool)`` of a micro-batch on ``device``, or None without routing
    (refused under mode ``on``)."""
    ids = batch.routed_experts
    if ids is None:
        if mode == "on" and batch.num_loss_tokens:  # (a rank's dummy batch trains nothing)
            raise RoutingReplayError(
                f"--routing-replay on: row {batch.sample_ids[0]!r} has no routed experts; generate the dataset with "
                "--routed-experts on (an SGLang server with --enable-return-routed-experts), or use --routing-replay "
                "auto (replay where stored) or off"
            )
        return None
    if ids.shape[1] != shape.width:
        raise RoutingReplayError(
            f"row {batch.sample_ids[0]!r} stores {ids.shape[1]} expert ids per position; the model routes "
            f"{shape.layers} layers x top-{shape.top_k} = {shape.width}: the dataset is of another model"
        )
    if mode == "on":  # every row trained on replays: one without routing among rows with it is refused too
        cu = batch.cu_seqlens.long().cpu()
        bare = torch.nonzero((_per_sequence(batch.routed_valid, cu) == 0) & (_per_sequence(batch.loss_mask, cu) > 0))
        if bare.numel():
            raise RoutingReplayError(
                f"--routing-replay on: row {batch.sample_ids[int(bare[0])]!r} has no routed experts; generate the "
                "dataset with --routed-experts on (an SGLang server with --enable-return-routed-experts), or use "
                "--routing-replay auto (replay where stored) or off"
            )
    if ids.numel() and ids.device.type == "cpu" and int(ids.max()) >= shape.experts:  # (the loader's batches are)
        raise RoutingReplayError(
            f"row {batch.sample_ids[0]!r} stores expert ids up to {int(ids.max())}; the model has {shape.experts} "
            "experts: the dataset is of another model"
        )
    return (ids.to(device=device, dtype=torch.long).view(-1, shape.layers, shape.top_k),
            batch.routed_valid.to(device))


def _per_sequence(values: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """``[T]`` -> ``[S]``: the sum of each packed sequence's values (``cu``: its ``[S+1]`` boundaries)."""
    total = F.pad(values.double().cpu().cumsum(0), (1, 0))  # [T + 1]
    return total[cu[1:]] - total[cu[:-1]]


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[..., k]`` x2 -> ``[...]`` bool: the two top-k hold the same experts (in any order)."""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


class Agreement:
    """Running count of (position, layer) pairs whose own top-k equals the stored one."""

    def __init__(self) -> None:
        self.same = 0.0
        self.pairs = 0.0

    def add(self, own: torch.Tensor, stored: torch.Tensor, valid: torch.Tensor) -> None:  # [T, K], [T, K], [T]
        self.same += float((same_sets(own, stored) & valid).sum())
        self.pairs += float(valid.sum())

    def take(self) -> tuple[float, float]:
        out = (self.same, self.pairs)
        self.same = self.pairs = 0.0
        return out


class StoredRouting:
    """What both backends' replays share: :meth:`set` before a forward gives the micro-batch's stored routing
    (:func:`batch_routing`, or None); it stays in force until the next call (a checkpointed layer's recomputation in
    backward sees it too). Each router's top-k step asks :meth:`choose` for its experts."""

    def __init__(self, slots: int, *, replay: bool = True) -> None:
        self.replay = replay
        self.agreement = Agreement()
        self._batch: tuple[torch.Tensor, torch.Tensor] | None = None
        self._counted = [False] * slots  # per router: its agreement counted in this forward

    def set(self, routing: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self._batch = routing
        self._counted = [False] * len(self._counted)

    def choose(self, slot: int, layer: int, own: torch.Tensor) -> torch.Tensor | None:
        """The expert ids ``[T, k]`` MoE layer ``layer`` (this model's router ``slot``) is to use: the stored ones at
        the positions that have them and ``own`` (the router's top-k) elsewhere; None when nothing is stored or
        replay is off (the router's own stand). The agreement of ``own`` with the stored ids is counted once per
        forward."""
        if self._batch is None:
            return None
        ids, valid = self._batch
        stored = ids[:, layer]  # [T, k]
        if stored.shape[0] != own.shape[0]:
            raise RoutingReplayError(f"MoE layer {layer} routes {own.shape[0]} tokens; the batch stores routing for "
                                     f"{stored.shape[0]}")
        if not self._counted[slot]:
            self.agreement.add(own, stored, valid)
            self._counted[slot] = True
        return torch.where(valid[:, None], stored, own) if self.replay else None


class HFRouting(StoredRouting):
    """Routing replay and agreement on a transformers MoE model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, shape: RoutingShape) -> None:
        routers = find_routers(model)
        if len(routers) != shape.layers or any(r.top_k != shape.top_k or r.num_experts != shape.experts
                                                for r in routers):
            raise RoutingReplayError(
                f"{type(model).__name__}: {len(routers)} top-k routers found for {shape.layers} MoE layers of top-"
                f"{shape.top_k} of {shape.experts} experts; rollshard replays routing on transformers MoE models "
                "whose routers (*TopKRouter) return their top-k ids"
            )
        other = sorted({type(r).__name__ for r in routers} - set(REPLAYABLE_ROUTERS))
        if other:
            raise RoutingReplayError(
                f"{type(model).__name__}'s routers ({', '.join(other)}) compute their gate weights in a way routing "
                f"replay does not reproduce; it replays {', '.join(REPLAYABLE_ROUTERS)}"
            )
        super().__init__(len(routers))
        self.shape = shape
        for layer, router in enumerate(routers):
            router.forward = self._wrap(router, router.forward, layer)

    def _wrap(self, router: torch.nn.Module, forward, layer: int):
        renormalize = bool(getattr(router, "norm_topk_prob", True))  # Mixtral always renormalizes its top-k

        def replayed(hidden_states: torch.Tensor):
            logits, scores, own = forward(hidden_states)
            idx = self.choose(layer, layer, own)
            if idx is None:
                return logits, scores, own
            weights = F.softmax(logits, dim=-1, dtype=torch.float).gather(-1, idx)  # as the router: over every expert
            if renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(scores.dtype), idx

        return replayed
