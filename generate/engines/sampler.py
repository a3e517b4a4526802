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

Per-row state (:class:`SamplingRows`): a running batch keeps each row's temperature, top-p and top-k as
tensors, and draws its uniforms :data:`UNIFORM_WINDOW` at a time from the row's generator into a
``[B, W]`` window, a column per step. The k-th token of a request uses its generator's k-th draw whatever
the window's phase when it joined (a generator's draws are one sequence, however many are taken at a
time), so the stream is the one a draw per token gives, for a Python call per row every W steps.

Sampling support (:func:`sample_tokens_with_support`, SGLang's ``return_sampling_mask``): the kept ids of
a row and the sampled token's logprob under the kept, renormalized distribution, read off the kept set
the draw used. Computed only for the rows that ask; the draw is the same with or without it.
"""

from __future__ import annotations

import torch

from rollshard.generate.engines.base import SamplingParams
from rollshard.store.format.schema import GREEDY_TEMPERATURE_EPS

UNIFORM_WINDOW = 64  # uniforms drawn per row at a time: one generator call per row every this many steps


def sample_tokens(
    logits: torch.Tensor,  # [B, V] fp32
    temperature: torch.Tensor,  # [B]; < GREEDY_TEMPERATURE_EPS means greedy (SGLang's rule)
    top_p: torch.Tensor,  # [B]
    top_k: torch.Tensor,  # [B] long; <= 0 means no top-k
    uniform: torch.Tensor,  # [B] in [0, 1); float64 keeps the draw as fine as the float64 CDF
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its logprob (see the module docstring). Returns ``(tokens [B], logprobs [B])``."""
    tokens, logprobs, _ = _sample(logits, temperature, top_p, top_k, uniform, want_support=None)
    return tokens, logprobs


def sample_tokens_with_support(
    logits: torch.Tensor,  # [B, V] fp32
    temperature: torch.Tensor,  # [B]
    top_p: torch.Tensor,  # [B]
    top_k: torch.Tensor,  # [B] long
    uniform: torch.Tensor,  # [B] float64
    want_support: list[bool],  # [B] which rows report their sampling support
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[list[int], float] | None]]:
    """:func:`sample_tokens` plus, for each row in ``want_support``, ``(support, sampling_logprob)``: the kept
    token ids in descending probability (SGLang's order) and the sampled token's logprob under the kept,
    renormalized distribution (see :func:`_support`); None for the other rows. The tokens are the ones
    :func:`sample_tokens` draws: the support is read off the same kept set, not recomputed."""
    return _sample(logits, temperature, top_p, top_k, uniform, want_support=want_support)


def _sample(logits, temperature, top_p, top_k, uniform, *, want_support):
    greedy = temperature < GREEDY_TEMPERATURE_EPS  # [B]
    any_greedy = bool(greedy.any())
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)  # [B]
    # Dividing by 1 is exact: a batch of temperature-1 rows skips a pass over [B, V] and gets the same bits.
    tempered = logits if bool((scale == 1.0).all()) else logits / scale[:, None]  # [B, V]
    logp = torch.log_softmax(tempered, dim=-1)  # [B, V]
    probs = logp.exp()  # [B, V]

    vocab = logits.shape[-1]
    use_k = (top_k > 0) & (top_k < vocab)  # [B]
    use_p = top_p < 1.0  # [B]
    kept = probs  # [B, V]; rows that truncate nothing keep every token, in whatever batch they are
    drop = None  # [B, V] bool in vocabulary order, when some row truncates
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

    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled) if any_greedy else sampled  # [B]
    token_logp = logp.gather(-1, tokens[:, None]).squeeze(-1)  # [B]
    supports = None
    if want_support is not None:
        supports = _support(logp, probs, drop, tokens, greedy, want_support)
    return tokens, token_logp, supports


