"""Token-budget packing: whole sequences concatenated into flat micro-batches, no padding.

A micro-batch (:class:`PackedBatch`) holds S sequences, each the row's prompt tokens
followed by its response tokens, concatenated into one stream of T tokens. The
boundaries are ``cu_seqlens`` (``[S+1]``, int32, the layout of flash-attention's
varlen kernels and of ``transformers``' packed-sequence path); position ids restart at
0 for every sequence, so attention never crosses a sequence.

The batch is lean: per token it carries only what differs per token (``input_ids``,
``loss_mask``, ``rollout_logprobs``: three ``[T]`` arrays written per step). What is
per sequence stays per sequence: the sampling temperature is ``temperatures [S]``, and
the position ids are not stored at all. The consumer derives both where it uses them,
on its own device, from ``cu_seqlens`` (:func:`positions_from_cu_seqlens`,
:func:`token_temperatures`: a ``repeat_interleave`` each, no host copy, no device sync);
the values are exactly those a ``[T]`` copy would hold. ``PackedBatch.position_ids`` and
``PackedBatch.temperature`` are the same derivations as properties, for code that reads
a batch on the host.

Alignment convention (the trainer depends on it): ``loss_mask[t]`` and
``rollout_logprobs[t]`` describe token ``input_ids[t]`` as a *target*. The logprob of
``input_ids[t]`` is predicted by the logits at position ``t - 1``, so the trainer
computes ``logp[t] = log_softmax(logits[t - 1] / temperature of t's sequence)[input_ids[t]]``
and never shifts across a ``cu_seqlens`` boundary. Prompt positions carry mask 0 and
logprob 0. A row with an empty prompt has no position that predicts its first
response token; that token's mask is set to 0.

Sampling supports (schema 1.1) follow the same convention: ``has_support[t]`` is True where
the position is trained on (packed ``loss_mask[t] == 1``) and its row has a support;
there ``sampling_logprobs[t]`` is the stored sampling logprob of ``input_ids[t]`` and
``support_ids[support_offsets[t]:support_offsets[t + 1]]`` the ids it was sampled from
(``input_ids[t]`` among them). Everywhere else (prompt positions, mask-0 tokens, rows
without a support, the masked first token of a row without prompt) the range is empty
and the sampling logprob 0. The four fields are None for a micro-batch none of whose rows
has a support, so 1.0 data costs nothing. They are built per micro-batch (``support_ids``
counts from 0 in each).

Sequences are assigned to micro-batches by first-fit-decreasing bin packing on
their lengths, within one optimizer step, under two budgets: tokens, and support ids
(the ``N`` of ``support_ids``, which the token budget does not bound: a top-k of 4096
puts 4096 ids behind each trained token). Sequences are taken longest first and each
goes into the first micro-batch with room for both its tokens and its support ids. A
sequence over either budget gets a micro-batch of its own (it is never cut: cutting
would lose the context of its tail). Data without supports counts 0 support ids per
sequence, so it packs exactly as by tokens alone. Packing efficiency = real tokens /
sum over micro-batches of ``max(budget, tokens in it)`` (tokens, whichever budget
closed the micro-batch): 1.0 means no budget left unused; an oversize micro-batch
counts as full.

The ``[T]`` tensors of one step's micro-batches are views of one buffer per field
(the step is written in one pass), as are the ``[S]`` temperatures; they do not overlap,
and ``.to(device)`` copies only the view.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import pyarrow as pa
import torch

DEFAULT_TEMPERATURE = 1.0  # rows without a recorded temperature were sampled at the engine default
# Default support budget per token of the token budget. Support ids per micro-batch are at most
# top-k x trained tokens <= top-k x tokens, so at 64 the support budget never binds for top-k <= 64
# (ordinary top-k 20-50 packs exactly as by tokens) at any token budget, while it caps a top-k 4096
# micro-batch at 1/64 of its unbounded size: 512 B of int64 ids per budgeted token on the host (4 MiB at
# 8192 tokens), small beside the fp32 logits row (4 B x vocab) the trainer keeps per token.
SUPPORT_PER_TOKEN = 64


@dataclasses.dataclass(kw_only=True)
class PackedBatch:
    """One micro-batch: S sequences packed into T tokens, no padding."""

    input_ids: torch.Tensor  # [T] int64, prompt then response tokens of each sequence
    cu_seqlens: torch.Tensor  # [S+1] int32, sequence boundaries in the flat stream
    loss_mask: torch.Tensor  # [T] float32, row's loss_mask at response positions, 0 at prompt positions
    rollout_logprobs: torch.Tensor  # [T] float32, stored logprob of input_ids[t] at response positions, else 0
    temperatures: torch.Tensor  # [S] float32, row's sampling temperature (1.0 when null; 0 = greedy kept as 0)
    response_start: torch.Tensor  # [S] int64, flat index of each sequence's first response token
    seq_group: torch.Tensor  # [S] int64, index of the sequence's group in Step.group_ids
    rewards: torch.Tensor  # [S] float32
    agents: list[str]  # [S]
    sample_ids: list[str]  # [S]
    weight_versions: list[str | None]  # [S]
    num_tokens: int  # T
    # [S] int64 each sequence's oldest policy version, of its tokens' spans (NO_VERSION: unknown); None: not read
    oldest_versions: torch.Tensor | None = None
    num_loss_tokens: int  # tokens with loss_mask 1
    # Schema 1.1 sampling support; None when no row of the micro-batch has one (no cost for 1.0 data).
    sampling_logprobs: torch.Tensor | None = None  # [T] float32, stored sampling logprob where has_support, else 0
    has_support: torch.Tensor | None = None  # [T] bool, response positions (loss_mask 1) whose row has a support
    support_ids: torch.Tensor | None = None  # [N] int64, the supports of positions t, flat
    support_offsets: torch.Tensor | None = None  # [T+1] int64: position t's support is support_ids[o[t]:o[t+1]]
    # Schema 1.2 routed experts (LoaderConfig.routed_experts); None when no row of the micro-batch has them.
    routed_experts: torch.Tensor | None = None  # [T, layers x top_k] uint8 (int32 over 256 experts), 0 where not valid
    routed_valid: torch.Tensor | None = None  # [T] bool: position t has its row's stored routing (not a row's last)

    @property
    def num_sequences(self) -> int:
        return len(self.sample_ids)

    @property
    def position_ids(self) -> torch.Tensor:  # [T] int64
        """Derived, not stored: 0, 1, ... within each sequence (:func:`positions_from_cu_seqlens`)."""
        return positions_from_cu_seqlens(self.cu_seqlens, self.num_tokens)

    @property
    def temperature(self) -> torch.Tensor:  # [T] float32
        """Derived, not stored: each token's sequence temperature (:func:`token_temperatures`)."""
        return token_temperatures(self.temperatures, self.cu_seqlens, self.num_tokens)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PackedBatch":
        """A copy with every tensor on ``device``."""
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)

    def pin_memory(self) -> "PackedBatch":
        """A copy with every tensor in page-locked memory (faster, asynchronous host-to-GPU copies)."""
        pinned = {
            f.name: getattr(self, f.name).pin_memory()
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **pinned)


