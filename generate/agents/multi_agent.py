"""``multi_agent``: solvers -> rewriters -> selector on one problem, after slime's examples/multi_agent.

Flow of one episode (``k`` = ``num_solvers`` = ``num_rewriters``, ``--n-samples``):

1. round 0: ``k`` solvers answer the task's prompt;
2. round 1: ``k`` rewriters each see the problem and every solver answer that parsed,
   and write an improved solution;
3. round 2: one selector sees the rewrites that parsed, numbered 1..m, and must end with
   ``Judgment: IDX``.

Answer parsing: a response's answer is the text after the last ``reasoning_end``
(``</think>``) when the response has one, else the whole response, stripped; an empty
answer counts as none. slime counts a response without a reasoning block as no answer;
``require_reasoning=true`` restores that (models without a reasoning format, such as the
tiny test model, would then never reach the rewriters).

Rewards (the exact rule, tested in tests/generate/test_agents.py; :meth:`MultiAgent.score`
computes it from the stored rows, so ``rescore`` recomputes it consistently):

* solver and rewriter: ``v`` = the scorer's reward (the task verifier's, or ``--reward``) on
  the call's answer (``metadata.answer``; on ``""`` when none parsed, ``metadata.answer_status``
  ``missing``);
* selector: its verdict is the **last** ``Judgment: N`` in its answer (slime takes the first;
  the prompt asks for it at the end, so an earlier one is reasoning, not the decision), read
  as instruct models write it: any case, ``Judgement`` too, markdown around it
  (``**Judgment:** 2``, ``**Judgment: 2**``, ``Judgment: **2**``, ``### Judgment: 2``), ``N``
  as ``Solution 2``, ``#2`` or ``[2]`` (:data:`JUDGMENT_RE`). ``metadata.judgment_status`` is
  ``ok`` when ``N`` is in ``1..m``, ``out_of_range`` when it is not, ``missing`` when there is
  no verdict. An ``ok`` verdict selects the N-th rewrite shown (``metadata.selected``) and the
  selector's ``v`` is that rewrite's reward; otherwise ``v = 0``. ``score`` reads the verdict
  again from the stored answer and candidates, so rescoring a dataset applies this parser to it;
* the selector was right when the rewrite it selected is correct by the verifier
  (``Verdict.correct``; for 0/1 verifiers this is slime's ``reward == 1``);
* episode weight (slime's ``correct_reward_weight`` / ``incorrect_reward_weight``): every
  row's reward is ``v * weight``, where the weight is ``correct_weight`` (1.2) when the
  selector gave an ``ok`` verdict and was right, ``incorrect_weight`` (0.8) when it gave an
  ``ok`` verdict and was wrong, and 1.0 when the episode has no ``ok`` verdict: a
  ``missing`` or ``out_of_range`` one, or no selector at all (no solver answer parsed, no
  rewrite parsed, or the selector call was skipped). This departs from slime, which weighs
  such episodes by ``incorrect_weight``: a failed selector says nothing about the solvers
  and rewriters, so a correct solver keeps its full reward (1.0, not 0.8). The raw ``v``
  and the weight are kept in each row's metadata.

Why the weight is kept although it mostly cancels: groups here are per (prompt, role,
round), so all rows of a group share one episode weight, and GRPO's std-normalized
advantage ``(r - mean) / std`` is unchanged by it (up to the epsilon); it changes the
advantage scale only without std normalization (Dr. GRPO) and the reported reward
means. It is on by default so rewards of episodes with a verdict match slime's;
``correct_weight=1 incorrect_weight=1`` turns it off.

Groups: solvers of a prompt form one group (round 0), rewriters another (round 1), the
selector a group of one (round 2).

Context: a rewriter's prompt holds every parsed solver answer, the selector's every
parsed rewrite, so they grow with ``--n-samples`` and ``--max-new-tokens``. A call whose
prompt does not fit the context fails the episode (it goes to the failure ledger), unless
the run passes ``--allow-skipped-calls``: the call is then skipped, has no row, and is
counted per role in the run's summary. A solver prompt that does not fit always fails.
:meth:`MultiAgent.context_warning` says at start when the settings make this likely.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import re

from rollshard.generate.agents.base import AgentCall, AgentSystem, Episode, set_reward
from rollshard.generate.engines.base import SamplingParams
from rollshard.generate.rewards import Scorer, metadata_of
from rollshard.generate.tasks.base import Prompt, Task
from rollshard.store.format.schema import Row

SOLVER, REWRITER, SELECTOR = "solver", "rewriter", "selector"
# ``Judgment: N`` in any case (or spelled ``Judgement``), with markdown emphasis or a heading around the label or
# the number, and ``N`` as ``2``, ``Solution 2``, ``#2`` or ``[2]``: ``**Judgment:** 2``, ``Judgment: **Solution #2**``,
# ``### judgment: [2]``.
JUDGMENT_RE = re.compile(r"\bjudge?ment[\s*_]*:[\s*_]*(?:solution\s*)?[#\[(]?\s*(\d+)", re.IGNORECASE)
NO_WEIGHT = 1.0  # the episode weight when the selector gave no valid verdict (module docstring)

REWRITE_TEMPLATE = """\
Problem:
{problem}

