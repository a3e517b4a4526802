"""What ``rollshard-train audit`` prints: the summary as tables (rich) or one JSON object, the flag check, and
the worst tokens' context (read back from their rows and decoded with the model's tokenizer).

The numbers are :func:`rollshard.store.inspection.audit.summarize`'s and :func:`~rollshard.store.inspection.audit.worst_tokens`'s;
nothing here computes a statistic, so ``rollshard-store report`` on the same report shows the same figures.
Model output (token text, context) is shown with control characters escaped, never sent to the terminal raw.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from rollshard.store.common import show_number
from rollshard.store.inspection.audit import GROUPS, RATIO_BAND

GROUP_TITLES = {
    "by_agent": "agent",
    "by_weight_version": "weight version",
    "by_position": "response position",
    "by_temperature": "temperature",
    "by_source": "source",
}
assert set(GROUP_TITLES) == set(GROUPS), "a summary group without a title"
TABLE_WIDTH = 160  # columns when stdout is not a terminal (a file, a pipe): every column of the tables fits


def exceeded(summary: dict, *, max_abs_diff: float, max_mean_abs_diff: float | None) -> list[str]:
    """The thresholds the summary exceeds, each as ``what value > --flag limit`` (empty: within them)."""
    o = summary["overall"]
    out = []
    if o["max"] is not None and not o["max"] <= max_abs_diff:  # NaN is flagged too
        out.append(f"max |logp - rollout_logp| {o['max']:.4g} > --max-abs-diff {max_abs_diff:g} "
                   f"(mean {o['mean']:.4g}, p99 {o['p99']:.4g}, {o['ratio_outside']:.1%} of {o['tokens']:,} tokens "
                   f"with a ratio outside [{RATIO_BAND[0]}, {RATIO_BAND[1]}], k3 {o['k3']:.4g})")
    if max_mean_abs_diff is not None and o["mean"] is not None and not o["mean"] <= max_mean_abs_diff:
        out.append(f"mean |logp - rollout_logp| {o['mean']:.4g} > --max-mean-abs-diff {max_mean_abs_diff:g}")
    return out


def print_json(result, file=None) -> None:
    """One JSON object: what was audited, the report's path, the summary and the worst tokens."""
    obj: dict[str, Any] = {**result.info, "report": result.report, **result.summary, "worst": result.worst,
                           "corrections": result.corrections, "routing": result.routing}
    print(json.dumps(_nonfinite_as_null(obj), allow_nan=False, default=str), file=file or sys.stdout)


