"""The start-up model check: models the logprob path reproduces pass, the others are refused in one line."""

from __future__ import annotations

import math
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollshard.train.backends.distributed import DistEnv
from rollshard.train.backends.hf import HFBackend
from rollshard.train.config import ModelConfig, OptimConfig
from rollshard.train.logprobs import (
    MODEL_CHECK_TOL,
    ModelCheckError,
    check_attention,
    check_model,
    model_check_tolerances,
)

# Dimensions of the architectures built from a config below (random weights, nothing downloaded).
TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128,
)


# A real vocabulary at a real model's logit scale, on small bodies. SmolLM2-135M-Instruct, per position on random
# tokens: logits of mean 6-16 and std 2.4-3.1, top logit 20-33.5, entropy 0.7-6 nats. Its output head shares a mean
# row that its final hidden states align with, which puts the logits' mean far above 0, and a few frequent tokens
# stand well above the rest; _real_scale builds both into random weights.
REAL_SCALE = {
    "Llama": dict(vocab_size=49152),
    "Qwen2": dict(vocab_size=32000),
    "Qwen3": dict(vocab_size=32000, head_dim=16),
    "Qwen3Moe": dict(vocab_size=32000, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "Gemma2": dict(
        vocab_size=32000, head_dim=16, final_logit_softcapping=30.0, attn_implementation="eager",
        layer_types=["full_attention"] * 2,
    ),
}  # fmt: skip
LOGIT_MEAN, LOGIT_STD = 12.0, 3.0  # nats
FREQUENT_TOKENS, FREQUENT_LIFT = 16, (8.0, 20.0)  # tokens whose logits stand 8-20 nats above the mean

# An fp32 Hugging Face folder of HuggingFaceTB/SmolLM2-135M-Instruct (Llama, 49,152 tokens).


def _tiny(request, name: str):
    path = request.getfixturevalue(name)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture(params=["tiny_gpt2", "tiny_qwen3"])
def tiny_model(request):
    return _tiny(request, request.param)


@pytest.fixture(params=["tiny_gpt2", "tiny_qwen3", "real_scale_llama"])
def model(request):
    return _real_scale("Llama") if request.param == "real_scale_llama" else _tiny(request, request.param)


def _built(cls_name: str, **config):
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, f"{cls_name}Config")(**TINY, **config)
    return getattr(transformers, f"{cls_name}ForCausalLM")(cfg).eval()


def _real_scale(cls_name: str) -> torch.nn.Module:
    """A random ``cls_name`` model (hidden 64, 2 layers, a real vocabulary) whose logits look like a real model's."""
    import transformers

    torch.manual_seed(0)
    config = {**TINY, "tie_word_embeddings": False, **REAL_SCALE[cls_name]}
    cfg = getattr(transformers, f"{cls_name}Config")(**config)
    m = getattr(transformers, f"{cls_name}ForCausalLM")(cfg).eval()
    H = cfg.hidden_size
    with torch.no_grad():
        # Every token embedding shares a direction c as long as itself, so every final hidden state h (RMS-normed,
        # |h| ~ sqrt(H)) has h . c/|c| ~ sqrt(H / 2); head rows of LOGIT_MEAN / sqrt(H / 2) along c set the logits'
        # mean, and the rest, N(0, LOGIT_STD / sqrt(H)) per weight, their spread.
        c = torch.randint(0, 2, (H,)).float() * 2 - 1  # [H]
        u = c / c.norm()  # [H]
        m.get_input_embeddings().weight.normal_(0, 1).add_(c)
        head = m.get_output_embeddings().weight  # [V, H]
        head.normal_(0, LOGIT_STD / math.sqrt(H)).add_(LOGIT_MEAN / math.sqrt(H / 2) * u)
        frequent = torch.randperm(cfg.vocab_size)[:FREQUENT_TOKENS]
        lift = torch.empty(FREQUENT_TOKENS).uniform_(*FREQUENT_LIFT)  # [F] nats
        head[frequent] += lift[:, None] / math.sqrt(H / 2) * u
    return m


