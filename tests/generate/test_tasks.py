import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollshard.generate.tasks import TASKS, PromptSourceError, get_task, load_prompts
from rollshard.generate.tasks.toy import TOY_CORRECT_THRESHOLD, toy_verify
from rollshard.generate.tasks.verifiers import exact_verify, extract_math_answer, math_verify, normalize_math


@pytest.mark.parametrize(
    "text, label, reward, source",
    [
        ("so the total is \\boxed{12}.", "12", 1.0, "boxed"),
        ("\\boxed{3} then \\boxed{\\frac{3}{2}}", "1.5", 1.0, "boxed"),  # the last box counts
        ("\\boxed{\\text{Paris}}", "paris", 1.0, "boxed"),  # \text{} content, case-folded
        ("we get 7 apples, then 12.0 apples", "12", 1.0, "last_number"),
        ("it costs 1,024 dollars.", "1024", 1.0, "last_number"),
        ("$\\dfrac{1}{2}$", "0.5", 1.0, "last_number"),  # \frac is one number, not "2"
        ("-\\frac{3}{4}", "-0.75", 1.0, "last_number"),
        ("the answer is 12 or maybe 13", "12", 0.0, "last_number"),
        ("\\boxed{12", "12", 1.0, "last_number"),  # unclosed box: the cut-off box is no answer
        ("no digits here", "12", 0.0, None),
    ],
)
def test_math_verify(text, label, reward, source):
    v = math_verify(text, label)
    assert (v.reward, v.correct, v.detail["source"]) == (reward, reward == 1.0, source)


def test_math_normalization_is_exact():
    assert normalize_math("0.1") == normalize_math("1/10") == "1/10"
    assert normalize_math("0.3333333") != normalize_math("1/3")  # values, no float rounding
    assert normalize_math(" 45^\\circ ") == "45"
    assert normalize_math("x = 3") == "x=3"
    assert extract_math_answer("\\boxed{a{b}c}") == ("a{b}c", "boxed")


def test_exact_verify_whitespace_only():
    assert exact_verify("  Paris \n", "Paris").reward == 1.0
    assert exact_verify("New   York", "New York").reward == 1.0
    assert exact_verify("paris", "Paris").reward == 0.0  # case-sensitive


def test_toy_reward_formula():
    # "yr 2024": 6 non-space chars, 4 of them digits -> 4/6
    v = toy_verify("yr 2024", "0123456789")
    assert v.reward == pytest.approx(2 / 3, abs=1e-12)
    assert v.detail == {"hits": 4, "chars": 6}
    assert v.correct and toy_verify("yr 2", None).correct is False  # 1/3 < TOY_CORRECT_THRESHOLD = 0.5
    assert TOY_CORRECT_THRESHOLD == 0.5
    assert toy_verify("", None).reward == 0.0
    assert toy_verify("  \n", None).reward == 0.0
    assert toy_verify("aeiou xyz", "aeiou").reward == pytest.approx(5 / 8)
    assert get_task("toy").verify("12ab", None).reward == 0.5  # label None -> digits


@pytest.mark.parametrize("name", sorted(n for n, t in TASKS.items() if t.generator is None))
def test_every_task_ships_prompts(name):
    task = get_task(name)
    prompts = load_prompts(task.default_prompts(), label_required=task.label_required)
    assert len(prompts) >= 16
    assert len({p.prompt_id for p in prompts}) == len(prompts)
    msgs = task.messages(prompts[0])
    assert msgs[-1]["role"] == "user" and prompts[0].content in msgs[-1]["content"]


def test_math_prompts_are_answerable_by_their_labels():
    # The shipped labels must pass their own verifier when written as a boxed answer.
    task = get_task("math")
    for p in load_prompts(task.default_prompts()):
        assert task.verify(f"\\boxed{{{p.label}}}", p.label).reward == 1.0, p.prompt_id


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_jsonl_ids_labels_and_chat_prompts(tmp_path):
    f = _write(
        tmp_path / "p.jsonl",
        [
            json.dumps({"q": "one", "a": 1}),
            "",
            json.dumps({"q": [{"role": "system", "content": "s"}, {"role": "user", "content": "two"}], "a": 2, "uid": "x"}),
        ],
    )
    ps = load_prompts(f, input_key="q", label_key="a", id_key="uid")
    assert [(p.prompt_id, p.index, p.label, p.problem) for p in ps] == [("000000", 0, 1, "one"), ("x", 1, 2, "two")]
    assert get_task("math").messages(ps[1]) == ps[1].content  # chat prompts are sent as they are


