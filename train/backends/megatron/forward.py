"""One pipeline stage's forward over a packed micro-batch, and the logprobs from vocabulary-split logits.

Packing: the micro-batch's sequences run laid end to end as one sequence of ``T`` tokens (batch 1); the
core attention attends within each sequence alone (:mod:`.attention`, no ``[T, T]`` mask; megatron-core's own
attention with the block-diagonal causal mask of :func:`packed_causal_mask` is its reference in the tests),
and rotary embeddings are taken at each token's own position id (restarting at 0 per sequence), exactly
the positions the hf backend and the engines use.

Logprobs (:func:`vocab_parallel_logprobs`): each tensor-parallel rank holds the logits of its slice of the
vocabulary, ``[K, V / tp]``, and never the whole ``[K, V]``: of ``z = logits / temperature`` (each row's own
temperature, greedy rows at 1, as :func:`rollshard.train.logprobs.sampling_temperature`) the row max, the
sum of ``exp(z - max)`` and the target's ``z`` are all-reduced over the tensor-parallel group, giving
``logp = z[target] - logsumexp(z)``; the entropy ``logsumexp(z) - sum p z`` takes one more all-reduce. The
reductions are megatron's ``reduce_from_tensor_model_parallel_region`` (sum forward, identity backward):
every rank computes the same loss, and each rank's backward carries the gradient of its own slice. All in
fp32, the head too (``fp32_lm_head``), as the hf backend. Given the sampling supports of schema 1.1 rows,
the same chunks give the logprob renormalized over each support and the probability mass on it
(rollshard.train.logprobs' definitions), the support's log-sum-exp reduced over the ranks the same way. Response positions are scored in chunks of
``chunk_tokens`` rows (activation-checkpointed in backward when there is more than one).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def packed_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:  # [1, 1, T, T] bool, True = masked
    """Causal within each packed sequence (a sequence starts where the position id is 0), nothing across."""
    seq = torch.cumsum((position_ids == 0).long(), 0)  # [T] sequence index of each token
    T = position_ids.numel()
    idx = torch.arange(T, device=position_ids.device)
    masked = (seq[:, None] != seq[None, :]) | (idx[None, :] > idx[:, None])  # [T, T]
    return masked[None, None]


def pad_as_sequences(
    position_ids: torch.Tensor, cu_seqlens: torch.Tensor, pad: int, max_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's position ids and ``cu_seqlens`` with ``pad`` padding tokens after it, as sequences of
    their own none longer than the rotary table (``max_positions``): under --ep a rank pads to the longest
    micro-batch of its group, which may be longer than any sequence the model takes (one padding sequence of
    ``pad`` tokens indexed past the table)."""
    pad_positions = torch.arange(pad, device=position_ids.device, dtype=position_ids.dtype) % max_positions
    T = int(cu_seqlens[-1])
    ends = cu_seqlens.new_tensor([T + end for end in [*range(max_positions, pad, max_positions), pad]])
    return torch.cat([position_ids, pad_positions]), torch.cat([cu_seqlens, ends])


def stage_hidden(
    model,
    input_ids: torch.Tensor,  # [T]
    position_ids: torch.Tensor,  # [T] restarting at 0 per sequence
    cu_seqlens: torch.Tensor,  # [S+1]
    freqs: torch.Tensor,
) -> torch.Tensor:
    """This stage's output ``[T, 1, H]``: embedding (first stage) or the tensor set by ``set_input_tensor``,
    then its decoder layers (and, on the last stage, the final norm)."""
    from rollshard.train.backends.megatron.attention import packed_sequences

    x = None
    if model.pre_process:
        x = model.embedding(input_ids=input_ids[None], position_ids=position_ids[None])  # [T, 1, H]
    rope = freqs.index_select(0, position_ids)  # [T, 1, 1, D] each token at its own position
    with packed_sequences(cu_seqlens):  # the core attention takes the boundaries, not a mask
        return model.decoder(hidden_states=x, attention_mask=None, rotary_pos_emb=rope)


