"""rollshard-store stats / inspect on a small hand-built dataset whose numbers are worked out below."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from rollshard.store.commands import main
from rollshard.store.format.schema import Row, Status
from rollshard.store.inspection.stats import tokenizer_path
from rollshard.store.io.writer import ShardWriter
from tests import forked

CONSOLE_SCRIPT = Path(sys.executable).with_name("rollshard-store")
WORDS = ["[UNK]", "the", "answer", "is", "42", "<tool>", "</tool>", "calc", "ok", "done"]


def _row(sid, group, agent, rnd, n_prompt, mask, reward, status=Status.COMPLETED, finish="stop", wv="0"):
    n = len(mask)
    # logprob -0.1 * (position + 1) under mask 1, 0.0 under mask 0 (tool tokens)
    lp = [-0.1 * (i + 1) if m else 0.0 for i, m in enumerate(mask)]
    return Row(
        sample_id=sid,
        prompt_id=group.split("/")[0],
        group_id=group,
        agent=agent,
        round=rnd,
        prompt_tokens=[1] * n_prompt,
        response_tokens=[(i % 9) + 1 for i in range(n)],
        rollout_logprobs=lp,
        loss_mask=mask,
        reward=reward,
        status=status,
        finish_reason=finish,
        weight_version=wv,
        temperature=1.0,
    )


# Worked dataset (prompt p0 by writer w0, prompt p1 by writer w1):
#   row                 group        round len mask   reward status     wv
#   p0-solver-0         p0/solver    0     3   111    1.0    completed  0
#   p0-solver-1         p0/solver    0     5   11001  0.0    completed  0
#   p0-rewriter-0       p0/rewriter  1     2   11     1.0    completed  0
#   p0-rewriter-1       p0/rewriter  1     4   1111   1.0    truncated  0
#   p0-selector-0       p0/selector  2     1   1      1.0    completed  0
#   p1-solver-0         p1/solver    0     2   11     0.5    completed  1
#   p1-solver-1         p1/solver    0     2   11     0.0    completed  1
#   p1-solver-2         p1/solver    0     0   -      None   failed     1
# prompt tokens: 5 rows x 4 + 3 rows x 3 = 29; response tokens 3+5+2+4+1 + 2+2+0 = 19.
P0 = [
    ("p0/solver", [_row("p0-solver-0", "p0/solver", "solver", 0, 4, [1, 1, 1], 1.0),
                   _row("p0-solver-1", "p0/solver", "solver", 0, 4, [1, 1, 0, 0, 1], 0.0)]),
    ("p0/rewriter", [_row("p0-rewriter-0", "p0/rewriter", "rewriter", 1, 4, [1, 1], 1.0),
                     _row("p0-rewriter-1", "p0/rewriter", "rewriter", 1, 4, [1, 1, 1, 1], 1.0,
                          status=Status.TRUNCATED, finish="length")]),
    ("p0/selector", [_row("p0-selector-0", "p0/selector", "selector", 2, 4, [1], 1.0)]),
]
P0[0][1][1].prompt_text = "Compute 6 x 7 [/] [bold]now"  # shown as is, never parsed as rich markup
P1 = [
    ("p1/solver", [_row("p1-solver-0", "p1/solver", "solver", 0, 3, [1, 1], 0.5, wv="1"),
                   _row("p1-solver-1", "p1/solver", "solver", 0, 3, [1, 1], 0.0, wv="1"),
                   _row("p1-solver-2", "p1/solver", "solver", 0, 3, [], None, status=Status.FAILED,
                        finish=None, wv="1")]),
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A word-level tokenizer over WORDS, saved as a transformers tokenizer folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def worked(tmp_path_factory, tokenizer_dir) -> Path:
    root = tmp_path_factory.mktemp("worked") / "ds"
    tok = str(tokenizer_dir)
    for writer_id, groups in (("w0", P0), ("w1", P1)):
        config = {"engine": {"kind": "embedded", "model": tok}, "agent_system": "multi_agent"}
        with ShardWriter(root, writer_id=writer_id, config=config) as w:
            for _, rows in groups:
                w.write_group(rows)
    return root


def run(*args: str, script: bool = False) -> subprocess.CompletedProcess:
    if not script:
        return forked.run("rollshard.store", *args, timeout=120)
    return subprocess.run([str(CONSOLE_SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def stats_json(worked) -> dict:
    res = run("stats", worked, "--json", script=True)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_stats_json_worked_values(worked, stats_json):
    st = stats_json
    assert (st["rows"], st["groups"], st["shards"], st["writers"]) == (8, 4, 2, 2)
    assert (st["prompt_tokens"], st["response_tokens"], st["tokens"]) == (29, 19, 48)
    assert st["bytes"] == sum(p.stat().st_size for p in (worked / "shards").glob("*.parquet"))
    assert st["status"] == {"completed": 6, "truncated": 1, "aborted": 0, "failed": 1}
    assert st["schema_version"] == "1.2"
    solver, rewriter, selector = (st["agents"][a] for a in ("solver", "rewriter", "selector"))
    # solver: 5 rows, 2 groups, response 3+5+2+2+0 = 12, trainable 3+3+2+2 = 10
    assert (solver["rows"], solver["groups"], solver["response_tokens"], solver["trainable_tokens"]) == (5, 2, 12, 10)
    # finite rewards [1, 0, 0.5, 0]: mean 0.375; squared deviations .390625+.140625+.015625+.140625 = .6875,
    # over n - 1 = 3 (unbiased, as the trainer's advantages: store.groups.REWARD_STD_DDOF)
    assert solver["reward_rows"] == 4
    assert solver["reward_mean"] == pytest.approx(0.375, abs=1e-12)
    assert solver["reward_std"] == pytest.approx(math.sqrt(0.6875 / 3), abs=1e-12)
    assert (rewriter["rows"], rewriter["response_tokens"], rewriter["reward_mean"], rewriter["reward_std"]) == (
        2, 6, 1.0, 0.0)
    assert (selector["rows"], selector["groups"], selector["response_tokens"]) == (1, 1, 1)
    assert all(a["parse"] == {} for a in st["agents"].values())  # no row records a parse status
    # by-agent lengths (from loss_mask) add up to the manifest's response token count
    assert sum(a["response_tokens"] for a in st["agents"].values()) == st["response_tokens"]


def test_inspect_json_matches_stats_and_worked_values(worked, stats_json):
    stats = stats_json
    res = run("inspect", worked, "--json")
    assert res.returncode == 0, res.stderr
    ins = json.loads(res.stdout)
    assert ins["stats"] == stats
    assert ins["config"]["agent_system"] == "multi_agent"
    assert [(w["writer_id"], w["shards"], w["rows"], w["groups"]) for w in ins["writers"]] == [
        ("w0", 1, 5, 3), ("w1", 1, 3, 1)]
    assert ins["finish_reason"] == {"stop": 6, "length": 1, "null": 1}  # the failed row has none
    by_round = {(r["agent"], r["round"]): r for r in ins["reward_by_agent_round"]}
    assert sorted(by_round) == [("rewriter", 1), ("selector", 2), ("solver", 0)]
    assert (by_round["solver", 0]["rows"], by_round["solver", 0]["reward_rows"]) == (5, 4)
    assert by_round["solver", 0]["reward_mean"] == pytest.approx(0.375, abs=1e-12)
    assert sum(r["rows"] for r in by_round.values()) == stats["rows"]
    lengths = {r["agent"]: r for r in ins["response_length"]}
    # solver lengths [0, 2, 2, 3, 5]: mean 2.4, nearest p50 -> 2, p90 -> index round(3.6) = 4 -> 5
    assert (lengths["solver"]["mean"], lengths["solver"]["p50"], lengths["solver"]["p90"]) == (2.4, 2, 5)
    assert lengths["rewriter"]["truncated_frac"] == 0.5 and lengths["solver"]["truncated_frac"] == 0.0
    for agent, r in lengths.items():  # the same tokens as stats, counted another way
        assert r["mean"] * r["rows"] == pytest.approx(stats["agents"][agent]["response_tokens"])
    # zero variance (2+ rows, equal rewards): p0/rewriter [1, 1]; not p0/solver [1, 0] nor p1/solver [0.5, 0];
    # p0/selector [1] is single-member: the trainer trains it on its reward
    zv = ins["zero_variance_groups"]
    assert (zv["groups"], zv["zero_variance"], zv["single_member"], zv["fraction"]) == (4, 1, 1, 0.25)
    assert {a: z["zero_variance"] for a, z in zv["by_agent"].items()} == {"rewriter": 1, "selector": 0, "solver": 0}
    assert {a: z["single_member"] for a, z in zv["by_agent"].items()} == {"rewriter": 0, "selector": 1, "solver": 0}
    assert {r["weight_version"]: r["rows"] for r in ins["weight_version"]} == {"0": 5, "1": 3}


def test_inspect_and_stats_tables(worked, capsys):
    res = run("inspect", worked)
    assert res.returncode == 0, res.stderr
    for needle in ("schema_version", "1.2", "engine.model", "multi_agent", "w0", "w1", "0.3750", "truncated",
                   "zero reward variance", "single-member", "25.0%", "weight_version"):
        assert needle in res.stdout, needle
    assert main(["stats", str(worked)]) == 0
    out = capsys.readouterr().out
    assert "0.3750" in out and "0.4787" in out  # sqrt(.6875 / 3)


def test_inspect_sample_decodes_with_run_config_tokenizer(worked, tokenizer_dir, capsys):
    assert tokenizer_path(json.loads((worked / "_manifests" / "w0.json").read_text())["config"]) == str(tokenizer_dir)
    assert main(["inspect", str(worked), "--sample", "p0-solver-1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["sample"]["group_id"] == "p0/solver" and doc["sample"]["reward"] == 0.0
    assert doc["tokenizer"] == str(tokenizer_dir)
    toks = doc["tokens"]
    assert [t["id"] for t in toks] == [1, 2, 3, 4, 5]
    assert [t["text"] for t in toks] == ["the", "answer", "is", "42", "<tool>"]
    assert [t["mask"] for t in toks] == [1, 1, 0, 0, 1]
    assert [t["logprob"] for t in toks] == pytest.approx([-0.1, -0.2, 0.0, 0.0, -0.5], abs=1e-6)

    assert main(["inspect", str(worked), "--sample", "p0-solver-1", "--max-tokens", "3"]) == 0
    text = capsys.readouterr().out
    assert "answer" in text and "-0.2000" in text and "2 more tokens" in text
    assert "Compute 6 x 7 [/] [bold]now" in text


def test_inspect_sample_ids_without_tokenizer(worked, capsys):
    assert tokenizer_path({"engine": {"model": "/no/such/model"}}) is None
    assert tokenizer_path({"model": str(worked)}) is None  # a folder, but no tokenizer files in it
    assert main(["inspect", str(worked), "--sample", "p1-solver-0", "--json", "--tokenizer", str(worked)]) == 2
    assert "cannot load a tokenizer" in capsys.readouterr().err
    assert main(["inspect", str(worked), "--sample", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no sample_id 'nope'" in err and "ids look like 'p0-solver-0'" in err


# Parse statuses as multi_agent records them in a row's metadata JSON (store reads them as data), 4 episodes:
#   episode  solver answer_status   selector answer_status / judgment_status
#   q0       ok, ok                 ok / ok
#   q1       ok, missing            ok / ok
#   q2       ok, ok                 ok / out_of_range
#   q3       missing, (no key)      missing / missing
# solver: 7 rows carry the key, 5 ok (5/7), 2 missing; the 8th (an older row) is not counted.
# selector: answer 3 of 4 ok; judgment ok 2, out_of_range 1, missing 1 (1/2, 1/4, 1/4).
# policy: its metadata has an answer only inside the verdict and no status key: no parse entry.
PARSED = [
    ("q0", ["ok", "ok"], ("ok", "ok")),
    ("q1", ["ok", "missing"], ("ok", "ok")),
    ("q2", ["ok", "ok"], ("ok", "out_of_range")),
    ("q3", ["missing", None], ("missing", "missing")),
]


@pytest.fixture(scope="module")
def parsed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("parsed") / "ds"
    with ShardWriter(root, writer_id="w0", config={"agent_system": "multi_agent"}) as w:
        for q, solver_status, (answer, judgment) in PARSED:
            solvers = [_row(f"{q}-solver-{i}", f"{q}/solver", "solver", 0, 2, [1], 1.0) for i in range(2)]
            for row, status in zip(solvers, solver_status):
                row.metadata = {"answer": None if status == "missing" else "7", "task": "math"}
                if status is not None:
                    row.metadata["answer_status"] = status
            selector = _row(f"{q}-selector-0", f"{q}/selector", "selector", 2, 2, [1], 0.0)
            selector.metadata = {"answer_status": answer, "judgment_status": judgment, "judgment": None}
            w.write_group(solvers)
            w.write_group([selector])
        policy = _row("q9-policy-0", "q9/policy", "policy", 0, 2, [1], 1.0)
        policy.metadata = {"verdict": {"answer": "7", "reward": 1.0}}
        w.write_group([policy])
    return root


def test_stats_parse_rates_by_agent(parsed, capsys):
    assert main(["stats", str(parsed), "--json"]) == 0
    agents = json.loads(capsys.readouterr().out)["agents"]
    assert agents["solver"]["parse"] == {
        "answer_status": {"rows": 7, "counts": {"ok": 5, "missing": 2}, "ok_share": pytest.approx(5 / 7, abs=1e-12)}}
    assert agents["selector"]["parse"] == {
        "answer_status": {"rows": 4, "counts": {"ok": 3, "missing": 1}, "ok_share": 0.75},
        "judgment_status": {"rows": 4, "counts": {"ok": 2, "missing": 1, "out_of_range": 1}, "ok_share": 0.5},
    }
    assert agents["policy"]["parse"] == {}
    assert agents["solver"]["rows"] == 8  # the row without a status still counts as a row


def test_stats_prints_the_parse_rates(parsed, capsys):
    assert main(["stats", str(parsed)]) == 0
    out = capsys.readouterr().out
    assert "parsed by agent" in out
    lines = [" ".join(line.replace("│", " ").split()) for line in out.splitlines()]
    assert "selector judgment 4 50.0% ok 2, missing 1, out_of_range 1" in lines
    assert "solver answer 7 71.4% ok 5, missing 2" in lines


def test_not_a_dataset_is_one_line_exit_2(tmp_path):
    res = run("stats", tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "no rollshard dataset here" in res.stderr



def test_argument_errors_and_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["inspect"])
    assert e.value.code == 2 and "usage:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and all(c in out for c in ("validate", "stats", "inspect"))


# -- filter, and the lineage in inspect ------------------------------------------------------


@pytest.fixture(scope="module")
def solvers(worked, tmp_path_factory) -> Path:
    """``filter --agent solver`` of the worked dataset: w0's shard keeps p0-solver-0/1 (rewritten), w1's shard is
    all solvers (copied): 5 of 8 rows."""
    out = tmp_path_factory.mktemp("filtered") / "solvers"
    res = run("filter", worked, "--out", out, "--agent", "solver", script=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout == (f"rollshard-store filter: {worked} -> {out}: kept 5 of 8 rows (3 dropped); shards: "
                          "1 copied, 1 rewritten, 0 dropped\n")
    return out


def test_filter_subprocess_keeps_the_solvers_and_copies_the_whole_shard(worked, solvers):
    from rollshard.store.io.dataset import RolloutDataset

    parent, derived = RolloutDataset.open(worked), RolloutDataset.open(solvers)
    assert sorted(derived.read().column("sample_id").to_pylist()) == [
        "p0-solver-0", "p0-solver-1", "p1-solver-0", "p1-solver-1", "p1-solver-2"]
    sha = {s.writer_id: s.sha256 for s in parent.shards}
    assert [(s.writer_id, s.rows, s.sha256 == sha["w1"]) for s in derived.shards] == [
        ("filter.w0", 2, False), ("filter.w1", 3, True)]
    assert run("validate", solvers, "--json").returncode == 0


def test_inspect_shows_the_lineage(worked, solvers, tokenizer_dir, capsys, monkeypatch):
    from rollshard.store.io.dataset import RolloutDataset

    assert main(["inspect", str(solvers), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    [entry] = doc["lineage"]
    assert entry["operation"] == "filter" and entry["parent"] == str(worked.resolve())
    assert entry["parent_fingerprint"] == RolloutDataset.open(worked).fingerprint
    assert entry["details"] == {"filters": {"agent": ["solver"]}, "expression": "agent in [solver]"}
    assert entry["command"].startswith("rollshard-store filter ") and "--agent solver" in entry["command"]
    assert doc["config"]["agent_system"] == "multi_agent"  # the parent's generation config is still there
    assert doc["stats"]["rows"] == 5 and set(doc["stats"]["agents"]) == {"solver"}
    assert main(["inspect", str(worked), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["lineage"] == []

    monkeypatch.setenv("COLUMNS", "300")  # wide enough that no cell folds
    assert main(["inspect", str(solvers)]) == 0
    text = capsys.readouterr().out
    lineage_at = text.index("lineage")
    for needle in ("filter", str(worked.resolve()), entry["parent_fingerprint"], "agent in [solver]"):
        assert needle in text[lineage_at:text.index("run config")], needle
    assert "derived." not in text  # the run config table leaves the lineage to its own table
    assert main(["inspect", str(worked)]) == 0
    assert "lineage" not in capsys.readouterr().out
    # decodes with the parent's tokenizer, as the parent does
    assert main(["inspect", str(solvers), "--sample", "p0-solver-1", "--json"]) == 0
    sample = json.loads(capsys.readouterr().out)
    assert sample["tokenizer"] == str(tokenizer_dir) and [t["text"] for t in sample["tokens"]][:2] == ["the", "answer"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--min-reward", "abc"], "--min-reward 'abc' is not a number"),
        (["--status", "done"], "status 'done' is not one of"),
        (["--weight-version", "5..3"], "range 5..3 is empty"),
        (["--agent", "slover"], "--agent 'slover': no such agent in"),
        ([], "no filter given"),
    ],
)
def test_filter_bad_value_is_one_line_exit_2(worked, tmp_path, args, message):
    res = run("filter", worked, "--out", tmp_path / "out", *args)
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("rollshard-store: error: filter: ")
    assert message in res.stderr and res.stdout == ""
    assert not (tmp_path / "out").exists()


def test_filter_refuses_an_out_with_other_filters_and_resumes_the_same(worked, solvers, capsys):
    assert main(["filter", str(worked), "--out", str(solvers), "--agent", "rewriter"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds a filter derive with other details" in err
    assert main(["filter", str(worked), "--out", str(solvers), "--agent", "solver", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["rows_out"], doc["rows_dropped"], doc["shards_resumed"]) == (5, 3, 2)


def test_filter_help():
    res = run("filter", "--help")
    assert res.returncode == 0
    for needle in ("--agent", "--status", "--min-reward", "--max-reward", "--weight-version", "--sample-ids",
                   "part of a GRPO", "copied byte for byte", "resumes"):
        assert needle in " ".join(res.stdout.split()), needle


def test_inspect_a_sample_without_its_id_float32_rewards_and_escaped_output(tmp_path, capsys):
    rows = [Row(sample_id=f"p0/policy/0/{i}", prompt_id="p0", group_id="p0/policy/0", agent="policy", round=0,
                prompt_tokens=[1, 2], response_tokens=[3, 4], rollout_logprobs=[-0.5, -1.0], loss_mask=[1, 1],
                reward=0.3, status=Status.COMPLETED, finish_reason="stop", weight_version="0", temperature=1.0,
                top_p=1.0, top_k=-1, prompt_text="q", response_text="ok\x1b[2Jgone\x07", metadata={})
            for i in range(2)]
    with ShardWriter(tmp_path / "ds", writer_id="w0") as w:
        w.write_group(rows)
    assert main(["inspect", str(tmp_path / "ds"), "--sample", "first"]) == 0
    shown = capsys.readouterr().out
    assert "sample p0/policy/0/0" in shown and "0.30000001" not in shown
    assert "ok\\x1b[2Jgone\\x07" in shown and "\x1b[2J" not in shown  # a terminal escape is shown, not run
    assert main(["inspect", str(tmp_path / "ds"), "--sample", "random", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["sample"]["sample_id"] in {"p0/policy/0/0", "p0/policy/0/1"} and doc["sample"]["reward"] == 0.3


# -- inspect --sample worst-mismatch --audit --------------------------------------------------


def _audit_table(worked, offsets: dict[tuple[str, int], float], source: str = "ds"):
    """Every trained token of ``worked``: trainer = rollout + offsets[(sample, position)] (0 elsewhere)."""
    import pyarrow as pa

    from rollshard.store.inspection.audit import AUDIT_SCHEMA
    from rollshard.store.io.dataset import RolloutDataset

    cols = {n: [] for n in AUDIT_SCHEMA.names}
    for r in RolloutDataset.open(worked).read().to_pylist():
        for pos, (tok, lp, m) in enumerate(zip(r["response_tokens"], r["rollout_logprobs"], r["loss_mask"])):
            if m:
                values = (r["sample_id"], r["group_id"], r["agent"], source, r["weight_version"], 1.0, pos, tok, lp,
                          lp + offsets.get((r["sample_id"], pos), 0.0))
                for name, v in zip(AUDIT_SCHEMA.names, values):
                    cols[name].append(v)
    return pa.table(cols, schema=AUDIT_SCHEMA)


def _audit(worked, path, offsets: dict[tuple[str, int], float]) -> None:
    """The audit report of ``worked`` (:func:`_audit_table`), naming it."""
    from rollshard.store.inspection.audit import AuditedDataset, write_audit
    from rollshard.store.io.dataset import RolloutDataset

    write_audit(_audit_table(worked, offsets), path, datasets=[AuditedDataset.of("ds", RolloutDataset.open(worked))])


def test_inspect_worst_mismatch_shows_the_trainer_logprob(worked, tmp_path, capsys):
    audit = tmp_path / "audit.parquet"
    # p0-solver-1's last token (position 4, rollout -0.5) is the worst: |-0.9 - (-0.5)| = 0.4 > 0.25 of p0-solver-0
    _audit(worked, audit, {("p0-solver-1", 4): -0.4, ("p0-solver-0", 1): 0.25, ("p0-solver-1", 0): 0.05})
    assert main(["inspect", str(worked), "--sample", "worst-mismatch", "--audit", str(audit), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["sample"]["sample_id"] == "p0-solver-1"
    toks = doc["tokens"]
    # masked positions 2 and 3 are not audited: no trainer logprob
    assert [t["trainer_logprob"] for t in toks] == pytest.approx([-0.05, -0.2, None, None, -0.9], abs=1e-6)
    assert [t["diff"] for t in toks] == pytest.approx([0.05, 0.0, None, None, -0.4], abs=1e-6)
    assert doc["audit"] == {"tokens": 3, "abs_diff_mean": pytest.approx(0.15, abs=1e-6),
                            "abs_diff_max": pytest.approx(0.4, abs=1e-6), "worst_position": 4}
    assert main(["inspect", str(worked), "--sample", "worst-mismatch", "--audit", str(audit)]) == 0
    text = capsys.readouterr().out
    assert "trainer logprob" in text and "-0.9000" in text and "-0.4000" in text and "at position 4" in text


def test_inspect_worst_mismatch_bad_input_is_one_line_exit_2(worked, tmp_path, capsys):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not really")
    for args, message in (
        ([], "needs --audit"),
        (["--audit", str(tmp_path / "missing.parquet")], "no such file"),
        (["--audit", str(bad)], "--audit"),
    ):
        assert main(["inspect", str(worked), "--sample", "worst-mismatch", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


@pytest.fixture(scope="module")
def next_round(tmp_path_factory) -> Path:
    """The next round of ``worked``'s prompts, as rollshard-loop writes it: the same sample ids, other responses."""
    import dataclasses

    root = tmp_path_factory.mktemp("round1") / "ds"
    with ShardWriter(root, writer_id="w0", config={}) as w:
        for _, rows in P0 + P1:
            w.write_group([dataclasses.replace(r, response_tokens=r.response_tokens[1:] + r.response_tokens[:1])
                           for r in rows])
    return root


