"""The batch runner: episodes of an agent system over prompts, written to a dataset, resumable.

Unit of work and of resume: the *episode* (every row one prompt produces). Finished
episodes go to the writer whole, up to :data:`WRITE_BATCH` of them in one
``write_groups`` call, and shards are committed only between such calls, so a committed
shard never holds part of an episode. A prompt is done when its ``prompt_id`` is in the dataset; a rerun of the
same command skips done prompts and runs the rest. Sample ids and sampling seeds are
functions of (prompt, agent, round, index), so the rerun names and (on a deterministic
engine) samples every row as an uninterrupted run would.

Concurrency: at most ``concurrency`` engine requests in flight (:class:`~.engines.gated.GatedEngine`);
episodes are started while fewer than ``EPISODES_PER_SLOT * ceil(concurrency / calls
per round)`` run, so later rounds (one selector) do not leave request slots idle.

Failures: a transient error (engine, transport, timeout) retries the whole episode with
exponential backoff (:func:`rollshard.store.common.backoff_delay`); an episode that still
fails, or fails with a permanent error (a row breaking an invariant, a prompt longer than
the context), goes to the failure ledger ``DATASET/_failures/<writer_id>.jsonl``
(:mod:`.ledger`: prompt id, error, attempts), rewritten after each failure and at the end to
hold exactly the prompts of this writer still missing. Nothing is dropped silently: a rerun
retries them.

Interrupt (SIGINT/SIGTERM): stop starting episodes, cancel those in flight (a rerun
regenerates them), commit every complete one, and return :data:`EXIT_INTERRUPTED`. The
handlers stay installed until that final commit is done, so a second interrupt cannot
tear it: it only says that the commit is still running; a third raises
KeyboardInterrupt (the open shard is then discarded; committed shards stay).

An engine that stops answering altogether (:class:`EngineUnavailableError`, the SGLang
client's circuit breaker) stops the run the same way: complete episodes committed, the
rest left for a rerun, exit :data:`EXIT_FAILURES` with one line.

Following (a trainer reads the dataset as it is written): the prompts may be an endless iterator
(:func:`~.tasks.schedule.repeat_prompts`, ``--repeat``), taken one at a time; :class:`~.admission.AdmissionGate`
(``--max-ahead``) holds back new episodes while the engine's weight version says the trainer is too far
behind, re-reading it every :data:`GATE_POLL_S` while episodes in flight go on. A run clears its writer's
end-of-run marker (:mod:`rollshard.store.io.live`) before it can commit, and sets it again when it has done every
prompt with none failed (never for an endless run: ``RunnerOptions.mark_complete``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import os
import signal
import sys
import time
from collections import Counter
from typing import Any, Callable, Iterable, Iterator, Sized

import aiohttp

from rollshard.generate.admission import GATE_POLL_S, AdmissionGate, integer_version
from rollshard.generate.agents import AgentSystem, Episode, play
from rollshard.generate.chat import ChatFormat
from rollshard.generate.engines.base import Engine, EngineError, EngineUnavailableError, SamplingParams
from rollshard.generate.engines.gated import GatedEngine
from rollshard.generate.ledger import Ledger, done_prompt_ids, failure_record
from rollshard.generate.rewards import Scorer
from rollshard.generate.tasks import Prompt, Task
from rollshard.store.common import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, backoff_delay, progress
from rollshard.store.io.live import clear_complete, mark_complete
from rollshard.store.format.routing import RoutingShape
from rollshard.store.format.schema import Row, rows_to_table
from rollshard.store.io.writer import ShardWriter

EXIT_FAILURES = EXIT_FAILED  # some prompts failed (the ledger has them)
TRANSIENT_ERRORS = (EngineError, asyncio.TimeoutError, aiohttp.ClientError, ConnectionError, OSError)
# Episodes in flight per request slot's worth of calls: enough that rounds with few calls (one selector)
# and episodes in the same round at once still leave no slot idle (measured in bench_generate.py).
EPISODES_PER_SLOT = 4
WRITE_BATCH = 64  # finished episodes handed to the writer at once (per-call costs amortized)
BACKOFF_MAX_S = 30.0  # retry steps double from RunnerOptions.backoff_s up to this
PROGRESS_EVERY_S = 0.25  # RunnerOptions.on_progress is called at most this often (and at the start and the end)


@dataclasses.dataclass(kw_only=True)
class RunnerOptions:
    concurrency: int = 64
    request_timeout: float | None = 600.0
    retries: int = 2  # extra attempts of an episode after a transient error
    backoff_s: float = 0.5  # the first retry's step (backoff_delay: a wait between half of it and it); doubles
    commit_every: int = 256  # episodes between shard commits
    commit_interval: float = 60.0  # seconds between shard commits
    seed: int = 0
    max_context_len: int | None = None
    allow_skipped_calls: bool = False  # store an episode without its optional calls that do not fit the context
    progress: bool = True
    # Called with (prompts done, prompts total) at the start, as prompts finish (at most every PROGRESS_EVERY_S)
    # and at the end: the Ray driver's one progress bar over all shards (rollshard.generate.ray_run).
    on_progress: Callable[[int, int], None] | None = None
    admission: AdmissionGate | None = None  # --max-ahead: start episodes only within the staleness bound
    mark_complete: bool = True  # set the writer's end-of-run marker after a run that did every prompt


@dataclasses.dataclass
class RunResult:
    exit_code: int
    prompts_total: int = 0  # an endless source: the prompts taken from it (skipped or started)
    prompts_skipped: int = 0  # already in the dataset
    episodes: int = 0
    rows: int = 0
    response_tokens: int = 0
    rows_by_agent: Counter = dataclasses.field(default_factory=Counter)  # of the rows written by this run
    skipped_calls: Counter = dataclasses.field(default_factory=Counter)  # by agent: calls over the context
    failed: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    interrupted: bool = False
    engine_down: str | None = None  # why the engine was given up on (EngineUnavailableError, a gate's version)
    ledger: str | None = None


@dataclasses.dataclass
class _Outcome:
    """A finished episode: its rows and the calls it skipped (by agent)."""

    rows: list[Row]
    skipped: Counter


class Runner:
    """Runs ``system`` over ``prompts`` against ``engine`` into ``writer``."""

    def __init__(
        self,
        *,
        system: AgentSystem,
        task: Task,
        engine: Engine,
        tokenizer,
        sampling: SamplingParams,
        writer: ShardWriter,
        options: RunnerOptions,
        scorer: Scorer | None = None,
        chat: ChatFormat | None = None,
    ):
        self.system = system
        self.scorer = scorer
        self.chat = chat
        self.task = task
        self.engine = GatedEngine(engine, concurrency=options.concurrency, request_timeout=options.request_timeout)
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.writer = writer
        self.options = options
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False
        self._finishing = False  # the final commit has started
        self._signals = 0  # interrupts received
        self._previous_handlers: dict[int, Any] = {}
        self._poll: asyncio.Task | None = None  # reading the engine's version while the admission gate is closed
        self._started = 0

    @property
    def started(self) -> int:
        """Episodes this run has started so far, failed ones too (the admission gate adds the dataset's prompts)."""
        return self._started

    # -- the run ----------------------------------------------------------------------------

    async def run(self, prompts: Iterable[Prompt]) -> RunResult:
        """Every prompt not yet in the dataset. ``prompts``: a list, or an iterator taken one prompt at a time
        (endless with :func:`repeat_prompts`: the run then ends when interrupted or when the engine is down)."""
        start = time.monotonic()
        self._stopping, self._signals, self._finishing = False, 0, False
        self._done = done_prompt_ids(self.writer.storage)  # after the writer adopted its crash orphans
        clear_complete(self.writer.storage, self.writer.writer_id)  # before this run can commit anything
        queue = self._queue(prompts)
        self._ledger = Ledger(self.writer)
        self._pending: list[tuple[Prompt, list[Row]]] = []
        self._since_commit, self._last_commit, self._start = 0, time.monotonic(), start
        self._made_rows = self._made_tokens = 0  # finished, written or not (the progress bar's figures)
        self._progress_done, self._progress_at = self._result.prompts_skipped, -math.inf
        self._in_dataset, self._started = len(self._done), 0  # the admission gate's count: these two added
        self._allowed: int | None = None  # episodes the gate lets start in all; None: the version is not read yet
        self._bar = progress(
            total=self._source_len,
            initial=self._result.prompts_skipped,
            unit="prompt",
            desc="generate",
            disable=not self.options.progress,
        )
        self._report_progress(final=True)
        self._install_signal_handlers()
        try:
            try:
                await self._run_episodes(queue)
            finally:
                pending = [*self._tasks, *([self._poll] if self._poll else [])]
                for task in pending:
                    task.cancel()
                if pending:
                    await asyncio.gather(*pending, return_exceptions=True)
                self._poll = None
                self._bar.close()
            self._finishing = True
            self._maybe_write_and_commit(final=True)  # interrupts are still caught here: nothing tears it
        finally:
            self._remove_signal_handlers()
        self._report_progress(final=True)
        result = self._result
        result.prompts_total = self._total()
        result.ledger = self._ledger.finish(self._done)
        # An interrupt during the final commit is handled after it: the run was still interrupted.
        result.interrupted = (self._stopping or self._signals > 0) and result.engine_down is None
        result.seconds = time.monotonic() - start
        if result.interrupted:
            result.exit_code = EXIT_INTERRUPTED
        elif result.failed or result.engine_down:
            result.exit_code = EXIT_FAILURES
        elif self.options.mark_complete:  # every prompt is in the dataset
            mark_complete(self.writer.storage, self.writer.writer_id, self._complete_info())
        return result

    def _queue(self, prompts: Iterable[Prompt]) -> Iterator[Prompt]:
        """The prompts to run, and the result's counts: a list's done prompts are skipped (and counted) at once,
        an iterator's as they are reached."""
        if isinstance(prompts, Sized):
            todo = [p for p in prompts if p.prompt_id not in self._done]
            self._source_len = len(prompts)
            self._result = RunResult(EXIT_OK, prompts_total=len(prompts), prompts_skipped=len(prompts) - len(todo))
            return iter(todo)
        self._source_len, self._result = None, RunResult(EXIT_OK)
        return self._skip_done(prompts)

    def _skip_done(self, prompts: Iterable[Prompt]) -> Iterator[Prompt]:
        for prompt in prompts:
            if prompt.prompt_id not in self._done:
                yield prompt
                continue
            self._result.prompts_skipped += 1
            self._bar.update(1)
            self._progress_done += 1

    def _total(self) -> int:
        """Prompts of the run: the list's, or those taken from an iterator so far (skipped or started)."""
        return self._source_len if self._source_len is not None else self._result.prompts_skipped + self._started

    async def _run_episodes(self, queue: Iterator[Prompt]) -> None:
        """Keep episodes in flight, as many as the slots and the admission gate allow, until none is left."""
        in_flight_max = EPISODES_PER_SLOT * math.ceil(self.options.concurrency / max(1, self.system.max_parallel_calls))
        order = itertools.count()
        prompt = next(queue, None)
        while True:
            while prompt is not None and not self._stopping and len(self._tasks) < in_flight_max and self._admits():
                task = asyncio.ensure_future(self._episode(prompt, next(order)))
                task.prompt = prompt  # type: ignore[attr-defined]
                self._tasks.add(task)
                self._started += 1
                prompt = next(queue, None)
            waiting = set(self._tasks)
            if prompt is not None and not self._stopping and not self._admits():
                waiting.add(self._poll_version())
            if not waiting:
                return
            finished, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                if task is self._poll:
                    self._read_poll(task)
                    continue
                self._tasks.discard(task)
                if not task.cancelled():
                    self._finished(task.prompt, task.result())  # type: ignore[attr-defined]
            self._maybe_write_and_commit(final=False)

    # -- the admission gate -----------------------------------------------------------------

    def _admits(self) -> bool:
        """Whether one more episode may start (always, without a gate)."""
        gate = self.options.admission
        return gate is None or (self._allowed is not None and self._in_dataset + self._started < self._allowed)

    def _poll_version(self) -> asyncio.Task:
        """The task reading the engine's version for the closed gate: at once the first time, then every
        GATE_POLL_S (one at a time)."""
        if self._poll is None:
            delay = 0.0 if self._allowed is None else GATE_POLL_S
            self._poll = asyncio.ensure_future(self._read_version(delay))
        return self._poll

    async def _read_version(self, delay: float) -> int | None:
        """The engine's weight version as an integer; None after stopping the run when there is none to read."""
        await asyncio.sleep(delay)
        try:
            info = await self.engine.model_info()
            return integer_version(info.get("weight_version"))
        except (ValueError, *TRANSIENT_ERRORS) as e:  # gone, or serving a version the gate cannot count
            self._engine_down(e)
            return None

    def _read_poll(self, task: asyncio.Task) -> None:
        self._poll = None
        version = None if task.cancelled() else task.result()
        if version is not None:
            self._allowed = self.options.admission.allowed(version)

    def _complete_info(self) -> dict[str, Any]:
        """What the end-of-run marker says: this writer's rows and groups in all (its manifest), this run's
        episodes and rows."""
        shards = self.writer.committed_shards
        return {
            "rows": sum(s.rows for s in shards),
            "groups": sum(s.groups for s in shards),
            "run_episodes": self._result.episodes,
            "run_rows": self._result.rows,
        }

    def _finished(self, prompt: Prompt, outcome: _Outcome | dict[str, Any] | None) -> None:
        if outcome is None:  # given up with the engine: not a failure of this prompt, a rerun does it
            return
        if isinstance(outcome, _Outcome):
            self._pending.append((prompt, outcome))
            self._made_rows += len(outcome.rows)
            self._made_tokens += sum(len(row.response_tokens) for row in outcome.rows)
        else:
            self._fail(prompt, outcome)
        elapsed = max(time.monotonic() - self._start, 1e-9)
        self._bar.set_postfix(
            rows=self._made_rows, tok_s=f"{self._made_tokens / elapsed:.0f}", failed=len(self._result.failed),
            refresh=False,
        )
        self._bar.update(1)
        self._progress_done += 1
        self._report_progress(final=False)

    def _report_progress(self, *, final: bool) -> None:
        hook, now = self.options.on_progress, time.monotonic()
        if hook is not None and (final or now - self._progress_at >= PROGRESS_EVERY_S):
            self._progress_at = now
            hook(self._progress_done, self._total())

    def _fail(self, prompt: Prompt, failure: dict[str, Any]) -> None:
        self._result.failed[prompt.prompt_id] = failure
        self._ledger.record(prompt.prompt_id, failure)

    def _maybe_write_and_commit(self, *, final: bool) -> None:
        """Hand finished episodes to the writer in batches; commit on the episode or time budget."""
        o = self.options
        commit_due = self._since_commit + len(self._pending) >= o.commit_every or (
            time.monotonic() - self._last_commit >= o.commit_interval
        )
        if final or commit_due or len(self._pending) >= WRITE_BATCH:
            self._write_pending()
        if self._since_commit and (final or commit_due):
            self.writer.commit()
            self._since_commit, self._last_commit = 0, time.monotonic()

    def _write_pending(self) -> None:
        """One ``write_groups`` call for many whole episodes; a shard commit never falls inside one."""
        batch, self._pending = self._pending, []
        if not batch:
            return
        try:
            self.writer.write_groups(rows_to_table([row for _, out in batch for row in out.rows]))
            written = batch
        except ValueError:  # a row breaks the schema or an invariant: find the episode, write the others
            written = []
            for prompt, out in batch:
                try:
                    self.writer.write_groups(rows_to_table(out.rows))  # validates every row before buffering any
                    written.append((prompt, out))
                except ValueError as e:
                    self._fail(prompt, failure_record(e, 1))
        r = self._result
        for prompt, out in written:
            r.episodes += 1
            r.rows += len(out.rows)
            r.response_tokens += sum(len(row.response_tokens) for row in out.rows)
            r.rows_by_agent.update(row.agent for row in out.rows)
            r.skipped_calls.update(out.skipped)
            self._done.add(prompt.prompt_id)
        self._since_commit += len(written)

    async def _episode(self, prompt: Prompt, priority: int) -> _Outcome | dict[str, Any] | None:
        """The episode's rows, a failure record after the last attempt, or None when the engine is down."""
        attempts = self.options.retries + 1
        engine = self.engine.for_episode(priority)
        for attempt in range(attempts):
            episode = Episode(
                prompt=prompt,
                task=self.task,
                engine=engine,
                tokenizer=self.tokenizer,
                sampling=self.sampling,
                seed=self.options.seed,
                attempt=attempt,
                max_context_len=self.options.max_context_len,
                allow_skip=self.options.allow_skipped_calls,
                system=self.system.name,
                scorer=self.scorer,
                chat=self.chat,
                routing=RoutingShape.from_config(self.writer.config) if self.sampling.return_routed_experts else None,
            )
            try:
                rows = await play(self.system, episode)
                if not rows:
                    raise ValueError(f"agent system {self.system.name!r} produced no rows")
                return _Outcome(rows, episode.skipped)
            except EngineUnavailableError as e:
                self._engine_down(e)
                return None
            except TRANSIENT_ERRORS as e:
                error = e
                if attempt + 1 < attempts:
                    await asyncio.sleep(backoff_delay(attempt, self.options.backoff_s, BACKOFF_MAX_S))
            except Exception as e:  # permanent (ContextFullError, RewardError, a plugin's rows): recorded, not retried
                return failure_record(e, attempt + 1)
        return failure_record(error, attempts)

    def _engine_down(self, error: Exception) -> None:
        """Stop as on an interrupt: nothing more can be generated, and retrying every prompt would only wait."""
        if self._result.engine_down is None:
            self._result.engine_down = " ".join(str(error).split())
            self._stop()

    # -- interrupt --------------------------------------------------------------------------

    def _stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        if self._poll is not None:
            self._poll.cancel()

    def _interrupt(self) -> None:
        if not self._stopping and not self._finishing:
            n = sum(1 for t in self._tasks if not t.done())
            _say(f"stopping: committing the complete prompts; the {n} in flight are left for a rerun")
        self._stop()

    def _on_signal(self, signum: int, frame) -> None:
        """A plain signal handler (not the event loop's): it runs even while the final commit blocks the loop,
        and it never raises into that commit but at the third interrupt."""
        self._signals += 1
        if self._signals == 1:
            self._loop.call_soon_threadsafe(self._interrupt)
        elif self._signals == 2:
            _say("still committing the complete prompts; interrupt once more to quit without them", raw=True)
        else:
            raise KeyboardInterrupt

    def _install_signal_handlers(self) -> None:
        self._loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: the caller handles signals
                pass

    def _remove_signal_handlers(self) -> None:
        for sig, previous in self._previous_handlers.items():
            signal.signal(sig, previous)
        self._previous_handlers.clear()


def _say(message: str, *, raw: bool = False) -> None:
    """One line on stderr; ``raw`` from a signal handler, where print() may re-enter a half-written buffer."""
    line = f"rollshard-generate: {message}\n"
    if not raw:
        print(line, end="", file=sys.stderr, flush=True)
        return
    try:  # never raise out of a signal handler: it would land in whatever the main thread is doing
        os.write((sys.__stderr__ or sys.stderr).fileno(), line.encode())
    except (OSError, ValueError, AttributeError):
        pass
