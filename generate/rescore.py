"""``rollshard-generate rescore DATASET --out NEW``: new rewards for stored rows, without an engine.

    rollshard-generate rescore runs/math --reward my_reward.py:score --out runs/math-rescored

Every row keeps its tokens, logprobs, mask, ids, versions and texts byte for byte (the
store's :func:`~rollshard.store.derived.derive.derive_dataset` checks it); only ``reward`` and
``metadata`` (the new verdict) change. The reward rule is the agent system's own
(:meth:`AgentSystem.score`), applied to each episode's stored rows, so derived rewards stay
consistent: a multi-agent selector takes the new reward of the rewrite it picked, and the
episode weight follows whether that rewrite is now correct.

What scores: ``--reward`` (a user function), ``--reward-url`` (a reward server), or
``--task`` (a task's verifier); by default what scored the dataset (its ``--reward``,
``--reward-url`` or task, from the run config), which reproduces the stored rewards
exactly when that code is unchanged. The agent system is the dataset's (its name and options from the
run config; a plugin system is loaded from its recorded spec unless ``--agents`` names one).

The new dataset records its lineage (the parent's fingerprint, the scorer's identity:
spec, file and sha256, or URL) and trains and inspects like any other. Rescoring is
resumable: rerun the same command after an interrupt to continue. Rows are scored episode
by episode within each row group (the runner writes whole episodes into one row group).

Exit status: 0 done; 1 a reward failed (the message names the sample; shards scored so far
are committed, rerun to continue) or the data is damaged; 2 a usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import pyarrow as pa

from rollshard.generate.agents import AgentSystem, make_agent_system
from rollshard.generate.rewards import RewardError, Scorer, add_reward_arguments, gather_all, make_scorer
from rollshard.generate.tasks import Task, get_task
from rollshard.store.io.dataset import DatasetNotFoundError, RolloutDataset, check_dataset_out
from rollshard.store.derived.derive import DeriveError, TransformError, derive_dataset
from rollshard.store.common import DataError, EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError, one_line, print_error
from rollshard.store.format.lineage import lineage_of
from rollshard.store.format.schema import Row, SchemaVersionError

PROG = "rollshard-generate rescore"
MUTABLE = ("reward", "metadata")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="New rewards for a stored dataset, tokens and logprobs untouched, lineage recorded "
        "(resumable: rerun to continue).",
    )
    p.add_argument("dataset", metavar="DATASET", help="the dataset to rescore (directory or pyarrow filesystem URI)")
    p.add_argument("--out", required=True, metavar="NEW", help="the rescored dataset (a new directory)")
    s = p.add_argument_group("what scores (default: what scored the dataset: its --reward, --reward-url or task)")
    add_reward_arguments(s, reward_help="reward function: module:fn or file.py:fn (sync or async)")
    s.add_argument("--task", metavar="TASK", help="a task's verifier: a built-in name, module:attr or file.py:attr")
    s.add_argument(
        "--agents", metavar="SYSTEM",
        help="the agent system whose reward rule applies (default: the dataset's, from its run config)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_dataset_out(args.out, fix="give a new or empty folder, or the unfinished output of this rescore to "
                          "resume")
        try:
            parent = RolloutDataset.open(args.dataset)
        except (DatasetNotFoundError, SchemaVersionError) as e:
            raise UsageError(str(e)) from e
        except DataError as e:  # a shard cut short or not Parquet: damaged data, said before anything is written
            raise UsageError(f"{args.dataset}: {e}") from e
        recorded = _recorded_scorer(parent)
        task, system = _task_and_system(parent.config, args, recorded)
        reward, reward_url = args.reward, args.reward_url
        if not (reward or reward_url or args.task):  # what scored the dataset last
            reward = recorded.get("spec") if recorded.get("kind") == "function" else None
            reward_url = recorded.get("url") if recorded.get("kind") == "http" else None
        try:
            scorer = make_scorer(
                task,
                reward=reward,
                reward_url=reward_url,
                concurrency=args.reward_concurrency,
                timeout=args.reward_timeout,
            )
        except ValueError as e:
            raise UsageError(str(e)) from e
        details = {"reward": scorer.identity, "task": task.name, "agents": system.config()}
        with asyncio.Runner() as loop:
            try:
                result = derive_dataset(
                    parent,
                    args.out,
                    lambda table: loop.run(rescore_table(table, system, scorer)),
                    operation="rescore",
                    details=details,
                    mutable_columns=MUTABLE,
                    command=PROG,
                    progress=not args.no_progress,
                )
            finally:
                loop.run(scorer.close())
    except UsageError as e:
        print_error(PROG, str(e))
        return EXIT_USAGE
    except DeriveError as e:
        print_error(PROG, str(e))
        return EXIT_USAGE
    except (RewardError, TransformError, DataError, ValueError) as e:
        print_error(PROG, f"{one_line(e)}; the shards rescored so far are committed: fix it and rerun to continue")
        return EXIT_FAILED
    except KeyboardInterrupt:
        print_error(PROG, "interrupted; the shards rescored so far are committed: rerun the same command to continue")
        return 130
    print(f"{PROG}: {result.summary()} -> {args.out}", file=sys.stderr)
    return EXIT_OK


async def rescore_table(table: pa.Table, system: AgentSystem, scorer: Scorer) -> pa.Table:
    """``table`` with the rewards and metadata the system's rule gives its episodes' rows (module docstring).

    The rows are :class:`Row` objects as in generation, except that their token, logprob and mask fields are
    numpy arrays (views of the read columns) rather than lists."""
    tokens = {name: _row_views(table.column(name)) for name in _TOKEN_FIELDS}  # numpy views, not Python lists
    rows = [
        Row.from_dict({**d, **{name: tokens[name][i] for name in _TOKEN_FIELDS}})
        for i, d in enumerate(table.select(_ROW_FIELDS).to_pylist())
    ]
    episodes: dict[str, list[Row]] = {}
    for row in rows:
        episodes.setdefault(row.prompt_id, []).append(row)
    await gather_all(system.score(ep, scorer) for ep in episodes.values())
    reward = pa.array([r.reward for r in rows], table.schema.field("reward").type)
    metadata = pa.array([r.metadata for r in rows], table.schema.field("metadata").type)
    table = table.set_column(table.schema.get_field_index("reward"), "reward", reward)
    return table.set_column(table.schema.get_field_index("metadata"), "metadata", metadata)


_TOKEN_FIELDS = ["prompt_tokens", "response_tokens", "rollout_logprobs", "loss_mask"]
_ROW_FIELDS = [
    "sample_id", "prompt_id", "group_id", "agent", "round", "reward", "status", "finish_reason", "weight_version",
    "weight_versions", "temperature", "top_p", "top_k", "prompt_text", "response_text", "metadata",
]


def _row_views(column: pa.ChunkedArray) -> list:
    """Each row's list as a numpy view of the column's values (no per-element Python objects)."""
    arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    values, offsets = arr.values.to_numpy(zero_copy_only=False), arr.offsets.to_numpy()
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(arr))]


def _recorded_scorer(dataset: RolloutDataset) -> dict[str, Any]:
    """What scored the dataset last: the newest rescore in its lineage, else the generation run's scorer."""
    for entry in lineage_of(dataset):
        if entry.get("operation") == "rescore" and isinstance((entry.get("details") or {}).get("reward"), dict):
            return entry["details"]["reward"]
    return dataset.config.get("reward") or {}