@dataclasses.dataclass(kw_only=True)
class Sequences:
    """The S sequences of one step, column by column; token arrays are views into the read row groups."""

    prompt: list[np.ndarray]  # S arrays of int32 token ids
    response: list[np.ndarray]  # S arrays of int32 token ids
    logprobs: list[np.ndarray]  # S arrays of float32, one per response token
    mask: list[np.ndarray]  # S arrays of uint8, one per response token
    temperature: np.ndarray  # [S] float32, NaN where the row has none
    reward: np.ndarray  # [S] float32
    group: np.ndarray  # [S] int64
    agent: list[str]
    sample_id: list[str]
    weight_version: list[str | None]
    oldest_version: np.ndarray | None = None  # [S] int64, the oldest of each row's versions (NO_VERSION: unknown)
    # Schema 1.1, None when no sequence has a support; else per sequence None (no support) or its arrays.
    sampling_logprobs: list[np.ndarray | None] | None = None  # S arrays of float32, one per response token
    support: list[tuple[np.ndarray, np.ndarray] | None] | None = None  # S (ids int32 [n], sizes [R] per token)
    # Schema 1.2, None when no sequence has routing; else per sequence None or its [P + R - 1, layers x top_k] ids.
    routing: list[np.ndarray | None] | None = None

    def __len__(self) -> int:
        return len(self.prompt)

    def lengths(self) -> np.ndarray:
        return np.fromiter((len(p) + len(r) for p, r in zip(self.prompt, self.response)), np.int64, len(self))

    def support_counts(self) -> np.ndarray:
        """``[S]`` int64: the support ids each sequence puts into its micro-batch (those of the positions
        trained on, as :func:`pack` keeps them; 0 for a sequence without a support)."""
        counts = np.zeros(len(self), np.int64)  # [S]
        if self.support is None:
            return counts
        for i, sup in enumerate(self.support):
            if sup is not None:
                counts[i] = sup[1][_trainable(self.mask[i], len(self.prompt[i])) == 1].sum()
        return counts


