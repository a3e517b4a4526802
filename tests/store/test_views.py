"""The view helpers shared by the notebooks and ``rollshard-store report``, on numbers worked out by hand."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

from rollshard.store.inspection.views import data, metrics, paths, tokens


def test_natural_sort_reads_numbers_as_numbers():
    ids = ["p/solver/0/10", "p/solver/0/9", "p/solver/0/1", "p/solver/0/2", "p/rewriter/1/0"]
    assert data.natural_sorted(ids) == ["p/rewriter/1/0", "p/solver/0/1", "p/solver/0/2", "p/solver/0/9",
                                        "p/solver/0/10"]
    assert data.natural_sorted(["v10", "v2", "v1"]) == ["v1", "v2", "v10"]


def _lf(rows):
    return pl.DataFrame(rows, orient="row", schema={"weight_version": pl.String, "agent": pl.String, "reward": pl.Float32,
                                      "weight_versions": pl.List(pl.Int32)}).lazy()


def test_staleness_counts_per_version():
    # versions 2 (3 solver rows, one spanning two versions), 10 (1 solver, 2 rewriter), 9 (1 rewriter)
    rows = ([("2", "solver", 1.0, [0])] * 2 + [("2", "solver", 0.0, [0, 1])] + [("10", "solver", 1.0, [0])]
            + [("10", "rewriter", 0.5, [0])] * 2 + [("9", "rewriter", 0.0, [0])])
    counts = data.staleness_counts(_lf(rows))
    assert counts.select("weight_version", "agent", "rows", "staleness", "multi_version_rows").rows() == [
        ("2", "solver", 3, 8, 1), ("9", "rewriter", 1, 1, 0), ("10", "rewriter", 2, 0, 0), ("10", "solver", 1, 0, 0)]
    assert counts.filter(weight_version="2")["reward_mean"][0] == pytest.approx(2 / 3)
    totals = data.version_totals(counts)
    assert totals.rows() == [("2", 8, 3, 1), ("9", 1, 1, 0), ("10", 0, 3, 0)]
    # against the trainer's version 12; a version that is not an integer has no staleness
    assert data.staleness_counts(_lf(rows), current=12)["staleness"].to_list() == [10, 3, 2, 2]
    named = data.staleness_counts(_lf([("base", "solver", 1.0, [0]), ("3", "solver", 1.0, [0])]))
    assert named.select("weight_version", "staleness").rows() == [("3", 0), ("base", None)]


def test_robust_limits_ignore_one_outlier_and_the_first_step():
    y = [150.0] + [1000.0 + 10 * (i % 5) for i in range(28)] + [90_000.0]  # warm-up, steady ~1,000-1,040, one spike
    lo, hi = metrics.robust_limits(y)
    # quartiles of the steady part and the spike: q1 1010, q3 1030 -> fence 1030 + 3 * 20 = 1090; pad 5% of 80
    assert (lo, hi) == pytest.approx((1000 - 4.5, 1090 + 4.5))
    assert metrics.robust_limits([5.0, 5.0, 5.0]) == pytest.approx((4.75, 5.25))  # flat: padded by 5% of the value
    assert metrics.robust_limits([]) == (0.0, 1.0)
    assert list(metrics.rolling_median([1.0, 100.0, 3.0, 4.0, 5.0], 3)) == [50.5, 3.0, 4.0, 4.0, 4.5]


def test_constant_zero_metrics_are_listed_not_plotted(tmp_path):
    path = tmp_path / "metrics.jsonl"
    recs = [{"step": s, "loss/total": 1.0 / s, "adv/mean": 0.0, "clip/frac_low": 0, "clip/frac_high": 0.01 * (s > 2),
             "is/min": "nan" if s == 2 else 0.0, "note": "x"} for s in (1, 2, 3)]
    path.write_text("\n".join(map(json.dumps, recs)) + '\n{"step": 4')
    m = metrics.read_metrics(str(path))
    assert m.steps == 3 and m.skipped_last_line
    assert metrics.constant_zero(m) == ["adv/mean", "clip/frac_low"]  # is/min has a NaN step: it is shown
    assert [(t, keys) for t, _, keys, _, _ in metrics.panels(m)] == [
        ("Loss", ["loss/total"]), ("Clipped fraction", ["clip/frac_high"]), ("Importance weights", ["is/min"])]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(metrics.MetricsError, match=r"bad.jsonl:2: not JSON"):
        metrics.read_metrics(str(bad))


def test_staleness_of_a_whole_round_fits_its_figure(tmp_path):
    """One round's rows trained for 24 steps are 0..23 versions behind: 24 legend entries, in columns."""
    import warnings

    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps({"step": s, f"staleness/hist/{s - 1}": 32}) for s in range(1, 25)) + "\n")
    fig = metrics.staleness_figure(metrics.read_metrics(str(path)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib: "constrained_layout not applied because axes sizes collapsed"
        fig.savefig(tmp_path / "staleness.png")
    legend = fig.axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == [str(n) for n in range(24)] and legend._ncols == 3


def test_logprob_scale_follows_the_data():
    mask = [1] * 6
    # a random model: every token near -7; the scale spans the row, not 0..-5
    low, high = tokens.logprob_scale([-7.2, -7.0, -6.9, -6.8, -7.1, -6.7], mask)
    assert -7.2 <= low < -7.15 and -6.75 < high <= -6.7
    # a trained model: most near 0 with one rare token; the 2% quantile keeps the rare one from setting the floor
    lp = [-0.01] * 80 + list(np.linspace(-0.2, -4.0, 19)) + [-30.0]
    low, high = tokens.logprob_scale(lp, [1] * 100)
    assert low == pytest.approx(np.quantile(lp, 0.02)) and -4.0 < low < -3.7 and high == pytest.approx(-0.01)
    # near-equal logprobs get at least MIN_SPAN; masked tokens do not count
    assert tokens.logprob_scale([-1.0, -1.0, -50.0], [1, 1, 0]) == pytest.approx((-1.25, -0.75))
    html = tokens.token_html(["a", "b", "c"], [-1.0, -1.0, 0.0], [1, 1, 0])
    assert html.count("loss_mask 0: tool/environment token") == 2  # the masked token and the scale's legend


def test_episode_table_shows_the_selector_pick_and_numeric_order():
    rows = [{"round": 0, "agent": "solver", "sample_id": f"q/solver/0/{i}", "reward": 1.0, "status": "completed",
             "length": 3, "response_text": f"s{i}", "meta": {"answer": f"s{i}"}} for i in (10, 2, 1)]
    rows += [{"round": 1, "agent": "rewriter", "sample_id": f"q/rewriter/1/{i}", "reward": 0.0, "status": "completed",
              "length": 3, "response_text": "r", "meta": {"answer": f"r{i}"}} for i in (0, 1)]
    rows += [{"round": 2, "agent": "selector", "sample_id": "q/selector/2/0", "reward": 0.0, "status": "completed",
              "length": 4, "response_text": "Judgment: 2",
              "meta": {"answer": "Judgment: 2", "judgment": 2, "selected": "q/rewriter/1/1",
                       "candidates": ["q/rewriter/1/0", "q/rewriter/1/1"]}}]
    rows.sort(key=lambda r: (r["round"], data.natural_key(r["sample_id"])))
    table = data.episode_table(rows)
    assert table["sample_id"].to_list()[:3] == ["q/solver/0/1", "q/solver/0/2", "q/solver/0/10"]
    assert table.filter(sample_id="q/rewriter/1/1")["pick"][0] == "picked by the selector"
    assert table.filter(agent="selector")["pick"][0] == "Judgment: 2 -> q/rewriter/1/1"
    for r in rows:
        r["prompt_text"] = "p"
    html = tokens.episode_html(rows)
    assert "Judgment: 2</b> &rarr; picked <code>q/rewriter/1/1</code>" in html
    assert "picked by the selector</b><br>Solution 2 for the selector" in html


def test_relative_paths_resolve_from_the_launch_directory_then_the_repository_root(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "notebooks").mkdir(parents=True)
    (repo / "pyproject.toml").write_text("")
    (repo / "runs" / "demo").mkdir(parents=True)
    (repo / "runs" / "tiny").mkdir()
    (repo / "runs" / "tiny" / "tokenizer.json").write_text("{}")
    elsewhere = tmp_path / "launch"
    (elsewhere / "runs" / "demo").mkdir(parents=True)
    monkeypatch.chdir(repo / "notebooks")  # where a Jupyter kernel runs
    monkeypatch.delenv("PWD", raising=False)
    assert paths.resolve_path("runs/demo") == str(repo / "runs" / "demo")  # the repository root
    monkeypatch.setenv("PWD", str(elsewhere))
    assert paths.resolve_path("runs/demo") == str(elsewhere / "runs" / "demo")  # the launch directory first
    assert paths.resolve_paths("runs/demo, ../runs/demo") == [str(elsewhere / "runs" / "demo"),
                                                               str(repo / "runs" / "demo")]
    with pytest.raises(FileNotFoundError, match="dataset 'runs/none' not found; tried"):
        paths.resolve_path("runs/none", what="dataset")
    assert paths.resolve_path("s3://bucket/ds") == "s3://bucket/ds"
    # a relative model path in a run config: from a folder above the dataset, wherever the notebook runs
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PWD")
    config = {"engine": "embedded:runs/tiny", "model": "runs/tiny"}
    assert paths.dataset_tokenizer(config, str(repo / "runs" / "demo")) == str(repo / "runs" / "tiny")
    assert paths.dataset_tokenizer({"model": "runs/none"}, str(repo / "runs" / "demo")) is None


def test_parse_rates_and_the_selector_status_in_the_episode(tmp_path):
    from rollshard.store.io.dataset import RolloutDataset
    from rollshard.store.format.schema import Row
    from rollshard.store.io.writer import ShardWriter

    # selectors: judgment ok, out_of_range, missing, missing (shares .25, .25, .5); a solver with its answer ok
    def row(sid, agent, rnd, meta):
        return Row(sample_id=sid, prompt_id=sid.split("/")[0], group_id=sid.rsplit("/", 1)[0], agent=agent, round=rnd,
                   prompt_tokens=[1], response_tokens=[2], rollout_logprobs=[-0.5], loss_mask=[1], reward=0.0,
                   status="completed", finish_reason="stop", weight_version="0", temperature=1.0, metadata=meta)

    with ShardWriter(tmp_path / "ds", writer_id="w0") as w:
        for q, status in zip("abcd", ("ok", "out_of_range", "missing", "missing")):
            w.write_group([row(f"{q}/selector/2/0", "selector", 2, {"judgment_status": status})])
        w.write_group([row("a/solver/0/0", "solver", 0, {"answer_status": "ok"})])
    rates = data.parse_rates(RolloutDataset.open(tmp_path / "ds"), ["solver", "selector"])
    assert rates.rows() == [
        ("solver", "answer_status", "ok", 1, 1.0),
        ("selector", "judgment_status", "ok", 1, 0.25),
        ("selector", "judgment_status", "missing", 2, 0.5),
        ("selector", "judgment_status", "out_of_range", 1, 0.25),
    ]
    table = data.episode_table([{"round": 2, "agent": "selector", "sample_id": "b/selector/2/0", "reward": 0.0,
                                 "status": "completed", "length": 1, "response_text": "Judgment: 6",
                                 "meta": {"judgment": None, "judgment_status": "out_of_range", "selected": None}}])
    assert table["pick"][0] == "no valid Judgment (out_of_range)"


def test_the_metrics_grid_shows_no_empty_panel(tmp_path):
    """Four panels in a grid of three columns: the two cells left over are hidden (zip took one more cell from the
    grid's iterator, so one empty panel stayed in sight, and one more in the others grid)."""
    path = tmp_path / "metrics.jsonl"
    recs = [{"step": s, "loss/total": 1.0 / s, "clip/frac_high": 0.1, "is/min": 0.5, "optim/grad_norm": 2.0 + s,
             "x/a": s, "x/b": s, "x/c": s} for s in (1, 2, 3)]
    path.write_text("\n".join(map(json.dumps, recs)) + "\n")
    m = metrics.read_metrics(str(path))
    n = len(metrics.panels(m))
    fig = metrics.panels_figure(m)
    assert n == 4 and len(fig.axes) == 6 and sum(ax.get_visible() for ax in fig.axes) == n
    assert all(ax.get_title() for ax in fig.axes if ax.get_visible())
    others = metrics.other_keys(m)
    fig = metrics.others_figure(m)
    assert sum(ax.get_visible() for ax in fig.axes) == len(others) == 3


def test_the_figures_label_what_they_show():
    from rollshard.store.inspection.views import figures

    agents = ["solver", "rewriter", "selector"]
    # Rewards across rounds: three agents with the same means, labels one above the other, none overlapping.
    across = pl.DataFrame({"round": [0, 0, 0, 1, 1, 1], "dataset": ["r0"] * 3 + ["r1"] * 3, "agent": agents * 2,
                           "mean": [0.5] * 6, "std": [0.1] * 6})
    fig = figures.rounds_figure(across, agents)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    boxes = [t.get_window_extent(renderer) for t in fig.axes[0].texts]
    assert len(boxes) == 6
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    # Reward by weight_version: which bar is which agent.
    counts = pl.DataFrame({"weight_version": ["0", "0", "1"], "agent": ["solver", "rewriter", "solver"],
                           "rows": [4, 4, 2], "reward_mean": [0.5, 0.2, 0.7], "staleness": [1, 1, 0]})
    fig = figures.staleness_figure(counts, ["solver", "rewriter"])
    assert [t.get_text() for t in fig.axes[1].get_legend().get_texts()] == ["solver", "rewriter"]
    # Zero variance: a chart of zero-height bars says so in words.
    none = pl.DataFrame({"agent": ["solver"], "fraction": [0.0], "zero_variance": [0], "groups": [4]})
    fig = figures.zero_variance_figure(none, ["solver"])
    assert "no group of two or more rows has zero reward variance" in [t.get_text() for t in fig.axes[0].texts]