def _task_and_system(config: dict[str, Any], args, recorded: dict[str, Any]) -> tuple[Task, AgentSystem]:
    """The task (for its verifier) and the agent system (for its reward rule): given, else the dataset's."""
    recorded_task = (
        ((recorded.get("plugin") or {}).get("spec") or recorded.get("task")) if recorded.get("kind") == "task" else None
    ) or (config.get("task_plugin") or {}).get("spec") or config.get("task")
    task_spec = args.task or recorded_task
    if not task_spec:
        raise UsageError(f"{args.dataset} records no task in its run config; pass --task (or --reward)")
    try:
        task = get_task(task_spec)
    except ValueError as e:
        raise UsageError(f"{e}{'' if args.task else ' (the dataset task; pass --task to choose another)'}") from e
    recorded = dict(config.get("agents") or {})
    name = recorded.pop("name", None)
    plugin = recorded.pop("plugin", None)
    spec = args.agents or (plugin or {}).get("spec") or name
    if not spec:
        raise UsageError(f"{args.dataset} records no agent system in its run config; pass --agents")
    options = recorded if spec in (name, (plugin or {}).get("spec")) else {}
    try:
        system = make_agent_system(spec, options=options)
    except ValueError as e:
        raise UsageError(f"{e}{'' if args.agents else ' (the dataset agent system; pass --agents)'}") from e
    if plugin and system.plugin and plugin.get("sha256") != system.plugin.get("sha256"):
        print(
            f"{PROG}: warning: {spec} changed since the dataset was generated (sha256 "
            f"{str(plugin.get('sha256'))[:12]} then, {str(system.plugin.get('sha256'))[:12]} now); its reward rule "
            "is applied as it is now",
            file=sys.stderr,
        )
    return task, system