Here are {count} candidate solutions to the problem.

{candidates}

Read the candidates, find their mistakes, and write one improved, correct solution to the problem."""

SELECT_TEMPLATE = """\
Problem:
{problem}

Here are {count} candidate solutions to the problem.

{candidates}

Compare the candidates and decide which one is most likely correct. End your reply with exactly one line:
Judgment: IDX
where IDX is the number (1 to {count}) of the best solution."""


@dataclasses.dataclass(kw_only=True)
class MultiAgentOptions:
    num_solvers: int = 4
    num_rewriters: int = 4
    correct_weight: float = 1.2  # slime's correct_reward_weight
    incorrect_weight: float = 0.8  # slime's incorrect_reward_weight
    reasoning_end: str = "</think>"
    require_reasoning: bool = False
    max_candidate_chars: int = 2000  # each candidate is cut to its last N characters, where the answer is


def final_answer(text: str, reasoning_end: str, require_reasoning: bool) -> str | None:
    """The answer part of a response (module docstring); None if empty."""
    if reasoning_end and reasoning_end in text:
        answer = text.rsplit(reasoning_end, 1)[1]
    elif require_reasoning:
        return None
    else:
        answer = text
    return answer.strip() or None


class JudgmentStatus(str, enum.Enum):
    OK = "ok"  # N in 1..m: a rewrite is selected
    OUT_OF_RANGE = "out_of_range"  # a verdict whose N is not a candidate's number
    MISSING = "missing"  # no verdict in the answer (or no answer)


@dataclasses.dataclass(frozen=True)
class Judgment:
    status: JudgmentStatus
    number: int | None  # the N of the last verdict as written (1-based); None when missing

    @property
    def index(self) -> int | None:
        """0-based index of the selected candidate; None unless the verdict is ``ok``."""
        return self.number - 1 if self.status is JudgmentStatus.OK else None


def parse_judgment(text: str | None, num_candidates: int) -> Judgment:
    """The last verdict (:data:`JUDGMENT_RE`) in ``text`` among ``num_candidates`` candidates numbered from 1."""
    matches = JUDGMENT_RE.findall(text or "")
    if not matches:
        return Judgment(JudgmentStatus.MISSING, None)
    n = int(matches[-1])
    return Judgment(JudgmentStatus.OK if 1 <= n <= num_candidates else JudgmentStatus.OUT_OF_RANGE, n)


def format_candidates(answers: list[str], max_chars: int) -> str:
    parts = []
    for i, answer in enumerate(answers, 1):
        if len(answer) > max_chars:
            answer = "..." + answer[-max_chars:]
        parts.append(f"### Solution {i}\n{answer}")
    return "\n\n".join(parts)


@dataclasses.dataclass
class _Answered:
    call: AgentCall
    answer: str | None
    meta: dict


class MultiAgent(AgentSystem):
    name = "multi_agent"

    def __init__(self, options: MultiAgentOptions):
        if options.num_solvers < 1 or options.num_rewriters < 1:
            raise ValueError("multi_agent needs num_solvers >= 1 and num_rewriters >= 1")
        self.options = options

    @property
    def max_parallel_calls(self) -> int:
        return max(self.options.num_solvers, self.options.num_rewriters)

    def context_warning(
        self, *, sampling: SamplingParams, context: int | None, task: Task, prompt: Prompt, count_tokens
    ) -> str | None:
        if context is None:
            return None
        o = self.options
        # The rewriter prompt around k empty candidates, plus k answers of at most max_new_tokens each, cut to
        # max_candidate_chars (a token is at least one character), plus its own response.
        k = o.num_solvers
        problem = task.messages(prompt)[-1]["content"]
        frame = REWRITE_TEMPLATE.format(problem=problem, count=k, candidates=format_candidates([""] * k, 0))
        per_answer = min(sampling.max_new_tokens, o.max_candidate_chars)
        need = count_tokens(task.chat(frame)) + k * per_answer + sampling.max_new_tokens
        if need <= context:
            return None
        return (
            f"multi_agent: a rewriter prompt with {k} solver answers of up to {per_answer} tokens plus its own "
            f"{sampling.max_new_tokens}-token response can reach {need} tokens, more than the context of {context}; "
            "calls that do not fit fail their prompt (lower --n-samples or --max-new-tokens, or pass "
            "--allow-skipped-calls to store episodes without them)"
        )

    async def run(self, episode: Episode) -> list[Row]:
        o = self.options
        problem = episode.task.messages(episode.prompt)[-1]["content"]
        solvers = await self._round(
            episode, SOLVER, 0, o.num_solvers, episode.task.messages(episode.prompt), required=True
        )
        solver_answers = [s for s in solvers if s.answer is not None]
        rewriters: list[_Answered] = []
        selector: _Answered | None = None
        if solver_answers:
            shown = [s.answer for s in solver_answers]
            prompt = REWRITE_TEMPLATE.format(
                problem=problem, count=len(shown), candidates=format_candidates(shown, o.max_candidate_chars)
            )
            rewriters = await self._round(episode, REWRITER, 1, o.num_rewriters, episode.task.chat(prompt))
            for r in rewriters:
                r.meta["candidates"] = [s.call.sample_id for s in solver_answers]
            rewrites = [r for r in rewriters if r.answer is not None]
            if rewrites:
                selector = await self._select(episode, problem, rewrites)
        return [episode.row(a.call, a.meta) for a in solvers + rewriters + ([selector] if selector else [])]

    def verify_text(self, row: Row) -> str:
        """Solvers and rewriters are scored on their parsed answer (``""`` when none parsed)."""
        return metadata_of(row).get("answer") or ""

    async def score(self, rows: list[Row], scorer: Scorer) -> list[Row]:
        """The reward rule of the module docstring, from the rows alone (``metadata.answer`` of every row, and
        ``metadata.candidates`` of the selector, whose verdict is read here and written to its metadata)."""
        o = self.options
        scored = [r for r in rows if r.agent != SELECTOR]
        verdicts = dict(zip((r.sample_id for r in scored), await scorer.verdicts([(r, self.verify_text(r)) for r in scored])))
        selectors = [r for r in rows if r.agent == SELECTOR]
        right, selector_raw, weight, judged = False, 0.0, NO_WEIGHT, {}
        if selectors:
            judged = self._judge(selectors[0])
            picked = judged["selected"]
            if picked is not None:
                if picked not in verdicts:
                    raise ValueError(
                        f"selector {selectors[0].sample_id!r} picked {picked!r}, which is not a row of its episode; "
                        "rescoring needs whole episodes"
                    )
                right, selector_raw = verdicts[picked].correct, verdicts[picked].reward
                weight = o.correct_weight if right else o.incorrect_weight
        for row in rows:
            verdict = verdicts.get(row.sample_id)
            raw = selector_raw if verdict is None else verdict.reward
            meta = {"reward_raw": raw, "episode_weight": weight, "selector_right": right}
            if verdict is not None:
                meta["verdict"] = verdict.to_json()
            if row.agent == SELECTOR:
                meta.update(judged)
            set_reward(row, raw * weight, meta)
        return rows

    @staticmethod
    def _judge(selector: Row) -> dict:
        """The selector's verdict, read from its stored answer and candidates, as its metadata keys: ``judgment``
        (the selected candidate's number, None unless ``ok``), ``judgment_status`` and ``selected`` (a sample id)."""
        meta = metadata_of(selector)
        candidates = meta.get("candidates")
        if candidates is None:
            raise ValueError(
                f"selector {selector.sample_id!r} has no metadata.candidates (the rewrites it was shown); "
                "rescoring needs the rows multi_agent wrote"
            )
        judgment = parse_judgment(meta.get("answer"), len(candidates))
        return {
            "judgment": None if judgment.index is None else judgment.number,
            "judgment_status": judgment.status.value,
            "selected": None if judgment.index is None else candidates[judgment.index],
        }

    async def _round(
        self, episode: Episode, agent: str, round: int, count: int, messages: list[dict], required: bool = False
    ) -> list[_Answered]:
        calls = await asyncio.gather(
            *(episode.call(agent, round, i, messages, required=required) for i in range(count))
        )
        return [self._answered(c) for c in calls if c is not None]

    def _answered(self, call: AgentCall) -> _Answered:
        o = self.options
        answer = final_answer(call.last_text, o.reasoning_end, o.require_reasoning)
        return _Answered(call, answer, {"answer": answer, "answer_status": "missing" if answer is None else "ok"})

    async def _select(self, episode: Episode, problem: str, rewrites: list[_Answered]) -> _Answered | None:
        o = self.options
        prompt = SELECT_TEMPLATE.format(
            problem=problem,
            count=len(rewrites),
            candidates=format_candidates([r.answer for r in rewrites], o.max_candidate_chars),
        )
        call = await episode.call(SELECTOR, 2, 0, episode.task.chat(prompt), required=False)
        if call is None:
            return None
        selector = self._answered(call)
        # The verdict (judgment, judgment_status, selected) is read by score, from these two keys.
        selector.meta["candidates"] = [r.call.sample_id for r in rewrites]
        return selector
