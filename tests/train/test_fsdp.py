"""FSDP2 over a gloo world of 2 CPU processes: the same gradient as one process on the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rollshard.store.loader import LoaderConfig, RolloutLoader
from rollshard.train.backends.distributed import DistEnv

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from fsdp_grad_worker import one_step_gradients  # noqa: E402


def uneven_budget(data) -> int:
    """A micro-batch budget at which the two ranks' first steps have different micro-batch counts."""
    for budget in range(48, 200, 8):
        counts = []
        for rank in (0, 1):
            with RolloutLoader(data, LoaderConfig(groups_per_step=2, micro_batch_tokens=budget), rank=rank, world_size=2) as ld:
                counts.append(len(next(iter(ld)).micro_batches))
        if counts[0] != counts[1]:
            return budget
    raise AssertionError("no budget gives the ranks different micro-batch counts")


def test_two_process_gradients_equal_one_process(tiny_dataset, tiny_gpt2, tmp_path):
    # World 1 with 4 groups per step vs world 2 with 2 per rank: the loader hands the same 4 groups
    # (rank r takes the r-th slice of each global step); summed gradients must match. The ranks get
    # different micro-batch counts, so one of them runs zero-weight padding passes.
    budget = uneven_budget(tiny_dataset)
    one_step_gradients(str(tiny_dataset), str(tiny_gpt2), str(tmp_path / "one"), 4, budget, DistEnv())
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", str(HERE / "fsdp_grad_worker.py"),
         str(tiny_dataset), str(tiny_gpt2), str(tmp_path / "two"), "2", str(budget)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts = [int((tmp_path / "two" / f"micro_batches-{r}").read_text()) for r in (0, 1)]
    assert counts[0] != counts[1]

    g1 = load_file(str(tmp_path / "one" / "grads.safetensors"))
    g2 = load_file(str(tmp_path / "two" / "grads.safetensors"))
    assert set(g1) == set(g2) and len(g1) > 10
    for name in g1:
        assert g1[name].abs().max() > 0, name
        assert (g2[name] - g1[name]).abs().max() <= 1e-6 + 1e-5 * g1[name].abs().max(), name
    m1 = json.loads((tmp_path / "one" / "metrics.json").read_text())
    m2 = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert m2["data/groups"] == m1["data/groups"] == 4
    assert m2["loss/total"] == pytest.approx(m1["loss/total"], abs=1e-6)
    assert m2["optim/grad_norm"] == pytest.approx(m1["optim/grad_norm"], rel=1e-5)
    assert m2["reward/mean"] == pytest.approx(m1["reward/mean"], abs=1e-6)

    # The checkpoint gathered from the shards reloads into the shards exactly (weights and AdamW moments).
    for world in ("one", "two"):
        resume = json.loads((tmp_path / world / "resume.json").read_text())
        assert resume == {"step": 1, "weights": 0.0, "moments": 0.0}, world
    w1 = load_file(str(tmp_path / "one" / "checkpoints" / "latest" / "model.safetensors"))
    w2 = load_file(str(tmp_path / "two" / "checkpoints" / "latest" / "model.safetensors"))
    # After one AdamW step (lr 1e-6, ~lr per weight) both worlds hold the same weights.
    assert set(w1) == set(w2) and max((w2[k] - w1[k]).abs().max().item() for k in w1) < 1e-7
