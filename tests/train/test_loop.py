"""``rollshard-loop``: rounds with versions carried, a rerun after SIGINT and kill -9 that ends where an
uninterrupted run ends (bit for bit), SGLang-API servers loading each round's policy, and bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import polars as pl
import pytest
from safetensors.torch import load_file

from rollshard.store.common import UsageError
from rollshard.store.io.dataset import RolloutDataset
from rollshard.train.cli import main as train_main
from rollshard.train.loop import main as loop_main
from rollshard.train.loop_state import RoundState
from rollshard.train.metrics import read_metrics

from tests.gated_main import REPO, Gate, wait_for_gate
from tests.generate.conftest import start_embedded_server, stop_server

FP32_LOGPROB_TOL = 1e-5  # embedded engine vs the trainer's packed forward, fp32 CPU
STEPS_PER_ROUND = 4  # 4 prompts, one group each, one group per step, one epoch
DEADLINE_S = 600.0  # for a broken run, not an expectation of speed


def loop_args(model: Path, out: Path, *extra: str, rounds: int = 2, report: bool = False) -> list[str]:
    return [
        "--model", str(model), "--out", str(out), "--rounds", str(rounds), "--no-progress", "--json",
        *([] if report else ["--no-report"]),
        "--generate", "--task toy --agents single --n-samples 4 --max-new-tokens 8 --limit 4 --commit-every 1",
        "--train", "--groups-per-step 1 --num-epochs 1 --lr 5e-3 --save-every 1 --no-tensorboard", *extra,
    ]  # fmt: skip


def run_loop(*args: str, gated: tuple[str, int, list[Gate]] | None = None, **popen) -> subprocess.Popen:
    if gated is None:
        cmd = [sys.executable, "-m", "rollshard.train.loop", *args]
    else:
        stage, k, gates = gated
        spec = json.dumps([g.__dict__ for g in gates])
        cmd = [sys.executable, "-m", "tests.train.loop_gated", stage, str(k), spec, *args]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=DEADLINE_S)
    return proc.returncode, out, err


def rows(dataset: Path) -> pl.DataFrame:
    cols = ["sample_id", "response_tokens", "rollout_logprobs", "reward", "weight_version"]
    return RolloutDataset.open(dataset).scan().select(cols).collect().sort("sample_id")


def processes_using(path: Path) -> list[int]:
    """Pids whose command line names ``path`` (the loop's children write under it)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(path) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def wait_until_gone(path: Path) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while processes_using(path):
        assert time.monotonic() < deadline, f"processes still running under {path}: {processes_using(path)}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(tiny_gpt2, tmp_path_factory) -> tuple[Path, dict]:
    """Two uninterrupted rounds: (run folder, the summary JSON it printed)."""
    out = tmp_path_factory.mktemp("loop") / "run"
    code, stdout, stderr = finish(run_loop(*loop_args(tiny_gpt2, out, "--audit", report=True)))
    assert code == 0, stderr
    return out, json.loads(stdout)


@pytest.mark.slow
def test_two_rounds_carry_the_policy_and_its_version(reference):
    out, summary = reference
    state = json.loads((out / "loop.json").read_text())
    r0, r1 = state["rounds"]
    assert (r0["policy_version"], r0["checkpoint_version"]) == ("0", str(STEPS_PER_ROUND))
    # Round 1 generates with round 0's checkpoint (the resolved step folder, not `latest`), as its version.
    assert r1["policy"] == r0["checkpoint"] == "round_000/train/checkpoints/step_00000004"  # kept relative to out
    assert (r1["policy_version"], r1["checkpoint_version"]) == (str(STEPS_PER_ROUND), str(2 * STEPS_PER_ROUND))
    assert set(rows(out / "round_000" / "data")["weight_version"]) == {"0"}
    assert set(rows(out / "round_001" / "data")["weight_version"]) == {"4"}
    assert RolloutDataset.open(out / "round_001" / "data").config["model"] == str(out / r0["checkpoint"])
    final = json.loads((out / r1["checkpoint"] / "trainer_state.json").read_text())
    assert final["weight_version"] == "8" and final["step"] == STEPS_PER_ROUND
    # Each round starts a fresh optimizer: its last checkpoint holds the model only.
    assert final["optimizer"] is False and not (out / r1["checkpoint"] / "shards").exists()

    # The report: both rounds' rows, the last training's metrics.
    page = (out / "report.html").read_text()
    assert "Reward across rounds" in page and str(out / "round_001" / "data") in page and "metrics.jsonl" in page
    assert str(out / "round_001" / "audit.parquet") in page  # the last round's audit beside its rows

    # The summary: each round's reward is its rows' mean; the step-0 mismatch is the engine's fp32 noise.
    assert [r["round"] for r in summary["rounds"]] == [0, 1]
    for k, entry in enumerate(summary["rounds"]):
        data = rows(out / f"round_{k:03d}" / "data")
        assert entry["rows"] == data.height == 16
        assert entry["reward_mean"] == pytest.approx(data["reward"].cast(pl.Float64).mean(), abs=1e-12)
        assert entry["steps"] == STEPS_PER_ROUND
        assert 0 <= entry["mismatch_max"] <= FP32_LOGPROB_TOL
        # --audit: every trained token of the round against the policy that generated it, before training.
        trained_tokens = RolloutDataset.open(out / f"round_{k:03d}" / "data").scan().select(
            pl.col("loss_mask").list.sum()).collect().sum().item()
        assert entry["audit"]["tokens"] == trained_tokens and entry["audit"]["max"] <= FP32_LOGPROB_TOL
        assert pl.read_parquet(out / f"round_{k:03d}" / "audit.parquet").height == trained_tokens


@pytest.mark.slow
def test_interrupted_and_killed_anywhere_the_rerun_ends_as_an_uninterrupted_run(reference, tiny_gpt2, tmp_path):
    ref, _ = reference
    out = tmp_path / "run"
    args = loop_args(tiny_gpt2, out)

    # 1. SIGINT while round 0 trains, just after its first save: the trainer saves its step and exits 130.
    saved = Gate("rollshard.train.trainer:save_checkpoint", 1, str(tmp_path / "saved"), str(tmp_path / "go"))
    proc = run_loop(*args, gated=("train", 0, [saved]))
    wait_for_gate(proc, saved)
    proc.send_signal(signal.SIGINT)  # to the loop alone: it forwards the signal to the stage once
    Path(saved.release).write_text("")
    code, _, err = finish(proc)
    assert code == 130, err
    assert "rollshard-loop: interrupted while training round 0; rerun the same command to continue" in err

    # 2. kill -9 of the loop while round 1 generates, after its first commit: the stage dies with it.
    committed = Gate("rollshard.store.io.writer:ShardWriter.commit", 1, str(tmp_path / "committed"))
    proc = run_loop(*args, gated=("generate", 1, [committed]))
    wait_for_gate(proc, committed)
    proc.kill()
    finish(proc)
    wait_until_gone(out)  # no orphaned stage beside the rerun
    kept = RolloutDataset.open(out / "round_001" / "data")
    assert kept.num_rows in (4, 8, 12, 16)  # whole groups

    # 3. The same command finishes the run where an uninterrupted one ends: the same rounds, versions,
    # checkpoints and row counts, the rows committed before the kill kept (their shards, not regenerated).
    # (Rows match the reference's token for token, but not their shard layout, which follows commit timing,
    # and the loader's shuffle deals blocks: the training order, and from there the weights, differ.)
    code, stdout, err = finish(run_loop(*args))
    assert code == 0, err
    state, ref_state = (json.loads((p / "loop.json").read_text()) for p in (out, ref))
    for mine, theirs in zip(state["rounds"], ref_state["rounds"], strict=True):
        for key in ("round", "policy", "policy_version", "checkpoint", "checkpoint_version"):
            assert mine[key] == theirs[key], key
    assert {s.path for s in kept.shards} <= {s.path for s in RolloutDataset.open(out / "round_001" / "data").shards}
    mine, theirs = rows(out / "round_000" / "data"), rows(ref / "round_000" / "data")
    assert mine.drop("rollout_logprobs").equals(theirs.drop("rollout_logprobs"))
    assert rows(out / "round_001" / "data").height == 16  # no prompt twice, none lost
    assert [r["round"] for r in json.loads(stdout)["rounds"]] == [0, 1]

    # Round 0's training, stopped by SIGINT and resumed by the loop, equals one uninterrupted run on its data.
    fresh = tmp_path / "fresh"
    argv = ["--data", out / "round_000" / "data", "--model", tiny_gpt2, "--out", fresh, "--groups-per-step", "1",
            "--num-epochs", "1", "--lr", "5e-3", "--no-tensorboard", "--no-progress"]  # fmt: skip
    assert train_main(list(map(str, argv))) == 0
    losses, fresh_losses = ([m["loss/total"] for m in read_metrics(p)] for p in (out / "round_000" / "train", fresh))
    assert len(losses) == STEPS_PER_ROUND and losses == fresh_losses  # steps 1..4 once each, bit for bit
    weights = load_file(out / state["rounds"][0]["checkpoint"] / "model.safetensors")
    fresh_weights = load_file(fresh / "checkpoints" / "latest" / "model.safetensors")
    assert weights.keys() == fresh_weights.keys() and all(weights[k].equal(fresh_weights[k]) for k in weights)


@pytest.mark.slow
def test_more_rounds_continue_a_finished_run(reference, tmp_path, tiny_gpt2):
    ref, _ = reference
    out = tmp_path / "run"
    subprocess.run(["cp", "-a", str(ref), str(out)], check=True)
    # A finished run (moved: loop.json names its folders relative to it) is not redone: no stage starts.
    code, stdout, err = finish(run_loop(*loop_args(tiny_gpt2, out)))
    assert code == 0 and "generating" not in err and "training" not in err, err
    code, stdout, err = finish(run_loop(*loop_args(tiny_gpt2, out, rounds=3)))
    assert code == 0, err
    assert err.count("generating with") == 1 and "round 3/3: generating" in err
    r2 = json.loads((out / "loop.json").read_text())["rounds"][2]
    assert (r2["policy_version"], r2["checkpoint_version"]) == ("8", "12")
    assert set(rows(out / "round_002" / "data")["weight_version"]) == {"8"}


@pytest.mark.slow
def test_sglang_api_servers_load_each_rounds_policy(tiny_gpt2, tmp_path):
    server, url = start_embedded_server(tiny_gpt2)  # `rollshard-generate serve`: SGLang's HTTP API
    try:
        out = tmp_path / "run"
        code, stdout, err = finish(run_loop(*loop_args(tiny_gpt2, out, "--engine", url)))
        assert code == 0, err
    finally:
        stop_server(server)
    state = json.loads((out / "loop.json").read_text())
    assert [r["policy_version"] for r in state["rounds"]] == ["0", "4"]
    assert set(rows(out / "round_000" / "data")["weight_version"]) == {"0"}
    assert set(rows(out / "round_001" / "data")["weight_version"]) == {"4"}  # served after /update_weights_from_disk
    assert RolloutDataset.open(out / "round_001" / "data").config["model"] == str(out / state["rounds"][0]["checkpoint"])
    for entry in json.loads(stdout)["rounds"]:
        assert entry["mismatch_max"] <= FP32_LOGPROB_TOL  # the server really generated with the trained weights


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--generate", "--out elsewhere"], "--generate may not set --out: the loop sets it for every round"),
        (["--train=--model=x"], "--train may not set --model: the loop sets it for every round"),
        (["--rounds", "0"], "--rounds and --window must be >= 1"),
        (["--generate", "--task 'toy"], "--generate: No closing quotation"),
        (["--generate", "--eng embedded:/elsewhere"], "--generate may not set --engine"),  # argparse's abbreviation
        (["--engine", "embedded:/elsewhere"], "--engine 'embedded:/elsewhere': 'embedded' (the policy served by this machine)"),
        (["--out", "s3://bucket/run"], "--out s3://bucket/run: the loop runs in a local folder"),
        (["--train=--no-resume"], "--train may not set --no-resume: the loop sets it for every round"),
    ],
)
def test_bad_input_is_one_line(tiny_gpt2, tmp_path, capsys, extra, message):
    assert loop_main(loop_args(tiny_gpt2, tmp_path / "run") + extra) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_a_rerun_with_other_settings_or_a_foreign_folder_is_refused(tiny_gpt2, tmp_path, capsys):
    out = tmp_path / "run"
    (out / "round_000").mkdir(parents=True)
    (out / "loop.json").write_text(json.dumps({"version": 1, "settings": {
        "model": str(tiny_gpt2.resolve()), "engine": "embedded", "window": 1, "seed": 0, "generate": [], "train": [],
    }, "rounds": [{"round": 0, "policy": str(tiny_gpt2), "policy_version": "0", "generated": True, "trained": True}]}))  # fmt: skip
    assert loop_main(["--model", str(tiny_gpt2), "--out", str(out), "--window", "2"]) == 2
    assert "was run with another window (1 there, 2 now; round 0's training used it)" in capsys.readouterr().err
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x").write_text("")
    assert loop_main(["--model", str(tiny_gpt2), "--out", str(foreign)]) == 2
    err = capsys.readouterr().err
    assert f"--out {foreign} holds x: not a rollshard-loop run folder; choose a new or empty folder" in err, err
    assert err.count("\n") == 1
    assert not (foreign / "loop.json").exists() and os.listdir(foreign) == ["x"]


