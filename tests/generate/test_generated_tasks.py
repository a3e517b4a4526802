"""The generated tasks (arithmetic, countdown): verifiers on worked cases, seeded disjoint splits, options, a run."""

import json
from fractions import Fraction

import pytest

from rollshard.generate.run import main
from rollshard.generate.tasks import TaskOptionError, get_task, parse_task_options
from rollshard.generate.tasks.arithmetic import problem as arithmetic_problem
from rollshard.generate.tasks.countdown import evaluate
from rollshard.generate.tasks.generated import EVAL_MODULUS, key_hash, split_of
from rollshard.store.io.dataset import RolloutDataset


def generated(task, split="train", **options):
    generator = get_task(task).generator
    resolved = generator.resolve({k: str(v) for k, v in options.items()}, split)
    return generator.problems(split, resolved), generator.prompts(split, resolved)


# -- arithmetic ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, reward, answer",
    [
        ("34 - 41 = -7, so \\boxed{-7}", 1.0, "-7"),
        ("The answer is -7.", 1.0, "-7"),
        ("34 - 41 = -7.0", 1.0, "-7.0"),  # compared by value
        ("\\boxed{-7} since 41 - 34 = 7", 1.0, "-7"),  # the box wins over a later number
        ("34 - 41 = 7", 0.0, "7"),  # the sign counts
        ("\\boxed{-8}", 0.0, "-8"),
        ("\\boxed{-7.5}", 0.0, "-7.5"),
        ("I don't know", 0.0, None),
    ],
)
def test_arithmetic_verifier_checks_the_integer_exactly(text, reward, answer):
    task = get_task("arithmetic")
    p = arithmetic_problem(34, "-", 41)
    assert (p.key, p.content, p.label) == ("34-41", "What is 34 - 41?", -7)
    v = task.verify(text, p.label)
    assert (v.reward, v.answer) == (reward, answer)


def test_arithmetic_problems_and_their_message():
    # 34 + 41 and 41 + 34 are one problem: one key, one rendering, whichever order was drawn.
    assert arithmetic_problem(34, "+", 41) == arithmetic_problem(41, "+", 34)
    assert arithmetic_problem(41, "+", 34).key == "34+41" and arithmetic_problem(34, "+", 41).label == 75
    assert arithmetic_problem(12, "*", 11).label == 132 and "×" in arithmetic_problem(12, "*", 11).content
    # Subtraction keeps its order: 41 - 34 is another problem than 34 - 41.
    assert (arithmetic_problem(41, "-", 34).key, arithmetic_problem(41, "-", 34).label) == ("41-34", 7)
    task = get_task("arithmetic")
    _, prompts = generated("arithmetic", "eval", size=3)
    assert task.messages(prompts[0]) == [
        {"role": "user", "content": f"{prompts[0].content}\nGive the final answer as \\boxed{{ANSWER}}."}
    ]
    for p in generated("arithmetic", "eval", size=50)[0]:  # every reference answer passes the verifier
        assert task.verify(p.solution, p.label).reward == 1.0, p.key


def test_arithmetic_options_shape_the_problems():
    problems, _ = generated("arithmetic", digits=3, ops="*", size=200)
    for p in problems:
        a, op, b = p.content.removeprefix("What is ").removesuffix("?").split()
        assert op == "×" and 100 <= int(a) <= 999 and 100 <= int(b) <= 999 and p.label == int(a) * int(b)
    problems, _ = generated("arithmetic", digits=1, ops="-+", size=40)
    shown = [p.content.split()[3] for p in problems]
    assert set(shown) == {"+", "-"}
    assert all(0 <= int(n) <= 9 for p in problems for n in p.content[8:-1].split(" ")[::2])


def test_a_split_smaller_than_asked_names_how_many_it_has():
    # digits=1, ops=+: the keys a+b with 0 <= a <= b <= 9 are the 55 problems; those whose hash is 0 mod 10 are eval.
    keys = {f"{a}+{b}" for a in range(10) for b in range(a, 10)}
    held_out = {k for k in keys if key_hash("arithmetic", k) % EVAL_MODULUS == 0}
    assert len(keys) == 55 and 0 < len(held_out) < 15
    with pytest.raises(TaskOptionError) as e:
        generated("arithmetic", "eval", digits=1, ops="+")  # the default eval size, 500
    msg = str(e.value)
    assert msg.startswith(f"task arithmetic: only {len(held_out)} distinct eval problems in 25000 draws (digits=1, ops=+)")
    assert f"pass --task-option size={len(held_out)} or less" in msg and "\n" not in msg
    problems, _ = generated("arithmetic", "eval", digits=1, ops="+", size=len(held_out))
    assert {p.key for p in problems} == held_out


