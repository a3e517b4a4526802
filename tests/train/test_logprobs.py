"""Packed logprob recomputation equals per-sequence transformers forwards; chunking changes nothing."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollshard.train.logprobs import PackedPolicy, Support, packed_logprobs, sampling_temperature

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


def test_greedy_threshold_matches_the_engines():
    """Temperatures below 1e-6 are greedy (SGLang's _SAMPLING_EPS): divide by 1, not by T."""
    from rollshard.generate.engines.embedded import sample_tokens

    temps = torch.tensor([0.0, 5e-7, 9.9e-7, 1e-6, 0.7])
    torch.testing.assert_close(sampling_temperature(temps), torch.tensor([1.0, 1.0, 1.0, 1e-6, 0.7]), atol=0, rtol=0)
    # The embedded engine agrees on the same rows: logits [2, 1, 0], greedy -> token 0 with
    # log softmax = 2 - log(e^2 + e + 1) = 2 - log(11.1073) = -0.40761.
    logits = torch.tensor([[2.0, 1.0, 0.0]]).repeat(3, 1)
    tokens, lps = sample_tokens(
        logits, torch.tensor([0.0, 5e-7, 9.9e-7]), torch.ones(3), torch.full((3,), -1), torch.zeros(3)
    )
    assert tokens.tolist() == [0, 0, 0]
    torch.testing.assert_close(lps, torch.full((3,), -0.40761), atol=1e-5, rtol=0)
    # T = 1e-6 itself is sampled, not greedy: logits / 1e-6 = [2e6, 1e6, 0] put all the mass on token 0.
    tokens, lps = sample_tokens(logits[:1], torch.tensor([1e-6]), torch.ones(1), torch.full((1,), -1), torch.zeros(1))
    assert tokens.tolist() == [0] and lps.item() == 0.0


def test_row_at_tiny_temperature_is_recomputed_as_greedy(tiny_gpt2):
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2, dtype=torch.float32).eval()
    seqs, prompt_lens, _ = _batch(model.config.vocab_size)
    temps = [5e-7, 0.0, 5e-7, 1.0]
    ids, pos, mask, temp, _ = _pack(seqs, prompt_lens, temps)
    with torch.no_grad():
        logp, _ = packed_logprobs(PackedPolicy(model), input_ids=ids, position_ids=pos, loss_mask=mask, temperature=temp)
    # Reference: log_softmax(logits) for both greedy rows (T = 5e-7 and T = 0), i.e. T = 1.
    expected = _reference(model, seqs, prompt_lens, [1.0, 1.0, 1.0, 1.0])
    torch.testing.assert_close(logp, expected, atol=TOL, rtol=0)
    # Dividing by 5e-7 would have sent every non-argmax logprob towards -1e5: a ~1 nat difference at least.
    assert (logp[mask > 0] > -20).all()


# The tiny random models' logits are about +-1; a trained LM's reach +-30, and bf16 rounding of the head grows
# with them. Scaling the head's weight 16x gives logprobs down to about -30 (tiny_gpt2 ties it to the embedding:
# the hidden states change too, but the comparison below is on whatever hidden states reach the head).
HEAD_SCALE = 16.0


def _head_step(model, fp32_head):
    """Under CPU bf16 autocast: (logp [K], the head's input [K, H] and output dtype, targets [K], temperatures [K])."""
    seqs, prompt_lens, temps = _batch(model.config.vocab_size)
    ids, pos, mask, temp, _ = _pack(seqs, prompt_lens, temps)
    seen = {}
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda mod, args, out: seen.update(h=args[0].detach(), dtype=out.dtype))
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            policy = PackedPolicy(model, fp32_head=fp32_head)
            logp, _ = packed_logprobs(policy, input_ids=ids, position_ids=pos, loss_mask=mask, temperature=temp)
    finally:
        hook.remove()
    at = torch.nonzero(mask).flatten()
    return logp[at], seen["h"], seen["dtype"], ids[at], sampling_temperature(temp)[at]