def _nonfinite_as_null(x: Any) -> Any:
    """JSON has no NaN or infinity: None in their place (a non-finite logprob shows as null)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _nonfinite_as_null(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_nonfinite_as_null(v) for v in x]
    return x


def print_tables(result, file=None) -> None:
    """The header line, the table of |r| by group, and the worst tokens with context."""
    from rich.console import Console

    file = file or sys.stdout
    console = Console(file=file, width=None if file.isatty() else TABLE_WIDTH, highlight=False)
    i, o = result.info, result.summary["overall"]
    where = f"report {result.report}" if result.report else "no report written (--out AUDIT.parquet writes one)"
    console.print(
        f"audit of {i['data']} against {i['model']} ({i['device']}, {i['dtype']}): {o['tokens']:,} trained tokens "
        f"of {o['sequences']:,} rows in {i['seconds']:.1f} s; {where}", soft_wrap=True,
    )
    console.print(_stats_table(result.summary))
    if result.routing:
        console.print(_routing_table(result.routing))
    if result.corrections:
        console.print(_corrections_table(result.corrections))
    if result.worst:
        console.print(_worst_table(result.worst))


def _stats_table(summary: dict):
    from rich.table import Table

    lo, hi = RATIO_BAND
    t = Table(title="|logp - rollout_logp| (nats) by group", title_justify="left")
    for name in ("group", "value", "tokens", "rows", "mean", "max", "p50", "p90", "p99", f"ratio ∉ [{lo}, {hi}]", "k3"):
        t.add_column(name, justify="left" if name in ("group", "value") else "right")

    def add(group: str, value: str, s: dict, *, end: bool = False) -> None:
        t.add_row(group, _safe(value), f"{s['tokens']:,}", f"{s['sequences']:,}",
                  *(show_number(s[k], ".3g") for k in ("mean", "max", "p50", "p90", "p99")),
                  f"{s['ratio_outside']:.2%}", show_number(s["k3"], ".3g"), end_section=end)

    add("overall", "", summary["overall"], end=True)
    for key, title in GROUP_TITLES.items():
        entries = summary[key]
        if key == "by_source" and len(entries) < 2:
            continue  # one dataset: the same row as overall
        for n, (value, s) in enumerate(entries.items()):
            add(title if n == 0 else "", value, s, end=n == len(entries) - 1)
    return t


def _routing_table(r: dict):
    """MoE routing replay (R3): the agreement, and the mismatch of the rows with stored routing both ways."""
    from rich.table import Table

    agreement = "-" if r["agreement"] is None else f"{r['agreement']:.2%}"
    t = Table(title=f"MoE routing ({r['tokens']:,} tokens): own top-k = engine's on {agreement} of (position, layer)",
              title_justify="left")
    t.add_column("forward")
    t.add_column("mean |logp - rollout_logp|", justify="right")
    t.add_column("max", justify="right")
    for key, name in (("no_replay", "own routing"), ("replay", "engine's routing replayed")):
        t.add_row(name, show_number(r[f"{key}_mean"], ".3g"), show_number(r[f"{key}_max"], ".3g"))
    return t


def _corrections_table(corrections: list[dict]):
    from rich.table import Table

    t = Table(title="off-policy corrections: what each would mask, clip or damp if this policy trained on these rows "
              "now (rollshard.train.corrections)", title_justify="left")
    for name in ("correction", "parameters", "tokens", "share", "rows", "share of rows"):
        t.add_column(name, justify="left" if name in ("correction", "parameters") else "right")
    for c in corrections:
        t.add_row(c["correction"], c["parameters"], f"{c['tokens']:,}", f"{c['token_share']:.2%}", f"{c['rows']:,}",
                  f"{c['row_share']:.2%}")
    return t


def _worst_table(worst: list[dict]):
    from rich.table import Table
    from rich.text import Text

    t = Table(title=f"the {len(worst)} worst tokens", title_justify="left")
    numbers = ("#", "pos", "T", "rollout", "trainer", "diff", "ratio")
    for name in ("#", "sample", "agent", "pos", "T", "token", "rollout", "trainer", "diff", "ratio", "context"):
        t.add_column(name, justify="right" if name in numbers else "left", overflow="fold")
    for n, w in enumerate(worst, 1):
        token = f"{w['token']}" if w["text"] is None else f"{_safe(w['text'])!r} ({w['token']})"
        context = Text()
        if w["before"] is not None:
            context.append("…" + _safe(w["before"]))
            context.append(f"[{_safe(w['text'])}]", style="bold red")
            context.append(_safe(w["after"]) + "…")
        t.add_row(
            str(n), _safe(w["sample_id"]), _safe(w["agent"]), str(w["position"]), f"{w['temperature']:g}", token,
            f"{w['rollout_logprob']:.4f}", f"{w['trainer_logprob']:.4f}", f"{w['diff']:+.3g}", f"{w['ratio']:.3g}",
            context,
        )
    return t


def _safe(text: str) -> str:
    """Control characters as escapes (a newline as \\n): model output never moves the terminal's cursor."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def worst_with_context(worst, datasets: dict, model: str) -> list[dict]:
    """The worst tokens (a :func:`~rollshard.store.inspection.audit.worst_tokens` frame) with their text and decoded context,
    read back from their rows in ``datasets`` (by source name) and decoded by ``model``'s tokenizer."""
    import pyarrow.compute as pc

    from rollshard.store.inspection.audit import token_contexts
    from rollshard.store.models.tokenizer import TokenizerError, load_tokenizer

    if worst.is_empty():
        return []
    try:
        tokenizer = load_tokenizer(model)
    except TokenizerError:
        tokenizer = None  # a model folder without tokenizer files: the ids are shown instead of text
    out: dict[int, dict] = {}
    cols = ["sample_id", "prompt_tokens", "response_tokens"]
    indexed = worst.with_row_index("rank")
    for name in indexed["source"].unique().to_list():  # sample ids are unique within a source, not across
        part = indexed.filter(indexed["source"] == name)
        wanted = pc.field("sample_id").isin(part["sample_id"].to_list())
        rows = datasets[name].to_arrow().to_table(columns=cols, filter=wanted)
        out.update(zip(part["rank"].to_list(), token_contexts(rows, part.drop("rank"), tokenizer)))
    return [out[k] for k in sorted(out)]
