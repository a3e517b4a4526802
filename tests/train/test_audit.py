"""rollshard-train audit on data of the embedded engine: agreement with the same model, flags for another
checkpoint and for a wrong stored temperature, the trainer's own numbers, one-line errors (exit 2)."""

from __future__ import annotations

import json
import os
import re

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

from rollshard.store.inspection import audit as store_audit
from rollshard.store.inspection.audit import AuditedDataset, audited_datasets, read_audit, summarize
from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.format.schema import Row, Status
from rollshard.store.io.writer import ShardWriter
from rollshard.train.audit import DEFAULT_MAX_ABS_DIFF
from rollshard.train.cli import main
from tests import forked
from tests.train.conftest import SINGLE_THREAD_ENV

# Embedded engine (batched, KV cache) against the trainer's packed forward, fp32 on CPU: measured 9.5e-7.
FP32_AGREEMENT = 1e-5
# Another checkpoint, or the right one at the wrong temperature, is off by tenths of a nat at its worst token on
# the tiny model (measured: 1.07 for a model of another seed, 0.21 for T 0.7 stored as 1.0): above 0.1.
MISMATCH = 0.1
TEMPERATURE = 0.7
FLAG_LINE = re.compile(
    r"rollshard-train audit: flagged: max \|logp - rollout_logp\| (?P<max>[0-9.e+-]+) > --max-abs-diff 0\.001 "
    r"\(mean (?P<mean>[0-9.e+-]+), .*\) at sample \S+ \(\w+, position \d+\); (report \S+|no report written .*)$"
)


@pytest.fixture(scope="module")
def embedded_data(tiny_gpt2, tmp_path_factory):
    """A multi-agent math run of the embedded engine at temperature 0.7 (solver, rewriter and selector rows)."""
    from rollshard.generate.run import main as generate_main

    out = tmp_path_factory.mktemp("audit") / "embedded"
    argv = [
        "--engine", f"embedded:{tiny_gpt2}", "--agents", "multi_agent", "--task", "math", "--n-samples", "2",
        "--max-new-tokens", "8", "--limit", "3", "--temperature", str(TEMPERATURE), "--no-progress", "--out", str(out),
    ]  # fmt: skip
    assert generate_main(argv) == 0
    return out


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """The tiny GPT-2 initialized from another seed: same architecture and vocabulary, other weights."""
    from rollshard.generate.models import init_model

    return init_model(tmp_path_factory.mktemp("models") / "tiny-gpt2-seed1", preset="tiny-gpt2", seed=1)


@pytest.fixture(scope="module")
def wrong_temperature(embedded_data, tmp_path_factory):
    """The same rows with their stored temperature changed from 0.7 to 1.0 (the store's derive, nothing else)."""
    from rollshard.store.derived.derive import derive_dataset

    out = tmp_path_factory.mktemp("audit") / "temperature-1"

    def to_one(t: pa.Table) -> pa.Table:
        return t.set_column(t.schema.get_field_index("temperature"), "temperature",
                            pa.array([1.0] * t.num_rows, pa.float32()))

    derive_dataset(embedded_data, out, to_one, operation="set-temperature", details={"temperature": 1.0},
                   mutable_columns=("temperature",), progress=False)
    return out


def trained_tokens(path) -> int:
    t = RolloutDataset.open(path).read(["loss_mask", "status"])
    t = t.filter(pc.is_in(t["status"], pa.array(["completed", "truncated"])))
    return int(pc.sum(pc.list_flatten(t["loss_mask"])).as_py())


