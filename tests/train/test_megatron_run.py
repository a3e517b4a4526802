"""GRPO through ``rollshard-train --backend megatron --tp 2`` (2 gloo processes) on toy-task shards sampled by the
embedded engine: the run trains, a SIGKILL while saving resumes to the same losses and weights bit for bit, and the
next round, sampled by the embedded engine from the exported checkpoint, scores with a step-0 mismatch <= 1e-5."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollshard.train.checkpoint import SHARDS_DIR, latest_checkpoint
from rollshard.train.cli import main as train_main
from rollshard.train.metrics import read_metrics

HERE = Path(__file__).parent
FP32_LOGPROB_TOL = 1e-5  # embedded engine (batched, KV cache) vs the trainer's packed forward, fp32 CPU
STEPS = 3


def generate(model: Path, out: Path, seed: int) -> None:
    from rollshard.generate.run import main as generate_main

    argv = ["--engine", f"embedded:{model}", "--agents", "single", "--task", "toy", "--n-samples", "4", "--limit", "16",
            "--max-new-tokens", "16", "--out", str(out), "--seed", str(seed), "--no-progress"]  # fmt: skip
    assert generate_main(argv) == 0


def train_args(data: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--backend", "megatron", "--data", str(data), "--model", str(model), "--out", str(out),
        "--groups-per-step", "4", "--max-steps", str(STEPS), "--lr", "5e-3", "--mode", "decoupled",
        # A schedule that depends on the update count, so a resume that lost it would step differently.
        "--lr-decay", "linear", "--min-lr-ratio", "0.1", "--no-progress", "--no-tensorboard", *extra,
    ]  # fmt: skip


def torchrun(mode: str, args: list[str]) -> subprocess.CompletedProcess:
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", "2",
           str(HERE / "megatron_run_worker.py"), mode, *args]
    return subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # four megatron runs of two processes each: ~30 s
def test_grpo_run_resumes_after_sigkill_and_closes_the_loop(tiny_qwen3, tmp_path):
    generate(tiny_qwen3, tmp_path / "round0", seed=0)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"

    proc = torchrun("plain", train_args(tmp_path / "round0", tiny_qwen3, straight, "--tp", "2"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = read_metrics(straight)
    assert len(m) == STEPS
    # Step 0: the policy is the one that sampled: the engine's logprobs are the trainer's, every ratio 1.
    assert m[0]["mismatch/abs_diff_max"] <= FP32_LOGPROB_TOL and m[0]["ratio/mean"] == 1.0
    assert m[1]["mismatch/abs_diff_max"] > 10 * FP32_LOGPROB_TOL  # the updates changed the policy

    # Killed on rank 1 while saving step 2; then resumed to step 3 by new processes.
    crash = torchrun("crash", train_args(tmp_path / "round0", tiny_qwen3, resumed, "--tp", "2", "--save-every", "1"))
    assert crash.returncode != 0 and "Signal 9 (SIGKILL)" in crash.stderr, crash.stderr[-4000:]
    assert latest_checkpoint(resumed).step == 1
    again = torchrun("plain", train_args(tmp_path / "round0", tiny_qwen3, resumed, "--tp", "2", "--save-every", "1",
                                         "--resume"))
    assert again.returncode == 0, again.stderr[-4000:]
    assert [x["loss/total"] for x in read_metrics(resumed)] == [x["loss/total"] for x in m]
    a, b = latest_checkpoint(straight), latest_checkpoint(resumed)
    assert a.step == b.step == STEPS and b.updates == STEPS
    wa, wb = load_file(str(a.path / "model.safetensors")), load_file(str(b.path / "model.safetensors"))
    assert sorted(wa) == sorted(wb) and len(wa) > 20 and all(torch.equal(wa[k], wb[k]) for k in wa)
    for rank in (1, 2):  # each rank's weights and AdamW state, bit for bit
        name = f"shard-{rank:05d}-model-00001-of-00001.safetensors"
        sa, sb = load_file(str(a.path / SHARDS_DIR / name)), load_file(str(b.path / SHARDS_DIR / name))
        assert sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa), name
        assert any(k.endswith("/exp_avg_sq") for k in sa)
    assert json.loads((a.path / "config.json").read_text())["model_type"] == "qwen3"

    # The next round: the embedded engine samples from the exported checkpoint; one process trains on it.
    generate(a.path, tmp_path / "round1", seed=1)
    nxt = tmp_path / "next"
    assert train_main(train_args(tmp_path / "round1", a.path, nxt)) == 0
    m1 = read_metrics(nxt)[0]
    print(f"megatron loop: step-0 max |logp - rollout| {m[0]['mismatch/abs_diff_max']:.2e}, next round "
          f"{m1['mismatch/abs_diff_max']:.2e}")
    assert m1["mismatch/abs_diff_max"] <= FP32_LOGPROB_TOL and m1["ratio/mean"] == pytest.approx(1.0, abs=1e-6)


def test_top_k_rows_train_over_their_support(tiny_qwen3, tmp_path):
    # The embedded engine samples top-k 20 (schema 1.1 rows with supports); at step 0 the megatron backend's
    # logprobs renormalized over each support are the engine's sampling logprobs: ratio 1.
    from rollshard.generate.run import main as generate_main

    argv = ["--engine", f"embedded:{tiny_qwen3}", "--agents", "single", "--task", "toy", "--n-samples", "4",
            "--limit", "8", "--max-new-tokens", "12", "--top-k", "20", "--out", str(tmp_path / "data"), "--no-progress"]
    assert generate_main(argv) == 0
    args = train_args(tmp_path / "data", tiny_qwen3, tmp_path / "run")
    args[args.index("--max-steps") + 1] = "1"
    assert train_main(args) == 0
    m = read_metrics(tmp_path / "run")[0]
    assert m["support/tokens"] == 1.0 and m["support/abs_diff_max"] <= FP32_LOGPROB_TOL
    assert m["ratio/mean"] == pytest.approx(1.0, abs=FP32_LOGPROB_TOL)
    assert m["support/ratio_unrenormalized_mean"] < 0.95  # the full softmax would not have been 1
