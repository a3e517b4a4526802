"""Parallel state for the megatron backend: megatron-core's tensor / pipeline / expert / data-parallel groups
over the torchrun world, and the trainer's view of it (:class:`ParallelEnv`).

``world = tp x pp x dp`` (ranks in megatron's order, tensor-parallel fastest). The trainer sees only the
data-parallel dimension: its loader splits the data by data-parallel rank (every rank of one
tensor/pipeline group reads the same share), its normalizers and metrics are reduced over the
data-parallel group (the model-parallel ranks of a group hold one replica of the loss), and the
checkpoint's world size is the data-parallel size. Logging and publishing checkpoints stay with global
rank 0, and barriers span the whole world.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch
import torch.distributed as dist

from rollshard.train.backends.distributed import DistEnv


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelEnv(DistEnv):
    """A :class:`DistEnv` whose rank and world size are the data-parallel ones."""

    global_rank: int = 0
    global_world: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def is_main(self) -> bool:
        return self.global_rank == 0

    def _group(self):
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device())
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        dist.all_reduce(t, op=ops[op], group=self._group())
        return t.tolist()

    def all_gather_json(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        data = json.dumps(obj).encode()
        dev, group = self.device(), self._group()
        size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=group)
        buf = torch.zeros(int(max(s.item() for s in sizes)), dtype=torch.uint8, device=dev)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
        bufs = [torch.zeros_like(buf) for _ in range(self.world_size)]
        dist.all_gather(bufs, buf, group=group)
        return [json.loads(bytes(b[: int(s.item())].cpu().tolist())) for b, s in zip(bufs, sizes)]

    def barrier(self) -> None:
        if self.global_world > 1:
            dist.barrier()


def init_parallel(env: DistEnv, *, tp: int, pp: int, ep: int) -> ParallelEnv:
    """megatron-core's groups over the world of ``env`` (one process: a gloo world of one, which megatron-core
    needs for its groups); ValueError (one line) when the world does not split into ``tp x pp``."""
    import os

    from rollshard.train.backends.megatron import compat

    world = env.world_size
    if world % (tp * pp) or (world // (tp * pp)) * tp % ep:
        raise ValueError(
            f"{world} processes do not split into --tp {tp} x --pp {pp} (x --ep {ep} experts): launch a multiple of "
            f"{tp * pp} processes with torchrun, or change --tp/--pp/--ep"
        )
    compat.quiet()
    compat.apply()
    if not dist.is_initialized():  # one process: megatron-core still builds its groups on a process group
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend, rank=0, world_size=1)
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
        )
    compat.init_rng_tracker()
    return ParallelEnv(
        rank=ps.get_data_parallel_rank(),
        world_size=ps.get_data_parallel_world_size(),
        local_rank=env.local_rank,
        global_rank=dist.get_rank(),
        global_world=dist.get_world_size(),
        tp=tp,
        pp=pp,
        ep=ep,
    )


def close_parallel() -> None:
    """megatron-core's groups, then the process group (torchrun's, or the one-process one :func:`init_parallel`
    made)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
