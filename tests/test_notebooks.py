"""Execute the notebooks against a small multi-agent dataset and a metrics file written here.

Each notebook runs top to bottom in a real ipykernel of this interpreter; any cell error
fails the test. The PNG figures the notebooks draw are saved under
``$ROLLSHARD_NOTEBOOK_FIGURES`` (default: the test's tmp folder) for a person to look at.
"""

from __future__ import annotations

import base64
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

from rollshard.store.format.schema import Row, Status  # noqa: E402
from rollshard.store.io.writer import ShardWriter  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
SOLVERS = REWRITERS = 4


def _response(rng: np.random.Generator, n: int, tool_span: bool, sharp: float) -> tuple[list, list, list]:
    """Token ids, logprobs, mask; a tool span (mask 0, logprob 0.0) in the middle when asked."""
    ids = rng.integers(3, 500, n).tolist()
    lp = (-rng.exponential(sharp, n)).astype(np.float32)
    tail = rng.random(n) < 0.05
    lp[tail] = -rng.uniform(3, 12, int(tail.sum()))
    mask = np.ones(n, np.uint8)
    if tool_span and n >= 12:
        a = int(rng.integers(2, n - 8))
        mask[a : a + 6] = 0
        lp[a : a + 6] = 0.0
    return ids, lp.tolist(), mask.tolist()


def multi_agent_rows(n_prompts: int, seed: int = 0) -> list[list[Row]]:
    """Groups of one solvers -> rewriters -> selector episode per prompt, slime-style:
    4 solvers (round 0), 4 rewriters with a tool call (round 1), one selector (round 2)."""
    rng = np.random.default_rng(seed)
    groups = []
    for p in range(n_prompts):
        pid, skill, version = f"q{p}", rng.uniform(0.1, 0.9), str(p % 3)
        prompt = rng.integers(3, 500, int(rng.integers(8, 20))).tolist()
        plan = [("solver", 0, SOLVERS, 0.35), ("rewriter", 1, REWRITERS, 0.25), ("selector", 2, 1, 0.15)]
        for agent, rnd, size, sharp in plan:
            rows = []
            for i in range(size):
                n = int(rng.integers(6, 64))
                ids, lp, mask = _response(rng, n, tool_span=agent == "rewriter", sharp=sharp)
                truncated = n >= 60
                failed = agent == "solver" and p == 1 and i == 3
                correct = rng.random() < (skill + 0.2 * rnd)
                rows.append(Row(
                    sample_id=f"{pid}-{agent}-{rnd}-{i}", prompt_id=pid, group_id=f"{pid}/{agent}/{rnd}",
                    agent=agent, round=rnd, prompt_tokens=prompt,
                    response_tokens=[] if failed else ids, rollout_logprobs=[] if failed else lp,
                    loss_mask=[] if failed else mask,
                    reward=None if failed else (1.0 if p == 0 else float(correct)),  # q0: every agent right
                    status=Status.FAILED if failed else Status.TRUNCATED if truncated else Status.COMPLETED,
                    finish_reason=None if failed else "length" if truncated else "stop",
                    weight_version=version, temperature=1.0, top_p=1.0, top_k=-1,
                    prompt_text=f"Problem {p}: what is {p} + {p}?",
                    response_text=None if failed else f"{agent} {i} reasons ... Answer: {2 * p if correct else p}",
                    metadata={"task": "arith"},
                ))
            groups.append(rows)
    return groups


def write_dataset(root, model: str = "/models/not-here"):
    config = {"engine": {"kind": "embedded", "model": model}, "agent_system": "multi_agent",
              "task": "arith", "sampling": {"temperature": 1.0, "max_new_tokens": 60}}
    groups = multi_agent_rows(8)
    for writer_id, part in (("host-a", groups[:12]), ("host-b", groups[12:])):
        with ShardWriter(root, writer_id=writer_id, config=config) as w:
            for rows in part:
                w.write_group(rows)
    return root


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("nb") / "dataset")


@pytest.fixture(scope="module")
def metrics_file(tmp_path_factory) -> Path:
    """30 steps with the keys rollshard-train logs, an extra key every 5 steps, a diverged value
    written as the string "nan", a text value, and an unfinished last line (a step being written)."""
    path = tmp_path_factory.mktemp("run") / "metrics.jsonl"
    lines = []
    for step in range(1, 31):
        rec = {
            "step": step, "time": 1.7e9 + step,
            "loss/total": 0.5 * math.exp(-step / 10), "loss/policy": 0.45 * math.exp(-step / 10),
            "reward/mean": 0.3 + 0.015 * step, "reward/std": 0.4,
            "reward/solver/mean": 0.25 + 0.015 * step, "reward/rewriter/mean": 0.35 + 0.012 * step,
            "ratio/mean": 1.0 + 0.001 * math.sin(step), "ratio/min": 0.9, "ratio/max": 1.1 + 0.01 * step,
            "clip/frac_low": 0.004, "clip/frac_high": 0.006 + 0.0002 * step,
            "mismatch/abs_diff_mean": 0.011 + 0.0008 * step, "mismatch/abs_diff_max": 0.2 + 0.01 * step,
            "mismatch/k3_kl": 1e-4 * step, "is/ess": 0.99 - 0.001 * step, "is/min": 0.8, "is/max": 1.3,
            "optim/lr": 1e-6 * min(1.0, step / 10), "optim/grad_norm": 1.0 / step, "optim/grad_norm_max": 1.5 / step,
            "staleness/mean": 0.3, "staleness/max": 1.0, "staleness/hist/0": 40.0 + step, "staleness/hist/1": 16.0,
            "groups/frac_zero_variance": 0.25, "perf/tokens_per_s": 1200.0 + step, "adv/mean": 0.0,
            "note": "text values are ignored",
        }
        if step % 5 == 0:
            rec["eval/accuracy"] = 0.2 + 0.01 * step
        if step == 17:
            rec["ratio/max"] = "nan"  # the trainer writes non-finite values as strings
        lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + '\n{"step": 31, "loss/total": 0.0')
    return path


