"""The trainer end to end on the tiny model's own samples: step-0 ratios, accumulation, modes, checkpoints,
versions, the step's metrics and the run's constants."""

from __future__ import annotations

import json
import re
import os
import shutil
import signal

import pytest
import torch
import yaml
from safetensors.torch import load_file

from rollshard.train.checkpoint import (
    CKPT_DIR,
    CONFIG_FILE,
    SHARDS_DIR,
    STATE_FILE,
    checkpoint_name,
    latest_checkpoint,
    read_checkpoint,
)
from rollshard.train.cli import summary_line
from rollshard.train.config import TrainConfig
from rollshard.train.losses import LossNorm
from rollshard.train.metrics import read_metrics
from rollshard.train.trainer import Trainer, prepare_config
from tests.train.conftest import generation_config, write_rows

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
    assert saved == prepare_config(config)
    assert saved.model.path == str(tiny_gpt2.resolve()) and saved.trainer.initial_version == 0  # resolved defaults
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


def test_a_model_only_final_checkpoint_ends_a_run_and_cannot_be_trained_on(tiny_dataset, tiny_gpt2, tmp_path,
                                                                            monkeypatch):
    out = tmp_path / "run"
    # Step 2 is a --save-every step and the run's last: saved once, model only (no whole save dropped after);
    # step 1's checkpoint stays whole.
    def no_drop(*args):
        raise AssertionError("the last step was saved whole first")

    monkeypatch.setattr("rollshard.train.trainer.drop_optimizer_state", no_drop)
    trainer = Trainer(make_config(tiny_dataset, tiny_gpt2, out,
                                  trainer={"save_every": 1, "final_checkpoint": "model"}))
    try:
        trainer.run()
    finally:
        trainer.close()
    monkeypatch.undo()
    ckpt = latest_checkpoint(out)
    assert (ckpt.step, ckpt.updates, ckpt.weight_version, ckpt.optimizer) == (2, 2, "2", False)
    assert not (ckpt.path / SHARDS_DIR).exists() and json.loads((ckpt.path / STATE_FILE).read_text())["optimizer"] is False
    weights = load_file(str(ckpt.path / "model.safetensors"))
    assert all(torch.equal(weights[n], p.detach()) for n, p in trainer.backend.hf_model.named_parameters())
    first = read_checkpoint(out / CKPT_DIR / checkpoint_name(1))
    assert first.optimizer and (first.path / SHARDS_DIR).is_dir()
    assert summary_line(trainer).count("model only, weight version 2") == 1

    # A resume with nothing left to train finishes (a loop's rerun of a round killed after its last save).
    resumed = Trainer(make_config(tiny_dataset, tiny_gpt2, out, trainer={"resume": True}))
    try:
        assert resumed.run() == [] and resumed.step == 2
    finally:
        resumed.close()
    # Training a step would need the moments it left out: refused before the step, in one line; nothing written.
    with pytest.raises(ValueError, match=r"step_00000002 holds the model only \(--final-checkpoint model\), no "
                       r"optimizer state to train on from it; train it as --model into a new --out$"):
        train(make_config(tiny_dataset, tiny_gpt2, out, trainer={"resume": True, "max_steps": 3}))
    assert latest_checkpoint(out).step == 2 and sorted(p.name for p in (out / CKPT_DIR).glob("step_*")) == [
        "step_00000001", "step_00000002"]

    # The data ending right after a --save-every checkpoint: that one is the run's last and loses its moments.
    out = tmp_path / "epoch"
    train(make_config(tiny_dataset, tiny_gpt2, out, data={"num_epochs": 1},
                      trainer={"max_steps": None, "save_every": 1, "final_checkpoint": "model"}))
    last = latest_checkpoint(out)
    assert (last.step, last.optimizer) == (4, False) and not (last.path / SHARDS_DIR).exists()
    assert read_checkpoint(out / CKPT_DIR / checkpoint_name(3)).optimizer

    # A rerun that finds nothing left after a whole checkpoint (a loop round killed after its last save, before
    # that save was made model-only) makes it model-only.
    out = tmp_path / "rerun"
    whole = {"max_steps": None, "save_every": 1}
    train(make_config(tiny_dataset, tiny_gpt2, out, data={"num_epochs": 1}, trainer=whole))
    assert latest_checkpoint(out).optimizer
    train(make_config(tiny_dataset, tiny_gpt2, out, data={"num_epochs": 1},
                      trainer={**whole, "resume": True, "final_checkpoint": "model"}))
    last = latest_checkpoint(out)
    assert (last.step, last.optimizer) == (4, False) and not (last.path / SHARDS_DIR).exists()


