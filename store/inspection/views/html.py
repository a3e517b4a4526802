"""Tables and figures as self-contained HTML fragments (figures inline as base64 PNG; no script, no network)."""

from __future__ import annotations

import base64
import html
import io
import math
from typing import Any

import polars as pl

PNG_DPI = 100


def cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
            return f"{v:.3e}"
        return f"{v:,.4f}"
    return str(v)


def table_html(df: pl.DataFrame, *, cls: str = "", caption: str | None = None, max_rows: int = 200) -> str:
    """``df`` as an HTML table: numbers right-aligned, floats to 4 decimals (large or tiny ones in e-notation)."""
    numeric = {c for c, t in df.schema.items() if t.is_numeric()}
    head = "".join(f"<th>{html.escape(c)}</th>" for c in df.columns)
    body = []
    for row in df.head(max_rows).iter_rows():
        tds = "".join(
            f"<td class='num'>{html.escape(cell(v))}</td>" if c in numeric else f"<td>{html.escape(cell(v))}</td>"
            for c, v in zip(df.columns, row)
        )
        body.append(f"<tr>{tds}</tr>")
    more = f"<caption class='more'>first {max_rows} of {df.height} rows</caption>" if df.height > max_rows else ""
    cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    return f"<table class='data {cls}'>{cap}{more}<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def figure_png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=PNG_DPI)
    return buf.getvalue()


def figure_html(fig, alt: str) -> str:
    """The figure as an inline PNG ``<img>`` (base64 data URI)."""
    data = base64.b64encode(figure_png(fig)).decode("ascii")
    return f"<figure><img class='figure' alt='{html.escape(alt)}' src='data:image/png;base64,{data}'></figure>"