def _support(
    logp: torch.Tensor,  # [B, V] fp32 log softmax(logits / T)
    probs: torch.Tensor,  # [B, V] its exp
    drop: torch.Tensor | None,  # [B, V] bool, vocabulary order; None when no row truncates
    tokens: torch.Tensor,  # [B]
    greedy: torch.Tensor,  # [B] bool
    want: list[bool],  # [B]
) -> list[tuple[list[int], float] | None]:
    """Per wanted row: (kept ids by descending probability, log(p_token / kept mass)).

    Greedy rows report ``([token], 0.0)``, as SGLang does (its greedy sampler is top_k 1). The sampling
    logprob is ``logp[token] - logsumexp(logp[kept])`` in fp32, from the same log softmax as the full
    logprob, so the two share their rounding and ``sampling >= full`` holds to float32 epsilon. A sampled row
    that truncates nothing is not asked for (its support is the vocabulary; see :mod:`.embedded`), and
    would get every id with the full logprob. Only wanted rows are gathered: the other rows cost nothing."""
    out: list[tuple[list[int], float] | None] = []
    for b, wanted in enumerate(want):
        if not wanted:
            out.append(None)
            continue
        tok = int(tokens[b])
        if bool(greedy[b]):
            out.append(([tok], 0.0))
            continue
        # A kept token whose probability underflowed to 0 cannot be drawn: not in the support (SGLang: weights > 0).
        keep = probs[b] > 0 if drop is None else ~drop[b] & (probs[b] > 0)  # [V]
        ids = keep.nonzero().squeeze(-1)  # [K] vocabulary order
        order = probs[b, ids].sort(descending=True, stable=True).indices  # [K]
        mass = torch.logsumexp(logp[b, ids], dim=0)  # log of the kept probability mass
        out.append((ids[order].tolist(), min(float(logp[b, tok] - mass), 0.0)))
    return out


class SamplingRows:
    """The sampling parameters and random streams of a batch's rows, as tensors (see the module docstring)."""

    def __init__(
        self,
        temperature: torch.Tensor,  # [B] float32
        top_p: torch.Tensor,  # [B] float32
        top_k: torch.Tensor,  # [B] long; <= 0 or >= vocab keeps every token
        generators: list[torch.Generator],  # [B] each row's own stream (on the CPU)
        want_support: list[bool],  # [B] rows that report their sampling support
    ) -> None:
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.generators, self.want_support = generators, want_support
        self.uniform = torch.zeros(len(generators), UNIFORM_WINDOW, dtype=torch.float64)  # [B, W] the window
        self.col = UNIFORM_WINDOW  # next window column; the window is drawn when it is used up

    @classmethod
    def of(cls, params: list[SamplingParams], generators: list[torch.Generator], vocab: int, device) -> "SamplingRows":
        """Rows of these requests' parameters and generators."""
        return cls(
            torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            # top_k >= vocab keeps every token; clamped so a huge one cannot overflow the tensor
            torch.tensor([max(min(p.top_k, vocab), -1) for p in params], dtype=torch.long, device=device),
            list(generators),
            [p.return_sampling_mask for p in params],
        )

    def __len__(self) -> int:
        return len(self.generators)

    def sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list | None]:
        """One token per row from ``logits`` [B, V] with the rows' next uniforms: (tokens [B], logprobs [B],
        supports or None)."""
        if self.col == UNIFORM_WINDOW:
            self.uniform = _draw(self.generators, UNIFORM_WINDOW)
            self.col = 0
        uniform = self.uniform[:, self.col]  # [B]
        self.col += 1
        return self._tokens(logits, uniform)

    def sample_first(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list | None]:
        """:meth:`sample` for the token of the rows' prefill: one draw per row, the window left for the batch
        the rows join (:meth:`merge` draws it to that batch's phase)."""
        return self._tokens(logits, _draw(self.generators, 1)[:, 0])

    def _tokens(self, logits: torch.Tensor, uniform: torch.Tensor):
        want = self.want_support if any(self.want_support) else None
        return _sample(logits.float(), self.temperature, self.top_p, self.top_k, uniform, want_support=want)

    def select(self, keep: list[int], index: torch.Tensor) -> "SamplingRows":
        """The rows ``keep`` (``index``: the same as a long tensor on the rows' device)."""
        out = SamplingRows(
            self.temperature.index_select(0, index),
            self.top_p.index_select(0, index),
            self.top_k.index_select(0, index),
            [self.generators[i] for i in keep],
            [self.want_support[i] for i in keep],
        )
        out.uniform, out.col = self.uniform[keep], self.col
        return out

    def merge(self, new: "SamplingRows") -> "SamplingRows":
        """These rows then ``new``'s, whose windows are drawn from here on to this batch's phase."""
        if not len(self):
            return new
        out = SamplingRows(
            torch.cat([self.temperature, new.temperature]),
            torch.cat([self.top_p, new.top_p]),
            torch.cat([self.top_k, new.top_k]),
            self.generators + new.generators,
            self.want_support + new.want_support,
        )
        fresh = torch.zeros(len(new), UNIFORM_WINDOW, dtype=torch.float64)  # [B', W]
        if self.col < UNIFORM_WINDOW:
            fresh[:, self.col :] = _draw(new.generators, UNIFORM_WINDOW - self.col)
        out.uniform, out.col = torch.cat([self.uniform, fresh]), self.col
        return out


def _draw(generators: list[torch.Generator], n: int) -> torch.Tensor:
    """[B, n] float64: the next n uniforms of each row's generator."""
    return torch.stack([torch.rand(n, generator=g, dtype=torch.float64) for g in generators])
