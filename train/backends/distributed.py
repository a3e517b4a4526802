"""Process-group setup for data parallelism under torchrun (NCCL on GPUs, gloo on CPU).

Without torchrun (no ``WORLD_SIZE`` in the environment, or 1) nothing is initialized
and every collective below is the identity, so single-process code needs no branches.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
from typing import Any

import torch
import torch.distributed as dist

# A collective that has not completed in this long means a rank died or diverged
# (different micro-batch counts); fail with a traceback rather than hang forever.
COLLECTIVE_TIMEOUT = dt.timedelta(minutes=30)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """Reduce a few Python numbers over the ranks (sum, max or min)."""
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device())
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        return t.tolist()

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's JSON-serializable ``obj``, in rank order (small objects: metrics, loader states)."""
        if not self.enabled:
            return [obj]
        data = json.dumps(obj).encode()
        dev = self.device()
        size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        width = int(max(s.item() for s in sizes))
        buf = torch.zeros(width, dtype=torch.uint8, device=dev)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
        bufs = [torch.zeros_like(buf) for _ in range(self.world_size)]
        dist.all_gather(bufs, buf)
        return [json.loads(bytes(b[: int(s.item())].cpu().tolist())) for b, s in zip(bufs, sizes)]

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def init_distributed() -> DistEnv:
    """Join the torchrun process group when launched by torchrun with more than one process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistEnv()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=COLLECTIVE_TIMEOUT)
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank)


def close_distributed(env: DistEnv) -> None:
    if env.enabled and dist.is_initialized():
        dist.destroy_process_group()