# -- splits ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["arithmetic", "countdown"])
def test_default_splits_are_disjoint_deterministic_and_seeded(task):
    train_problems, train = generated(task, "train")
    eval_problems, held_out = generated(task, "eval")
    assert (len(train), len(held_out)) == (5000, 500)  # the default sizes
    train_keys, eval_keys = {p.key for p in train_problems}, {p.key for p in eval_problems}
    assert len(train_keys) == 5000 and len(eval_keys) == 500  # no problem twice
    assert not train_keys & eval_keys
    assert all(split_of(task, k) == "eval" for k in eval_keys) and all(split_of(task, k) == "train" for k in train_keys)
    # Another seed draws other train problems, never an eval one.
    other_keys = {p.key for p in generated(task, "train", seed=1)[0]}
    assert other_keys != train_keys and not other_keys & eval_keys
    # Ids: task, split and the problem's hash; distinct across splits; the same on a second generation.
    assert all(p.prompt_id == f"{task}-eval-{key_hash(task, q.key):016x}" for p, q in zip(held_out, eval_problems))
    assert not {p.prompt_id for p in train} & {p.prompt_id for p in held_out}
    assert generated(task, "eval")[1] == held_out
    assert [p.index for p in held_out] == list(range(500))
    # A smaller size is a prefix of a larger one (as --limit takes the first N).
    assert generated(task, "eval", size=120)[1] == held_out[:120]


# -- countdown -------------------------------------------------------------------------------------

LABEL = {"numbers": [2, 3, 7, 25], "target": 47}


@pytest.mark.parametrize(
    "text, reward, error",
    [
        ("<think>25 times 2 is 50</think> <answer>25 * 2 - 3</answer>", 1.0, None),  # 50 - 3 = 47; 7 unused is fine
        ("<answer>(25 * 2) - 3 = 47</answer>", 1.0, None),  # a trailing "= N" is dropped
        ("\\boxed{25 \\times 2 - 3}", 1.0, None),
        ("<answer>1 + 1</answer> then <answer>25 * 2 - 3 + 7 - 7</answer>", 0.0,  # the last one counts: 7 twice
         "uses [7] beyond the given numbers [2, 3, 7, 25]"),
        ("<answer>25 * 2 - 3 * 1</answer>", 0.0, "uses [1] beyond the given numbers [2, 3, 7, 25]"),  # 47, with a 1
        ("<answer>25 + 2 + 7</answer>", 0.0, None),  # 34, not 47
        ("<answer>25 * 2 ** 1</answer>", 0.0, "Pow is not allowed: only integers and binary + - * /"),
        ("<answer>-3 + 50</answer>", 0.0, "USub is not allowed: only integers and binary + - * /"),
        ("<answer>25 // 2</answer>", 0.0, "FloorDiv is not allowed: only integers and binary + - * /"),
        ("<answer>__import__('os').system('echo hi')</answer>", 0.0,
         "only integers, + - * /, parentheses and spaces are allowed"),
        ("<answer>" + "2 + " * 60 + "2</answer>", 0.0, "longer than 200 characters"),
        ("<answer>25 * (2 - 3</answer>", 0.0, "not an arithmetic expression ('(' was never closed)"),
        ("25 * 2 - 3", 0.0, "no <answer> tags or \\boxed{}"),
    ],
)
def test_countdown_verifier(text, reward, error):
    v = get_task("countdown").verify(text, LABEL)
    assert (v.reward, v.correct, v.detail["error"]) == (reward, reward == 1.0, error)


def test_countdown_division_is_exact_and_by_zero_scores_zero():
    # 7 / 2 * 4 = 14 exactly (7 // 2 * 4 would be 12).
    assert evaluate("7 / 2 * 4", [2, 4, 7]) == (Fraction(14), [2, 4, 7])
    verify = get_task("countdown").verify
    assert verify("<answer>7 / 2 * 4</answer>", {"numbers": [2, 4, 7], "target": 14}).reward == 1.0
    v = verify("<answer>6 / (4 - 4)</answer>", {"numbers": [4, 4, 6], "target": 6})
    assert (v.reward, v.detail["error"]) == (0.0, "division by zero")
    v = verify("<answer>(4 - 4) / 6 + 6</answer>", {"numbers": [4, 4, 6, 6], "target": 6})  # 0/6 is fine
    assert (v.reward, v.detail["value"]) == (1.0, "6")
    with pytest.raises(ValueError, match="a countdown label is"):
        verify("<answer>1</answer>", "47")


