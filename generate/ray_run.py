"""``rollshard-generate --ray [ADDRESS] --num-shards n``: the n shards of a run as Ray tasks, one dataset.

Each task runs this same command for its shard (``--shard-index i --num-shards n``, writer
``gen-i-of-n``), so everything the single-host command guarantees holds per task: the row
invariants, the identity and settings checks of a resume, the failure ledger, whole episodes
per commit. The driver checks the arguments, the prompt source and the dataset's settings
once, before any task starts (the one-line usage errors of the command), then:

* submits the n tasks (``num_cpus=1`` each) and shows one progress bar over all of them: each
  task reports (prompts done, prompts of its shard) to a small actor the driver reads;
* reports a task that died (its worker killed, its node lost) or ended with failed prompts in
  one line, and reruns it, up to ``--ray-retries`` times: the rerun resumes the shard from its
  committed rows and retries its ledgered prompts, so nothing is lost or doubled;
* prints each shard's summary line and one line for the dataset, and exits as the command does
  (0 all prompts done; 1 a shard still failing after its reruns; 2 a usage error in a task,
  not rerun; 130 interrupted).

Rerunning the same command resumes the whole run. The tasks get plain arguments (the command
line), never rows: rows go from each task straight to the dataset, so ``--out`` must be a path
every node sees (a shared filesystem) or a pyarrow filesystem URI. Without ADDRESS, a Ray
cluster of this machine alone is started for the run and stopped after it, bound to 127.0.0.1
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: Ray then keeps every server on the loopback address).

Not Ray Data's SGLang stage: it returns token ids without their logprobs, the loss this
project exists to prevent (slime #1976).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import signal
import socket
import sys
import time
from typing import Any

from rollshard.generate.arguments import PROG
from rollshard.generate.config import GenerateConfig
from rollshard.generate.inputs import load_inputs
from rollshard.generate.resume import ExistingDataset
from rollshard.generate.run import main as run_main
from rollshard.generate.run_config import run_config
from rollshard.generate.runner import EXIT_FAILURES, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from rollshard.store.common import UsageError, progress
from rollshard.store.io.dataset import DatasetNotFoundError, RolloutDataset

INSTALL_HINT = "pip install 'rollshard[ray]' (or bash scripts/setup.sh, which installs it)"
ADDRESS = re.compile(r"^(auto|local|ray://[\w.\-]+:\d+|[\w.\-]+:\d+)$")
CONNECT_TIMEOUT_S = 10.0  # a TCP answer from the cluster's address, before ray.init
POLL_S = 0.5  # how often the driver redraws the progress bar while it waits for tasks
CANCEL_WAIT_S = 120.0  # after Ctrl-C, how long the driver waits for the tasks to commit and stop
REPORT_LINES = 20  # of a task's stderr kept in its result


class ProgressBoard:
    """Prompts done and prompts in total, per shard; the driver's one bar is their sum (a Ray actor)."""

    def __init__(self) -> None:
        self.done: dict[int, int] = {}

    def update(self, shard: int, done: int, total: int) -> None:
        self.done[shard] = done  # absolute: a rerun of the shard starts again from what it has committed

    def snapshot(self) -> int:
        return sum(self.done.values())


def run_shard(argv: list[str], shard: int, num_shards: int, board) -> dict[str, Any]:
    """One Ray task: the command for shard ``shard`` of ``num_shards``; returns its exit code and summary lines."""
    captured = io.StringIO()

    def report(done: int, total: int) -> None:
        board.update.remote(shard, done, total)  # fire and forget

    task_argv = [*argv, "--ray-task", "--shard-index", str(shard), "--num-shards", str(num_shards), "--no-progress"]
    with contextlib.redirect_stderr(_Tee(captured, sys.stderr)):
        code = run_main(task_argv, progress=report)
    lines = [line for line in captured.getvalue().splitlines() if line.startswith(f"{PROG}:")]
    return {"shard": shard, "exit_code": code, "lines": lines[-REPORT_LINES:], "pid": os.getpid()}


