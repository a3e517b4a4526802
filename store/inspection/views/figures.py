"""Matplotlib figures of a dataset's views (:mod:`.data` computes their numbers).

Each function returns a :class:`matplotlib.figure.Figure` built without pyplot. Legends sit outside
the axes, so they never cover data. matplotlib is imported when a figure is first drawn: without it,
:class:`MissingPlotting` says which extra to install.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import polars as pl


class MissingPlotting(ImportError):
    """matplotlib is not installed."""


INSTALL_HINT = "pip install 'rollshard[notebooks]'"
STYLE = {"axes.grid": True, "grid.alpha": 0.3, "axes.titleweight": "bold", "axes.titlesize": 11,
         "axes.spines.top": False, "axes.spines.right": False}


def mpl():
    """The matplotlib module, or a one-line error naming the extra to install."""
    try:
        import matplotlib
    except ImportError as e:
        raise MissingPlotting(f"figures need matplotlib: {INSTALL_HINT}") from e
    matplotlib.rcParams.update(STYLE)
    return matplotlib


def new_figure(width: float, height: float):
    mpl()
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def agent_colors(agents: Sequence[str]) -> dict[str, Any]:
    cmap = mpl().colormaps["tab10"]
    return {a: cmap(i % 10) for i, a in enumerate(agents)}


def legend_outside(ax, **kwargs) -> None:
    """The legend to the right of the axes, outside the data."""
    if ax.get_legend_handles_labels()[0] or kwargs.get("handles"):
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=9, **kwargs)


def reward_figure(by_round: pl.DataFrame, rewards: pl.DataFrame, agents: Sequence[str]):
    """Mean reward by agent and round (error bar: std), and the reward distribution by agent."""
    colors = agent_colors(agents)
    fig = new_figure(13, 4.2)
    ax1, ax2 = fig.subplots(1, 2)
    ax1.bar([f"{a}\nround {r}" for a, r in zip(by_round["agent"], by_round["round"])], by_round["mean"].fill_null(0.0),
            yerr=by_round["std"].fill_null(0.0), capsize=4, color=[colors[a] for a in by_round["agent"]])
    ax1.set(title="Mean reward by agent and round (error bar: std)", xlabel="agent, round", ylabel="mean reward")
    values = rewards["reward"].unique().sort()
    if 0 < values.len() <= 10:  # discrete rewards (e.g. 0/1): rows per value, one bar per agent
        width = 0.8 / len(agents)
        for i, agent in enumerate(agents):
            got = rewards.filter(pl.col("agent") == agent)["reward"]
            n = [int((got == v).sum()) for v in values]
            ax2.bar(np.arange(values.len()) + (i - (len(agents) - 1) / 2) * width, n, width, color=colors[agent],
                    label=agent)
        ax2.set_xticks(range(values.len()), [f"{v:g}" for v in values])
    elif values.len():
        bins = np.linspace(values.min(), values.max(), 21)
        for agent in agents:
            ax2.hist(rewards.filter(pl.col("agent") == agent)["reward"].to_numpy(), bins=bins, histtype="step",
                     linewidth=2, color=colors[agent], label=agent)
    ax2.set(title="Reward distribution by agent", xlabel="reward", ylabel="rows")
    legend_outside(ax2, title="agent")
    return fig


def rounds_figure(across: pl.DataFrame, agents: Sequence[str]):
    """Mean reward per agent in each round (one dataset a round; band: +-1 std)."""
    colors = agent_colors(agents)
    fig = new_figure(10, 4)
    ax = fig.subplots()
    names = across.select("round", "dataset").unique().sort("round")
    drawn = [a for a in agents if across.filter(pl.col("agent") == a).height]
    for i, agent in enumerate(drawn):
        d = across.filter(pl.col("agent") == agent).sort("round")
        x, y, s = d["round"].to_numpy(), d["mean"].to_numpy(), d["std"].fill_null(0.0).to_numpy()
        ax.errorbar(x, y, yerr=s, marker="o", capsize=4, color=colors[agent], label=agent)
        for xi, yi in zip(x, y):  # one line of labels per agent, so that agents with close rewards do not overlap
            ax.annotate(f"{yi:.3f}", (xi, yi), textcoords="offset points", xytext=(6, 4 - 11 * i), fontsize=8,
                        color=colors[agent])
    ax.set_xticks(names["round"].to_list(), [f"round {r}\n{_short(n)}" for r, n in names.iter_rows()])
    ax.set_xlim(-0.5, max(names["round"].max() or 0, 1) + 0.5)
    ax.set(title="Mean reward by agent across rounds (error bar: std)", xlabel="round (dataset)",
           ylabel="mean reward")
    legend_outside(ax, title="agent")
    return fig


def held_out_figure(table: pl.DataFrame):
    """Held-out pass@1 of each round's policy (round R: the last checkpoint) and the training reward of its rows."""
    fig = new_figure(8, 3.6)
    ax = fig.subplots()
    k = table["round"].to_list()
    policies = [(r, v) for r, v in zip(k, table["held-out pass@1 (its policy)"].to_list()) if v is not None]
    last = table.tail(1)["held-out pass@1 (its checkpoint)"].item() if table.height else None
    if last is not None:
        policies.append((k[-1] + 1, last))
    if policies:
        x, y = zip(*policies)
        ax.plot(x, y, marker="o", label="held-out pass@1 of the policy")
        for xi, yi in policies:
            ax.annotate(f"{yi:.1%}", (xi, yi), textcoords="offset points", xytext=(6, 4), fontsize=8)
    rewards = [(r, v) for r, v in zip(k, table["train reward (its rows)"].to_list()) if v is not None]
    if rewards:
        ax.plot(*zip(*rewards), marker="s", linestyle="--", label="training reward of its rows")
    ax.set(title="Held-out accuracy and training reward by policy", xlabel="policy of round (last: final checkpoint)",
           ylabel="accuracy / mean reward", ylim=(0, 1.05))
    ax.set_xticks(list(range(0, (k[-1] + 2) if k else 1)))
    legend_outside(ax, title="")
    return fig