def _logits(m: torch.nn.Module, n: int = 16) -> torch.Tensor:  # [n, V]
    ids = torch.randint(0, m.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return m(input_ids=ids).logits[0]


def test_tiny_models_pass_to_fp32_rounding(tiny_model):
    diffs = check_model(tiny_model)
    assert set(diffs) == {"position_ids", "logprob", "entropy", "packing"}
    assert max(diffs.values()) <= 1e-5, diffs  # measured <= 2e-6: summation order alone


def test_tolerances_grow_with_the_logit_scale():
    # Per nat of the largest |logit|: 1e-5 for logprobs, 2e-4 for the entropy, from a floor of 10 nats.
    at_smollm2 = model_check_tolerances(33.5)
    assert at_smollm2["logprob"] == pytest.approx(3.35e-4, rel=1e-9)
    assert at_smollm2["position_ids"] == at_smollm2["packing"] == at_smollm2["logprob"]
    assert at_smollm2["entropy"] == pytest.approx(6.7e-3, rel=1e-9)
    small = model_check_tolerances(0.8)
    assert small["logprob"] == pytest.approx(MODEL_CHECK_TOL, rel=1e-9) == 1e-4
    assert small["entropy"] == pytest.approx(2e-3, rel=1e-9)
    assert all(math.isnan(t) for t in model_check_tolerances(float("nan")).values())  # NaN logits fail the check


def test_smollm2_135m_passes(smollm2):
    m = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    assert m.config.model_type == "llama" and m.config.vocab_size == 49152
    diffs = check_model(m)
    # Measured (CPU) at its logit scale of 33.5 nats: logprobs 1.3e-5 apart and entropies 5.2e-4, the rounding of
    # the trainer's lse - E_p[logit], which a fixed 1e-4 would refuse; the tolerances there: 3.35e-4 and 6.7e-3.
    assert diffs["logprob"] <= 1e-4 and diffs["packing"] <= 1e-4 and diffs["position_ids"] <= 1e-4, diffs


@pytest.mark.parametrize("cls_name", sorted(REAL_SCALE))
def test_real_vocabularies_at_real_logit_scales_pass(cls_name):
    m = _real_scale(cls_name)
    logits = _logits(m)  # [16, V]
    # The statistics of a real model's logits (Gemma 2's are softcapped at 30: a smaller spread and top).
    assert 2.5 <= float(logits.std(-1).mean()) <= 3.5
    assert 7.0 <= float(logits.mean(-1).mean()) <= 14.0
    assert 20.0 <= float(logits.max()) <= 45.0
    diffs = check_model(m)
    # Measured (CPU): logprobs <= 5.7e-6 apart; entropies 1.0e-5 (Gemma2) to 2.1e-4 (Llama, logit scale 38.5), three
    # of the five over 1e-4, so a tolerance that ignored the logit scale would refuse them.
    assert diffs["logprob"] <= 1e-4 and diffs["packing"] <= 1e-4 and diffs["position_ids"] <= 1e-4, diffs


def test_check_leaves_the_global_rng_alone(tiny_qwen3):
    m = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    state = torch.random.get_rng_state()
    check_model(m)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_model_that_drops_position_ids_is_refused(model):
    # The body ignores the position ids it is given: packed sequences become one long causal sequence.
    base = model.base_model
    forward = base.forward
    base.forward = lambda *args, position_ids=None, **kw: forward(*args, **kw)
    with pytest.raises(ModelCheckError, match=rf"model type '{model.config.model_type}' \(packing") as e:
        check_model(model)
    assert "\n" not in str(e.value) and "sdpa" in str(e.value)


def test_model_that_zeroes_given_position_ids_is_refused(model):
    base = model.base_model
    forward = base.forward

    def zeroed(*args, position_ids=None, **kw):
        return forward(*args, position_ids=None if position_ids is None else torch.zeros_like(position_ids), **kw)

    base.forward = zeroed
    with pytest.raises(ModelCheckError, match=r"\(position_ids, .* honours them"):
        check_model(model)


def test_logits_multiplied_in_forward_are_refused(model):
    forward = model.forward

    def doubled(*args, **kw):
        out = forward(*args, **kw)
        out.logits = out.logits * 2
        return out

    model.forward = doubled
    with pytest.raises(ModelCheckError, match=r"\(logprob, .* post-head multiplier"):
        check_model(model)


def _failure(e: pytest.ExceptionInfo, name: str) -> tuple[float, float, float]:
    """(difference, tolerance, logit scale) that a one-line check failure of comparison ``name`` reports."""
    msg = str(e.value)
    assert "\n" not in msg
    found = re.search(rf"\({name}, (\S+) nats > (\S+) allowed at a largest \|logit\| of (\S+)\): ", msg)
    assert found, msg
    return tuple(float(x) for x in found.groups())


def test_a_small_logit_multiplier_at_real_scale_is_refused_by_the_amount_it_moves_logprobs():
    # Logits l times 1.001 move a logprob by 0.001 * (l_y - E_p[l]) to first order: ~0.001 * 10 nats at this scale,
    # 25x the tolerance of ~4e-4 that the 39-nat top logit earns.
    m = _real_scale("Llama")
    forward, seen = m.forward, []

    def scaled(*args, **kw):
        out = forward(*args, **kw)
        seen.append((kw["input_ids"][0], out.logits[0].clone()))  # [L], [L, V] as the head computed them
        out.logits = out.logits * 1.001
        return out

    m.forward = scaled
    with pytest.raises(ModelCheckError) as e:
        check_model(m)
    diff, tol, scale = _failure(e, "logprob")
    ids, logits = seen[0]
    lp = lambda x: torch.log_softmax(x.double(), -1)[:-1].gather(-1, ids[1:, None])  # noqa: E731  [L-1, 1]
    expected = float((lp(logits * 1.001) - lp(logits)).abs().max())
    assert 5e-3 <= expected <= 3e-2  # the worked estimate above
    assert diff == pytest.approx(expected, rel=5e-3)  # 3 significant digits in the message
    assert scale == pytest.approx(1.001 * float(logits.abs().max()), rel=5e-3)
    assert tol == pytest.approx(model_check_tolerances(scale)["logprob"], rel=5e-3)


def test_a_forward_that_changes_only_the_entropy_is_refused_as_entropy():
    # Merging two logits a, b into log((e^a + e^b) / 2) each keeps the logsumexp, so every other token's logprob is
    # unchanged, but not the entropy: p = (0.6, 0.2, 0.2) becomes (0.4, 0.4, 0.2), H from 0.950 to 1.055 nats.
    m = _real_scale("Llama")
    forward, changes = m.forward, []

    def merged(*args, **kw):
        out = forward(*args, **kw)
        ids, logits = kw["input_ids"][0], out.logits[0].clone()  # [L], [L, V]
        rows = torch.arange(ids.numel() - 1)  # [L-1] rows whose next token is scored
        scored = torch.zeros_like(logits, dtype=torch.bool)  # [L, V]
        scored[rows, ids[1:]] = True
        a = logits.masked_fill(scored, -torch.inf).argmax(-1)  # [L] the top token that is not scored
        b = logits.masked_fill(scored, torch.inf).argmin(-1)  # [L] the bottom one
        r = torch.arange(ids.numel())
        both = torch.logaddexp(logits[r, a], logits[r, b]) - math.log(2)  # [L]
        new = logits.clone()
        new[r, a], new[r, b] = both, both
        entropy = lambda x: -(x.double().softmax(-1) * x.double().log_softmax(-1)).sum(-1)  # noqa: E731  [L]
        changes.append(float((entropy(new) - entropy(logits))[:-1].abs().max()))
        out.logits = new[None]
        return out

    m.forward = merged
    with pytest.raises(ModelCheckError, match=r"another entropy .* although the logprobs") as e:
        check_model(m)
    diff, tol, _ = _failure(e, "entropy")  # the logprob comparison before it passed
    assert 0.05 <= changes[0] <= 0.7  # the top token's share (up to ln 2 nats) moved
    assert diff == pytest.approx(changes[0], rel=5e-3)
    assert diff > 10 * tol


@pytest.mark.parametrize(
    "cls_name,config",
    [("Granite", {"logits_scaling": 4.0}), ("Cohere", {"logit_scale": 0.0625})],
)
def test_real_architectures_with_logit_scaling_are_refused(cls_name, config):
    with pytest.raises(ModelCheckError, match=r"\(logprob, "):
        check_model(_built(cls_name, **config))


def test_granite_without_scaling_passes():
    assert max(check_model(_built("Granite", logits_scaling=1.0)).values()) <= 1e-5


def test_gemma2_softcap_is_reproduced_exactly():
    # Gemma 2's forward applies tanh(logits / cap) * cap; the logprob path applies the same cap.
    m = _built("Gemma2", head_dim=16, final_logit_softcapping=0.5, attn_implementation="eager")
    assert max(check_model(m).values()) <= 1e-5
    # The cap matters at this scale (logits ~ +-1 against a cap of 0.5), so skipping it would show.
    ids = torch.arange(3, 10)[None]
    with torch.no_grad():
        capped = torch.log_softmax(m(input_ids=ids).logits, -1)
        m.config.final_logit_softcapping = None
        raw = torch.log_softmax(m(input_ids=ids).logits, -1)
    assert (capped - raw).abs().max() > 1e-2


def test_softcap_in_config_but_not_in_forward_is_refused(tiny_qwen3):
    # Qwen3's forward ignores final_logit_softcapping; the logprob path would apply it and be wrong.
    m = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    m.config.final_logit_softcapping = 0.5
    with pytest.raises(ModelCheckError, match=r"\(logprob, "):
        check_model(m)


def test_half_precision_attention_is_checked_on_sdpa():
    assert check_attention("flash_attention_2") == "sdpa"
    assert check_attention("flash_attention_3") == "sdpa"
    assert check_attention("sdpa") == "sdpa" and check_attention("eager") == "eager"


def _backend(path, **model_kw):
    return HFBackend(ModelConfig(path=str(path), **model_kw), OptimConfig(), env=DistEnv(), total_updates=None)


def test_backend_refuses_a_scaled_model_folder_with_a_user_error(tmp_path):
    _built("Granite", logits_scaling=4.0).save_pretrained(tmp_path / "granite")
    with pytest.raises(ModelCheckError) as e:
        _backend(tmp_path / "granite")
    assert isinstance(e.value, ValueError)  # the CLI turns ValueError into exit 2
    msg = str(e.value)
    assert "\n" not in msg and "'granite'" in msg and "fold the scale into the output head" in msg


@pytest.mark.parametrize("fp32_lm_head", [True, False])
def test_backend_head_dtype_under_bf16_follows_the_config(tiny_gpt2, fp32_lm_head):
    from types import SimpleNamespace

    backend = _backend(tiny_gpt2, dtype="bfloat16", fp32_lm_head=fp32_lm_head)
    assert backend.bf16 and max(backend.model_check.values()) <= MODEL_CHECK_TOL
    seen = {}
    backend.hf_model.get_output_embeddings().register_forward_hook(lambda m, a, out: seen.update(dtype=out.dtype))
    batch = SimpleNamespace(
        input_ids=torch.tensor([5, 6, 7, 8]), cu_seqlens=torch.tensor([0, 4], dtype=torch.int32), num_tokens=4,
        loss_mask=torch.tensor([0.0, 1, 1, 1]), temperatures=torch.full((1,), 0.7),
    )
    logp, _ = backend.logprobs(batch, grad=False)
    assert logp.dtype == torch.float32
    assert seen["dtype"] == (torch.float32 if fp32_lm_head else torch.bfloat16)
