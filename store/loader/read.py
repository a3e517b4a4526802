"""Reading one block: column projection, the row checks, and the columns as numpy arrays.

The filter columns are read first, the token columns only when some row passes the status and agent
filters; a shard that has the schema 1.1 sampling columns has them read with the token columns (a 1.0
shard is read as before). With ``verify_data``, every block read has the row invariants of store/format/invariants.py
checked on the columns read (:func:`~rollshard.store.format.invariants.check_projection`: logprobs finite and <= 0
under the mask, lengths aligned, token ids non-negative, a known status, ...) before anything is built
from them; a break is a :class:`~rollshard.store.common.DataError` naming the shard, the row groups and
the sample.

**Order.** A block's groups are taken in ``group_id`` order and a group's rows in ``sample_id`` order, not
in the order the engine finished them (the file's): two generations of the same rows, whose shards differ only
in that order, give the same steps. The follow loader and a loader resuming a version-2 state keep the file's
order (``sort=False``), the order their cursors were counted in.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rollshard.store.common import DataError, one_line
from rollshard.store.io.integrity import VALIDATE, check_rows, sampling_columns
from rollshard.store.loader.blocks import Block
from rollshard.store.loader.config import SMALL_COLUMNS, SPAN_COLUMNS, TOKEN_COLUMNS
from rollshard.store.loader.filters import Filters, oldest_versions
from rollshard.store.format.routing import ROUTING_COLUMN, RoutingShape, flat_bytes
from rollshard.store.format.schema import config_of


def _single(col: pa.ChunkedArray) -> pa.Array:
    return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()


def _bool(arr: pa.Array) -> np.ndarray:
    return arr.fill_null(False).to_numpy(zero_copy_only=False)


class BlockData:
    """One block in memory: the filter columns as numpy, token columns as flat values + offsets."""

    shard: int = -1  # index in dataset.shards (-1: read outside a loader)
    checks: list = []  # the checks of its bytes (store/io/integrity.py Job) a step drawing from it waits for

    def __init__(self, small: pa.Table, filters: Filters, sort: bool = True):
        group_id = _single(small.column("group_id"))
        if sort:  # groups in group_id order, a group's rows in sample_id order: not the order the rows finished in
            keys = pa.table({"g": group_id, "s": _single(small.column("sample_id"))})
            order = pc.sort_indices(keys, sort_keys=[("g", "ascending"), ("s", "ascending")]).to_numpy()
            group_id = group_id.take(order)
        enc = pc.dictionary_encode(group_id)  # codes in order of first appearance (ascending, sorted)
        codes = enc.indices.to_numpy()
        self.group_ids: list[str] = enc.dictionary.to_pylist()
        if not sort:
            order = np.argsort(codes, kind="stable")
        self.group_rows = np.split(order, np.cumsum(np.bincount(codes, minlength=len(self.group_ids)))[:-1])
        self.pass_status = _bool(pc.is_in(_single(small.column("status")), value_set=filters.statuses))
        self.pass_agent = None
        if filters.agents is not None:
            self.pass_agent = _bool(pc.is_in(_single(small.column("agent")), value_set=filters.agents))
        # [rows] each row's oldest policy version (NO_VERSION: unknown); what the staleness filter compares (it
        # refuses a version that is no integer) and what the trainer's staleness figures count
        self.oldest = oldest_versions(small, strict=filters.staleness)
        self.version = self.oldest if filters.staleness else None
        self.reward = small.column("reward").to_numpy().astype(np.float32)  # null (failed rows) -> NaN
        self.temperature = small.column("temperature").to_numpy().astype(np.float32)  # null -> NaN
        self.sample_id: list[str] = small.column("sample_id").to_pylist()
        self.agent: list[str] = small.column("agent").to_pylist()
        self.weight_version: list[str | None] = small.column("weight_version").to_pylist()
        passing = self.pass_status if self.pass_agent is None else self.pass_status & self.pass_agent
        self.needs_tokens = bool(passing.any())
        self.tokens: dict[str, tuple[np.ndarray, np.ndarray]] | None = None
        self.support: tuple[np.ndarray, ...] | None = None
        # schema 1.2 with LoaderConfig.routed_experts: (bytes, offsets [rows + 1], valid [rows]) and their shape
        self.routing: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.routing_shape: RoutingShape | None = None

    def set_tokens(self, table: pa.Table) -> None:
        self.tokens = {}
        for name in TOKEN_COLUMNS:
            arr = _single(table.column(name))
            self.tokens[name] = (arr.values.to_numpy(), arr.offsets.to_numpy())
        self.support = None  # (has [rows], ids [n], id offsets [tokens + 1], token offsets [rows + 1]) of 1.1 shards
        if "sampling_support" in table.column_names and table.column("sampling_support").null_count < table.num_rows:
            sup, lp = _single(table.column("sampling_support")), _single(table.column("sampling_logprobs"))
            self.tokens["sampling_logprobs"] = (lp.values.to_numpy(zero_copy_only=False), lp.offsets.to_numpy())
            inner = sup.values  # [tokens] one support per token (the offsets below index it as they are)
            self.support = (sup.is_valid().to_numpy(zero_copy_only=False), inner.values.to_numpy(),
                            inner.offsets.to_numpy(), sup.offsets.to_numpy())

    def set_routing(self, table: pa.Table, shape: RoutingShape | None) -> None:
        column = table.column(ROUTING_COLUMN) if ROUTING_COLUMN in table.column_names else None
        if shape is not None and column is not None and column.null_count < table.num_rows:
            self.routing, self.routing_shape = flat_bytes(column), shape

    def row_routing(self, row: int) -> np.ndarray | None:
        """The row's routed experts as ``[positions, layers x top_k]`` ids (a view of the block's bytes), or None."""
        if self.routing is None or not self.routing[2][row]:
            return None
        data, off, _ = self.routing
        shape = self.routing_shape
        return data[off[row] : off[row + 1]].view(shape.dtype).reshape(-1, shape.width)

    def row_tokens(self, name: str, row: int) -> np.ndarray:
        values, offsets = self.tokens[name]
        return values[offsets[row] : offsets[row + 1]]

    def row_support(self, row: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The row's support as (ids [n] int32, size of each token's support [R] int64), or None without one."""
        if self.support is None or not self.support[0][row]:
            return None
        _, ids, id_off, tok_off = self.support
        bounds = id_off[tok_off[row] : tok_off[row + 1] + 1]  # [R + 1]
        return ids[bounds[0] : bounds[-1]], np.diff(bounds).astype(np.int64)

    def row_support_lists(self, row: int) -> list[list[int]] | None:
        """The row's support as one list of ids per token (HF examples), or None."""
        sup = self.row_support(row)
        if sup is None:
            return None
        ids, sizes = sup
        return [a.tolist() for a in np.split(ids, np.cumsum(sizes)[:-1])] if len(sizes) else []



