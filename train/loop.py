"""``rollshard-loop``: offline rounds generate -> train -> generate, versions carried, resumable anywhere.

    rollshard-loop --model M --out RUN --rounds 3 --generate "--task toy ..." --train "--lr 5e-3 ..."

Round k generates ``RUN/round_K/data`` with the policy P_k (P_0 = ``--model``, P_k = the checkpoint round k-1
trained), then trains P_k on it (or on the last ``--window`` rounds' datasets, mixed) into
``RUN/round_K/train``, whose checkpoint is P_{k+1}. The stage commands run as child processes
(``python -m rollshard.generate`` / ``rollshard.train``), so generate and train never import each other and
each stage keeps its own resume: a rerun of a generation skips committed prompts, a training run is
restarted with ``--resume``. Versions need no bookkeeping here: a checkpoint records its version, and both
engines serve it as that version (the embedded engine from ``embedded:CKPT``; SGLang servers load it with
``--update-weights CKPT``), so the rows of round k carry v(P_k) and the trainer's staleness filter counts real
updates across the window.

``RUN/loop.json`` holds the settings and what each round finished, written atomically after every stage;
a rerun of the same command continues at the first unfinished stage (a rerun with other settings is refused,
naming the setting; ``--rounds`` may grow). Before anything runs, the ``--train`` and ``--generate`` flags go
through the stages' own parsers and checks (a typo is one line, not a failed stage after a whole generation).
The loop kills its children if it dies (SIGKILL included), and forwards SIGINT/SIGTERM to the running stage,
which commits (generate) or saves (train) before exiting.

Each round trains from P_k with a fresh optimizer (the checkpoint's AdamW state belongs to its own data
stream, which a resume of another dataset would refuse), so a round's last checkpoint holds the model only
(``--final-checkpoint model``, unless ``--train`` says otherwise): a third of the bytes of one with AdamW's state.
Exit status: 0 every round done; 1 a stage failed
(its own message says why); 2 bad input; 130 interrupted (rerun to continue).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import io
import json
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollshard.store.io.dataset import DatasetNotFoundError, RolloutDataset
from rollshard.store.io.destination import check_out_folder
from rollshard.store.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    one_line,
    print_error,
    show_number,
)
from rollshard.store.format.manifest import FAILURE_DIR
from rollshard.store.inspection.stats import dataset_stats
from rollshard.store.models.gguf import is_gguf
from rollshard.store.models.versions import VersionError, folder_weight_version, resolve_model_path
from rollshard.train.checkpoint import latest_checkpoint
from rollshard.train.launcher import Stage, StageLauncher
from rollshard.train.loop_stages import (
    GENERATE_OWNED,
    PROG,
    TRAIN_OWNED,
    check_train_config,
    last_error,
    policy_version,
    say,
    sets_final_checkpoint,
    split_stage_flags,
    train_flags,
)
from rollshard.train.loop_state import LOCK_FILE, LoopState, RoundState
from rollshard.train.loggers import read_metrics

# When each setting is frozen: once a stage of that kind finished, a rerun with another value would mix rounds
# made two ways; before, a stage that failed on it (a typo in --train) is fixed by rerunning with the new value.
FROZEN_BY = {"model": "generated", "engine": "generated", "seed": "generated", "generate": "generated",
             "window": "trained", "train": "trained", "audit": None, "eval": None}  # checks, shaping no row: free
# Frozen as soon as round 0's generation committed rows: a resumed generation checks its own row-shaping flags
# (rollshard-generate names the one that differs), but not which policy the engine serves.
FROZEN_BY_ROWS = ("model",)
AUDIT_OWNED = ("--data", "--model", "--out", "--json")
EVAL_OWNED = ("--model", "--engine", "--out", "--json")
EVAL_FILE = "eval.json"  # what rollshard-generate eval writes in its --out
# What a run folder holds: the rounds and their state, the report; --async: its dataset, training and logs.
RUN_ENTRIES = ("round_*", "loop.json", "report.html", "data", "train", "logs")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Offline RL rounds: generate with the current policy, train on the rows, repeat; versions "
        "carried, resumable (rerun the same command to continue).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, metavar="PATH", help="the policy of round 0 (a model folder or checkpoint)")
    p.add_argument("--out", required=True, metavar="RUN", help="run folder: RUN/round_K/{data,train}, RUN/loop.json")
    p.add_argument("--rounds", type=int, default=3, metavar="N", help="rounds to run (a rerun may raise it)")
    p.add_argument(
        "--engine", default="embedded", metavar="SPEC",
        help="'embedded' (each round's policy in process), or SGLang URL[,URL...] / one sglang-router URL: the "
        "servers load each round's policy with /update_weights_from_disk (paths must be visible to them)",
    )
    p.add_argument(
        "--window", type=int, default=1, metavar="W",
        help="train round k on the datasets of rounds k-W+1..k, mixed with equal weights (pair it with "
        "--train '--max-staleness S')",
    )
    p.add_argument("--seed", type=int, default=0, help="generation seed of round 0; round k uses seed + k")
    p.add_argument(
        "--generate", action="append", default=[], metavar="ARGS",
        help="flags for rollshard-generate, one quoted string (repeatable), e.g. \"--task toy --n-samples 16\"",
    )
    p.add_argument(
        "--train", action="append", default=[], metavar="ARGS",
        help="flags for rollshard-train, one quoted string (repeatable), e.g. \"--lr 5e-3 --num-epochs 3\"",
    )
    p.add_argument(
        "--audit", action="store_true",
        help="before training a round, audit its rows against the policy that generated them (rollshard-train "
        "audit, RUN/round_K/audit.parquet) and stop if they are off it (a wrong temperature, another checkpoint "
        "served): the loop never trains on them",
    )
    p.add_argument(
        "--audit-args", action="append", default=[], metavar="ARGS",
        help="flags for rollshard-train audit, e.g. \"--max-abs-diff 0.05\" for a bf16 engine (repeatable)",
    )
    p.add_argument(
        "--eval", action="append", default=[], metavar="ARGS",
        help="evaluate round 0's model and every round's checkpoint on held-out prompts with rollshard-generate eval "
        "and these flags, e.g. \"--task arithmetic --limit 128 --max-new-tokens 48\" (RUN/round_K/eval*; repeatable)",
    )
    p.add_argument(
        "--no-report", action="store_true",
        help="skip RUN/report.html (rollshard-store report of every round's rows and the last training's metrics)",
    )
    g = p.add_argument_group(
        "asynchronous (--async)",
        "generate and train at once through one dataset: the engine keeps generating while the trainer follows "
        "the dataset (rollshard-train --follow); each checkpoint is pushed to the engine; generation waits when it "
        "runs more than --max-staleness versions ahead of the trainer (train/async_loop.py)",
    )
    g.add_argument("--async", dest="async_mode", action="store_true", help="run generation and training at once")
    g.add_argument("--steps", type=int, metavar="N", help="optimizer steps of the whole run (a rerun may raise it)")
    g.add_argument(
        "--max-staleness", type=int, metavar="ETA",
        help="versions a trained row may lag the policy: generation pauses beyond it, and the trainer drops rows "
        "whose oldest token is older (default: 1)%(default).0s",
    )
    g.add_argument("--update-every", type=int, default=1, metavar="K", help="push the trainer's weights every K steps")
    g.add_argument(
        "--serve-threads", type=int, metavar="N",
        help="torch threads of the embedded engine's process (0: its default, the cores less one) (default: 1)%(default).0s",
    )
    g.add_argument(
        "--train-threads", type=int, default=0, metavar="N",
        help="torch threads of the trainer's process (0: torch's default, every core; the engine's thread shares "
        "one: on 2 cores the trainer's 2 threads beside the engine's one measured faster than 1 + 1)",
    )
    p.add_argument("--dry-run", action="store_true", help="print each stage's command and exit")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--no-progress", action="store_true", help="pass --no-progress to every stage")
    p.add_argument(
        "--fresh-stages",
        action="store_true",
        help="start each stage as a Python process of its own, importing torch and transformers again (about 4 s "
        "a stage on 2 cores), instead of a fork of one process that imported them once",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.async_mode:
        return _main_async(args)
    try:
        loop = Loop.from_args(args)
        loop.check_stage_args()
    except UsageError as e:
        print_error(PROG, e)
        return EXIT_USAGE
    except KeyboardInterrupt:  # while a stage's flags were checked: nothing ran yet
        say("interrupted before round 0; rerun the same command to continue")
        return EXIT_INTERRUPTED
    if args.dry_run:
        for command in loop.dry_run_commands(args.rounds):
            print(shlex.join(command))
        return EXIT_OK
    loop.launcher = StageLauncher(fresh=args.fresh_stages, model=loop.settings.model)
    code = loop.run(args.rounds)
    if code == EXIT_OK and not args.no_report:
        loop.write_report()
    rows = loop.summary()
    if args.json:
        print(json.dumps({"run": str(loop.out), "rounds": rows}, indent=2))
    else:
        print_summary(rows)
    return code


def _main_async(args: argparse.Namespace) -> int:
    from rollshard.train.async_loop import AsyncLoop, print_figures

    try:
        model = _model_folder(args)
        _check_engine_and_out(args)
        loop = AsyncLoop.from_args(args, model)
    except UsageError as e:
        print_error(PROG, e)
        return EXIT_USAGE
    if args.dry_run:
        try:
            groups_per_step = loop.check_stage_args()
        except UsageError as e:
            print_error(PROG, e)
            return EXIT_USAGE
        for command in loop.dry_run_commands(groups_per_step):
            print(shlex.join(command))
        return EXIT_OK
    loop.launcher = StageLauncher(fresh=args.fresh_stages, model=model)
    code = loop.run()
    state = LoopState.read(loop.out)
    figures = state.async_runs[-1] if state is not None and state.async_runs else None
    if code == EXIT_OK and figures is not None:
        if args.json:
            print(json.dumps({"run": str(loop.out), "async": figures}, indent=2))
        else:
            print_figures(figures)
    return code


@dataclass(kw_only=True)
class LoopSettings:
    """The settings of a run of rounds, from its command line; loop.json keeps them (``settings``), and a rerun
    that changes one a finished stage used is refused (:data:`FROZEN_BY`)."""

    model: str  # P_0, a resolved model folder
    engine: str  # 'embedded' or SGLang URL[,URL...]
    window: int  # rounds whose datasets a round trains on
    seed: int  # round k generates with seed + k
    generate: list[str]  # rollshard-generate's flags (the loop's own left out)
    train: list[str]  # rollshard-train's flags
    audit: list[str] | None = None  # rollshard-train audit's flags; None: no audit stage
    eval: list[str] | None = None  # rollshard-generate eval's flags; None: no evaluations

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Loop:
    def __init__(self, out: Path, settings: LoopSettings, rounds: list[RoundState], *, progress: bool):
        self.out, self.settings, self.rounds, self.progress = out, settings, rounds, progress
        self.launcher = StageLauncher(fresh=True)  # main() starts the warm one, once the flags passed
        self._child: Stage | None = None
        self._stop: int | None = None  # the signal that asked the loop to stop
        self._seconds = 0.0  # wall time of the last stage

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Loop:
        if args.rounds < 1 or args.window < 1:
            raise UsageError("--rounds and --window must be >= 1")
        for flag, given in (("--steps", args.steps is not None), ("--update-every", args.update_every != 1),
                            ("--max-staleness", args.max_staleness is not None),
                            ("--serve-threads", args.serve_threads is not None),
                            ("--train-threads", args.train_threads != 0)):
            if given:
                raise UsageError(f"{flag} is for --async runs; rounds run --rounds, each on its own dataset")
        model = Path(_model_folder(args))
        _check_engine_and_out(args)
        generate_args = split_stage_flags("--generate", args.generate, GENERATE_OWNED)
        train_args = split_stage_flags("--train", args.train, TRAIN_OWNED, known=train_flags())
        check_train_config(train_args)
        settings = LoopSettings(
            model=resolve_model_path(model),
            engine=args.engine,
            window=args.window,
            seed=args.seed,
            generate=generate_args,
            train=train_args,
            audit=split_stage_flags("--audit-args", args.audit_args, AUDIT_OWNED) if args.audit else None,
            eval=split_stage_flags("--eval", args.eval, EVAL_OWNED) if args.eval else None,
        )
        # Links resolved, as the checkpoints' paths come back: loop.json keeps paths relative to it, so a run moves.
        out = Path(args.out).resolve()
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {args.out} is a file; the loop needs a folder (a new one, or an earlier run's)")
        loop = cls(out, settings, [], progress=not args.no_progress)
        loop.rounds = loop.reconcile(LoopState.read(out))
        return loop

    def reconcile(self, state: LoopState | None) -> list[RoundState]:
        """The rounds of a run's state, checked against this command's settings. A round whose generation
        committed rows, finished or not, freezes the policy it was given (``FROZEN_BY_ROWS``). A round not yet
        trained whose data folder was deleted (to regenerate it, after a flagged audit) starts over."""
        if state is not None and state.is_async:
            raise UsageError(f"{self.out} is an --async run; rerun it with --async, or choose a new --out")
        rounds = [] if state is None else state.rounds
        for r in rounds:
            if not r.trained and r.generated and self._committed_rows(r.round) is None:
                train = self.round_dir(r.round) / "train"
                if train.exists():  # its resume would continue a training of the deleted rows
                    raise UsageError(f"round {r.round}'s data folder is gone but its training {train} is not; "
                                     "delete that too to generate and train the round anew")
                r.generated, r.data, r.audit = False, None, None
        for key, value in self.settings.to_json().items():
            before = value if state is None else state.settings.get(key)
            if before == value or not FROZEN_BY[key]:
                continue
            done = [r.round for r in rounds if (r.generated if FROZEN_BY[key] == "generated" else r.trained)]
            if key in FROZEN_BY_ROWS:
                done += [r.round for r in rounds if not r.generated and self._committed_rows(r.round)]
            if done:
                k, rows = min(done), FROZEN_BY[key] == "generated"
                # Only rows no training used yet can be made again.
                anew = rows and not any(r.trained for r in rounds)
                hint = f", delete {self.round_dir(k) / 'data'} to generate round {k} anew," if anew else ""
                raise UsageError(
                    f"{self.out} was run with another {key} ({before!r} there, {value!r} now; round {k}'s "
                    f"{'rows' if rows else 'training'} used it); rerun with the same settings to continue{hint} "
                    "or choose a new --out"
                )
        return rounds

    def _committed_rows(self, k: int) -> int | None:
        """Rows committed in round k's dataset; None when it has none (never written, or deleted)."""
        try:
            return RolloutDataset.open(self.round_dir(k) / "data").num_rows or None
        except (DatasetNotFoundError, ValueError, OSError):
            return None

    def check_stage_args(self) -> None:
        """The ``--train`` and ``--generate`` flags through the stages' own parsers and checks, as round 0 would run
        them, before anything is generated: a typo or a value a stage refuses is one line now, not a failed stage
        after a whole generation. The trainer's parser runs here (it is this package's); rollshard-generate checks
        its command itself (``--check-args``, a process of its own: train never imports generate)."""
        from rollshard.train.cli import build_parser as train_parser
        from rollshard.train.config import resolve

        policy = str(self.policy_path(0))
        train = self.train_args(0, policy)
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
                parsed = train_parser().parse_args(train)
            resolve(parsed, require_paths=True)
        except SystemExit as e:  # argparse: its usage and one error line, or the help (exit 0)
            what = last_error(said.getvalue(), "rollshard-train") if e.code else "asks for the help, not a run"
            raise UsageError(f"--train: {what}") from None
        except ValueError as e:
            raise UsageError(f"--train: {one_line(e)}") from e
        check = [sys.executable, "-m", "rollshard.generate", *self.generate_args(0, policy, "0"), "--check-args"]
        done = subprocess.run(check, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=0)
        if done.returncode != 0:
            raise UsageError(f"--generate: {last_error(done.stderr, 'rollshard-generate')}")
        if self.settings.eval is not None:  # eval's own flags, then the batch command's (--check-args)
            check = [*self.eval_command(policy, self.round_dir(0) / "eval_policy"), "--check-args"]
            done = subprocess.run(check, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=0)
            if done.returncode != 0:
                raise UsageError(f"--eval: {last_error(done.stderr, 'rollshard-generate eval')}")

    # ---- paths and commands ------------------------------------------------------------------

    def round_dir(self, k: int) -> Path:
        return self.out / f"round_{k:03d}"

    def policy_path(self, k: int) -> Path:
        """P_k: --model for round 0, else the (resolved) checkpoint round k-1 finished with."""
        return Path(self.settings.model) if k == 0 else self.out / self.rounds[k - 1].checkpoint

    def dry_run_commands(self, rounds: int) -> list[list[str]]:
        """The stages' commands of ``rounds`` rounds, a later round's policy and version named, not known."""
        commands = []
        for k in range(rounds):
            policy = str(self.policy_path(k)) if k == 0 else f"<checkpoint of round {k - 1}>"
            version = None if k == 0 else f"<version of round {k - 1}'s checkpoint>"
            commands.append(self.generate_command(k, policy, version))
            if self.settings.audit is not None:
                commands.append(self.audit_command(k, policy))
            commands.append(self.train_command(k, policy))
        return commands

    def generate_command(self, k: int, policy: str, version: str | None = None) -> list[str]:
        return [sys.executable, "-m", "rollshard.generate", *self.generate_args(k, policy, version)]

    def generate_args(self, k: int, policy: str, version: str | None = None) -> list[str]:
        """rollshard-generate's flags for round k (what the loop's check runs with --check-args before round 0)."""
        engine = self.settings.engine
        if version is None:
            version = self.rounds[k].policy_version if k < len(self.rounds) else policy_version(Path(policy))
        where = (
            ["--engine", f"embedded:{policy}"] if engine == "embedded"
            # A folder without a version of its own (round 0's model) is served as the version the loop names.
            else ["--engine", engine, "--update-weights", policy, "--weight-version", version]
        )  # fmt: skip
        return [
            *where, "--out", str(self.round_dir(k) / "data"), "--seed", str(self.settings.seed + k),
            *self.settings.generate, *self._quiet(),
        ]  # fmt: skip

    def train_command(self, k: int, policy: str) -> list[str]:
        return [sys.executable, "-m", "rollshard.train", *self.train_args(k, policy)]

    def train_args(self, k: int, policy: str) -> list[str]:
        """rollshard-train's flags for round k (what the loop's check parses before round 0, too)."""
        first = max(0, k - self.settings.window + 1)
        data = ",".join(str(self.round_dir(j) / "data") for j in range(first, k + 1))
        out = self.round_dir(k) / "train"
        # Killed after (or during) a save: continue from it. The trainer also repairs a save torn between renames.
        resume = ["--resume"] if (out / "checkpoints").exists() else []
        train = self.settings.train
        # With wandb, each round is a run of its own; name it after the round (every round's folder is `train`).
        if any("wandb" in t for t in train) and not any(t.startswith("--wandb-name") for t in train):
            train = ["--wandb-name", f"{self.out.name}/round_{k:03d}", *train]
        if not sets_final_checkpoint(train):  # the next round starts a fresh optimizer
            train = ["--final-checkpoint", "model", *train]
        return ["--data", data, "--model", policy, "--out", str(out), *resume, *train, *self._quiet()]

    def audit_command(self, k: int, policy: str) -> list[str]:
        return [
            sys.executable, "-m", "rollshard.train", "audit", "--data", str(self.round_dir(k) / "data"),
            "--model", policy, "--out", str(self.round_dir(k) / "audit.parquet"), "--json",
            *self.settings.audit, *self._quiet(),
        ]  # fmt: skip

    def eval_command(self, policy: str, out: Path) -> list[str]:
        """rollshard-generate eval of ``policy`` (embedded), or of what the servers serve once they loaded it."""
        engine = self.settings.engine
        where = ["--model", policy] if engine == "embedded" else ["--engine", engine, "--update-weights", policy]
        return [
            sys.executable, "-m", "rollshard.generate", "eval", *where, "--out", str(out),
            *self.settings.eval, *self._quiet(),
        ]  # fmt: skip

    def _name(self, path: Path) -> str:
        """A path as loop.json keeps it: relative to the run folder when inside it, so a run can be moved."""
        path = Path(path).resolve()
        return str(path.relative_to(self.out)) if path.is_relative_to(self.out) else str(path)

    def _quiet(self) -> list[str]:
        return [] if self.progress else ["--no-progress"]

    # ---- running -----------------------------------------------------------------------------

    def run(self, rounds: int) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        lock = open(self.out / LOCK_FILE, "a")  # held until this process ends: one loop per run folder
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            say(f"another {PROG} is running in {self.out}; wait for it to finish (or stop it), then rerun")
            return EXIT_USAGE
        try:  # what a loop that held the folder until now left, not what this one read before the lock
            self.rounds = self.reconcile(LoopState.read(self.out))
        except UsageError as e:
            lock.close()
            say(str(e))
            return EXIT_USAGE
        self._save()
        previous = {sig: signal.signal(sig, self.forward_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for k in range(rounds):
                code = self._round(k, rounds)
                if code != EXIT_OK:
                    return code
            return EXIT_OK
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            lock.close()

    def _round(self, k: int, rounds: int) -> int:
        if k == len(self.rounds):
            self.rounds.append(RoundState(round=k))
        state = self.rounds[k]
        if state.trained and (self.settings.eval is None or state.checkpoint_eval):
            return EXIT_OK
        if k == 0 and self.settings.eval is not None and not state.eval:
            code, figures = self._eval(k, rounds, self.policy_path(0), self.round_dir(0) / "eval_policy")
            if code != EXIT_OK:
                return code
            state.eval = figures
            self._save()
        if state.trained:
            return self._eval_checkpoint(k, rounds)
        if not state.generated:
            # The policy as it is now: --model may have changed since a generation that committed nothing.
            policy = self.policy_path(k)
            if not policy.is_dir():
                say(f"round {k}: its policy {policy} is missing (a run moved without its checkpoints?); restore it, "
                    "or choose a new --out")
                return EXIT_FAILED
            try:
                state.policy, state.policy_version = self._name(policy), policy_version(policy)
            except VersionError as e:
                say(f"round {k}: {e}")
                return EXIT_FAILED
            self._save()
            code = self.run_stage(k, rounds, "generating", self.generate_command(k, str(policy)))
            if code != EXIT_OK:
                return code
            state.generated, state.data = True, _data_summary(self.round_dir(k) / "data")
            state.seconds["generate"] = self._seconds
            self._save()
        if self.settings.audit is not None and not state.audit:
            code, summary = self._audit(k, rounds)
            if code != EXIT_OK:
                return code
            state.audit = summary
            self._save()
        code = self.run_stage(k, rounds, "training", self.train_command(k, str(self.policy_path(k))))
        if code != EXIT_OK:
            return code
        state.seconds["train"] = self._seconds
        ckpt = latest_checkpoint(self.round_dir(k) / "train")
        if ckpt is None:  # nothing passed the filters: no step, no checkpoint
            say(f"round {k}: training wrote no checkpoint (no step ran: see its output above); check the --train filters")
            return EXIT_FAILED
        state.trained, state.checkpoint, state.checkpoint_version = True, self._name(ckpt.path), ckpt.weight_version
        state.train = _train_summary(self.round_dir(k) / "train")
        self._save()
        return self._eval_checkpoint(k, rounds)

    def _eval_checkpoint(self, k: int, rounds: int) -> int:
        """``--eval``: round k's checkpoint (P_{k+1}) on the held-out prompts; round k+1's policy is that one."""
        state = self.rounds[k]
        if self.settings.eval is None or state.checkpoint_eval:
            return EXIT_OK
        code, figures = self._eval(k, rounds, self.out / state.checkpoint, self.round_dir(k) / "eval")
        if code != EXIT_OK:
            return code
        state.checkpoint_eval = figures
        state.seconds["eval"] = self._seconds
        self._save()
        return EXIT_OK

    def _eval(self, k: int, rounds: int, policy: Path, out: Path) -> tuple[int, dict[str, Any] | None]:
        code = self.run_stage(k, rounds, f"evaluating {self._name(policy)}", self.eval_command(str(policy), out))
        if code != EXIT_OK:
            return code, None
        try:
            return EXIT_OK, json.loads((out / EVAL_FILE).read_text())
        except (OSError, ValueError) as e:
            say(f"round {k}: the evaluation wrote no figures ({e}); rerun the same command to continue")
            return EXIT_FAILED, None

    def _audit(self, k: int, rounds: int) -> tuple[int, dict[str, Any] | None]:
        """The audit stage: (exit code, the overall mismatch of the round's rows). Flagged rows stop the loop."""
        report = self.round_dir(k) / "audit.json"
        code = self.run_stage(k, rounds, "auditing", self.audit_command(k, str(self.policy_path(k))), stdout=report)
        try:  # exit 1 with its summary printed is a flag; exit 1 without one is a failure
            overall = json.loads(report.read_text())["overall"]
        except (OSError, ValueError, KeyError, TypeError):
            overall = None
        if code == EXIT_FAILED and overall is not None:  # flagged: its own line said by how much
            say(f"round {k}: the audit flagged its rows (above; {self.round_dir(k) / 'audit.parquet'}); not training "
                f"on them. Fix the engine's settings, delete {self.round_dir(k) / 'data'} and rerun to generate the "
                "round anew, or accept the mismatch with --audit-args '--max-abs-diff X'")
            return EXIT_FAILED, None
        if code != EXIT_OK or overall is None:
            if code == EXIT_FAILED:
                say(f"round {k}: auditing failed (exit 1, see above); fix it and rerun the same command to continue")
            return code if code != EXIT_OK else EXIT_FAILED, None
        return EXIT_OK, {k: overall[k] for k in ("tokens", "mean", "max", "p99", "ratio_outside", "k3")}

    def run_stage(self, k: int, rounds: int, what: str, command: list[str], stdout: Path | None = None) -> int:
        if self._stop is not None:  # a signal between stages: start no other
            say(f"interrupted before {what} round {k}; rerun the same command to continue")
            return EXIT_INTERRUPTED
        policy = "" if what.startswith("evaluating") else f" with {self.policy_path(k)} (version {self.rounds[k].policy_version})"
        say(f"round {k + 1}/{rounds}: {what}{policy}")
        started = time.perf_counter()
        # The stages' own lines go to stderr with the loop's: stdout is the loop's summary (--json parses).
        try:
            self._child = self.launcher.start(command, stdout=stdout)
            if self._stop is not None:  # a signal while the child was being started: it has not seen it
                self._child.send_signal(self._stop)
            code = self._child.wait()
        finally:
            self._child = None
        self._seconds = round(time.perf_counter() - started, 1)
        if code == EXIT_OK:
            say(f"round {k + 1}/{rounds}: {what} done in {self._seconds:.1f} s")
            return EXIT_OK
        if code in (EXIT_INTERRUPTED, -signal.SIGINT, -signal.SIGTERM):
            say(f"interrupted while {what} round {k}; rerun the same command to continue")
            return EXIT_INTERRUPTED
        if not (what == "auditing" and code == EXIT_FAILED):  # a flagged audit is said by the audit stage
            say(f"round {k}: {what} failed (exit {code}, see above); fix it and rerun the same command to continue")
        return EXIT_USAGE if code == EXIT_USAGE else EXIT_FAILED

    def forward_signal(self, signum: int, frame) -> None:
        """SIGINT/SIGTERM: the stage (in its own process group, so a terminal's Ctrl-C reaches it once, from
        here) commits or saves and exits 130; the loop then stops."""
        self._stop = signum
        child = self._child
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    def _save(self) -> None:
        LoopState(settings=self.settings.to_json(), rounds=self.rounds).write(self.out)

    def write_report(self) -> None:
        """RUN/report.html: reward across the rounds, the last round's rows in detail, its training's metrics. A
        report that cannot be made (no matplotlib) is a warning: the rounds are done."""
        from rollshard.store.inspection import report

        datasets = [str(self.round_dir(s.round) / "data") for s in self.rounds if s.generated]
        last = self.round_dir(self.rounds[-1].round)
        audit = last / "audit.parquet" if self.rounds[-1].audit else None  # its rows beside the trainer's
        try:
            page = report.build(datasets, metrics=str(last / "train" / "metrics.jsonl"), audit=audit and str(audit),
                                held_out=self.held_out())
            path = report.write(page, str(self.out / "report.html"))
        except (ImportError, ValueError, OSError) as e:  # MissingPlotting is an ImportError
            say(f"no report: {e}")
            return
        say(f"report of {len(datasets)} rounds: {path}")

    # ---- summary -----------------------------------------------------------------------------

    def held_out(self) -> list[dict[str, Any]] | None:
        """Per generated round: its rows' reward and the held-out pass@1 of its policy and checkpoint (``--eval``)."""
        rows = self.summary()
        if not any(r["eval"] or r["checkpoint_eval"] for r in rows):
            return None
        score = lambda f: f.get("pass@1") if f else None  # noqa: E731
        return [{"round": r["round"], "train_reward": r["reward_mean"], "policy": score(r["eval"]),
                 "checkpoint": score(r["checkpoint_eval"])} for r in rows]  # fmt: skip

    def summary(self) -> list[dict[str, Any]]:
        """One entry per generated round: reward by agent of its rows, its training's step-0 mismatch."""
        rows = []
        for state in self.rounds:
            if not state.generated:
                continue
            policy_eval = state.eval if state.round == 0 else self.rounds[state.round - 1].checkpoint_eval
            rows.append({
                "round": state.round, "policy_version": state.policy_version,
                **state.data, **(state.train or {}), "audit": state.audit,
                "checkpoint_version": state.checkpoint_version,
                "eval": policy_eval, "checkpoint_eval": state.checkpoint_eval,
                "seconds": state.seconds,
            })  # fmt: skip
        return rows


def _model_folder(args: argparse.Namespace) -> str:
    """--model as a folder (a GGUF file converted once, cached), checked for a readable version."""
    model = Path(args.model)
    if model.is_file() and is_gguf(model):
        try:
            model = Path(resolve_model_path(model))  # converted once, cached; every stage reads the folder
        except ValueError as e:
            raise UsageError(f"--model {args.model}: {e}") from e
    if not model.is_dir():
        raise UsageError(f"--model {args.model}: no such model folder (or .gguf file)")
    try:
        folder_weight_version(model)
    except VersionError as e:
        raise UsageError(f"--model {args.model}: {e}") from e
    return resolve_model_path(model)


def _check_engine_and_out(args: argparse.Namespace) -> None:
    if args.engine != "embedded" and not args.engine.startswith(("http://", "https://")):
        raise UsageError(f"--engine {args.engine!r}: 'embedded' (the policy served by this machine) or SGLang "
                         "URL[,URL...]; the model is --model")
    if "://" in args.out:
        raise UsageError(f"--out {args.out}: the loop runs in a local folder (its datasets and checkpoints live "
                         "there); copy a finished round's data to S3 with any tool")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {args.out} is a file; the loop needs a folder (a new one, or an earlier run's)")
    check_out_folder(out, accepts=RUN_ENTRIES, kind="a rollshard-loop run folder",
                     fix="choose a new or empty folder, or an earlier run's to continue it")


def _data_summary(path: Path) -> dict[str, Any]:
    stats = dataset_stats(RolloutDataset.open(path))
    agents = stats["agents"]
    rows = sum(a["rows"] for a in agents.values())
    reward = sum((a.get("reward_mean") or 0.0) * a["reward_rows"] for a in agents.values())
    reward_rows = sum(a["reward_rows"] for a in agents.values())
    # Prompts a generation left failed (its --max-failed-prompts let it exit 0): one ledger line each.
    failed = sum(len(f.read_text().splitlines()) for f in (path / FAILURE_DIR).glob("*.jsonl"))
    return {
        "rows": rows,
        "failed_prompts": failed,
        "reward_mean": reward / reward_rows if reward_rows else None,
        "reward_by_agent": {name: a.get("reward_mean") for name, a in agents.items()},
    }


def _train_summary(out: Path) -> dict[str, Any]:
    metrics = read_metrics(out)
    first, last = metrics[0], metrics[-1]
    return {
        "steps": len(metrics),
        # The first step's batch, at the weights that generated the round (--audit: every row of it).
        "mismatch_mean": first.get("mismatch/abs_diff_mean"),
        "mismatch_max": first.get("mismatch/abs_diff_max"),
        "last_loss": last.get("loss/total"),
    }


def print_summary(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    agents = sorted({a for r in rows for a in r["reward_by_agent"]})
    agents = agents if len(agents) > 1 else []  # one agent: its reward is the round's
    table = Table(title="rollshard-loop: reward of each round's rows (generated by that round's policy)")
    audited = any(r.get("audit") for r in rows)
    label = "audit |dlogp| mean/max" if audited else "first-step |dlogp| mean/max"
    failed = any(r.get("failed_prompts") for r in rows)
    evaluated = any(r.get("eval") or r.get("checkpoint_eval") for r in rows)
    held_out = ["held-out", "-> held-out"] if evaluated else []
    for name in ("round", "version", "rows", *(["failed prompts"] if failed else []), "reward",
                 *(f"reward {a}" for a in agents), label, "steps", "-> version", *held_out):  # fmt: skip
        table.add_column(name, justify="right")
    for r in rows:
        m = r.get("audit") if audited else {"mean": r.get("mismatch_mean"), "max": r.get("mismatch_max")}
        mismatch = "-" if not m or m.get("max") is None else f"{_sci(m['mean'])} / {_sci(m['max'])}"
        table.add_row(
            str(r["round"]), r["policy_version"], str(r["rows"]),
            *([str(r.get("failed_prompts", 0))] if failed else []), show_number(r["reward_mean"], ".4f"),
            *(show_number(r["reward_by_agent"].get(a), ".4f") for a in agents), mismatch, str(r.get("steps", "-")),
            r.get("checkpoint_version") or "-",
            *([_score(r.get("eval")), _score(r.get("checkpoint_eval"))] if evaluated else []),
        )  # fmt: skip
    Console(width=200).print(table)


def _score(figures: dict[str, Any] | None) -> str:
    """An evaluation's headline: pass@1 (greedy, or the unbiased estimate over its samples)."""
    return "-" if not figures or figures.get("pass@1") is None else f"{figures['pass@1']:.1%}"


def _sci(x: Any) -> str:
    """A mismatch figure; metrics.jsonl writes a non-finite one as a string ("nan")."""
    return f"{x:.1e}" if isinstance(x, (int, float)) else str(x)


if __name__ == "__main__":
    # The module's own instance, as the package's other modules import it.
    from rollshard.train.loop import main as _main

    sys.exit(_main())
