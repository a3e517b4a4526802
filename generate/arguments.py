"""``rollshard-generate``'s command line: every flag, its default and its help, declared once.

:func:`build_parser` only parses; :meth:`rollshard.generate.config.GenerateConfig.from_args` checks the values and
resolves the defaults that depend on others (the run's settings are read from the config, never from the
Namespace).
"""

from __future__ import annotations

import argparse

from rollshard.generate.admission import GATE_POLL_S
from rollshard.generate.agents import SYSTEMS
from rollshard.generate.rewards import add_reward_arguments
from rollshard.generate.tasks import TASKS

PROG = "rollshard-generate"
SUPPORT_MODES = ("auto", "on", "off")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Generate rollouts with an agent system into a rollshard dataset (resumable: rerun to continue). "
        "Subcommands: `serve` (the embedded engine behind SGLang's HTTP API), `rescore` (new rewards for a stored "
        "dataset, no engine), `eval` (a model on held-out prompts: pass@k), `init-model` (a tiny local model, or the real "
        "SmolLM2-135M-Instruct).",
    )
    _add_what_to_run(p)
    _add_sampling(p)
    _add_running(p)
    _add_asynchronous(p)
    _add_cluster(p)
    return p


def _add_what_to_run(p: argparse.ArgumentParser) -> None:
    """The engine, the agent system, the task, the prompts and where the rows go."""
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


def _add_sampling(p: argparse.ArgumentParser) -> None:
    """How each answer is sampled."""
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


def _add_running(p: argparse.ArgumentParser) -> None:
    """How the run proceeds: concurrency, retries, shards, checks."""
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


def _add_asynchronous(p: argparse.ArgumentParser) -> None:
    """Generating for a trainer that follows --out as it is written (rollshard-loop --async)."""
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


def _add_cluster(p: argparse.ArgumentParser) -> None:
    """Running the shards as Ray tasks."""
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