def first_fit_decreasing(
    lengths: np.ndarray, budget: int, supports: np.ndarray | None = None, support_budget: int | None = None
) -> list[np.ndarray]:
    """Bins of sequence indices, each bin's lengths summing to at most ``budget`` and its ``supports``
    (support ids per sequence, ``[S]``; None: all 0) to at most ``support_budget`` (None: unbounded).

    Longest first (by length alone), each into the first bin with room for both; a sequence over either
    budget gets a bin of its own. Bins come out in creation order, members in index order.
    """
    if budget < 1:
        raise ValueError(f"micro-batch budget must be at least 1 token, got {budget}")
    if support_budget is not None and support_budget < 1:
        raise ValueError(f"micro-batch support budget must be at least 1 support id, got {support_budget}")
    order = np.argsort(-np.asarray(lengths), kind="stable").tolist()
    sizes = np.asarray(lengths).tolist()
    bounded = supports is not None and support_budget is not None
    ids = np.asarray(supports).tolist() if bounded else [0] * len(sizes)
    id_budget = support_budget if bounded else 0
    # budget left in each bin, tokens and support ids (plain lists: bins are few, numpy calls cost more)
    room: list[int] = []
    id_room: list[int] = []
    members: list[list[int]] = []
    for i in order:
        n, m = sizes[i], ids[i]
        alone = n > budget or m > id_budget
        b = None if alone else next((b for b, r in enumerate(room) if r >= n and id_room[b] >= m), None)
        if b is None:
            room.append(0 if alone else budget - n)  # an oversize sequence leaves no room in its bin
            id_room.append(0 if alone else id_budget - m)
            members.append([i])
        else:
            room[b] -= n
            id_room[b] -= m
            members[b].append(i)
    return [np.sort(np.asarray(m, np.int64)) for m in members]


def pack(seqs: Sequences, budget: int, support_budget: int | None = None) -> tuple[list[PackedBatch], float]:
    """Micro-batches of ``seqs`` under a token budget and a support-id budget (None:
    ``SUPPORT_PER_TOKEN * budget``), and the packing efficiency (module docstring)."""
    step = pack_step(seqs, budget, support_budget)
    return step.batches, step.efficiency


@dataclasses.dataclass
class PackedStep:
    """:func:`pack_step`'s micro-batches, and the step's sequences in their order, as whole-step arrays."""

    batches: list[PackedBatch]
    efficiency: float
    group: np.ndarray  # [S] int64, each sequence's group (Step.group_ids' index), in micro-batch order
    tokens: np.ndarray  # [S] int64
    loss_tokens: np.ndarray  # [S] int64, tokens with loss_mask 1


