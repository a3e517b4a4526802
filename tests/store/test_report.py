"""``rollshard-store report`` end to end: two rounds of a real multi-agent dataset (the embedded engine on the tiny
GPT-2), an audit report and a metrics file; the command run as a process, the page opened in headless Chromium.

The page must load without a page or console error, every figure must decode (naturalWidth > 0), and its
numbers must be ``rollshard-store stats --json``'s. Chromium is Debian's (scripts/setup.sh installs it);
playwright only drives it.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from rollshard.store.inspection import report as report_module
from rollshard.store.inspection.audit import AUDIT_SCHEMA, AuditedDataset, write_audit
from rollshard.store.commands import main
from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.synthetic import synthetic_table
from rollshard.store.io.writer import ShardWriter
from tests import forked

SOLVERS = 11  # solver/0/10 exists: the episode must list it after solver/0/9
WORST_DIFF = -0.75  # the one token whose trainer logprob is far from the rollout one
SECTIONS = ("overview", "reward", "rounds", "groups", "lengths", "logprobs", "staleness", "trajectory", "episode",
            "audit", "metrics")
FIGURES = 11  # reward, rounds, zero variance, lengths, logprobs, staleness, trajectory, episode, audit; the
# metrics panels and staleness per step (every other key is in a panel or constant 0: no "other metrics" figure)


def cli(*args, tool: str = "rollshard.store") -> subprocess.CompletedProcess:
    return forked.run(tool, *args)


@pytest.fixture(scope="module")
def rounds(tiny_gpt2, tmp_path_factory) -> list[Path]:
    """Two rounds (two seeds) of multi_agent on the toy task: 2 prompts, 11 solvers and rewriters, 1 selector each."""
    root = tmp_path_factory.mktemp("report")
    out = []
    for seed in (0, 1):
        path = root / f"round{seed}"
        done = cli("--engine", f"embedded:{tiny_gpt2}", "--agents", "multi_agent", "--task", "toy", "--n-samples",
                   SOLVERS, "--max-new-tokens", 6, "--limit", 2, "--seed", seed, "--out", path, "--no-progress",
                   tool="rollshard.generate")
        assert done.returncode == 0, done.stderr
        out.append(path)
    return out


def write_audit_for(dataset: Path, path: Path) -> tuple[str, int]:
    """An audit of every trained token: trainer = rollout + 1e-3 noise, except one token off by WORST_DIFF."""
    rows = RolloutDataset.open(dataset).read().to_pylist()
    rng = np.random.default_rng(0)
    cols = {n: [] for n in AUDIT_SCHEMA.names}
    for r in rows:
        for pos, (tok, lp, m) in enumerate(zip(r["response_tokens"], r["rollout_logprobs"], r["loss_mask"])):
            if m:
                for k, v in (("sample_id", r["sample_id"]), ("group_id", r["group_id"]), ("agent", r["agent"]),
                             ("source", dataset.name), ("weight_version", r["weight_version"]), ("temperature", 1.0),
                             ("position", pos), ("token", tok), ("rollout_logprob", lp),
                             ("trainer_logprob", lp + float(rng.uniform(-1e-3, 1e-3)))):
                    cols[k].append(v)
    worst = len(cols["sample_id"]) // 2
    cols["trainer_logprob"][worst] = cols["rollout_logprob"][worst] + WORST_DIFF
    ds = RolloutDataset.open(dataset)
    write_audit(pa.table(cols, schema=AUDIT_SCHEMA), path, datasets=[AuditedDataset.of(dataset.name, ds)])
    return cols["sample_id"][worst], cols["position"][worst]


def write_metrics(path: Path) -> None:
    """30 steps; throughput ~1,200 tokens/s with a slow first step and one 90,000 outlier; two constant-zero keys."""
    lines = []
    for step in range(1, 31):
        tps = 150.0 if step == 1 else 90_000.0 if step == 17 else 1200.0 + 20 * math.sin(step)
        lines.append(json.dumps({"step": step, "loss/total": 0.5 * math.exp(-step / 10), "reward/mean": 0.3 + 0.01 * step,
                                 "ratio/mean": 1.0, "clip/frac_low": 0.0, "adv/mean": 0.0, "optim/lr": 1e-6,
                                 "perf/tokens_per_s": tps, "staleness/hist/0": 40.0, "staleness/hist/1": 8.0}))
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def report(rounds, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("page")
    audit, metrics, out = root / "audit.parquet", root / "metrics.jsonl", root / "report.html"
    worst = write_audit_for(rounds[-1], audit)
    write_metrics(metrics)
    done = cli("report", *rounds, "--out", out, "--audit", audit, "--metrics", metrics)
    assert done.returncode == 0, done.stderr
    assert not list(root.glob(".report.html.*"))  # the temporary file was renamed
    stats = [json.loads(cli("stats", d, "--json").stdout) for d in rounds]
    return {"out": out, "worst": worst, "stats": stats, "rounds": rounds}


@pytest.fixture(scope="module")
def page(report):
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("no chromium on PATH: run scripts/setup.sh (it installs Debian's chromium)", pytrace=False)
    errors: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        tab = browser.new_page(viewport={"width": 1400, "height": 900})
        tab.on("pageerror", lambda e: errors.append(f"page error: {e}"))
        tab.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        tab.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}"))
        tab.goto(report["out"].as_uri())
        tab.wait_for_load_state("load")
        got = {
            "errors": errors,
            "images": tab.evaluate("[...document.images].map(i => [i.complete, i.naturalWidth, i.src.slice(0, 22)])"),
            "sources": tab.evaluate("[...document.images].map(i => i.src)"),
            "sections": tab.evaluate("[...document.querySelectorAll('section')].map(s => s.id)"),
            "text": {s: tab.inner_text(f"#{s}") for s in SECTIONS},
            "per_agent": tab.evaluate(
                "[...document.querySelectorAll('table.per-agent tbody tr')].map(r => [...r.cells].map(c => c.innerText))"),
            "parse": tab.evaluate(
                "[...document.querySelectorAll('table.parse tbody tr')].map(r => [...r.cells].map(c => c.innerText))"),
            "across": tab.evaluate(
                "[...document.querySelectorAll('table.across tbody tr')].map(r => [...r.cells].map(c => c.innerText))"),
            "scripts": tab.evaluate("document.scripts.length"),
        }
        browser.close()
    return got


@pytest.mark.browser
def test_report_loads_clean_with_every_figure(page):
    assert page["errors"] == []
    assert page["scripts"] == 0
    assert len(page["images"]) == FIGURES
    assert all(done and width > 0 and src == "data:image/png;base64," for done, width, src in page["images"])
    assert tuple(page["sections"]) == SECTIONS
    for src, (_, width, _) in zip(page["sources"], page["images"]):  # each PNG whole, not only its header
        with Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))) as png:
            png.load()
            assert png.width == width


@pytest.mark.browser
def test_report_numbers_are_the_stats(page, report):
    last = report["stats"][-1]
    header = ["agent", "rows", "groups", "response_tokens", "trainable_tokens", "reward_rows", "reward_mean",
              "reward_std"]
    shown = {r[0]: dict(zip(header, r)) for r in page["per_agent"]}
    assert set(shown) == set(last["agents"]) == {"solver", "rewriter", "selector"}
    for agent, a in last["agents"].items():
        assert shown[agent]["rows"] == f"{a['rows']:,}"
        assert shown[agent]["groups"] == f"{a['groups']:,}"
        assert shown[agent]["trainable_tokens"] == f"{a['trainable_tokens']:,}"
        assert shown[agent]["reward_mean"] == f"{a['reward_mean']:,.4f}"
    assert f"{last['rows']:,}" in page["text"]["overview"]
    # parse rates: one line per agent, key and status, the status's share of the rows carrying the key
    expected = [[agent, key, status, f"{n:,}", f"{n / entry['rows']:,.4f}"]
                for agent in ("solver", "rewriter", "selector")
                for key, entry in last["agents"][agent]["parse"].items() for status, n in entry["counts"].items()]
    assert page["parse"] == expected
    assert {k for a in last["agents"].values() for k in a["parse"]} == {"answer_status", "judgment_status"}
    # reward across rounds: round i's means are dataset i's stats
    for rnd, agent, mean in ((int(r[0]), r[2], r[5]) for r in page["across"]):
        assert mean == f"{report['stats'][rnd]['agents'][agent]['reward_mean']:,.4f}"
    assert len(page["across"]) == 2 * 3


@pytest.mark.browser
def test_report_audit_episode_and_metrics_views(page, report):
    worst_id, worst_pos = report["worst"]
    assert f"{worst_id}" in page["text"]["trajectory"] and "worst-mismatch row" in page["text"]["trajectory"]
    audit = page["text"]["audit"]
    assert "worst tokens" in audit and worst_id in audit and f"{-WORST_DIFF:.4f}" in audit
    episode = page["text"]["episode"]
    assert episode.index("solver/0/9") < episode.index("solver/0/10")  # numeric order, not solver/0/1, /10, /2
    assert "Judgment" in episode and "Solution 1 for the selector" in episode
    metrics = page["text"]["metrics"]
    assert "30 steps" in metrics and "constant 0 at every step (not plotted): adv/mean, clip/frac_low" in metrics


def test_report_help_and_bad_input_are_one_line_exit_2(rounds, tmp_path):
    assert "--audit" in cli("report", "--help").stdout
    out = tmp_path / "r.html"
    bad_audit = tmp_path / "bad.parquet"
    bad_audit.write_bytes(b"not parquet")
    empty = tmp_path / "empty"
    from rollshard.store.io.writer import ShardWriter

    with ShardWriter(empty, writer_id="w", config={}):
        pass
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("{\"step\": 1}\nnot json\n{\"step\": 2}\n")
    for args, message in (
        ((tmp_path / "nothing",), "nothing"),
        ((empty,), "no rows"),
        ((rounds[0], "--audit", bad_audit), "--audit"),
        ((rounds[0], "--audit", tmp_path / "missing.parquet"), "no such file"),
        ((rounds[0], "--metrics", metrics), "not JSON"),
    ):
        done = cli("report", *args, "--out", out)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
        assert not out.exists()


# -- fast: two synthetic rounds with the same sample ids, no browser ---------------------------------------------

OFF = 0.5  # the one audited token whose trainer logprob is off, of round 0's p0-policy-0-1 (position 1)


@pytest.fixture(scope="module")
def same_ids(tmp_path_factory) -> list[Path]:
    """Two rounds of 2 groups of 2 rows, as rollshard-loop makes them: the same sample ids, other tokens."""
    root = tmp_path_factory.mktemp("same-ids")
    out = []
    for seed in (0, 1):
        table = synthetic_table(2, 2, seed=seed, prompt_len=(3, 6), response_len=(6, 12))
        with ShardWriter(root / f"r{seed}", writer_id="w", config={}) as w:
            w.write_groups(table)
        out.append(root / f"r{seed}")
    return out


def audit_of(dataset: Path, path: Path, *, recorded: bool = True) -> None:
    """Every token of ``dataset``: trainer = rollout, except p0-policy-0-1's position 1, off by OFF. Without
    ``recorded``, an audit report of schema 1.0 (no dataset named)."""
    import pyarrow.parquet as pq

    ds = RolloutDataset.open(dataset)
    cols = {n: [] for n in AUDIT_SCHEMA.names}
    for r in ds.read().to_pylist():
        for pos, (tok, lp) in enumerate(zip(r["response_tokens"], r["rollout_logprobs"])):
            off = OFF if (r["sample_id"], pos) == ("p0-policy-0-1", 1) else 0.0
            values = (r["sample_id"], r["group_id"], r["agent"], dataset.name, r["weight_version"], 1.0, pos, tok, lp,
                      lp + off)
            for name, v in zip(AUDIT_SCHEMA.names, values):
                cols[name].append(v)
    table = pa.table(cols, schema=AUDIT_SCHEMA)
    if recorded:
        write_audit(table, path, datasets=[AuditedDataset.of(dataset.name, ds)])
    else:
        pq.write_table(table.replace_schema_metadata({"rollshard.audit_schema_version": "1.0"}), path)


def trajectory_diffs(page: str) -> list[str]:
    """The trainer - rollout diff of every token of the page's one trajectory (its hover texts)."""
    section = page[page.index("<section id='trajectory'>"):page.index("<section id='episode'>")]
    return re.findall(r"\(diff ([+-][0-9.]+)\)", section)