def test_malformed_jsonl_reports_line_numbers(tmp_path):
    f = _write(
        tmp_path / "bad.jsonl",
        [
            json.dumps({"prompt": "fine", "label": "1"}),
            '{"prompt": "broken", ',
            json.dumps({"prompt": "no label"}),
            json.dumps({"text": "wrong key", "label": "1"}),
            json.dumps(["not", "an", "object"]),
            json.dumps({"prompt": "", "label": "1"}),
        ],
    )
    with pytest.raises(PromptSourceError) as e:
        load_prompts(f)
    msg = str(e.value)
    assert msg.startswith(f"{f}:2: not valid JSON")
    assert msg.endswith("(also malformed: 3, 4, 5, 6)")
    assert "\n" not in msg


def test_missing_key_message_names_fields(tmp_path):
    f = _write(tmp_path / "p.jsonl", [json.dumps({"question": "q", "label": 1})])
    with pytest.raises(PromptSourceError, match=r"p\.jsonl:1: no 'prompt' field \(fields: label, question\); pass --input-key"):
        load_prompts(f)


def test_duplicate_ids_and_empty_and_missing_files(tmp_path):
    f = _write(tmp_path / "d.jsonl", [json.dumps({"id": "a", "prompt": "x", "label": 1})] * 2)
    with pytest.raises(PromptSourceError, match=r"d\.jsonl:2: duplicate prompt id 'a' \(first at 1\)"):
        load_prompts(f)
    with pytest.raises(PromptSourceError, match="no prompts in it"):
        load_prompts(_write(tmp_path / "e.jsonl", [""]))
    with pytest.raises(PromptSourceError, match="no such prompt file"):
        load_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(PromptSourceError, match="unknown prompt file type"):
        load_prompts(_write(tmp_path / "p.txt", ["hi"]))


def test_toy_needs_no_label(tmp_path):
    f = _write(tmp_path / "t.jsonl", [json.dumps({"prompt": "count"})])
    assert load_prompts(f, label_required=False)[0].label is None
    with pytest.raises(PromptSourceError, match="no 'label' label"):
        load_prompts(f, label_required=True)


def test_parquet_and_hf_folder(tmp_path):
    table = pa.table({"prompt": ["a", "b", None], "label": ["1", "2", "3"]})
    pq.write_table(table, tmp_path / "p.parquet")
    with pytest.raises(PromptSourceError, match=r"p\.parquet: row 2: 'prompt' must be a non-empty string"):
        load_prompts(tmp_path / "p.parquet")
    pq.write_table(table.slice(0, 2), tmp_path / "p.parquet")
    assert [p.problem for p in load_prompts(tmp_path / "p.parquet")] == ["a", "b"]

    folder = tmp_path / "hf"
    folder.mkdir()
    pq.write_table(table.slice(0, 2), folder / "train.parquet")
    ps = load_prompts(folder, split="train")
    assert [(p.prompt_id, p.problem, p.label) for p in ps] == [("000000", "a", "1"), ("000001", "b", "2")]


def test_prompt_id_with_a_slash_is_refused_at_loading(tmp_path):
    # Sample ids are prompt/agent/round/index: prompt "a/b" would give "a/b/solver/0/1", which also reads as
    # prompt "a", agent "b", round "solver"...: ids could collide, so such prompt ids are refused.
    f = _write(
        tmp_path / "s.jsonl",
        [json.dumps({"id": "ok", "prompt": "x", "label": 1}), json.dumps({"id": "a/b", "prompt": "y", "label": 1})],
    )
    with pytest.raises(PromptSourceError) as e:
        load_prompts(f)
    msg = str(e.value)
    assert msg.startswith(f"{f}:2: prompt id 'a/b' contains '/'")
    assert "change the 'id' field" in msg and "--id-key" in msg and "\n" not in msg
    # Parquet rows are named by 0-based row.
    pq.write_table(pa.table({"uid": ["x/1"], "prompt": ["p"], "label": [1]}), tmp_path / "s.parquet")
    with pytest.raises(PromptSourceError, match=r"s\.parquet: row 0: prompt id 'x/1' contains '/'"):
        load_prompts(tmp_path / "s.parquet", id_key="uid")
