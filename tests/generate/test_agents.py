"""Agent systems against a scripted engine: exact rows, rewards, groups, masks and logprobs."""

import asyncio
import zlib

import pytest

from rollshard.generate.agents import (
    AgentSystem,
    ContextFullError,
    Episode,
    RowProvenanceError,
    derive_seed,
    make_agent_system,
    play,
)
from rollshard.generate.agents.multi_agent import JudgmentStatus, final_answer, parse_judgment
from rollshard.generate.agents.tool_loop import calculate, observation
from rollshard.generate.engines.base import Engine, EngineError, GenerateResult, SamplingParams
from rollshard.generate.tasks import Prompt, get_task
from rollshard.store.format.invariants import check_table
from rollshard.store.format.schema import Status, rows_to_table
from rollshard.store.models.tokenizer import apply_chat_template, encode, load_tokenizer


class ScriptedEngine(Engine):
    """Answers from ``script(agent, index, turn, input_ids) -> text`` (or ``(text, finish_reason)``).

    Logprobs are a deterministic function of the request id, different for every request,
    so a test can tell whose logprobs ended up in which row.
    """

    def __init__(self, tokenizer, script, *, weight_version="v7", delay=0.0, drop_support=False):
        self.tokenizer = tokenizer
        self.script = script
        self.weight_version = weight_version
        self.delay = delay
        self.drop_support = drop_support  # ignore return_sampling_mask, as an engine that does not know it
        self.requests: dict[str, tuple[list[int], SamplingParams, GenerateResult]] = {}

    async def generate(self, input_ids, sampling, *, rid=None):
        if self.delay:
            await asyncio.sleep(self.delay)
        sample_id, turn, _ = rid.rsplit("/", 2)
        _, agent, _, index = sample_id.rsplit("/", 3)
        out = self.script(agent, int(index), int(turn.removeprefix("turn")), list(input_ids))
        text, finish = out if isinstance(out, tuple) else (out, "stop")
        ids = encode(self.tokenizer, text)
        base = zlib.crc32(rid.encode()) % 1000
        logprobs = [-((base + 7 * i) % 997) / 100.0 - 0.001 for i in range(len(ids))]
        # With return_sampling_mask: the token and two neighbours, and half the full logprob (>= it, <= 0).
        asked = sampling.return_sampling_mask and not self.drop_support
        result = GenerateResult(
            output_ids=ids,
            logprobs=logprobs,
            text=text,
            finish_reason=finish,
            weight_version=self.weight_version,
            prompt_tokens=len(input_ids),
            completion_tokens=len(ids),
            sampling_support=[[t + 1, t, t + 2] for t in ids] if asked else None,
            sampling_logprobs=[lp / 2 for lp in logprobs] if asked else None,
        )
        self.requests[rid] = (list(input_ids), sampling, result)
        return result

    async def model_info(self):
        return {"model_path": "scripted", "weight_version": self.weight_version}


@pytest.fixture(scope="module")
def tok(tiny_gpt2):
    return load_tokenizer(tiny_gpt2)


def run_episode(
    system, tok, script, *, task="math", label="12", problem="What is 5 + 7?", max_context_len=None, engine=None, **kw
):
    engine = engine or ScriptedEngine(tok, script)
    episode = Episode(
        prompt=Prompt(prompt_id="p0", index=0, content=problem, label=label),
        task=get_task(task),
        engine=engine,
        tokenizer=tok,
        sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=64, **kw),
        seed=3,
        max_context_len=max_context_len,
        system=system.name,
    )
    rows = asyncio.run(play(system, episode))
    table = rows_to_table(rows)
    assert check_table(table) == []
    return rows, engine


SOLVERS = ["The answer is \\boxed{12}", "I think 13", ""]  # correct, wrong, no answer
REWRITERS = ["wrong: 7", "<think>5 + 7</think> \\boxed{12}", "<think>only thinking</think>  "]  # wrong, right, none


