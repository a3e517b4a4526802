"""Sampling-aware ratios (rollshard.train.support): which logprobs the ratio takes, the support metrics and
their aggregation, and the trainer at step 0 on rows sampled with top-k / top-p from the tiny model itself."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rollshard.store.loader import WrappedLoader
from rollshard.train.config import LossConfig
from rollshard.train.logprobs import SupportLogprobs
from rollshard.train.losses import policy_loss
from rollshard.train.metrics import MetricAccumulator
from rollshard.train.support import policy_logprobs, rollout_logprobs, support_metrics

# -- the pure functions ----------------------------------------------------------------------------------


def _support(logp, mass, has) -> SupportLogprobs:
    return SupportLogprobs(logp=torch.tensor(logp), mass=torch.tensor(mass), has_support=torch.tensor(has))


def test_ratio_takes_the_renormalized_logprobs_where_a_token_has_a_support():
    logp = torch.tensor([0.0, -2.0, -3.0, -1.5])  # [T] full softmax; position 0 is a prompt token
    rollout = torch.tensor([0.0, -2.1, -3.2, -1.4])
    sampling = torch.tensor([0.0, -0.4, 0.0, 0.0])
    sup = _support([0.0, -0.5, 0.0, 0.0], [0.0, 0.2, 0.0, 0.0], [False, True, False, False])
    assert policy_logprobs(logp, sup, renormalize=True).tolist() == [0.0, -0.5, -3.0, -1.5]
    assert rollout_logprobs(rollout, sampling, sup, renormalize=True).tolist() == pytest.approx([0.0, -0.4, -3.2, -1.4])
    # Off, or without supports: the full-softmax logprobs themselves.
    assert policy_logprobs(logp, sup, renormalize=False) is logp and policy_logprobs(logp, None, renormalize=True) is logp
    assert rollout_logprobs(rollout, sampling, sup, renormalize=False) is rollout
    assert rollout_logprobs(rollout, None, None, renormalize=True) is rollout


def test_support_metrics_worked_values():
    # Loss tokens 1..3; tokens 1 and 2 have supports with trainer masses 0.5 and 0.25.
    mask = torch.tensor([0.0, 1.0, 1.0, 1.0])
    sup = _support([0.0, math.log(0.6), math.log(0.9), 0.0], [0.0, 0.5, 0.25, 0.0], [False, True, True, False])
    logp = torch.tensor([0.0, math.log(0.3), math.log(0.225), math.log(0.4)])  # pi(y) = pi(y|S) * pi(S)
    sampling = torch.tensor([0.0, math.log(0.5), math.log(0.9), 0.0])  # q(y): token 1 off by log(0.6/0.5)
    rollout = torch.tensor([0.0, math.log(0.3), math.log(0.225), math.log(0.5)])  # the engine's full softmax
    old = rollout_logprobs(rollout, sampling, sup, renormalize=True)
    m = support_metrics(logp, old_logp=old, rollout_logp=rollout, sampling_logp=sampling, support=sup, loss_mask=mask)
    close = dict(abs=1e-6)
    assert m["support/tokens"] == pytest.approx(2 / 3, **close)
    assert m["support/mass_mean"] == pytest.approx(0.375, **close) and m["support/mass_min"] == pytest.approx(0.25)
    # pi(y|S) / q(y): 0.6 / 0.5 = 1.2 and 0.9 / 0.9 = 1.
    assert m["support/ratio_mean"] == pytest.approx(1.1, **close)
    assert m["support/abs_diff_max"] == pytest.approx(math.log(1.2), **close)
    assert m["support/abs_diff_mean"] == pytest.approx(math.log(1.2) / 2, **close)
    # pi(y) / q(y): 0.3 / 0.5 = 0.6 and 0.225 / 0.9 = 0.25; pi(y) / pi_rollout(y) = 1 on both.
    assert m["support/ratio_unrenormalized_mean"] == pytest.approx(0.425, **close)
    assert m["support/ratio_full_mean"] == pytest.approx(1.0, **close)
    # Over the three loss tokens against the same rollout side: 0.6, 0.25 and 0.4 / 0.5 = 0.8.
    assert m["ratio/unrenormalized_mean"] == pytest.approx(0.55, **close)
    # A micro-batch without supports reports a zero fraction (its tokens count in the step's fraction).
    plain = support_metrics(logp, old_logp=rollout, rollout_logp=rollout, sampling_logp=None, support=None, loss_mask=mask)
    assert plain["support/tokens"] == 0.0 and "support/mass_mean" not in plain
    assert plain["ratio/unrenormalized_mean"] == pytest.approx((1 + 1 + 0.8) / 3, **close)


def test_support_means_are_weighted_by_supported_tokens_across_micro_batches():
    # Micro-batch a: 4 loss tokens, 2 with supports (mass 0.8); b: 2 tokens, both (mass 0.5); c: 4, none.
    # Step: 4 of 10 tokens, mass (2 * 0.8 + 2 * 0.5) / 4 = 0.65 (a token-weighted mean would say 0.7).
    acc = MetricAccumulator()
    acc.add_loss_metrics({"tokens": 4, "support/tokens": 0.5, "support/mass_mean": 0.8, "ratio/mean": 1.0}, weight=4)
    other = MetricAccumulator()
    other.add_loss_metrics({"tokens": 2, "support/tokens": 1.0, "support/mass_mean": 0.5, "ratio/mean": 0.7}, weight=2)
    other.add_loss_metrics({"tokens": 4, "support/tokens": 0.0, "ratio/mean": 1.0}, weight=4)
    out = MetricAccumulator.merged([acc.state(), other.state()]).result()  # two ranks
    assert out["support/tokens"] == pytest.approx(0.4) and out["support/mass_mean"] == pytest.approx(0.65)
    assert out["ratio/mean"] == pytest.approx(9.4 / 10) and out["tokens"] == 10


def test_kl_term_compares_kl_logp_to_the_reference():
    # The ratio's logp is renormalized (-0.5) but the KL is on the full distributions: lr = -2.0 - (-2.0) = 0.
    mask, cu = torch.tensor([0.0, 1.0]), torch.tensor([0, 2])
    full = torch.tensor([0.0, -2.0], requires_grad=True)
    renorm = torch.tensor([0.0, -0.5], requires_grad=True)
    kw = dict(rollout_logp=torch.tensor([0.0, -0.5]), advantages=torch.zeros(2), loss_mask=mask, cu_seqlens=cu,
              config=LossConfig(kl_coef=1.0, kl_type="k1"), ref_logp=torch.tensor([0.0, -2.0]))
    loss, m = policy_loss(renorm, kl_logp=full, **kw)
    loss.backward()
    assert m["loss/kl"] == 0.0 and full.grad.tolist() == [0.0, 1.0] and renorm.grad.tolist() == [0.0, 0.0]
    _, m = policy_loss(renorm.detach(), **kw)  # without kl_logp: the KL of logp itself, 1.5 nats
    assert m["loss/kl"] == pytest.approx(1.5)


# -- the trainer at step 0, on rows sampled with truncation from the model itself ---------------------------

# Trainer logprobs (packed, no cache) vs the sampler's (KV cache): fp32 rounding only (tests/train/test_trainer.py).
FP32_LOGPROB_TOL = 1e-5
# (temperature, top_k, top_p) per group: top-k alone, top-p alone, both, and an untruncated group (no support).
TRUNCATION = [(1.0, 5, 1.0), (0.7, 0, 0.8), (1.0, 5, 0.8), (1.0, 0, 1.0)]


@torch.no_grad()
def sample_truncated(model, prompt_ids: list[int], n: int, *, temperature, top_k, top_p, seed, max_new_tokens=8):
    """``n`` samples under top-k / top-p, each ``(tokens, full logprobs, sampling logprobs, supports)``.

    transformers' processed scores are ``logits / T`` with ``-inf`` outside the kept set: the support is where
    they are finite and the sampling logprob their log softmax at the token; the full logprob is
    ``log_softmax(logits / T)`` of the raw logits (SGLang's rollout logprob)."""
    torch.manual_seed(seed)
    out = model.generate(
        torch.tensor([prompt_ids] * n), attention_mask=torch.ones(n, len(prompt_ids), dtype=torch.long),
        do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens,
        output_logits=True, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
    )
    full = torch.log_softmax(torch.stack(out.logits, 1).float() / temperature, -1)  # [n, steps, V]
    scores = torch.stack(out.scores, 1).float()  # [n, steps, V] processed: -inf outside the support
    kept = torch.log_softmax(scores, -1)
    eos = model.generation_config.eos_token_id
    rows = []
    for i in range(n):
        toks, lps, slps, sups = [], [], [], []
        for s, tok in enumerate(out.sequences[i, len(prompt_ids):].tolist()):
            toks.append(tok)
            lps.append(float(full[i, s, tok]))
            slps.append(float(kept[i, s, tok]))
            sups.append(torch.nonzero(torch.isfinite(scores[i, s])).flatten().tolist())
            if tok == eos:
                break
        rows.append((toks, lps, slps, sups))
    return rows


def write_truncated_dataset(model_path, out, *, store_supports: bool = False):
    """Four groups of three rows (TRUNCATION), one row with a tool span (mask 0); returns the dataset and
    ``{sample_id: (supports or None, sampling logprobs or None, loss mask, rollout logprobs)}``. With
    ``store_supports`` the rows carry them in the schema 1.1 columns."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollshard.store.format.schema import Row, Status
    from rollshard.store.io.writer import ShardWriter
    from tests.train.conftest import PROMPTS, generation_config

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_path)
    table = {}
    with ShardWriter(out, writer_id="test", config=generation_config(model_path, 8)) as w:
        for g, (temperature, top_k, top_p) in enumerate(TRUNCATION):
            prompt = tok(PROMPTS[g], add_special_tokens=False)["input_ids"]
            samples = sample_truncated(model, prompt, 3, temperature=temperature, top_k=top_k, top_p=top_p, seed=g)
            rows = []
            for i, (toks, lps, slps, sups) in enumerate(samples):
                mask = [1] * len(toks)
                if g == 2 and i == 0 and len(toks) >= 5:  # a tool span: mask 0, logprob 0, empty support
                    for k in (2, 3):
                        mask[k], lps[k], slps[k], sups[k] = 0, 0.0, 0.0, []
                truncated = top_k > 0 or top_p < 1
                table[f"p{g}-{i}"] = (sups if truncated else None, slps if truncated else None, mask, lps)
                rows.append(Row(
                    sample_id=f"p{g}-{i}", prompt_id=f"p{g}", group_id=f"p{g}/policy/0", agent="policy", round=0,
                    prompt_tokens=prompt, response_tokens=toks, rollout_logprobs=lps, loss_mask=mask,
                    reward=float(i), status=Status.COMPLETED, finish_reason="stop", weight_version="0",
                    temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else -1,
                    sampling_logprobs=slps if truncated and store_supports else None,
                    sampling_support=sups if truncated and store_supports else None,
                ))
            w.write_group(rows)
    return out, table


def with_supports(mb, table):
    """The PackedBatch fields of schema 1.1 for ``mb``, from the rows' supports (the loader's job, done here so
    the trainer is tested against the PackedBatch contract alone)."""
    T = mb.num_tokens
    sampling, has = torch.zeros(T), torch.zeros(T, dtype=torch.bool)
    supports: list[list[int]] = [[] for _ in range(T)]
    for k, sid in enumerate(mb.sample_ids):
        sups, slps, _, _ = table[sid]
        if sups is None:
            continue
        start = int(mb.response_start[k])
        for j, (sup, slp) in enumerate(zip(sups, slps)):
            if mb.loss_mask[start + j] > 0:
                has[start + j], sampling[start + j], supports[start + j] = True, slp, sup
    if not has.any():
        return mb
    offsets = torch.tensor([0] + [len(s) for s in supports]).cumsum(0)  # [T+1]
    ids = torch.tensor([v for s in supports for v in s], dtype=torch.int64)  # [N]
    return dataclasses.replace(mb, sampling_logprobs=sampling, has_support=has, support_ids=ids, support_offsets=offsets)


class SupportLoader(WrappedLoader):
    """The store loader with each micro-batch's supports filled in from ``table``."""

    def __init__(self, inner, table):
        super().__init__(inner)
        self.table = table

    def __iter__(self):
        for step in self.inner:
            yield dataclasses.replace(step, micro_batches=[with_supports(mb, self.table) for mb in step.micro_batches])


