"""The rich tables of ``validate``, ``stats`` and ``inspect`` (a dataset's summary): each a function of the
numbers the command looked up, drawing nothing itself. Cells are shown as they are, never parsed as markup."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from rich.console import RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from rollshard.store.format.groups import REWARD_STD_DDOF
from rollshard.store.format.lineage import DERIVED_KEY, LINEAGE_KEY
from rollshard.store.io.validate import ValidationReport


# -- validate -------------------------------------------------------------------------------


def validation(report: ValidationReport) -> list[RenderableType]:
    """The shards and their results, the problems, the warnings and the verdict line."""
    shards = Table(title=escape(f"{report.dataset}: {len(report.shards)} shards"))
    for col in ("shard", "writer", "rows", "bytes", "result"):
        shards.add_column(col, justify="right" if col in ("rows", "bytes") else "left")
    involved = Counter(path for p in report.problems for path in p.shards)  # cross-shard ones too
    for s in report.shards:
        n = involved[s.path]
        result = Text("ok", style="green") if not n else Text(f"{n} problem{'s' * (n > 1)}", style="red")
        row(shards, s.path, s.writer_id, f"{s.rows:,}", f"{s.bytes:,}", result)
    shown: list[RenderableType] = [shards]
    if report.problems:
        problems = Table(title="problems", show_lines=False)
        problems.add_column("where", overflow="fold")
        problems.add_column("check", style="bold")
        problems.add_column("detail", overflow="fold")
        for p in report.problems:
            row(problems, "\n".join(p.shards) or "dataset", p.check, p.detail)
        shown.append(problems)
    shown += [Text("warning: ", style="yellow") + Text(w) for w in report.warnings]
    if report.ok:
        rows = sum(s.rows for s in report.shards)
        shown.append(Text("ok", style="green") + Text(f": {len(report.shards)} shards, {rows:,} rows, every check passed"))
    else:
        shown.append(Text("FAILED", style="red") + Text(f": {len(report.problems)} problems in {report.dataset}"))
    return shown


# -- stats ----------------------------------------------------------------------------------


def stats(st: dict[str, Any]) -> list[RenderableType]:
    shown = [totals(st), counts("rows by status", "status", st["status"], st["rows"]), agents(st)]
    if any(a.get("parse") for a in st["agents"].values()):
        shown.append(parsed(st))
    return shown


def parsed(st: dict[str, Any]) -> Table:
    """Each agent's parse rates (an agent system that records answer_status / judgment_status: multi_agent)."""
    t = Table(title="parsed by agent")
    for c in ("agent", "what", "rows", "ok", "statuses"):
        t.add_column(c, justify="left" if c in ("agent", "what", "statuses") else "right")
    for agent, a in st["agents"].items():
        for key, e in a.get("parse", {}).items():
            statuses = ", ".join(f"{k} {n:,}" for k, n in e["counts"].items())
            row(t, agent, key.removesuffix("_status"), f"{e['rows']:,}", f"{e['ok_share']:.1%}", statuses)
    return t


def totals(st: dict[str, Any]) -> Table:
    t = Table(title=escape(f"dataset {st['dataset']}"), show_header=False)
    t.add_column("key", style="bold")
    t.add_column("value", justify="right")
    for key in ("schema_version", "fingerprint", "writers", "shards", "rows", "groups"):
        row(t, key, fmt(st[key]))
    for key in ("prompt_tokens", "response_tokens", "tokens", "bytes"):
        row(t, key, fmt(st[key]))
    if st["rows_with_support"]:
        row(t, "rows with a sampling support", f"{st['rows_with_support']:,} ({st['support_fraction']:.1%})")
    if st["rows_with_routing"]:
        shapes = ", ".join(f"{r['layers']} layers x top-{r['top_k']} of {r['experts']} experts" for r in st["routing"])
        row(t, "rows with MoE routing", f"{st['rows_with_routing']:,} ({st['rows_with_routing'] / st['rows']:.1%}; "
            f"{shapes})")
    return t


def counts(title: str, name: str, by: dict[str, int], total: int) -> Table:
    t = Table(title=title)
    t.add_column(name)
    t.add_column("rows", justify="right")
    t.add_column("share", justify="right")
    for k, n in by.items():
        row(t, str(k), f"{n:,}", f"{n / total:.1%}" if total else "-")
    return t


def agents(st: dict[str, Any]) -> Table:
    t = Table(title="by agent")
    cols = ("rows", "groups", "response_tokens", "trainable_tokens", "reward_mean", "reward_std")
    t.add_column("agent")
    for c in cols:
        t.add_column(c.replace("_", " "), justify="right")
    for agent, a in st["agents"].items():
        row(t, agent, *(fmt(a[c]) for c in cols))
    return t


# -- inspect (the summary) ------------------------------------------------------------------