def test_a_window_trains_on_the_last_rounds(tiny_gpt2, tmp_path):
    from rollshard.train.loop import Loop, build_parser

    args = build_parser().parse_args(loop_args(tiny_gpt2, tmp_path / "run", "--window", "2", rounds=3))
    loop = Loop.from_args(args)
    data = [loop.train_command(k, "P")[loop.train_command(k, "P").index("--data") + 1] for k in range(3)]
    run = tmp_path / "run"
    assert data == [
        f"{run}/round_000/data",
        f"{run}/round_000/data,{run}/round_001/data",  # equal weights: the mixture's default
        f"{run}/round_001/data,{run}/round_002/data",
    ]


def test_stage_flags_of_their_own_pass_and_a_file_or_a_damaged_state_is_refused(tiny_gpt2, tmp_path, capsys):
    from rollshard.train.loop import Loop, build_parser

    # --mode begins --model and --config is the trainer's own: neither is taken for a flag the loop sets.
    args = build_parser().parse_args(loop_args(tiny_gpt2, tmp_path / "run", "--train", "--mode decoupled --config c.yaml"))
    assert Loop.from_args(args).train_command(0, "P")[-6:-1] == ["--no-tensorboard", "--mode", "decoupled",
                                                                  "--config", "c.yaml"]
    afile = tmp_path / "afile"
    afile.write_text("")
    assert loop_main(loop_args(tiny_gpt2, afile)) == 2
    assert "is a file; the loop needs a folder" in capsys.readouterr().err
    for i, bad in enumerate(("{}", "[]", '{"settings": {}, "rounds": {}}')):
        run = tmp_path / f"damaged{i}"
        run.mkdir()
        (run / "loop.json").write_text(bad)
        assert loop_main(loop_args(tiny_gpt2, run)) == 2
        err = capsys.readouterr().err
        assert "is not a rollshard-loop state file" in err and err.count("\n") == 1, err


