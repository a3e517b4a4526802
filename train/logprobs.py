"""Recompute the policy's logprob of every stored response token from a packed batch.

One forward over the micro-batch's sequences laid end to end (no padding): the
model gets ``input_ids [1, T]`` and ``position_ids [1, T]`` that restart at 0 for
every sequence, and no attention mask. The attention derives the sequence boundaries
from the position restarts, so no token attends across sequences: by default
``rollshard_varlen`` (:mod:`rollshard.train.attention`, registered with transformers on
import of this module: causal sdpa on each sequence alone, no ``[T, T]`` mask) or
flash attention's varlen kernel; with ``sdpa`` or ``eager``, transformers' packed-sequence
detection (``masking_utils``, huggingface/transformers#39194, 4.54 and later; tested
with 5.x) builds a dense block-diagonal causal mask. ``tests/train/test_logprobs.py``
and ``tests/train/test_attention.py`` hold the packed logprobs (and gradients) equal to
per-sequence forwards (GPT-2 and Qwen3).

Logprob definition (SGLang's, DESIGN.md "Generate"): ``log_softmax(logits / temperature)``
in fp32 at the token actually stored, where ``temperature`` is the row's sampling
temperature; a row sampled greedily (temperature < ``GREEDY_TEMPERATURE_EPS`` = 1e-6,
SGLang's ``_SAMPLING_EPS``, the engines' threshold) uses 1.

Memory: the base model runs once to hidden states ``[T, H]``; the output head is
applied only at the ``K`` positions that carry loss (response tokens under
``loss_mask``) and in chunks of ``chunk_tokens`` rows, so at most one ``[chunk, V]``
block of fp32 logits exists at a time (:func:`chunk_rows` sizes chunks from a memory
budget: ~880 rows per 512 MiB at a 152k vocabulary). When there is more than one
chunk, each is activation-checkpointed: backward recomputes its logits instead of
keeping all ``[K, V]`` of them alive, at the price of one more output-head matmul.

Precision: with ``fp32_head`` (``ModelConfig.fp32_lm_head``, the default) the output head
runs in fp32 with autocast off, on the fp32 master weights (under FSDP2 the backend keeps
the head, embeddings and final norm out of the bf16 parameter policy), so a bf16 body
changes the hidden states but the head and log softmax add no bf16 rounding (a bf16 head
is ~0.025 mean / 0.08 max nats off, as large as the engine/trainer mismatch itself).

Sampling support (schema 1.1, "sampling-aware ratios"): where the engine truncated
(top-p / top-k) it sampled from the renormalized distribution over a support ``S``, and
the row stores ``S``. Given the supports (:class:`Support`), the same chunks also give,
per position with one,

* ``support_logp = logits[token] / T - logsumexp(logits[S] / T)``: the trainer's logprob
  renormalized over ``S`` (the policy the engine actually sampled from), and
* ``support_mass = exp(logsumexp(logits[S] / T) - logsumexp(logits / T))``: the
  trainer's probability mass on ``S``.

The support's logits are gathered from the ``[chunk, V]`` block that already exists and
reduced per position with segment ops (a max for stability, an ``index_add`` of the
exponentials), so beyond that block only the chunk's support elements are held, however
uneven the support sizes; gradients flow through both. Logits outside ``S`` get no
gradient from ``support_logp``. The entropy stays that of the full distribution (the
regularized quantity is the model, on which the engine truncates afresh every step).
Without supports nothing of this runs: the path, its results and its cost are unchanged.

The model is checked, not trusted: :func:`check_model` runs once at start-up and refuses
a model whose packed logprobs differ from its own forward's (position ids not honoured,
logits transformed after the head other than by ``final_logit_softcapping``, which this
path applies as Gemma 2 does).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rollshard.store.format.schema import GREEDY_TEMPERATURE_EPS
from rollshard.train import attention  # noqa: F401  registers rollshard_varlen before any model is loaded


class _NoPaddingHere(logging.Filter):
    """Drops transformers' "pass an attention_mask" hint: a packed batch has no padding, but a sequence
    ending in the pad/eos id trips its heuristic."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "strongly recommend passing in an `attention_mask`" not in record.getMessage()