def test_report_pairs_the_audit_with_its_own_rounds_rows(same_ids, tmp_path):
    """An audit of round 0, two rounds given: the trajectory is round 0's row (round 1's has the same id)."""
    r0, r1 = same_ids
    audit = tmp_path / "a0.parquet"
    audit_of(r0, audit)
    page = report_module.build([str(r0), str(r1)], audit=str(audit))
    diffs = trajectory_diffs(page)
    row = next(r for r in RolloutDataset.open(r0).read().to_pylist() if r["sample_id"] == "p0-policy-0-1")
    # round 0's own tokens: every diff 0 but the one of position 1 (round 1's row would show its logprobs'
    # distance from round 0's trainer logprobs instead)
    assert diffs == ["+0.0000", f"+{OFF:.4f}"] + ["+0.0000"] * (len(row["response_tokens"]) - 2)
    assert f"of {r0}" in page and f"fingerprint {RolloutDataset.open(r0).fingerprint}" in page


def test_report_refuses_an_audit_of_another_round(same_ids, tmp_path, capsys, monkeypatch):
    r0, r1 = same_ids
    audit, out = tmp_path / "a0.parquet", tmp_path / "r.html"
    audit_of(r0, audit)
    assert main(["report", str(r1), "--out", str(out), "--audit", str(audit), "--no-progress"]) == 2
    err = capsys.readouterr().err
    f0, f1 = RolloutDataset.open(r0).fingerprint, RolloutDataset.open(r1).fingerprint
    assert err == (f"rollshard-store: error: --audit {audit}: the audit is of {r0} (fingerprint {f0}), not of {r1} "
                   f"(fingerprint {f1}); pass that dataset or re-run rollshard-train audit --data {r1}\n")
    assert not out.exists()


