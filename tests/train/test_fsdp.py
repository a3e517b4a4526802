"""FSDP2 over a gloo world of 2 CPU processes: the same gradient as one process on the same global batch; sharded
checkpoints (each rank its half) that resume bit for bit after a crash while saving, and load into one process; a
save whose shards did not all reach rank 0's file system is refused on every rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rollshard.store.loader import LoaderConfig, RolloutLoader
from rollshard.train.backends.distributed import DistEnv
from rollshard.train.backends.hf import HFBackend
from rollshard.train.checkpoint import latest_checkpoint
from rollshard.train.config import ModelConfig, OptimConfig, TrainConfig
from rollshard.train.metrics import read_metrics
from rollshard.train.checkpoint import SHARDS_DIR
from rollshard.train.trainer import Trainer
from tests.train.test_checkpoint import safetensors_parts

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
    w1 = load_file(str(tmp_path / "one" / "run" / "checkpoints" / "latest" / "model.safetensors"))
    w2 = load_file(str(tmp_path / "two" / "run" / "checkpoints" / "latest" / "model.safetensors"))
    # After one AdamW step (lr 1e-6, ~lr per weight) both worlds hold the same weights.
    assert set(w1) == set(w2) and max((w2[k] - w1[k]).abs().max().item() for k in w1) < 1e-7


def test_bf16_policy_keeps_embedding_norm_and_head_fp32(tiny_gpt2, tiny_qwen3, tmp_path):
    # FSDP2 mixed precision runs on CPU with gloo, so the dtypes are those of a real run (fsdp_dtype_worker.py).
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", str(HERE / "fsdp_dtype_worker.py"),
         str(tmp_path), f"gpt2={tiny_gpt2}", f"qwen3={tiny_qwen3}"],
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "dtypes.json").read_text())
    for model in ("gpt2", "qwen3"):
        fp32, bf16 = report[f"{model}/fp32_lm_head=True"], report[f"{model}/fp32_lm_head=False"]
        for r in (fp32, bf16):
            assert r["master"] == ["float32"], model  # sharded master weights
            assert r["layer"]["weight"] == r["layer"]["output"] == "bfloat16", model  # the blocks run bf16
            assert r["temperature"] == "float32", model  # the root casts no inputs: a bf16 0.7 would be 0.6992
        assert fp32["embedding"] == {"weight": "float32", "input": "int64", "output": "float32"}, model
        assert fp32["norm"] == {"weight": "float32", "input": "float32", "output": "float32"}, model
        assert fp32["head"] == {"weight": "float32", "input": "float32", "output": "float32"}, model
        # Given the hidden states the head received, the logprobs are a pure fp32 head + log softmax ...
        assert fp32["err_max"] <= 1e-5, model
        # ... while the old bf16 root (fp32_lm_head off) rounds the head: measured 0.03-0.04 mean, 0.07 max nats.
        assert bf16["head"] == {"weight": "bfloat16", "input": "bfloat16", "output": "bfloat16"}, model
        assert bf16["err_mean"] > 1e-2 and bf16["err_max"] > 3e-2, model


def chunks(folder: Path) -> dict[tuple[str, tuple[int, ...]], tuple[str, tuple[str, list[int]], bytes]]:
    """Every chunk of a shards folder: (tensor, offsets) -> (the file holding it, (dtype, shape), bytes)."""
    out = {}
    for f in sorted(folder.glob("shard-*.safetensors")):
        parts, data = safetensors_parts(f)
        info = parts["metadata"]["DCP_SHARDING_INFO"]
        for name, (dtype, shape) in parts["tensors"].items():
            out[name, tuple(info[name]["saved_offsets"])] = (f.name, (dtype, shape), data[name])
    return out


def shard_chunks(folder: Path) -> dict[int, dict[str, tuple[list[int], list[int], int]]]:
    """Per rank, per tensor of its shard file: ``(offsets, shape, bytes)`` of the chunk it holds, from the
    file's safetensors header (DCP's JSON sharding info)."""
    out: dict[int, dict] = {}
    for (name, offsets), (file, (_, shape), data) in chunks(folder).items():
        out.setdefault(int(file.split("-")[1]) - 1, {})[name] = (list(offsets), shape, len(data))
    return out


def assemble(folder: Path, name: str) -> torch.Tensor:
    """One whole tensor put together from the ranks' files by their saved offsets along dim 0 (not through DCP)."""
    parts = []
    for f in sorted(folder.glob("shard-*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            if name in st.keys():
                parts.append((json.loads(st.metadata()["DCP_SHARDING_INFO"])[name]["saved_offsets"], st.get_tensor(name)))
    parts.sort(key=lambda p: p[0])
    return torch.cat([t for _, t in parts]) if parts[0][1].dim() else parts[0][1]


def test_sharded_checkpoint_resumes_exactly_after_a_crash_while_saving(tiny_dataset, tiny_gpt2, tmp_path):
    steps = 3
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", "2",
                str(HERE / "fsdp_resume_worker.py")]
    args = [str(tiny_dataset), str(tiny_gpt2), str(tmp_path), str(steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # 1. Straight to step 3; then the same run again, saving every step, killed on rank 1 while saving step 2.
    first = subprocess.run(torchrun + ["first", *args], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode != 0 and "Signal 9 (SIGKILL)" in first.stderr, first.stderr[-4000:]
    root = tmp_path / "resumed" / "checkpoints"
    assert latest_checkpoint(tmp_path / "resumed").step == 1  # the torn save of step 2 never became the latest
    torn = root / ".tmp-step_00000002" / SHARDS_DIR
    assert len(list(torn.glob("shard-*.safetensors"))) == 2 and not (root / "step_00000002").exists()

    # 2. Resume to step 3 in new processes (a torn save of a step the run does not reach left there too).
    (root / ".tmp-step_00000007" / SHARDS_DIR).mkdir(parents=True)
    second = subprocess.run(torchrun + ["resume", *args], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-4000:]
    straight, resumed = latest_checkpoint(tmp_path / "straight"), latest_checkpoint(tmp_path / "resumed")
    assert straight.step == resumed.step == steps and straight.version == resumed.version == 3
    # Rank 0 cleared the torn saves before the first barrier of the resumed run's first save, and found both ranks'
    # shards in every folder it published.
    assert not list(root.glob(".tmp-*"))

    # Bitwise: the weights (model folder, where format 3 keeps them) and every rank's shards of AdamW state.
    a, b = load_file(str(straight.path / "model.safetensors")), load_file(str(resumed.path / "model.safetensors"))
    assert set(a) == set(b) and len(a) > 10 and all(torch.equal(a[k], b[k]) for k in a)
    files = sorted(p.name for p in (straight.path / SHARDS_DIR).iterdir())
    assert files == sorted(p.name for p in (resumed.path / SHARDS_DIR).iterdir())
    assert files == ["optimizer.json", "shard-00001-model-00001-of-00001.safetensors",
                     "shard-00002-model-00001-of-00001.safetensors"]
    for f in files[1:]:
        sa, sb = load_file(str(straight.path / SHARDS_DIR / f)), load_file(str(resumed.path / SHARDS_DIR / f))
        assert set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa), f
        steps_saved = {v.item() for k, v in sa.items() if k.endswith("/step")}
        assert steps_saved <= {float(steps)}, steps_saved  # AdamW's step count
    assert [m["loss/total"] for m in read_metrics(tmp_path / "straight")] == [
        m["loss/total"] for m in read_metrics(tmp_path / "resumed")
    ]

    # Each rank's file holds its half of each moment: rows [0, R/2) on rank 0, [R/2, R) on rank 1; no weight.
    chunks = shard_chunks(straight.path / SHARDS_DIR)
    weights = load_file(str(straight.path / "model.safetensors"))
    moments_total = 2 * sum(t.numel() * 4 for t in weights.values())  # exp_avg + exp_avg_sq, fp32
    for rank in (0, 1):
        held = chunks[rank]
        moments = sum(n for k, (_, _, n) in held.items() if k.startswith("optim/") and not k.endswith("/step"))
        assert abs(moments - moments_total / 2) <= 0.01 * moments_total, (rank, moments, moments_total)
        assert not any(k.startswith("model/") for k in held), rank
        for name, w in weights.items():
            for key in (f"optim/{name}/exp_avg", f"optim/{name}/exp_avg_sq"):
                offsets, shape, _ = held[key]
                rows = -(-w.shape[0] // 2)  # FSDP2 shards dim 0 in torch.chunk pieces
                assert offsets[0] == rank * rows and shape == [min(rows, w.shape[0] - rank * rows), *w.shape[1:]], key
    # Resuming, each rank read its own file and, from the other's, at most the step counts (one copy is stored).
    step_bytes = 4 * len(weights)
    for rank in (0, 1):
        reads = json.loads((tmp_path / f"reads-{rank}.json").read_text())
        own = sum(n for f, n in reads.items() if f.startswith(f"shard-0000{rank + 1}-"))
        other = sum(n for f, n in reads.items() if f.startswith(f"shard-0000{2 - rank}-"))
        held = sum(n for k, (_, _, n) in chunks[rank].items() if not k.endswith("/step"))
        assert held <= own <= held + step_bytes and other <= step_bytes, (rank, reads)

    # 3. World size 2 -> 1: the shards load into one process (DCP reshards) equal to the ranks' pieces put
    # together, the weights from the model folder; the trainer itself refuses, its loader cursors being per rank.
    one = HFBackend(ModelConfig(path=str(tiny_gpt2)), OptimConfig(), env=DistEnv(), total_updates=None,
                    weights_from=straight.weights_from)
    straight.restore(one)
    for name, p in one.hf_model.named_parameters():
        assert torch.equal(p.detach(), weights[name]), name
        state = one.optimizer.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], assemble(straight.path / SHARDS_DIR, f"optim/{name}/{key}")), (name, key)
        assert state["step"].item() == steps
    assert one.optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    cfg = TrainConfig.from_dict({
        "data": {"path": str(tiny_dataset), "groups_per_step": 2}, "model": {"path": str(tiny_gpt2)},
        "trainer": {"out": str(tmp_path / "straight"), "resume": True, "progress": False, "tensorboard": False},
    })
    with pytest.raises(ValueError, match=r"written by 2 processes, this run has 1; resume with the same number"):
        Trainer(cfg)


def test_each_rank_writes_the_chunks_dcp_writes(tiny_dataset, tiny_gpt2, tmp_path):
    # Each rank streams its shard files out itself. DCP writes the same files: each rank's chunk of every weight and
    # AdamW moment (FSDP2: along dim 0) in that rank's file, the same bytes at the same offsets; a tensor every rank
    # holds whole (AdamW's step) once, in one rank's file (DCP balances which; rollshard: rank 0's).
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", "2",
                str(HERE / "fsdp_resume_worker.py")]
    proc = subprocess.run(torchrun + ["dcp", str(tiny_dataset), str(tiny_gpt2), str(tmp_path), "1"],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [(tmp_path / f"dcp-saves-{r}.txt").read_text() for r in (0, 1)] == ["0", "0"]
    own, dcp = chunks(latest_checkpoint(tmp_path / "own").path / SHARDS_DIR), chunks(tmp_path / "dcp")
    assert own.keys() == dcp.keys() and len(own) > 30
    whole = {key for key in own if key[0].endswith("/step")}
    assert whole and all(own[key][0].startswith("shard-00001-") for key in whole)
    for key in own:
        assert own[key][1:] == dcp[key][1:], key  # dtype, shape and bytes
        assert key in whole or own[key][0] == dcp[key][0], key  # a rank's chunk in that rank's file
    assert {own[k][0] for k in own} == {dcp[k][0] for k in dcp} == {"shard-00001-model-00001-of-00001.safetensors",
                                                                    "shard-00002-model-00001-of-00001.safetensors"}


def test_a_save_missing_a_rank_shards_is_refused_on_every_rank(tiny_dataset, tiny_gpt2, tmp_path):
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", "2",
                str(HERE / "fsdp_resume_worker.py")]
    proc = subprocess.run(torchrun + ["unshared", str(tiny_dataset), str(tiny_gpt2), str(tmp_path), "1"],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and all((tmp_path / f"refused-{r}.txt").exists() for r in (0, 1)), proc.stderr[-4000:]
    refused = [(tmp_path / f"refused-{r}.txt").read_text() for r in (0, 1)]
    assert refused[0] == refused[1] and "\n" not in refused[0]
    assert refused[0] == (
        f"{tmp_path / 'unshared' / 'checkpoints' / '.tmp-step_00000001' / SHARDS_DIR} holds no shard file of rank 1 "
        "(world size 2), so the checkpoint is not published: under torchrun --out must be on a file system every "
        "rank shares"
    )
    assert latest_checkpoint(tmp_path / "unshared") is None
    assert not (tmp_path / "unshared" / "checkpoints" / "step_00000001").exists()


def test_a_signal_one_rank_gets_as_the_data_ends_stops_every_rank_alike(tiny_dataset, tiny_gpt2, tmp_path):
    # Rank 0 alone is signalled between the step boundary's check and the data's end: the ranks agree that the run
    # was stopped, so both write the same (whole) checkpoint instead of rank 0 a whole one and rank 1 the model only.
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", "2",
                str(HERE / "fsdp_resume_worker.py")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(torchrun + ["signal-at-end", str(tiny_dataset), str(tiny_gpt2), str(tmp_path), "0"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "stopped-0.txt").read_text() == "SIGTERM 130"
    assert (tmp_path / "stopped-1.txt").read_text() == "a signal to another rank 130"
    ckpt = latest_checkpoint(tmp_path / "signalled")
    assert ckpt.optimizer and len(list((ckpt.path / SHARDS_DIR).glob("shard-*.safetensors"))) == 2
