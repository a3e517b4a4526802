"""What both loops (``rollshard-loop`` and its ``--async`` mode) do with the stage commands they run as child
processes: each stage's flags checked before anything runs, a stage's error line read back, the child tied to the
loop's life, and the loop's own messages."""

from __future__ import annotations

import os
import shlex
import signal
import sys
from pathlib import Path

from rollshard.store.common import EXIT_INTERRUPTED, UsageError
from rollshard.store.models.versions import folder_weight_version

PROG = "rollshard-loop"
PR_SET_PDEATHSIG = 1  # prctl option: the signal a child gets when its parent dies
# Flags the loops set for each stage; given in --generate/--train they would break the round's wiring.
GENERATE_OWNED = ("--engine", "--out", "--seed", "--update-weights", "--weight-version", "--ray")
TRAIN_OWNED = ("--data", "--model", "--out", "--resume", "--no-resume", "--print-config", "--initial-version")


def say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def split_stage_flags(flag: str, values: list[str], owned: tuple[str, ...], *, known: set[str] | None = None) -> list[str]:
    """The flags of one stage; refuses those the loop sets, abbreviated too (argparse takes ``--eng`` for
    ``--engine``), except a flag of the stage's own (``known``) that happens to begin one (``--mode``)."""
    try:
        tokens = [t for v in values for t in shlex.split(v)]
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from e
    for t in tokens:
        name = t.split("=", 1)[0]
        if not name.startswith("--") or name == "--":
            continue
        taken = [o for o in owned if o == name or (o.startswith(name) and (known is None or name not in known))]
        if taken:
            raise UsageError(f"{flag} may not set {taken[0]}: the loop sets it for every round (see --help)")
    return tokens


def train_flags() -> set[str]:
    from rollshard.train.cli import build_parser as train_parser

    return set(train_parser()._option_string_actions)


def check_train_config(train_args: list[str]) -> None:
    """A ``--config`` file of ``--train`` may not set the version a round starts at: each round's checkpoint does
    (a fixed ``trainer.initial_version`` would give every round's steps the same versions)."""
    from rollshard.train.cli import build_parser as train_parser
    from rollshard.train.config import TrainConfig

    path = train_parser().parse_known_args(train_args)[0].config  # as rollshard-train reads it, abbreviated too
    if path is None:
        return
    try:
        config = TrainConfig.from_yaml(path)
    except ValueError:
        return  # rollshard-train says what is wrong with it, in one line
    if config.trainer.initial_version is not None:
        raise UsageError(f"--train's --config {path} sets trainer.initial_version: the loop starts each round "
                         "at its checkpoint's version; remove it from the file")


def sets_final_checkpoint(train_args: list[str]) -> bool:
    """Whether ``--train``'s flags (abbreviated too, as rollshard-train reads them) or its ``--config`` file say what the
    last checkpoint of a round holds (``final_checkpoint``)."""
    import yaml

    from rollshard.train.cli import build_parser as train_parser

    args = train_parser().parse_known_args(train_args)[0]
    if vars(args).get("trainer.final_checkpoint") is not None:  # config flags' dests are section.field (resolve)
        return True
    if args.config is None:
        return False
    try:
        raw = yaml.safe_load(Path(args.config).read_text())
    except (OSError, yaml.YAMLError):
        return False  # rollshard-train says what is wrong with it, in one line
    return isinstance(raw, dict) and isinstance(raw.get("trainer"), dict) and "final_checkpoint" in raw["trainer"]


def last_error(output: str, prog: str) -> str:
    """A stage's error line out of its output (argparse prints its usage first), without the stage's prefix."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if not lines:
        return f"{prog} refused it and said nothing"
    return lines[-1].removeprefix(f"{prog}: error: ")


def die_with_parent(loop_pid: int) -> None:
    """In the child, before exec: SIGKILL when the loop dies (a kill -9 of the loop must not leave a stage running
    beside the rerun that continues it), and SIGINT/SIGTERM at their defaults: a loop started with them ignored (a
    background job of a script, nohup) handles them itself, and the stage must hear the one it forwards."""
    import ctypes

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != loop_pid:  # the loop died between fork and prctl
        os._exit(EXIT_INTERRUPTED)


def policy_version(policy: Path) -> str:
    """The version a policy folder is served as: its checkpoint's, or 0 for a model folder of none."""
    return folder_weight_version(policy) or "0"
