"""``rollshard-store report``: one self-contained HTML page with the views of ``notebooks/inspect_rollouts.ipynb``
(and, given a run's metrics, ``notebooks/train_metrics.ipynb``'s), built from the same functions
(:mod:`rollshard.store.inspection.views`), so the page and the notebooks show the same numbers and figures.

Several datasets are read as consecutive rounds (round 0 first): the page compares reward per agent
across them, and details the last one. With an audit report (``rollshard-train audit``), the trajectory
shown token by token is the worst-mismatch one, its trainer logprobs beside the rollout ones: the worst token
of the sources the report names whose dataset (by fingerprint) is among those given, its row read from that
dataset (sample ids repeat across rounds). An audit of none of them is refused; one of audit schema 1.0, which
names no dataset, is paired by sample_id alone (newest dataset first), with a warning.

Figures are inline PNGs (base64 data URIs); the page loads nothing from the network and runs no script.
It is written to a temporary file beside ``--out`` (a local path, checked up front by :func:`check_out`), then
renamed.
"""

from __future__ import annotations

import datetime as dt
import html
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import polars as pl

from rollshard.store.common import show_number
from rollshard.store.io.storage import Storage
from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.format.groups import REWARD_STD_DDOF
from rollshard.store.inspection.stats import decode_each
from rollshard.store.inspection.views import data, figures
from rollshard.store.inspection.views.html import figure_html, table_html
from rollshard.store.inspection.views.paths import dataset_tokenizer

TOKEN_ROWS = 5_000  # rows read for the token-level views
MAX_TOKENS_SHOWN = 1_024  # one trajectory's tokens shown (a long one is cut, and says so)
PAGE_START = "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
TITLE = "rollshard report:"  # every page's title starts so: with PAGE_START, how a page to replace is recognized


@dataclass
class Page:
    title: str
    sections: list[tuple[str, str, str]] = field(default_factory=list)  # (id, heading, body html)
    closers: list = field(default_factory=list)

    def add(self, sid: str, heading: str, *parts: str) -> None:
        self.sections.append((sid, heading, "".join(parts)))

    def figure(self, fig, alt: str) -> str:
        out = figure_html(fig, alt)
        fig.clear()  # figures are built without pyplot: dropping the last reference frees them
        return out


def _p(text: str) -> str:
    return f"<p>{text}</p>"


def build(datasets: list[str], *, audit: str | None = None, metrics: str | None = None,
          held_out: list[dict[str, Any]] | None = None, async_run: dict[str, Any] | None = None,
          step: Callable[[str], None] = lambda _: None, warn: Callable[[str], None] = lambda _: None) -> str:
    """The report page as HTML text. ``step(name)`` is called as each section starts (progress), ``warn(text)``
    with what the page had to guess (an audit report naming no dataset). An audit of none of ``datasets`` is
    refused (:class:`~rollshard.store.inspection.views.mismatch.AuditDatasetError`) before any section is built.
    ``held_out``: per round, ``{"round", "train_reward", "policy", "checkpoint"}`` with the held-out pass@1 of the
    round's policy and of the checkpoint its training made (None where not evaluated), as ``rollshard-loop
    --eval`` measures them: a section of its own beside the rewards. ``async_run``: the figures of a
    ``rollshard-loop --async`` run (its ``loop.json``): a section on generation and training over time."""
    figures.mpl()  # the one-line error about the extra, before any work
    step("opening datasets")
    opened = [RolloutDataset.open(p) for p in datasets]
    for ds in opened:
        if ds.num_rows == 0:
            raise ValueError(f"{ds.storage.uri}: the dataset has no rows (no committed shard); nothing to report")
    audit_table = pairing = None
    if audit is not None:
        from rollshard.store.inspection.views import mismatch

        step("reading the audit report")
        audit_table = mismatch.load(audit)
        pairing = mismatch.pair(audit_table, opened, audit=audit)
        if pairing.audited is None:
            warn(f"--audit {audit} {mismatch.UNPAIRED}")
    run_metrics = None
    if metrics is not None:
        from rollshard.store.inspection.views import metrics as metrics_views

        step("reading the metrics")
        run_metrics = metrics_views.read_metrics(metrics)

    ds = opened[-1]
    page = Page(f"{TITLE} {ds.storage.uri}")
    lf = ds.scan()
    agents = data.agent_order(lf)
    step("overview")
    _overview(page, opened)
    step("rewards")
    _rewards(page, opened, lf, agents)
    if held_out:
        step("held-out evaluation")
        _held_out(page, held_out)
    if async_run:
        step("asynchronous run")
        _async_run(page, async_run)
    step("groups, lengths")
    _groups_lengths(page, lf, agents)
    step("logprobs")
    tokenizer, tok_note = _tokenizer(ds)
    _logprobs(page, lf, agents, tokenizer, tok_note)
    step("staleness")
    _staleness(page, lf, agents)
    step("one trajectory")
    _trajectory(page, lf, tokenizer, audit_table, pairing)
    step("one prompt across the agents")
    _episode(page, lf, agents)
    if audit_table is not None:
        step("audit")
        _audit(page, audit, audit_table, pairing)
    if run_metrics is not None:
        step("training metrics")
        _metrics(page, metrics, run_metrics)
    return render(page, datasets)