def test_one_loop_per_run_folder(tiny_gpt2, tmp_path, capsys):
    import fcntl

    out = tmp_path / "run"
    out.mkdir()
    with open(out / ".loop.lock", "a") as held:  # another loop holds the folder
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert loop_main(loop_args(tiny_gpt2, out)) == 2
    err = capsys.readouterr().err
    assert f"another rollshard-loop is running in {out}" in err
    assert not (out / "round_000").exists()


@pytest.mark.slow
def test_a_stage_that_failed_on_its_flags_is_fixed_by_rerunning_with_others(tiny_gpt2, tmp_path):
    out = tmp_path / "run"
    # Flags that parse (the loop checks that before round 0) but leave the trainer no row: the stage fails.
    code, _, err = finish(run_loop(*loop_args(tiny_gpt2, out, "--train", "--agents nobody", rounds=1)))
    assert code == 2 and "no step to train" in err and "training failed (exit 2" in err
    code, _, err = finish(run_loop(*loop_args(tiny_gpt2, out, "--train", "--lr 1e-3", rounds=1)))
    assert code == 0, err
    assert "generating" not in err  # the round's rows were kept, only the training ran
    # Once a round trained, its flags are the run's: another value is refused.
    code, _, err = finish(run_loop(*loop_args(tiny_gpt2, out, "--train", "--lr 2e-3", rounds=2)))
    assert code == 2 and "was run with another train" in err


