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
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from rollshard.store.audit import AUDIT_SCHEMA, write_audit
from rollshard.store.dataset import RolloutDataset

SOLVERS = 11  # solver/0/10 exists: the episode must list it after solver/0/9
WORST_DIFF = -0.75  # the one token whose trainer logprob is far from the rollout one
SECTIONS = ("overview", "reward", "rounds", "groups", "lengths", "logprobs", "staleness", "trajectory", "episode",
            "audit", "metrics")
FIGURES = 11  # reward, rounds, zero variance, lengths, logprobs, staleness, trajectory, episode, audit; the
# metrics panels and staleness per step (every other key is in a panel or constant 0: no "other metrics" figure)


def cli(*args, tool: str = "rollshard.store") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", tool, *map(str, args)], capture_output=True, text=True, timeout=300)


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
    write_audit(pa.table(cols, schema=AUDIT_SCHEMA), path)
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
    from rollshard.store.writer import ShardWriter

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
