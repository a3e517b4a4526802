"""Routing replay (R3) and the routing agreement on megatron-core MoE layers (train/routing.py describes both).

megatron-core 0.16.1's ``TopKRouter.routing`` hands its top-k step to ``router.router_replay.get_replay_topk(scores,
topk, num_groups, group_topk, default_compute_topk)`` when the router has a replay object
(``topk_routing_with_score_function``, moe_utils.py). Its own ``RouterReplay`` forces the target ids at *every*
token and keeps every instance ever built in one class-level list (the policy's and the reference's routers mixed).
So each router of a model gets a :class:`_ForcedTopK` of its own instead, holding no state but its model's
:class:`MegatronRouting`: it takes the router's own top-k (megatron's default step), counts the agreement with the
stored ids, and at valid positions replaces the ids with the stored ones and the values with the scores gathered at
them, as ``RouterReplay``'s ``REPLAY_FORWARD`` does. megatron then computes the gate weights from those exactly as
for its own top-k: with ``pre_softmax`` (no ``norm_topk_prob``) the softmax over every expert gathered at the forced
ids, else the softmax over the forced logits (= softmax-then-renormalize), with gradients reaching the router
through the gather. Replaying the router's own choice is bit for bit no replay; positions without stored routing
(a row's last, rows without routing) keep the router's own choice.

Token order: the backend runs ``[T, 1, H]`` (packed, batch 1), so router row ``r`` is packed token ``r``. Every
tensor-parallel rank routes all ``T`` tokens (no sequence parallelism) and takes the whole ``[T, k]``; under expert
parallelism (the allgather dispatcher routes each rank's own tokens before gathering them) each rank its own
micro-batch's; a pipeline stage holds global layers ``router.layer_number - 1`` and takes those columns.
Needs ``moe_router_fusion`` off (the fused kernel has no replay hook; the backend never turns it on).
"""

from __future__ import annotations

import torch

from rollshard.store.format.routing import RoutingShape
from rollshard.train.routing import RoutingReplayError, StoredRouting


def moe_routers(model) -> list:
    """This stage's top-k routers of ``model`` in global layer order (``layer_number`` is 1-based, global)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return sorted((m for m in model.modules() if isinstance(m, TopKRouter)), key=lambda r: r.layer_number)


class _ForcedTopK:
    """``router.router_replay`` of one router: megatron-core calls :meth:`get_replay_topk` for its top-k step."""

    def __init__(self, owner: "MegatronRouting", slot: int, layer: int):
        self.owner, self.slot, self.layer = owner, slot, layer

    def get_replay_topk(self, scores, topk, num_groups, group_topk, default_compute_topk):
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        return self.owner._force(self.slot, self.layer, scores, values, own)


class MegatronRouting(StoredRouting):
    """Routing replay and agreement on one megatron model's routers (the policy's or the reference's), this
    pipeline stage's layers. :meth:`set` before a forward gives the micro-batch's stored routing
    (``batch_routing``: ``ids [T, layers, k]`` over all layers, ``valid [T]``) or None; with :attr:`record`,
    :attr:`used` holds the ids each of this stage's layers dispatched to in the last forward (by global layer)."""

    def __init__(self, model, shape: RoutingShape, *, replay: bool):
        routers = moe_routers(model)
        layers = [r.layer_number - 1 for r in routers]
        if not routers or any(r.topk != shape.top_k or r.config.num_moe_experts != shape.experts for r in routers) \
                or layers != list(range(layers[0], layers[0] + len(layers))) or layers[-1] >= shape.layers:
            raise RoutingReplayError(
                f"the megatron model's routers (layers {layers}) do not route top-{shape.top_k} of {shape.experts} "
                f"experts in {shape.layers} MoE layers as the model's config.json says"
            )
        if any(r.config.moe_router_fusion for r in routers):
            raise RoutingReplayError("routing replay needs moe_router_fusion off (the fused top-k has no replay hook)")
        super().__init__(len(routers), replay=replay)
        self.shape, self.layers = shape, layers
        self.record = False
        self.used: dict[int, torch.Tensor] = {}  # global layer -> [T, k] ids dispatched to (with record)
        for slot, (router, layer) in enumerate(zip(routers, layers)):
            router.router_replay = _ForcedTopK(self, slot, layer)

    def set(self, routing: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        if routing is not None:
            ids, valid = routing
            if ids.shape[1:] != (self.shape.layers, self.shape.top_k) or valid.shape != ids.shape[:1]:
                raise RoutingReplayError(f"stored routing of shape {tuple(ids.shape)} for {self.shape}")
        super().set(routing)

    def _force(self, slot: int, layer: int, scores: torch.Tensor, values: torch.Tensor, own: torch.Tensor):
        idx = self.choose(slot, layer, own)
        if idx is None:
            idx = own
        else:
            values = scores.gather(1, idx)  # RouterReplay's REPLAY_FORWARD: the scores at the forced ids
        if self.record:
            self.used[layer] = idx.detach()
        return values, idx