def pack_step(seqs: Sequences, budget: int, support_budget: int | None = None) -> PackedStep:
    """:func:`pack`, with the per-sequence figures of the step.

    The step is written once, in micro-batch order, into flat arrays; each micro-batch's
    tensors are views of one contiguous slice of them (one allocation per step, one pass
    over the tokens).
    """
    if len(seqs) == 0:
        empty = np.zeros(0, np.int64)
        return PackedStep([], 1.0, empty, empty, empty)
    if support_budget is None:
        support_budget = SUPPORT_PER_TOKEN * budget
    if seqs.support is None:  # 1.0 data: every count is 0, skip counting
        bins = first_fit_decreasing(seqs.lengths(), budget)
    else:
        bins = first_fit_decreasing(seqs.lengths(), budget, seqs.support_counts(), support_budget)
    order = np.concatenate(bins)  # [S] sequences in micro-batch order
    p_len = np.fromiter((len(seqs.prompt[i]) for i in order), np.int64, len(order))  # [S]
    seq_len = p_len + np.fromiter((len(seqs.response[i]) for i in order), np.int64, len(order))  # [S]
    cu = np.zeros(len(order) + 1, np.int64)  # [S+1] over the whole step
    np.cumsum(seq_len, out=cu[1:])
    # One vectorized pass per array (np.concatenate into the output; slice-by-slice casting assignment
    # measured 6x slower), into buffers from Arrow's memory pool, which keeps freed pages for the next
    # step (fresh numpy arrays of this size are mmap'ed and page-faulted in every step: 2x slower).
    total = int(cu[-1])
    longest = int(seq_len.max())
    zeros_u8, zeros_f32 = np.zeros(longest, np.uint8), np.zeros(longest, np.float32)
    idx, prompt_lens = order.tolist(), p_len.tolist()
    # Three [T] arrays: the position ids and the temperature are per sequence, derived by the consumer.
    input_ids = pooled_array(total, np.int64)  # [T]
    np.concatenate([t for i in idx for t in (seqs.prompt[i], seqs.response[i])], out=input_ids)
    loss_mask = pooled_array(total, np.float32)  # [T]
    masks = [t for i, n in zip(idx, prompt_lens) for t in (zeros_u8[:n], _trainable(seqs.mask[i], n))]
    np.concatenate(masks, out=loss_mask)
    logprobs = pooled_array(total, np.float32)  # [T]
    np.concatenate([t for i, n in zip(idx, prompt_lens) for t in (zeros_f32[:n], seqs.logprobs[i])], out=logprobs)
    seq_loss = np.zeros(len(order), np.float32)  # [S] loss tokens per sequence: one pass over the step's mask
    nonempty = seq_len > 0
    if nonempty.any():  # 0/1 values: float32 sums are exact
        seq_loss[nonempty] = np.add.reduceat(loss_mask, cu[:-1][nonempty])
    seq_loss = seq_loss.astype(np.int64)
    # Each micro-batch's tensors are views of step-wide ones, cut by one split per field (a micro-batch holds a
    # few sequences, so per-micro-batch numpy and torch calls would cost more than the tokens' copies).
    counts = np.fromiter((len(b) for b in bins), np.int64, len(bins))  # [B] sequences per micro-batch
    firsts = np.zeros(len(bins), np.int64)  # [B] index of each one's first sequence in the step's order
    np.cumsum(counts[:-1], out=firsts[1:])
    k, starts = counts.tolist(), cu[firsts]  # starts: [B] each micro-batch's first token in the step
    tokens = np.diff(cu[np.append(firsts, len(order))]).tolist()  # [B]
    # [S + B] each micro-batch's cu_seqlens (its S_b + 1 boundaries, from 0), laid end to end
    at = np.arange(len(order) + len(bins)) - np.repeat(np.arange(len(bins)), counts + 1)
    local_cu = torch.from_numpy((cu[at] - np.repeat(starts, counts + 1)).astype(np.int32)).split([n + 1 for n in k])
    temp = seqs.temperature[order]  # [S]
    per_seq = {  # [S] each, split into the micro-batches' [S_b]
        "temperatures": np.where(np.isnan(temp), DEFAULT_TEMPERATURE, temp).astype(np.float32),
        "response_start": cu[:-1] + p_len - np.repeat(starts, counts),  # within its micro-batch
        "seq_group": seqs.group[order].astype(np.int64),
        "rewards": seqs.reward[order].astype(np.float32),
    }
    if seqs.oldest_version is not None:
        per_seq["oldest_versions"] = seqs.oldest_version[order]
    cut = {name: torch.from_numpy(a).split(k) for name, a in per_seq.items()}
    cut.update({name: torch.from_numpy(a).split(tokens) for name, a in
                (("input_ids", input_ids), ("loss_mask", loss_mask), ("rollout_logprobs", logprobs))})
    loss_tokens = np.add.reduceat(seq_loss, firsts).tolist()  # [B]
    agents, sample_ids = [seqs.agent[i] for i in idx], [seqs.sample_id[i] for i in idx]  # [S] in the step's order
    versions = [seqs.weight_version[i] for i in idx]
    batches = []
    for b, (first, n) in enumerate(zip(firsts.tolist(), k)):
        last = first + n
        batches.append(
            PackedBatch(
                **{name: views[b] for name, views in cut.items()},
                **_extras(seqs, idx[first:last], cu[first:last], p_len[first:last], starts[b], loss_mask, tokens[b]),
                cu_seqlens=local_cu[b],
                agents=agents[first:last],
                sample_ids=sample_ids[first:last],
                weight_versions=versions[first:last],
                num_tokens=tokens[b],
                num_loss_tokens=loss_tokens[b],
            )
        )
    capacity = sum(max(budget, n) for n in tokens)
    return PackedStep(batches, total / capacity, per_seq["seq_group"], seq_len, seq_loss)


