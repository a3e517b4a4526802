"""rollshard_varlen: the packed forward equals each sequence's own forward, values and gradients, with no mask."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollshard.train import attention
from rollshard.train.attention import VARLEN, sequence_lengths
from rollshard.train.config import ModelConfig, default_attention
from rollshard.train.logprobs import ModelCheckError, PackedPolicy, check_model, packed_logprobs

# fp32 CPU: packed and alone run the same sdpa kernel on the same sequence; what differs is the summation
# order of the matmuls over a longer T (measured <= 1e-6 on logprobs, <= 4e-6 on gradients as large as 14).
TOL = 1e-5
# Lengths 1 (first, inner and last), short and long: a sequence of one token attends to itself alone.
LENGTHS = [1, 6, 1, 40, 2, 17, 1]


def _load(path, impl: str):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=impl).eval()
    model.config.use_cache = False  # as the backend loads it
    return model


@pytest.fixture(params=["tiny_gpt2", "tiny_qwen3"])  # Qwen3: grouped-query attention (4 query, 2 kv heads), RoPE
def path(request):
    return request.getfixturevalue(request.param)


def _sequences(vocab: int, lengths=LENGTHS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def _loss_weights(T: int) -> torch.Tensor:  # [T] uneven weights, so every position's gradient counts differently
    return torch.linspace(-1.0, 2.0, T)


def _packed(model, seqs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logprob of every token after each sequence's first ([T], 0 at first tokens) and the gradients of a weighted
    sum of them, from one packed forward through the trainer's path."""
    ids = torch.cat(seqs)  # [T]
    pos = torch.cat([torch.arange(s.numel()) for s in seqs])  # [T] restarting at 0
    mask = (pos > 0).float()  # [T]
    model.zero_grad()
    logp, _ = packed_logprobs(
        PackedPolicy(model), input_ids=ids, position_ids=pos, loss_mask=mask, temperature=torch.ones(ids.numel())
    )
    (logp * _loss_weights(ids.numel())).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _alone(model, seqs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The same quantities from one plain forward per sequence (no packing, no position ids)."""
    model.zero_grad()
    weights = _loss_weights(sum(s.numel() for s in seqs)).split([s.numel() for s in seqs])
    rows = []
    for s, w in zip(seqs, weights):
        logits = model(input_ids=s[None]).logits[0].float()  # [L, V]
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, s[1:, None]).squeeze(-1)  # [L-1] t-1 predicts t
        row = torch.cat([torch.zeros(1), lp])  # [L]
        (row * w).sum().backward()
        rows.append(row.detach())
    return torch.cat(rows), {n: p.grad.clone() for n, p in model.named_parameters()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_sequence_lengths_follow_position_restarts():
    # A new sequence wherever the position does not advance by 1 (masking_utils' rule): 0 1 2 | 0 | 0 1.
    assert sequence_lengths(torch.tensor([0, 1, 2, 0, 0, 1])) == [3, 1, 2]
    assert sequence_lengths(torch.arange(5)) == [5]
    assert sequence_lengths(torch.tensor([4, 5, 6])) == [3]  # one sequence that does not start at 0
    assert sequence_lengths(torch.tensor([0])) == [1]


def test_varlen_equals_per_sequence_values_and_gradients(path):
    model = _load(path, VARLEN)
    seqs = _sequences(model.config.vocab_size)
    logp, grads = _packed(model, seqs)
    expected, expected_grads = _alone(_load(path, "sdpa"), seqs)
    mask = torch.cat([torch.arange(s.numel()) for s in seqs]) > 0
    assert (logp[~mask] == 0).all() and (logp[mask] < 0).all()
    torch.testing.assert_close(logp, expected, atol=TOL, rtol=0)
    assert set(grads) == set(expected_grads)
    assert _max_diff(grads, expected_grads) <= TOL
    assert min(float(g.abs().max()) for g in grads.values()) > 1e-3  # every parameter gets a gradient that counts


def test_a_leak_across_sequences_would_be_seen(path, monkeypatch):
    # The comparison above must be able to fail: with the boundaries ignored (one sequence of T tokens, the bug
    # of attending across the packed sequences) both the logprobs and the gradients are far off.
    model = _load(path, VARLEN)
    seqs = _sequences(model.config.vocab_size)
    expected, expected_grads = _alone(_load(path, "sdpa"), seqs)
    monkeypatch.setattr(attention, "sequence_lengths", lambda pos: [pos.numel()])
    leaked, leaked_grads = _packed(model, seqs)
    assert float((leaked - expected).abs().max()) > 1e-3
    assert _max_diff(leaked_grads, expected_grads) > 1e-3


def test_varlen_equals_the_dense_packed_mask(path):
    # The same sequences as transformers' sdpa with its block-diagonal [T, T] mask sees them.
    seqs = _sequences(1000)
    ids, pos = torch.cat(seqs)[None], torch.cat([torch.arange(s.numel()) for s in seqs])[None]  # [1, T]
    with torch.no_grad():
        varlen = _load(path, VARLEN)(input_ids=ids, position_ids=pos).logits
        dense = _load(path, "sdpa")(input_ids=ids, position_ids=pos).logits
    torch.testing.assert_close(varlen, dense, atol=TOL, rtol=0)


def test_no_mask_is_built(tiny_qwen3):
    from transformers.masking_utils import create_causal_mask

    model = _load(tiny_qwen3, VARLEN)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    embeds = torch.zeros(1, 6, model.config.hidden_size)
    assert create_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=None, cache=None,
                              position_ids=pos) is None  # fmt: skip
    model.config._attn_implementation = "sdpa"  # what the dense path builds instead: [1, 1, T, T]
    dense = create_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=None, cache=None,
                               position_ids=pos)  # fmt: skip
    assert dense.shape == (1, 1, 6, 6)


def test_the_model_s_attention_scale_is_kept():
    # GPT-2 without 1/sqrt(d) scaling (scale_attn_weights=False, scaling 1.0): sdpa's default scale would be wrong.
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, scale_attn_weights=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).eval()
    seqs = _sequences(256, [5, 9])
    ids, pos = torch.cat(seqs)[None], torch.cat([torch.arange(s.numel()) for s in seqs])[None]
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        alone = torch.cat([model(input_ids=s[None]).logits[0] for s in seqs])  # [T, V]
        model.set_attn_implementation(VARLEN)
        packed = model(input_ids=ids, position_ids=pos).logits[0]
    torch.testing.assert_close(packed, alone, atol=TOL, rtol=0)


def test_rows_of_a_batch_are_packed_independently(tiny_qwen3):
    # Two rows, each packing other lengths: every row equals its own sequences alone.
    model = _load(tiny_qwen3, VARLEN)
    ref = _load(tiny_qwen3, "sdpa")
    rows = [_sequences(1000, [3, 9]), _sequences(1000, [5, 1, 6])]
    ids = torch.stack([torch.cat(r) for r in rows])  # [2, 12]
    pos = torch.stack([torch.cat([torch.arange(s.numel()) for s in r]) for r in rows])  # [2, 12]
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=pos).logits  # [2, 12, V]
        for b, r in enumerate(rows):
            alone = torch.cat([ref(input_ids=s[None]).logits[0] for s in r])  # [12, V]
            torch.testing.assert_close(out[b], alone, atol=TOL, rtol=0)


def test_sliding_window_equals_per_sequence():
    # Qwen3 with a 4-token window on its first layer: per-sequence band masks equal sdpa's sliding mask alone.
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, use_sliding_window=True, sliding_window=4,
        max_window_layers=1, layer_types=["sliding_attention", "full_attention"], use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = Qwen3ForCausalLM(cfg).eval()
    ref.set_attn_implementation("sdpa")
    seqs = _sequences(256, [3, 11, 1, 8])
    ids, pos = torch.cat(seqs)[None], torch.cat([torch.arange(s.numel()) for s in seqs])[None]
    with torch.no_grad():
        alone = torch.cat([ref(input_ids=s[None]).logits[0] for s in seqs])  # [T, V]
        ref.set_attn_implementation(VARLEN)
        packed = ref(input_ids=ids, position_ids=pos).logits[0]
        ref.config.layer_types = ["full_attention", "full_attention"]  # the window must matter for this test
        ref.model.layers[0].self_attn.sliding_window = None
        unwindowed = ref(input_ids=ids, position_ids=pos).logits[0]
    torch.testing.assert_close(packed, alone, atol=TOL, rtol=0)
    assert float((unwindowed - alone).abs().max()) > 1e-3


def test_padding_and_a_kv_cache_are_refused(tiny_qwen3):
    model = _load(tiny_qwen3, VARLEN)
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="without padding"):
        model(input_ids=ids, attention_mask=torch.tensor([[0, 1, 1, 1]]))
    with pytest.raises(ValueError, match="no KV cache"):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, use_cache=True)


def test_attention_softcapping_is_refused():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, attn_logit_softcapping=50.0,
        layer_types=["full_attention"], use_cache=False,
    )  # fmt: skip
    model = Gemma2ForCausalLM(cfg).eval()
    model.set_attn_implementation(VARLEN)
    with pytest.raises(ValueError, match="softcapping"):
        model(input_ids=torch.tensor([[5, 6, 7]]))


def test_model_check_runs_on_varlen_and_catches_a_leak(path, monkeypatch):
    model = _load(path, VARLEN)
    assert max(check_model(model).values()) <= TOL  # the fp32 start-up check runs on the varlen path itself
    assert model.config._attn_implementation == VARLEN
    monkeypatch.setattr(attention, "sequence_lengths", lambda pos: [pos.numel()])
    with pytest.raises(ModelCheckError, match=r"\(packing"):
        check_model(model)


def test_model_check_catches_a_kernel_that_is_not_causal(path, monkeypatch):
    # Packed and alone agree with each other on such a kernel; the sequences alone run on eager attention too.
    sdpa = torch.nn.functional.scaled_dot_product_attention
    not_causal = types.SimpleNamespace(
        scaled_dot_product_attention=lambda *a, is_causal, **kw: sdpa(*a, is_causal=False, **kw)
    )
    monkeypatch.setattr(attention, "F", not_causal)
    with pytest.raises(ModelCheckError, match=r"\(packing"):
        check_model(_load(path, VARLEN))


def test_auto_is_varlen_without_flash_attn_and_flash_where_it_runs(monkeypatch):
    import importlib.util

    assert ModelConfig().attn_implementation == VARLEN  # this machine: no flash-attn
    assert ModelConfig(attn_implementation="sdpa").attn_implementation == "sdpa"
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: object() if n == "flash_attn" else real_find_spec(n))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert default_attention("auto") == "flash_attention_2"
    assert default_attention("bfloat16") == "flash_attention_2"
    assert default_attention("float32") == VARLEN  # flash attention has no fp32 kernel
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_attention("auto") == VARLEN


def test_backend_loads_the_default_as_varlen(tiny_gpt2):
    # The hf backend passes --attn-implementation to from_pretrained; the default reaches the model resolved.
    from rollshard.train.backends.distributed import DistEnv
    from rollshard.train.backends.hf import HFBackend
    from rollshard.train.config import OptimConfig

    backend = HFBackend(ModelConfig(path=str(tiny_gpt2)), OptimConfig(), env=DistEnv(), total_updates=None)
    assert backend.hf_model.config._attn_implementation == VARLEN
    assert max(backend.model_check.values()) <= TOL


@pytest.mark.parametrize("L,window", [(11, 4), (16, 4), (9, 8), (23, 5), (7, 1)])
def test_banded_tiles_equal_one_band_mask(L, window):
    # The sliding window in query tiles of `window` equals one [L, L] band mask (masking_utils' rule), GQA too.
    from rollshard.train.attention import banded_attention

    torch.manual_seed(L * 31 + window)
    q, k, v = torch.randn(1, 4, L, 8), torch.randn(1, 2, L, 8), torch.randn(1, 2, L, 8)
    i = torch.arange(L)
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)  # [L, L]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=True)
    torch.testing.assert_close(banded_attention(q, k, v, window, 0.0, None, True), want, atol=1e-6, rtol=0)


def test_refuses_multimodal_position_ids():
    from rollshard.train.attention import varlen_attention_forward

    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=r"\[batch, tokens\]"):
        varlen_attention_forward(torch.nn.Module(), q, q, q, None, position_ids=torch.zeros(3, 1, 5, dtype=torch.long))