def test_a_run_stopped_by_a_signal_saves_whole_whatever_final_checkpoint_says(tiny_dataset, tiny_gpt2, tmp_path):
    # The stop is not the run's end: a --resume trains on from that checkpoint, so it keeps the optimizer state.
    trainer = Trainer(make_config(tiny_dataset, tiny_gpt2, tmp_path / "run",
                                  trainer={"max_steps": 3, "final_checkpoint": "model"}))
    real = trainer.train_step

    def step_then_signal(step):
        metrics = real(step)
        signal.raise_signal(signal.SIGTERM)  # the trainer's handler: stop at the next step boundary
        return metrics

    trainer.train_step = step_then_signal
    try:
        trainer.run()
    finally:
        trainer.close()
    ckpt = latest_checkpoint(tmp_path / "run")
    assert trainer.stopped_by == "SIGTERM" and trainer.exit_status == 130
    assert (ckpt.step, ckpt.optimizer) == (1, True) and (ckpt.path / SHARDS_DIR).is_dir()


def _micro_batch(loss_tokens: list[int], prompt: int = 2, tool: int = 3):
    """A packed micro-batch: each sequence has ``prompt`` prompt tokens, then its loss tokens and ``tool``
    masked (loss_mask 0) environment tokens, so response length = loss tokens + tool."""
    from rollshard.store.loader.packing import PackedBatch

    lens = [prompt + n + tool for n in loss_tokens]
    T = sum(lens)
    mask = torch.cat([torch.tensor([0.0] * prompt + [1.0] * n + [0.0] * tool) for n in loss_tokens])
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    S = len(loss_tokens)
    return PackedBatch(
        input_ids=torch.zeros(T, dtype=torch.int64),
        cu_seqlens=cu, loss_mask=mask, rollout_logprobs=torch.zeros(T), temperatures=torch.ones(S),
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


def test_mini_batch_norms_sum_over_micro_batches_and_ranks():
    import numpy as np

    from rollshard.train.backends.distributed import DistEnv
    from rollshard.train.trainer import mini_batch_norms

    # Loss tokens per sequence: mb0 [3, 5], mb1 [2, 9], mb2 [4]; masked tool tokens (3 each) are not counted.
    mbs = [_micro_batch([3, 5]), _micro_batch([2, 9]), _micro_batch([4])]
    one = mini_batch_norms(mbs, np.array_split(np.arange(3), 1), DistEnv(), norm_len=16)
    two = mini_batch_norms(mbs, np.array_split(np.arange(3), 2), DistEnv(), norm_len=16)  # parts [0, 1] and [2]
    assert [(n.tokens, n.sequences, n.norm_len) for n in one] == [(23.0, 5.0, 16.0)]
    assert [(n.tokens, n.sequences, n.norm_len) for n in two] == [(19.0, 4.0, 16.0), (4.0, 1.0, 16.0)]
    env = _TwoRanks(longest=12.0, other=(10.0, 2.0))
    two = mini_batch_norms(mbs, np.array_split(np.arange(3), 2), env, norm_len=16)
    assert [(n.tokens, n.sequences, n.norm_len) for n in two] == [(29.0, 6.0, 16.0), (14.0, 3.0, 16.0)]
    assert env.calls == ["sum", "sum"]  # no per-step length collective: the length is the run's


def test_run_norm_len_from_the_generation_config():
    from rollshard.train.trainer import run_norm_len

    single = {"agents": {"name": "single", "n_samples": 4}, "sampling": {"max_new_tokens": 512}}
    tools = {"agents": {"name": "tool_loop", "n_samples": 4, "turns": 3}, "sampling": {"max_new_tokens": 100}}
    assert run_norm_len([single]) == 512
    assert run_norm_len([tools]) == 300  # three model turns of up to 100 tokens each (tool text carries no loss)
    assert run_norm_len([single, tools]) == 512  # two writers: the longest row either allows
    assert run_norm_len([{"model": "m"}]) is None  # nothing recorded
    assert run_norm_len([{"agents": {"name": "custom"}, "sampling": {"max_new_tokens": 64}}]) is None  # turns unknown


def test_sum_norm_uses_one_constant_for_the_run(tiny_gpt2, tmp_path, monkeypatch):
    import rollshard.train.trainer as trainer_mod

    seen, longest = [], []
    real = trainer_mod.policy_loss

    def spy(*args, norm, loss_mask, cu_seqlens, **kw):
        seen.append(norm.norm_len)
        longest.append(LossNorm.of(loss_mask, cu_seqlens).norm_len)
        return real(*args, norm=norm, loss_mask=loss_mask, cu_seqlens=cu_seqlens, **kw)

    monkeypatch.setattr(trainer_mod, "policy_loss", spy)
    # Two steps of one group each (in order): responses of 3 tokens, then of 6; the generator allowed 8.
    data = write_rows(tmp_path / "data", [[0.0, 1.0], [1.0, 0.0]], response_len=[3, 6],
                      config=generation_config(tiny_gpt2, max_new_tokens=8))
    config = make_config(data, tiny_gpt2, tmp_path / "run", data={"groups_per_step": 1, "shuffle": False},
                         loss={"agg": "seq-mean-token-sum-norm"}, trainer={"max_steps": None})
    assert len(train(config)) == 2
    # The steps' longest sequences differ (the old default followed them: 3, then 6); the constant does not:
    # the dataset's max_new_tokens x 1 model turn, recorded in the saved config.
    assert longest == [3.0, 6.0]
    assert seen == [8.0, 8.0]
    assert TrainConfig.from_yaml(latest_checkpoint(tmp_path / "run").path / CONFIG_FILE).loss.norm_len == 8


def test_sum_norm_without_a_recorded_length_asks_for_norm_len(tiny_gpt2, tmp_path):
    data = write_rows(tmp_path / "data", [[0.0, 1.0], [1.0, 0.0]], config={"model": "m"})
    config = make_config(data, tiny_gpt2, tmp_path / "run", loss={"agg": "seq-mean-token-sum-norm"})
    with pytest.raises(ValueError, match="pass --norm-len N"):
        Trainer(config)
    config = make_config(data, tiny_gpt2, tmp_path / "run2", loss={"agg": "seq-mean-token-sum-norm", "norm_len": 7})
    trainer = Trainer(config)  # an explicit length needs nothing from the dataset
    trainer.close()
    assert trainer.norm_len == 7.0


def test_initial_version_comes_from_a_checkpoint_folder(tiny_dataset, tiny_gpt2, tmp_path):
    first = make_config(tiny_dataset, tiny_gpt2, tmp_path / "first", trainer={"max_steps": 1, "initial_version": 2})
    train(first)
    latest = tmp_path / "first" / "checkpoints" / "latest"
    assert latest_checkpoint(tmp_path / "first").weight_version == "3"

    m = train(make_config(tiny_dataset, latest, tmp_path / "next", trainer={"max_steps": 1}))[0]
    assert m["train/weight_version"] == 4.0
    assert m["staleness/hist/3"] == m["data/sequences"]  # rows of version 0 against the policy of version 3
    ckpt = latest_checkpoint(tmp_path / "next")
    assert ckpt.weight_version == "4"
    saved = TrainConfig.from_yaml(ckpt.path / CONFIG_FILE)
    assert saved.trainer.initial_version == 3
    assert saved.model.path == str((tmp_path / "first" / "checkpoints" / "step_00000001").resolve())  # not "latest"
    # An explicit value wins.
    m = train(make_config(tiny_dataset, latest, tmp_path / "explicit", trainer={"max_steps": 1, "initial_version": 10}))[0]
    assert m["train/weight_version"] == 11.0


@pytest.mark.parametrize("max_staleness", [None, 5])
def test_staleness_figures_count_a_rows_oldest_token_as_the_filter_does(tiny_gpt2, tmp_path, max_staleness):
    # Policy version 3. Rows recorded as version 2 whose first tokens came from version 1 (a request continued across
    # a weight update) are 2 versions stale, as --max-staleness counts them; single-span rows of version 2 are 1;
    # a version that is no integer is unknown (only the staleness filter refuses one).
    from rollshard.store.format.schema import Row, Status, WeightSpan
    from rollshard.store.io.writer import ShardWriter

    def row(g: int, i: int, version: str, spans: list[tuple[str, int, int]] | None) -> Row:
        return Row(sample_id=f"p{g}-{i}", prompt_id=f"p{g}", group_id=f"p{g}/policy/0", agent="policy", round=0,
                   prompt_tokens=[5 + g, 6, 7], response_tokens=[11 * i + k + 3 for k in range(4)],
                   rollout_logprobs=[-1.0] * 4, loss_mask=[1] * 4, reward=float(i % 2), status=Status.COMPLETED,
                   finish_reason="stop", weight_version=version, temperature=1.0, top_p=1.0, top_k=-1,
                   weight_versions=None if spans is None else [WeightSpan(version=v, start=a, end=b) for v, a, b in spans])

    groups = [[row(0, i, "2", [("1", 0, 2), ("2", 2, 4)] if i < 3 else None) for i in range(4)],
              [row(1, i, "2", None) for i in range(4)]]
    if max_staleness is None:
        groups.append([row(2, i, "run-a", None) for i in range(2)])
    with ShardWriter(tmp_path / "data", writer_id="test") as w:
        for rows in groups:
            w.write_group(rows)
    config = make_config(tmp_path / "data", tiny_gpt2, tmp_path / "run", trainer={"max_steps": 1, "initial_version": 3},
                         data={"groups_per_step": len(groups), "max_staleness": max_staleness})
    m = train(config)[0]
    assert m["staleness/hist/2"] == 3.0 and m["staleness/hist/1"] == 5.0  # the newest version said 1 for all 8
    assert m["staleness/max"] == 2.0 and m["staleness/mean"] == pytest.approx(11 / 8)
    assert m.get("staleness/hist/unknown", 0.0) == (2.0 if max_staleness is None else 0.0)


def test_loss_metrics_are_the_step_loss_whatever_the_mini_batches(tiny_dataset, tiny_gpt2, tmp_path):
    # lr 0: both runs see the same weights, so the step's loss is the same number; each mini-batch's loss
    # is normalized by its own tokens, and the logged loss weights them by their share of the step's tokens.
    def run(out, m, agg="token-mean"):
        return train(make_config(
            tiny_dataset, tiny_gpt2, tmp_path / out, data={"micro_batch_tokens": 48}, optim={"lr": 0.0},
            loss={"entropy_coef": 0.01, "agg": agg}, trainer={"max_steps": 1, "mini_batches": m},
        ))[0]

    for agg in ("token-mean", "seq-mean-token-mean"):
        one, two = run(f"one-{agg}", 1, agg), run(f"two-{agg}", 2, agg)
        assert two["data/micro_batches"] >= 3
        assert 5.0 < one["loss/entropy"] < 6.94  # near log(1024), not twice it
        for key in ("loss/entropy", "loss/policy", "loss/total"):
            assert two[key] == pytest.approx(one[key], abs=1e-6), (agg, key)


def test_one_row_group_is_not_a_zero_variance_group(tiny_gpt2, tmp_path):
    # One step of three groups: a one-row group (the selector), a zero-variance group, a group with signal.
    data = write_rows(tmp_path / "data", [[1.0], [0.5, 0.5], [0.0, 1.0]], config=generation_config(tiny_gpt2))
    config = make_config(data, tiny_gpt2, tmp_path / "run", data={"groups_per_step": 3, "shuffle": False},
                         trainer={"max_steps": 1})
    m = train(config)[0]
    assert m["data/groups"] == 3
    assert m["groups/zero_variance"] == 1 and m["loader/zero_variance_groups"] == 1  # the same count
    assert m["groups/single"] == 1 and m["groups/frac_zero_variance"] == pytest.approx(1 / 3)
    assert m["adv/max"] > 0  # the one-row group is trained (--single-member reward)


def test_loader_figures_of_each_rank_add_up():
    from rollshard.train.metrics import MetricAccumulator
    from rollshard.train.trainer import Trainer as T

    from rollshard.store.loader import Step

    ranks = []
    for zero_var in (1.0, 0.0):  # two ranks: one zero-variance group on the first
        acc = MetricAccumulator()
        step = Step(micro_batches=[], group_ids=[], epoch=0, index=0,
                    metrics={"zero_variance_groups": zero_var, "groups": 2.0, "groups_examined": 4.0})
        T.data_metrics(object.__new__(T), step, [], acc)
        ranks.append(acc.state())
    merged = MetricAccumulator.merged(ranks).result()
    assert merged["loader/zero_variance_groups"] == 1.0 and merged["loader/groups"] == 4.0  # this rank's: summed
    assert merged["loader/groups_examined"] == 8.0  # each rank examines its own share: summed too


def test_advantages_use_the_store_definition_of_reward_spread():
    import rollshard.store.format.groups as groups
    import rollshard.train.advantages as advantages

    assert advantages.REWARD_STD_DDOF is groups.REWARD_STD_DDOF


def test_decoupled_one_mini_batch_skips_the_proximal_forward(tiny_dataset, tiny_gpt2, tmp_path, monkeypatch):
    from rollshard.train.backends.hf import HFBackend

    calls = []
    real = HFBackend.logprobs

    def spy(self, batch, *, grad, **kw):
        calls.append(grad)
        return real(self, batch, grad=grad, **kw)

    monkeypatch.setattr(HFBackend, "logprobs", spy)
    force = {"path": False}  # True: the forward of pi_prox that one mini-batch used to run
    needs_forward = Trainer.needs_proximal_forward
    monkeypatch.setattr(Trainer, "needs_proximal_forward", lambda self: force["path"] or needs_forward(self))

    def run(out, mini_batches, *, old_path=False):
        calls.clear()
        force["path"] = old_path
        config = make_config(tiny_dataset, tiny_gpt2, tmp_path / out, data={"micro_batch_tokens": 48},
                             loss={"mode": "decoupled"}, trainer={"max_steps": 2, "mini_batches": mini_batches})
        return train(config), list(calls)

    new, new_calls = run("new", 1)
    old, old_calls = run("old", 1, old_path=True)
    two, two_calls = run("two", 2)
    micro = sum(m["data/micro_batches"] for m in new)
    assert new_calls == [True] * int(micro)  # gradient passes only
    assert old_calls.count(False) == micro and two_calls.count(False) == micro  # one pi_prox forward per micro-batch
    for a, b in zip(new, old):
        for key in ("loss/total", "ratio/mean", "is/mean", "is/max", "optim/grad_norm"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), key


def test_progress_bar_knows_the_steps_and_no_progress_silences_transformers(tiny_dataset, tiny_gpt2, tmp_path, capsys):
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    try:
        # 8 groups of 2 per step, one epoch: 4 steps, though --max-steps is not given.
        train(make_config(tiny_dataset, tiny_gpt2, tmp_path / "bar", trainer={"max_steps": None, "progress": True}))
        assert "4/4" in capsys.readouterr().err
        assert hf_logging.is_progress_bar_enabled()  # left alone when our own bar is on
        trainer = Trainer(make_config(tiny_dataset, tiny_gpt2, tmp_path / "quiet", trainer={"max_steps": 5}))
        trainer.close()
        assert not hf_logging.is_progress_bar_enabled()
        assert trainer.planned_steps() == 4  # --max-steps 5, but the data holds 4
    finally:
        hf_logging.enable_progress_bar()


def test_the_bar_ends_full_when_filters_left_fewer_steps_than_planned(tiny_gpt2, tmp_path, capsys):
    # The plan counts the groups before the filters: 4 steps of one group, of which --drop-zero-variance leaves 2. The
    # bar's end says what the run did (2/2), not 2/4 at the end of the data.
    data = write_rows(tmp_path / "data", [[1.0, 0.0], [0.5, 0.5], [0.0, 1.0], [0.0, 0.0]])
    sections = {"data": {"groups_per_step": 1, "drop_zero_variance": True},
                "trainer": {"max_steps": None, "progress": True}}
    trainer = Trainer(make_config(data, tiny_gpt2, tmp_path / "run", **sections))
    try:
        assert trainer.planned_steps() == 4
        assert len(trainer.run()) == 2
    finally:
        trainer.close()
    renders = [r for r in re.split(r"[\r\n]", capsys.readouterr().err) if "step" in r and "|" in r]
    assert "2/2 " in renders[-1] and "100%" in renders[-1], renders[-3:]


def test_torn_metrics_line_is_dropped_on_resume(tiny_dataset, tiny_gpt2, tmp_path):
    from rollshard.train.metrics import MetricsLogger

    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    MetricsLogger(out, tensorboard=False, resume_step=2).close()
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n'
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"st\n{"step": 3}\n')  # not a torn tail: an error naming it
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not JSON .*; repair or delete that line"):
        MetricsLogger(out, tensorboard=False, resume_step=3)


def test_a_config_built_in_python_is_validated_too(tiny_dataset, tiny_gpt2, tmp_path):
    from rollshard.train.config import DataConfig, LossConfig, ModelConfig, TrainConfig, TrainerConfig

    config = TrainConfig(
        data=DataConfig(path=str(tiny_dataset)), model=ModelConfig(path=str(tiny_gpt2)),
        trainer=TrainerConfig(out=str(tmp_path / "run")), loss=LossConfig(ratio_level="sequence"),
    )
    with pytest.raises(ValueError, match="--ratio-level sequence .* with --mode bypass"):
        prepare_config(config)


def test_ranks_that_opened_different_datasets_are_refused(tiny_dataset, tmp_path):
    # Each rank deals the shares from its own open: a shard committed between two ranks' opens would deal
    # different shares (groups doubled or lost), so the trainer compares the fingerprints first.
    import dataclasses

    from rollshard.store.loader import RolloutLoader
    from rollshard.train.backends.distributed import DistEnv
    from rollshard.train.trainer import check_same_data

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class TwoRanks(DistEnv):
        other: list

        def all_gather_json(self, obj):
            return [obj, self.other]

    with RolloutLoader(tiny_dataset) as loader:
        mine = [loader.dataset.fingerprint]
        check_same_data(loader, TwoRanks(rank=0, world_size=2, other=mine))  # the same data: passes
        with pytest.raises(ValueError, match=r"the ranks opened different datasets \(rank 0 and ranks \[1\]\)"):
            check_same_data(loader, TwoRanks(rank=0, world_size=2, other=["another"]))


def _per_token_logprobs(self, batch, *, grad, entropy=False, reference=False, support=False):
    """HFBackend.logprobs as it was before the lean batch: ``position_ids`` and the temperature as ``[T]`` arrays
    written on the host as packing wrote them (a concatenation of aranges; each sequence's slice filled with its
    temperature), then copied to the device."""
    import numpy as np

    from rollshard.train.logprobs import Support, packed_logprobs

    module = self.reference if reference else self.policy
    cu = batch.cu_seqlens.cpu().tolist()
    positions = np.concatenate([np.arange(e - s, dtype=np.int64) for s, e in zip(cu[:-1], cu[1:])])  # [T]
    temperature = np.empty(cu[-1], np.float32)  # [T]
    for k, t in enumerate(batch.temperatures.cpu().tolist()):
        temperature[cu[k] : cu[k + 1]] = t
    dev = self.device
    sup = Support.of(batch) if support else None
    if sup is not None:
        sup = Support(has_support=sup.has_support.to(dev), ids=sup.ids.to(dev), offsets=sup.offsets.to(dev))
    with torch.set_grad_enabled(grad), self._autocast():
        out = packed_logprobs(
            module, input_ids=batch.input_ids.to(dev), position_ids=torch.from_numpy(positions).to(dev),
            loss_mask=batch.loss_mask.to(dev), temperature=torch.from_numpy(temperature).to(dev),
            with_entropy=entropy, support=sup,
        )
    return (*out, None) if support and sup is None else out


@pytest.mark.parametrize("loss", [
    {},  # vanilla: token-mean PPO clip, one mini-batch
    {"mode": "decoupled", "is_correction": "tis", "kl_coef": 0.1, "entropy_coef": 0.01},  # every logprob pass
])
def test_lean_batch_step_is_bit_for_bit_the_per_token_layout(tiny_dataset, tiny_gpt2, tmp_path, monkeypatch, loss):
    """Position ids and temperatures derived from ``cu_seqlens`` on the device (the lean batch) give the very losses,
    metrics, gradients and weights that the per-token arrays packing used to write give: torch.equal, not allclose.
    Two steps, two mini-batches (the second trains on updated weights), rows at temperatures 1.0 and 0.7."""
    from rollshard.train.backends.hf import HFBackend

    grads: dict[str, list[dict[str, torch.Tensor]]] = {"lean": [], "per_token": []}
    real_step = HFBackend.optimizer_step

    def run(name: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
        def capture(self):  # the gradients the update uses, before clipping
            grads[name].append({n: p.grad.detach().clone() for n, p in self.policy.named_parameters()})
            return real_step(self)

        monkeypatch.setattr(HFBackend, "optimizer_step", capture)
        config = make_config(tiny_dataset, tiny_gpt2, tmp_path / name, data={"micro_batch_tokens": 48}, loss=loss,
                             trainer={"max_steps": 2, "mini_batches": 2})
        trainer = Trainer(config)
        try:
            history = trainer.run()
            weights = {n: p.detach().clone() for n, p in trainer.backend.policy.named_parameters()}
        finally:
            trainer.close()
        return history, weights

    lean, lean_weights = run("lean")
    monkeypatch.setattr(HFBackend, "logprobs", _per_token_logprobs)
    old, old_weights = run("per_token")
    assert len(lean) == len(old) == 2 and lean[0]["data/micro_batches"] >= 2
    for a, b in zip(lean, old):  # every figure but the clock's (perf/*: step time, data-wait share, tokens/s)
        assert a.keys() == b.keys()
        assert {k: v for k, v in a.items() if not k.startswith("perf/")} == {
            k: v for k, v in b.items() if not k.startswith("perf/")}
    assert len(grads["lean"]) == len(grads["per_token"]) == 4  # 2 steps x 2 mini-batches
    for ga, gb in zip(grads["lean"], grads["per_token"]):
        assert ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga)
    assert all(torch.equal(lean_weights[n], old_weights[n]) for n in lean_weights)


def test_exports_are_weights_only_policy_folders_the_newest_two_kept(tiny_dataset, tiny_gpt2, tmp_path):
    from safetensors.torch import load_file

    from rollshard.store.models.versions import folder_weight_version
    from rollshard.train.checkpoint import latest_checkpoint, latest_policy

    out = tmp_path / "run"
    config = make_config(tiny_dataset, tiny_gpt2, out, trainer={"max_steps": 4, "export_every": 1, "save_every": 3})
    train(config)
    policy = out / "policy"
    # steps 1, 2 and 4 exported (v_1 pruned: the newest two kept), step 3 checkpointed (a checkpoint is a policy
    # folder too: no export), step 4 also saved at the end
    assert sorted(p.name for p in policy.iterdir()) == ["latest", "v_00000002", "v_00000004"]
    assert os.readlink(policy / "latest") == "v_00000004"
    assert folder_weight_version(policy / "v_00000004") == "4"
    assert not (policy / "v_00000004" / "shards").exists()  # no optimizer or loader state
    exported = load_file(policy / "v_00000004" / "model.safetensors")
    saved = load_file(latest_checkpoint(out).path / "model.safetensors")
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in exported)
    assert latest_policy(out)[1] == "4"
    shutil.rmtree(latest_checkpoint(out).path)  # pruned under a reader: the export still answers
    assert latest_policy(out) == (policy / "v_00000004", "4")
