"""``tool_loop``: a multi-turn trajectory with a calculator environment between model turns.

Each of n samples per prompt is one row (agent ``policy``, round 0; the samples of a
prompt form one group) holding ``turns`` model turns. After every model turn but the
last, the environment appends an observation to the same token stream:

* the turn contains ``<calc>EXPR</calc>`` (the turn stops at ``</calc>``): the
  observation is ``\\n<result>VALUE</result>\\n`` with EXPR evaluated (``+ - * / ** %``,
  parentheses, numbers); what cannot be evaluated gives ``error: REASON`` (not arithmetic,
  division by zero, a result over :data:`MAX_DIGITS` digits, an expression over
  :data:`MAX_EXPR_CHARS` characters). The bounds keep every evaluation to microseconds:
  the model writes these expressions, and ``((10**64)**64)**64`` must not hang a run;
* otherwise: ``\\n<result>no calculation</result>\\n``.

Observation tokens are not the policy's: loss_mask 0 and logprob 0.0 (slime's rule for
tool output, as in its search-r1 example, which also appends tool text as plain tokens
rather than re-applying the chat template). The loop ends early when a turn aborts or
the context is full. Reward: the scorer on the last model turn (:meth:`AgentSystem.score`).
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import math
import operator
import re

from rollshard.generate.agents.base import AgentSystem, Episode
from rollshard.store.format.schema import Row

AGENT = "policy"
CALL_END = "</calc>"
CALL_RE = re.compile(r"<calc>(.*?)(?:</calc>|$)", re.S)
MAX_EXPR_CHARS = 200  # longer model output is not a calculation worth running
MAX_DIGITS = 100  # every intermediate integer stays below 10**MAX_DIGITS
_LIMIT = 10**MAX_DIGITS
_MAX_BITS = _LIMIT.bit_length()
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


class CalcError(ValueError):
    """An expression the calculator refuses; the message becomes the tool's answer."""


@dataclasses.dataclass(kw_only=True)
class ToolLoopOptions:
    n_samples: int = 4
    turns: int = 2  # model turns per trajectory


def _bounded(value):
    if isinstance(value, int) and abs(value) >= _LIMIT:
        raise CalcError(f"result over {MAX_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("result too large")
    return value


def _power(base, exponent):
    # Refuse before computing: the size of an integer power is known from its operands.
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * (abs(base).bit_length() - 1) > _MAX_BITS:
            raise CalcError(f"result over {MAX_DIGITS} digits")
    return base**exponent


def calculate(expr: str) -> str:
    """Evaluate an arithmetic expression without ``eval``; ``"error: REASON"`` for anything else."""

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return _bounded(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            op = _power if isinstance(node.op, ast.Pow) else _OPS[type(node.op)]
            return _bounded(op(left, right))
        raise CalcError("not arithmetic")

    text = expr.strip()
    if len(text) > MAX_EXPR_CHARS:
        return f"error: expression over {MAX_EXPR_CHARS} characters"
    try:
        value = ev(ast.parse(text, mode="eval").body)
    except CalcError as e:
        return f"error: {e}"
    except ZeroDivisionError:
        return "error: division by zero"
    except OverflowError:
        return "error: result too large"
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return "error: not arithmetic"
    if isinstance(value, complex):  # a negative base to a fractional power
        return "error: not a real number"
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
        return episode.row(call)