def audit(capsys, *args) -> tuple[int, str, str]:
    rc = main(["audit", *map(str, args), "--no-progress"])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_embedded_data_agrees_with_its_model(embedded_data, tiny_gpt2, tmp_path):
    """A ``python -m rollshard.train audit`` process (forked, as a loop's stage): exit 0, every trained token once, max |diff| <= 1e-5."""
    report = tmp_path / "audit.parquet"
    proc = forked.run("rollshard.train", "audit", "--data", embedded_data, "--model", tiny_gpt2, "--out", report,
                      "--json", "--no-progress", env={**os.environ, **SINGLE_THREAD_ENV})
    assert proc.returncode == 0, proc.stderr
    assert "flagged" not in proc.stderr
    out = json.loads(proc.stdout)
    o = out["overall"]
    print(f"embedded data, same model: max |diff| {o['max']:.2e}, mean {o['mean']:.2e} over {o['tokens']} tokens")
    assert o["max"] <= FP32_AGREEMENT and o["ratio_outside"] == 0.0
    assert o["tokens"] == trained_tokens(embedded_data) > 0
    assert out["report"] == str(report) and out["dtype"] == "float32" and out["device"] == "cpu"
    assert set(out["by_agent"]) == {"solver", "rewriter", "selector"}
    assert list(out["by_temperature"]) == [str(TEMPERATURE)]

    table = read_audit(report)
    assert table.num_rows == o["tokens"]
    # what was audited, for rollshard-store report / inspect to pair the rows by (dataset, sample_id)
    (source,) = set(table["source"].to_pylist())
    assert audited_datasets(table) == [AuditedDataset(source=source, uri=str(embedded_data),
                                                      fingerprint=RolloutDataset.open(embedded_data).fingerprint)]
    back = summarize(table)  # the file gives the printed numbers (rollshard-store report reads the same)
    assert {k: out[k] for k in back} == json.loads(json.dumps(back))
    # Every report row is its row's stored logprob at that response position (the alignment of the token).
    rows = RolloutDataset.open(embedded_data).read(["sample_id", "response_tokens", "rollout_logprobs"]).to_pylist()
    by_id = {r["sample_id"]: r for r in rows}
    for r in table.to_pylist():
        row = by_id[r["sample_id"]]
        assert row["response_tokens"][r["position"]] == r["token"]
        assert row["rollout_logprobs"][r["position"]] == pytest.approx(r["rollout_logprob"], abs=0)
    assert len(out["worst"]) == 10 and out["worst"][0]["text"] is not None


def test_another_checkpoint_is_flagged(embedded_data, other_model, capsys):
    rc, out, err = audit(capsys, "--data", embedded_data, "--model", other_model, "--json")
    assert rc == 1
    assert len(err.strip().splitlines()) == 1
    m = FLAG_LINE.match(err.strip())
    assert m, err
    s = json.loads(out)["overall"]
    print(f"another checkpoint: max |diff| {s['max']:.3g}, mean {s['mean']:.3g}, outside {s['ratio_outside']:.1%}, "
          f"k3 {s['k3']:.3g}")
    assert float(m["max"]) == pytest.approx(s["max"], rel=1e-3) and s["max"] > MISMATCH
    assert float(m["mean"]) == pytest.approx(s["mean"], rel=1e-3)
    assert s["ratio_outside"] > 0.1


def test_a_wrong_stored_temperature_is_flagged(wrong_temperature, tiny_gpt2, capsys):
    rc, out, err = audit(capsys, "--data", wrong_temperature, "--model", tiny_gpt2, "--json")
    assert rc == 1 and FLAG_LINE.match(err.strip()), err
    s = json.loads(out)
    print(f"temperature 0.7 stored as 1.0: max |diff| {s['overall']['max']:.3g}, mean {s['overall']['mean']:.3g}")
    assert list(s["by_temperature"]) == ["1.0"]
    assert s["overall"]["max"] > MISMATCH