@pytest.fixture(scope="module")
def truncated_data(tiny_gpt2, tmp_path_factory):
    return write_truncated_dataset(tiny_gpt2, tmp_path_factory.mktemp("data") / "truncated")


def step0(data, model_path, out, *, micro_batch_tokens=4096, mini_batches=1, shim=True, **loss):
    """The metrics of one step on ``data`` (all four groups), with the loss settings given; ``shim``: the
    supports filled in by :class:`SupportLoader`, else read by the store's loader from the rows."""
    from rollshard.train.backends.distributed import DistEnv
    from rollshard.train.config import TrainConfig
    from rollshard.train.trainer import Trainer, build_loader

    path, table = data
    config = TrainConfig.from_dict({
        "data": {"path": str(path), "groups_per_step": 4, "micro_batch_tokens": micro_batch_tokens},
        "model": {"path": str(model_path)}, "loss": loss, "optim": {"lr": 1e-3},
        "trainer": {"out": str(out), "max_steps": 1, "mini_batches": mini_batches, "progress": False,
                    "tensorboard": False},
    }).validate()
    trainer = Trainer(config, loader=SupportLoader(build_loader(config, DistEnv()), table) if shim else None)
    try:
        return trainer.run()[0]
    finally:
        trainer.close()


def stored_figures(table):
    """Fraction of loss tokens with a support, and the engine's kept mass on each of those tokens from the
    stored logprobs alone: pi(S) = pi(y) / q(y) = exp(rollout logprob - sampling logprob)."""
    loss_tokens, masses = 0, []
    for sups, slps, mask, lps in table.values():
        loss_tokens += sum(mask)
        masses += [math.exp(lp - q) for m, lp, q in zip(mask, lps, slps or []) if m and sups is not None]
    return len(masses) / loss_tokens, masses