class _Tee(io.TextIOBase):
    """Writes to both: the task's summary for the driver, and the worker's own log."""

    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()


def launch(argv: list[str], config: GenerateConfig, existing: ExistingDataset) -> int:
    """The driver (see the module docstring); UsageError for what the user can fix, before any task runs."""
    address = _check_address(config.ray)
    runtime_env = _runtime_env(config.ray_runtime_env)
    prompts_total = _precheck(config, existing)
    ray = _import_ray(local=address == "local")
    start = time.monotonic()
    _init(ray, address, config.num_shards, runtime_env)
    previous = signal.signal(signal.SIGTERM, _terminate)  # SIGTERM stops the run as Ctrl-C does
    try:
        return _drive(ray, argv, config, prompts_total, start)
    finally:
        signal.signal(signal.SIGTERM, previous)
        ray.shutdown()


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt


def _check_address(address: str) -> str:
    """The address, checked for its form, and a host:port for an answer: ray.init waits minutes on a port where
    nothing listens."""
    address = address.strip()
    if not ADDRESS.match(address):
        raise UsageError(
            f"--ray {address!r}: expected a Ray cluster address (host:port, auto, ray://host:port), or no value for a "
            "cluster of this machine"
        )
    if address not in ("auto", "local"):
        host, _, port = address.removeprefix("ray://").rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as e:
            raise UsageError(
                f"--ray {address}: nothing answers there ({e}); start the cluster (`ray start --head`) or fix the address"
            ) from e
    return address