def read_block(pf: pq.ParquetFile, block: Block, filters: Filters, shard: str, check: bool = True,
               sort: bool = True) -> BlockData:
    """Column projection: the filter columns first, the token columns only when some row passes.

    With ``check``, the rows read are checked (:func:`rollshard.store.io.integrity.check_rows`) before
    anything is built from them; ``shard`` (dataset-relative path) names the block in errors. With ``sort``,
    the block's groups are in ``group_id`` order and each group's rows in ``sample_id`` order (else in the
    order of the file, the order an engine finished them in).
    """
    rgs = list(block.row_groups)
    where = f"{shard} (row group{'s' * (len(rgs) > 1)} {', '.join(map(str, rgs))})"
    try:
        small = _one_chunk(pf.read_row_groups(rgs, columns=SMALL_COLUMNS + SPAN_COLUMNS))
        tokens = None
        routing = None
        if _passes(small, filters).any():  # the sampling columns only from a shard that has them (not a 1.0 one)
            token_columns = TOKEN_COLUMNS + sampling_columns(pf.schema_arrow, shard)
            if filters.routing and pf.schema_arrow.get_field_index(ROUTING_COLUMN) >= 0:
                token_columns.append(ROUTING_COLUMN)
                routing = _routing_shape(pf, where)
            tokens = _one_chunk(pf.read_row_groups(rgs, columns=token_columns))
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{where}: not readable: {one_line(e)}") from e
    if check:  # one check of the columns read (a block none of whose rows passes reaches no step)
        columns = {**{n: small.column(n) for n in SMALL_COLUMNS}, **({} if tokens is None else
                   {n: tokens.column(n) for n in tokens.column_names})}
        check_rows(pa.table(columns), where, routing)
    try:
        data = BlockData(small, filters, sort)
    except DataError:
        raise
    except ValueError as e:  # a weight_version the staleness filter cannot read: name the block
        raise DataError(f"{where}: {e}") from e
    assert data.needs_tokens == (tokens is not None)
    if tokens is not None:
        data.set_tokens(tokens)
        data.set_routing(tokens, routing)
    return data


def _routing_shape(pf: pq.ParquetFile, where: str) -> RoutingShape | None:
    """The routing shape a shard's run config names (its routed_experts column is read against it)."""
    try:
        return RoutingShape.from_config(config_of(pf.schema_arrow.metadata))
    except ValueError as e:
        raise DataError(f"{where}: {e}; {VALIDATE}") from e


def _one_chunk(table: pa.Table) -> pa.Table:
    """Each column in one chunk (a block of several row groups reads as several), so that the checks and
    the token arrays below see flat buffers without copying twice."""
    return pa.table({n: _single(table.column(n)) for n in table.column_names})


def _passes(small: pa.Table, filters: Filters) -> np.ndarray:
    """[rows] whether a row passes the status and agent filters (those that decide whether tokens are read)."""
    ok = _bool(pc.is_in(_single(small.column("status")), value_set=filters.statuses))
    if filters.agents is not None:
        ok &= _bool(pc.is_in(_single(small.column("agent")), value_set=filters.agents))
    return ok