def test_several_sources_are_each_audited_whole(embedded_data, wrong_temperature, tiny_gpt2, tmp_path, capsys):
    """Mixture syntax: every source whole (weights do not apply), told apart in the report's source column."""
    report = tmp_path / "a.parquet"
    rc, out, err = audit(capsys, "--data", f"right={embedded_data}:0.9,wrong={wrong_temperature}:0.1", "--model",
                         tiny_gpt2, "--json", "--top", "200", "--out", report)
    s = json.loads(out)
    assert rc == 1 and FLAG_LINE.match(err.strip()), err
    assert list(s["by_source"]) == ["right", "wrong"]
    n = trained_tokens(embedded_data)
    assert s["by_source"]["right"]["tokens"] == s["by_source"]["wrong"]["tokens"] == n
    # the same sample ids in both: each source's rows are sequences of their own
    rows = RolloutDataset.open(embedded_data).read(["sample_id", "loss_mask", "status"]).to_pylist()
    trained = sum(1 for r in rows if r["status"] in ("completed", "truncated") and any(r["loss_mask"]))
    assert s["by_source"]["right"]["sequences"] == s["by_source"]["wrong"]["sequences"] == trained
    assert s["overall"]["sequences"] == 2 * trained
    assert audited_datasets(read_audit(report)) == [
        AuditedDataset(source=name, uri=str(path), fingerprint=RolloutDataset.open(path).fingerprint)
        for name, path in (("right", embedded_data), ("wrong", wrong_temperature))]
    assert s["by_source"]["right"]["max"] <= FP32_AGREEMENT < MISMATCH < s["by_source"]["wrong"]["max"]
    # The same sample ids in both sources: each worst token's context is its own source's row.
    assert {w["source"] for w in s["worst"]} == {"right", "wrong"} and all(w["before"] for w in s["worst"])


def test_the_audit_is_the_trainers_step_zero(embedded_data, tiny_gpt2, tmp_path, capsys):
    """One step of rollshard-train over every group sees the audit's numbers in its mismatch metrics."""
    from rollshard.train.metrics import read_metrics

    groups = RolloutDataset.open(embedded_data).num_groups
    run = tmp_path / "run"
    argv = ["--data", embedded_data, "--model", tiny_gpt2, "--out", run, "--groups-per-step", groups, "--max-steps", 1,
            "--lr", 0, "--no-progress", "--no-tensorboard"]
    assert main(list(map(str, argv))) == 0
    capsys.readouterr()  # the trainer's summary line
    m0 = read_metrics(run)[0]
    rc, out, _ = audit(capsys, "--data", embedded_data, "--model", tiny_gpt2, "--json")
    assert rc == 0
    o = json.loads(out)["overall"]
    assert o["tokens"] == m0["data/loss_tokens"]
    # float32 differences in the trainer, float64 of the same float32 values here: equal to fp32 rounding
    assert o["max"] == pytest.approx(m0["mismatch/abs_diff_max"], abs=1e-7)
    assert o["mean"] == pytest.approx(m0["mismatch/abs_diff_mean"], abs=1e-7)


def test_k3_and_abs_diff_are_the_losses_definitions():
    from rollshard.train.config import LossConfig
    from rollshard.train.losses import LOG_RATIO_CLAMP, token_metrics

    assert store_audit.LOG_RATIO_CLAMP == LOG_RATIO_CLAMP
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(64, generator=g, dtype=torch.float32) * 5  # [T]
    logp = rollout + torch.randn(64, generator=g) * 0.5  # [T]
    ones = torch.ones(64)
    m = token_metrics(logp, rollout_logp=rollout, ratio=ones, advantages=ones, mask=ones, is_weight=ones,
                      is_dropped=torch.zeros(64, dtype=torch.bool), config=LossConfig())
    n = 64
    table = pa.table({
        "sample_id": ["s"] * n, "group_id": ["g"] * n, "agent": ["policy"] * n, "source": ["d"] * n,
        "weight_version": ["0"] * n, "temperature": pa.array([1.0] * n, pa.float32()),
        "position": pa.array(range(n), pa.int32()), "token": pa.array([0] * n, pa.int32()),
        "rollout_logprob": pa.array(rollout.numpy()), "trainer_logprob": pa.array(logp.numpy()),
    }, schema=store_audit.AUDIT_SCHEMA)
    o = summarize(table)["overall"]
    assert o["k3"] == pytest.approx(float(m["mismatch/k3_kl"]), rel=1e-5)  # float32 there, float64 here
    assert o["mean"] == pytest.approx(float(m["mismatch/abs_diff_mean"]), rel=1e-5)
    assert o["max"] == pytest.approx(float(m["mismatch/abs_diff_max"]), rel=1e-6)


