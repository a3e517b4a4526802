"""What every agent system shares: one episode's context, agent calls, and rows built from them.

An agent system turns one prompt into the rows of one *episode*. It talks to the
engine only through :meth:`Episode.call` (one model turn from chat messages) and
:meth:`Episode.extend` (environment text, then another model turn of the same
trajectory), and turns each finished :class:`AgentCall` into a row with
:meth:`Episode.row`.

Identity (DESIGN.md "The row"): an agent call is named by ``(prompt_id, agent, round,
index)``; ``sample_id = "{prompt_id}/{agent}/{round}/{index}"`` and ``group_id =
"{prompt_id}/{agent}/{round}"``, so GRPO groups never mix prompts, roles or rounds,
and a rerun names every call the same way. Each request carries
``sampling_seed`` derived from the run seed, the sample id and the turn, so a
deterministic engine (the embedded one) regenerates a lost row token for token.

Token accounting: ``prompt_tokens`` are exactly the ids sent for the first turn (chat
template applied); ``response_tokens`` are every id after them -- model turns
(loss_mask 1, the engine's logprob) and environment text between turns (loss_mask 0,
logprob 0.0), as slime builds multi-turn samples. With ``SamplingParams.return_sampling_mask``
a call also keeps each token's sampling support and sampling logprob (the engine's for model
turns; ``[]`` and 0.0 for environment tokens), written to the row's schema 1.1 columns; without
it both are None.

Rewards are a second phase: :meth:`AgentSystem.run` makes the calls and their rows,
:meth:`AgentSystem.score` assigns rewards from the rows alone (the system's reward rule,
through a :class:`~rollshard.generate.rewards.Scorer`), so ``rollshard-generate rescore``
applies the same rule to stored rows. :func:`play` runs both, then checks every row
against the engine calls the episode made (:meth:`Episode.check_rows`): whatever a plugin
system does, a row whose tokens, logprobs or mask are not those of a call of this
episode cannot reach the writer, which checks the row invariants in turn.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import json
from collections import Counter
from typing import Any, ClassVar

import numpy as np

from rollshard.generate.chat import ChatFormat
from rollshard.generate.engines.base import Engine, EngineError, GenerateResult, SamplingParams
from rollshard.generate.rewards import Scorer, TaskScorer, metadata_of
from rollshard.generate.tasks.base import Prompt, Task
from rollshard.generate.tasks.prompts import ID_SEPARATOR
from rollshard.store.format.routing import RoutingShape
from rollshard.store.format.schema import Row, Status, WeightSpan
from rollshard.store.models.tokenizer import encode

SEED_MODULUS = 2**31 - 1  # engines take the seed as a signed 32-bit int (torch and SGLang both accept it)


def derive_seed(run_seed: int, sample_id: str, turn: int) -> int:
    """Per-request sampling seed: a hash of (run seed, sample id, turn), stable across runs and hosts."""
    digest = hashlib.blake2b(f"{run_seed}\x00{sample_id}\x00{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_MODULUS


def prompt_hash(prompt_ids: list[int], label: Any) -> str:
    """Hash of a prompt's rendered first-turn ids and its label (JSON), as stored in row metadata."""
    payload = json.dumps([list(prompt_ids), label], sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.blake2b(payload.encode(), digest_size=12).hexdigest()


@dataclasses.dataclass(kw_only=True)
class AgentCall:
    """One trajectory of one agent: what was sent, and every response token after it."""

    sample_id: str
    group_id: str
    agent: str
    round: int
    prompt_ids: list[int]
    prompt_text: str
    sampling: SamplingParams
    response_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    text: str = ""  # whole response as text: model turns and environment text
    last_text: str = ""  # the last model turn's text (what a verifier reads)
    finish_reason: str = "abort"
    finish_detail: dict[str, Any] = dataclasses.field(default_factory=dict)
    weight_version: str | None = None
    weight_spans: list[WeightSpan] = dataclasses.field(default_factory=list)
    turns: int = 0
    # With sampling.return_sampling_mask, per response token (environment tokens: 0.0 and []); else None.
    sampling_logprobs: list[float] | None = None
    sampling_support: list[list[int]] | None = None
    # With sampling.return_routed_experts: [positions, layers, top_k] expert ids of every position the engine
    # forwarded for this trajectory (prompt, then each turn's tokens, the last one excepted); None when a turn
    # came back with none (a request answered before any forward).
    routed_experts: Any = None

    def __post_init__(self) -> None:
        if self.sampling.return_sampling_mask and self.sampling_logprobs is None:
            self.sampling_logprobs, self.sampling_support = [], []

    def _add_routing(self, result: GenerateResult, input_len: int) -> None:
        """A turn's routing after what the call holds: the turn's request covered positions
        ``[routed_experts_start, input_len + output - 1)``; a continuation keeps the earlier turns' routing of the
        positions they forwarded (as the engine routed them then) and takes the turn's for the rest. A turn the
        engine answered before any forward (an abort in its queue) leaves the call without routing."""
        ids = result.routed_experts
        if ids is None and result.output_ids:  # tokens without the routing that chose them: the ask was ignored
            raise EngineError(
                f"request for {self.sample_id} turn {self.turns}: the engine returned no routed experts although "
                "return_routed_experts was asked for (an SGLang server needs --enable-return-routed-experts)"
            )
        if ids is None or (self.turns and self.routed_experts is None):
            self.routed_experts = None
            return
        have = 0 if self.routed_experts is None else len(self.routed_experts)
        start, want = result.routed_experts_start, max(input_len + len(result.output_ids) - 1, 0)
        if start > have or start + len(ids) != want:
            raise EngineError(
                f"request for {self.sample_id} turn {self.turns}: the engine's routed experts cover positions "
                f"[{start}, {start + len(ids)}); they must end at {want} (input + output - 1) and start at or before "
                f"{have} (what the call holds)"
            )
        new = ids[have - start :]
        self.routed_experts = new if self.routed_experts is None else np.concatenate([self.routed_experts, new])

    def add_turn(self, result: GenerateResult) -> None:
        if self.sampling_support is not None:
            if result.sampling_support is None or result.sampling_logprobs is None:
                # An engine that ignored the request: the row would lack what the run promised to store.
                raise EngineError(
                    f"request for {self.sample_id} turn {self.turns}: the engine returned no sampling support "
                    "although return_sampling_mask was asked for"
                )
            self.sampling_logprobs += result.sampling_logprobs
            self.sampling_support += [list(s) for s in result.sampling_support]
        if self.sampling.return_routed_experts:
            self._add_routing(result, len(self.prompt_ids) + len(self.response_ids))
        start = len(self.response_ids)
        self.response_ids += result.output_ids
        self.logprobs += result.logprobs
        self.loss_mask += [1] * len(result.output_ids)
        self.text += result.text
        self.last_text = result.text
        self.finish_reason = result.finish_reason
        self.finish_detail = dict(result.finish_detail)
        self.weight_version = result.weight_version or self.weight_version
        spans = result.weight_versions or (
            [WeightSpan(version=result.weight_version, start=0, end=len(result.output_ids))]
            if result.weight_version is not None
            else []
        )
        for s in spans:
            self._add_span(s.version, start + s.start, start + s.end)
        self.turns += 1

    def add_environment(self, ids: list[int], text: str) -> None:
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        if self.sampling_support is not None:  # not the policy's tokens: no support (the store's rule)
            self.sampling_logprobs += [0.0] * len(ids)
            self.sampling_support += [[] for _ in ids]
        self.text += text

    def _add_span(self, version: str, start: int, end: int) -> None:
        # One span per version run: environment tokens between two turns of one version join them.
        if self.weight_spans and self.weight_spans[-1].version == version:
            self.weight_spans[-1].end = end
        else:
            self.weight_spans.append(WeightSpan(version=version, start=start, end=end))

    @property
    def status(self) -> Status:
        return Status.from_finish_reason(self.finish_reason)


class ContextFullError(ValueError):
    """A prompt leaves no room for a response within the model's context."""


class RowProvenanceError(ValueError):
    """An agent system returned a row that is not one of its episode's engine calls, as the engine answered."""


class Episode:
    """Everything one agent system needs to turn one prompt into rows."""

    def __init__(
        self,
        *,
        prompt: Prompt,
        task: Task,
        engine: Engine,
        tokenizer,
        sampling: SamplingParams,
        seed: int = 0,
        attempt: int = 0,
        max_context_len: int | None = None,
        allow_skip: bool = False,
        system: str = "",
        scorer: Scorer | None = None,
        chat: ChatFormat | None = None,
        routing: RoutingShape | None = None,
    ):
        """``routing``: the dataset's routing shape (its run config's), with which a call's routed experts are
        stored (schema 1.2); None when the run stores none."""
        if ID_SEPARATOR in prompt.prompt_id:  # load_prompts refuses these; a Prompt built in code may not
            raise ValueError(
                f"prompt id {prompt.prompt_id!r} contains {ID_SEPARATOR!r}, which separates the parts of group and "
                "sample ids; give the prompt an id without it"
            )
        self.prompt = prompt
        self.task = task
        self.engine = engine
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.seed = seed
        self.attempt = attempt
        self.max_context_len = max_context_len
        self.allow_skip = allow_skip
        self.system = system
        self.scorer = scorer or TaskScorer(task)
        self.chat = chat or ChatFormat()
        self.routing = routing
        self.calls: dict[str, AgentCall] = {}  # every call made, by sample id (what check_rows holds rows to)
        self.skipped: Counter = Counter()  # optional calls skipped because their prompt did not fit, by agent
        self._prompts: dict[str, tuple[str, list[int]]] = {}  # n samples of one conversation: render once
        self._prompt_hash: str | None = None

    def ids(self, agent: str, round: int, index: int) -> tuple[str, str]:
        """``(sample_id, group_id)``: ``prompt/agent/round/index`` and ``prompt/agent/round`` (the prompt id has no
        ``/``, so different samples never share an id)."""
        group_id = f"{self.prompt.prompt_id}/{agent}/{round}"
        return f"{group_id}/{index}", group_id

    async def call(
        self,
        agent: str,
        round: int,
        index: int,
        messages: list[dict[str, Any]],
        *,
        sampling: SamplingParams | None = None,
        required: bool = True,
    ) -> AgentCall | None:
        """One model turn on ``messages`` (chat template applied).

        If the prompt leaves no room for a response within ``max_context_len``: returns None
        (the call is skipped, and counted in :attr:`skipped`) when the call is not
        ``required`` and the run allows skipping (``--allow-skipped-calls``); otherwise raises
        :class:`ContextFullError`, which fails the episode: a silently thinner episode
        (solver rows only, say) would look like a complete one in the dataset.
        """
        sample_id, group_id = self.ids(agent, round, index)
        prompt_text, prompt_ids = self._prompt(messages)
        call = AgentCall(
            sample_id=sample_id,
            group_id=group_id,
            agent=agent,
            round=round,
            prompt_ids=prompt_ids,
            prompt_text=prompt_text,
            sampling=sampling or self.sampling,
        )
        self.calls[sample_id] = call
        if await self._turn(call):
            return call
        if not required and self.allow_skip:
            self.skipped[agent] += 1
            return None
        hint = "" if required else ", or pass --allow-skipped-calls to store the episode without such calls"
        raise ContextFullError(
            f"the {agent} prompt is {len(call.prompt_ids)} tokens and the context {self.max_context_len}: "
            f"no room for a response; lower --max-new-tokens or --n-samples, or raise --max-context-len{hint}"
        )

    def _prompt(self, messages: list[dict[str, Any]]) -> tuple[str, list[int]]:
        """Chat template applied (text, ids), once per distinct conversation of the episode.

        The ids are the rendered text (the run's :class:`ChatFormat`), encoded.
        """
        key = json.dumps(messages, sort_keys=True)
        hit = self._prompts.get(key)
        if hit is None:
            text = self.chat.render(self.tokenizer, messages)
            hit = self._prompts[key] = (text, encode(self.tokenizer, text))
        return hit

    async def extend(self, call: AgentCall, environment_text: str) -> bool:
        """Append environment text (mask 0) and one more model turn; False if the context is full."""
        ids = encode(self.tokenizer, environment_text)
        if self._budget(len(call.prompt_ids) + len(call.response_ids) + len(ids)) <= 0:
            return False
        call.add_environment(ids, environment_text)
        return await self._turn(call)

    async def _turn(self, call: AgentCall) -> bool:
        input_ids = call.prompt_ids + call.response_ids
        budget = self._budget(len(input_ids))
        if budget <= 0:
            return False
        sampling = dataclasses.replace(
            call.sampling,
            max_new_tokens=min(call.sampling.max_new_tokens, budget),
            sampling_seed=derive_seed(self.seed, call.sample_id, call.turns),
        )
        rid = f"{call.sample_id}/turn{call.turns}/try{self.attempt}"
        call.add_turn(await self.engine.generate(input_ids, sampling, rid=rid))
        return True

    def _budget(self, used: int) -> int:
        if self.max_context_len is None:
            return 1 << 30
        return self.max_context_len - used

    @property
    def prompt_hash(self) -> str:
        """Identity of the source prompt as the run saw it: its rendered ids (task template, chat template and
        tokenizer applied) and its label. Stored in every row; a resume compares it (see :func:`prompt_hash`)."""
        if self._prompt_hash is None:
            _, ids = self._prompt(self.task.messages(self.prompt))
            self._prompt_hash = prompt_hash(ids, self.prompt.label)
        return self._prompt_hash

    def row(self, call: AgentCall, metadata: dict[str, Any] | None = None, *, reward: float | None = None) -> Row:
        """The row of a finished call; its reward is :meth:`AgentSystem.score`'s to set.

        ``metadata.last_turn_start`` is the character offset of the last model turn in the response text: what
        a verifier reads, recoverable from the stored row."""
        meta = {
            "task": self.task.name,
            "system": self.system,
            "label": self.prompt.label,
            "prompt_hash": self.prompt_hash,
            "turns": call.turns,
            "last_turn_start": len(call.text) - len(call.last_text),
        }
        meta.update(metadata or {})
        return Row(
            sample_id=call.sample_id,
            prompt_id=self.prompt.prompt_id,
            group_id=call.group_id,
            agent=call.agent,
            round=call.round,
            # Copies: a row edited in place must not edit the call that check_rows holds it to.
            prompt_tokens=list(call.prompt_ids),
            response_tokens=list(call.response_ids),
            rollout_logprobs=list(call.logprobs),
            loss_mask=list(call.loss_mask),
            reward=reward,
            status=call.status,
            finish_reason=call.finish_reason,
            weight_version=call.weight_version,
            weight_versions=[dataclasses.replace(w) for w in call.weight_spans] or None,
            temperature=call.sampling.temperature,
            top_p=call.sampling.top_p,
            top_k=call.sampling.top_k,
            prompt_text=call.prompt_text,
            response_text=call.text,
            metadata=meta,
            sampling_logprobs=_copy_logprobs(call.sampling_logprobs),
            sampling_support=_copy_support(call.sampling_support),
            routed_experts=(self.routing.encode(call.routed_experts)
                            if self.routing is not None and call.routed_experts is not None else None),
        )

    def check_rows(self, rows: list[Row]) -> None:
        """Raise :class:`RowProvenanceError` unless every row is a distinct call of this episode and everything
        but its reward and system metadata is what :meth:`row` makes of that call: the engine's tokens,
        logprobs, mask, sampling, versions, texts and ids (module docstring). Its metadata must be JSON."""
        seen: set[str] = set()
        for row in rows:
            call = self.calls.get(row.sample_id) if isinstance(row, Row) else None
            if call is None:
                raise RowProvenanceError(
                    f"agent system {self.system!r} returned a row {getattr(row, 'sample_id', row)!r} that is not one "
                    "of its episode's engine calls; build rows with episode.row(call) from episode.call/extend"
                )
            if row.sample_id in seen:
                raise RowProvenanceError(f"agent system {self.system!r} returned row {row.sample_id!r} twice")
            seen.add(row.sample_id)
            made = self.row(call)
            for field in PROVENANCE_FIELDS:
                mine, theirs = getattr(made, field), getattr(row, field)
                if field in LIST_FIELDS:
                    mine, theirs = list(mine), list(theirs)
                elif field in OPTIONAL_LIST_FIELDS:
                    mine, theirs = OPTIONAL_LIST_FIELDS[field](mine), OPTIONAL_LIST_FIELDS[field](theirs)
                if theirs != mine:
                    raise RowProvenanceError(
                        f"agent system {self.system!r} changed {field} of {row.sample_id!r} from what the engine "
                        f"returned and the episode recorded; rows must keep them (only reward and metadata are the "
                        "system's to set)"
                    )
            meta = metadata_of(row)
            for key, value in metadata_of(made).items():
                if meta.get(key) != value:
                    raise RowProvenanceError(
                        f"agent system {self.system!r} changed metadata.{key} of {row.sample_id!r}; the episode's "
                        "own metadata keys are kept as recorded"
                    )
            try:
                json.dumps(meta, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise RowProvenanceError(f"metadata of {row.sample_id!r} is not plain JSON: {e}") from e


# What check_rows holds every row to: the fields row() sets from the call (reward and metadata are the system's).
PROVENANCE_FIELDS = (
    "prompt_id", "group_id", "agent", "round", "prompt_tokens", "response_tokens", "rollout_logprobs", "loss_mask",
    "status", "finish_reason", "weight_version", "weight_versions", "temperature", "top_p", "top_k", "prompt_text",
    "response_text", "sampling_logprobs", "sampling_support", "routed_experts",
)
LIST_FIELDS = ("prompt_tokens", "response_tokens", "rollout_logprobs", "loss_mask")


def _copy_logprobs(values) -> list[float] | None:
    return None if values is None else list(values)


def _copy_support(supports) -> list[list[int]] | None:
    return None if supports is None else [list(s) for s in supports]


# Nullable list fields, compared as plain lists (None stays None): a row's sampling support as the call made it.
OPTIONAL_LIST_FIELDS = {"sampling_logprobs": _copy_logprobs, "sampling_support": _copy_support}


async def play(system: "AgentSystem", episode: Episode) -> list[Row]:
    """One episode: the system's calls and rows, its rewards, and the rows checked against the calls."""
    rows = await system.run(episode)
    rows = await system.score(rows, episode.scorer)
    episode.check_rows(rows)
    return rows


class AgentSystem(abc.ABC):
    """Turns one prompt into the rows of one episode."""

    name: ClassVar[str]
    plugin: dict[str, Any] | None = None  # where a user system came from (set by make_agent_system)

    @abc.abstractmethod
    async def run(self, episode: Episode) -> list[Row]: ...

    @property
    @abc.abstractmethod
    def max_parallel_calls(self) -> int:
        """Most engine requests one episode has in flight at once (sizes the episode pool)."""

    def context_warning(
        self, *, sampling: SamplingParams, context: int | None, task: Task, prompt: Prompt, count_tokens
    ) -> str | None:
        """Said at start when this system's calls can outgrow the context with these settings (their prompts
        hold earlier responses), judged on the source's first ``prompt``; ``count_tokens(messages)`` is the
        rendered length of a conversation. None when they cannot, or the system cannot tell."""
        return None

    def verify_text(self, row: Row) -> str:
        """The text of ``row`` that the reward reads: its last model turn (``metadata.last_turn_start`` on)."""
        start = metadata_of(row).get("last_turn_start", 0)
        return (row.response_text or "")[start:]

    async def score(self, rows: list[Row], scorer: Scorer) -> list[Row]:
        """The reward rule, a function of one episode's rows: each row's reward is the scorer's on its
        :meth:`verify_text`, its verdict kept in ``metadata.verdict``. Systems with another rule override this;
        it must not change anything of a row but ``reward`` and ``metadata``."""
        verdicts = await scorer.verdicts([(row, self.verify_text(row)) for row in rows])
        for row, verdict in zip(rows, verdicts):
            set_reward(row, verdict.reward, {"verdict": verdict.to_json()})
        return rows

    def config(self) -> dict[str, Any]:
        """The system's settings, for the run config stored with the dataset."""
        options = getattr(self, "options", None)
        fields = dataclasses.asdict(options) if dataclasses.is_dataclass(options) else {}
        plugin = {"plugin": self.plugin} if self.plugin else {}
        return {"name": self.name, **plugin, **fields}


def set_reward(row: Row, reward: float, metadata: dict[str, Any]) -> None:
    """Set a row's reward and merge ``metadata`` into its metadata (kept a dict, or JSON text as it was)."""
    meta = metadata_of(row)
    meta.update(metadata)
    row.reward = reward
    row.metadata = json.dumps(meta, sort_keys=True) if isinstance(row.metadata, str) else meta