def test_step0_renormalized_ratio_is_one_and_the_unrenormalized_one_the_kept_mass(truncated_data, tiny_gpt2, tmp_path):
    frac, masses = stored_figures(truncated_data[1])
    m = step0(truncated_data, tiny_gpt2, tmp_path / "on")
    assert 0.5 < frac < 1 and m["data/groups"] == 4 and m["data/micro_batches"] == 1
    assert m["support/tokens"] == pytest.approx(frac, abs=1e-6)
    # Unchanged weights: over its support the trainer's logprob is the engine's sampling logprob.
    assert m["support/abs_diff_max"] <= FP32_LOGPROB_TOL and m["mismatch/abs_diff_max"] <= FP32_LOGPROB_TOL
    assert abs(m["support/ratio_mean"] - 1) < FP32_LOGPROB_TOL and abs(m["ratio/mean"] - 1) < FP32_LOGPROB_TOL
    assert abs(m["ratio/max"] - 1) < FP32_LOGPROB_TOL and abs(m["ratio/min"] - 1) < FP32_LOGPROB_TOL
    # The trainer's mass on the support is the engine's; the full softmax over q is off by exactly that mass.
    mass = sum(masses) / len(masses)
    assert m["support/mass_mean"] == pytest.approx(mass, abs=1e-5) and m["support/mass_mean"] < 0.9
    assert m["support/mass_min"] == pytest.approx(min(masses), abs=1e-5)
    assert m["support/ratio_unrenormalized_mean"] == pytest.approx(mass, abs=1e-5)
    unsupported = 1 - frac  # their ratio is 1: full softmax against the full rollout logprob
    assert m["ratio/unrenormalized_mean"] == pytest.approx(frac * mass + unsupported, abs=1e-5)
    assert abs(m["support/ratio_full_mean"] - 1) < FP32_LOGPROB_TOL
    print(f"step 0, on: support/tokens {m['support/tokens']:.4f} ratio/mean {m['ratio/mean']:.7f} "
          f"support/abs_diff_max {m['support/abs_diff_max']:.2e} support/mass_mean {m['support/mass_mean']:.4f} "
          f"ratio/unrenormalized_mean {m['ratio/unrenormalized_mean']:.4f} "
          f"support/ratio_unrenormalized_mean {m['support/ratio_unrenormalized_mean']:.4f}")

    off = step0(truncated_data, tiny_gpt2, tmp_path / "off", renormalize_support=False)
    # Off: the full-softmax ratio against rollout_logprobs everywhere (1 at step 0: they are pre-truncation).
    assert off["ratio/mean"] == off["ratio/unrenormalized_mean"] and abs(off["ratio/mean"] - 1) < FP32_LOGPROB_TOL
    assert off["support/ratio_unrenormalized_mean"] == pytest.approx(mass, abs=1e-5)  # still reported
    # Same loss value at step 0 (every ratio 1), another gradient: pi(y|S) moves only the logits of S.
    assert off["loss/total"] == pytest.approx(m["loss/total"], abs=1e-6)
    assert abs(off["optim/grad_norm"] - m["optim/grad_norm"]) > 1e-3 * m["optim/grad_norm"]
    print(f"step 0, off: ratio/mean {off['ratio/mean']:.7f} grad_norm on {m['optim/grad_norm']:.5f} "
          f"off {off['optim/grad_norm']:.5f}")