_PADDING_HINT_FILTER = _NoPaddingHere()


class PackedPolicy(nn.Module):
    """A causal LM seen as a function: packed token ids -> logprob (and entropy) of chosen tokens.

    Wrapping the model in one module makes the whole computation a single ``forward``,
    which is what FSDP2 needs to gather the root parameters (embeddings, output head).
    """

    def __init__(self, model: nn.Module, *, chunk_tokens: int = 1024, fp32_head: bool = True):
        super().__init__()
        try:
            from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
        except ImportError as e:
            raise RuntimeError(
                "rollshard-train packs sequences and needs the packed-sequence masks of transformers 4.54 or "
                "later (transformers.masking_utils.find_packed_sequence_indices); upgrade transformers"
            ) from e
        self.model = model
        self.chunk_tokens = int(chunk_tokens)
        self.fp32_head = bool(fp32_head)
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        logging.getLogger("transformers.modeling_utils").addFilter(_PADDING_HINT_FILTER)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        position_ids: torch.Tensor,  # [T]
        targets_at: torch.Tensor,  # [K] positions t whose token input_ids[t] is scored (t >= 1)
        temperature: torch.Tensor,  # [K]
        with_entropy: bool = False,
        support_rows: torch.Tensor | None = None,  # [M] row k in [0, K) of each support element, non-decreasing
        support_ids: torch.Tensor | None = None,  # [M] token id of each support element
    ) -> tuple[torch.Tensor, ...]:
        """``(logp [K], entropy [K] | None)``; given a support, also ``(support_logp [K], support_mass [K])``
        (0 at rows without a support element)."""
        out = self.model.base_model(
            input_ids=input_ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0), use_cache=False
        )
        hidden = out.last_hidden_state[0]  # [T, H]
        h = hidden.index_select(0, targets_at - 1)  # [K, H] logits at t-1 predict input_ids[t]
        targets = input_ids.index_select(0, targets_at)  # [K]
        head = self.model.get_output_embeddings()
        K = targets.numel()
        opts = (self.softcap, self.fp32_head, with_entropy)
        with_support = support_rows is not None
        if K <= self.chunk_tokens:
            sup = (support_rows, support_ids) if with_support else ()
            return _chunk(head, h, targets, temperature, *opts, *sup)
        if with_support:
            # Support elements of chunk c are the contiguous run whose rows fall in [c * chunk, (c + 1) * chunk).
            bounds = torch.arange(0, K + self.chunk_tokens, self.chunk_tokens, device=support_rows.device)
            cuts = torch.searchsorted(support_rows, bounds.clamp(max=K)).tolist()  # [chunks + 1]
        parts = []
        for c, s in enumerate(range(0, K, self.chunk_tokens)):
            sl = slice(s, s + self.chunk_tokens)
            sup = (support_rows[cuts[c] : cuts[c + 1]] - s, support_ids[cuts[c] : cuts[c + 1]]) if with_support else ()
            args = (head, h[sl], targets[sl], temperature[sl], *opts, *sup)
            if torch.is_grad_enabled():
                parts.append(checkpoint(_chunk, *args, use_reentrant=False))
            else:
                parts.append(_chunk(*args))
        return tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts))


