"""Recompute the policy's logprob of every stored response token from a packed batch.

One forward over the micro-batch's sequences laid end to end (no padding): the
model gets ``input_ids [1, T]`` and ``position_ids [1, T]`` that restart at 0 for
every sequence, and no attention mask. transformers (the packed-sequence detection
of ``masking_utils``, huggingface/transformers#39194, 4.54 and later; tested with
5.x) derives the sequence boundaries from the position restarts and builds a
block-diagonal causal mask (sdpa, eager) or varlen calls (flash attention), so no
token attends across sequences. ``tests/train/test_logprobs.py`` holds the packed
logprobs equal to per-sequence forwards (GPT-2 and Qwen3).

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
Models that transform logits after the head are supported for
``final_logit_softcapping`` (Gemma 2); other post-head scalings are refused.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rollshard.store.schema import GREEDY_TEMPERATURE_EPS


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

    def __init__(self, model: nn.Module, *, chunk_tokens: int = 1024):
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
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        logging.getLogger("transformers.modeling_utils").addFilter(_PADDING_HINT_FILTER)
        for unsupported in ("logit_scale", "logits_scaling"):
            if getattr(model.config, unsupported, None) not in (None, 1, 1.0):
                raise ValueError(
                    f"{type(model).__name__} scales its logits ({unsupported}); rollshard-train recomputes logprobs "
                    "from the output head and does not apply that scaling, so ratios would be wrong"
                )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        position_ids: torch.Tensor,  # [T]
        targets_at: torch.Tensor,  # [K] positions t whose token input_ids[t] is scored (t >= 1)
        temperature: torch.Tensor,  # [K]
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [K], [K] or None
        out = self.model.base_model(
            input_ids=input_ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0), use_cache=False
        )
        hidden = out.last_hidden_state[0]  # [T, H]
        h = hidden.index_select(0, targets_at - 1)  # [K, H] logits at t-1 predict input_ids[t]
        targets = input_ids.index_select(0, targets_at)  # [K]
        head = self.model.get_output_embeddings()
        K = targets.numel()
        if K <= self.chunk_tokens:
            return _chunk(head, h, targets, temperature, self.softcap, with_entropy)
        logps, ents = [], []
        for s in range(0, K, self.chunk_tokens):
            sl = slice(s, s + self.chunk_tokens)
            if torch.is_grad_enabled():
                lp, ent = checkpoint(
                    _chunk, head, h[sl], targets[sl], temperature[sl], self.softcap, with_entropy, use_reentrant=False
                )
            else:
                lp, ent = _chunk(head, h[sl], targets[sl], temperature[sl], self.softcap, with_entropy)
            logps.append(lp)
            ents.append(ent)
        return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


def _chunk(
    head: nn.Module,
    h: torch.Tensor,  # [C, H]
    targets: torch.Tensor,  # [C]
    temperature: torch.Tensor,  # [C]
    softcap: float | None,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # [C], [C] or None
    """fp32 log softmax of head(h) / temperature at the targets (and the entropy of that distribution)."""
    logits = head(h).float()  # [C, V] fp32 whatever the compute dtype
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits / temperature.unsqueeze(-1)
    lse = torch.logsumexp(logits, dim=-1)  # [C]
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse  # [C]
    entropy = None
    if with_entropy:
        entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # [C] H = lse - E_p[logit]
    return logp, entropy


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


def packed_logprobs(
    policy: nn.Module,
    *,
    input_ids: torch.Tensor,  # [T]
    position_ids: torch.Tensor,  # [T]
    loss_mask: torch.Tensor,  # [T]
    temperature: torch.Tensor,  # [T]
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # [T], [T] or None
    """Logprob (and entropy) of ``input_ids[t]`` at every position with ``loss_mask[t] > 0``; 0 elsewhere."""
    at = loss_positions(loss_mask)  # [K]
    temp = sampling_temperature(temperature.float()).index_select(0, at)  # [K]
    lp, ent = policy(input_ids, position_ids, at, temp, with_entropy)  # [K]
    T = input_ids.numel()
    logp = torch.zeros(T, dtype=lp.dtype, device=lp.device).index_copy(0, at, lp)  # [T]
    entropy = None if ent is None else torch.zeros(T, dtype=ent.dtype, device=ent.device).index_copy(0, at, ent)
    return logp, entropy