def async_figure(timeline: list[dict[str, Any]], rewards: list[float | None]):
    """An asynchronous run over time: rows committed and optimizer steps against the wall seconds (left), and the
    mean reward of the rows each step trained on (right)."""
    fig = new_figure(10, 3.6)
    left, right = fig.subplots(1, 2)
    points = [t for t in timeline if t.get("rows") is not None]
    if points:
        seconds = [t["seconds"] for t in points]
        left.plot(seconds, [t["rows"] for t in points], label="rows committed (generator)")
        steps = left.twinx()
        steps.plot(seconds, [t["steps"] for t in points], color="C1", label="optimizer steps (trainer)")
        steps.set_ylabel("steps")
        lines = left.get_lines() + steps.get_lines()
        left.legend(lines, [line.get_label() for line in lines], loc="upper left", fontsize=8)
    left.set(title="Generation and training over time", xlabel="seconds since the engine and trainer started",
             ylabel="rows")
    known = [(i + 1, r) for i, r in enumerate(rewards) if r is not None]
    if known:
        right.plot(*zip(*known), marker=".")
    right.set(title="Reward of the rows each step trained on", xlabel="step", ylabel="mean reward")
    return fig


def _short(path: str, n: int = 28) -> str:
    tail = str(path).rstrip("/").rsplit("/", 2)
    text = "/".join(tail[-2:])
    return text if len(text) <= n else "..." + text[-n:]


def zero_variance_figure(by_agent: pl.DataFrame, agents: Sequence[str]):
    colors = agent_colors(agents)
    fig = new_figure(6.5, 3.6)
    ax = fig.subplots()
    bars = ax.bar(by_agent["agent"], by_agent["fraction"], color=[colors[a] for a in by_agent["agent"]])
    ax.bar_label(bars, labels=[f"{z} / {g}" for z, g in zip(by_agent["zero_variance"], by_agent["groups"])])
    ax.set(title="Fraction of groups with zero reward variance", xlabel="agent", ylabel="fraction of groups",
           ylim=(0, 1.15))
    if not by_agent.height or not by_agent["zero_variance"].sum():  # say it rather than draw nothing
        ax.text(0.5, 0.6, "no group of two or more rows has zero reward variance" if by_agent.height
                else "no group of two or more rows", transform=ax.transAxes, ha="center", va="center", fontsize=10)
    return fig


