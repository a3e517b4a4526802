"""The start-up model check: models the logprob path reproduces pass, the others are refused in one line."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollshard.train.backends.distributed import DistEnv
from rollshard.train.backends.hf import HFBackend
from rollshard.train.config import ModelConfig, OptimConfig
from rollshard.train.logprobs import MODEL_CHECK_TOL, ModelCheckError, check_attention, check_model

# Dimensions of the architectures built from a config below (random weights, nothing downloaded).
TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128,
)


@pytest.fixture(params=["tiny_gpt2", "tiny_qwen3"])
def model(request):
    path = request.getfixturevalue(request.param)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def _built(cls_name: str, **config):
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, f"{cls_name}Config")(**TINY, **config)
    return getattr(transformers, f"{cls_name}ForCausalLM")(cfg).eval()


def test_tiny_models_pass_to_fp32_rounding(model):
    diffs = check_model(model)
    assert set(diffs) == {"position_ids", "forward", "packing"}
    assert max(diffs.values()) <= 1e-5, diffs  # measured <= 2e-6: summation order alone


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
    with pytest.raises(ModelCheckError, match=r"\(forward, .* post-head multiplier"):
        check_model(model)


@pytest.mark.parametrize(
    "cls_name,config",
    [("Granite", {"logits_scaling": 4.0}), ("Cohere", {"logit_scale": 0.0625})],
)
def test_real_architectures_with_logit_scaling_are_refused(cls_name, config):
    with pytest.raises(ModelCheckError, match=r"\(forward, "):
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
    with pytest.raises(ModelCheckError, match=r"\(forward, "):
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
        input_ids=torch.tensor([5, 6, 7, 8]), position_ids=torch.arange(4),
        loss_mask=torch.tensor([0.0, 1, 1, 1]), temperature=torch.full((4,), 0.7),
    )
    logp, _ = backend.logprobs(batch, grad=False)
    assert logp.dtype == torch.float32
    assert seen["dtype"] == (torch.float32 if fp32_lm_head else torch.bfloat16)