@pytest.mark.slow
def test_a_flagged_audit_stops_the_round_before_training(tiny_gpt2, tmp_path):
    out = tmp_path / "run"
    # fp32 rounding (~5e-7) is over a threshold of 1e-9: the audit flags the rows, and nothing trains on them.
    args = loop_args(tiny_gpt2, out, "--audit", "--audit-args", "--max-abs-diff 1e-9", rounds=1)
    code, stdout, err = finish(run_loop(*args))
    assert code == 1, err
    assert "rollshard-train audit: flagged: max |logp - rollout_logp|" in err
    assert "round 0: the audit flagged its rows" in err and "not training on them" in err
    assert not (out / "round_000" / "train").exists()
    assert "steps" not in json.loads(stdout)["rounds"][0]  # generated, audited, never trained
    assert f"delete {out / 'round_000' / 'data'} and rerun to generate the round anew" in err

    # As the message says: delete the rows, rerun (here with a bound the rows meet): generated anew, then trained.
    shutil.rmtree(out / "round_000" / "data")
    args = loop_args(tiny_gpt2, out, "--audit", "--audit-args", "--max-abs-diff 1e-3", rounds=1)
    code, stdout, err = finish(run_loop(*args))
    assert code == 0, err
    assert "round 1/1: generating" in err and "round 1/1: auditing done" in err
    (entry,) = json.loads(stdout)["rounds"]
    assert entry["rows"] == 16 and entry["steps"] == STEPS_PER_ROUND and entry["audit"]["max"] <= FP32_LOGPROB_TOL