def ma_script(selector_text):
    def script(agent, index, turn, ids):
        return {"solver": SOLVERS, "rewriter": REWRITERS}.get(agent, [selector_text])[index]

    return script


def rewards(rows):
    return {r.sample_id.removeprefix("p0/"): float(r.reward) for r in rows}


def test_multi_agent_rows_rewards_groups_and_logprobs(tok):
    system = make_agent_system("multi_agent", n_samples=3)
    # The last Judgment wins: 2 -> the second rewrite shown, which is correct.
    rows, engine = run_episode(system, tok, ma_script("Judgment: 1. On reflection the second is right.\nJudgment: 2"))
    # Solvers and rewriters by the verifier, selector by its pick; every reward x 1.2 (selector right).
    assert rewards(rows) == pytest.approx(
        {
            "solver/0/0": 1.2, "solver/0/1": 0.0, "solver/0/2": 0.0,
            "rewriter/1/0": 0.0, "rewriter/1/1": 1.2, "rewriter/1/2": 0.0,
            "selector/2/0": 1.2,
        },
        abs=0,
    )
    assert [(r.agent, r.round, r.group_id) for r in rows] == [
        ("solver", 0, "p0/solver/0"), ("solver", 0, "p0/solver/0"), ("solver", 0, "p0/solver/0"),
        ("rewriter", 1, "p0/rewriter/1"), ("rewriter", 1, "p0/rewriter/1"), ("rewriter", 1, "p0/rewriter/1"),
        ("selector", 2, "p0/selector/2"),
    ]
    for row in rows:  # every stored token and logprob is what the engine sent for that call
        (input_ids, sampling, result) = engine.requests[f"{row.sample_id}/turn0/try0"]
        assert list(row.prompt_tokens) == input_ids
        assert list(row.response_tokens) == result.output_ids
        assert list(row.rollout_logprobs) == result.logprobs
        assert list(row.loss_mask) == [1] * len(result.output_ids)
        assert (row.temperature, row.top_p, row.top_k) == (0.7, 0.9, 50)
        assert row.status == Status.COMPLETED and row.weight_version == "v7"
        assert sampling.sampling_seed == derive_seed(3, row.sample_id, 0)
    assert len({tuple(r.rollout_logprobs[:3]) for r in rows if r.response_tokens}) == 6  # distinct per request

    # The solver saw the task's chat prompt; the rewriters saw the two solver answers that parsed.
    msgs = get_task("math").messages(Prompt(prompt_id="p0", index=0, content="What is 5 + 7?"))
    assert list(rows[0].prompt_tokens) == apply_chat_template(tok, msgs)
    rewriter_prompt = rows[3].prompt_text
    assert "### Solution 1\nThe answer is \\boxed{12}\n\n### Solution 2\nI think 13\n\nRead" in rewriter_prompt
    assert "### Solution 3" not in rewriter_prompt
    assert "Here are 2 candidate solutions to the problem." in rewriter_prompt
    # The selector saw the two rewrites that parsed, in rewriter order.
    sel = rows[-1]
    assert "### Solution 1\nwrong: 7\n\n### Solution 2\n\\boxed{12}\n\n" in sel.prompt_text
    assert sel.metadata["judgment"] == 2 and sel.metadata["selected"] == "p0/rewriter/1/1"
    assert sel.metadata["judgment_status"] == "ok" and sel.metadata["answer_status"] == "ok"
    assert sel.metadata["candidates"] == ["p0/rewriter/1/0", "p0/rewriter/1/1"]
    # solver 2 and rewriter 2 answered nothing after their reasoning
    assert [r.metadata["answer_status"] for r in rows[:6]] == ["ok", "ok", "missing", "ok", "ok", "missing"]
    assert sel.metadata["reward_raw"] == 1.0 and sel.metadata["episode_weight"] == 1.2
    assert rows[0].metadata["verdict"]["answer"] == "12"