def test_inspect_refuses_an_audit_of_another_round(worked, next_round, tmp_path, capsys):
    """Round 0's audit with round 1's dataset: the same sample ids, so the old pairing by id showed round 0's
    trainer logprobs beside round 1's tokens. Refused in one line, whichever --sample."""
    from rollshard.store.io.dataset import RolloutDataset

    audit = tmp_path / "a0.parquet"
    _audit(worked, audit, {("p0-solver-1", 4): -0.4})
    f0, f1 = RolloutDataset.open(worked).fingerprint, RolloutDataset.open(next_round).fingerprint
    assert f0 != f1
    expected = (f"rollshard-store: error: --audit {audit}: the audit is of {worked} (fingerprint {f0}), not of "
                f"{next_round} (fingerprint {f1}); pass that dataset or re-run rollshard-train audit --data "
                f"{next_round}\n")
    for sample in ("worst-mismatch", "p0-solver-1"):
        assert main(["inspect", str(next_round), "--sample", sample, "--audit", str(audit), "--json"]) == 2
        cap = capsys.readouterr()
        assert cap.err == expected and cap.out == ""


def test_inspect_an_audit_of_two_rounds_shows_the_rounds_own_tokens(worked, next_round, tmp_path, capsys):
    """``audit --data r0,r1``: the worst token is round 1's; inspecting round 0 shows round 0's worst row and its
    own trainer logprobs, not round 1's of the same sample id."""
    import pyarrow as pa

    from rollshard.store.inspection.audit import AuditedDataset, write_audit
    from rollshard.store.io.dataset import RolloutDataset

    audit = tmp_path / "a01.parquet"
    both = pa.concat_tables([_audit_table(worked, {("p0-solver-0", 1): 0.25}, source="r0"),
                             _audit_table(next_round, {("p0-solver-1", 4): -0.4, ("p0-solver-0", 1): 0.125},
                                          source="r1")])
    write_audit(both, audit, datasets=[AuditedDataset.of("r0", RolloutDataset.open(worked)),
                                       AuditedDataset.of("r1", RolloutDataset.open(next_round))])
    assert main(["inspect", str(worked), "--sample", "worst-mismatch", "--audit", str(audit), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["sample"]["sample_id"] == "p0-solver-0"  # round 0's worst (0.25), not round 1's p0-solver-1
    assert [t["diff"] for t in doc["tokens"]] == pytest.approx([0.0, 0.25, 0.0], abs=1e-6)
    assert main(["inspect", str(next_round), "--sample", "p0-solver-0", "--audit", str(audit), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [t["diff"] for t in doc["tokens"]] == pytest.approx([0.0, 0.125, 0.0], abs=1e-6)  # round 1's own


def test_inspect_an_audit_naming_no_dataset_warns(worked, tmp_path, capsys):
    """A report of audit schema 1.0 (written before it named its datasets): read, paired by sample_id, said."""
    import pyarrow.parquet as pq

    old = tmp_path / "old.parquet"
    table = _audit_table(worked, {("p0-solver-1", 4): -0.4})
    pq.write_table(table.replace_schema_metadata({"rollshard.audit_schema_version": "1.0"}), old)
    assert main(["inspect", str(worked), "--sample", "worst-mismatch", "--audit", str(old), "--json"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["sample"]["sample_id"] == "p0-solver-1"
    assert cap.err.count("\n") == 1 and cap.err.startswith(f"rollshard-store: warning: --audit {old} names no audited "
                                                           "dataset"), cap.err
