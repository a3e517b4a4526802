"""Scoring rows: the task's verifier, a user reward function (``--reward``), or a remote one (``--reward-url``).

A :class:`Scorer` turns one row and the text its agent system verifies (the last model
turn; ``multi_agent``: the parsed answer) into a :class:`Verdict`. Agent systems apply their
reward rule to whole episodes through it (:meth:`AgentSystem.score`), during generation
and in ``rollshard-generate rescore`` alike, and the input a scorer sees is built from the
row alone (:meth:`Sample.of`): rescoring stored rows gives what generating them gave.

A user reward function takes one :class:`Sample` and returns a float, or a dict
``{"reward": float, "correct": bool (optional), ...}`` whose other keys are kept in the
row's ``metadata.verdict``; it may be ``async``. ``correct`` (what the multi-agent selector
rule reads) defaults to ``reward >= 1``. A function sees the row's metadata without what
scoring writes there (:data:`SCORER_KEYS`), as a copy. Sync functions run on daemon threads,
so a slow one does not stall the engine's requests; at most ``concurrency`` calls run at
once, each within ``timeout`` seconds (a sync call that times out keeps its thread, and its
slot, until it returns). A task's verifier runs inline: it is meant to be a cheap function of
strings; put anything slow behind ``--reward``.

A function that raises, returns a non-number, NaN or an infinity, or does not return in
time fails its episode with :class:`RewardError` (the function's error in the message): the
prompt goes to the failure ledger whole, never a half-scored episode, and a rerun retries it.

Remote rewards (:class:`HttpScorer`): ``POST URL`` with the sample as a JSON object;
the answer is a number or the dict above. Connection errors and 5xx answers are retried
(3 attempts, backoff steps of 0.5 s doubling, each wait jittered between half the step and the
step: :func:`rollshard.store.common.backoff_delay`); a 4xx answer or a malformed body fails the episode.
Before the first prompt the run probes the URL (:meth:`Scorer.probe`): a ``GET``, with the
same retries, that a server must answer on that route. Any answer but a missing route (404,
410), a refusal (401, 403) or a server error passes: a POST-only route answers 405, and a
probe never asks for a reward (a GET computes none, and a made-up sample could be scored).
"""

from __future__ import annotations

import abc
import asyncio
import copy
import dataclasses
import inspect
import json
import math
import numbers
import threading
from typing import Any, Callable

import numpy as np

from rollshard.generate.tasks.base import Task
from rollshard.generate.tasks.verifiers import Verdict
from rollshard.store.common import backoff_delay, one_line
from rollshard.store.format.schema import Row

DEFAULT_CONCURRENCY = 32
DEFAULT_TIMEOUT_S = 60.0
HTTP_ATTEMPTS = 3
HTTP_BACKOFF_S = 0.5  # the first retry's backoff step (store's backoff_delay: waits between half of it and it)
HTTP_BACKOFF_MAX_S = 30.0  # the step's cap (with HTTP_ATTEMPTS 3 the steps are 0.5 and 1 s: it never binds)
CORRECT_AT = 1.0  # a user reward without "correct" counts as correct at this reward or above
# Answers to the probe's GET that every POST of the run would get too: no such route, or not allowed.
PROBE_REFUSED = frozenset({401, 403, 404, 410})
FLOAT32_MAX = float(np.finfo(np.float32).max)  # rewards are stored as float32
# Row metadata keys that scoring writes (rollshard.generate.agents): not part of what a reward function is given.
SCORER_KEYS = ("verdict", "reward_raw", "episode_weight", "selector_right")