def test_report_reads_an_audit_naming_no_dataset_with_a_warning(same_ids, tmp_path, capsys):
    """A report of audit schema 1.0: rows matched by sample_id alone, newest dataset first, said on stderr."""
    r0, r1 = same_ids
    audit, out = tmp_path / "old.parquet", tmp_path / "r.html"
    audit_of(r0, audit, recorded=False)
    assert main(["report", str(r0), "--out", str(out), "--audit", str(audit), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "warning: --audit" in err and "names no audited dataset" in err and "re-run rollshard-train audit" in err
    page = out.read_text()
    assert "names no audited dataset" in page and trajectory_diffs(page)[1] == f"+{OFF:.4f}"


def test_report_bad_out_is_one_line_before_the_page_is_built(same_ids, tmp_path, capsys, monkeypatch):
    def no_page(*args, **kwargs):
        raise AssertionError("the page was built before --out was checked")

    monkeypatch.setattr(report_module, "build", no_page)
    for out, message in (
        (tmp_path, f"--out {tmp_path} is a folder; name the page, e.g. --out {tmp_path / 'report.html'}"),
        (tmp_path / "no" / "r.html", f"--out {tmp_path / 'no' / 'r.html'}: no folder {tmp_path / 'no'}"),
        ("s3://bucket/r.html", "--out s3://bucket/r.html: the report is written to a local file"),
    ):
        assert main(["report", str(same_ids[0]), "--out", str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_report_read_errors_are_one_line(same_ids, tmp_path, capsys, monkeypatch, s3_dataset):
    out = tmp_path / "r.html"
    assert main(["report", str(tmp_path / "nothing"), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no rollshard dataset here" in err and "no such file" not in err, err
    # an --audit in a bucket that does not exist: the read fails under pyarrow
    nobucket = "s3://no-such-bucket-here/a.parquet"
    assert main(["report", str(same_ids[0]), "--out", str(out), "--audit", nobucket, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == f"rollshard-store: error: --audit {nobucket}: no such file\n"
    # a shard cut short
    damaged = tmp_path / "damaged"
    shutil.copytree(same_ids[0], damaged)
    shard = RolloutDataset.open(damaged).files[0]
    Path(shard).write_bytes(Path(shard).read_bytes()[:-200])
    assert main(["report", str(damaged), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(damaged) in err, err
    # a read refused under pyarrow (S3 access denied, an I/O error): the datasets named, no traceback
    def refused(*args, **kwargs):
        raise OSError("AWS Error ACCESS_DENIED during GetObject operation")

    monkeypatch.setattr(RolloutDataset, "scan", refused)
    assert main(["report", str(same_ids[0]), str(same_ids[1]), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == (f"rollshard-store: error: cannot read {same_ids[0]} {same_ids[1]}: AWS Error ACCESS_DENIED during "
                   "GetObject operation; run `rollshard-store validate` on it\n")
    assert not out.exists()


def test_report_shows_held_out_accuracy_beside_the_training_reward(same_ids):
    held_out = [
        {"round": 0, "train_reward": 0.25, "policy": 0.203, "checkpoint": 0.375},
        {"round": 1, "train_reward": 0.5, "policy": 0.375, "checkpoint": 0.4219},
    ]
    page = report_module.build([str(p) for p in same_ids], held_out=held_out)
    section = page[page.index("<section id='held-out'>"):]
    section = section[: section.index("</section>")]
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", section)
    assert cells[:8] == ["0", "0.2500", "0.2030", "0.3750", "1", "0.5000", "0.3750", "0.4219"], cells
    assert "<img" in section and "Held-out accuracy across rounds" in section
    assert "<section id='held-out'>" not in report_module.build([str(same_ids[0])])  # no --eval, no section


def test_the_report_decodes_tokens_without_importing_transformers(rounds, tmp_path):
    """Its tokens decoded from the model folder's tokenizer.json with the tokenizers library: transformers' import
    was ~2 s of a report's ~6 s on 2 cores."""
    script = ("import sys\nfrom rollshard.store.inspection import report\n"
              f"page = report.build({[str(r) for r in rounds]!r})\n"
              "print('transformers' in sys.modules, 'decoded with' in page)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]


def test_the_decoder_gives_transformers_text_for_every_token_and_sequence(tiny_gpt2):
    from rollshard.store.models.tokenizer import Decoder, load_decoder, load_tokenizer

    decoder, tokenizer = load_decoder(tiny_gpt2), load_tokenizer(tiny_gpt2)
    assert isinstance(decoder, Decoder)
    rng = np.random.default_rng(0)
    ids = [[i] for i in range(len(tokenizer))] + [rng.integers(0, len(tokenizer), 20).tolist() for _ in range(50)]
    for skip in (False, True):
        assert decoder.batch_decode(ids, skip_special_tokens=skip) == tokenizer.batch_decode(
            ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