@pytest.mark.parametrize(
    "selector_text, status, selector_raw, weight",
    [
        ("Judgment: 1", "ok", 0.0, 0.8),  # picks the wrong rewrite: selector 0, episode x 0.8
        ("**Judgment:** 2", "ok", 1.0, 1.2),  # the right rewrite, in markdown: selector 1 x 1.2
        ("judgment: 2", "ok", 1.0, 1.2),  # any case
        ("<think>Judgment: 2</think> Judgment: 1", "ok", 0.0, 0.8),  # only the answer part counts
        ("<think>hmm</think>Judgment:2", "ok", 1.0, 1.2),
        # No valid verdict: the selector gets 0 and the others keep their verifier reward (weight 1.0), so the
        # correct solver 0 and rewriter 1 are stored at 1.0, not 0.8.
        ("Judgment: 3", "out_of_range", 0.0, 1.0),  # 2 candidates
        ("Judgment: 0", "out_of_range", 0.0, 1.0),  # numbered from 1
        ("Judgment: 2. No wait: Judgment: 6", "out_of_range", 0.0, 1.0),  # the last verdict counts, even out of range
        ("I pick the second one.", "missing", 0.0, 1.0),
        ("Judgment: IDX", "missing", 0.0, 1.0),  # the prompt's placeholder echoed
    ],
)
def test_multi_agent_selector_rule(tok, selector_text, status, selector_raw, weight):
    rows, _ = run_episode(make_agent_system("multi_agent", n_samples=3), tok, ma_script(selector_text))
    r = rewards(rows)
    assert r["selector/2/0"] == pytest.approx(selector_raw * weight, abs=1e-12)
    assert r["solver/0/0"] == pytest.approx(weight, abs=1e-12)
    assert r["rewriter/1/1"] == pytest.approx(weight, abs=1e-12)
    assert [r.metadata["episode_weight"] for r in rows] == [weight] * 7
    sel = rows[-1].metadata
    assert sel["judgment_status"] == status
    if status == "ok":
        assert sel["selected"] == sel["candidates"][sel["judgment"] - 1]
    else:
        assert sel["judgment"] is None and sel["selected"] is None


def test_multi_agent_early_stops_and_weight_off(tok):
    # No rewrite parses: solvers and rewriters only, x 1.0 (no selector, no verdict): the correct solver keeps 1.0.
    def no_rewrites(agent, index, turn, ids):
        return SOLVERS[index] if agent == "solver" else "  "

    rows, _ = run_episode(make_agent_system("multi_agent", n_samples=3), tok, no_rewrites)
    assert rewards(rows) == {
        "solver/0/0": 1.0, "solver/0/1": 0.0, "solver/0/2": 0.0, "rewriter/1/0": 0.0, "rewriter/1/1": 0.0,
        "rewriter/1/2": 0.0,
    }
    assert {r.metadata["episode_weight"] for r in rows} == {1.0}
    # No solver answer parses (require_reasoning and none has </think>): solver rows only.
    system = make_agent_system("multi_agent", n_samples=2, options={"require_reasoning": "true"})
    rows, engine = run_episode(system, tok, lambda a, i, t, ids: "\\boxed{12}")
    assert rewards(rows) == {"solver/0/0": 0.0, "solver/0/1": 0.0}
    assert len(engine.requests) == 2
    # correct_weight=1 incorrect_weight=1 keeps the verifier's rewards as they are.
    system = make_agent_system("multi_agent", n_samples=3, options={"correct_weight": "1", "incorrect_weight": "1"})
    rows, _ = run_episode(system, tok, ma_script("Judgment: 1"))
    assert rewards(rows)["solver/0/0"] == 1.0 and rewards(rows)["selector/2/0"] == 0.0


