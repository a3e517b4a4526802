"""Packed logprob recomputation equals per-sequence transformers forwards; chunking changes nothing."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollshard.train.logprobs import PackedPolicy, packed_logprobs, sampling_temperature

# fp32 CPU: packed and unpacked forwards differ only in summation order.
TOL = 1e-5


def _pack(seqs, prompt_lens, temps):
    ids = torch.cat([torch.tensor(s) for s in seqs])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    mask = torch.cat([torch.tensor([0.0] * p + [1.0] * (len(s) - p)) for s, p in zip(seqs, prompt_lens)])
    temp = torch.cat([torch.full((len(s),), t) for s, t in zip(seqs, temps)])
    cu = torch.tensor([0] + list(torch.tensor([len(s) for s in seqs]).cumsum(0)))
    return ids, pos, mask, temp, cu


def _reference(model, seqs, prompt_lens, temps):
    """Per-sequence: log_softmax(logits / T) of the next token, as SGLang defines it (T <= 0 -> 1)."""
    out = []
    for s, p, t in zip(seqs, prompt_lens, temps):
        with torch.no_grad():
            logits = model(torch.tensor([s])).logits[0].float()  # [L, V]
        lp = torch.log_softmax(logits / (t if t > 0 else 1.0), dim=-1)
        row = torch.zeros(len(s))
        for i in range(p, len(s)):
            row[i] = lp[i - 1, s[i]]
        out.append(row)
    return torch.cat(out)


@pytest.fixture(params=["tiny_gpt2", "tiny_qwen3"])
def model(request):
    path = request.getfixturevalue(request.param)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    return m.eval()


def _batch(vocab):
    g = torch.Generator().manual_seed(0)
    lens, prompt_lens = [9, 1 + 4, 13, 6], [4, 1, 5, 3]
    seqs = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
    return seqs, prompt_lens, [1.0, 0.7, 0.0, 1.3]


def test_packed_equals_per_sequence(model):
    seqs, prompt_lens, temps = _batch(model.config.vocab_size)
    ids, pos, mask, temp, _ = _pack(seqs, prompt_lens, temps)
    policy = PackedPolicy(model, chunk_tokens=1024)
    logp, _ = packed_logprobs(policy, input_ids=ids, position_ids=pos, loss_mask=mask, temperature=temp)
    expected = _reference(model, seqs, prompt_lens, temps)
    assert (logp[mask == 0] == 0).all()
    assert (logp[mask > 0] < 0).all()
    torch.testing.assert_close(logp, expected, atol=TOL, rtol=0)
    # Cross-sequence attention would change the later sequences: make sure the test would see it.
    at = torch.nonzero(mask).flatten()
    leaked = PackedPolicy(model)(ids, torch.arange(len(ids)), at, sampling_temperature(temp)[at])[0]
    assert (leaked - expected[mask > 0]).abs().max() > 1e-3


def test_chunked_equals_unchunked_values_and_gradients(tiny_gpt2):
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2, dtype=torch.float32).eval()
    seqs, prompt_lens, temps = _batch(model.config.vocab_size)
    ids, pos, mask, temp, _ = _pack(seqs, prompt_lens, temps)
    weights = torch.linspace(-1, 1, len(ids))
    results = []
    for chunk in (1024, 3):
        model.zero_grad()
        policy = PackedPolicy(model, chunk_tokens=chunk)
        logp, ent = packed_logprobs(
            policy, input_ids=ids, position_ids=pos, loss_mask=mask, temperature=temp, with_entropy=True
        )
        ((logp * weights).sum() + ent.sum()).backward()
        grad = model.get_output_embeddings().weight.grad.clone()
        results.append((logp.detach(), ent.detach(), grad))
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results
    torch.testing.assert_close(lp_b, lp_a, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent_b, ent_a, atol=1e-6, rtol=0)
    torch.testing.assert_close(g_b, g_a, atol=1e-6, rtol=1e-5)
    # Entropy of a 1024-way distribution from a near-uniform random model: close to log(1024) = 6.93.
    assert 6.0 < ent_a[mask > 0].mean().item() <= 6.94


def test_loss_on_first_token_is_refused(tiny_gpt2):
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2, dtype=torch.float32).eval()
    with pytest.raises(ValueError, match="prompt token"):
        packed_logprobs(
            PackedPolicy(model),
            input_ids=torch.tensor([5, 6]),
            position_ids=torch.tensor([0, 1]),
            loss_mask=torch.tensor([1.0, 1.0]),
            temperature=torch.ones(2),
        )
