"""The embedded engine's sampler: one token per row and its logprob, the same whatever else is in the batch.

Truncation follows SGLang's torch sampler exactly: sort the tempered probabilities,
keep the top-k, then keep a token while the probability mass sorted before it is
<= top_p (top-p on the untruncated sorted cumulative probabilities). A row with top_p 1
and no top-k keeps every token without the sort (the rule would only drop tail tokens
whose preceding mass rounds above 1), the same in any batch. Logprobs follow
SGLang's definition: log softmax(logits / T) of the sampled token, before truncation;
greedy (T < GREEDY_TEMPERATURE_EPS) takes the argmax and reports log softmax(logits).

Where this departs from SGLang: the token is drawn by inverse CDF over the kept
probabilities in *vocabulary* order (cumsum in float64), not in sorted order, with one
uniform per row from that request's own generator. In sorted order, a float-rounding
difference of 1e-7 between two batch compositions can swap two near-equal
probabilities and with them two whole CDF intervals, so the same uniform picks another
token; random tiny models, whose distributions are nearly flat, hit this in a few rows
out of a few hundred. In vocabulary order a rounding difference only moves interval
boundaries by about that much, so the token changes only when the uniform lands within
float rounding of a boundary, or when rounding moves the top-k/top-p cut itself (a
token within ~1e-7 of the cut). Distribution-wise both orders are the same sampler.

Measured on the tiny test models (fp32, CPU), batch 1 against one padded batch of 256:
logits differ by up to 3.6e-7, the float64 CDFs by 4e-8 per row on average (1.6e-7 at
most), so a draw changes its token with probability about 1e-7; 0 of 51,200 draws did
here, against 8 of 51,200 with the sorted-order draw (tests/generate/test_sampler.py
runs 256 seeded requests x 32 tokens at batch 16, 1 and 8: identical tokens).
"""

from __future__ import annotations

import torch

from rollshard.store.schema import GREEDY_TEMPERATURE_EPS


def sample_tokens(
    logits: torch.Tensor,  # [B, V] fp32
    temperature: torch.Tensor,  # [B]; < GREEDY_TEMPERATURE_EPS means greedy (SGLang's rule)
    top_p: torch.Tensor,  # [B]
    top_k: torch.Tensor,  # [B] long; <= 0 means no top-k
    uniform: torch.Tensor,  # [B] in [0, 1); float64 keeps the draw as fine as the float64 CDF
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its logprob (see the module docstring). Returns ``(tokens [B], logprobs [B])``."""
    greedy = temperature < GREEDY_TEMPERATURE_EPS  # [B]
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)  # [B]
    logp = torch.log_softmax(logits / scale[:, None], dim=-1)  # [B, V]
    probs = logp.exp()  # [B, V]

    vocab = logits.shape[-1]
    use_k = (top_k > 0) & (top_k < vocab)  # [B]
    use_p = top_p < 1.0  # [B]
    kept = probs  # [B, V]; rows that truncate nothing keep every token, in whatever batch they are
    if bool(((use_k | use_p) & ~greedy).any()):  # the sort is most of the sampler's cost: only when needed
        # Decided in sorted order exactly as SGLang does; a stable sort breaks exact ties by vocabulary index,
        # so the kept set does not depend on the sort kernel's choice among equal values.
        probs_sort, probs_idx = probs.sort(dim=-1, descending=True, stable=True)  # [B, V]
        k = torch.where(use_k, top_k, torch.full_like(top_k, vocab))  # [B]
        rank = torch.arange(vocab, device=logits.device)[None, :]  # [1, V]
        over_p = use_p[:, None] & ((probs_sort.cumsum(dim=-1) - probs_sort) > top_p[:, None])  # [B, V]
        drop_sorted = (rank >= k[:, None]) | over_p  # [B, V]; SGLang's rule
        drop = torch.empty_like(drop_sorted).scatter_(-1, probs_idx, drop_sorted)  # [B, V] in vocabulary order
        kept = probs.masked_fill(drop, 0.0)

    # Inverse CDF in vocabulary order: the first token whose cumulative kept mass exceeds u * total.
    # float64 where the device has it (MPS has none: the CDF is taken on the CPU there).
    kept_cum = (kept.cpu() if kept.device.type == "mps" else kept).double().cumsum(dim=-1)  # [B, V]
    target = uniform.to(kept_cum.device, kept_cum.dtype) * kept_cum[:, -1]  # [B]
    pos = torch.searchsorted(kept_cum, target[:, None], right=True)  # [B, 1]
    # u * total can round up to total itself: stay on the last token with kept mass (the first index whose
    # cumsum reaches the total), never on a dropped or zero-probability token after it.
    last = torch.searchsorted(kept_cum, kept_cum[:, -1:].contiguous(), right=False)  # [B, 1]
    sampled = torch.minimum(pos, last).squeeze(-1).to(logits.device)  # [B]

    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)  # [B]
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