class RewardError(RuntimeError):
    """A reward could not be computed for a row; its episode fails (permanent: not retried in the run)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample:
    """What a reward function sees of one row."""

    sample_id: str
    prompt_id: str
    group_id: str
    agent: str
    round: int
    prompt_text: str  # the rendered prompt (chat template applied), as sent
    prompt_tokens: list[int]
    response: str  # the text the agent system verifies: the last model turn (multi_agent: the parsed answer)
    response_text: str  # the whole response (every turn and environment text)
    response_tokens: list[int]
    label: Any  # the prompt's label (None when the source has none)
    metadata: dict[str, Any]  # the row's metadata (task, system, turns, agent-system fields)
    status: str
    finish_reason: str | None

    @classmethod
    def of(cls, row: Row, text: str) -> "Sample":
        # A copy without what scoring writes (a verdict, the episode weight): a function sees the same metadata
        # when it scores a row at generation and when it rescores the stored row, and cannot edit the row's.
        meta = {k: v for k, v in copy.deepcopy(metadata_of(row)).items() if k not in SCORER_KEYS}
        return cls(
            sample_id=row.sample_id,
            prompt_id=row.prompt_id,
            group_id=row.group_id,
            agent=row.agent,
            round=int(row.round),
            prompt_text=row.prompt_text or "",
            prompt_tokens=_ints(row.prompt_tokens),
            response=text,
            response_text=row.response_text or "",
            response_tokens=_ints(row.response_tokens),
            label=meta.get("label"),
            metadata=meta,
            status=getattr(row.status, "value", row.status),
            finish_reason=row.finish_reason,
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _ints(values) -> list[int]:
    """Python ints (rows read back from a shard hold numpy arrays)."""
    return values.tolist() if hasattr(values, "tolist") else list(values)


def metadata_of(row: Row) -> dict[str, Any]:
    """A row's metadata as a dict (rows read back from a shard hold it as JSON text)."""
    meta = row.metadata
    if meta is None:
        return {}
    return json.loads(meta) if isinstance(meta, str) else meta


def to_verdict(value: Any, where: str) -> Verdict:
    """A reward function's answer as a Verdict; :class:`RewardError` for anything else (module docstring)."""
    if isinstance(value, Verdict):
        reward, correct, answer, detail = value.reward, value.correct, value.answer, dict(value.detail)
    elif isinstance(value, dict):
        if "reward" not in value:
            raise RewardError(f"{where} returned a dict without 'reward' (keys: {', '.join(map(str, value))})")
        extra = {k: v for k, v in value.items() if k not in ("reward", "correct", "answer")}
        reward, correct, answer, detail = value["reward"], value.get("correct"), value.get("answer"), extra
    else:
        reward, correct, answer, detail = value, None, None, {}
    if isinstance(reward, (bool, np.bool_)) or not isinstance(reward, numbers.Real):
        raise RewardError(f"{where} returned {type(reward).__name__} {reward!r} as the reward; return a float")
    try:
        reward = float(reward)
    except OverflowError:
        reward = math.inf
    if not math.isfinite(reward) or abs(reward) > FLOAT32_MAX:
        raise RewardError(f"{where} returned reward {reward:g}; rewards must be finite float32 values")
    try:
        detail = json.loads(json.dumps(detail, allow_nan=False))
        json.dumps(answer)
    except (TypeError, ValueError) as e:
        raise RewardError(f"{where} returned details that are not plain JSON ({e}); return str, number, bool, None, "
                          "list or dict values") from None
    correct = bool(correct) if correct is not None else reward >= CORRECT_AT
    return Verdict(reward=reward, correct=correct, answer=answer, detail=detail)


class Scorer(abc.ABC):
    """Verdicts for rows: see the module docstring."""

    @abc.abstractmethod
    async def verdict(self, row: Row, text: str) -> Verdict: ...

    @property
    @abc.abstractmethod
    def identity(self) -> dict[str, Any]:
        """What the run config (and a rescored dataset's lineage) records of this scorer."""

    async def verdicts(self, items: list[tuple[Row, str]]) -> list[Verdict]:
        """Verdicts of many rows at once; every call ends (none is left running) before the first error is raised."""
        return await gather_all(self.verdict(row, text) for row, text in items)

    async def probe(self) -> None:
        """Raise :class:`RewardError` (one line: what failed, how to fix it) when this scorer cannot answer at all;
        run once before the first prompt. Local scorers have nothing to reach."""
        return None

    async def close(self) -> None:
        return None


