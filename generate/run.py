"""``rollshard-generate``: run an agent system over a prompt set against an engine into a dataset.

    rollshard-generate --engine embedded:MODEL --agents multi_agent --task math --out DATASET

Steps: parse -> load task, agent system, reward and prompts -> reach the engine -> load the
tokenizer -> open the dataset (resume) -> run -> commit, report.

Bring your own (rollshard/generate/plugins.py): ``--task``, ``--agents`` and ``--reward``
take a built-in name or ``module:attr`` / ``path/to/file.py:attr``; ``--reward-url`` posts each
row to a reward server. A plugin's file and hash are recorded in the run config, and a
resume with an edited plugin is refused.

Rerunning the same command resumes: prompts already in DATASET are skipped, the rest
(including those in the failure ledger) are generated. ``--shard-index i --num-shards
n`` on n hosts split the prompts (by position modulo n) into the one dataset, each
host writing as writer ``gen-i-of-n``. ``--ray [ADDRESS] --num-shards n`` runs those n shards as
Ray tasks of this same command (:mod:`rollshard.generate.ray_run`): one progress bar, a task
that dies or leaves failed prompts rerun (``--ray-retries``), resumable like the rest.

Sampling support (``--sampling-support auto|on|off``, default auto): when sampling truncates
(top-p < 1 or a top-k, temperature > 0), each row also stores every response token's
sampling support and its logprob under the truncated, renormalized distribution (schema
1.1 ``sampling_support`` / ``sampling_logprobs``; environment tokens: [] and 0.0). SGLang
returns them only with a finite top-k (<= its ``--sampling-mask-max-tokens``): a top-p run on
SGLang needs ``--top-k K`` or ``--sampling-support off`` (a usage error otherwise). The
resolved setting is part of the run config a resume compares.

Routed experts (``--routed-experts auto|on|off``, default auto): on a mixture-of-experts model each row
also stores every MoE layer's top-k expert ids at every position the engine forwarded (schema 1.2
``routed_experts``, store/format/routing.py), which ``rollshard-train --routing-replay`` forces in training (R3).
auto: when the model is MoE and the engine returns them (an SGLang server needs
``--enable-return-routed-experts``); on: refused for a dense model or an engine that does not.

Resuming checks the settings (the first differing one is named) and every prompt
already in the dataset: its stored ``prompt_hash`` (rendered prompt ids and label) must
match the source's, so an edited or swapped prompt file is refused rather than skipped.

Asynchronous RL (a trainer following the dataset as it is written, ``rollshard-train --follow``):
``--repeat`` cycles the prompts without end, pass k >= 1 naming prompt ID ``ID~k`` (fresh sample ids
and seeds; a rerun resumes pass by pass), until interrupted or the engine is down. ``--max-ahead ETA
--step-episodes B [--first-version V0]`` starts an episode only while the episodes started (those in
the dataset plus this run's) number fewer than ``(ETA + 1 + v - V0) * B``, ``v`` the engine's
weight version (:mod:`rollshard.generate.admission`). A run that did every prompt with none failed
leaves its writer's end-of-run marker (:mod:`rollshard.store.io.live`); a --repeat run never does.

Exit status: 0 every prompt is in the dataset; 1 some prompts failed (listed in
``DATASET/_failures/``; rerun to retry) or the engine stopped answering (rerun once it
is back); 2 a usage error (bad arguments, a malformed
prompt file, an unreachable engine, a dataset made with other settings) -- nothing is
written then; 130 interrupted (complete episodes are committed).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import math
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import aiohttp

from rollshard.generate.admission import AdmissionGate, integer_version
from rollshard.generate.agents import SYSTEMS, AgentSystem, make_agent_system
from rollshard.generate.agents.base import prompt_hash
from rollshard.generate.chat import ChatFormat
from rollshard.generate.rewards import RewardError, Scorer, add_reward_arguments, make_scorer
from rollshard.generate.engines.base import Engine, EngineError, EngineSettingsError, SamplingParams
from rollshard.generate.runner import (
    EXIT_FAILURES,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    GATE_POLL_S,
    ConfigMismatchError,
    PASS_SUFFIX,
    Runner,
    RunnerOptions,
    RunResult,
    check_resume_config,
    check_resume_prompts,
    repeat_prompts,
    shard_prompts,
    writer_id_for,
)
from rollshard.generate.tasks import (
    TASKS, Prompt, PromptSourceError, Task, get_task, load_prompts, parse_task_options,
)
from rollshard.store.common import UsageError
from rollshard.store.io.dataset import DatasetNotFoundError, RolloutDataset, foreign_entries
from rollshard.store.format.lineage import lineage_of
from rollshard.store.models.fingerprint import model_fingerprint
from rollshard.store.format.routing import CONFIG_KEY as ROUTING_KEY, RoutingShape, RoutingShapeError, shape_of_model_folder
from rollshard.store.format.schema import GREEDY_TEMPERATURE_EPS, SchemaVersionError
from rollshard.store.models.tokenizer import TokenizerError, load_tokenizer
from rollshard.store.models.gguf import gguf_source
from rollshard.store.models.versions import resolve_model_path
from rollshard.store.io.writer import ShardWriter

PROG = "rollshard-generate"
SUPPORT_MODES = ("auto", "on", "off")
CONTEXT_KEYS = ("max_context_length", "context_length", "max_context_len")  # model_info names for the context
MAX_SANE_CONTEXT = 1 << 24  # tokenizers without a limit report ~1e30 as model_max_length


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Generate rollouts with an agent system into a rollshard dataset (resumable: rerun to continue). "
        "Subcommands: `serve` (the embedded engine behind SGLang's HTTP API), `rescore` (new rewards for a stored "
        "dataset, no engine), `eval` (a model on held-out prompts: pass@k), `init-model` (a tiny local model, or the real "
        "SmolLM2-135M-Instruct).",
    )
    g = p.add_argument_group("what to run")
    g.add_argument("--engine", required=True, metavar="SPEC", help="embedded:MODEL_DIR, or SGLang URL[,URL...]")
    g.add_argument(
        "--agents", default="single", metavar="SYSTEM",
        help=f"agent system: {', '.join(sorted(SYSTEMS))}, or your own as module:Class or file.py:Class "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--agent-option", action="append", default=[], metavar="KEY=VALUE",
        help="an option of the agent system, e.g. correct_weight=1.0 (repeatable)",
    )
    g.add_argument(
        "--task", default="math", metavar="TASK",
        help=f"prompt format and verifier: {', '.join(sorted(TASKS))}, or your own as module:attr or file.py:attr "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--task-option", action="append", default=[], metavar="KEY=VALUE",
        help="an option of a task that generates its prompts (arithmetic, countdown), e.g. digits=3, ops=+-*, seed=1, "
        "size=200 (repeatable)",
    )
    add_reward_arguments(
        g,
        reward_help="reward function instead of the task's verifier: module:fn or file.py:fn, sync or async, given a "
        "rollshard.generate.rewards.Sample, returning a float or {'reward': float, ...}",
    )
    g.add_argument("--system-prompt", metavar="TEXT", help="system message before every prompt (default: the task's)")
    chat = g.add_mutually_exclusive_group()
    chat.add_argument("--chat-template", metavar="PATH", help="Jinja chat template file (default: the tokenizer's)")
    chat.add_argument(
        "--no-chat-template", action="store_true",
        help="send raw prompts: message contents joined by a blank line, no template (base models)",
    )
    g.add_argument(
        "--prompts", metavar="SOURCE",
        help="JSONL or Parquet file, HF dataset name or folder (default: the task's own)",
    )
    g.add_argument(
        "--input-key", default="prompt", metavar="KEY",
        help="prompt field, a string or chat messages (default: %(default)s)",
    )
    g.add_argument("--label-key", default="label", metavar="KEY", help="label field (default: %(default)s)")
    g.add_argument(
        "--id-key", default="id", metavar="KEY",
        help="prompt id field; without it, the position (default: %(default)s)",
    )
    g.add_argument(
        "--split", default="train",
        help="split of a HF dataset, or of a task that generates its prompts: train, or eval (held out, disjoint "
        "from train) (default: %(default)s)",
    )
    g.add_argument("--limit", type=int, metavar="N", help="use the first N prompts of the source")
    g.add_argument("--out", required=True, metavar="DATASET", help="dataset directory or pyarrow filesystem URI")

    s = p.add_argument_group("sampling")
    s.add_argument(
        "--n-samples", type=int, default=4, metavar="N",
        help="samples per prompt; multi_agent: solvers and rewriters (default: %(default)s)",
    )
    s.add_argument("--temperature", type=float, default=1.0, metavar="T", help="0 is greedy (default: %(default)s)")
    s.add_argument("--top-p", type=float, default=1.0, metavar="P", help="(default: %(default)s)")
    s.add_argument("--top-k", type=int, default=-1, metavar="K", help="-1: no top-k (default: %(default)s)")
    s.add_argument(
        "--sampling-support", choices=SUPPORT_MODES, default="auto",
        help="store each response token's sampling support and its logprob under the truncated, renormalized "
        "distribution (schema 1.1), for importance ratios that know what top-p/top-k kept. auto: when sampling "
        "truncates (--top-p < 1 or --top-k, temperature > 0); on: also for greedy runs, and refused when nothing "
        "truncates; off: never. SGLang returns it only with a top-k (<= its --sampling-mask-max-tokens, 4096 by "
        "default): a top-p run needs --top-k K too (default: %(default)s)",
    )
    s.add_argument(
        "--routed-experts", choices=SUPPORT_MODES, default="auto",
        help="store each MoE layer's top-k expert ids at every prompt and response position but the last (schema "
        "1.2), for routing replay in training. auto: when the model is a mixture of experts and the engine returns "
        "them "
        "(SGLang: --enable-return-routed-experts); on: refused otherwise; off: never (default: %(default)s)",
    )
    s.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="per model turn (default: %(default)s)")
    s.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)")
    s.add_argument(
        "--ignore-eos", action="store_true",
        help="SGLang's ignore_eos: neither the model's eos nor a stop token id ends a turn, only --max-new-tokens or "
        "a --stop string (rows end 'truncated'); the eos stays in the distribution, so the logprobs keep their "
        "meaning (for benchmarks and fixed-length rollouts)",
    )
    s.add_argument(
        "--seed", type=int, default=0,
        help="run seed; request seeds derive from it and the sample id (default: %(default)s)",
    )
    s.add_argument(
        "--max-context-len", type=int, metavar="N",
        help="prompt + response token limit (default: the engine's)",
    )
    s.add_argument("--tokenizer", metavar="PATH", help="tokenizer folder (default: the engine's model path)")
    s.add_argument(
        "--device", default=None, metavar="DEV",
        help="embedded engine: torch device, e.g. cuda or cuda:1 (default: cpu, or the @DEV of embedded:PATH@DEV)",
    )
    s.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
        help="embedded engine: weights and compute dtype; float32 keeps its logprobs within ~1e-6 of the fp32 "
        "trainer's (default: %(default)s)",
    )
    s.add_argument(
        "--threads", type=int, default=None, metavar="N",
        help="embedded engine: torch threads of its decode (default: the machine's cores less one, at least 1: the "
        "process's event loop and writer keep a core)",
    )
    s.add_argument(
        "--weight-version", metavar="V",
        help="policy version stored in the rows (default: the checkpoint's own, from its trainer_state.json, else "
        "0); with SGLang servers, checked against the version they serve",
    )

    s.add_argument(
        "--update-weights", metavar="CHECKPOINT",
        help="SGLang servers: load this model folder on every server (/update_weights_from_disk, with its version "
        "or --weight-version) before generating; the path must be visible to the servers",
    )

    r = p.add_argument_group("running")
    r.add_argument(
        "--concurrency", type=int, default=64, metavar="N",
        help="engine requests in flight (default: %(default)s)",
    )
    r.add_argument(
        "--shard-index", type=int, default=None, metavar="I",
        help="this host's part of the prompts (default: 0; with --ray, each task's own)",
    )
    r.add_argument(
        "--num-shards", type=int, default=None, metavar="N",
        help="hosts (with --ray: Ray tasks) splitting the prompts (default: 1; with --ray, one per engine URL)",
    )
    r.add_argument(
        "--commit-every", type=int, default=256, metavar="N",
        help="commit a shard every N prompts (default: %(default)s)",
    )
    r.add_argument(
        "--commit-interval", type=float, default=60.0, metavar="S",
        help="and at least every S seconds (default: %(default)s)",
    )
    r.add_argument(
        "--request-timeout", type=float, default=600.0, metavar="S",
        help="per engine request (default: %(default)s)",
    )
    r.add_argument(
        "--retries", type=int, default=2, metavar="N",
        help="extra attempts of a prompt after an engine error (default: %(default)s)",
    )
    r.add_argument(
        "--allow-skipped-calls", action="store_true",
        help="store an episode without the calls whose prompt does not fit the context (multi_agent rewriters, "
        "selector) instead of failing its prompt; skipped calls are counted per role in the summary",
    )
    r.add_argument(
        "--max-failed-prompts", type=float, default=0.0, metavar="FRAC",
        help="exit 0 when no more than this fraction of the prompts failed (they stay in the ledger, and a rerun "
        "retries them); an engine that went away still exits 1 (default: %(default)s, every prompt must succeed)",
    )
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument(
        "--check-args", action="store_true",
        help="check the arguments and exit: 0 when the run would start, 2 and the error in one line when not; no "
        "engine starts, nothing is written (rollshard-loop checks its --generate with it before round 0)",
    )

    a = p.add_argument_group("asynchronous RL (a trainer following --out as it is written)")
    a.add_argument(
        "--repeat", action="store_true",
        help="cycle the prompts (with --limit N: the first N) without end, each pass sampling afresh: pass k >= 1 "
        "names prompt ID ID~k (new sample ids and seeds). Runs until interrupted (exit 130, complete episodes "
        "committed) or the engine is down; rerunning resumes where it stopped. Never marks the writer complete",
    )
    a.add_argument(
        "--max-ahead", type=int, metavar="ETA",
        help="AReaL's staleness bound: start an episode only while the episodes started (the prompts already in "
        "--out plus this run's episodes, failed ones too) number fewer than (ETA + 1 + v - V0) * B, v the engine's "
        f"weight_version (an integer); while not, re-read it every {GATE_POLL_S:g} s. 0: every episode is trained "
        "on by the policy that generated it (synchronous). Needs --step-episodes and an engine whose version moves: "
        "an SGLang URL, or `rollshard-generate serve` for a local model",
    )
    a.add_argument(
        "--step-episodes", type=int, metavar="B",
        help="episodes (prompts, not rows) the trainer takes per step; with --max-ahead",
    )
    a.add_argument(
        "--first-version", type=int, default=0, metavar="V0",
        help="the weight_version the engine serves before the trainer's first step; with --max-ahead "
        "(default: %(default)s)",
    )

    c = p.add_argument_group("cluster (Ray; pip install 'rollshard[ray]')")
    c.add_argument(
        "--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
        help="run the --num-shards shards as Ray tasks, each writing as its own writer into --out (a path every "
        "node sees, or a pyarrow filesystem URI); ADDRESS: a running cluster (host:port, auto, ray://host:port); "
        "without it, a one-machine cluster started for the run on 127.0.0.1. Rerun the same command to resume",
    )
    c.add_argument(
        "--ray-retries", type=int, default=2, metavar="N",
        help="reruns of a shard whose task died or left failed prompts; each resumes from its committed rows "
        "(default: %(default)s)",
    )
    c.add_argument(
        "--ray-runtime-env", metavar="JSON",
        help="Ray runtime_env of the tasks, as a JSON object (env_vars, pip, working_dir, ...)",
    )
    c.add_argument("--ray-task", action="store_true", help=argparse.SUPPRESS)  # set by the driver for its tasks
    return p


def main(argv: list[str] | None = None, *, progress: Callable[[int, int], None] | None = None) -> int:
    """The command; ``progress(done, total)`` is called as prompts finish (a Ray task reports to its driver)."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = build_parser().parse_args(argv)
    try:
        _check_args(args)
        if args.check_args:
            return 0
        if args.ray is not None and not args.ray_task:
            from rollshard.generate.ray_run import launch

            return launch(argv, args)
        task, system, scorer, prompts = _load_inputs(args)
        return asyncio.run(_run(args, task, system, scorer, prompts, progress))
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # before the run started, or a second Ctrl-C: committed shards stay
        print(f"{PROG}: interrupted; rerun the same command to continue", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as e:  # the dataset location failed under us (disk full, permissions, network)
        msg = f"{PROG}: error: writing {args.out}: {e}; committed shards are intact, rerun to continue"
        print(msg, file=sys.stderr)
        return EXIT_FAILURES


def _engine_urls(spec: str) -> list[str]:
    return [u for u in spec.split(",") if u.strip()] or [spec]


def _quiet_model_loading() -> None:
    """transformers' own bars (loading weights) would interleave with the run's progress bar."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _check_args(args: argparse.Namespace) -> None:
    if args.ray is not None and not args.ray_task:
        if args.shard_index is not None:
            raise UsageError("--shard-index is not for --ray: each task gets its own; give --num-shards only")
        if args.num_shards is None:  # one task per server
            args.num_shards = 1 if args.engine.strip().startswith("embedded:") else len(_engine_urls(args.engine))
        if args.ray_retries < 0:
            raise UsageError("--ray-retries must be >= 0")
    args.shard_index = 0 if args.shard_index is None else args.shard_index
    args.num_shards = 1 if args.num_shards is None else args.num_shards
    if args.num_shards < 1 or not 0 <= args.shard_index < args.num_shards:
        raise UsageError(f"--shard-index must be in [0, --num-shards); got {args.shard_index} of {args.num_shards}")
    for name in ("concurrency", "n_samples", "max_new_tokens", "commit_every"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if args.retries < 0:
        raise UsageError("--retries must be >= 0")
    if not args.request_timeout > 0:  # NaN too
        raise UsageError(f"--request-timeout {args.request_timeout:g} must be > 0 seconds")
    _check_sampling(args)
    if not 0.0 <= args.max_failed_prompts <= 1.0:
        raise UsageError(f"--max-failed-prompts must be a fraction in [0, 1]; got {args.max_failed_prompts:g}")
    if args.update_weights is not None and args.engine.strip().startswith("embedded:"):
        raise UsageError(f"--update-weights is for SGLang servers; the embedded engine loads its model from the "
                         f"spec: --engine embedded:{args.update_weights}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1 (torch threads of the embedded engine's decode); got {args.threads}")
    if not args.engine.strip().startswith("embedded:") and args.threads is not None:
        raise UsageError("--threads is for the embedded engine; an SGLang server sets its own")
    if not args.engine.strip().startswith("embedded:") and (args.device is not None or args.dtype != "float32"):
        raise UsageError("--device and --dtype are for the embedded engine; an SGLang server has its own "
                         "(its --device and --dtype)")
    _check_following(args)
    args.return_sampling_mask = _sampling_support(args)


def _check_following(args: argparse.Namespace) -> None:
    """``--repeat`` and the admission gate (``--max-ahead``): what one writer against a moving engine needs."""
    if args.ray is not None and (args.repeat or args.max_ahead is not None):
        raise UsageError("--repeat and --max-ahead are for one writer, not --ray: run rollshard-generate on its own")
    if (args.max_ahead is None) != (args.step_episodes is None):
        raise UsageError("--max-ahead and --step-episodes go together: the bound is (ETA + 1 + v - V0) * B episodes")
    if args.max_ahead is None:
        if args.first_version != 0:
            raise UsageError("--first-version is the version --max-ahead counts from; give --max-ahead too")
        return
    if args.max_ahead < 0 or args.step_episodes < 1:
        raise UsageError(f"--max-ahead must be >= 0 and --step-episodes >= 1; got {args.max_ahead} and "
                         f"{args.step_episodes}")
    if args.num_shards > 1:
        raise UsageError("--max-ahead counts the episodes of one writer against the trainer's steps; run one "
                         "writer (no --num-shards) and give it every engine URL")
    if args.engine.strip().startswith("embedded:"):
        raise UsageError("--max-ahead needs an engine whose weight version moves as the trainer steps; the "
                         "embedded engine's never does: run `rollshard-generate serve --model MODEL` and point "
                         "--engine at its URL")


def _check_sampling(args: argparse.Namespace) -> None:
    """The sampling settings, before any engine starts: a value no engine samples with (SGLang refuses it per
    request, the writer refuses its rows) would otherwise fail every prompt of the run, at its end."""
    if not (math.isfinite(args.temperature) and args.temperature >= 0.0):
        raise UsageError(f"--temperature {args.temperature:g} must be a finite number >= 0 (0 is greedy)")
    if not (math.isfinite(args.top_p) and 0.0 < args.top_p <= 1.0):
        raise UsageError(f"--top-p {args.top_p:g} must be in (0, 1] (1 keeps every token)")
    if args.top_k == 0 or args.top_k < -1:
        raise UsageError(f"--top-k {args.top_k} must be -1 (no top-k) or >= 1")
    if args.max_context_len is not None and args.max_context_len < 1:
        raise UsageError(f"--max-context-len {args.max_context_len} must be >= 1 (or left out: the engine's)")


def _sampling_support(args: argparse.Namespace) -> bool:
    """Whether the run asks the engine for the sampling support (``--sampling-support``); usage errors for what
    cannot work: ``on`` with nothing truncated (the support would be the vocabulary, per token), and an SGLang
    engine asked without a top-k (SGLang refuses every such request; its top-k cap is checked on connect)."""
    greedy = args.temperature < GREEDY_TEMPERATURE_EPS
    truncates = not greedy and (args.top_p < 1.0 or args.top_k > 0)
    if args.sampling_support == "off":
        return False
    if args.sampling_support == "auto" and _resumes_a_dataset_without_supports(args.out):
        return False  # rerunning the command that made it resumes it, as before supports were stored
    if args.sampling_support == "on" and not (truncates or greedy):
        raise UsageError(
            "--sampling-support on: nothing truncates (--top-p 1, no --top-k), so the support would be the whole "
            "vocabulary; set --top-k K or --top-p P < 1, or use --sampling-support auto/off"
        )
    ask = args.sampling_support == "on" or truncates
    sglang = not args.engine.strip().startswith("embedded:")
    if ask and sglang and not greedy and args.top_k < 1:
        raise UsageError(
            f"--sampling-support {args.sampling_support} with --top-p {args.top_p:g} and no --top-k: SGLang returns "
            "the sampling support only with a top-k; add --top-k K (K <= the server's --sampling-mask-max-tokens, "
            "4096 by default) or pass --sampling-support off"
        )
    return ask


async def resolve_routing(args: argparse.Namespace, engine: Engine, folders: list[str | None],
                   sampling: SamplingParams) -> RoutingShape | None:
    """The routing shape the run stores (``--routed-experts``), or None: the model's (the config.json of the
    engine's model folder, else of the tokenizer's), when it is a mixture of experts and the engine returns routing
    of that shape."""
    if args.routed_experts == "off":
        return None
    try:
        shape = served_model_routing(folders)
    except RoutingShapeError as e:
        if args.routed_experts == "on":
            raise UsageError(f"--routed-experts on: {e}") from e
        print(f"{PROG}: note: {e}; rows are written without routed experts", file=sys.stderr)
        return None
    if shape is None:
        if args.routed_experts == "on":
            raise UsageError(f"--routed-experts on: the model ({folders[0]}) is not a mixture of experts whose "
                             "config.json names num_experts and num_experts_per_tok; use --routed-experts auto")
        return None
    try:
        width = await engine.routed_experts_width(sampling)
    except EngineError as e:
        raise UsageError(str(e)) from e
    if width is None:
        why = engine.routing_reason or (
            f"engine {args.engine!r} returns no routed experts (start the SGLang server with "
            "--enable-return-routed-experts)")
        if args.routed_experts == "on":
            raise UsageError(f"--routed-experts on: {why}; or use --routed-experts auto/off")
        print(f"{PROG}: note: {why}; rows are written without routed experts", file=sys.stderr)
        return None
    if width != shape.width:
        raise UsageError(
            f"the engine returns {width} expert ids per position, but {folders} describes {shape.layers} layers x "
            f"top-{shape.top_k} = {shape.width}: the local config.json is of another model; pass --tokenizer with "
            "the served model's folder, or --routed-experts off"
        )
    return shape


def served_model_routing(folders: list[str | None]) -> RoutingShape | None:
    """The routing shape of the served model, from the first of ``folders`` with a config.json (None: dense)."""
    for folder in folders:
        if folder and (Path(str(folder)) / "config.json").is_file():
            return shape_of_model_folder(folder)
    raise RoutingShapeError(
        f"no config.json in the engine's model folder {folders[0]!r} (nor in the tokenizer's) to tell whether the "
        "model is a mixture of experts; pass --tokenizer with the model's local folder"
    )


def _resumes_a_dataset_without_supports(out: str) -> bool:
    """Whether ``out`` holds rows generated before the sampling support was recorded (no such config key)."""
    try:
        dataset = RolloutDataset.open(out)
    except (DatasetNotFoundError, SchemaVersionError, ValueError, OSError):
        return False  # nothing to resume (or _check_existing says what is wrong)
    return any(m.shards and "agents" in (m.config or {}) and "sampling_support" not in m.config for m in dataset.manifests)


def _load_inputs(args: argparse.Namespace) -> tuple[Task, AgentSystem, Scorer, list[Prompt]]:
    """Task, agent system, scorer and this host's prompts; every error here is the user's to fix."""
    try:
        task = get_task(args.task)
        if args.system_prompt is not None:
            task = dataclasses.replace(task, system_prompt=args.system_prompt or None)
        options = dict(_key_value(o) for o in args.agent_option)
        system = make_agent_system(args.agents, n_samples=args.n_samples, options=options)
        scorer = make_scorer(
            task,
            reward=args.reward,
            reward_url=args.reward_url,
            concurrency=args.reward_concurrency,
            timeout=args.reward_timeout,
        )
        args.chat = ChatFormat.from_file(args.chat_template) if args.chat_template else (
            ChatFormat(mode="raw") if args.no_chat_template else ChatFormat()
        )
        task_options = parse_task_options(args.task_option)
        args.task_options = None  # the resolved options of a task that generates its prompts (in the run config)
        if task.generator is not None and args.prompts is None:
            args.task_options = task.generator.resolve(task_options, args.split)
            source = f"{task.name}[{args.split}]"
            prompts = task.generator.prompts(args.split, args.task_options)
        else:
            if task_options:
                raise UsageError(
                    "--task-option is for a task that generates its prompts "
                    f"({', '.join(name for name, t in sorted(TASKS.items()) if t.generator)}), "
                    f"not for task {task.name!r} reading {args.prompts or 'its prompt file'}; drop --task-option"
                )
            source = args.prompts or task.default_prompts()
            prompts = load_prompts(
                source,
                input_key=args.input_key,
                label_key=args.label_key,
                id_key=args.id_key,
                label_required=task.label_required,
                split=args.split,
            )
    except (ValueError, PromptSourceError) as e:
        raise UsageError(str(e)) from e
    args.prompts = str(source)
    args.prompts_fingerprint = prompts_fingerprint(prompts)
    if args.limit is not None:
        prompts = prompts[: args.limit]
    args.prompts_total = len(prompts)  # of every shard
    prompts = shard_prompts(prompts, args.shard_index, args.num_shards)
    if args.repeat:
        _check_repeatable(prompts)
    return task, system, scorer, prompts


def _check_repeatable(prompts: list[Prompt]) -> None:
    """``--repeat`` names pass k of prompt ID ``ID~k``: a source id of that form would be another prompt's pass."""
    if not prompts:
        raise UsageError("--repeat: this shard has no prompts to repeat")
    for p in prompts:
        if PASS_SUFFIX.search(p.prompt_id):
            raise UsageError(
                f"--repeat names pass k of prompt ID ID~k, and the source has prompt id {p.prompt_id!r} (position "
                f"{p.index}), a pass of {PASS_SUFFIX.sub('', p.prompt_id)!r}; rename it or drop --repeat"
            )


