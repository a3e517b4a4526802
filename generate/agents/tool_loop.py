"""``tool_loop``: a multi-turn trajectory with a calculator environment between model turns.

Each of n samples per prompt is one row (agent ``policy``, round 0; the samples of a
prompt form one group) holding ``turns`` model turns. After every model turn but the
last, the environment appends an observation to the same token stream:

* the turn contains ``<calc>EXPR</calc>`` (the turn stops at ``</calc>``): the
  observation is ``\\n<result>VALUE</result>\\n`` with EXPR evaluated (``+ - * / ** %``,
  parentheses, numbers; anything else gives ``error``);
* otherwise: ``\\n<result>no calculation</result>\\n``.

Observation tokens are not the policy's: loss_mask 0 and logprob 0.0 (slime's rule for
tool output, as in its search-r1 example, which also appends tool text as plain tokens
rather than re-applying the chat template). The loop ends early when a turn aborts or
the context is full. Reward: the task verifier on the last model turn.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import operator
import re

from rollshard.generate.agents.base import AgentSystem, Episode
from rollshard.store.schema import Row

AGENT = "policy"
CALL_END = "</calc>"
CALL_RE = re.compile(r"<calc>(.*?)(?:</calc>|$)", re.S)
MAX_EXPONENT = 64  # keeps 9**9**9-style expressions from hanging the run
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


@dataclasses.dataclass(kw_only=True)
class ToolLoopOptions:
    n_samples: int = 4
    turns: int = 2  # model turns per trajectory


def calculate(expr: str) -> str:
    """Evaluate an arithmetic expression without ``eval``; ``"error"`` for anything else."""

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"unsupported expression {ast.dump(node)[:40]}")

    try:
        value = ev(ast.parse(expr.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError):
        return "error"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def observation(turn_text: str) -> str:
    calls = CALL_RE.findall(turn_text)
    result = calculate(calls[-1]) if calls else "no calculation"
    return f"\n<result>{result}</result>\n"


class ToolLoop(AgentSystem):
    name = "tool_loop"

    def __init__(self, options: ToolLoopOptions):
        if options.n_samples < 1 or options.turns < 1:
            raise ValueError("tool_loop needs n_samples >= 1 and turns >= 1")
        self.options = options

    @property
    def max_parallel_calls(self) -> int:
        return self.options.n_samples

    async def run(self, episode: Episode) -> list[Row]:
        rows = await asyncio.gather(*(self._sample(episode, i) for i in range(self.options.n_samples)))
        return list(rows)

    async def _sample(self, episode: Episode, index: int) -> Row:
        s = episode.sampling
        # Stop at the end of a tool call so the environment can answer it; keep the tag in the text.
        sampling = dataclasses.replace(s, stop=[*(s.stop or []), CALL_END], no_stop_trim=True)
        call = await episode.call(AGENT, 0, index, episode.task.messages(episode.prompt), sampling=sampling)
        while call.turns < self.options.turns and call.finish_reason != "abort":
            if not await episode.extend(call, observation(call.last_text)):
                break
        verdict = episode.verify(call.last_text)
        return episode.row(call, verdict.reward, {"verdict": verdict.to_json()})