def _extras(seqs: Sequences, ids: list[int], cu: np.ndarray, p_len: np.ndarray, lo: int, loss_mask: np.ndarray,
            T: int) -> dict[str, torch.Tensor]:
    """The schema 1.1 and 1.2 fields of the micro-batch of sequences ``ids`` (``cu``, ``p_len``: their starts in
    the step and prompt lengths; ``lo``: the micro-batch's first token in the step, ``T`` its tokens), none for
    data without them."""
    if seqs.support is None and seqs.routing is None:
        return {}
    starts = (cu - lo + p_len).tolist()  # each sequence's first response token in the micro-batch
    return {**_supports(seqs, ids, starts, loss_mask[lo : lo + T]), **_routing(seqs, ids, T)}


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:  # [T] int64
    """Position ids of a packed stream of ``num_tokens`` tokens, restarting at 0 at every sequence start
    (``cu_seqlens [S+1]``), on ``cu_seqlens``' device: ``t - cu_seqlens[sequence of t]``.

    ``num_tokens`` is ``PackedBatch.num_tokens`` (known on the host), so nothing waits for the device."""
    cu = cu_seqlens.long()  # [S+1]
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=num_tokens)  # [T] its sequence's start
    return torch.arange(num_tokens, device=cu.device) - starts


def token_temperatures(temperatures: torch.Tensor, cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:  # [T]
    """Each token's sampling temperature, that of its sequence (``temperatures [S]``, ``cu_seqlens [S+1]``), on
    their device; ``num_tokens`` as in :func:`positions_from_cu_seqlens`."""
    cu = cu_seqlens.long()  # [S+1]
    return torch.repeat_interleave(temperatures, cu[1:] - cu[:-1], output_size=num_tokens)


def _supports(seqs: Sequences, ids: list[int], starts: list[int], loss_mask: np.ndarray) -> dict[str, torch.Tensor]:
    """The four schema 1.1 fields of one micro-batch (PackedBatch), or none when no sequence of it has a support.

    ``ids``: its sequences, ``starts``: the position of each one's first response token, ``loss_mask``: the
    packed mask ``[T]`` (a token masked at packing, the first of a row without prompt, gets no support).
    """
    if seqs.support is None or all(seqs.support[i] is None for i in ids):
        return {}
    T = len(loss_mask)
    on = loss_mask == 1  # [T]
    has = np.zeros(T, bool)  # [T]
    sampling = np.zeros(T, np.float32)  # [T]
    sizes = np.zeros(T, np.int64)  # [T] support size of each position
    chunks = []
    for i, start in zip(ids, starts):
        if seqs.support[i] is None:
            continue
        values, size = seqs.support[i]
        end = start + len(size)
        keep = on[start:end]  # [R] positions trained on: loss_mask 1 (a row's mask 0 tokens have empty supports)
        has[start:end] = keep
        sampling[start:end] = np.where(keep, seqs.sampling_logprobs[i], 0.0)
        sizes[start:end] = np.where(keep, size, 0)
        chunks.append(values if keep.all() else values[np.repeat(keep, size)])
    offsets = np.zeros(T + 1, np.int64)  # [T+1]
    np.cumsum(sizes, out=offsets[1:])
    support_ids = np.concatenate(chunks).astype(np.int64) if chunks else np.zeros(0, np.int64)  # [N]
    return {
        "sampling_logprobs": torch.from_numpy(sampling),
        "has_support": torch.from_numpy(has),
        "support_ids": torch.from_numpy(support_ids),
        "support_offsets": torch.from_numpy(offsets),
    }


def _routing(seqs: Sequences, ids: list[int], T: int) -> dict[str, torch.Tensor]:
    """``routed_experts`` and ``routed_valid`` of one micro-batch (PackedBatch), or none when no sequence of it
    has routing: each sequence's stored ``P + R - 1`` positions in place, its last position (and every position of
    a sequence without routing) not valid."""
    if seqs.routing is None:
        return {}
    rows = [seqs.routing[i] for i in ids]
    stored = [r for r in rows if r is not None]
    if not stored:
        return {}
    width, dtype = stored[0].shape[1], np.int32 if stored[0].dtype.itemsize > 1 else np.uint8
    if any(r.shape[1] != width for r in stored):
        raise ValueError(f"rows of one micro-batch store routing of {sorted({r.shape[1] for r in stored})} ids per "
                         "position; train on datasets of one model's routing")
    ids_out, valid = np.zeros((T, width), dtype), np.zeros(T, bool)
    start = 0
    for i, r in zip(ids, rows):
        n = len(seqs.prompt[i]) + len(seqs.response[i])
        if r is not None:
            ids_out[start : start + len(r)] = r
            valid[start : start + len(r)] = True
        start += n
    return {"routed_experts": torch.from_numpy(ids_out), "routed_valid": torch.from_numpy(valid)}


def pooled_array(n: int, dtype) -> np.ndarray:
    """An uninitialized writable array in Arrow's memory pool (freed when the last tensor view goes)."""
    dtype = np.dtype(dtype)
    return np.frombuffer(pa.allocate_buffer(n * dtype.itemsize), dtype)


def _trainable(mask: np.ndarray, prompt_len: int) -> np.ndarray:
    """A row with an empty prompt has no position that predicts its first token: mask it."""
    if prompt_len or not len(mask) or not mask[0]:
        return mask
    out = mask.copy()
    out[0] = 0
    return out


def unpack(batch: PackedBatch) -> list[dict]:
    """The sequences of a micro-batch as row-like dicts (tests, debugging): the inverse of packing."""
    cu = batch.cu_seqlens.tolist()
    out = []
    for k in range(batch.num_sequences):
        start, mid, end = cu[k], int(batch.response_start[k]), cu[k + 1]
        out.append(
            {
                "sample_id": batch.sample_ids[k],
                "agent": batch.agents[k],
                "weight_version": batch.weight_versions[k],
                "group": int(batch.seq_group[k]),
                "reward": float(batch.rewards[k]),
                "temperature": float(batch.temperatures[k]),
                "prompt_tokens": batch.input_ids[start:mid].tolist(),
                "response_tokens": batch.input_ids[mid:end].tolist(),
                "rollout_logprobs": batch.rollout_logprobs[mid:end].tolist(),
                "loss_mask": [int(m) for m in batch.loss_mask[mid:end].tolist()],
            }
        )
        if batch.has_support is not None:  # the supports of the positions trained on ([] elsewhere)
            o = batch.support_offsets.tolist()
            out[-1]["sampling_logprobs"] = batch.sampling_logprobs[mid:end].tolist()
            out[-1]["sampling_support"] = [batch.support_ids[o[t] : o[t + 1]].tolist() for t in range(mid, end)]
    return out


def packing_efficiency(token_counts: Sequence[int], budget: int) -> float:
    """Real tokens / sum of ``max(budget, tokens)`` over micro-batches (the module's definition)."""
    cap = sum(max(budget, n) for n in token_counts)
    return sum(token_counts) / cap if cap else 1.0