@pytest.fixture
def python3_kernel(tmp_path, monkeypatch) -> str:
    """A "python3" kernelspec that launches this interpreter, found before any user-wide one."""
    from ipykernel.kernelspec import write_kernel_spec

    write_kernel_spec(tmp_path / "kernels" / "python3")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    return "python3"


def execute(name: str, kernel: str, figures: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert all(c.get("outputs", []) == [] and c.get("execution_count") is None for c in nb.cells
               if c.cell_type == "code"), f"{name} must be stored without outputs"
    client = nbclient.NotebookClient(nb, kernel_name=kernel, timeout=120,
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    figures.mkdir(parents=True, exist_ok=True)
    for i, cell in enumerate(nb.cells):
        for j, out in enumerate(cell.get("outputs", [])):
            if "image/png" in out.get("data", {}):
                png = base64.b64decode(out.data["image/png"])
                (figures / f"{Path(name).stem}-cell{i:02d}-{j}.png").write_bytes(png)
    return nb


def _figures(tmp_path: Path) -> Path:
    return Path(os.environ.get("ROLLSHARD_NOTEBOOK_FIGURES", tmp_path / "figures"))


def _text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", ""))
            parts.append(out.get("data", {}).get("text/plain", ""))
            parts.append(out.get("data", {}).get("text/html", ""))
    return "\n".join(parts)


def test_inspect_rollouts_notebook(dataset, python3_kernel, tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLSHARD_DATASET", str(dataset))
    figures = _figures(tmp_path)
    nb = execute("inspect_rollouts.ipynb", python3_kernel, figures)
    text = _text(nb)
    # 8 prompts x 3 groups; q0's three groups all reward 1.0 -> at least 3 zero-variance groups
    assert "of 24" in text and "single-member groups: 8" in text and "no local tokenizer" in text
    assert "loss_mask 0: tool/environment token" in text  # the per-sample view picked a row with a tool span
    assert "prompt q" in text
    # reward, rounds, zero variance, lengths, logprobs, staleness, one trajectory, one episode
    assert len(list(figures.glob("inspect_rollouts-*.png"))) == 8


def test_inspect_rollouts_notebook_with_paths_relative_to_the_launch_directory(python3_kernel, tmp_path, monkeypatch):
    """As the README runs it: `ROLLSHARD_DATASET=<relative> jupyter lab notebooks/...` from another directory. The
    kernel runs in notebooks/; the path is found from the launch directory ($PWD), and a relative model path in
    the run config from a folder above the dataset."""
    from rollshard.generate.models import init_model

    root = tmp_path / "launch"
    write_dataset(root / "runs" / "demo", model="runs/tiny")  # as older datasets store it: relative to the run's cwd
    init_model(root / "runs" / "tiny", preset="tiny-gpt2", seed=0)
    monkeypatch.setenv("PWD", str(root))
    monkeypatch.setenv("ROLLSHARD_DATASET", "runs/demo")
    text = _text(execute("inspect_rollouts.ipynb", python3_kernel, _figures(tmp_path) / "relative"))
    assert f"decoding with {root / 'runs' / 'tiny'}" in text and "of 24" in text


@pytest.mark.s3
def test_inspect_rollouts_notebook_on_s3(s3_dataset, python3_kernel, tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLSHARD_DATASET", write_dataset(s3_dataset))  # the kernel inherits AWS_ENDPOINT_URL
    figures = _figures(tmp_path) / "s3"
    text = _text(execute("inspect_rollouts.ipynb", python3_kernel, figures))
    assert "of 24" in text and "single-member groups: 8" in text and "prompt q" in text
    assert len(list(figures.glob("inspect_rollouts-*.png"))) == 8


def test_train_metrics_notebook(metrics_file, python3_kernel, tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLSHARD_METRICS", str(metrics_file))
    figures = _figures(tmp_path)
    nb = execute("train_metrics.ipynb", python3_kernel, figures)
    text = _text(nb)
    assert "30 steps" in text and "skipping the unfinished last line" in text
    assert "constant 0 at every step (not plotted): adv/mean" in text  # no flat-zero panel
    assert "note" not in text.split("numeric keys:")[1].split("\n")[0]
    for panel in ("Loss: loss/total, loss/policy", "Reward: reward/mean, reward/rewriter/mean, reward/solver/mean",
                  "Clipped fraction: clip/frac_low, clip/frac_high", "KL (k3 estimator): mismatch/k3_kl",
                  "Learning rate: optim/lr", "Gradient norm: optim/grad_norm, optim/grad_norm_max"):
        assert panel in text, panel
    # the panel grid, the other keys (eval/accuracy, adv/mean, reward/std), the staleness histogram
    assert len(list(figures.glob("train_metrics-*.png"))) == 3
