"""One trajectory token by token, and one prompt's multi-agent episode.

The logprob colour scale adapts to the row: red at the :data:`LOW_QUANTILE` quantile of its trained
tokens' logprobs, green at the :data:`HIGH_QUANTILE` one (capped at 0), so a single extreme token does not
wash the rest out, and a row of uniformly unlikely tokens (a random model: all near -7) still shows which
are likelier. The span is at least :data:`MIN_SPAN` nats wide. Tokens under ``loss_mask == 0`` (tool or
environment output, not trained on) are grey and dashed.
"""

from __future__ import annotations

import html
from typing import Any, Sequence

import numpy as np

from rollshard.store.inspection.views.figures import agent_colors, legend_outside, mpl, new_figure

LOW_QUANTILE, HIGH_QUANTILE = 0.02, 0.98  # the scale's red and green ends; rarer or likelier tokens saturate
MIN_SPAN = 0.5  # nats: a row of near-equal logprobs is not stretched into false contrast
CMAP = "RdYlGn"


def logprob_scale(logprobs: Sequence[float], mask: Sequence[int]) -> tuple[float, float]:
    """``(low, high)``: the colour scale's red and green ends for these tokens (module docstring)."""
    lp = np.asarray(logprobs, float)[np.asarray(mask, bool)] if len(logprobs) else np.zeros(0)
    lp = lp[np.isfinite(lp)]
    if not len(lp):
        return (-MIN_SPAN, 0.0)
    low, high = float(np.quantile(lp, LOW_QUANTILE)), min(float(np.quantile(lp, HIGH_QUANTILE)), 0.0)
    if high - low < MIN_SPAN:
        mid = (high + low) / 2
        low, high = mid - MIN_SPAN / 2, min(mid + MIN_SPAN / 2, 0.0)
        low = min(low, high - MIN_SPAN)
    return (low, high)


def _norm(scale: tuple[float, float]):
    from matplotlib.colors import Normalize

    return Normalize(vmin=scale[0], vmax=scale[1], clip=True)


def token_colors(logprobs: Sequence[float], scale: tuple[float, float]) -> np.ndarray:
    """RGBA per token on ``scale`` (:func:`logprob_scale`: red at its low end, green at its high end)."""
    return mpl().colormaps[CMAP](_norm(scale)(np.asarray(logprobs, float)))


def token_html(texts: Sequence[str], logprobs: Sequence[float], mask: Sequence[int], *,
               trainer: Sequence[float] | None = None, scale: tuple[float, float] | None = None) -> str:
    """The response as coloured token spans, with a scale; hovering a token shows its logprob(s)."""
    scale = logprob_scale(logprobs, mask) if scale is None else scale
    colors = token_colors(logprobs, scale)
    spans = []
    for i, (text, lp, m) in enumerate(zip(texts, logprobs, mask)):
        label = html.escape(text).replace("\n", "&#8629;<br>")
        if m == 0:
            style = "background:#e6e6e6;color:#555;font-style:italic;border:1px dashed #888"
            tip = f"pos {i}: loss_mask 0: tool/environment token, not trained"
        else:
            r, g, b, _ = colors[i]
            style = f"background:rgba({r * 255:.0f},{g * 255:.0f},{b * 255:.0f},0.55)"  # translucent: text readable
            tip = f"pos {i}: rollout logprob {lp:.3f} (p={np.exp(lp):.3f})"
            if trainer is not None:
                tip += f", trainer {trainer[i]:.3f} (diff {trainer[i] - lp:+.4f})"
        spans.append(f'<span title="{html.escape(tip)}" style="{style};padding:1px 2px;margin:1px;'
                     f'border-radius:3px">{label}</span>')
    return (f"<div class='scale'>{scale_html(scale)}</div>"
            f"<div class='tokens' style='line-height:2;font-family:monospace'>{''.join(spans)}</div>")


def scale_html(scale: tuple[float, float]) -> str:
    """The colour scale as a CSS gradient, labelled with its ends."""
    cmap = mpl().colormaps[CMAP]
    stops = ", ".join(f"rgba({r * 255:.0f},{g * 255:.0f},{b * 255:.0f},0.55) {q * 100:.0f}%"
                      for q in np.linspace(0, 1, 6) for r, g, b, _ in [cmap(q)])
    return (f"<span style='font-size:90%'>rollout logprob (this row's scale): {scale[0]:.2f} or lower "
            f"<span style='display:inline-block;width:12em;height:0.9em;vertical-align:middle;"
            f"background:linear-gradient(to right, {stops})'></span> {scale[1]:.2f} or higher &nbsp; "
            f"<span style='background:#e6e6e6;border:1px dashed #888;font-style:italic;padding:0 4px'>"
            f"loss_mask 0: tool/environment token</span> &nbsp; hover a token for its logprob</span>")