def test_multi_agent_shaped_task_selector_takes_the_rewrite_reward(tok):
    # toy task: reward = digit fraction. The selector gets the selected rewrite's reward; "right" iff >= 0.5.
    def script(agent, index, turn, ids):
        return {"solver": ["12ab", "1"], "rewriter": ["1abc", "123a"]}.get(agent, ["Judgment: 2"])[index]

    rows, _ = run_episode(make_agent_system("multi_agent", n_samples=2), tok, script, task="toy", label=None)
    # rewriter 1 "123a" -> 3/4, correct -> weight 1.2
    assert rewards(rows) == pytest.approx(
        {
            "solver/0/0": 0.5 * 1.2, "solver/0/1": 1.0 * 1.2,
            "rewriter/1/0": 0.25 * 1.2, "rewriter/1/1": 0.75 * 1.2,
            "selector/2/0": 0.75 * 1.2,
        },
        rel=1e-12,
    )


def test_parsers():
    assert final_answer("<think>a</think> b ", "</think>", False) == "b"
    assert final_answer("<think>a</think>", "</think>", False) is None
    assert final_answer(" plain ", "</think>", False) == "plain"
    assert final_answer(" plain ", "</think>", True) is None


OK, OUT, MISSING = JudgmentStatus.OK, JudgmentStatus.OUT_OF_RANGE, JudgmentStatus.MISSING


@pytest.mark.parametrize(
    "text, status, number",
    [
        ("Judgment: 2", OK, 2),
        ("**Judgment:** 2", OK, 2),
        ("**Judgment: 2**", OK, 2),
        ("Judgment: **2**", OK, 2),
        ("### Judgment: 2", OK, 2),
        ("**Judgment**: 2", OK, 2),
        ("judgment: 2", OK, 2),
        ("JUDGMENT:2", OK, 2),
        ("Judgement: 2", OK, 2),
        ("Judgment: Solution 2", OK, 2),
        ("Judgment: #2", OK, 2),
        ("Judgment: [2]", OK, 2),
        ("Judgment: **Solution #3**.", OK, 3),
        ("Solution 1 has a slip.\n\n**Judgment:** Solution #4", OK, 4),
        ("Judgment: 1 at first. On reflection, solution 3.\n**Judgment:** 3", OK, 3),  # the last verdict
        ("Judgment: 3\nJudgment: 5", OUT, 5),  # the last verdict, out of range: not the earlier valid one
        ("Judgment: 0", OUT, 0),
        ("Judgment: 6", OUT, 6),
        ("Judgment: IDX", MISSING, None),
        ("Solution 2 is the best.", MISSING, None),  # a solution named outside a verdict is not one
        ("a misjudgment: 2", MISSING, None),
        ("", MISSING, None),
        (None, MISSING, None),
    ],
)
def test_parse_judgment(text, status, number):
    judgment = parse_judgment(text, 4)
    assert (judgment.status, judgment.number) == (status, number)
    assert judgment.index == (number - 1 if status is OK else None)


def test_single_rows_and_group(tok):
    system = make_agent_system("single", n_samples=3)
    rows, engine = run_episode(system, tok, lambda a, i, t, ids: ["\\boxed{12}", "13", "", ][i])
    assert [(r.sample_id, r.group_id, r.agent, r.round, float(r.reward)) for r in rows] == [
        ("p0/policy/0/0", "p0/policy/0", "policy", 0, 1.0),
        ("p0/policy/0/1", "p0/policy/0", "policy", 0, 0.0),
        ("p0/policy/0/2", "p0/policy/0", "policy", 0, 0.0),
    ]
    seeds = [engine.requests[f"p0/policy/0/{i}/turn0/try0"][1].sampling_seed for i in range(3)]
    assert len(set(seeds)) == 3  # each sample its own seed


