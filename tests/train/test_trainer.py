"""The trainer end to end on the tiny model's own samples: step-0 ratios, accumulation, modes, checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from rollshard.train.checkpoint import CONFIG_FILE, STATE_FILE, latest_checkpoint
from rollshard.train.config import TrainConfig
from rollshard.train.losses import LossNorm
from rollshard.train.metrics import read_metrics
from rollshard.train.trainer import Trainer

# Trainer logprobs (packed, no cache) vs the sampler's (KV cache): fp32 rounding only.
FP32_LOGPROB_TOL = 1e-5


def make_config(data_path, model_path, out, **sections) -> TrainConfig:
    d = {
        "data": {"path": str(data_path), "groups_per_step": 2, "micro_batch_tokens": 128, "shuffle_seed": 1},
        "model": {"path": str(model_path)},
        "optim": {"lr": 1e-3},
        "trainer": {"out": str(out), "max_steps": 2, "progress": False, "tensorboard": False},
    }
    for name, values in sections.items():
        d.setdefault(name, {}).update(values)
    return TrainConfig.from_dict(d).validate()


def train(config: TrainConfig) -> list[dict]:
    trainer = Trainer(config)
    try:
        return trainer.run()
    finally:
        trainer.close()


def test_step0_ratio_one_and_checkpoint_is_a_model_folder(tiny_dataset, tiny_gpt2, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = make_config(tiny_dataset, tiny_gpt2, tmp_path / "run", trainer={"tensorboard": True})
    history = train(config)
    assert len(history) == 2
    m0 = history[0]
    # Unchanged weights: the recomputed logprobs are the sampler's (mask-0 environment tokens excluded).
    assert m0["mismatch/abs_diff_max"] <= FP32_LOGPROB_TOL
    assert abs(m0["ratio/mean"] - 1) < FP32_LOGPROB_TOL and abs(m0["ratio/max"] - 1) < FP32_LOGPROB_TOL
    assert m0["clip/frac_low"] == 0.0 and m0["clip/frac_high"] == 0.0
    assert m0["mismatch/k3_kl"] < 1e-9
    assert m0["is/ess"] == pytest.approx(1.0, abs=1e-6)
    # The update moved the policy: step 1 sees ratios away from 1.
    assert history[1]["mismatch/abs_diff_max"] > 1e-3
    assert m0["optim/grad_norm"] > 0 and m0["optim/lr"] == 1e-3
    assert m0["data/groups"] == 2 and m0["staleness/hist/0"] == m0["data/sequences"]

    ckpt = latest_checkpoint(tmp_path / "run")
    assert ckpt.step == 2 and ckpt.weight_version == "2" and ckpt.updates == 2
    model = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32)
    AutoTokenizer.from_pretrained(ckpt.path)
    before = load_file(str(tiny_gpt2 / "model.safetensors"))
    after = load_file(str(ckpt.path / "model.safetensors"))
    assert set(after) == set(before)
    # Engines load every top-level *.safetensors as weights: the optimizer state must live elsewhere.
    assert [p.name for p in ckpt.path.glob("*.safetensors")] == ["model.safetensors"]
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 1e-4
    assert json.loads((ckpt.path / "config.json").read_text())["torch_dtype"] == "float32"
    assert torch.equal(model.state_dict()["transformer.h.0.attn.c_attn.weight"], after["transformer.h.0.attn.c_attn.weight"])
    saved = TrainConfig.from_dict(yaml.safe_load((ckpt.path / CONFIG_FILE).read_text()))
    assert saved == config
    assert json.loads((ckpt.path / STATE_FILE).read_text())["loader_states"][0]["cursor"]["step"] == 2

    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["loss/total"] == pytest.approx(m0["loss/total"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(tmp_path / "run" / "tb"))
    ev.Reload()
    assert [e.step for e in ev.Scalars("loss/total")] == [1, 2]
    assert "staleness" in ev.Tags()["histograms"]


def test_micro_batch_split_does_not_change_the_step(tiny_dataset, tiny_gpt2, tmp_path):
    # One micro-batch per step vs many: the same loss and gradient (global token normalization).
    # The single micro-batch also takes the chunked, checkpointed logprob path (0.05 MiB = 12 rows of 1024 logits).
    one = train(make_config(tiny_dataset, tiny_gpt2, tmp_path / "a", data={"micro_batch_tokens": 4096},
                            model={"logprob_chunk_mib": 0.05}, trainer={"max_steps": 1}))[0]
    many = train(make_config(tiny_dataset, tiny_gpt2, tmp_path / "b", data={"micro_batch_tokens": 48},
                             trainer={"max_steps": 1}))[0]
    assert one["data/micro_batches"] == 1 and many["data/micro_batches"] >= 3
    assert one["data/loss_tokens"] > 3 * 12  # several chunks
    assert many["loss/total"] == pytest.approx(one["loss/total"], abs=1e-7)
    assert many["optim/grad_norm"] == pytest.approx(one["optim/grad_norm"], rel=1e-5)


def test_decoupled_tis_kl_entropy_at_step0(tiny_dataset, tiny_gpt2, tmp_path):
    config = make_config(
        tiny_dataset, tiny_gpt2, tmp_path / "run",
        loss={"mode": "decoupled", "is_correction": "tis", "kl_coef": 0.1, "entropy_coef": 0.01},
        trainer={"max_steps": 1},
    )
    m = train(config)[0]
    # pi == pi_prox exactly (same weights, same computation); w = pi_prox / pi_rollout ~ 1; KL to the reference 0.
    assert m["ratio/min"] == 1.0 and m["ratio/max"] == 1.0
    assert abs(m["is/max"] - 1) < FP32_LOGPROB_TOL and abs(m["is/min"] - 1) < FP32_LOGPROB_TOL
    assert m["loss/kl"] == 0.0
    assert 5.0 < m["entropy/mean"] < 6.94  # near log(1024) for a random tiny model, lower at T=0.7 rows
    assert m["loss/total"] == pytest.approx(m["loss/policy"] - 0.01 * m["loss/entropy"], abs=1e-6)


def test_mini_batches_make_several_updates(tiny_dataset, tiny_gpt2, tmp_path):
    config = make_config(tiny_dataset, tiny_gpt2, tmp_path / "run", trainer={"max_steps": 1, "mini_batches": 2})
    m = train(config)[0]
    assert latest_checkpoint(tmp_path / "run").updates == 2
    assert m["ratio/max"] > 1 + 1e-4 or m["ratio/min"] < 1 - 1e-4  # the second mini-batch saw updated weights


def test_existing_run_needs_resume_flag(tiny_dataset, tiny_gpt2, tmp_path):
    train(make_config(tiny_dataset, tiny_gpt2, tmp_path / "run", trainer={"max_steps": 1}))
    with pytest.raises(ValueError, match="--resume"):
        Trainer(make_config(tiny_dataset, tiny_gpt2, tmp_path / "run", trainer={"max_steps": 2}))


def _micro_batch(loss_tokens: list[int], prompt: int = 2, tool: int = 3):
    """A packed micro-batch: each sequence has ``prompt`` prompt tokens, then its loss tokens and ``tool``
    masked (loss_mask 0) environment tokens, so response length = loss tokens + tool."""
    from rollshard.store.packing import PackedBatch

    lens = [prompt + n + tool for n in loss_tokens]
    T = sum(lens)
    mask = torch.cat([torch.tensor([0.0] * prompt + [1.0] * n + [0.0] * tool) for n in loss_tokens])
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    S = len(loss_tokens)
    return PackedBatch(
        input_ids=torch.zeros(T, dtype=torch.int64), position_ids=torch.cat([torch.arange(n) for n in lens]),
        cu_seqlens=cu, loss_mask=mask, rollout_logprobs=torch.zeros(T), temperature=torch.ones(T),
        response_start=cu[:-1].long() + prompt, seq_group=torch.arange(S), rewards=torch.zeros(S),
        agents=["a"] * S, sample_ids=[str(i) for i in range(S)], weight_versions=[None] * S,
        num_tokens=T, num_loss_tokens=int(mask.sum()),
    )


class _TwoRanks:
    """DistEnv stand-in: a second rank holding ``other`` (tokens, sequences) per call and a longest of ``longest``."""

    def __init__(self, *, longest: float, other: tuple[float, float]):
        self.longest, self.other, self.calls = longest, other, []

    def all_reduce(self, values, op="sum"):
        self.calls.append(op)
        if op == "max":
            return [max(v, self.longest) for v in values]
        return [v + o for v, o in zip(values, self.other)]


def test_norm_len_is_one_constant_per_step():
    import numpy as np

    from rollshard.train.backends.distributed import DistEnv
    from rollshard.train.trainer import mini_batch_norms, step_norm_len

    # Loss tokens per sequence: mb0 [3, 5], mb1 [2, 9], mb2 [4]; masked tool tokens (3 each) are not counted.
    mbs = [_micro_batch([3, 5]), _micro_batch([2, 9]), _micro_batch([4])]
    one = mini_batch_norms(mbs, np.array_split(np.arange(3), 1), DistEnv())
    two = mini_batch_norms(mbs, np.array_split(np.arange(3), 2), DistEnv())  # parts [0, 1] and [2]
    assert [(n.tokens, n.sequences, n.norm_len) for n in one] == [(23.0, 5.0, 9.0)]
    # The second mini-batch alone has a longest sequence of 4: it still divides by the step's 9.
    assert [(n.tokens, n.sequences, n.norm_len) for n in two] == [(19.0, 4.0, 9.0), (4.0, 1.0, 9.0)]
    # Dr. GRPO: each token's loss weight 1 / (n_seqs * norm_len) uses the same norm_len in every mini-batch.
    assert {n.norm_len for n in two} == {one[0].norm_len}
    # --norm-len wins; the max over ranks is still taken (every rank must call the same collectives).
    assert step_norm_len(mbs, DistEnv(), norm_len=16) == 16.0
    env = _TwoRanks(longest=12.0, other=(10.0, 2.0))
    two = mini_batch_norms(mbs, np.array_split(np.arange(3), 2), env)
    assert [(n.tokens, n.sequences, n.norm_len) for n in two] == [(29.0, 6.0, 12.0), (14.0, 3.0, 12.0)]
    assert env.calls == ["max", "sum", "sum"]  # the length once per step, before the mini-batches
    assert step_norm_len([], DistEnv()) == 0.0


def test_sum_norm_mini_batches_share_the_step_norm_len(tiny_dataset, tiny_gpt2, tmp_path, monkeypatch):
    import rollshard.train.trainer as trainer_mod

    seen = []
    real = trainer_mod.policy_loss

    def spy(*args, norm, **kw):
        seen.append(norm.norm_len)
        return real(*args, norm=norm, **kw)

    monkeypatch.setattr(trainer_mod, "policy_loss", spy)
    config = make_config(
        tiny_dataset, tiny_gpt2, tmp_path / "run", data={"micro_batch_tokens": 48},
        loss={"agg": "seq-mean-token-sum-norm"}, trainer={"max_steps": 1, "mini_batches": 2},
    )
    trainer = Trainer(config)
    try:
        step = next(iter(trainer.loader))
        mbs = step.micro_batches
        half = (len(mbs) + 1) // 2  # np.array_split: the first mini-batch takes the extra micro-batch
        for mb in mbs[half:]:  # the second mini-batch keeps at most 4 loss tokens per sequence
            for a, b in zip(mb.cu_seqlens[:-1].tolist(), mb.cu_seqlens[1:].tolist()):
                on = torch.nonzero(mb.loss_mask[a:b]).flatten() + a
                mb.loss_mask[on[4:]] = 0.0
            mb.num_loss_tokens = int(mb.loss_mask.sum())
        per_mb = [LossNorm.of(mb.loss_mask, mb.cu_seqlens).norm_len for mb in mbs]
        trainer.train_step(step)
    finally:
        trainer.close()
    # Loss tokens of the longest sequence: 10 (max_new_tokens) in the first mini-batch, 4 in the second;
    # both mini-batches divide by the step's 10.
    assert max(per_mb[:half]) == 10.0 and max(per_mb[half:]) == 4.0
    assert len(seen) == len(mbs) >= 3
    assert set(seen) == {max(per_mb)}