def test_micro_batches_and_chunks_do_not_change_the_support_step(truncated_data, tiny_gpt2, tmp_path):
    one = step0(truncated_data, tiny_gpt2, tmp_path / "one")
    many = step0(truncated_data, tiny_gpt2, tmp_path / "many", micro_batch_tokens=40)
    assert many["data/micro_batches"] >= 3
    for name in ("support/tokens", "support/mass_mean", "ratio/unrenormalized_mean", "loss/total"):
        assert many[name] == pytest.approx(one[name], abs=1e-6), name
    assert many["support/mass_min"] == pytest.approx(one["support/mass_min"], abs=1e-7)
    assert many["optim/grad_norm"] == pytest.approx(one["optim/grad_norm"], rel=1e-5)


def test_decoupled_proximal_is_renormalized_and_kl_is_on_the_full_distribution(truncated_data, tiny_gpt2, tmp_path):
    m = step0(truncated_data, tiny_gpt2, tmp_path / "one", mode="decoupled", kl_coef=0.1)
    # One mini-batch: pi_prox is the gradient pass's own policy, renormalized as it is: rho exactly 1, and
    # w = pi_prox(y|S) / q(y) is 1 to fp32 rounding (a full-softmax pi_prox would make w the kept mass).
    assert m["ratio/min"] == 1.0 and m["ratio/max"] == 1.0
    assert abs(m["is/min"] - 1) < FP32_LOGPROB_TOL and abs(m["is/max"] - 1) < FP32_LOGPROB_TOL
    # The KL compares full softmaxes of equal weights: exactly 0 (a renormalized logp would give -log pi(S)).
    assert m["loss/kl"] == 0.0
    # Two mini-batches: pi_prox comes from a forward of its own before any update, renormalized the same way.
    two = step0(truncated_data, tiny_gpt2, tmp_path / "two", micro_batch_tokens=40, mini_batches=2, mode="decoupled")
    assert abs(two["is/min"] - 1) < FP32_LOGPROB_TOL and abs(two["is/max"] - 1) < FP32_LOGPROB_TOL
    assert two["ratio/max"] > 1 + 1e-4 or two["ratio/min"] < 1 - 1e-4  # the second mini-batch saw an update