def _chunk(
    head: nn.Module,
    h: torch.Tensor,  # [C, H]
    targets: torch.Tensor,  # [C]
    temperature: torch.Tensor,  # [C]
    softcap: float | None,
    fp32_head: bool,
    with_entropy: bool,
    support_rows: torch.Tensor | None = None,  # [M_c] row in [0, C) of each support element
    support_ids: torch.Tensor | None = None,  # [M_c]
) -> tuple[torch.Tensor, ...]:  # [C], [C] or None[, [C], [C]]
    """fp32 log softmax of head(h) / temperature at the targets (and the entropy of that distribution); with a
    support, the log softmax over the support at the targets and the probability mass on the support."""
    logits = head_logits(head, h, fp32=fp32_head)  # [C, V] fp32
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits / temperature.unsqueeze(-1)
    lse = torch.logsumexp(logits, dim=-1)  # [C]
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [C]
    logp = picked - lse  # [C]
    entropy = None
    if with_entropy:
        entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # [C] H = lse - E_p[logit]
    if support_rows is None:
        return logp, entropy
    C = targets.numel()
    vals = logits[support_rows, support_ids]  # [M_c] the support's logits / T, gathered from the block
    # Segment logsumexp: subtract the per-row max (detached: any constant gives the same value and gradient).
    peak = torch.full((C,), -torch.inf, device=vals.device).scatter_reduce(0, support_rows, vals.detach(), "amax")
    has = torch.isfinite(peak)  # [C] rows with a support element
    peak = torch.where(has, peak, torch.zeros_like(peak))
    total = torch.zeros(C, device=vals.device).index_add(0, support_rows, torch.exp(vals - peak[support_rows]))  # [C]
    # log(1) = 0 on rows without a support: a log(0) there would put 0 * inf = NaN into the backward.
    support_lse = torch.log(torch.where(has, total, torch.ones_like(total))) + peak  # [C]
    zero = torch.zeros_like(logp)
    support_logp = torch.where(has, picked - support_lse, zero)  # [C]
    support_mass = torch.where(has, torch.exp(support_lse - lse), zero)  # [C]
    return logp, entropy, support_logp, support_mass


def head_logits(head: nn.Module, h: torch.Tensor, *, fp32: bool) -> torch.Tensor:  # [C, V] fp32
    """The output head at hidden states ``h [C, H]``: in fp32 with autocast off, or in the compute dtype, upcast."""
    if not fp32:
        return head(h).float()
    # The weight is fp32 here (master weights; FSDP2 keeps the head out of the bf16 policy); a bf16 one would
    # make this matmul fail loudly rather than round quietly.
    with torch.autocast(h.device.type, enabled=False):
        return head(h.float())