# -- sections ------------------------------------------------------------------------------------


def _overview(page: Page, opened: list[RolloutDataset]) -> None:
    parts = []
    if len(opened) > 1:
        rows = [{"round": i, "dataset": d.storage.uri, "rows": d.num_rows, "groups": d.num_groups,
                 "response tokens": d.num_response_tokens, "fingerprint": d.fingerprint} for i, d in enumerate(opened)]
        parts.append(_p(f"{len(opened)} datasets, read as consecutive rounds; the sections below detail the last."))
        parts.append(table_html(pl.DataFrame(rows), cls="rounds"))
    ds = opened[-1]
    parts.append(table_html(data.overview(ds), cls="overview"))
    parts.append(table_html(data.status_counts(ds.scan()), cls="status", caption="rows by status"))
    config = html.escape(json.dumps(ds.config, indent=2, sort_keys=True, default=str))
    parts.append(f"<details><summary>run config</summary><pre>{config}</pre></details>")
    page.add("overview", "Overview", *parts)


def _rewards(page: Page, opened, lf, agents) -> None:
    ds = opened[-1]
    rewards = data.finite_rewards(lf)
    by_round = data.reward_by_round(rewards, agents)
    page.add(
        "reward", "Reward by agent and round",
        _p(f"Finite rewards only (a failed row may have none); std with ddof={REWARD_STD_DDOF}, as the trainer "
           "normalizes. <i>round</i> here is the agent system's step (multi_agent: solver 0, rewriter 1, selector 2)."),
        table_html(data.per_agent(ds, agents), cls="per-agent", caption="by agent (as rollshard-store stats)"),
        _parse_table(ds, agents),
        table_html(by_round, cls="by-round", caption="by agent and round"),
        page.figure(figures.reward_figure(by_round, rewards, agents), "reward by agent and round"),
    )
    across = data.rewards_across(opened)
    all_agents = agents + [a for a in data.natural_sorted(across["agent"].unique().to_list()) if a not in agents]
    page.add(
        "rounds", "Reward across rounds",
        _p("Each dataset is one round of generate -> train -> generate, in the order given."
           if len(opened) > 1 else "One dataset given (one round); pass several to compare rounds."),
        table_html(across, cls="across"),
        page.figure(figures.rounds_figure(across, all_agents), "reward across rounds"),
    )


def _held_out(page: Page, rounds: list[dict[str, Any]]) -> None:
    table = pl.DataFrame(
        [{"round": r["round"], "train reward (its rows)": r.get("train_reward"),
          "held-out pass@1 (its policy)": r.get("policy"), "held-out pass@1 (its checkpoint)": r.get("checkpoint")}
         for r in rounds],  # fmt: skip
        schema={"round": pl.Int64, "train reward (its rows)": pl.Float64, "held-out pass@1 (its policy)": pl.Float64,
                "held-out pass@1 (its checkpoint)": pl.Float64},
    )
    page.add(
        "held-out", "Held-out accuracy across rounds",
        _p("Round k's policy generated its rows (their mean reward is the training reward) and was trained into its "
           "checkpoint, the policy of round k+1; both evaluated greedy on the task's held-out split "
           "(rollshard-generate eval), which training never sees."),
        table_html(table, cls="held-out"),
        page.figure(figures.held_out_figure(table), "held-out accuracy and training reward across rounds"),
    )