@pytest.mark.slow
def test_the_policy_of_round_0_is_read_when_it_generates_and_frozen_once_it_committed_rows(reference, tiny_gpt2, tmp_path):
    checkpoint = reference[0] / "round_000" / "train" / "checkpoints" / "latest"  # version 4
    # A generation that failed on its flags wrote no row: rerunning with another --model is a fresh start, and the
    # round carries the version of the policy it really generated with.
    out = tmp_path / "run"
    # (a flag that parses, refused by the stage: a bad one is refused before round 0, test_loop_checks.py)
    code, _, err = finish(run_loop(*loop_args(tiny_gpt2, out, "--generate", "--agents nobody", rounds=1)))
    assert code == 2 and "round 0: generating failed (exit 2" in err, err
    code, stdout, err = finish(run_loop(*loop_args(checkpoint, out, rounds=1)))
    assert code == 0, err
    (entry,) = json.loads(stdout)["rounds"]
    assert (entry["policy_version"], entry["checkpoint_version"]) == ("4", str(4 + STEPS_PER_ROUND))
    assert set(rows(out / "round_000" / "data")["weight_version"]) == {"4"}
    assert "generating with" in err and "(version 4)" in err

    # A generation that committed rows before it failed: its rows are of its policy, another --model is refused.
    plugin = tmp_path / "flaky.py"
    plugin.write_text("def reward(sample):\n    if sample.prompt_id == 'toy-001':\n        raise ValueError('no')\n"
                      "    return 1.0\n")
    out = tmp_path / "partial"
    flaky = ("--generate", f"--reward {plugin}:reward --retries 0")
    code, _, err = finish(run_loop(*loop_args(tiny_gpt2, out, *flaky, rounds=1)))
    assert code == 1 and RolloutDataset.open(out / "round_000" / "data").num_rows == 12, err
    code, _, err = finish(run_loop(*loop_args(checkpoint, out, *flaky, rounds=1)))
    assert code == 2 and "was run with another model" in err and "round 0's rows used it" in err, err
    assert f"delete {out / 'round_000' / 'data'} to generate round 0 anew" in err
    assert set(rows(out / "round_000" / "data")["weight_version"]) == {"0"}