def chunk_rows(vocab_size: int, budget_mib: float) -> int:
    """Positions per chunk so that one chunk's fp32 logits fit in ``budget_mib``."""
    return max(1, int(budget_mib * (1 << 20)) // (4 * vocab_size))


def sampling_temperature(temperature: torch.Tensor) -> torch.Tensor:  # [T]
    """The row temperatures the engine divided by: greedy rows (< GREEDY_TEMPERATURE_EPS) mean 1."""
    return torch.where(temperature < GREEDY_TEMPERATURE_EPS, torch.ones_like(temperature), temperature)


def loss_positions(loss_mask: torch.Tensor) -> torch.Tensor:  # [K]
    """Packed positions whose token carries loss; position 0 of a micro-batch never can (nothing precedes it)."""
    at = torch.nonzero(loss_mask > 0).flatten()  # [K]
    if at.numel() and int(at[0]) == 0:
        raise ValueError("loss_mask is set on the first packed token; every sequence needs at least one prompt token")
    return at


@dataclasses.dataclass(frozen=True)
class Support:
    """The sampling supports of a micro-batch (``PackedBatch`` fields of schema 1.1)."""

    has_support: torch.Tensor  # [T] bool, positions (loss_mask 1) whose row has a support
    ids: torch.Tensor  # [N] int64, the supports of positions t, flat
    offsets: torch.Tensor  # [T+1] int64: position t's support is ids[offsets[t]:offsets[t+1]]

    @classmethod
    def of(cls, batch) -> "Support | None":
        """The batch's supports, or None when no row of it has one."""
        if batch.has_support is None:
            return None
        return cls(has_support=batch.has_support, ids=batch.support_ids, offsets=batch.support_offsets)


@dataclasses.dataclass(frozen=True)
class SupportLogprobs:
    """The trainer's view of the sampling supports, per packed position (0 where ``has_support`` is False)."""

    logp: torch.Tensor  # [T] logprob renormalized over the support: logits[token]/T - logsumexp(logits[S]/T)
    mass: torch.Tensor  # [T] probability mass on the support: exp(logsumexp(logits[S]/T) - logsumexp(logits/T))
    has_support: torch.Tensor  # [T] bool


def support_elements(
    support: Support,
    at: torch.Tensor,  # [K] loss positions
    targets: torch.Tensor,  # [K] token input_ids[at]
) -> tuple[torch.Tensor, torch.Tensor]:  # [M], [M]
    """Row in ``[0, K)`` and token id of every support element of the positions ``at`` (rows non-decreasing);
    ValueError when a supported position's own token is not in its support (a corrupt support: the
    renormalized logprob would be meaningless)."""
    has = support.has_support.index_select(0, at)  # [K]
    start = support.offsets.index_select(0, at)  # [K]
    lengths = torch.where(has, support.offsets.index_select(0, at + 1) - start, torch.zeros_like(start))  # [K]
    rows = torch.repeat_interleave(torch.arange(at.numel(), device=at.device), lengths)  # [M]
    first = torch.cumsum(lengths, 0) - lengths  # [K] index of each row's first element in the [M] list
    flat = start.index_select(0, rows) + torch.arange(rows.numel(), device=at.device) - first.index_select(0, rows)
    ids = support.ids.index_select(0, flat)  # [M]
    found = torch.zeros_like(lengths).index_add(0, rows, (ids == targets.index_select(0, rows)).long())  # [K]
    missing = has & (found == 0)  # [K]
    if bool(missing.any()):
        k = int(missing.nonzero()[0, 0])
        raise ValueError(
            f"packed position {int(at[k])}: token {int(targets[k])} is not in its stored sampling support; the "
            "dataset's sampling_support is corrupt (check it with rollshard-store validate)"
        )
    return rows, ids


def packed_logprobs(
    policy: nn.Module,
    *,
    input_ids: torch.Tensor,  # [T]
    position_ids: torch.Tensor,  # [T]
    loss_mask: torch.Tensor,  # [T]
    temperature: torch.Tensor,  # [T]
    with_entropy: bool = False,
    support: Support | None = None,
) -> tuple:  # [T], [T] or None[, SupportLogprobs]
    """Logprob (and entropy) of ``input_ids[t]`` at every position with ``loss_mask[t] > 0``; 0 elsewhere.

    Given ``support``, a third element: the :class:`SupportLogprobs` of the same forward."""
    at = loss_positions(loss_mask)  # [K]
    temp = sampling_temperature(temperature.float()).index_select(0, at)  # [K]
    T = input_ids.numel()

    def scatter(v: torch.Tensor) -> torch.Tensor:  # [K] -> [T]
        return torch.zeros(T, dtype=v.dtype, device=v.device).index_copy(0, at, v)

    if support is None:
        lp, ent = policy(input_ids, position_ids, at, temp, with_entropy)  # [K]
        return scatter(lp), (None if ent is None else scatter(ent))
    rows, ids = support_elements(support, at, input_ids.index_select(0, at))  # [M]
    lp, ent, sup_lp, mass = policy(input_ids, position_ids, at, temp, with_entropy, rows, ids)  # [K]
    has = support.has_support & (loss_mask > 0)  # [T]
    sup = SupportLogprobs(logp=scatter(sup_lp), mass=scatter(mass), has_support=has)
    return scatter(lp), (None if ent is None else scatter(ent)), sup


# -- the start-up check of the model -------------------------------------------------------------

# fp32 forwards of the same tokens, packed or not, differ only in rounding, and the rounding of a log softmax is
# relative to the logits it reduces: each tolerance is per nat of the model's logit scale (its largest |logit| on
# the check's first sequence, at least MODEL_CHECK_MIN_SCALE). Measured on SmolLM2-135M-Instruct (49,152 tokens;
# per position logits of mean 6-16, std 2.4-3.1, top 20-33.5): logprobs 1.3e-5 nats apart, entropies 5.2e-4.
MODEL_CHECK_MIN_SCALE = 10.0  # nats; the tiny test models' logits are ~1 and their rounding ~1e-6
# Logprobs (the position-id and packing comparisons compare logprobs too): 1e-4 nats at a scale of 10, 3.35e-4
# at SmolLM2's 33.5, 25x its rounding; a logit multiplier 1 + a moves logprobs by about a times the logit spread.
LOGPROB_TOL_PER_NAT = 1e-5
# The trainer's entropy, lse - E_p[logit], carries (sum(p) - 1) * lse of rounding, and an fp32 softmax over 49k
# logits sums to 1 + 1.6e-5 at a peaked position (CPU): 5.2e-4 nats at lse 33.5. 2e-4 per nat (6.7e-3 there)
# leaves 13x; the entropy is a bonus term, and a transform of the logits already shows in the logprobs.
ENTROPY_TOL_PER_NAT = 2e-4
MODEL_CHECK_TOL = LOGPROB_TOL_PER_NAT * MODEL_CHECK_MIN_SCALE  # the logprob tolerance up to 10 nats of logits
MODEL_CHECK_LENGTHS = (7, 5)  # two short sequences: enough for a leak across the boundary to show, and cheap
MODEL_CHECK_SEED = 0
# Attention kernels without fp32 (flash attention): the check runs on sdpa, which does.
HALF_ONLY_ATTENTION_PREFIXES = ("flash_attention", "kernels-community/flash")
# The sequences alone are scored on transformers' eager attention (every model has it; plain fp32 matmuls and
# softmax), so a kernel that agrees with itself packed and alone but is wrong (not causal, another scale) fails too.
REFERENCE_ATTENTION = "eager"

_MODEL_CHECK_FIXES = {
    "position_ids": (
        "gives different logits when passed position_ids 0..L-1 than without them; rollshard-train packs "
        "sequences by position ids, so use a model (or attn_implementation) that honours them"
    ),
    "logprob": (
        "its forward computes logits other than as lm_head(final hidden state) (a post-head multiplier or "
        "scaling, or a final_logit_softcapping in its config that the forward does not apply), which "
        "rollshard-train does not reproduce; use a model without logit scaling, or fold the scale into the output "
        "head's weights"
    ),
    "entropy": (
        "its forward's distribution has another entropy than lm_head(final hidden state) gives although the "
        "logprobs of the scored tokens agree, so the forward changes logits after the head; use a model whose "
        "forward returns lm_head(final hidden state)"
    ),
    "packing": (
        "sequences packed with restarting position_ids get other logprobs than each alone on eager attention, "
        "so packed training would leak attention across sequences (or the attention kernel is wrong); use "
        "attn_implementation rollshard_varlen, sdpa, eager or flash_attention_2 and a transformers version whose "
        "masks follow packed position ids (4.54 or later)"
    ),
}


class ModelCheckError(ValueError):
    """The trainer's logprob path would not reproduce this model's own forward (the CLI exits 2)."""


def check_attention(impl: str | None) -> str | None:
    """The attention implementation the fp32 check runs on: ``impl`` itself unless it has no fp32 kernel."""
    return "sdpa" if impl and impl.startswith(HALF_ONLY_ATTENTION_PREFIXES) else impl


def model_check_tolerances(logit_scale: float) -> dict[str, float]:
    """Nats by which each comparison of :func:`check_model` may differ, at a model's logit scale (largest |logit|)."""
    scale = max(logit_scale, MODEL_CHECK_MIN_SCALE)  # a NaN scale stays NaN, and every comparison fails
    logprob = LOGPROB_TOL_PER_NAT * scale
    return {"position_ids": logprob, "logprob": logprob, "entropy": ENTROPY_TOL_PER_NAT * scale, "packing": logprob}


@torch.no_grad()
def check_model(model: nn.Module, *, chunk_tokens: int = 1024) -> dict[str, float]:
    """Refuse a model whose logprobs this path would get wrong; the largest differences seen, in nats.

    On two short random sequences (a fixed generator), in fp32 with autocast off, each comparison within its
    tolerance at the model's logit scale (:func:`model_check_tolerances`):

    * ``position_ids``: ``model(ids)`` against ``model(ids, position_ids=0..L-1)``: a model that drops
      or alters the position ids it is given (the trainer always gives them);
    * ``logprob``: :class:`PackedPolicy` on one sequence against ``log_softmax(model(ids).logits)``: a forward
      that does more than ``lm_head(final hidden state)`` (a logit multiplier or scaling such as Granite's
      ``logits_scaling``, Cohere's ``logit_scale``, FalconH1's ``lm_head_multiplier``) or a softcap this path
      applies but the forward does not;
    * ``entropy``: the same, for the entropy of the distribution (what ``entropy_coef`` trains on);
    * ``packing``: both sequences packed (positions restarting at 0) against each alone through
      :class:`PackedPolicy` on eager attention (:data:`REFERENCE_ATTENTION`): attention or rotary embeddings
      that do not follow the position restarts, or an attention kernel that is wrong.
    """
    model_type = getattr(model.config, "model_type", type(model).__name__)
    device = next(model.parameters()).device
    impl = getattr(model.config, "_attn_implementation", None)
    if check_attention(impl) != impl:
        model.set_attn_implementation(check_attention(impl))
    try:
        with torch.autocast(device.type, enabled=False):
            diffs, scale = _check_diffs(model, device, chunk_tokens)
    finally:
        if check_attention(impl) != impl:
            model.set_attn_implementation(impl)
    tolerances = model_check_tolerances(scale)
    for name, diff in diffs.items():
        if not diff <= tolerances[name]:  # NaN fails too
            raise ModelCheckError(
                f"model check failed for model type {model_type!r} ({name}, {diff:.3g} nats > {tolerances[name]:.3g} "
                f"allowed at a largest |logit| of {scale:.3g}): {_MODEL_CHECK_FIXES[name]}"
            )
    return diffs


def _check_diffs(model: nn.Module, device: torch.device, chunk_tokens: int) -> tuple[dict[str, float], float]:
    """The largest difference of each comparison, in nats, and the logit scale (largest |logit|) they are held to."""
    g = torch.Generator().manual_seed(MODEL_CHECK_SEED)
    vocab = model.get_input_embeddings().weight.shape[0]
    seqs = [torch.randint(0, vocab, (n,), generator=g).to(device) for n in MODEL_CHECK_LENGTHS]
    policy = PackedPolicy(model, chunk_tokens=chunk_tokens)

    def alone(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [L-1], [L-1]
        at = torch.arange(1, ids.numel(), device=device)  # [L-1] every token after the first
        return policy(ids, torch.arange(ids.numel(), device=device), at, torch.ones(at.numel(), device=device), True)

    first = seqs[0]
    pos = torch.arange(first.numel(), device=device)
    logits = model(input_ids=first[None]).logits[0].float()  # [L, V]
    plain = torch.log_softmax(logits, dim=-1)  # [L, V]
    given = torch.log_softmax(model(input_ids=first[None], position_ids=pos[None]).logits[0].float(), dim=-1)
    lp, ent = alone(first)  # [L-1]
    expected_lp = plain[:-1].gather(-1, first[1:, None]).squeeze(-1)  # [L-1] logits at t-1 predict token t
    expected_ent = -(plain[:-1].exp() * plain[:-1]).sum(-1)  # [L-1]

    ids = torch.cat(seqs)  # [T]
    positions = torch.cat([torch.arange(s.numel(), device=device) for s in seqs])  # [T] restarting at 0
    at = torch.nonzero(positions > 0).flatten()  # [K] every token but each sequence's first
    packed, _ = policy(ids, positions, at, torch.ones(at.numel(), device=device))  # [K]
    impl = model.config._attn_implementation
    model.set_attn_implementation(REFERENCE_ATTENTION)
    try:
        separate = torch.cat([alone(s)[0] for s in seqs])  # [K]
    finally:
        model.set_attn_implementation(impl)
    diffs = {
        "position_ids": float((plain - given).abs().max()),
        "logprob": float((lp - expected_lp).abs().max()),
        "entropy": float((ent - expected_ent).abs().max()),
        "packing": float((packed - separate).abs().max()),
    }
    return diffs, float(logits.abs().max())
