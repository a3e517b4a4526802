"""Tiny local models and the shared tokenizer helper: offline loading, chat template, determinism, CLI."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollshard.generate.models import CONTEXT, IM_END, IM_START, init_model, main
from rollshard.store.models.tokenizer import (
    TokenizerError,
    apply_chat_template,
    decode,
    encode,
    eos_token_ids,
    load_tokenizer,
    render_chat,
)

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 3?"},
]


@pytest.mark.parametrize("fixture, model_type", [("tiny_gpt2", "gpt2"), ("tiny_qwen3", "qwen3")])
def test_folder_loads_offline_with_transformers(request, fixture, model_type):
    path = request.getfixturevalue(fixture)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == model_type
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(tok) == 1024
    assert model.config.max_position_embeddings == CONTEXT == 1024
    assert tok.eos_token == IM_END and tok.pad_token == "<|endoftext|>"
    # Special tokens occupy the first ids: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2.
    assert tok.convert_tokens_to_ids(["<|endoftext|>", IM_START, IM_END]) == [0, 1, 2]
    assert eos_token_ids(tok, path) == [2, 0]
    ids = torch.tensor([apply_chat_template(tok, MESSAGES)])
    with torch.inference_mode():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 1024) and torch.isfinite(logits).all()


def test_gpt2_config_has_what_sglang_reads(tiny_gpt2):
    cfg = json.loads((tiny_gpt2 / "config.json").read_text())
    assert cfg["architectures"] == ["GPT2LMHeadModel"]
    assert (cfg["n_layer"], cfg["n_embd"], cfg["n_head"], cfg["n_positions"]) == (2, 64, 4, 1024)
    assert cfg["torch_dtype"] == "float32"
    # No dropout: a trainer recomputing logprobs in train mode sees the rollout's function.
    assert cfg["attn_pdrop"] == cfg["resid_pdrop"] == cfg["embd_pdrop"] == 0.0
    tok_cfg = json.loads((tiny_gpt2 / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"  # loadable by transformers 4.x too


def test_chat_template_renders_chatml(tiny_gpt2):
    tok = load_tokenizer(tiny_gpt2)
    text = render_chat(tok, MESSAGES)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = apply_chat_template(tok, MESSAGES)
    # Markers are single special-token ids, nothing is added at either end.
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
    assert ids == encode(tok, text)
    assert decode(tok, ids, skip_special_tokens=False) == text
    assert render_chat(tok, MESSAGES[:1], add_generation_prompt=False).endswith("<|im_end|>\n")


def test_byte_level_tokenizer_round_trips_any_text(tiny_gpt2):
    tok = load_tokenizer(tiny_gpt2)
    for text in ["héllo ünïcode 🙂 — ok", "12 + 35 = 47", "\t\n  spaces  ", "日本語のテキスト"]:
        ids = encode(tok, text)
        assert all(0 <= i < 1024 for i in ids)
        assert decode(tok, ids) == text
    # Trained merges make common corpus text compress well below one token per character.
    assert len(encode(tok, "The final answer is 42.")) <= 10


def test_weights_are_a_function_of_the_seed(tmp_path, tiny_gpt2):
    again = init_model(tmp_path / "again", preset="tiny-gpt2", seed=0)
    other = init_model(tmp_path / "other", preset="tiny-gpt2", seed=1)
    a, b, c = (load_file(p / "model.safetensors") for p in (tiny_gpt2, again, other))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["transformer.h.0.attn.c_attn.weight"], c["transformer.h.0.attn.c_attn.weight"])
    assert (tiny_gpt2 / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()


def test_cli_builds_then_keeps_then_refuses_another_preset(tmp_path, capsys):
    path = tmp_path / "m"
    assert main(["--preset", "tiny", str(path)]) == 0
    assert "built tiny-gpt2 model" in capsys.readouterr().out
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert main([str(path)]) == 0
    assert "kept existing" in capsys.readouterr().out
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny-qwen3", str(path)])
    assert e.value.code == 2
    assert "already holds a 'gpt2' model" in capsys.readouterr().err
    assert main(["--preset", "tiny-qwen3", "--force", str(path)]) == 0
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_unknown_preset_and_missing_tokenizer_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown model preset 'huge'; choose one of"):
        init_model(tmp_path / "x", preset="huge")
    with pytest.raises(TokenizerError, match="cannot load a tokenizer from .*init-model"):
        load_tokenizer(tmp_path)
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match="exists and is not a model folder"):
        init_model(tmp_path, preset="tiny")
    assert (tmp_path / "notes.txt").exists()  # never deleted