def length_figure(lens: pl.DataFrame, agents: Sequence[str]):
    colors = agent_colors(agents)
    fig = new_figure(13, 4.2)
    ax1, ax2 = fig.subplots(1, 2)
    bins = np.linspace(0, max(lens["length"].max() or 1, 1), 31)
    for agent in agents:
        ax1.hist(lens.filter(pl.col("agent") == agent)["length"].to_numpy(), bins=bins, histtype="step", linewidth=2,
                 color=colors[agent], label=agent)
    ax1.set(title="Response length by agent", xlabel="response tokens", ylabel="rows")
    legend_outside(ax1, title="agent")
    reason = lens["finish_reason"].fill_null("none")
    reasons = reason.unique().sort().to_list()
    set2 = mpl().colormaps["Set2"]
    ax2.hist([lens.filter(reason == r)["length"].to_numpy() for r in reasons], bins=bins, stacked=True,
             label=[f"{r} ({(reason == r).mean():.1%})" for r in reasons], color=[set2(i) for i in range(len(reasons))])
    ax2.set(title="Response length by finish reason (stacked)", xlabel="response tokens", ylabel="rows")
    legend_outside(ax2, title="finish reason")
    return fig


def logprob_figure(tokens: pl.DataFrame, row_means: pl.DataFrame, agents: Sequence[str]):
    colors = agent_colors(agents)
    fig = new_figure(13, 4.2)
    ax1, ax2 = fig.subplots(1, 2)
    lo = min(tokens["rollout_logprobs"].min() or -1.0, -1.0)
    bins = np.linspace(lo, 0, 41)
    for agent in agents:
        v = tokens.filter(pl.col("agent") == agent)["rollout_logprobs"].to_numpy()
        if len(v):
            ax1.hist(v, bins=bins, histtype="step", linewidth=2, color=colors[agent], label=agent, density=True)
    ax1.set_yscale("log")
    ax1.set(title="Per-token rollout logprob (trained tokens)", xlabel="logprob", ylabel="density (log scale)")
    legend_outside(ax1, title="agent")
    data = [row_means.filter(pl.col("agent") == a)["mean_logprob"].to_numpy() for a in agents]
    boxes = ax2.boxplot(data, patch_artist=True, medianprops={"color": "black"})
    for box, agent in zip(boxes["boxes"], agents):
        box.set(facecolor=colors[agent], alpha=0.7)
    ax2.set_xticks(range(1, len(agents) + 1), agents)
    ax2.set(title="Mean logprob per row, by agent", xlabel="agent", ylabel="mean logprob of trained tokens")
    return fig


def staleness_figure(counts: pl.DataFrame, agents: Sequence[str]):
    """Rows per weight_version stacked by agent (staleness under each version), and mean reward per version."""
    colors = agent_colors(agents)
    order = list(dict.fromkeys(counts["weight_version"].to_list()))
    stale = {v: s for v, s in zip(counts["weight_version"], counts["staleness"])}
    fig = new_figure(13, 4.2)
    ax1, ax2 = fig.subplots(1, 2)
    x = np.arange(len(order))
    bottom = np.zeros(len(order))
    width = 0.8 / max(len(agents), 1)
    for i, agent in enumerate(agents):
        d = counts.filter(pl.col("agent") == agent)
        n = np.array([d.filter(pl.col("weight_version") == v)["rows"].sum() for v in order], float)
        ax1.bar(x, n, 0.7, bottom=bottom, color=colors[agent], label=agent)
        bottom += n
        r = [d.filter(pl.col("weight_version") == v)["reward_mean"].mean() for v in order]
        ax2.bar(x + (i - (len(agents) - 1) / 2) * width, [np.nan if v is None else v for v in r], width,
                color=colors[agent], label=agent)
    for xi, total in zip(x, bottom):
        ax1.annotate(f"{int(total):,}", (xi, total), ha="center", va="bottom", fontsize=8)
    labels = [f"{v}\n{'?' if stale[v] is None else stale[v]} behind" for v in order]
    ax1.set_xticks(x, labels)
    ax1.set_ylim(0, max(bottom.max() if len(bottom) else 1, 1) * 1.15)
    ax1.set(title="Rows by weight_version (stacked by agent)", xlabel="weight_version (versions behind the newest)",
            ylabel="rows")
    legend_outside(ax1, title="agent")
    ax2.set_xticks(x, labels)
    ax2.set(title="Mean reward by weight_version", xlabel="weight_version", ylabel="mean reward")
    legend_outside(ax2, title="agent")
    return fig
