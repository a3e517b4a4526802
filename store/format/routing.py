"""Schema 1.2: the mixture-of-experts routing of each row (routing replay, R3), its shape and its checks.

A row of a MoE model may store, for every position the engine forwarded, each MoE layer's top-k expert ids:
``routed_experts``, the bytes of a C-order ``[positions, layers, top_k]`` array, ``uint8`` when the model has
at most 256 experts, else little-endian ``uint16``. The positions are the prompt's and the response's but the
last response token (which no forward fed: SGLang's ``len(tokens) - 1``), so a row of ``P`` prompt and ``R``
response tokens stores ``P + R - 1`` positions. The shape is the dataset's: its run config's
``routed_experts`` entry (:class:`RoutingShape`: layers, top_k, experts) names it, and every shard of the
dataset carries that config in its metadata.

Why bytes and not a nested or flat list of integers (``tests/bench/bench_routing.py``, Qwen3-30B-A3B's
48 layers x top-8 of 128 experts): Parquet has no 8-bit integer, so a ``list<uint8>`` is stored as 32-bit
integers, dictionary- or zstd-coded; the bytes, zstd-coded, take fewer bytes on disk than either and are read
into numpy without a per-value decode (the README's Performance pages give the figures).

Invariants of a row with routing (:func:`routing_problems`): its byte length is ``(P + R - 1) x layers x top_k``
ids; every id is below ``experts``; and the ``top_k`` ids of one (position, layer) are distinct (a top-k never
picks an expert twice). With ``top_k > 1`` a top-k of all zeros is named apart: slime's check for a layer the
capture never wrote (top-1 routing may send every token to expert 0, and is not held to it).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa

ROUTING_COLUMN = "routed_experts"
CONFIG_KEY = "routed_experts"  # the run config's entry: {"layers": L, "top_k": K, "experts": E}


class RoutingShapeError(ValueError):
    """A routing shape (run config entry or a model's config) that rollshard cannot use."""


@dataclasses.dataclass(frozen=True, slots=True)
class RoutingShape:
    """The routing a dataset stores: ``top_k`` of ``experts`` ids for each of ``layers`` MoE layers."""

    layers: int
    top_k: int
    experts: int

    def __post_init__(self) -> None:
        for name in ("layers", "top_k", "experts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RoutingShapeError(f"routing {name} must be a positive integer, got {value!r}")
        if self.top_k > self.experts:
            raise RoutingShapeError(f"routing top_k {self.top_k} exceeds its {self.experts} experts")
        if self.experts > 1 << 16:
            raise RoutingShapeError(f"routing of {self.experts} experts: at most 65536 are stored")

    @property
    def dtype(self) -> np.dtype:
        """The smallest unsigned type that holds every expert id (little-endian)."""
        return np.dtype(np.uint8) if self.experts <= 256 else np.dtype("<u2")

    @property
    def width(self) -> int:
        """Ids per position: layers x top_k."""
        return self.layers * self.top_k

    @property
    def bytes_per_position(self) -> int:
        return self.width * self.dtype.itemsize

    def to_config(self) -> dict[str, int]:
        return {"layers": self.layers, "top_k": self.top_k, "experts": self.experts}

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> "RoutingShape | None":
        """The shape a run config names (its ``routed_experts`` entry), or None when it names none."""
        entry = (config or {}).get(CONFIG_KEY)
        if entry is None:
            return None
        if not isinstance(entry, dict) or set(entry) != {"layers", "top_k", "experts"}:
            raise RoutingShapeError(
                f"run config entry {CONFIG_KEY!r} is {entry!r}; expected {{'layers', 'top_k', 'experts'}} integers"
            )
        return cls(**entry)

    def encode(self, ids: np.ndarray) -> bytes:
        """``[positions, layers, top_k]`` (or ``[positions, layers x top_k]``, as an SGLang client without the
        model's config holds them) ids -> the column's bytes (checked to fit the shape and the type)."""
        ids = np.asarray(ids)
        if ids.ndim == 2 and ids.shape[1] == self.width:
            ids = ids.reshape(-1, self.layers, self.top_k)
        if ids.ndim != 3 or ids.shape[1:] != (self.layers, self.top_k):
            raise RoutingShapeError(
                f"routed experts of shape {tuple(ids.shape)}; this dataset stores [positions, {self.layers}, "
                f"{self.top_k}]"
            )
        if ids.size and (ids.min() < 0 or ids.max() >= self.experts):
            raise RoutingShapeError(f"routed expert ids must lie in [0, {self.experts}), got {ids.min()}..{ids.max()}")
        return np.ascontiguousarray(ids, dtype=self.dtype).tobytes()

    def decode(self, data: bytes | memoryview | np.ndarray) -> np.ndarray:
        """The column's bytes -> ``[positions, layers, top_k]`` ids (a view, no copy)."""
        flat = np.frombuffer(data, self.dtype) if not isinstance(data, np.ndarray) else data.view(self.dtype)
        if flat.size % self.width:
            raise RoutingShapeError(f"{flat.size} routed expert ids are not a whole number of positions of "
                                    f"{self.layers} layers x top-{self.top_k}")
        return flat.reshape(-1, self.layers, self.top_k)


def positions(prompt_len: int | np.ndarray, response_len: int | np.ndarray):
    """Positions a row's routing covers: prompt and response but the last response token (at least 0)."""
    return np.maximum(np.asarray(prompt_len) + np.asarray(response_len) - 1, 0)


def shape_of_model_config(config: Any) -> RoutingShape | None:
    """The routing shape of a transformers model config (an object or its ``config.json`` dict): every layer
    a top-k MoE (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE style), or None for a dense model.

    A model with dense layers between its MoE ones (``decoder_sparse_step`` > 1, ``mlp_only_layers``,
    ``first_k_dense_replace``) is refused: its layers would not all be routed, and the engines differ in
    whether they count the dense ones."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    experts = get("num_experts") or get("num_local_experts") or get("n_routed_experts")
    top_k = get("num_experts_per_tok")
    if not experts or not top_k:
        return None
    if (get("decoder_sparse_step", 1) or 1) != 1 or get("mlp_only_layers") or get("first_k_dense_replace"):
        raise RoutingShapeError(
            f"model type {get('model_type')!r} has dense layers between its MoE layers (decoder_sparse_step, "
            "mlp_only_layers or first_k_dense_replace); rollshard stores routing for models whose every layer is MoE"
        )
    return RoutingShape(layers=int(get("num_hidden_layers")), top_k=int(top_k), experts=int(experts))


def shape_of_model_folder(folder: str | Path) -> RoutingShape | None:
    """:func:`shape_of_model_config` of a model folder's ``config.json`` (its ``text_config`` for a multimodal
    one); :class:`RoutingShapeError` for a folder without a readable one."""
    path = Path(folder) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RoutingShapeError(f"cannot read {path}: {e}") from e
    return shape_of_model_config(data.get("text_config", data) if isinstance(data, dict) else {})


def flat_bytes(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A binary column's bytes (flat uint8, no copy for one chunk), its ``[rows + 1]`` offsets from 0 and
    ``[rows]`` validity."""
    arr = col if isinstance(col, pa.Array) else (col.chunk(0) if col.num_chunks == 1 else col.combine_chunks())
    if len(arr) == 0:
        return np.zeros(0, np.uint8), np.zeros(1, np.int64), np.zeros(0, bool)
    offsets = np.frombuffer(arr.buffers()[1], np.int32, len(arr) + 1, arr.offset * 4).astype(np.int64)
    data = arr.buffers()[2]
    values = np.frombuffer(data, np.uint8)[offsets[0] : offsets[-1]] if data is not None else np.zeros(0, np.uint8)
    valid = ~arr.is_null().to_numpy(zero_copy_only=False)
    return values, offsets - offsets[0], valid


def routing_problems(
    routed: pa.ChunkedArray,
    prompt_lens: np.ndarray,
    response_lens: np.ndarray,
    shape: RoutingShape | None,
    add: Callable[[np.ndarray | list[int], str, Callable[[int], str]], None],
) -> None:
    """Report (through ``add(rows, field, detail_of_row)``) every row whose ``routed_experts`` breaks an
    invariant of the module docstring. ``prompt_lens``, ``response_lens``: ``[rows]`` token counts."""
    if routed.null_count == len(routed):
        return
    data, off, valid = flat_bytes(routed)
    if shape is None:
        add(np.flatnonzero(valid), ROUTING_COLUMN, lambda i: (
            f"is present, but the dataset's run config names no routing shape ({CONFIG_KEY!r}: layers, top_k, "
            "experts); write routing through a writer whose config carries it"))
        return
    n_pos = positions(prompt_lens, response_lens).astype(np.int64)  # [rows]
    want = n_pos * shape.bytes_per_position
    got = np.diff(off)
    bad_len = valid & (got != want)
    add(np.flatnonzero(bad_len), ROUTING_COLUMN, lambda i: (
        f"holds {got[i]} bytes; {n_pos[i]} positions (prompt + response - 1) x {shape.layers} layers x top-"
        f"{shape.top_k} x {shape.dtype.itemsize} byte(s) is {want[i]}"))
    ok = valid & ~bad_len  # [rows] checked id by id
    if not ok.any():
        return
    keep = np.repeat(ok, got)  # [bytes]
    ids = (data if ok.all() else data[keep]).view(shape.dtype).reshape(-1, shape.layers, shape.top_k)  # [N, L, K]
    pos_rows = np.repeat(np.flatnonzero(ok), n_pos[ok])  # [N] row of each position

    def rows_of(bad_pos: np.ndarray) -> list[int]:
        return sorted(set(pos_rows[bad_pos].tolist()))

    if ids.size and int(ids.max()) >= shape.experts:
        bad = (ids >= shape.experts).any(axis=(1, 2))
        add(rows_of(np.flatnonzero(bad)[:1000]), ROUTING_COLUMN, lambda i: (
            f"holds an expert id >= {shape.experts}, the model's expert count"))
    if shape.top_k > 1 and ids.size:
        # A top-k of zeros is slime's check for a layer the capture never wrote (a top-k > 1 of real routing cannot be
        # all one expert); other repeats are a broken top-k. Top-1 routing may well send every token to expert 0.
        zeros = ~ids.any(axis=-1)  # [N, L]
        s = np.sort(ids, axis=-1)
        twice = ((s[..., 1:] == s[..., :-1]).any(axis=-1) & ~zeros).any(axis=1)  # [N]
        for bad, detail in ((zeros.any(axis=1), "has a top-k of all expert 0 at a position and layer: the routing was "
                             "not captured there"),
                            (twice, "names one expert twice in a top-k of one position and layer; a top-k picks "
                             "distinct experts")):
            if bad.any():
                add(rows_of(np.flatnonzero(bad)[:1000]), ROUTING_COLUMN, lambda i, detail=detail: detail)


def find_routers(model: Any) -> list[Any]:
    """The top-k routers of a transformers MoE model, in layer order: the submodules named ``*TopKRouter`` with
    ``top_k`` and ``num_experts`` (transformers 5.x: ``forward(hidden) -> (logits, scores, indices)``). Empty for a
    dense model."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k") and hasattr(m, "num_experts")]
