"""The row invariants of :data:`~rollshard.store.format.schema.ROW_SCHEMA`: every break of a table, one
:class:`~rollshard.store.format.schema.Problem` each, naming the sample and the field.

Invariants (DESIGN.md "The row"):

* ``len(rollout_logprobs) == len(loss_mask) == len(response_tokens)``;
* every logprob under ``loss_mask == 1`` is finite and ``<= 0``; under
  ``loss_mask == 0`` it is exactly ``0.0`` (tool/environment tokens have no engine
  logprob); mask values are 0 or 1;
* token ids are non-negative (int32 by type);
* ``status`` is a :class:`Status`; ``reward`` is present and finite unless the
  row failed;
* ``sample_id`` and ``group_id`` are non-empty and sample ids are unique.

Schema 1.1 sampling supports (``sampling_logprobs``, ``sampling_support``; store/format/schema.py):

* both null, or both present with one entry per response token (a row with only one is refused);
* under ``loss_mask == 1``: the support is non-empty, holds ``response_tokens[i]``, has
  non-negative ids and no id twice; ``sampling_logprobs[i]`` is finite, at most
  ``SAMPLING_LOGPROB_MAX`` (0 plus the rounding of an engine's fp32 log-softmax over a
  support of one dominant token) and at least ``rollout_logprobs[i] - SAMPLING_LOGPROB_TOL``
  (truncation only removes mass, so it can only raise the sampled token's probability; the
  tolerance is the engine's fp32 rounding of two log-softmaxes, 5x the 2e-5 measured between
  SGLang and a transformers recomputation); both constants are schema.py's;
* under ``loss_mask == 0`` (tool/environment tokens): ``0.0`` and an empty support.

Cost: every check is a whole-array numpy pass over the support ids (membership by
comparing each id with its token's sampled id). Duplicates are found by one comparison of
neighbours for supports in ascending id order; other supports are sorted first. Engines give
supports in descending probability order (SGLang's mask, the embedded sampler), so real data
takes the sort: measured 1.56 s against 0.22 s for 190k tokens at top_k 50 (9.5M ids).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rollshard.store.format.routing import ROUTING_COLUMN, RoutingShape, routing_problems
from rollshard.store.format.schema import (
    OPTIONAL_COLUMNS,
    ROW_SCHEMA,
    SAMPLING_LOGPROB_MAX,
    SAMPLING_LOGPROB_TOL,
    STATUS_VALUES,
    Problem,
    Status,
)


def _flat(list_array: pa.ChunkedArray | pa.ListArray) -> tuple[np.ndarray, np.ndarray]:
    """Flattened values and row offsets (from 0) of a list column, without copying when possible."""
    arr = list_array
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.chunk(0) if arr.num_chunks == 1 else arr.combine_chunks()  # combine copies even one chunk
    offsets = arr.offsets.to_numpy()  # [rows + 1], relative to the (possibly sliced) values buffer
    values = arr.values.slice(offsets[0], offsets[-1] - offsets[0]).to_numpy(zero_copy_only=False)
    return values, (offsets - offsets[0]).astype(np.int64)


def check_table(table: pa.Table, *, limit: int = 20, routing: RoutingShape | None = None) -> list[Problem]:
    """Every invariant break in a table of :data:`ROW_SCHEMA` rows (at most ``limit`` reported).

    Written for the common case of a clean table: a screen of whole-column reductions
    (:func:`is_clean`), and the per-row detail of :func:`find_problems` only for a table it does not pass.
    ``routing``: the dataset's routing shape (its run config's, store/format/routing.py), which the
    ``routed_experts`` column is checked against; a table with routing and no shape is a problem.
    """
    has = _ALL_COLUMNS
    problems = [] if is_clean(table, has) else find_problems(table, limit, has)
    return problems + _check_routing(table, limit - len(problems), has, routing)


def check_projection(table: pa.Table, *, limit: int = 20, routing: RoutingShape | None = None) -> list[Problem]:
    """:func:`check_table` on a projection of :data:`ROW_SCHEMA` columns (``sample_id`` among them).

    Each invariant is checked when the table has every column it involves; the loader,
    which reads only the columns a step needs, checks each block it reads with this.
    """
    if "sample_id" not in table.column_names:
        raise ValueError("check_projection needs the sample_id column to name the rows it reports")
    has = set(table.column_names) & _ALL_COLUMNS
    problems = [] if is_clean(table, has) else find_problems(table, limit, has)
    return problems + _check_routing(table, limit - len(problems), has, routing)


def _check_routing(table: pa.Table, limit: int, has: set[str] | frozenset[str],
                   routing: RoutingShape | None) -> list[Problem]:
    """The schema 1.2 ``routed_experts`` invariants (store/format/routing.py), when the table has the column and the
    token columns it is measured against."""
    if limit <= 0 or not has.issuperset((ROUTING_COLUMN, "prompt_tokens", "response_tokens")):
        return []
    routed = table.column(ROUTING_COLUMN)
    if routed.null_count == table.num_rows:
        return []
    problems: list[Problem] = []
    ids = table.column("sample_id").to_pylist()

    def add(rows, field, detail_of) -> None:
        for i in list(rows)[: max(0, limit - len(problems))]:
            problems.append(Problem(ids[int(i)], field, detail_of(int(i))))

    lens = [np.diff(_flat(table.column(c))[1]) for c in ("prompt_tokens", "response_tokens")]
    routing_problems(routed, lens[0], lens[1], routing, add)
    return problems


TOKEN_LISTS = ("response_tokens", "rollout_logprobs", "loss_mask")  # the columns of the length invariant
_ALL_COLUMNS = frozenset(ROW_SCHEMA.names)
_REQUIRED = tuple(f.name for f in ROW_SCHEMA if not f.nullable)
_NON_EMPTY = ("sample_id", "group_id", "prompt_id", "agent")  # string columns that must not be ""


def _plain_list(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray] | None:
    """Values (zero-copy view) and absolute offsets of a one-chunk list column without null values; else None."""
    if col.num_chunks != 1:
        return None
    arr = col.chunk(0)
    values = arr.values  # the whole values array behind a sliced list: the offsets index into it
    if values.null_count:
        return None
    offsets = arr.offsets.to_numpy()  # [rows + 1]
    return values.to_numpy()[offsets[0] : offsets[-1]], offsets


_STRING = pa.string()


def _string_offsets(arr: pa.StringArray) -> np.ndarray:
    """``[rows + 1]`` byte offsets of a string array (a view of its offsets buffer, the array's slice of it)."""
    return np.frombuffer(arr.buffers()[1], np.int32, len(arr) + 1, arr.offset * 4)


def is_clean(table: pa.Table, has: set[str] | frozenset[str]) -> bool:
    """True only when :func:`find_problems` would find nothing: each invariant as one whole-column reduction, for the
    common, clean table (a call of one GRPO group costs tens of microseconds, not hundreds). False (anything
    it does not certainly pass: a break, but also several chunks or a present sampling support) hands the table
    to :func:`find_problems`, which finds and names every break. Each test here is at least as strict as its
    counterpart there."""
    n = table.num_rows
    if n == 0:
        return True
    col = table.column
    for name in _REQUIRED:
        if name in has and col(name).null_count:
            return False
    tokens = has.issuperset(TOKEN_LISTS)
    if tokens:
        resp, lp, mask = (_plain_list(col(c)) for c in TOKEN_LISTS)
        if resp is None or lp is None or mask is None:
            return False
        (resp, r_off), (lp, l_off), (mask, m_off) = resp, lp, mask
        if not (np.array_equal(r_off - r_off[0], l_off - l_off[0]) and np.array_equal(r_off - r_off[0], m_off - m_off[0])):
            return False
        if mask.size:
            low = mask.min()
            if low < 0 or mask.max() > 1 or not (lp.max() <= 0.0 and lp.min() > -np.inf):  # NaN fails both
                return False
            if low == 0 and lp[mask == 0].any():  # tool/environment tokens carry exactly 0.0
                return False
        if resp.size and resp.min() < 0:
            return False
        if has.issuperset(OPTIONAL_COLUMNS) and not (col(OPTIONAL_COLUMNS[0]).null_count == n
                                                     and col(OPTIONAL_COLUMNS[1]).null_count == n):
            return False  # a row with a sampling support: its token-level checks are find_problems's
    for name in _NON_EMPTY:
        if name in has:
            c = col(name)
            if c.num_chunks != 1 or c.type != _STRING or np.diff(_string_offsets(c.chunk(0))).min() <= 0:
                return False
    if "prompt_tokens" in has:
        prompt = _plain_list(col("prompt_tokens"))
        if prompt is None or (prompt[0].size and prompt[0].min() < 0):
            return False
    if "status" in has and not pc.all(pc.is_in(col("status"), value_set=_STATUS_SET)).as_py():
        return False
    if "reward" in has and "status" in has:
        reward = col("reward")
        if reward.null_count or not np.isfinite(reward.to_numpy()).all():
            return False
    if "temperature" in has and tokens:
        temp = col("temperature")
        if temp.null_count:
            return False
        temp = temp.to_numpy()
        if not (temp.min() >= 0.0 and temp.max() < np.inf):  # NaN fails both
            return False
    if "sample_id" in has and n > 1 and len(pc.unique(col("sample_id"))) != n:
        return False
    return True


def find_problems(table: pa.Table, limit: int, has: set[str]) -> list[Problem]:
    problems: list[Problem] = []
    ids: list[str] | None = None

    def add(rows: np.ndarray | Iterable[int], field: str, detail_of) -> None:
        nonlocal ids
        ids = table.column("sample_id").to_pylist() if ids is None else ids
        for i in list(rows)[: max(0, limit - len(problems))]:
            problems.append(Problem(ids[i], field, detail_of(int(i))))

    for field in ROW_SCHEMA:
        if field.name in has and not field.nullable and table.column(field.name).null_count:
            add(np.flatnonzero(table.column(field.name).is_null().to_numpy(zero_copy_only=False)), field.name, lambda i: "is null")
    if problems:  # the checks below assume the required columns are present
        return problems

    tokens = has.issuperset(TOKEN_LISTS)
    bad_len = np.zeros(0, np.int64)
    if tokens:
        resp, resp_off = _flat(table.column("response_tokens"))
        lp, lp_off = _flat(table.column("rollout_logprobs"))
        mask, mask_off = _flat(table.column("loss_mask"))
        n_resp, n_lp, n_mask = np.diff(resp_off), np.diff(lp_off), np.diff(mask_off)
        bad_len = np.flatnonzero((n_resp != n_lp) | (n_resp != n_mask))
        add(
            bad_len,
            "rollout_logprobs",
            lambda i: f"length {n_lp[i]} and loss_mask length {n_mask[i]} must both equal response_tokens length "
            f"{n_resp[i]}; keep the engine's logprob of every response token",
        )

    for col in ("sample_id", "group_id", "prompt_id", "agent"):
        if col not in has:
            continue
        vals = table.column(col)
        lengths = pc.binary_length(vals).to_numpy(zero_copy_only=False)  # bytes; null -> NaN
        if vals.null_count or not (lengths > 0).all():
            add(np.flatnonzero(~(lengths > 0)), col, lambda i: "is empty")

    def row_of(flat_idx: int) -> int:
        return int(np.searchsorted(mask_off, flat_idx, side="right") - 1)

    if tokens and not bad_len.size and mask.size:
        if mask.max() > 1:
            add(sorted({row_of(j) for j in np.flatnonzero(mask > 1)[:limit]}), "loss_mask", lambda i: "values must be 0 or 1")
        # Fast path: reductions only (NaN propagates through max/min and fails both tests).
        all_on = mask.min() == 1
        lp_on = lp if all_on else lp[mask == 1]
        on_ok = lp_on.size == 0 or (lp_on.max() <= 0.0 and lp_on.min() > -np.inf)
        off_ok = all_on or not np.count_nonzero(lp[mask != 1])
        if not (on_ok and off_ok):
            on = mask == 1
            with np.errstate(invalid="ignore"):
                ok_on = np.isfinite(lp) & (lp <= 0.0)
            for bad, what, why in (
                (on & ~ok_on, "under loss_mask 1", "engine logprobs must be finite and <= 0"),
                (~on & (lp != 0.0), "under loss_mask 0", "tool/environment tokens carry logprob 0.0"),
            ):
                if bad.any():
                    first: dict[int, int] = {}
                    for j in np.flatnonzero(bad)[: limit * 8]:
                        first.setdefault(row_of(j), int(j))
                    add(
                        sorted(first),
                        "rollout_logprobs",
                        lambda i, first=first, what=what, why=why: (
                            f"token {first[i] - mask_off[i]} has logprob {float(lp[first[i]]):.6g} {what}; {why}"
                        ),
                    )

    if tokens and not bad_len.size and has.issuperset(OPTIONAL_COLUMNS):
        _check_sampling(table, resp, resp_off, lp, mask, add)

    for col in ("prompt_tokens", "response_tokens"):
        if col not in has:
            continue
        flat, offsets = (resp, resp_off) if col == "response_tokens" and tokens else _flat(table.column(col))
        if flat.size and flat.min() < 0:
            rows = sorted({int(np.searchsorted(offsets, j, side="right") - 1) for j in np.flatnonzero(flat < 0)[:limit]})
            add(rows, col, lambda i, col=col: "token ids must be non-negative")

    if "status" in has:
        status = table.column("status")
        known = pc.is_in(status, value_set=_STATUS_SET).to_numpy(zero_copy_only=False)
        if not known.all():
            statuses = status.to_pylist()
            add(np.flatnonzero(~known), "status", lambda i: f"{statuses[i]!r} is not one of {', '.join(STATUS_VALUES)}")

    if has.issuperset(("reward", "status")):
        reward = table.column("reward").to_numpy(zero_copy_only=False).astype(np.float64)  # null -> NaN
        no_reward = ~np.isfinite(reward)
        if no_reward.any():
            failed = pc.equal(status, Status.FAILED.value).to_numpy(zero_copy_only=False)
            add(
                np.flatnonzero(no_reward & ~(failed == True)),  # noqa: E712  (null status counts as not failed)
                "reward",
                lambda i: f"is {table.column('reward')[i].as_py()!r}; only a failed row may lack a finite reward",
            )

    # The trainer recomputes logprobs at each row's own temperature: a trainable row without a usable one would
    # be trained against other logprobs than the engine's (a null or NaN as if sampled at 1.0, an infinite one
    # as uniform, a negative one as greedy).
    temperature = table.column("temperature") if "temperature" in has and tokens else None
    if temperature is not None:
        temp = temperature.to_numpy(zero_copy_only=False).astype(np.float64)  # null -> NaN
        with np.errstate(invalid="ignore"):
            unusable = ~(np.isfinite(temp) & (temp >= 0.0))
        if unusable.any():
            on = np.concatenate([[0], np.cumsum(mask == 1)])  # [flat + 1] trained tokens before each position
            trainable = on[mask_off[1:]] > on[mask_off[:-1]]  # [rows] at least one loss_mask-1 token
            add(
                np.flatnonzero(unusable & trainable),
                "temperature",
                lambda i: f"is {temperature[i].as_py()!r} on a row with trained tokens (loss_mask 1); store the "
                "sampling temperature, a finite number >= 0 (0 = greedy)",
            )

    if "sample_id" in has and table.num_rows > 1 and len(pc.unique(table.column("sample_id"))) != table.num_rows:
        seen: set[str] = set()
        all_ids = table.column("sample_id").to_pylist()
        dup = [i for i, s in enumerate(all_ids) if s in seen or seen.add(s)]  # type: ignore[func-returns-value]
        add(dup, "sample_id", lambda i: "appears more than once")
    return problems


_STATUS_SET = pa.array(STATUS_VALUES)


def _present(col: pa.ChunkedArray) -> np.ndarray:
    return ~col.is_null().to_numpy(zero_copy_only=False)  # [rows]


def _check_sampling(table: pa.Table, resp: np.ndarray, resp_off: np.ndarray, lp: np.ndarray, mask: np.ndarray,
                    add) -> None:
    """The schema 1.1 invariants of ``sampling_logprobs`` and ``sampling_support`` (module docstring).

    ``resp``, ``lp``, ``mask``: the flat response columns of every row (lengths already checked equal)."""
    slp_col, sup_col = table.column("sampling_logprobs"), table.column("sampling_support")
    if slp_col.null_count == table.num_rows and sup_col.null_count == table.num_rows:
        return  # no row has a support (every 1.0 row): nothing to check
    has_slp, has_sup = _present(slp_col), _present(sup_col)
    for name, other, alone in (("sampling_support", "sampling_logprobs", has_slp & ~has_sup),
                               ("sampling_logprobs", "sampling_support", has_sup & ~has_slp)):
        add(np.flatnonzero(alone), name, lambda i, name=name, other=other: (
            f"is null while {other} is present; store both (one entry per response token) or neither"))
    both = has_slp & has_sup  # [rows]
    n_resp = np.diff(resp_off)
    slp, slp_off = _flat(slp_col)
    sup = _single_chunk(sup_col)
    sup_off = sup.offsets.to_numpy()
    sup_off = (sup_off - sup_off[0]).astype(np.int64)  # [rows + 1] row -> its tokens' supports
    n_slp, n_sup = np.diff(slp_off), np.diff(sup_off)
    for name, n in (("sampling_logprobs", n_slp), ("sampling_support", n_sup)):
        add(np.flatnonzero(both & (n != n_resp)), name, lambda i, n=n, name=name: (
            f"length {n[i]} must equal response_tokens length {n_resp[i]}; one entry per response token"))
    ok = both & (n_slp == n_resp) & (n_sup == n_resp)  # [rows] the rows checked token by token
    if not ok.any():
        return
    inner = sup.values.slice(sup.offsets[0].as_py(), int(sup_off[-1]))  # [tokens of every row] one support each
    ids_arr = inner.values.slice(inner.offsets[0].as_py(), inner.offsets[len(inner)].as_py() - inner.offsets[0].as_py())
    if inner.null_count or ids_arr.null_count:
        bad_tok = (~inner.is_valid().to_numpy(zero_copy_only=False)) if inner.null_count else np.zeros(len(inner), bool)
        if ids_arr.null_count:
            id_null = ids_arr.is_null().to_numpy(zero_copy_only=False)
            in_off = inner.offsets.to_numpy() - inner.offsets[0].as_py()
            bad_tok |= np.add.reduceat(np.append(id_null, False), in_off[:-1]) * (np.diff(in_off) > 0) > 0
        bad_row = np.add.reduceat(np.append(bad_tok, False), sup_off[:-1]) * (n_sup > 0) > 0
        add(np.flatnonzero(ok & bad_row), "sampling_support", lambda i: "holds a null; a support is a list of ids")
        ok &= ~bad_row
        if not ok.any():
            return
    # Token level, over the rows in ``ok`` only (flat positions of their response tokens).
    keep_resp = np.repeat(ok, n_resp)  # [flat response tokens]
    all_rows = bool(ok.all())
    tok = resp if all_rows else resp[keep_resp]  # [T'] sampled ids
    on = (mask if all_rows else mask[keep_resp]) == 1  # [T']
    rlp = lp if all_rows else lp[keep_resp]  # [T']
    s_lp = slp if all_rows else slp[np.repeat(ok, n_slp)]  # [T']
    in_off = inner.offsets.to_numpy().astype(np.int64)
    in_off -= in_off[0]  # [all tokens + 1]
    size_all = np.diff(in_off)
    keep_sup = np.repeat(ok, n_sup)  # [all tokens]
    size = size_all if all_rows else size_all[keep_sup]  # [T']
    ids = ids_arr.to_numpy(zero_copy_only=False)
    if not all_rows:
        ids = ids[np.repeat(keep_sup, size_all)]
    # Whole-array passes over the N support ids (int32, no [N] int64 temporaries); per-token detail only where
    # something fails.
    id_start = np.zeros(len(tok) + 1, np.int64)  # [T' + 1] each token's first id in ``ids``
    np.cumsum(size, out=id_start[1:])

    def token_of(pos: np.ndarray) -> np.ndarray:  # [n] positions in ids -> their token
        return np.searchsorted(id_start, pos, side="right") - 1

    member = np.zeros(len(tok), bool)  # [T'] the sampled id is in its support
    member[token_of(np.flatnonzero(ids == np.repeat(tok, size)))] = True
    # Duplicates: neighbours of an ascending support differ; only a support that is not ascending is sorted.
    step = np.diff(ids)  # [N-1] int32: ids are < 2^31 (a negative one is reported below anyway)
    inside = np.ones(len(step), bool)  # [N-1] both neighbours in one token's support
    bounds = id_start[1:-1]
    inside[bounds[(bounds > 0) & (bounds < len(ids))] - 1] = False
    dup = np.zeros(len(tok), bool)
    if (step[inside] <= 0).any():
        dup[token_of(np.flatnonzero(inside & (step == 0)))] = True
        unsorted_tok = np.unique(token_of(np.flatnonzero(inside & (step < 0))))
        if unsorted_tok.size:
            sel = np.repeat(np.isin(np.arange(len(tok)), unsorted_tok), size)
            tok_of = np.repeat(np.arange(len(tok), dtype=np.int64), size)[sel]
            key = np.sort(tok_of << 32 | (ids[sel].astype(np.int64) & 0xFFFFFFFF))
            dup[(key[1:] >> 32)[key[1:] == key[:-1]]] = True
    neg = np.zeros(len(tok), bool)
    if ids.size and ids.min() < 0:
        neg[token_of(np.flatnonzero(ids < 0))] = True
    with np.errstate(invalid="ignore"):
        lp_ok = np.isfinite(s_lp) & (s_lp <= SAMPLING_LOGPROB_MAX) & (s_lp >= rlp - SAMPLING_LOGPROB_TOL)
    bad_on = on & ((size == 0) | ~member | dup | neg | ~lp_ok)
    bad_off = ~on & ((size != 0) | (s_lp != 0.0))
    if not (bad_on.any() or bad_off.any()):
        return
    rows = np.flatnonzero(ok)  # [rows checked] row index of each
    starts = np.concatenate([[0], np.cumsum(n_resp[ok])])  # [rows checked + 1] into the T' positions

    def support(t: int) -> list[int]:
        s = ids[id_start[t] : id_start[t + 1]].tolist()
        return s if len(s) <= 8 else s[:8] + ["..."]

    cases = (  # (bad tokens, field, detail of token t at position i of its row)
        (on & (size == 0), "sampling_support", lambda t, i: f"token {i} has an empty support under loss_mask 1; "
         "the engine sampled it from a non-empty set"),
        (on & (size > 0) & ~member, "sampling_support", lambda t, i: f"token {i} (id {tok[t]}) is not in its "
         f"support {support(t)}; the sampled token must be in the set it was sampled from"),
        (on & neg, "sampling_support", lambda t, i: f"token {i} has a negative id in its support {support(t)}"),
        (on & dup, "sampling_support", lambda t, i: f"token {i} has an id twice in its support {support(t)}"),
        (on & ~lp_ok, "sampling_logprobs", lambda t, i: f"token {i} has sampling logprob {float(s_lp[t]):.6g} under "
         f"loss_mask 1 (rollout logprob {float(rlp[t]):.6g}); it must be finite, <= {SAMPLING_LOGPROB_MAX:g} and >= "
         f"the rollout logprob - {SAMPLING_LOGPROB_TOL:g} (truncation only raises the sampled token's probability)"),
        (~on & (size != 0), "sampling_support", lambda t, i: f"token {i} has a support of {size[t]} ids under "
         "loss_mask 0; tool/environment tokens carry an empty support"),
        (~on & (s_lp != 0.0), "sampling_logprobs", lambda t, i: f"token {i} has sampling logprob "
         f"{float(s_lp[t]):.6g} under loss_mask 0; tool/environment tokens carry 0.0"),
    )
    for bad, field, detail in cases:
        if not bad.any():
            continue
        first: dict[int, int] = {}
        for t in np.flatnonzero(bad)[:1000]:
            first.setdefault(int(np.searchsorted(starts, t, side="right") - 1), int(t))
        add([rows[k] for k in sorted(first)], field,
            lambda i, first={int(rows[k]): t for k, t in first.items()}, detail=detail:
            detail(first[i], first[i] - int(starts[np.searchsorted(rows, i)])))


def _single_chunk(col: pa.ChunkedArray) -> pa.Array:
    return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