async def gather_all(coroutines) -> list[Any]:
    """``asyncio.gather`` that lets every coroutine finish, then raises the first error (in order), if any."""
    results = await asyncio.gather(*coroutines, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


class TaskScorer(Scorer):
    """The task's own verifier on the row's label (the built-in and ``--task`` plugins' rewards)."""

    def __init__(self, task: Task, identity: dict[str, Any] | None = None):
        self.task = task
        self._identity = identity or {"kind": "task", "task": task.name}

    @property
    def identity(self) -> dict[str, Any]:
        return self._identity

    async def verdicts(self, items: list[tuple[Row, str]]) -> list[Verdict]:
        # One after the other, without yielding to the event loop: a verifier is a pure function of strings, and an
        # episode whose calls are done then finishes in the same step (an interrupt cannot cancel it half scored).
        return [await self.verdict(row, text) for row, text in items]

    async def verdict(self, row: Row, text: str) -> Verdict:
        where = f"task {self.task.name!r} verifier on {row.sample_id}"
        try:
            return to_verdict(self.task.verify(text, metadata_of(row).get("label")), where)
        except RewardError:
            raise
        except Exception as e:
            raise RewardError(f"{where} raised {type(e).__name__}: {one_line(e)}") from e


class _Bounded(Scorer):
    """A scorer whose calls are bounded in number and time."""

    def __init__(self, *, concurrency: int, timeout: float, name: str):
        check_bounds(concurrency, timeout)
        self.timeout, self.name = timeout, name
        self._slots = asyncio.Semaphore(concurrency)  # binds to the running loop at its first use

    async def verdict(self, row: Row, text: str) -> Verdict:
        where = f"{self.name} on {row.sample_id}"
        async with self._slots:
            try:
                value = await asyncio.wait_for(self._call(Sample.of(row, text)), self.timeout)
            except asyncio.TimeoutError:
                raise RewardError(f"{where} gave no answer within {self.timeout:g} s (--reward-timeout)") from None
            except RewardError:
                raise
            except Exception as e:
                raise RewardError(f"{where} raised {type(e).__name__}: {one_line(e)}") from e
            return to_verdict(value, where)

    @abc.abstractmethod
    async def _call(self, sample: Sample) -> Any: ...


class FunctionScorer(_Bounded):
    """A user reward function (``--reward module:fn`` / ``file.py:fn``), sync or async.

    A sync call runs on a daemon thread of its own and holds one of ``concurrency`` thread slots until it
    returns, also after it timed out: a function that hangs uses up slots (then every later call times out,
    with the message), never unbounded threads, and never keeps the process from exiting."""

    def __init__(
        self,
        fn: Callable[[Sample], Any],
        *,
        identity: dict[str, Any],
        concurrency: int = DEFAULT_CONCURRENCY,
        timeout: float = DEFAULT_TIMEOUT_S,
    ):
        if not callable(fn):
            raise ValueError(f"--reward {identity.get('spec')!r} is a {type(fn).__name__}, not a function")
        super().__init__(concurrency=concurrency, timeout=timeout, name=f"reward function {identity.get('spec')}")
        self.fn, self._identity = fn, {"kind": "function", **identity}
        self._async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
        self._threads = asyncio.Semaphore(concurrency)

    @property
    def identity(self) -> dict[str, Any]:
        return self._identity

    async def _call(self, sample: Sample) -> Any:
        if self._async:
            return await self.fn(sample)
        await self._threads.acquire()
        loop, done = asyncio.get_running_loop(), asyncio.get_running_loop().create_future()
        threading.Thread(target=self._run, args=(sample, loop, done), name="rollshard-reward", daemon=True).start()
        value = await done
        if inspect.isawaitable(value):  # a sync callable that returns a coroutine
            value = await value
        return value

    def _run(self, sample: Sample, loop: asyncio.AbstractEventLoop, done: asyncio.Future) -> None:
        try:
            outcome = (self.fn(sample), None)
        except BaseException as e:
            outcome = (None, e)
        try:
            loop.call_soon_threadsafe(self._finish, done, *outcome)
        except RuntimeError:  # the loop is gone (the run ended while this call hung)
            pass

    def _finish(self, done: asyncio.Future, value: Any, error: BaseException | None) -> None:
        self._threads.release()
        if done.done():  # timed out or cancelled: nobody waits for it any more
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(value)


class HttpScorer(_Bounded):
    """A remote reward model or verifier: ``POST url`` with the sample as JSON (module docstring)."""

    def __init__(self, url: str, *, concurrency: int = DEFAULT_CONCURRENCY, timeout: float = DEFAULT_TIMEOUT_S):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--reward-url {url!r}: expected an http:// or https:// URL")
        super().__init__(concurrency=concurrency, timeout=timeout, name=f"reward server {url}")
        self.url = url
        self._session = None

    @property
    def identity(self) -> dict[str, Any]:
        return {"kind": "http", "url": self.url}

    def _client(self):
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def probe(self) -> None:
        """A GET of the URL, retried as a call is (module docstring); the server's reward route is not called."""
        import aiohttp

        where, timeout = f"--reward-url {self.url}", aiohttp.ClientTimeout(total=self.timeout)
        for attempt in range(HTTP_ATTEMPTS):
            last = attempt + 1 == HTTP_ATTEMPTS
            try:
                async with self._client().get(self.url, timeout=timeout) as resp:
                    status = resp.status
                    text = one_line(await resp.text())[:200] if status in PROBE_REFUSED or status >= 500 else ""
            except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError) as e:
                if last:
                    how = f"no answer within {self.timeout:g} s" if isinstance(e, asyncio.TimeoutError) else one_line(e)
                    raise RewardError(
                        f"{where} does not answer: {how} (after {HTTP_ATTEMPTS} attempts); check the reward server "
                        "is up at that URL and reachable from this machine"
                    ) from e
                await _backoff(attempt)
                continue
            if status >= 500 and not last:
                await _backoff(attempt)
                continue
            if status in PROBE_REFUSED or status >= 500:
                raise RewardError(
                    f"{where} answered HTTP {status} to a probe (GET): {text or 'no body'}; check the URL (its path: "
                    "the route rows are POSTed to) and that the server accepts this machine"
                )
            return

    async def _call(self, sample: Sample) -> Any:
        import aiohttp

        self._client()
        body = json.dumps(sample.to_json(), default=str)
        for attempt in range(HTTP_ATTEMPTS):
            last = attempt + 1 == HTTP_ATTEMPTS
            try:
                async with self._session.post(
                    self.url, data=body, headers={"Content-Type": "application/json"}
                ) as resp:
                    text = await resp.text()
                    if resp.status >= 500 and not last:
                        await _backoff(attempt)
                        continue
                    if resp.status != 200:
                        raise RewardError(f"{self.name} answered HTTP {resp.status}: {one_line(text)[:200]}")
                    try:
                        return json.loads(text)
                    except json.JSONDecodeError:
                        raise RewardError(f"{self.name} answered non-JSON: {one_line(text)[:200]}") from None
            except (aiohttp.ClientConnectionError, ConnectionError) as e:
                if last:
                    raise RewardError(f"{self.name} unreachable after {HTTP_ATTEMPTS} attempts: {one_line(e)}") from e
                await _backoff(attempt)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def check_bounds(concurrency: int, timeout: float) -> None:
    if concurrency < 1 or not timeout > 0:
        raise ValueError("--reward-concurrency must be >= 1 and --reward-timeout > 0")