def summary(summary: dict[str, Any]) -> list[RenderableType]:
    st = summary["stats"]
    shown: list[RenderableType] = [totals(st)]
    if summary["lineage"]:
        shown.append(lineage(summary["lineage"]))
    shown += [config(summary["config"]), writers(summary["writers"]),
              counts("rows by status", "status", st["status"], st["rows"]),
              counts("rows by finish reason", "finish_reason", summary["finish_reason"], st["rows"]), agents(st),
              reward_by_round(summary["reward_by_agent_round"]), response_length(summary["response_length"]),
              zero_variance(summary["zero_variance_groups"]), weight_versions(summary["weight_version"])]
    return shown


def config(cfg: dict[str, Any]) -> Table:
    t = Table(title="run config", show_header=False)
    t.add_column("key", style="bold")
    t.add_column("value", overflow="fold")
    shown = {k: v for k, v in cfg.items() if k not in (DERIVED_KEY, LINEAGE_KEY)}  # the lineage table's
    for key, value in flatten(shown):
        row(t, key, str(value))
    return t


def writers(by_writer: list[dict[str, Any]]) -> Table:
    t = Table(title="writers")
    for c in ("writer", "shards", "rows", "groups", "tokens", "bytes"):
        t.add_column(c, justify="left" if c == "writer" else "right")
    for w in by_writer:
        row(t, w["writer_id"], *(fmt(w[c]) for c in ("shards", "rows", "groups", "tokens", "bytes")))
    return t


def reward_by_round(rounds: list[dict[str, Any]]) -> Table:
    t = Table(title=f"reward by agent and round (finite rewards; std ddof={REWARD_STD_DDOF})")
    for c in ("agent", "round", "rows", "reward rows", "mean", "std"):
        t.add_column(c, justify="left" if c == "agent" else "right")
    for r in rounds:
        row(t, r["agent"], *(fmt(r[c]) for c in ("round", "rows", "reward_rows", "reward_mean", "reward_std")))
    return t


def response_length(lengths: list[dict[str, Any]]) -> Table:
    t = Table(title="response length (tokens)")
    for c in ("agent", "rows", "mean", "p50", "p90", "max", "truncated"):
        t.add_column(c, justify="left" if c == "agent" else "right")
    for r in lengths:
        spread = (fmt(r[c]) for c in ("p50", "p90", "max"))
        row(t, r["agent"], fmt(r["rows"]), f"{r['mean']:,.1f}", *spread, f"{r['truncated_frac']:.1%}")
    return t


def zero_variance(zv: dict[str, Any]) -> Table:
    t = Table(title="groups: zero reward variance (2+ rows, equal rewards: no learning signal); single-member "
              "(1 row: trained on its reward)")
    for c in ("agent", "groups", "zero variance", "fraction", "single-member"):
        t.add_column(c, justify="left" if c == "agent" else "right")
    for agent, z in zv["by_agent"].items():
        row(t, agent, fmt(z["groups"]), fmt(z["zero_variance"]), f"{z['fraction']:.1%}", fmt(z["single_member"]))
    row(t, "all", fmt(zv["groups"]), fmt(zv["zero_variance"]), f"{zv['fraction']:.1%}" if zv["groups"] else "-",
        fmt(zv["single_member"]))
    return t


def weight_versions(versions: list[dict[str, Any]]) -> Table:
    t = Table(title="rows by weight_version")
    for c in ("weight_version", "rows", "multi-version rows"):
        t.add_column(c, justify="left" if c == "weight_version" else "right")
    for r in versions:
        row(t, str(r["weight_version"]), fmt(r["rows"]), fmt(r["multi_version_rows"]))
    return t


def lineage(steps: list[dict[str, Any]]) -> Table:
    t = Table(title="lineage (newest first; details: the operation's settings)")
    for c in ("step", "operation", "parent", "parent fingerprint", "details"):
        short = c in ("step", "operation", "parent fingerprint")  # kept whole; the others fold
        t.add_column(c, justify="right" if c == "step" else "left", overflow="fold", no_wrap=short, min_width=None)
    for n, e in enumerate(steps, 1):
        details = e.get("details")
        if isinstance(details, dict) and isinstance(details.get("expression"), str):
            shown = details["expression"]
        else:
            shown = json.dumps(details, sort_keys=True)
        row(t, n, e.get("operation"), e.get("parent"), e.get("parent_fingerprint"), shown)
    return t


# -- cells ----------------------------------------------------------------------------------


def row(table: Table, *cells: Any, style: str | None = None) -> None:
    """Add a row of data: strings are shown as they are, never parsed as rich markup."""
    table.add_row(*(c if isinstance(c, Text) else Text(str(c)) for c in cells), style=style)


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.4f}" if abs(v) < 1e6 else f"{v:,.0f}"
    return str(v)


def flatten(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(d, dict) and d:
        return [kv for k, v in d.items() for kv in flatten(v, f"{prefix}{k}.")]
    return [(prefix.rstrip("."), d)] if prefix else []