def _key_value(option: str) -> tuple[str, str]:
    key, sep, value = option.partition("=")
    if not sep or not key:
        raise ValueError(f"--agent-option {option!r}: expected KEY=VALUE")
    return key.strip(), value.strip()


async def _run(
    args: argparse.Namespace, task: Task, system: AgentSystem, scorer: Scorer, prompts: list[Prompt], progress=None
) -> int:
    try:
        await _probe_reward(scorer)
        return await _generate(args, task, system, scorer, prompts, progress)
    finally:
        await scorer.close()


async def _probe_reward(scorer: Scorer) -> None:
    """A remote scorer (``--reward-url``) must answer before the engine starts: one that does not would fail
    every prompt of the run, after all of its generation."""
    try:
        await scorer.probe()
    except RewardError as e:
        raise UsageError(str(e)) from e


async def _generate(
    args: argparse.Namespace, task: Task, system: AgentSystem, scorer: Scorer, prompts: list[Prompt], progress=None
) -> int:
    sampling = sampling_params(args)
    config = _generation_config(args, system, task, scorer, sampling)
    _check_existing(args.out, config)  # before the engine: a refused resume costs no model load
    _quiet_model_loading()
    engine = await _connect(args)
    try:
        if args.update_weights is not None:
            await _update_weights(engine, args)
        info = await _model_info(engine, args.engine, sampling, args.weight_version)
        gate = _admission_gate(args, info)
        tokenizer_path = args.tokenizer or info.get("tokenizer_path") or info.get("model_path")
        if not tokenizer_path:
            raise UsageError(f"engine {args.engine!r} reports no model path to load the tokenizer from; pass --tokenizer")
        try:
            tokenizer = load_tokenizer(tokenizer_path)
        except TokenizerError as e:
            raise UsageError(f"{e} (or pass --tokenizer)") from e
        if sampling.return_sampling_mask and sampling.top_p >= 1.0 and sampling.top_k >= len(tokenizer):
            raise UsageError(
                f"--top-k {sampling.top_k} is at least the vocabulary ({len(tokenizer)} tokens): nothing truncates, and "
                "the support of every token would be the whole vocabulary; lower --top-k or pass --sampling-support off"
            )
        config.update(
            # Absolute, links resolved (checkpoints/latest -> step_N): the dataset names the exact policy, and
            # inspect / the notebook find the tokenizer from anywhere.
            model=resolve_model_path(info["model_path"]) if info.get("model_path") else None,
            # The weights themselves (rollshard-train compares its --model's); None where the folder is not local.
            model_fingerprint=(
                model_fingerprint(resolve_model_path(info["model_path"])) if info.get("model_path") else None
            ),
            tokenizer=resolve_model_path(tokenizer_path),
            weight_version=info.get("weight_version"),
            max_context_len=_context_len(args, info, tokenizer),
            chat_template=args.chat.config(tokenizer),
        )
        if config["model"] and (source := gguf_source(config["model"])):
            config["model_source"] = source  # a .gguf file's name and sha256 (its converted folder is a cache)
        routing = await resolve_routing(args, engine, [info.get("model_path"), tokenizer_path], sampling)
        if routing is not None:
            config[ROUTING_KEY] = routing.to_config()
            sampling = dataclasses.replace(sampling, return_routed_experts=True)
        try:  # both render prompts with the run's chat template
            _check_existing_prompts(args.out, prompts, task, tokenizer, args.chat, passes=args.repeat)
            warning = prompts and system.context_warning(
                sampling=sampling,
                context=config["max_context_len"],
                task=task,
                prompt=prompts[0],
                count_tokens=lambda messages: len(args.chat.ids(tokenizer, messages)),
            )
        except TokenizerError as e:
            raise UsageError(f"{e} (or pass --tokenizer)") from e
        if warning and not args.allow_skipped_calls:
            print(f"{PROG}: warning: {warning}", file=sys.stderr)
        writer_id = writer_id_for(args.shard_index, args.num_shards)
        try:
            writer = ShardWriter(args.out, writer_id=writer_id, config=config)
        except (RuntimeError, ValueError) as e:
            raise UsageError(str(e)) from e
        with writer:
            runner = Runner(
                system=system,
                task=task,
                engine=engine,
                tokenizer=tokenizer,
                sampling=sampling,
                writer=writer,
                options=RunnerOptions(
                    concurrency=args.concurrency,
                    # The SGLang client times out (and retries) each request itself; the embedded engine does not.
                    request_timeout=args.request_timeout if args.engine.strip().startswith("embedded:") else None,
                    retries=args.retries,
                    commit_every=args.commit_every,
                    commit_interval=args.commit_interval,
                    seed=args.seed,
                    max_context_len=config["max_context_len"],
                    allow_skipped_calls=args.allow_skipped_calls,
                    progress=not args.no_progress,
                    on_progress=progress,
                    admission=gate,
                    mark_complete=not args.repeat,  # an endless run is never done
                ),
                scorer=scorer,
                chat=args.chat,
            )
            result = await runner.run(repeat_prompts(prompts) if args.repeat else prompts)
        _report(args, result)
        return _exit_code(args, result)
    finally:
        await engine.close()


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_new_tokens=args.max_new_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        return_sampling_mask=args.return_sampling_mask,
    )


