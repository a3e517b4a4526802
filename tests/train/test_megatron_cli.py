"""rollshard-train's megatron options: what it refuses, each in one line with the fix (exit 2, no traceback)."""

from __future__ import annotations

from rollshard.train.cli import main as train_main


def run(capsys, *argv) -> tuple[int, str]:
    code = train_main([str(a) for a in argv])
    return code, capsys.readouterr().err


def test_megatron_options_refused_in_one_line(tiny_dataset, tiny_gpt2, tiny_qwen3, tmp_path, capsys):
    base = ["--data", tiny_dataset, "--out", tmp_path / "run", "--no-progress", "--no-tensorboard", "--max-steps", "1"]
    code, err = run(capsys, *base, "--model", tiny_qwen3, "--tp", "2")
    assert code == 2 and err == (
        "rollshard-train: error: --tp, --pp and --ep split a megatron model; add --backend megatron (the hf backend "
        "shards with FSDP)\n"
    )
    code, err = run(capsys, *base, "--model", tiny_qwen3, "--backend", "megatron", "--tp", "2")
    assert code == 2 and err == (
        "rollshard-train: error: 1 processes do not split into --tp 2 x --pp 1 (x --ep 1 experts): launch a multiple "
        "of 2 processes with torchrun, or change --tp/--pp/--ep\n"
    )
    code, err = run(capsys, *base, "--model", tiny_gpt2, "--backend", "megatron")
    assert code == 2 and err == (
        "rollshard-train: error: --backend megatron builds Llama-style models (llama, qwen2, qwen3, qwen3_moe), not "
        "model type 'gpt2'; use --backend hf for it\n"
    )
    code, err = run(capsys, *base, "--model", tiny_qwen3, "--backend", "megatron", "--ep", "2")
    assert code == 2 and err.startswith("rollshard-train: error: 1 processes do not split") and err.count("\n") == 1