def token_figure(row: dict[str, Any], *, scale: tuple[float, float] | None = None):
    """Rollout logprob per response position, y-limits fitted to the row: markers coloured on the row's own
    scale (colour bar at the right), masked positions shaded grey, the legend outside the axes."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    lp, mask = np.asarray(row["rollout_logprobs"], float), np.asarray(row["loss_mask"])
    scale = logprob_scale(lp, mask) if scale is None else scale
    fig = new_figure(13, 3.8)
    ax = fig.subplots()
    pos = np.arange(len(lp))
    on = mask == 1
    ax.plot(pos[on], lp[on], color="0.6", linewidth=0.8, zorder=1)
    ax.scatter(pos[on], lp[on], c=token_colors(lp[on], scale), s=28, edgecolors="0.3", linewidths=0.4, zorder=2)
    for p in pos[~on]:
        ax.axvspan(p - 0.5, p + 0.5, color="0.88", zorder=0)
    if on.any():
        lo, hi = float(lp[on].min()), float(lp[on].max())
        pad = max((hi - lo) * 0.08, 0.05)
        ax.set_ylim(lo - pad, min(hi + pad, 0.0 + pad))
    reward = "-" if row["reward"] is None else f"{row['reward']:.4g}"
    ax.set(title=f"Rollout logprob per response token: {row['sample_id']} ({row['agent']}, reward {reward})",
           xlabel="response token position", ylabel="rollout logprob", xlim=(-0.5, max(len(lp), 1) - 0.5))
    bar = fig.colorbar(ScalarMappable(norm=_norm(scale), cmap=CMAP), ax=ax, pad=0.01, fraction=0.03)
    bar.set_label("colour scale (this row)", fontsize=8)
    handles = [Line2D([], [], marker="o", linestyle="", markerfacecolor=mpl().colormaps[CMAP](0.8),
                      markeredgecolor="0.3", label="trained token\n(colour: logprob)"),
               Patch(color="0.88", label="loss_mask 0\n(tool/environment)")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.09, 1.0), fontsize=8, borderaxespad=0.0)
    return fig


def audit_figure(tokens, sample_id: str):
    """Rollout vs trainer logprob per position of one trajectory (top) and their absolute difference (bottom).

    ``tokens``: the audit rows of the sample (``position``, ``rollout_logprob``, ``trainer_logprob``)."""
    d = tokens.sort("position")
    pos = d["position"].to_numpy()
    ro, tr = d["rollout_logprob"].to_numpy().astype(float), d["trainer_logprob"].to_numpy().astype(float)
    diff = np.abs(tr - ro)
    fig = new_figure(13, 5.2)
    ax1, ax2 = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    ax1.plot(pos, ro, marker="o", markersize=3, linewidth=1, label="rollout (engine)")
    ax1.plot(pos, tr, marker="x", markersize=4, linewidth=1, linestyle="--", label="trainer (recomputed)")
    ax1.set(title=f"Logprob per trained token: {sample_id}", ylabel="logprob")
    legend_outside(ax1)
    worst = int(np.argmax(diff)) if len(diff) else None
    ax2.bar(pos, diff, width=1.0, color="tab:red")
    if worst is not None:
        ax2.annotate(f"max {diff[worst]:.3g} at {pos[worst]}", (pos[worst], diff[worst]), textcoords="offset points",
                     xytext=(6, -2), fontsize=8, va="top")
        ax2.set_ylim(0, diff[worst] * 1.25 if diff[worst] > 0 else 1e-6)
    ax2.set(xlabel="response token position", ylabel="|trainer - rollout|")
    return fig


def episode_html(rows: list[dict[str, Any]]) -> str:
    """What each role of one prompt saw (its prompt, once per distinct prompt) and answered, the selector's
    ``Judgment: IDX`` and the rewrite it picked."""
    picked = {r["meta"].get("selected") for r in rows if r["agent"] == "selector"} - {None}
    shown_as: dict[str, list[str]] = {}  # sample id -> "Solution i for the <role>" (the numbering each role saw)
    for r in rows:
        for i, sid in enumerate(r["meta"].get("candidates") or [], 1):
            label = f"Solution {i} for the {r['agent']}"
            if label not in shown_as.setdefault(str(sid), []):
                shown_as[str(sid)].append(label)
    parts, seen_prompt = [], {}
    roles = list(dict.fromkeys((r["round"], r["agent"]) for r in rows))
    for rnd, agent in roles:
        calls = [r for r in rows if (r["round"], r["agent"]) == (rnd, agent)]
        parts.append(f"<h4>round {rnd}: {html.escape(agent)} ({len(calls)} call{'s' * (len(calls) != 1)})</h4>")
        for prompt in dict.fromkeys(c["prompt_text"] for c in calls):
            shared = sum(c["prompt_text"] == prompt for c in calls)
            key = seen_prompt.setdefault(prompt, len(seen_prompt) + 1)
            text = "(no prompt_text stored)" if prompt is None else html.escape(prompt)
            parts.append(f"<details open><summary>prompt {key} ({shared} call{'s' * (shared != 1)}, "
                         f"{0 if prompt is None else len(prompt):,} characters)</summary>"
                         f"<pre class='prompt'>{text}</pre></details>")
        body = []
        for c in calls:
            m = c["meta"]
            answer = m.get("answer") if "answer" in m else c["response_text"]
            note = ""
            if c["agent"] == "selector" or "judgment" in m:
                if m.get("judgment"):
                    note = (f"<b>Judgment: {m['judgment']}</b> &rarr; picked "
                            f"<code>{html.escape(str(m.get('selected')))}</code>")
                else:
                    status = {"out_of_range": "out of range", "missing": "none in the answer"}.get(
                        m.get("judgment_status"), "malformed")
                    note = f"<b>no valid Judgment</b> ({status}: no rewrite picked)"
                cands = m.get("candidates") or []
                if cands:
                    note += "<br>candidates: " + ", ".join(
                        f"{i}: <code>{html.escape(str(s))}</code>" for i, s in enumerate(cands, 1))
            else:
                note = "<br>".join(html.escape(x) for x in shown_as.get(c["sample_id"], []))
                if c["sample_id"] in picked:
                    note = "<b>&#10003; picked by the selector</b><br>" + note
            reward = "-" if c["reward"] is None else f"{c['reward']:.4g}"
            cls = " class='picked'" if c["sample_id"] in picked else ""
            body.append(
                f"<tr{cls}><td><code>{html.escape(c['sample_id'])}</code></td><td>{reward}</td>"
                f"<td>{html.escape(str(c['status']))}</td><td>{c['length']}</td>"
                f"<td><pre class='answer'>{html.escape('' if answer is None else str(answer))}</pre></td>"
                f"<td>{note}</td></tr>")
        parts.append("<table class='episode'><tr><th>sample_id</th><th>reward</th><th>status</th><th>tokens</th>"
                     "<th>answer</th><th>pick</th></tr>" + "".join(body) + "</table>")
    return "<div class='episode'>" + "".join(parts) + "</div>"


def episode_figure(rows: list[dict[str, Any]], agents: Sequence[str]):
    """Reward of each agent call of one prompt, in round order; the rewrite the selector picked outlined."""
    from matplotlib.patches import Patch

    colors = agent_colors(agents)
    picked = {r["meta"].get("selected") for r in rows if r["agent"] == "selector"} - {None}
    fig = new_figure(13, 4)
    ax = fig.subplots()
    x, ticks, labels, last_round = 0.0, [], [], None
    top = 1.0
    for r in rows:
        if last_round is not None and r["round"] != last_round:
            x += 0.8  # gap between rounds
        last_round = r["round"]
        reward = r["reward"] if r["reward"] is not None and np.isfinite(r["reward"]) else 0.0
        top = max(top, reward)
        done = r["status"] == "completed"
        ax.bar(x, reward, color=colors.get(r["agent"], "grey"), hatch=None if done else "//",
               edgecolor="black" if (not done or r["sample_id"] in picked) else None,
               linewidth=2.5 if r["sample_id"] in picked else 0.8)
        note = "picked" if r["sample_id"] in picked else ""
        if "judgment" in r["meta"]:
            note = f"Judgment: {r['meta']['judgment']}" if r["meta"].get("judgment") else "no Judgment"
        ax.annotate(f"{r['length']} tok" + (f"\n{note}" if note else ""), (x, reward), ha="center", va="bottom",
                    fontsize=7)
        ticks.append(x)
        labels.append(call_label(r))
        x += 1
    ax.set_xticks(ticks, labels, rotation=60, ha="right", fontsize=8)
    ax.set(title=f"Prompt {rows[0]['prompt_id'] if rows else ''}: reward of each agent "
           "call, in round order", xlabel="agent call (sample id without the prompt id)", ylabel="reward", ylim=(0, top * 1.3))
    legend_outside(ax, title="agent", handles=[Patch(color=colors[a], label=a) for a in agents
                                               if any(r["agent"] == a for r in rows)]
                   + [Patch(facecolor="white", edgecolor="black", hatch="//", label="not completed"),
                      Patch(facecolor="white", edgecolor="black", linewidth=2.5, label="picked by the selector")])
    return fig


def call_label(row: dict[str, Any]) -> str:
    """A call's sample id without its prompt id (``toy-002/solver/0/10`` -> ``solver/0/10``)."""
    sid, pid = str(row["sample_id"]), str(row.get("prompt_id") or "")
    return sid[len(pid):].lstrip("/-_:") or sid if pid and sid.startswith(pid) else sid