def make_scorer(
    task: Task,
    *,
    reward: str | None = None,
    reward_url: str | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> Scorer:
    """The scorer of a run: ``--reward`` (a plugin spec), ``--reward-url``, else the task's verifier."""
    from rollshard.generate import plugins

    check_bounds(concurrency, timeout)
    if reward and reward_url:
        raise ValueError("give --reward or --reward-url, not both")
    if reward_url:
        return HttpScorer(reward_url, concurrency=concurrency, timeout=timeout)
    if reward:
        if not plugins.is_spec(reward):
            raise ValueError(f"--reward {reward!r}: expected module:function or path/to/file.py:function")
        plugin = plugins.load(reward, what="--reward")
        return FunctionScorer(plugin.obj, identity=plugin.identity, concurrency=concurrency, timeout=timeout)
    identity = {"kind": "task", "task": task.name, **({"plugin": task.plugin} if task.plugin else {})}
    return TaskScorer(task, identity)


async def _backoff(attempt: int) -> None:
    """The wait before retry ``attempt + 1`` of a remote reward call (``attempt`` counts from 0)."""
    await asyncio.sleep(backoff_delay(attempt, HTTP_BACKOFF_S, HTTP_BACKOFF_MAX_S))


def add_reward_arguments(group, *, reward_help: str) -> None:
    """``--reward``, ``--reward-url``, ``--reward-concurrency``, ``--reward-timeout`` (generate and rescore)."""
    group.add_argument("--reward", metavar="FN", help=reward_help)
    group.add_argument("--reward-url", metavar="URL", help="reward server: each row is POSTed as JSON, the answer is the reward")
    group.add_argument(
        "--reward-concurrency", type=int, default=DEFAULT_CONCURRENCY, metavar="N",
        help="reward calls at once (default: %(default)s)",
    )
    group.add_argument(
        "--reward-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
        help="per reward call; over it the prompt fails (default: %(default)s)",
    )