@pytest.mark.parametrize("fp32_head", [True, False])
def test_head_and_log_softmax_in_fp32_under_bf16_autocast(model, fp32_head):
    # The bf16 body makes the hidden states differ from an fp32 forward; the claim is about the step after it:
    # given the same final hidden states h, the logprobs equal a pure fp32 head + log softmax (autocast off).
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(HEAD_SCALE)
    logp, h, out_dtype, targets, temp = _head_step(model, fp32_head)
    weight = model.get_output_embeddings().weight.detach()  # [V, H] fp32 master weight
    logits = torch.nn.functional.linear(h.float(), weight)  # [K, V] pure fp32, outside autocast
    expected = torch.log_softmax(logits / temp[:, None], dim=-1).gather(-1, targets[:, None]).squeeze(-1)  # [K]
    assert expected.min() < -20  # logits at a trained LM's scale
    err = (logp - expected).abs()
    if fp32_head:
        assert out_dtype == torch.float32
        assert err.max() <= 1e-5, err.max()
    else:
        # The old path: a bf16 head, upcast after; measured 0.03 mean / 0.09 max nats here, as on real models.
        assert out_dtype == torch.bfloat16
        assert err.mean() > 1e-2 and err.max() > 3e-2, (err.mean(), err.max())


# -- sampling supports (schema 1.1): the logprob renormalized over the engine's support -------------------


class _LogitsModel(torch.nn.Module):
    """A stand-in causal LM whose "hidden state" at position t is a free [V] row and whose head is the identity:
    PackedPolicy's logits at t are exactly ``rows[t]``, so its support path can be checked on random logits."""

    def __init__(self, rows: torch.Tensor):  # [T, V]
        super().__init__()
        self.rows = torch.nn.Parameter(rows)
        self.config = type("Config", (), {})()
        self.head = torch.nn.Identity()

    def base_model(self, input_ids, position_ids, use_cache):
        return type("Out", (), {"last_hidden_state": self.rows.unsqueeze(0)})()

    def get_output_embeddings(self):
        return self.head


