"""Hugging Face <-> megatron weight layout (rollshard.train.backends.megatron.weights): bit-exact round trips for
every preset the backend builds and every split, the fused layouts on worked examples, and the configs it refuses."""

from __future__ import annotations

import itertools

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, LlamaConfig, Qwen2Config

from rollshard.train.backends.megatron import weights as W
from rollshard.train.backends.megatron.model import arch_of, check_layout


def split_and_join(hf: dict[str, torch.Tensor], arch, *, tp: int, pp: int, ep: int) -> dict[str, torch.Tensor]:
    parts = {
        (s, r, e): W.to_megatron(hf, arch, tp_rank=r, tp=tp, pp_rank=s, pp=pp, ep_rank=e, ep=ep)
        for s, r, e in itertools.product(range(pp), range(tp), range(ep))
    }
    return W.to_hf(parts, arch, tp=tp, pp=pp, ep=ep)


def random_weights(config) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not (config.tie_word_embeddings and k == "lm_head.weight")}



LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1)]


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_round_trip_of_every_preset_is_bit_exact(preset, tiny_qwen3, tiny_moe):
    folder = {"tiny-qwen3": tiny_qwen3, "tiny-qwen3-moe": tiny_moe}[preset]
    hf = load_file(str(folder / "model.safetensors"))
    arch = arch_of(AutoConfig.from_pretrained(folder))
    layouts = LAYOUTS + ([(1, 1, 2), (2, 1, 2), (1, 2, 4)] if arch.moe else [])
    for tp, pp, ep in layouts:
        check_layout(arch, tp=tp, pp=pp, ep=ep)
        back = split_and_join(hf, arch, tp=tp, pp=pp, ep=ep)
        assert sorted(back) == sorted(hf), (tp, pp, ep)
        assert all(torch.equal(back[k], hf[k]) for k in hf), (tp, pp, ep)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_round_trip_with_qkv_bias_and_untied_head(kind):
    # Qwen2: q/k/v biases; both: an untied output layer, split by vocabulary like the embedding.
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    config = Qwen2Config(**common) if kind == "qwen2" else LlamaConfig(**common)
    hf = random_weights(config)
    arch = arch_of(config)
    assert arch.qkv_bias == (kind == "qwen2") == ("model.layers.0.self_attn.q_proj.bias" in hf)
    assert not arch.tied and "lm_head.weight" in hf
    for tp, pp, ep in LAYOUTS:
        back = split_and_join(hf, arch, tp=tp, pp=pp, ep=ep)
        assert sorted(back) == sorted(hf) and all(torch.equal(back[k], hf[k]) for k in hf), (tp, pp)


def test_fused_layouts_on_worked_examples():
    # 4 query heads in 2 groups, head dim 1, hidden 1: rows labelled q 0-3, k 10-11, v 20-21.
    config = Qwen2Config(vocab_size=4, hidden_size=4, intermediate_size=4, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=1, tie_word_embeddings=True)
    arch = arch_of(config)
    hf = {k: torch.zeros_like(v) for k, v in random_weights(config).items()}
    att = "model.layers.0.self_attn."
    hf[att + "q_proj.weight"] = torch.tensor([[0.0], [1.0], [2.0], [3.0]]).expand(4, 4).clone()
    hf[att + "k_proj.weight"] = torch.tensor([[10.0], [11.0]]).expand(2, 4).clone()
    hf[att + "v_proj.weight"] = torch.tensor([[20.0], [21.0]]).expand(2, 4).clone()
    # gate rows 0-3, up rows 10-13
    hf["model.layers.0.mlp.gate_proj.weight"] = torch.arange(4.0)[:, None].expand(4, 4).clone()
    hf["model.layers.0.mlp.up_proj.weight"] = (10 + torch.arange(4.0))[:, None].expand(4, 4).clone()
    one = W.to_megatron(hf, arch)
    # Per group: its 2 query heads, its key head, its value head.
    assert one["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert one["decoder.layers.0.mlp.linear_fc1.weight"][:, 0].tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    rank1 = W.to_megatron(hf, arch, tp_rank=1, tp=2)
    assert rank1["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist() == [2, 3, 11, 21]
    assert rank1["decoder.layers.0.mlp.linear_fc1.weight"][:, 0].tolist() == [2, 3, 12, 13]  # its gate rows, its up rows


def test_transformer_engine_names_round_trip(tiny_qwen3):
    arch = arch_of(AutoConfig.from_pretrained(tiny_qwen3))
    local = W.to_megatron(load_file(str(tiny_qwen3 / "model.safetensors")), arch)
    te = W.te_names(local, to_te=True)
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in te and "decoder.layers.1.input_layernorm.weight" not in te
    back = W.te_names(te, to_te=False)
    assert sorted(back) == sorted(local) and all(back[k] is local[k] for k in local)


def test_refused_configs_and_layouts_say_why_in_one_line(tiny_gpt2, tiny_qwen3):
    with pytest.raises(ValueError, match=r"^--backend megatron builds Llama-style models .* not model type 'gpt2'; use --backend hf for it$"):
        arch_of(AutoConfig.from_pretrained(tiny_gpt2))
    scaled = LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match=r"does not reproduce rope scaling 'linear' of this llama config"):
        arch_of(scaled)
    with pytest.raises(ValueError, match=r"does not reproduce attention biases \(o_proj's among them\)"):
        arch_of(LlamaConfig(attention_bias=True))
    arch = arch_of(AutoConfig.from_pretrained(tiny_qwen3))
    with pytest.raises(ValueError, match=r"^--tp 4 must divide the attention heads \(4\) and key/value heads \(2\)$"):
        check_layout(arch, tp=4, pp=1, ep=1)
    with pytest.raises(ValueError, match=r"^--pp 3 must divide the 2 layers$"):
        check_layout(arch, tp=1, pp=3, ep=1)
    with pytest.raises(ValueError, match=r"^--ep 2 needs a mixture-of-experts model; this qwen3 is dense$"):
        check_layout(arch, tp=1, pp=1, ep=2)