@pytest.mark.slow
def test_a_run_folder_reached_through_a_link_keeps_its_paths_relative_and_moves(tiny_gpt2, tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    code, _, err = finish(run_loop(*loop_args(tiny_gpt2, tmp_path / "link" / "run", rounds=1)))
    assert code == 0, err
    (r0,) = json.loads((real / "run" / "loop.json").read_text())["rounds"]
    assert r0["checkpoint"] == f"round_000/train/checkpoints/step_{STEPS_PER_ROUND:08d}"
    (real / "run").rename(tmp_path / "moved")
    code, stdout, err = finish(run_loop(*loop_args(tiny_gpt2, tmp_path / "moved", rounds=2)))
    assert code == 0, err
    assert f"generating with {tmp_path / 'moved' / r0['checkpoint']} (version {STEPS_PER_ROUND})" in err
    assert [r["policy_version"] for r in json.loads(stdout)["rounds"]] == ["0", str(STEPS_PER_ROUND)]


def test_a_round_whose_rows_were_deleted_under_its_training_is_refused(tiny_gpt2, tmp_path, capsys):
    out = tmp_path / "run"
    args = loop_args(tiny_gpt2, out)
    from rollshard.train.loop import Loop, build_parser

    settings = Loop.from_args(build_parser().parse_args(args)).settings.to_json()
    (out / "round_000" / "train").mkdir(parents=True)  # a training begun on rows since deleted
    (out / "loop.json").write_text(json.dumps({"version": 1, "settings": settings, "rounds": [
        {"round": 0, "policy": str(tiny_gpt2), "policy_version": "0", "generated": True}]}))
    assert loop_main(args) == 2
    err = capsys.readouterr().err
    assert f"round 0's data folder is gone but its training {out / 'round_000' / 'train'} is not" in err, err
    assert err.count("\n") == 1


def test_a_train_config_file_may_not_set_the_initial_version(tiny_gpt2, tmp_path, capsys):
    config = tmp_path / "train.yaml"
    config.write_text("trainer:\n  initial_version: 100\noptim:\n  lr: 0.001\n")
    assert loop_main(loop_args(tiny_gpt2, tmp_path / "run", "--train", f"--config {config}")) == 2
    err = capsys.readouterr().err
    assert f"--train's --config {config} sets trainer.initial_version" in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_a_damaged_checkpoint_as_model_is_one_line(tiny_gpt2, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_gpt2, model)
    (model / "trainer_state.json").write_text("{not json")
    assert loop_main(loop_args(model, tmp_path / "run")) == 2
    err = capsys.readouterr().err
    assert f"--model {model}: {model / 'trainer_state.json'}: unreadable checkpoint state" in err
    assert err.count("\n") == 1, err


def test_the_dry_run_prints_the_version_and_the_audits_a_run_would_use(tiny_gpt2, tmp_path, capsys):
    model = tmp_path / "ckpt"
    shutil.copytree(tiny_gpt2, model)
    (model / "trainer_state.json").write_text(json.dumps({"weight_version": "7", "step": 7}))
    args = loop_args(model, tmp_path / "run", "--engine", "http://127.0.0.1:9", "--audit", "--dry-run")
    assert loop_main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6  # generate, audit, train for each of 2 rounds
    assert "--weight-version 7" in lines[0] and " audit --data " in lines[1]
    assert "--weight-version '<version of round 0'\"'\"'s checkpoint>'" in lines[3]
    assert not (tmp_path / "run").exists()


def _loop_for_stages(tiny_gpt2, tmp_path):
    from rollshard.train.loop import Loop, build_parser

    loop = Loop.from_args(build_parser().parse_args(loop_args(tiny_gpt2, tmp_path / "run")))
    loop.rounds = [RoundState(round=0, policy_version="0")]
    return loop


def test_a_loop_started_in_a_forked_process_runs_its_stages(tiny_gpt2, tmp_path):
    loop = _loop_for_stages(tiny_gpt2, tmp_path)
    pid = os.fork()
    if pid == 0:  # the child: a process forked after the module was imported, as a worker pool would
        os._exit(loop.run_stage(0, 1, "generating", [sys.executable, "-c", "pass"]))
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # not 130: the stage's parent is this process, alive


# A stage that ends at the first SIGINT, wherever it lands: before the block by the default action, after it
# (pending or not) by sigwait; no window where it is missed (signal.pause() has one, just before the call).
WAIT_FOR_SIGINT = "import signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\nsignal.sigwait({signal.SIGINT})\nraise SystemExit(130)"


@pytest.mark.timeout(120)  # without the forwarded signal the stage never ends
def test_a_signal_while_a_stage_starts_reaches_the_stage(tiny_gpt2, tmp_path, monkeypatch):
    import rollshard.train.loop as loop_module

    loop = _loop_for_stages(tiny_gpt2, tmp_path)
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):  # SIGINT lands after the fork, before the loop has the child to forward it to
        child = real_popen(*args, **kwargs)
        loop.forward_signal(signal.SIGINT, None)
        return child

    monkeypatch.setattr(loop_module.subprocess, "Popen", popen)
    # The stage waits for a signal and nothing else: it ends only if the loop forwarded the SIGINT.
    code = loop.run_stage(0, 1, "training", [sys.executable, "-c", WAIT_FOR_SIGINT])
    assert code == 130  # interrupted by the forwarded signal


