"""The rich tables of ``inspect --sample``: the row's fields, then its response tokens (logprobs colored by
probability, mask-0 tokens dimmed, with an audit the trainer's logprob and the difference)."""

from __future__ import annotations

from rich.console import RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from rollshard.store.commands.sample import SampleView, audit_line
from rollshard.store.commands.tables import row

DIFF_WARN = 0.1  # |trainer - rollout| above it: a ratio outside about [0.9, 1.1], where a PPO clip of 0.1 acts
TEXT_SHOWN = 400  # characters of prompt_text / response_text shown in the fields table
_CONTROL = {c: f"\\x{c:02x}" for c in range(32) if chr(c) not in "\n\t"} | {127: "\\x7f"}


def sample(view: SampleView, *, max_tokens: int) -> list[RenderableType]:
    """The fields table, the tokens table (the first ``max_tokens``; 0: all) and a line for the tokens left."""
    shown: list[RenderableType] = [fields(view)]
    limit = max_tokens if max_tokens > 0 else len(view.tokens)
    shown.append(tokens(view, limit))
    if limit < len(view.tokens):
        shown.append(Text(f"... {len(view.tokens) - limit:,} more tokens (--max-tokens 0 shows all)"))
    return shown


def fields(view: SampleView) -> Table:
    head = Table(title=escape(f"sample {view.scalars['sample_id']}"), show_header=False)
    head.add_column("field", style="bold")
    head.add_column("value", overflow="fold")
    for k, v in view.scalars.items():
        if k == "prompt_tokens":
            v = f"{len(v):,} tokens"
        elif k in ("prompt_text", "response_text") and v and len(v) > TEXT_SHOWN:
            v = v[:TEXT_SHOWN] + f"... ({len(v):,} characters)"
        row(head, k, "-" if v is None else printable(str(v)))
    on = [t["logprob"] for t in view.tokens if t["mask"] == 1]
    row(head, "response", f"{len(view.tokens):,} tokens, {len(on):,} under loss_mask 1")
    if on:
        row(head, "mean logprob (mask 1)", f"{sum(on) / len(on):.4f}")
    sizes = [t["support_size"] for t in view.tokens if t["mask"] == 1 and "support_size" in t]
    if not view.has_support:
        row(head, "sampling support", "none (not truncated, or not recorded)")
    elif sizes:
        row(head, "sampling support", f"{min(sizes):,}-{max(sizes):,} ids per token (mask 1)")
    if view.audited:
        a = audit_line(view.tokens)
        shown = (f"{a['tokens']:,} tokens audited; |trainer - rollout| mean {a['abs_diff_mean']:.4g}, max "
                 f"{a['abs_diff_max']:.4g} at position {a['worst_position']}") if a["tokens"] else "not in the report"
        row(head, "audit", shown)
    return head


def tokens(view: SampleView, limit: int) -> Table:
    source = f"decoded with {view.decoded_with}" if view.decoded_with else "ids; no tokenizer"
    tt = Table(title=escape(f"response tokens ({source})"))
    columns = ("pos", "id", "text", "logprob", "mask") + (("sampling logprob", "support") if view.has_support else ())
    columns += ("trainer logprob", "diff") if view.audited else ()
    for c in columns:
        tt.add_column(c, justify="left" if c == "text" else "right")
    for t in view.tokens[:limit]:
        style = "dim" if t["mask"] == 0 else None
        text = repr(t["text"])[1:-1] if t["text"] is not None else ""
        extra = (f"{t['sampling_logprob']:.4f}", t["support_size"]) if view.has_support else ()
        if view.audited:
            tl = t["trainer_logprob"]
            extra += ("-", "-") if tl is None else (f"{tl:.4f}", diff_cell(t["diff"]))
        row(tt, t["pos"], t["id"], text, logprob_cell(t["logprob"], t["mask"]), t["mask"], *extra, style=style)
    return tt


def printable(text: str) -> str:
    """``text`` with control characters (model output can hold terminal escapes) shown as ``\\xNN``."""
    return text.translate(_CONTROL)


def logprob_cell(lp: float, mask: int) -> Text:
    if mask == 0:
        return Text(f"{lp:.4f}")
    color = "green" if lp > -0.5 else "yellow" if lp > -2.5 else "red"  # p > 0.61, p > 0.08, rarer
    return Text(f"{lp:.4f}", style=color)


def diff_cell(diff: float) -> Text:
    return Text(f"{diff:+.4f}", style="red" if abs(diff) > DIFF_WARN else None)