def _async_run(page: Page, run: dict[str, Any]) -> None:
    share = lambda x: None if x is None else round(100 * x, 1)  # noqa: E731
    totals = pl.DataFrame([{
        "steps": run["steps"], "seconds": run["seconds"], "steps/hour": run["steps_per_hour"],
        "rows generated": run["rows_generated"], "rows trained": run["rows_trained"],
        "rows dropped as stale": run["rows_dropped_stale"], "engine busy %": share(run.get("engine_busy_share")),
        "trainer busy %": share(run.get("trainer_busy_share")),
    }])  # fmt: skip
    staleness = pl.DataFrame(
        {"versions behind": list(run["staleness_hist"]), "trained rows": list(run["staleness_hist"].values())},
        schema={"versions behind": pl.String, "trained rows": pl.Int64},
    )
    page.add(
        "async", "Generation and training at once",
        _p("The engine generated while the trainer trained (rollshard-loop --async): rows committed and steps taken "
           "over the run, each side's busy share (the engine's time with a batch; the trainer's step time less its "
           "waits for commits), and how many versions behind its policy each trained row was."),
        table_html(totals, cls="async"),
        table_html(staleness, cls="staleness-trained", caption="staleness of the trained rows"),
        page.figure(figures.async_figure(run.get("timeline") or [], run.get("reward_by_step") or []),
                    "rows committed and steps over time; reward per step"),
    )


def _parse_table(ds: RolloutDataset, agents) -> str:
    rates = data.parse_rates(ds, agents)
    if rates.is_empty():
        return _p("No row records what its response parsed to (metadata answer_status / judgment_status).")
    return table_html(rates, cls="parse", caption="what the responses parsed to, by agent: share of the agent's rows "
                      "(multi_agent: answer_status ok | missing; the selector's judgment_status ok | out_of_range | "
                      "missing)")


def _groups_lengths(page: Page, lf, agents) -> None:
    per_group, by_agent = data.groups(lf, agents)
    n_zero, n_single = int(per_group["zero_variance"].sum()), int(per_group["single_member"].sum())
    page.add(
        "groups", "Groups with zero reward variance",
        _p(f"zero-variance groups: {n_zero} of {per_group.height} ({n_zero / max(per_group.height, 1):.1%}); "
           f"single-member groups: {n_single}. A group of 2+ rows with equal rewards has every advantage 0; a "
           "single-member group (the selector) is trained on its reward."),
        table_html(by_agent, cls="zero-variance"),
        page.figure(figures.zero_variance_figure(by_agent, agents), "zero-variance groups"),
    )
    lens = data.lengths(lf)
    page.add(
        "lengths", "Response length by agent and finish reason",
        table_html(data.length_summary(lens, agents), cls="lengths"),
        page.figure(figures.length_figure(lens, agents), "response lengths"),
    )


def _tokenizer(ds: RolloutDataset):
    path = dataset_tokenizer(ds.config, ds.storage.uri)
    if path is None:
        return None, "no local tokenizer named in the run config: showing token ids"
    from rollshard.store.models.tokenizer import load_decoder

    try:
        return load_decoder(path), f"decoded with {path}"
    except (OSError, ValueError) as e:
        return None, f"showing token ids: the run config's tokenizer {path} did not load ({' '.join(str(e).split())})"


def _logprobs(page: Page, lf, agents, tokenizer, note: str) -> None:
    tokens = data.trained_tokens(lf, TOKEN_ROWS)
    lowest = tokens.sort("rollout_logprobs").head(15)
    if tokenizer is not None:
        lowest = lowest.with_columns(text=pl.Series(decode_each(tokenizer, lowest["response_tokens"].to_list())))
    page.add(
        "logprobs", "Logprobs",
        _p("Over trained tokens (loss_mask 1); the entropy proxy is the mean surprise of the sampled tokens."),
        table_html(data.logprob_by_agent(lf, agents), cls="logprobs"),
        page.figure(figures.logprob_figure(tokens, data.row_mean_logprob(lf), agents), "logprob distributions"),
        _p(f"lowest-logprob trained tokens ({html.escape(note)}):"),
        table_html(lowest, cls="lowest"),
    )


def _staleness(page: Page, lf, agents) -> None:
    counts = data.staleness_counts(lf)
    page.add(
        "staleness", "Staleness by weight version",
        _p("weight_version is the policy that generated a row (the last one when an update landed mid-response: "
           "multi-version rows). Staleness: versions behind the newest in the dataset. The trainer and --max-staleness "
           "count a multi-version row from its oldest token, so such a row is staler there than its line here."),
        table_html(data.version_totals(counts), cls="versions"),
        page.figure(figures.staleness_figure(counts, agents), "rows by weight version"),
    )


