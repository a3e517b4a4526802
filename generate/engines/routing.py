"""The embedded engine's capture of a MoE model's routing (schema 1.2 ``routed_experts``, store/format/routing.py).

A forward hook on each top-k router (:func:`rollshard.store.format.routing.find_routers`) keeps the expert ids it chose
for every token of the forward, prefill and decode alike; :meth:`RoutingCapture.take` hands them over as
``[tokens, layers, top_k]``, in the forward's token order (row-major over its ``[batch, sequence]`` input). The
hooks cost a copy of ``tokens x top_k`` ids per layer, and only in forwards run with :attr:`RoutingCapture.on`.
"""

from __future__ import annotations

import torch

from rollshard.store.format.routing import RoutingShape, RoutingShapeError, find_routers, shape_of_model_config


class RoutingCapture:
    """Hooks on the routers of ``model``. None on a dense model, nor on a MoE whose routing rollshard does not
    store (dense layers between the MoE ones, routers that do not return their top-k): :attr:`shape` is then None
    and :attr:`reason` says why (for a MoE); the model is served as before, without routing."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.reason: str | None = None
        try:
            self.shape: RoutingShape | None = shape_of_model_config(model.config)
        except RoutingShapeError as e:
            self.shape, self.reason = None, str(e)
        routers = find_routers(model) if self.shape is not None else []
        if self.shape is not None and len(routers) != self.shape.layers:
            self.reason = (f"{type(model).__name__} has {len(routers)} top-k routers for {self.shape.layers} MoE "
                           "layers; rollshard captures the routing of transformers MoE models whose every layer's "
                           "router returns its top-k ids")
            self.shape, routers = None, []
        self.on = False
        self._ids: list[torch.Tensor | None] = [None] * len(routers)
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, layer: int):
        def keep(module, inputs, output) -> None:
            if self.on:
                self._ids[layer] = output[-1].detach()  # [tokens, top_k]
        return keep

    def take(self) -> torch.Tensor:
        """``[tokens, layers, top_k]`` ids of the last forward, on the CPU in the dataset's integer type."""
        missing = [i for i, t in enumerate(self._ids) if t is None]
        if missing:
            raise RuntimeError(f"the forward ran no router of MoE layer {missing[0]}")
        ids = torch.stack(self._ids, dim=1)  # [tokens, layers, top_k]
        self._ids = [None] * len(self._ids)
        return ids.to("cpu", torch.uint8 if self.shape.experts <= 256 else torch.int32)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