def test_thresholds(embedded_data, tiny_gpt2, other_model, capsys):
    rc, _, err = audit(capsys, "--data", embedded_data, "--model", other_model, "--max-abs-diff", "100", "--json")
    assert rc == 0 and err == ""
    rc, _, err = audit(capsys, "--data", embedded_data, "--model", tiny_gpt2, "--max-mean-abs-diff", "1e-12", "--json")
    assert rc == 1  # the embedded data's mean is ~2e-7: over 1e-12, under the default max
    assert re.search(r"mean \|logp - rollout_logp\| [0-9.e-]+ > --max-mean-abs-diff 1e-12", err), err
    assert "--max-abs-diff" not in err and DEFAULT_MAX_ABS_DIFF == 1e-3


def test_tables(embedded_data, tiny_gpt2, tmp_path, capsys):
    report = tmp_path / "a.parquet"
    rc, out, err = audit(capsys, "--data", embedded_data, "--model", tiny_gpt2, "--top", "3", "--out", report)
    assert rc == 0 and err == ""
    assert f"report {report}" in out.splitlines()[0]
    for word in ("overall", "agent", "rewriter", "weight version", "response position", "0-15", "temperature",
                 "the 3 worst tokens"):
        assert word in out
    worst = store_audit.worst_tokens(read_audit(report), 1)
    assert worst["sample_id"][0] in out


def test_agents_and_max_rows(embedded_data, tiny_gpt2, capsys):
    rc, out, _ = audit(capsys, "--data", embedded_data, "--model", tiny_gpt2, "--agents", "solver", "--json")
    assert rc == 0
    s = json.loads(out)
    assert list(s["by_agent"]) == ["solver"]
    solver = RolloutDataset.open(embedded_data).read(["agent", "loss_mask"]).filter(pc.field("agent") == "solver")
    assert s["overall"]["tokens"] == pc.sum(pc.list_flatten(solver["loss_mask"])).as_py()
    rc, out, _ = audit(capsys, "--data", embedded_data, "--model", tiny_gpt2, "--max-rows", "1", "--json")
    s = json.loads(out)
    # The loader's order: the block's groups by id, the first math-000/rewriter/1 (its two rewriters), taken whole.
    assert rc == 0 and s["rows"] == 2 and s["overall"]["sequences"] == 2 and list(s["by_agent"]) == ["rewriter"]


@pytest.fixture(scope="module")
def foreign_ids(tmp_path_factory):
    """A dataset whose response holds id 5000, beyond the tiny model's 1024."""
    out = tmp_path_factory.mktemp("audit") / "foreign"
    with ShardWriter(out, writer_id="test", config={}) as w:
        w.write_group([Row(
            sample_id="x-0", prompt_id="x", group_id="x/policy/0", agent="policy", round=0, prompt_tokens=[5, 6],
            response_tokens=[7, 5000], rollout_logprobs=[-1.0, -1.0], loss_mask=[1, 1], reward=1.0,
            status=Status.COMPLETED, finish_reason="stop", weight_version="0", temperature=1.0, top_p=1.0, top_k=-1,
        )])
    return out


