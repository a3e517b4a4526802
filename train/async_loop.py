"""``rollshard-loop --async``: generation and training at once, with the dataset as the queue between them.

    rollshard-loop --async --model M --out RUN --steps 40 --max-staleness 1 --generate "--task toy ..." --train "..."

Three processes run side by side, each with its log under ``RUN/logs/``:

* the engine: ``rollshard-generate serve`` (``--engine embedded``: started here on the newest policy, one torch
  thread by default, ``--serve-threads``) or the SGLang servers of ``--engine URL[,URL...]``;
* the generator: ``rollshard-generate --repeat`` into ``RUN/data``, the prompt source cycled with fresh seeds,
  admitted by AReaL's rule (``--max-ahead ETA --step-episodes B``, generate/admission.py): episode ``i``
  starts only while ``i < (ETA + 1 + v - v0) * B``, ``v`` the version the engine serves, ``B`` the trainer's
  ``--groups-per-step``;
* the trainer: ``rollshard-train --follow`` on ``RUN/data`` into ``RUN/train``, ``--max-steps N``, its weights
  alone every ``--update-every K`` steps (``--export-every K``: ``RUN/train/policy/v_<version>``, no optimizer
  state), a checkpoint every 10 steps (``--train "--save-every S"`` to change it), ``--max-staleness ETA``: rows
  whose oldest token is more than ETA versions behind the policy are dropped (counted in its metrics), from the
  rows' per-token version spans.

This process pushes each new export to the engine (``/update_weights_from_disk`` with its version; the
embedded engine finishes the requests in flight on the old weights, an SGLang server continues them and
reports per-token version spans) and ends the run when the trainer has made its N steps: the generator
commits what it finished and stops, the engine stops.

The proximal policy of the decoupled loss (``--train "--loss-mode decoupled"``) is the trainer's policy
at the start of the step, recomputed (AReaL's choice): each token's behaviour logprob is the one stored
with it, so a row continued across an update carries both versions' logprobs, and the proximal policy is
one policy for the whole batch whatever mix of versions it holds, which keeps the trust region about the
policy being updated rather than about a stale one.

Crash-safe as the rest: every piece resumes on its own (the generator skips committed prompts, the trainer
continues from its checkpoint with its follower's cursor, the engine starts on the newest checkpoint), so
after a kill -9 of any process the same command continues with nothing lost or trained twice. Ctrl-C stops
the three cleanly (exit 130). ``RUN/loop.json`` keeps the settings and, when done, the run's figures.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollshard.store.common import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, UsageError, one_line, progress
from rollshard.store.format.manifest import load_manifests
from rollshard.store.io.storage import Storage
from rollshard.train.checkpoint import latest_checkpoint, latest_policy
from rollshard.train.launcher import Stage, StageLauncher
from rollshard.train.loop_stages import (
    GENERATE_OWNED,
    PROG,
    TRAIN_OWNED,
    check_train_config,
    last_error,
    policy_version,
    say,
    split_stage_flags,
    train_flags,
)
from rollshard.train.loop_state import LOCK_FILE, STATE_FILE, LoopState
from rollshard.train.loggers import read_metrics

POLL_S = 0.05  # how often the loop looks at its children and the trainer's checkpoints
PUSH_TIMEOUT_S = 600.0  # one /update_weights_from_disk (the engine drains its running batch first)
READY = re.compile(r"ready on (http://[\w.\-]+:\d+)")
LOGS = "logs"
COMMIT_INTERVAL_S = 1.0  # the generator's longest wait before it commits what it finished (--commit-interval)
# Flags the async loop sets for the stages (besides the round loop's own).
ASYNC_GENERATE_OWNED = ("--repeat", "--max-ahead", "--step-episodes", "--first-version")
ASYNC_TRAIN_OWNED = ("--follow", "--max-steps", "--export-every", "--max-staleness", "--follow-wait")
SAVE_EVERY = 10  # the trainer's checkpoint cadence unless --train sets --save-every: what a crash makes it redo
FROZEN = ("model", "engine", "seed", "generate", "train", "max_staleness", "update_every")  # threads: free


class PushError(RuntimeError):
    """The engine did not load a policy the trainer wrote."""


@dataclass(kw_only=True)
class AsyncSettings:
    """The settings of an --async run, from its command line; loop.json keeps them (``settings``), and a rerun
    that changes one of :data:`FROZEN` is refused."""

    mode: str = "async"  # what tells an --async run folder from one of rounds
    model: str  # the policy the run starts from, a resolved model folder
    engine: str  # 'embedded' or SGLang URL[,URL...]
    seed: int
    generate: list[str]  # rollshard-generate's flags (the loop's own left out)
    train: list[str]  # rollshard-train's flags
    max_staleness: int  # ETA: versions a trained row may lag the policy
    update_every: int  # push the trainer's weights every K steps
    serve_threads: int  # torch threads of the embedded engine (0: its default)
    train_threads: int  # torch threads of the trainer (0: torch's default)
    steps: int  # optimizer steps of the whole run

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class AsyncLoop:
    def __init__(self, out: Path, settings: AsyncSettings, *, progress: bool, report: bool = True):
        self.out, self.settings, self.progress, self.report = out, settings, progress, report
        self.launcher = StageLauncher(fresh=True)  # the command line's starts the warm one
        self.children: dict[str, Stage] = {}
        self._stop: int | None = None
        self.pushed: str | None = None  # the version the engine serves
        self.timeline: list[dict[str, float]] = []
        self._busy_start: dict[str, float] | None = None
        self._counted = (-1, 0)  # metrics.jsonl's size and lines when last counted

    # ---- settings ----------------------------------------------------------------------------

    @classmethod
    def from_args(cls, args: argparse.Namespace, model: str) -> "AsyncLoop":
        if args.steps is None or args.steps < 1:
            raise UsageError("--async needs --steps N (>= 1): the optimizer steps of the whole run")
        max_staleness = 1 if args.max_staleness is None else args.max_staleness
        serve_threads = 1 if args.serve_threads is None else args.serve_threads
        if min(max_staleness, serve_threads, args.train_threads) < 0 or args.update_every < 1:
            raise UsageError("--max-staleness, --serve-threads and --train-threads must be >= 0, --update-every >= 1")
        for flag, value, default in (("--window", args.window, 1), ("--audit", args.audit, False),
                                     ("--eval", args.eval, [])):  # fmt: skip
            if value != default:
                raise UsageError(f"{flag} is for rounds; --async trains on one live dataset (drop {flag})")
        settings = AsyncSettings(
            model=model,
            engine=args.engine,
            seed=args.seed,
            generate=split_stage_flags("--generate", args.generate, GENERATE_OWNED + ASYNC_GENERATE_OWNED),
            train=split_stage_flags("--train", args.train, TRAIN_OWNED + ASYNC_TRAIN_OWNED, known=train_flags()),
            max_staleness=max_staleness,
            update_every=args.update_every,
            serve_threads=serve_threads,
            train_threads=args.train_threads,
            steps=args.steps,
        )
        check_train_config(settings.train)
        out = Path(args.out).resolve()
        loop = cls(out, settings, progress=not args.no_progress, report=not args.no_report)
        loop.check_state(LoopState.read(out))
        return loop

    def check_state(self, state: LoopState | None) -> None:
        """A rerun continues only with the same settings (``--steps`` may grow)."""
        if state is None:
            return
        if not state.is_async:
            raise UsageError(f"{self.out} holds rounds of the synchronous loop; choose a new --out for --async")
        before, now = state.settings, self.settings.to_json()
        for key in FROZEN:
            if before.get(key) != now[key]:
                raise UsageError(
                    f"{self.out} was run with another {key} ({before.get(key)!r} there, {now[key]!r} now); "
                    "rerun with the same settings to continue, or choose a new --out"
                )

    def check_stage_args(self) -> int:
        """The stages' flags through their own checks before anything starts; returns B (groups per step)."""
        from rollshard.train.cli import build_parser as train_parser
        from rollshard.train.config import resolve

        try:
            config = resolve(train_parser().parse_args(self.train_args()), require_paths=True)
        except SystemExit:
            raise UsageError("--train: rollshard-train refused its flags (run it with them to see why)") from None
        except ValueError as e:
            raise UsageError(f"--train: {one_line(e)}") from e
        check = [sys.executable, "-m", "rollshard.generate", *self.generate_args("http://127.0.0.1:1", 1), "--check-args"]
        done = subprocess.run(check, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=0)
        if done.returncode != 0:
            raise UsageError(f"--generate: {last_error(done.stderr, 'rollshard-generate')}")
        return config.data.groups_per_step

    def dry_run_commands(self, groups_per_step: int) -> list[list[str]]:
        """The three processes' commands (the embedded engine's port is the one it will pick: PORT)."""
        embedded = self.settings.engine == "embedded"
        engine = "http://127.0.0.1:PORT" if embedded else self.settings.engine
        return [
            *([self.serve_command(self.settings.model, "0")] if embedded else []),
            [sys.executable, "-m", "rollshard.generate", *self.generate_args(engine, groups_per_step)],
            [sys.executable, "-m", "rollshard.train", *self.train_args()],
        ]

    # ---- the stages' commands ----------------------------------------------------------------

    @property
    def data(self) -> Path:
        return self.out / "data"

    @property
    def train_out(self) -> Path:
        return self.out / "train"

    def first_version(self) -> int:
        return int(policy_version(Path(self.settings.model)))

    def generate_args(self, engine: str, groups_per_step: int) -> list[str]:
        s = self.settings
        return [
            "--engine", engine, "--out", str(self.data), "--seed", str(s.seed), "--repeat",
            "--max-ahead", str(s.max_staleness), "--step-episodes", str(groups_per_step),
            "--first-version", str(self.first_version()),
            # a shard per step's worth of episodes, or per second: the trainer sees rows as soon as they are done
            "--commit-every", str(groups_per_step), "--commit-interval", str(COMMIT_INTERVAL_S),
            *s.generate, "--no-progress",
        ]  # fmt: skip

    def train_args(self) -> list[str]:
        s = self.settings
        resume = ["--resume"] if (self.train_out / "checkpoints").exists() else []
        return [
            "--data", str(self.data), "--follow", "--model", s.model, "--out", str(self.train_out), *resume,
            "--max-steps", str(s.steps), "--export-every", str(s.update_every), "--save-every", str(SAVE_EVERY),
            "--max-staleness", str(s.max_staleness), *s.train, "--no-progress",
        ]  # fmt: skip

    # ---- running -----------------------------------------------------------------------------

    def run(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        lock = open(self.out / LOCK_FILE, "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            say(f"another {PROG} is running in {self.out}; wait for it to finish (or stop it), then rerun")
            return EXIT_USAGE
        previous = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._save()
            groups_per_step = self.check_stage_args()
            ckpt = latest_checkpoint(self.train_out)
            if ckpt is not None and ckpt.step >= self.settings.steps:  # the trainer saves its last step
                return EXIT_OK
            return self._run(groups_per_step)
        except UsageError as e:
            say(str(e))
            return EXIT_USAGE
        except PushError as e:
            if self._ended("serve"):  # the engine died under the push: say that
                return self._failed("serve", self.children["serve"].poll())
            say(f"{e}; fix it and rerun the same command to continue")
            return EXIT_FAILED
        finally:
            self._stop_children()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            lock.close()

    def _run(self, groups_per_step: int) -> int:
        (self.out / LOGS).mkdir(exist_ok=True)
        started = time.monotonic()
        # The trainer loads while the engine does (it waits for the first commit anyway); the generator once the
        # engine listens.
        self._start("train", [sys.executable, "-m", "rollshard.train", *self.train_args()], env=self._train_env())
        engine = self._start_engine()
        if engine is None:
            return EXIT_INTERRUPTED if self._stop is not None else EXIT_FAILED
        self._start("generate", [sys.executable, "-m", "rollshard.generate", *self.generate_args(engine, groups_per_step)])
        say(f"generating into {self.data} and training {self.settings.steps} steps into {self.train_out} "
            f"(logs in {self.out / LOGS})")
        bar = progress(self.settings.steps, desc="async", unit="step", initial=self._trained_steps(),
                       file=sys.stderr, disable=not self.progress)
        steps = self._trained_steps()
        while True:
            if self._stop is not None:
                self._stop_children(self._stop)
                say("interrupted; rerun the same command to continue")
                return EXIT_INTERRUPTED
            self._push_newest(engine)
            now_steps = self._trained_steps()
            if now_steps != steps:
                bar.update(now_steps - steps)
                steps = now_steps
                self._sample(started, steps)
            for name, child in self.children.items():
                code = child.poll()
                if code is None:
                    continue
                if name == "train" and code == EXIT_OK:
                    bar.close()
                    self._finish(engine, time.monotonic() - started)
                    return EXIT_OK
                if self._stop is not None:
                    break
                bar.close()
                return self._failed(name, code)
            time.sleep(POLL_S)

    def _ended(self, name: str, within_s: float = 5.0) -> bool:
        """Whether child ``name`` has exited (or does within ``within_s``: a connection it dropped as it died)."""
        child = self.children.get(name)
        if child is None:
            return False
        try:
            child.wait(timeout=within_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _failed(self, name: str, code: int) -> int:
        """A child that ended on its own: stop the others and say which, with its log's last lines."""
        self._stop_children()
        say(f"{name} exited with {code} (its log: {self._log_path(name)}{_tail(self._log_path(name))}); "
            "fix it and rerun the same command to continue")
        return EXIT_USAGE if code == EXIT_USAGE else EXIT_FAILED

    def serve_command(self, policy: str, version: str) -> list[str]:
        """The embedded engine's server: ``rollshard-generate serve`` on a free port."""
        command = [sys.executable, "-m", "rollshard.generate", "serve", "--model", policy, "--port", "0",
                   "--weight-version", version, "--seed", str(self.settings.seed)]  # fmt: skip
        if self.settings.serve_threads:
            command += ["--threads", str(self.settings.serve_threads)]
        from rollshard.train.routing import reads_routing  # torch: the loop itself runs without it

        if reads_routing(policy):  # a MoE: the engine returns its routing, the rows store it, the trainer replays it
            command.append("--enable-return-routed-experts")
        return command

    def _start_engine(self) -> str | None:
        """The engine's URL(s): the given SGLang servers (loaded with the newest policy), or a serve child."""
        policy, version = self._newest_policy()
        if self.settings.engine != "embedded":
            self._push(self.settings.engine, policy, version)
            return self.settings.engine
        log = self._log_path("serve")
        start = log.stat().st_size if log.exists() else 0  # an earlier run's lines stay above
        child = self._start("serve", self.serve_command(policy, version))
        while True:  # the server says where it listens once it is ready (or ends)
            ended = child.poll() is not None
            with open(log, "rb") as f:
                f.seek(start)
                found = READY.search(f.read().decode(errors="replace"))
            if found:
                self.pushed = version
                self._busy_start = self._busy(found.group(1))
                return found.group(1)
            if ended or self._stop is not None:
                break
            time.sleep(POLL_S)
        if self._stop is None:
            say(f"the engine did not start (its log: {self._log_path('serve')}{_tail(self._log_path('serve'))})")
        return None

    def _newest_policy(self) -> tuple[str, str]:
        """What the engine starts on: the trainer's newest checkpoint (what it resumes from), else --model."""
        ckpt = latest_checkpoint(self.train_out)
        if ckpt is None:
            return self.settings.model, str(self.first_version())
        return str(ckpt.path), ckpt.weight_version

    def _push_newest(self, engine: str) -> None:
        newest = latest_policy(self.train_out)  # an export (--export-every) or a checkpoint, the newer
        if newest is None or newest[1] == self.pushed:
            return
        self._push(engine, str(newest[0]), newest[1])

    def _push(self, engine: str, path: str, version: str) -> None:
        body = json.dumps({"model_path": path, "weight_version": version}).encode()
        for url in engine.split(","):
            request = urllib.request.Request(
                f"{url.rstrip('/')}/update_weights_from_disk", data=body, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=PUSH_TIMEOUT_S) as answer:
                    ok = json.loads(answer.read()).get("success", False)
            except (urllib.error.URLError, OSError, ValueError) as e:
                if not Path(path).exists():  # the trainer removed it (--keep-last) meanwhile: the next one follows
                    return
                raise PushError(f"the engine at {url} did not load {path}: {' '.join(str(e).split())}") from e
            if not ok and Path(path).exists():
                raise PushError(f"the engine at {url} refused to load {path}")
        self.pushed = version

    def _train_env(self) -> dict[str, str] | None:
        """The trainer's torch threads (``--train-threads``; 0: torch's default, every core)."""
        threads = self.settings.train_threads
        return {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None

    def _start(self, name: str, command: list[str], env: dict[str, str] | None = None) -> Stage:
        log = self._log_path(name)
        child = self.launcher.start(command, stdout=log, stderr=log, append=True, env=env)
        self.children[name] = child
        if self._stop is not None:
            child.send_signal(self._stop)
        return child

    def _log_path(self, name: str) -> Path:
        return self.out / LOGS / f"{name}.log"

    def _stop_children(self, sig: int = signal.SIGTERM) -> None:
        """Generator first (it commits what it finished), then the trainer (it saves), then the engine."""
        for name in ("generate", "train", "serve"):
            child = self.children.get(name)
            if child is not None and child.poll() is None:
                child.send_signal(sig)
                child.wait()

    def _forward(self, signum: int, frame) -> None:
        self._stop = signum

    def _trained_steps(self) -> int:
        """Steps the trainer logged (lines of its metrics.jsonl; counted again only when the file changed)."""
        path = self.train_out / "metrics.jsonl"
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return 0
        if size != self._counted[0]:
            with open(path, "rb") as f:
                self._counted = (size, sum(1 for line in f if line.strip()))
        return self._counted[1]

    # ---- figures -----------------------------------------------------------------------------

    def _sample(self, started: float, steps: int) -> None:
        try:
            rows = sum(s.rows for m in load_manifests(Storage(self.data)) for s in m.shards)
        except (OSError, ValueError):
            rows = None
        self.timeline.append({"seconds": round(time.monotonic() - started, 2), "steps": steps, "rows": rows,
                              "engine_version": self.pushed})  # fmt: skip

    def _busy(self, engine: str) -> dict[str, float] | None:
        try:
            with urllib.request.urlopen(f"{engine}/get_server_info", timeout=10) as answer:
                info = json.loads(answer.read())
            return {"busy": float(info["busy_seconds"]), "up": float(info["uptime_seconds"])}
        except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError):
            return None

    def _finish(self, engine: str, seconds: float) -> None:
        end = self._busy(engine) if self.settings.engine == "embedded" else None
        self._stop_children()
        figures = run_figures(read_metrics(self.train_out), self.data, seconds)
        if end is not None and self._busy_start is not None:
            figures["engine_busy_share"] = round((end["busy"] - self._busy_start["busy"]) /
                                                 max(end["up"] - self._busy_start["up"], 1e-9), 4)
        figures["timeline"] = self.timeline
        self._save(figures)
        if self.report:
            self._write_report(figures)

    def _write_report(self, figures: dict[str, Any]) -> None:
        """RUN/report.html: the rows (reward by weight_version, staleness) and the training's metrics over the steps."""
        from rollshard.store.inspection import report

        try:
            page = report.build([str(self.data)], metrics=str(self.train_out / "metrics.jsonl"), async_run=figures)
            path = report.write(page, str(self.out / "report.html"))
        except (ImportError, ValueError, OSError) as e:  # MissingPlotting is an ImportError
            say(f"no report: {e}")
            return
        say(f"report: {path}")

    def _save(self, figures: dict[str, Any] | None = None) -> None:
        """loop.json: the settings, and the figures of every finished run (this one's added when given)."""
        previous = LoopState.read(self.out) if (self.out / STATE_FILE).exists() else None
        runs = (previous.async_runs if previous is not None else None) or []
        if figures is not None:
            runs = [*runs, figures]
        LoopState(settings=self.settings.to_json(), async_runs=runs).write(self.out)


def run_figures(metrics: list[dict[str, Any]], data: Path, seconds: float) -> dict[str, Any]:
    """What the run did: steps, rows generated and trained, staleness of the trained rows, each side's busy share."""
    hist: collections.Counter = collections.Counter()
    for m in metrics:
        for k, v in m.items():
            if k.startswith("staleness/hist/"):
                hist[k.rsplit("/", 1)[-1]] += int(v)
    waited = sum(m.get("loader/follow_wait_s", 0.0) for m in metrics)
    busy = sum(m.get("perf/step_s", 0.0) for m in metrics) - waited
    rows = sum(s.rows for m in load_manifests(Storage(data)) for s in m.shards)
    return {
        "steps": len(metrics),
        "seconds": round(seconds, 2),
        "steps_per_hour": round(len(metrics) / seconds * 3600, 1) if seconds else None,
        "rows_generated": rows,
        "rows_trained": int(sum(m.get("data/sequences", 0) for m in metrics)),
        "rows_dropped_stale": int(sum(m.get("loader/filtered_rows/stale", 0) for m in metrics)),
        "staleness_hist": dict(sorted(hist.items())),
        "trainer_busy_share": round(busy / seconds, 4) if seconds else None,
        "reward_by_step": [m.get("reward/mean") for m in metrics],
    }


def print_figures(figures: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="rollshard-loop --async")
    for name in ("steps", "seconds", "steps/hour", "rows generated", "rows trained", "dropped stale",
                 "staleness of trained rows", "engine busy", "trainer busy", "reward first -> last 5 steps"):  # fmt: skip
        table.add_column(name, justify="right")
    rewards = [r for r in figures["reward_by_step"] if r is not None]
    mean = lambda xs: f"{sum(xs) / len(xs):.3f}" if xs else "-"  # noqa: E731
    share = lambda x: "-" if x is None else f"{x:.0%}"  # noqa: E731
    table.add_row(
        str(figures["steps"]), f"{figures['seconds']:.0f}", str(figures["steps_per_hour"]),
        str(figures["rows_generated"]), str(figures["rows_trained"]), str(figures["rows_dropped_stale"]),
        " ".join(f"{k}:{v}" for k, v in figures["staleness_hist"].items()) or "-",
        share(figures.get("engine_busy_share")), share(figures.get("trainer_busy_share")),
        f"{mean(rewards[:5])} -> {mean(rewards[-5:])}",
    )  # fmt: skip
    Console(width=200).print(table)


def _tail(path: Path, lines: int = 3) -> str:
    try:
        last = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()][-lines:]
    except OSError:
        return ""
    return ": " + " | ".join(last) if last else ""