def test_context_limit(tok):
    system = make_agent_system("single", n_samples=1)
    msgs = get_task("math").messages(Prompt(prompt_id="p0", index=0, content="What is 5 + 7?"))
    n = len(apply_chat_template(tok, msgs))
    with pytest.raises(ContextFullError, match=f"the policy prompt is {n} tokens and the context {n}: no room"):
        run_episode(system, tok, lambda *a: "x", max_context_len=n)
    rows, engine = run_episode(system, tok, lambda *a: "x", max_context_len=n + 8)
    (ids, sampling, _), = engine.requests.values()
    assert len(ids) == n and sampling.max_new_tokens == 8  # capped to what the context leaves (64 asked)


def test_tool_loop_masks_environment_tokens(tok):
    def script(agent, index, turn, ids):
        return ["let me compute <calc>3*4</calc>", "so it is \\boxed{12}"][turn]

    system = make_agent_system("tool_loop", n_samples=2)
    rows, engine = run_episode(system, tok, script)
    assert len(rows) == 2
    row = rows[0]
    in0, s0, r0 = engine.requests["p0/policy/0/0/turn0/try0"]
    in1, s1, r1 = engine.requests["p0/policy/0/0/turn1/try0"]
    env = encode(tok, "\n<result>12</result>\n")
    n0, ne, n1 = len(r0.output_ids), len(env), len(r1.output_ids)
    assert list(row.prompt_tokens) == in0
    assert list(row.response_tokens) == r0.output_ids + env + r1.output_ids
    assert in1 == in0 + r0.output_ids + env  # the second turn continues the same token stream
    assert list(row.loss_mask) == [1] * n0 + [0] * ne + [1] * n1
    assert list(row.rollout_logprobs) == r0.logprobs + [0.0] * ne + r1.logprobs
    assert row.response_text == "let me compute <calc>3*4</calc>\n<result>12</result>\nso it is \\boxed{12}"
    assert float(row.reward) == 1.0 and row.metadata["turns"] == 2
    assert "</calc>" in s0.stop and s0.no_stop_trim
    assert s0.sampling_seed != s1.sampling_seed
    # One version produced both turns: one span over the whole response, environment included.
    assert [(s.version, s.start, s.end) for s in row.weight_versions] == [("v7", 0, n0 + ne + n1)]


def test_tool_loop_environment():
    assert calculate("2 + 3 * (4 - 1)") == "11"
    assert calculate("7 / 2") == "3.5" and calculate("2 ** -2") == "0.25"
    assert calculate("10 ** 99") == "1" + "0" * 99  # the largest power of ten under MAX_DIGITS = 100 digits
    assert calculate("2 ** 1000") == "error: result over 100 digits"
    assert calculate("__import__('os')") == "error: not arithmetic"
    assert calculate("1 / 0") == "error: division by zero" and calculate("5 % 0") == "error: division by zero"
    assert calculate("(-8) ** 0.5") == "error: not a real number"
    assert calculate("1e308 * 10") == "error: result too large" and calculate("10.0 ** 400") == "error: result too large"
    assert calculate("1" * 201) == "error: expression over 200 characters"
    assert observation("no call here") == "\n<result>no calculation</result>\n"
    assert observation("<calc>1+1</calc> and <calc>2*5") == "\n<result>10</result>\n"  # the last call, even cut at the stop


@pytest.mark.parametrize(
    "expr",
    [
        "((10**64)**64)**64",  # raised an uncaught ValueError (int -> str over 4,300 digits)
        "(((10**64)**64)**64)**64",  # ran for more than 8 s
        "9**64**64",
        "10.0**64**64",
        "(10**50*10**50)*(10**50*10**50)",
        "-(10**99)*10",
    ],
)
def test_calculator_bounds_the_work_of_hostile_expressions(expr):
    # Refused by the size of the operands before any big number is built: this returns at once whatever the
    # machine, where unbounded evaluation would raise, or run for minutes (the test's timeout catches that).
    assert calculate(expr) == "error: result over 100 digits"
    assert observation(f"<calc>{expr}</calc>") == "\n<result>error: result over 100 digits</result>\n"