def vocab_parallel_logprobs(
    logits: torch.Tensor,  # [C, V/tp] fp32, this rank's vocabulary slice
    targets: torch.Tensor,  # [C] global token ids
    temperature: torch.Tensor,  # [C]
    vocab_start: int,
    with_entropy: bool,
    support_rows: torch.Tensor | None = None,  # [M] row in [0, C) of each support element
    support_ids: torch.Tensor | None = None,  # [M] global token id of each support element
) -> tuple[torch.Tensor | None, ...]:  # [C], [C] or None[, [C], [C]]
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as reduce

    z = logits / temperature.unsqueeze(-1)  # [C, V/tp]
    peak = z.detach().amax(-1)  # [C] any constant gives the same value and gradient
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    e = torch.exp(z - peak.unsqueeze(-1))  # [C, V/tp]
    total = reduce(e.sum(-1))  # [C]
    lse = torch.log(total) + peak  # [C]
    local = targets - vocab_start  # [C]
    mine = (local >= 0) & (local < z.shape[-1])  # [C] targets in this rank's slice
    picked = z.gather(-1, local.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)  # [C]
    picked = reduce(torch.where(mine, picked, torch.zeros_like(picked)))  # [C] exactly one rank contributes
    logp = picked - lse
    entropy = None
    if with_entropy:
        entropy = lse - reduce((e * z).sum(-1)) / total  # [C] H = lse - E_p[z]
    if support_rows is None:
        return logp, entropy
    # The support's log-sum-exp: each rank its own support elements, max and sum reduced as above
    # (rollshard.train.logprobs._chunk on one rank; rows without a support element give 0).
    C = targets.numel()
    local_ids = support_ids - vocab_start  # [M]
    held = (local_ids >= 0) & (local_ids < z.shape[-1])  # [M]
    rows, vals = support_rows[held], z[support_rows[held], local_ids[held]]  # [M_r]
    s_peak = torch.full((C,), -torch.inf, device=z.device).scatter_reduce(0, rows, vals.detach(), "amax")  # [C]
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(s_peak, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    has = torch.isfinite(s_peak)  # [C]
    s_peak = torch.where(has, s_peak, torch.zeros_like(s_peak))
    s_total = reduce(torch.zeros(C, device=z.device).index_add(0, rows, torch.exp(vals - s_peak[rows])))  # [C]
    s_lse = torch.log(torch.where(has, s_total, torch.ones_like(s_total))) + s_peak  # log(1): no 0 * inf in backward
    zero = torch.zeros_like(logp)
    return logp, entropy, torch.where(has, picked - s_lse, zero), torch.where(has, torch.exp(s_lse - lse), zero)


def head_logprobs(
    model,
    hidden: torch.Tensor,  # [T, 1, H] the last stage's output (after the final norm)
    input_ids: torch.Tensor,  # [T]
    at: torch.Tensor,  # [K] scored positions
    temperature: torch.Tensor,  # [K]
    *,
    with_entropy: bool,
    chunk_tokens: int,
    support_rows: torch.Tensor | None = None,  # [M] row in [0, K) of each support element, non-decreasing
    support_ids: torch.Tensor | None = None,  # [M]
) -> tuple[torch.Tensor | None, ...]:  # [K], [K] or None[, [K], [K]]
    from megatron.core import parallel_state as ps

    h = hidden.index_select(0, at - 1)  # [K, 1, H] the state at t-1 predicts token t
    targets = input_ids.index_select(0, at)  # [K]
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    start = ps.get_tensor_model_parallel_rank() * (model.vocab_size // ps.get_tensor_model_parallel_world_size())

    def chunk(h_c: torch.Tensor, t_c: torch.Tensor, temp_c: torch.Tensor, *sup):
        with torch.autocast(h_c.device.type, enabled=False):
            logits, _ = model.output_layer(h_c.float(), weight=weight)  # [C, 1, V/tp] fp32
        return vocab_parallel_logprobs(logits[:, 0], t_c, temp_c, start, with_entropy, *sup)

    K = targets.numel()
    with_support = support_rows is not None
    if K <= chunk_tokens:
        return chunk(h, targets, temperature, *((support_rows, support_ids) if with_support else ()))
    if with_support:  # chunk c's support elements: the run whose rows fall in [c * chunk, (c + 1) * chunk)
        bounds = torch.arange(0, K + chunk_tokens, chunk_tokens, device=support_rows.device)
        cuts = torch.searchsorted(support_rows, bounds.clamp(max=K)).tolist()
    parts = []
    for c, s in enumerate(range(0, K, chunk_tokens)):
        sl = slice(s, s + chunk_tokens)
        sup = (support_rows[cuts[c] : cuts[c + 1]] - s, support_ids[cuts[c] : cuts[c + 1]]) if with_support else ()
        args = (h[sl], targets[sl], temperature[sl], *sup)
        parts.append(checkpoint(chunk, *args, use_reentrant=False) if torch.is_grad_enabled() else chunk(*args))
    return tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts))