def test_the_summary_prints_a_non_finite_mismatch(capsys):
    from rollshard.train.loop import print_summary

    print_summary([{"round": 0, "policy_version": "0", "rows": 4, "reward_mean": 0.5, "reward_by_agent": {"policy": 0.5},
                    "mismatch_mean": "nan", "mismatch_max": "nan", "steps": 1, "checkpoint_version": "1"}])
    assert "nan / nan" in capsys.readouterr().out


@pytest.mark.slow
def test_a_round_goes_on_without_failed_prompts_within_the_generations_bound(tiny_gpt2, tmp_path):
    plugin = tmp_path / "flaky.py"
    plugin.write_text("def reward(sample):\n    if sample.prompt_id == 'toy-001':\n        raise ValueError('no')\n"
                      "    return 1.0\n")
    out = tmp_path / "run"
    strict = loop_args(tiny_gpt2, out, "--generate", f"--reward {plugin}:reward --retries 0", rounds=1)
    code, _, err = finish(run_loop(*strict))
    assert code == 1 and "round 0: generating failed (exit 1" in err
    code, stdout, err = finish(run_loop(*strict, "--generate", "--max-failed-prompts 0.25"))
    assert code == 0, err
    (entry,) = json.loads(stdout)["rounds"]
    assert (entry["failed_prompts"], entry["rows"], entry["steps"]) == (1, 12, 3)  # 3 of 4 prompts, one step each


EVAL = "--task arithmetic --limit 3 --max-new-tokens 4"


@pytest.mark.slow
def test_eval_scores_round_0s_model_and_every_checkpoint(tiny_gpt2, tmp_path):
    out = tmp_path / "run"
    code, stdout, err = finish(run_loop(*loop_args(tiny_gpt2, out, "--eval", EVAL, rounds=2, report=True)))
    assert code == 0, err
    page = (out / "report.html").read_text()
    assert "<section id='held-out'>" in page  # the held-out figures beside the training reward
    state = json.loads((out / "loop.json").read_text())
    r0, r1 = state["rounds"]
    for figures, model in ((r0["eval"], tiny_gpt2), (r0["checkpoint_eval"], out / r0["checkpoint"]),
                           (r1["checkpoint_eval"], out / r1["checkpoint"])):  # fmt: skip
        assert figures["prompts"] == 3 and figures["answers"] == 3 and figures["split"] == "eval"
        assert Path(figures["model"]).resolve() == Path(model).resolve() and 0.0 <= figures["pass@1"] <= 1.0
    assert "eval" not in r1  # round 1's policy is round 0's checkpoint, evaluated once
    assert set(r0["seconds"]) == {"generate", "train", "eval"} and all(v >= 0 for v in r0["seconds"].values())
    assert err.count("evaluating") == 3 * 2  # three evaluations, each a start and a done line
    summary = json.loads(stdout)["rounds"]
    assert summary[1]["eval"] == r0["checkpoint_eval"] and summary[1]["checkpoint_eval"] == r1["checkpoint_eval"]
    assert (out / "round_000" / "eval_policy" / "eval.json").is_file() and (out / "round_001" / "eval").is_dir()

    # A finished run reruns nothing; one without --eval before gets its evaluations on a rerun with it.
    code, _, err = finish(run_loop(*loop_args(tiny_gpt2, out, "--eval", EVAL, rounds=2)))
    assert code == 0 and "evaluating" not in err and "generating" not in err