def _trajectory(page: Page, lf, tokenizer, audit_table, pairing) -> None:
    from rollshard.store.inspection.views import tokens as token_views

    row, trainer, why = None, None, "the first row with a tool/environment (masked) span, else the first row"
    if audit_table is not None:
        from rollshard.store.inspection.views import mismatch

        worst = mismatch.worst_sample(pairing.tokens(audit_table))
        if worst is not None:
            source, sid = worst
            ds, row = pairing.find_row(source, sid)
            if row is not None:
                got = mismatch.sample_tokens(audit_table, sid, source)
                by_pos = dict(zip(got["position"].to_list(), got["trainer_logprob"].to_list()))
                trainer = [by_pos.get(i, lp) for i, lp in enumerate(row["rollout_logprobs"])]
                why = ("the worst-mismatch row of the audit report (the largest |trainer - rollout| logprob), "
                       f"of {ds.storage.uri}")
            else:
                why = f"the audit's worst sample {sid!r} is in none of the datasets; showing " + why
    row = row or data.pick_sample(lf)
    ids = list(row["response_tokens"])[:MAX_TOKENS_SHOWN]
    texts = decode_each(tokenizer, ids) if tokenizer is not None else [f"{t} " for t in ids]
    n = len(row["response_tokens"])
    mask = list(row["loss_mask"])
    head = (f"<b>{html.escape(row['sample_id'])}</b>: agent {html.escape(row['agent'])}, round {row['round']}, "
            f"group {html.escape(row['group_id'])}, reward {show_number(row['reward'], '.4g')}, "
            f"status {html.escape(row['status'])}, "
            f"weight_version {html.escape(str(row['weight_version']))}, {n} response tokens "
            f"({n - sum(mask)} masked). Chosen: {html.escape(why)}.")
    prompt = (f"<details><summary>prompt text</summary><pre class='prompt'>{html.escape(row['prompt_text'])}</pre>"
              "</details>") if row["prompt_text"] else ""
    cut = _p(f"first {MAX_TOKENS_SHOWN:,} of {n:,} tokens shown") if n > MAX_TOKENS_SHOWN else ""
    page.add(
        "trajectory", "One trajectory, token by token",
        _p(head), prompt,
        token_views.token_html(texts, row["rollout_logprobs"][:MAX_TOKENS_SHOWN], mask[:MAX_TOKENS_SHOWN],
                               trainer=trainer[:MAX_TOKENS_SHOWN] if trainer else None),
        cut,
        page.figure(token_views.token_figure(row), "logprob per token"),
    )


def _episode(page: Page, lf, agents) -> None:
    from rollshard.store.inspection.views import tokens as token_views

    prompt_id = data.pick_episode_prompt(lf)
    rows = data.episode(lf, prompt_id)
    page.add(
        "episode", "One prompt across the agents",
        _p(f"prompt <code>{html.escape(str(prompt_id))}</code> (the prompt with the most agents, then the most distinct "
           "rewards): what each role saw and answered; the selector's Judgment and the rewrite it picked."),
        token_views.episode_html(rows),
        page.figure(token_views.episode_figure(rows, agents), "rewards of one episode"),
    )


def _audit(page: Page, path: str, table, pairing) -> None:
    from rollshard.store.inspection.views import mismatch
    from rollshard.store.inspection.views import tokens as token_views
    from rollshard.store.inspection.audit import worst_tokens

    summary, frames = mismatch.summary_frames(table)
    worst = mismatch.worst_sample(pairing.tokens(table))
    parts = [_p(f"audit report {html.escape(path)} ({html.escape(pairing.describe())}): "
                f"{summary['overall']['tokens']:,} tokens of {summary['overall']['sequences']:,} sequences; "
                f"r = trainer - rollout logprob; ratio band {summary['ratio_band']}.")]
    if pairing.audited is None:
        parts.append(_p(f"<b>warning</b>: the report {html.escape(mismatch.UNPAIRED)}."))
    for key, df in frames.items():
        parts.append(table_html(df, cls=f"audit-{key}", caption=key.replace("_", " ")))
    parts.append(table_html(worst_tokens(table, 10), cls="audit-worst", caption="worst tokens"))
    if worst is not None:
        source, sid = worst
        parts.append(page.figure(token_views.audit_figure(mismatch.sample_tokens(table, sid, source), sid),
                                 "rollout vs trainer logprob"))
    page.add("audit", "Trainer vs rollout logprobs (audit)", *parts)