async def _connect(args: argparse.Namespace) -> Engine:
    from rollshard.generate.engines import make_engine

    options: dict[str, Any] = {}
    if args.engine.strip().startswith("embedded:"):
        options["weight_version"] = args.weight_version  # None: the checkpoint folder's own, else "0"
        options["dtype"] = args.dtype
        options["threads"] = args.threads
        if args.device is not None:
            options["device"] = args.device
    else:
        from rollshard.generate.engines.sglang import SGLangConfig

        # The runner bounds requests in flight; the client must not bound them lower.
        options["config"] = SGLangConfig(max_concurrency=args.concurrency, request_timeout_s=args.request_timeout)
    try:
        return make_engine(args.engine, **options)
    except (EngineError, ValueError, OSError) as e:
        raise UsageError(f"cannot start engine {args.engine!r}: {e}") from e


async def _update_weights(engine: Engine, args: argparse.Namespace) -> None:
    """``--update-weights``: every server loads the checkpoint (as its own version unless --weight-version)."""
    path = resolve_model_path(args.update_weights)
    try:
        await engine.update_weights_from_disk(path, args.weight_version)
    except (EngineError, aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
        raise UsageError(f"--update-weights {args.update_weights}: the servers did not load it: {e}") from e


async def _model_info(engine: Engine, spec: str, sampling: SamplingParams, version: str | None) -> dict[str, Any]:
    """The engine's model info, after checking every server answers, samples as asked and serves ``version``
    when one is asked for (one line if not)."""
    try:
        infos = await engine.health_check(sampling)
    except EngineSettingsError as e:
        raise UsageError(f"engine {spec!r} cannot be used as it is: {e}") from e
    except (EngineError, aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
        raise UsageError(f"cannot reach engine {spec!r}: {e}") from e
    # A server stamps every response with the version it serves; rows must carry the version that generated
    # them, so --weight-version cannot relabel a server's output: it checks it.
    served = sorted({str(info.get("weight_version")) for info in infos})
    if version is not None and served != [version]:
        raise UsageError(
            f"engine {spec!r} serves weight_version {', '.join(served)}, not --weight-version {version}; load that "
            "checkpoint with /update_weights_from_disk (or /update_weight_version) first, or drop --weight-version"
        )
    return infos[0]


def _admission_gate(args: argparse.Namespace, info: dict[str, Any]) -> AdmissionGate | None:
    """``--max-ahead``'s gate, once the engine serves a version it can count (one line if not)."""
    if args.max_ahead is None:
        return None
    try:
        integer_version(info.get("weight_version"))
    except ValueError as e:
        raise UsageError(f"{e}; serve a rollshard checkpoint (versions 0, 1, 2, ...) or drop --max-ahead") from e
    return AdmissionGate(max_ahead=args.max_ahead, step_episodes=args.step_episodes, first_version=args.first_version)


def _context_len(args: argparse.Namespace, info: dict[str, Any], tokenizer) -> int | None:
    if args.max_context_len is not None:
        return args.max_context_len
    for key in CONTEXT_KEYS:
        if info.get(key):
            return int(info[key])
    limit = getattr(tokenizer, "model_max_length", None)
    return int(limit) if isinstance(limit, int) and 0 < limit < MAX_SANE_CONTEXT else None


def _sampling_config(sampling: SamplingParams) -> dict[str, Any]:
    """The run config's ``sampling``: every field but the per-request seed and the support (recorded apart).
    ``ignore_eos`` only when set: configs written before it existed mean false, and the resume check compares
    the dicts key by key, so a false written out would refuse to resume every earlier dataset."""
    out = {k: v for k, v in dataclasses.asdict(sampling).items()
           if k not in ("sampling_seed", "return_sampling_mask", "return_routed_experts")}
    if not out["ignore_eos"]:
        del out["ignore_eos"]
    return out


def _generation_config(args, system: AgentSystem, task: Task, scorer: Scorer, sampling: SamplingParams) -> dict[str, Any]:
    """The run config (stored with every shard); the engine's fields are added once it answers."""
    try:
        version = metadata.version("rollshard")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {
        "command": PROG,
        "rollshard_version": version,
        "engine": args.engine,
        **({"engine_dtype": args.dtype} if args.engine.strip().startswith("embedded:") else {}),
        "agents": system.config(),
        "task": task.name,
        "task_plugin": task.plugin,
        "reward": scorer.identity,
        "system_prompt": task.system_prompt,
        "prompts": args.prompts,
        "prompts_fingerprint": args.prompts_fingerprint,
        "input_key": args.input_key,
        "label_key": args.label_key,
        "id_key": args.id_key,
        "limit": args.limit,
        "split": args.split,
        "task_options": args.task_options,
        # return_sampling_mask is recorded as sampling_support: a config without it (before schema 1.1) means off.
        "sampling": _sampling_config(sampling),
        "sampling_support": "on" if sampling.return_sampling_mask else "off",
        "sampling_support_mode": args.sampling_support,  # as given (auto resolves to the value above)
        "seed": args.seed,
        "n_samples": args.n_samples,
        "shard_index": args.shard_index,
        "num_shards": args.num_shards,
        "concurrency": args.concurrency,
        "allow_skipped_calls": args.allow_skipped_calls,
    }


def _check_existing(out: str, config: dict[str, Any]) -> None:
    foreign = foreign_entries(out)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UsageError(f"--out {out} holds {shown}: not a rollshard dataset; give a new or empty folder, or a "
                         "dataset to resume")
    try:
        dataset = RolloutDataset.open(out)
    except DatasetNotFoundError:
        return
    except (SchemaVersionError, ValueError, OSError) as e:
        raise UsageError(f"cannot resume into {out}: {e}") from e
    lineage = lineage_of(dataset)
    if lineage:
        raise UsageError(
            f"{out} is a derived dataset ({lineage[0].get('operation')} of {lineage[0].get('parent')}), not a "
            "generation run; generate into a new --out (or into its parent)"
        )
    try:
        check_resume_config(dataset, config)
    except ConfigMismatchError as e:
        raise UsageError(str(e)) from e


def _check_existing_prompts(
    out: str, prompts: list[Prompt], task: Task, tokenizer, chat: ChatFormat, *, passes: bool
) -> None:
    """A resume refuses prompts that changed under their id, in any pass of --repeat (see
    :func:`check_resume_prompts`)."""
    try:
        dataset = RolloutDataset.open(out)
    except DatasetNotFoundError:
        return
    try:
        check_resume_prompts(
            dataset, prompts, lambda p: prompt_hash(chat.ids(tokenizer, task.messages(p)), p.label), passes=passes
        )
    except ConfigMismatchError as e:
        raise UsageError(str(e)) from e


def prompts_fingerprint(prompts: list[Prompt]) -> str:
    """Content hash of the whole prompt source (ids, prompts, labels, in order), kept in the run config."""
    h = hashlib.blake2b(digest_size=12)
    for p in prompts:
        h.update(json.dumps([p.prompt_id, p.content, p.label], sort_keys=True, default=str).encode())
        h.update(b"\n")
    return h.hexdigest()


def _exit_code(args: argparse.Namespace, r: RunResult) -> int:
    """The run's exit code; failed prompts within ``--max-failed-prompts`` (and nothing else wrong) are 0."""
    share = len(r.failed) / max(r.prompts_total, 1)
    if r.exit_code == EXIT_FAILURES and r.engine_down is None and r.failed and share <= args.max_failed_prompts:
        print(f"{PROG}: {len(r.failed)} of {r.prompts_total} prompts failed ({share:.2%}), within --max-failed-prompts "
              f"{args.max_failed_prompts:g}: exit 0, the dataset holds the others", file=sys.stderr)
        return 0
    return r.exit_code


def _report(args: argparse.Namespace, r: RunResult) -> None:
    seconds = max(r.seconds, 1e-9)
    rate = f"{r.rows / seconds:.1f} rows/s, {r.response_tokens / seconds:.0f} response tokens/s"
    skipped = f"; {r.prompts_skipped} already there" if r.prompts_skipped else ""
    print(
        f"{PROG}: {r.episodes} of {r.prompts_total} prompts done in {r.seconds:.1f} s{skipped}: "
        f"{r.rows} rows, {r.response_tokens} response tokens ({rate}) -> {args.out}",
        file=sys.stderr,
    )
    if r.rows_by_agent or r.skipped_calls:
        by_agent = ", ".join(f"{agent} {n}" for agent, n in sorted(r.rows_by_agent.items())) or "none"
        line = f"{PROG}: rows by agent: {by_agent}"
        if r.skipped_calls:
            skipped = ", ".join(f"{agent} {n}" for agent, n in sorted(r.skipped_calls.items()))
            line += f"; calls skipped (prompt over the context, --allow-skipped-calls): {skipped}"
        print(line, file=sys.stderr)
    if r.engine_down:
        print(
            f"{PROG}: gave up on the engine: {r.engine_down}; complete prompts are committed; "
            "rerun the same command once it is back",
            file=sys.stderr,
        )
    if r.exit_code == EXIT_INTERRUPTED:
        print(f"{PROG}: interrupted; complete prompts are committed; rerun the same command to finish", file=sys.stderr)
    if r.failed:
        first_id, first = next(iter(r.failed.items()))
        print(
            f"{PROG}: {len(r.failed)} prompts failed (first: {first_id}: {first['error']}); "
            f"ledger {r.ledger}; rerun the same command to retry them",
            file=sys.stderr,
        )