def _random_supports(T=23, V=17, seed=0):
    """Packed positions 1..T-1 carry loss except a few; supports of sizes 1..V (the target among them; one token,
    as top_k=1 or greedy, and the whole vocabulary among them), a few loss positions without one; a temperature
    per token."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, V, generator=g) * 3  # [T, V]
    ids = torch.randint(0, V, (T,), generator=g)  # [T]
    mask = torch.ones(T)
    mask[[0, 7, 8]] = 0  # position 0 never carries loss; 7, 8: a prompt / tool span
    temp = torch.rand(T, generator=g) * 1.5 + 0.3  # [T]
    has = (mask > 0) & (torch.rand(T, generator=g) > 0.2)
    supports = []
    for t in range(T):
        if not has[t]:
            supports.append([])
            continue
        size = 1 if t % 5 == 0 else V if t % 6 == 0 else int(torch.randint(1, V + 1, (), generator=g))
        others = [int(v) for v in torch.randperm(V, generator=g) if int(v) != int(ids[t])][: size - 1]
        supports.append(sorted(others + [int(ids[t])]) if t % 2 else others + [int(ids[t])])
    offsets = torch.tensor([0] + [len(s) for s in supports]).cumsum(0)  # [T+1]
    flat = torch.tensor([v for s in supports for v in s], dtype=torch.int64)  # [N]
    return logits, ids, mask, temp, has, supports, Support(has_support=has, ids=flat, offsets=offsets)


def _direct(logits, ids, mask, temp, supports):
    """The definition, position by position: logits[y]/T - logsumexp(logits[S]/T), and the mass on S."""
    T = len(ids)
    logp, sup_lp, mass = torch.zeros(T), torch.zeros(T), torch.zeros(T)
    for t in range(1, T):
        if mask[t] == 0:
            continue
        row = logits[t - 1] / temp[t]  # logits at t-1 predict token t
        logp = logp.index_put((torch.tensor(t),), row[ids[t]] - torch.logsumexp(row, 0))
        if supports[t]:
            s_lse = torch.logsumexp(row[supports[t]], 0)
            sup_lp = sup_lp.index_put((torch.tensor(t),), row[ids[t]] - s_lse)
            mass = mass.index_put((torch.tensor(t),), torch.exp(s_lse - torch.logsumexp(row, 0)))
    return logp, sup_lp, mass


@pytest.mark.parametrize("chunk", [1024, 4])
def test_support_logprobs_equal_the_definition_values_and_gradients(chunk):
    logits, ids, mask, temp, has, supports, support = _random_supports()
    T = len(ids)
    w = torch.linspace(-1, 2, T)  # weights that make every output's gradient matter
    u = torch.linspace(1, -0.5, T)
    model = _LogitsModel(logits.clone())
    logp, _, sup = packed_logprobs(
        PackedPolicy(model, chunk_tokens=chunk), input_ids=ids, position_ids=torch.arange(T), loss_mask=mask,
        temperature=temp, support=support,
    )
    ((sup.logp * w).sum() + (sup.mass * u).sum() + logp.sum()).backward()

    leaf = logits.clone().requires_grad_(True)
    e_logp, e_sup, e_mass = _direct(leaf, ids, mask, temp, supports)
    ((e_sup * w).sum() + (e_mass * u).sum() + e_logp.sum()).backward()
    assert (sup.has_support == has).all() and int((mask > 0).sum()) > 4 * 4  # several chunks when chunk = 4
    sizes = {len(s) for s in supports if s}
    assert {1, logits.shape[1]} <= sizes and len(sizes) > 5  # many sizes, one token and the whole vocabulary
    torch.testing.assert_close(sup.logp, e_sup.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(sup.mass, e_mass.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(logp, e_logp.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(model.rows.grad, leaf.grad, atol=1e-6, rtol=1e-5)
    one = [t for t, s in enumerate(supports) if len(s) == 1]
    assert (sup.logp[one] == 0).all() and (sup.mass[has] < 1 + 1e-6).all()  # log(1) and a mass <= 1
    assert (sup.logp[~has] == 0).all() and (sup.mass[~has] == 0).all()


def test_support_leaves_the_full_logprobs_bit_identical():
    """The support path computes the full logprob and entropy exactly as the path without supports, and a batch
    whose supports are all empty gets the full path's values and gradients bit for bit."""
    logits, ids, mask, temp, has, supports, support = _random_supports(seed=1)
    T = len(ids)
    results = []
    for sup in (None, support, Support(has_support=torch.zeros(T, dtype=torch.bool), ids=support.ids[:0],
                                       offsets=torch.zeros(T + 1, dtype=torch.int64))):
        model = _LogitsModel(logits.clone())
        out = packed_logprobs(
            PackedPolicy(model, chunk_tokens=4), input_ids=ids, position_ids=torch.arange(T), loss_mask=mask,
            temperature=temp, with_entropy=True, support=sup,
        )
        (out[0].sum() + out[1].sum()).backward()
        results.append((out[0].detach(), out[1].detach(), model.rows.grad))
    # The path before supports, written out: fp32 logits / T, gather - logsumexp.
    at = torch.nonzero(mask).flatten()
    rows = logits[at - 1] / sampling_temperature(temp)[at].unsqueeze(-1)
    before = torch.zeros(T).index_copy(0, at, rows.gather(-1, ids[at].unsqueeze(-1)).squeeze(-1) - rows.logsumexp(-1))
    for lp, ent, grad in results:
        assert torch.equal(lp, results[0][0]) and torch.equal(ent, results[0][1]) and torch.equal(grad, results[0][2])
    assert torch.equal(results[0][0], before)


def test_a_token_outside_its_support_is_refused():
    logits, ids, mask, temp, has, supports, support = _random_supports(seed=2)
    t = int(torch.nonzero(has)[0])
    bad_ids = support.ids.clone()
    bad_ids[support.offsets[t] : support.offsets[t + 1]] = (ids[t] + 1) % logits.shape[1]
    with pytest.raises(ValueError, match=f"packed position {t}: token {int(ids[t])} is not in its stored sampling"):
        packed_logprobs(
            PackedPolicy(_LogitsModel(logits)), input_ids=ids, position_ids=torch.arange(len(ids)), loss_mask=mask,
            temperature=temp, support=Support(has_support=has, ids=bad_ids, offsets=support.offsets),
        )