def _metrics(page: Page, path: str, m) -> None:
    from rollshard.store.inspection.views import metrics as mv

    parts = [_p(f"{html.escape(path)}: {m.steps} steps"
                + (" (an unfinished last line skipped)" if m.skipped_last_line else "") + ".")]
    zero = mv.constant_zero(m)
    if zero:
        parts.append(_p(f"constant 0 at every step (not plotted): {html.escape(', '.join(zero))}"))
    for fig, alt in ((mv.panels_figure(m), "training panels"), (mv.others_figure(m), "other metrics"),
                     (mv.staleness_figure(m), "staleness per step")):
        if fig is not None:
            parts.append(page.figure(fig, alt))
    parts.append(f"<details><summary>every metric: last, min, max</summary>{table_html(mv.summary(m))}</details>")
    page.add("metrics", "Training metrics", *parts)


# -- page ----------------------------------------------------------------------------------------

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0 auto;max-width:1400px;padding:0 24px 48px;
color:#222;line-height:1.4}
h1{font-size:1.5em;margin-top:1em} h2{border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:2em}
nav{background:#f6f6f6;padding:8px 12px;border-radius:6px} nav a{margin-right:12px}
table.data,table.episode{border-collapse:collapse;margin:8px 0 16px;font-size:13px}
table.data th,table.data td,table.episode th,table.episode td{border:1px solid #ddd;padding:3px 8px;vertical-align:top}
table.data th,table.episode th{background:#f2f2f2;text-align:left} td.num{text-align:right;font-variant-numeric:tabular-nums}
caption{caption-side:top;text-align:left;font-weight:600;padding:4px 0} caption.more{font-weight:400;color:#777}
img.figure{max-width:100%;height:auto} figure{margin:8px 0}
pre{background:#fafafa;border:1px solid #eee;padding:6px;white-space:pre-wrap;max-height:24em;overflow:auto;font-size:12px}
pre.answer{max-height:8em;margin:0;border:none;background:none;padding:0}
tr.picked{background:#eef7ee} .tokens{max-height:30em;overflow:auto;border:1px solid #eee;padding:6px}
footer{color:#777;font-size:12px;margin-top:3em}
"""


def render(page: Page, datasets: list[str]) -> str:
    nav = "".join(f"<a href='#{sid}'>{html.escape(h)}</a>" for sid, h, _ in page.sections)
    body = "".join(f"<section id='{sid}'><h2>{html.escape(h)}</h2>{b}</section>" for sid, h, b in page.sections)
    made = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    from rollshard.store.format.schema import SCHEMA_VERSION

    return (f"{PAGE_START}<title>{html.escape(page.title)}</title>"
            f"<meta name='viewport' content='width=device-width,initial-scale=1'><style>{CSS}</style></head><body>"
            f"<h1>{html.escape(page.title)}</h1><nav>{nav}</nav>{body}"
            f"<footer>rollshard-store report of {html.escape(', '.join(datasets))}; schema {SCHEMA_VERSION}; "
            f"made {made}</footer></body></html>")


def check_out(out: str) -> str:
    """The absolute local path of ``--out``; ValueError (one line) for a URI, a folder or a missing parent
    folder. Checked before the page is built."""
    if "://" in out:
        raise ValueError(f"--out {out}: the report is written to a local file; write it here, then copy it "
                         "(e.g. aws s3 cp)")
    target = os.path.abspath(os.path.expanduser(out))
    if os.path.isdir(target):
        raise ValueError(f"--out {out} is a folder; name the page, e.g. --out {os.path.join(out, 'report.html')}")
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        raise ValueError(f"--out {out}: no folder {folder}; create it first or choose another path")
    return target


def is_page(path: Path) -> bool:
    """Whether the file at ``path`` is a page :func:`write` wrote (rewriting it is a rerun)."""
    start = f"{PAGE_START}<title>{TITLE}".encode()
    with open(path, "rb") as f:
        return f.read(len(start)) == start


def write(text: str, out: str) -> str:
    """``text`` to ``out`` (:func:`check_out`) atomically (a temporary file beside it, fsynced, renamed);
    returns ``out``."""
    target = check_out(out)
    Storage(os.path.dirname(target)).write_atomic(os.path.basename(target), text.encode("utf-8"))
    return out