def test_countdown_problems_are_solvable_and_follow_the_options():
    task = get_task("countdown")
    problems, prompts = generated("countdown", "eval")
    for p, prompt in zip(problems, prompts):
        numbers, target = p.label["numbers"], p.label["target"]
        assert 3 <= len(numbers) <= 4 and all(1 <= n <= 99 for n in numbers) and 1 <= target <= 100
        shown = json.loads(prompt.content.split("numbers ")[1].split("]")[0] + "]")
        assert sorted(shown) == numbers and prompt.content.endswith(f"create an equation that equals {target}.")
        assert task.verify(p.solution, p.label).reward == 1.0, p.solution
    problems, _ = generated("countdown", min_numbers=4, max_numbers=4, max_number=9, max_target=20, size=100)
    assert all(len(p.label["numbers"]) == 4 and max(p.label["numbers"]) <= 9 for p in problems)
    assert all(1 <= p.label["target"] <= 20 and task.verify(p.solution, p.label).reward == 1.0 for p in problems)


# -- options ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "task, split, options, message",
    [
        ("arithmetic", "train", {"digits": "0"}, "task arithmetic: option digits='0' must be an integer from 1 to 9"),
        ("arithmetic", "train", {"digits": "two"}, "task arithmetic: option digits='two' must be an integer from 1 to 9"),
        ("arithmetic", "train", {"ops": "+/"},
         "task arithmetic: option ops='+/' must be one or more of + - * without repeats, e.g. +-*"),
        ("arithmetic", "train", {"digit": "2"}, "task arithmetic has no option 'digit'; its options: digits, ops, seed, size"),
        ("arithmetic", "train", {"size": "0"}, "task arithmetic: option size='0' must be an integer from 1 to 100000"),
        ("arithmetic", "test", {}, "--split test: task arithmetic has the splits train and eval"),
        ("countdown", "train", {"min_numbers": "4", "max_numbers": "3"},
         "task countdown: min_numbers=4 is more than max_numbers=3; give min_numbers <= max_numbers"),
    ],
)
def test_bad_options_are_one_line(task, split, options, message):
    with pytest.raises(TaskOptionError) as e:
        get_task(task).generator.resolve(options, split)
    assert str(e.value) == message


def test_task_option_parsing():
    assert parse_task_options(["digits=3", " ops = +-* "]) == {"digits": "3", "ops": "+-*"}
    with pytest.raises(TaskOptionError, match=r"^--task-option 'digits': expected KEY=VALUE, e\.g\. --task-option size=100$"):
        parse_task_options(["digits"])
    with pytest.raises(TaskOptionError, match=r"^--task-option size is given twice \('1' and '2'\); give it once$"):
        parse_task_options(["size=1", "size=2"])
    assert get_task("arithmetic").generator.resolve({}, "eval") == {"digits": 2, "ops": "+-", "seed": 0, "size": 500}


# -- through rollshard-generate --------------------------------------------------------------------


@pytest.mark.parametrize("task", ["arithmetic", "countdown"])
def test_a_run_writes_the_eval_prompts_with_their_labels(task, tiny_gpt2, tmp_path):
    out = tmp_path / "ds"
    args = [
        "--engine", f"embedded:{tiny_gpt2}", "--task", task, "--split", "eval", "--task-option", "size=8",
        "--task-option", "seed=3", "--limit", "3", "--n-samples", "2", "--max-new-tokens", "4", "--concurrency", "1",
        "--no-progress", "--out", str(out),
    ]  # fmt: skip
    assert main(args) == 0
    dataset = RolloutDataset.open(out)
    rows = dataset.read().to_pylist()
    expected = {p.prompt_id: p for p in generated(task, "eval", size=8, seed=3)[1][:3]}
    assert len(rows) == 6 and {r["prompt_id"] for r in rows} == set(expected)
    verify = get_task(task).verify
    for r in rows:
        prompt = expected[r["prompt_id"]]
        assert r["prompt_id"].startswith(f"{task}-eval-") and prompt.content in r["prompt_text"]
        assert json.loads(r["metadata"])["label"] == prompt.label
        assert r["reward"] == verify(r["response_text"], prompt.label).reward
    options = get_task(task).generator.resolve({"size": "8", "seed": "3"}, "eval")
    assert dataset.config["split"] == "eval" and dataset.config["task_options"] == options
    assert dataset.config["prompts"] == f"{task}[eval]"


def test_run_usage_errors_for_task_options(tiny_gpt2, tmp_path, capsys):
    base = ["--engine", f"embedded:{tiny_gpt2}", "--no-progress", "--out", str(tmp_path / "ds")]
    cases = [
        (["--task", "arithmetic", "--task-option", "ops=/"],
         "task arithmetic: option ops='/' must be one or more of + - * without repeats, e.g. +-*"),
        (["--task", "countdown", "--split", "validation"],
         "--split validation: task countdown has the splits train and eval"),
        (["--task", "math", "--task-option", "digits=3"],
         "--task-option is for a task that generates its prompts (arithmetic, countdown), not for task 'math' "
         "reading its prompt file; drop --task-option"),
    ]  # fmt: skip
    for extra, message in cases:
        capsys.readouterr()
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert err == f"rollshard-generate: error: {message}\n"
    assert not (tmp_path / "ds").exists()