@pytest.mark.parametrize(
    "case, expected",
    [
        ("no-dataset", "no rollshard dataset here"),
        ("no-model", "no such folder"),
        ("foreign-ids", r"sample x-0 holds token id 5000, outside the vocabulary of --model .* \(1024 ids\)"),
        ("out-folder", "is a folder; name the report file"),
        ("device", "not a torch device; use cpu, cuda or cuda:N"),
        ("no-token", "no trained token to audit"),
        ("statuses", "--statuses done: choose one or more of completed,truncated,aborted,failed"),
        ("top", "--top -1 must be >= 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(case, expected, embedded_data, foreign_ids, tiny_gpt2, tmp_path, capsys):
    data, model, extra = embedded_data, tiny_gpt2, []
    if case == "no-dataset":
        data = tmp_path / "nothing"
        data.mkdir()
    elif case == "no-model":
        model = tmp_path / "no-model"
    elif case == "foreign-ids":
        data = foreign_ids
    elif case == "out-folder":
        extra = ["--out", tmp_path]
    elif case == "device":
        extra = ["--device", "nonsense"]
    elif case == "no-token":
        extra = ["--agents", "nobody"]
    elif case == "statuses":
        extra = ["--statuses", "done"]
    elif case == "top":
        extra = ["--top", "-1"]
    rc, out, err = audit(capsys, "--data", data, "--model", model, *extra)
    assert rc == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("rollshard-train audit: error: "), err
    assert re.search(expected, err), err


@pytest.mark.parametrize("where, expected", [
    ("s3://no-such-bucket-here/a.parquet", r"--out s3://no-such-bucket-here/a\.parquet: no bucket no-such-bucket-here; "
     "create it first"),
    ("BUCKET", r"--out s3://\S+ names no file; name the report, e\.g\. --out s3://\S+/audit\.parquet"),
    ("BUCKET/reports", r"--out s3://\S+/reports is a folder; name the report file"),
])
def test_an_s3_out_is_checked_before_the_model_loads(where, expected, foreign_ids, tiny_gpt2, s3_dataset, capsys,
                                                     monkeypatch):
    from rollshard.store.inspection.audit import write_audit
    from rollshard.train import backends

    bucket = s3_dataset.rsplit("/", 1)[0]
    table = pa.table({n: pa.array([], f.type) for n, f in zip(store_audit.AUDIT_SCHEMA.names, store_audit.AUDIT_SCHEMA)})
    write_audit(table, f"{bucket}/reports/old.parquet", datasets=[])  # makes s3://BUCKET/reports a folder

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(backends, "build_backend", no_model)
    rc, out, err = audit(capsys, "--data", foreign_ids, "--model", tiny_gpt2, "--out", where.replace("BUCKET", bucket))
    assert rc == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("rollshard-train audit: error: "), err
    assert re.search(expected, err), err


def test_help_and_the_plain_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["audit", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--data", "--model", "--out", "--json", "--top", "--max-abs-diff", "--max-mean-abs-diff", "--agents",
                 "--statuses", "--max-rows", "--device", "--dtype", "--fp32-lm-head", "--micro-batch-tokens",
                 "--no-progress", "Exit status"):
        assert flag in text
    assert main(["--print-config"]) == 0  # the training command, as before
    assert "groups_per_step" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "rollshard-train audit" in capsys.readouterr().out


@pytest.fixture(scope="module")
def rewarded(embedded_data, tmp_path_factory):
    """The embedded rows (the tiny model earns no reward) with rewards 0, 1 or 2 by a hash of their sample id, so
    that groups have advantages of both signs (the store's derive, nothing else changed)."""
    import zlib

    from rollshard.store.derived.derive import derive_dataset

    out = tmp_path_factory.mktemp("audit") / "rewarded"

    def reward(t: pa.Table) -> pa.Table:
        values = [float(zlib.crc32(s.encode()) % 3) for s in t["sample_id"].to_pylist()]
        return t.set_column(t.schema.get_field_index("reward"), "reward", pa.array(values, pa.float32()))

    derive_dataset(embedded_data, out, reward, operation="set-reward", details={"reward": "crc32(sample_id) % 3"},
                   mutable_columns=("reward",), progress=False)
    return out


def test_the_corrections_table_is_the_trainers_step_zero(rewarded, other_model, tmp_path, capsys):
    """What the audit says each off-policy correction would do to the rows under another checkpoint is what the
    trainer's first step with that checkpoint does: its mask/* shares, clip fractions and dropped IS weights."""
    from rollshard.train.metrics import read_metrics

    embedded_data = rewarded
    # The tiny model spreads its probability over 1,000 ids: a TV band of 0.2 holds every token, 1e-5 does not.
    # Another seed is far off these rows: wider Geo-RS / K3-RS bands than verl's presets keep some of them.
    tv = ["--dppo-mask-low", "1e-5", "--dppo-mask-high", "1e-5"]
    masks = ["--opsm-delta", "1e-4", "--m2po-tau", "0.04", "--geo-rs", "0.95,1.5", "--k3-rs", "0.05"]
    rc, out, _ = audit(capsys, "--data", embedded_data, "--model", other_model, "--json", *tv, *masks)
    assert rc == 1  # another checkpoint: flagged, and the table is printed all the same
    table = {c["correction"]: c for c in json.loads(out)["corrections"]}
    assert list(table) == ["ppo clip", "dual clip", "cispo", "sapo", "dppo", "tis", "icepop", "sequence mask", "opsm",
                           "m2po", "geo-rs", "k3-rs"]
    share = {name: c["token_share"] for name, c in table.items()}
    tokens = trained_tokens(embedded_data)
    assert all(c["tokens"] == round(c["token_share"] * tokens) for c in table.values())
    groups = RolloutDataset.open(embedded_data).num_groups

    def step_zero(name: str, *flags) -> dict:
        run = tmp_path / name
        argv = ["--data", embedded_data, "--model", other_model, "--out", run, "--groups-per-step", groups,
                "--max-steps", 1, "--lr", 0, "--no-progress", "--no-tensorboard", *flags]
        assert main(list(map(str, argv))) == 0
        capsys.readouterr()
        return read_metrics(run)[0]

    ppo = step_zero("ppo", *masks)
    dppo = step_zero("dppo", "--pg-loss", "dppo", *tv)
    tis = step_zero("tis", "--mode", "decoupled", "--is-correction", "tis")
    icepop = step_zero("icepop", "--mode", "decoupled", "--is-correction", "mis", "--mis-low", 0.5, "--mis-high", 5)
    trainer = {
        "ppo clip": ppo["clip/frac_low"] + ppo["clip/frac_high"],
        "dual clip": ppo["clip/frac_dual"],
        "dppo": dppo["mask/dppo_low"] + dppo["mask/dppo_high"],
        "tis": tis["is/frac_dropped"],
        "icepop": icepop["is/frac_dropped"],
        "opsm": ppo["mask/opsm"],
        "m2po": ppo["mask/m2po"],
        "geo-rs": ppo["mask/geo_rs"],
        "k3-rs": ppo["mask/k3_rs"],
    }
    print({name: f"{share[name]:.4f} / {value:.4f}" for name, value in trainer.items()})
    for name, value in trainer.items():
        assert share[name] == pytest.approx(value, abs=1e-6), name
    # each count is neither none nor all of the tokens: the comparison can fail
    assert all(0 < share[n] < 1 for n in ("ppo clip", "dppo", "tis", "icepop", "opsm", "m2po", "geo-rs", "k3-rs"))


def test_a_bad_correction_parameter_is_one_line_and_exit_2(embedded_data, tiny_gpt2, capsys):
    rc, out, err = audit(capsys, "--data", embedded_data, "--model", tiny_gpt2, "--geo-rs", "1.1,1.2")
    assert rc == 2 and out == ""
    assert err.strip().splitlines() == [
        "rollshard-train audit: error: --geo-rs takes two numbers LO,HI with 0 < LO <= 1 <= HI (e.g. 0.999,1.001), "
        "got (1.1, 1.2)"
    ]