def _runtime_env(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        env = json.loads(text)
    except ValueError as e:
        raise UsageError(f"--ray-runtime-env is not JSON: {e}") from e
    if not isinstance(env, dict):
        raise UsageError(f"--ray-runtime-env must be a JSON object, got {type(env).__name__}")
    return env


def _precheck(config: GenerateConfig, existing: ExistingDataset) -> int:
    """The checks the command makes before it reaches an engine, made once here: a bad prompt source, plugin or
    resume is one line from the driver, not n task failures. Returns the prompts of the run (every shard's)."""
    inputs = load_inputs(config)
    try:
        existing.check_run_config(run_config(config, inputs, config.sampling_params()))
    finally:
        asyncio.run(inputs.scorer.close())
    return inputs.prompts_total


def _import_ray(*, local: bool):
    if local:  # before ray is imported: it reads these at import
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # node address 127.0.0.1: loopback only
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
    except ImportError as e:
        raise UsageError(f"--ray needs Ray, which is not installed: {INSTALL_HINT}") from e
    return ray


def _init(ray, address: str, num_shards: int, runtime_env: dict[str, Any] | None) -> None:
    import logging

    options: dict[str, Any] = {
        "log_to_driver": False,  # each task's summary comes back with its result; its full log stays on its node
        "logging_level": logging.WARNING,
        "runtime_env": runtime_env,
    }
    if address == "local":
        # Tasks wait on their engine most of the time: as many slots as shards, however few cores.
        options.update(address="local", num_cpus=max(num_shards, os.cpu_count() or 1), include_dashboard=False)
    else:
        options["address"] = address
    try:
        ray.init(**options)
    except (ConnectionError, RuntimeError, ValueError, TimeoutError) as e:
        where = "a Ray cluster on this machine" if address == "local" else f"the Ray cluster at {address}"
        reason = " ".join(str(e).split())
        raise UsageError(f"cannot start or reach {where}: {reason}; check --ray (start one with `ray start --head`)") from e


def _drive(ray, argv: list[str], config: GenerateConfig, prompts_total: int, start: float) -> int:
    n, retries = config.num_shards, config.ray_retries
    board = ray.remote(num_cpus=0)(ProgressBoard).remote()
    task = ray.remote(num_cpus=1, max_retries=0)(run_shard)  # reruns are ours: each one reported
    pending: dict[Any, tuple[int, int]] = {}  # ref -> (shard, attempt)
    results: dict[int, tuple[dict[str, Any] | None, str | None, int]] = {}  # shard -> (result, problem, attempts)

    def submit(shard: int, attempt: int) -> None:
        pending[task.remote(argv, shard, n, board)] = (shard, attempt)

    for shard in range(n):
        submit(shard, 1)
    bar = progress(total=prompts_total, unit="prompt", desc=f"generate ({n} Ray tasks)", disable=not config.progress)
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
            bar.n = ray.get(board.snapshot.remote())
            bar.refresh()
            for ref in ready:
                shard, attempt = pending.pop(ref)
                out, problem = _outcome(ray, ref)
                if problem is not None and attempt <= retries:
                    bar.write(
                        f"{PROG}: shard {shard} of {n} failed (attempt {attempt} of {retries + 1}): {problem}; "
                        "rerunning it (it resumes from its committed rows)",
                        file=sys.stderr,
                    )
                    submit(shard, attempt + 1)
                else:
                    results[shard] = (out, problem, attempt)
    except KeyboardInterrupt:
        bar.close()
        return _interrupt(ray, pending)
    bar.close()
    return _report(config, prompts_total, results, time.monotonic() - start)


def _outcome(ray, ref) -> tuple[dict[str, Any] | None, str | None]:
    """A finished task's result, and why it needs a rerun (None: it does not)."""
    try:
        out = ray.get(ref)
    except ray.exceptions.RayError as e:  # the worker died, the node was lost, the task raised
        lines = [line for line in str(e).splitlines() if line.strip()]
        return None, f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    if out["exit_code"] == EXIT_FAILURES:
        return out, out["lines"][-1] if out["lines"] else f"exit status {out['exit_code']}"
    return out, None


def _interrupt(ray, pending: dict[Any, tuple[int, int]]) -> int:
    """Ctrl-C: each task is interrupted as the command is (it commits its complete prompts), then waited for."""
    print(f"{PROG}: stopping {len(pending)} Ray tasks: each commits its complete prompts", file=sys.stderr)
    for ref in pending:
        ray.cancel(ref)
    ray.wait(list(pending), num_returns=len(pending), timeout=CANCEL_WAIT_S)
    print(f"{PROG}: interrupted; rerun the same command to continue", file=sys.stderr)
    return EXIT_INTERRUPTED


def _report(
    config: GenerateConfig, prompts_total: int, results: dict[int, tuple[dict[str, Any] | None, str | None, int]],
    seconds: float,
) -> int:
    n = config.num_shards
    codes = []
    for shard in range(n):
        out, problem, attempts = results[shard]
        prefix = f"{PROG}: shard {shard} of {n}:"
        if out is None:
            print(f"{prefix} failed after {attempts} attempts: {problem}", file=sys.stderr)
            codes.append(EXIT_FAILURES)
            continue
        for line in out["lines"]:
            print(f"{prefix} {line[len(PROG) + 2:]}", file=sys.stderr)
        codes.append(out["exit_code"])
    try:
        dataset = RolloutDataset.open(config.out)
        shards = dataset.shards
        rows, tokens = sum(s.rows for s in shards), sum(s.response_tokens for s in shards)
        prompts = len(set(dataset.read(columns=["prompt_id"]).column("prompt_id").to_pylist())) if shards else 0
    except DatasetNotFoundError:
        rows = tokens = prompts = 0
    rate = f"{rows / max(seconds, 1e-9):.1f} rows/s, {tokens / max(seconds, 1e-9):.0f} response tokens/s"
    print(
        f"{PROG}: {n} Ray tasks in {seconds:.1f} s: {config.out} holds {prompts} of {prompts_total} prompts, "
        f"{rows} rows, {tokens} response tokens ({rate} over the whole run)",
        file=sys.stderr,
    )
    for code in (EXIT_INTERRUPTED, EXIT_FAILURES, EXIT_USAGE):
        if code in codes:
            return code
    return EXIT_OK