def test_unknown_system_and_options():
    with pytest.raises(ValueError, match="unknown agent system 'nope'"):
        make_agent_system("nope")
    with pytest.raises(ValueError, match="multi_agent has no option 'k'"):
        make_agent_system("multi_agent", options={"k": "1"})
    with pytest.raises(ValueError, match="expected float"):
        make_agent_system("multi_agent", options={"correct_weight": "high"})
    assert make_agent_system("multi_agent", n_samples=5).options.num_rewriters == 5


def test_episode_refuses_a_prompt_id_with_a_slash(tok):
    with pytest.raises(ValueError, match=r"prompt id 'a/b' contains '/'"):
        Episode(
            prompt=Prompt(prompt_id="a/b", index=0, content="What is 5 + 7?", label="12"), task=get_task("math"),
            engine=ScriptedEngine(tok, []), tokenizer=tok, sampling=SamplingParams(),
        )


# ---- sampling support (schema 1.1) ---------------------------------------------------------------


def _tool_script(agent, index, turn, ids):
    return ["let me compute <calc>3*4</calc>", "so it is \\boxed{12}"][turn]


def test_tool_loop_keeps_each_turns_support_and_none_between_turns(tok):
    rows, engine = run_episode(make_agent_system("tool_loop", n_samples=1), tok, _tool_script, return_sampling_mask=True)
    (row,) = rows
    _, s0, r0 = engine.requests["p0/policy/0/0/turn0/try0"]
    _, s1, r1 = engine.requests["p0/policy/0/0/turn1/try0"]
    ne = len(encode(tok, "\n<result>12</result>\n"))
    assert s0.return_sampling_mask and s1.return_sampling_mask  # every turn asks, the tool's stop added or not
    assert list(row.sampling_support) == r0.sampling_support + [[]] * ne + r1.sampling_support
    assert list(row.sampling_logprobs) == r0.sampling_logprobs + [0.0] * ne + r1.sampling_logprobs
    assert len(row.sampling_support) == len(row.response_tokens)  # and run_episode checked the store invariants


def test_rows_carry_no_support_unless_asked(tok):
    rows, _ = run_episode(make_agent_system("tool_loop", n_samples=1), tok, _tool_script)
    assert rows[0].sampling_support is None and rows[0].sampling_logprobs is None


def test_an_engine_that_ignores_the_request_fails_the_call(tok):
    engine = ScriptedEngine(tok, _tool_script, drop_support=True)
    with pytest.raises(EngineError, match="p0/policy/0/0 turn 0: the engine returned no sampling support"):
        run_episode(make_agent_system("single", n_samples=1), tok, None, engine=engine, return_sampling_mask=True)


class _EditSupport(AgentSystem):
    """Returns its rows with the support of the first token edited (a plugin may not)."""

    name = "edit_support"
    max_parallel_calls = 1

    def __init__(self, edit):
        self.edit = edit

    async def run(self, episode):
        call = await episode.call("policy", 0, 0, episode.task.messages(episode.prompt))
        row = episode.row(call)
        self.edit(row)
        return [row]


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda row: row.sampling_support[0].append(5), "sampling_support"),
        (lambda row: row.sampling_logprobs.__setitem__(0, 0.0), "sampling_logprobs"),
        (lambda row: setattr(row, "sampling_support", None), "sampling_support"),
    ],
)
def test_check_rows_holds_the_support_to_the_call(tok, edit, field):
    with pytest.raises(RowProvenanceError, match=f"changed {field} of 'p0/policy/0/0'"):
        run_episode(_EditSupport(edit), tok, lambda *a: "\\boxed{12}", return_sampling_mask=True)
    rows, _ = run_episode(_EditSupport(lambda row: None), tok, lambda *a: "\\boxed{12}", return_sampling_mask=True)
    assert rows[0].sampling_support  # unedited: accepted