def test_bad_eval_flags_are_one_line_before_round_0(tiny_gpt2, tmp_path, capsys):
    out = tmp_path / "run"
    assert loop_main(loop_args(tiny_gpt2, out, "--eval", "--task arithmetic --n-samples 2 --temperature 0")) == 2
    err = capsys.readouterr().err
    assert "--eval: --n-samples 2 at --temperature 0 draws one answer 2 times" in err and err.count("\n") == 1
    assert not (out / "round_000").exists()
    assert loop_main(loop_args(tiny_gpt2, out, "--eval", "--task arithmetic --out x")) == 2
    assert "--eval may not set --out" in capsys.readouterr().err


def test_a_stage_hears_the_forwarded_signal_when_the_loop_was_started_ignoring_it(tiny_gpt2, tmp_path):
    """A loop started as a background job of a script inherits SIGINT ignored; it handles SIGINT itself, and its
    stages must not inherit the ignore, or the SIGINT it forwards would never stop them."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        loop = _loop_for_stages(tiny_gpt2, tmp_path)
        ready = tmp_path / "ready"
        # ignoring SIGINT, the stage could never be stopped by it: it says so at once (exit 3) instead of waiting
        stage = (f"import pathlib, signal, sys\nif signal.getsignal(signal.SIGINT) is signal.SIG_IGN: sys.exit(3)\n"
                 f"pathlib.Path({str(ready)!r}).touch()\n{WAIT_FOR_SIGINT}")

        def forward_once_ready():
            while not ready.exists():
                time.sleep(0.01)
            loop.forward_signal(signal.SIGINT, None)

        threading.Thread(target=forward_once_ready, daemon=True).start()
        code = loop.run_stage(0, 1, "training", [sys.executable, "-c", stage])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 130


def test_a_state_file_of_an_earlier_rollshard_reads_and_writes_back_unchanged(tmp_path):
    from rollshard.train.loop_state import LoopState

    # Every field a round can hold, as rollshard wrote loop.json before its rounds were typed; round 1 is new.
    written = {"version": 1, "settings": {"model": "/m", "engine": "embedded", "window": 1, "seed": 0, "generate": [],
                                          "train": [], "audit": [], "eval": ["--task", "arithmetic"]}, "rounds": [
        {"round": 0, "policy": "/m", "policy_version": "0", "generated": True,
         "data": {"rows": 4, "failed_prompts": 0, "reward_mean": 0.5, "reward_by_agent": {"policy": 0.5}},
         "seconds": {"generate": 1.0, "train": 2.0, "eval": 3.0}, "audit": {"tokens": 8, "mean": 0.0, "max": 0.0},
         "trained": True, "checkpoint": "round_000/train/checkpoints/step_00000001", "checkpoint_version": "1",
         "train": {"steps": 1, "mismatch_mean": 0.0, "mismatch_max": 0.0, "last_loss": 0.1},
         "eval": {"pass@1": 0.25}, "checkpoint_eval": {"pass@1": 0.5}},
        {"round": 1, "policy": "round_000/train/checkpoints/step_00000001", "policy_version": "1"},
    ]}  # fmt: skip
    (tmp_path / "loop.json").write_text(json.dumps(written))
    state = LoopState.read(tmp_path)
    assert state.rounds[0].trained and state.rounds[0].seconds["eval"] == 3.0 and not state.rounds[1].generated
    assert state.to_json() == written  # a field at its default is left out, as before
    (tmp_path / "loop.json").write_text(json.dumps({**written, "rounds": [{"round": 0, "polcy": "/m"}]}))
    with pytest.raises(UsageError, match="round 0 has fields this rollshard does not know \\(polcy\\)"):
        LoopState.read(tmp_path)