def test_data_without_supports_takes_the_path_of_before(tiny_dataset, tiny_gpt2, tmp_path, monkeypatch):
    """1.0 data: no support work at all (the support gather would raise here), and the feature on or off
    trains bit for bit the same step."""
    from rollshard.train import logprobs
    from tests.train.test_trainer import make_config, train

    def refuse(*args, **kwargs):
        raise AssertionError("support work on a batch without supports")

    monkeypatch.setattr(logprobs, "support_elements", refuse)
    runs = [
        train(make_config(tiny_dataset, tiny_gpt2, tmp_path / str(on), loss={"renormalize_support": on},
                          trainer={"max_steps": 1}))[0]
        for on in (True, False)
    ]
    same = [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in runs]
    assert same[0] == same[1] and same[0]["support/tokens"] == 0.0 and "support/mass_mean" not in same[0]
    assert same[0]["ratio/unrenormalized_mean"] == same[0]["ratio/mean"]


def test_step0_on_supports_read_by_the_store_loader(tiny_gpt2, tmp_path):
    """The same rows with their supports in the schema 1.1 columns, through the store's loader: the
    micro-batches carry what the trainer expects, and step 0 shows the same figures."""
    from rollshard.store.loader import LoaderConfig, RolloutLoader

    data = write_truncated_dataset(tiny_gpt2, tmp_path / "data", store_supports=True)
    table = data[1]
    (step,) = list(RolloutLoader(data[0], LoaderConfig(groups_per_step=4, micro_batch_tokens=40, shuffle=False)))
    assert len(step.micro_batches) >= 3
    for mb in step.micro_batches:
        expected = with_supports(dataclasses.replace(mb, sampling_logprobs=None, has_support=None, support_ids=None,
                                                     support_offsets=None), table)
        if expected.has_support is None:
            assert mb.has_support is None
            continue
        assert torch.equal(mb.has_support, expected.has_support)
        assert torch.equal(mb.support_offsets, expected.support_offsets)
        assert torch.equal(mb.support_ids, expected.support_ids)
        assert torch.equal(mb.sampling_logprobs, expected.sampling_logprobs)

    frac, masses = stored_figures(table)
    m = step0(data, tiny_gpt2, tmp_path / "on", shim=False)
    assert m["support/tokens"] == pytest.approx(frac, abs=1e-6)
    assert abs(m["ratio/mean"] - 1) < FP32_LOGPROB_TOL and m["support/abs_diff_max"] <= FP32_LOGPROB_TOL
    mass = sum(masses) / len(masses)
    assert m["support/ratio_unrenormalized_mean"] == pytest.approx(mass, abs=1e-5) and mass < 0.9
    print(f"step 0, store loader: support/tokens {m['support/tokens']:.4f} ratio/mean {m['ratio/mean']:.7f} "
          f"support/abs_diff_max {m['support/abs_diff_max']:.2e} support/mass_mean {m['support/mass_mean']:.4f} "
          f"ratio/unrenormalized_mean {m['ratio/unrenormalized_mean']:.4f}")
    off = step0(data, tiny_gpt2, tmp_path / "off", shim=False, renormalize_support=False)
    assert off["ratio/mean"] == off["ratio/unrenormalized_mean"]
    assert abs(off["optim/grad_norm"] - m["optim/grad_norm"]) > 1e-3 * m["optim/grad_norm"]
