"""rollshard-loop --async: one engine, one generator, one trainer through one live dataset.

What the run must do, checked from what it wrote (never from timing): the admission gate's exact counts
(at eta 1, B 2 and a push every 2 steps, exactly 4 episodes start at version 0), every trained row within
eta of the policy that trained on it (from the rows' version spans, replaying the trainer's follower over
the final dataset), and after a kill -9 of any process, or a Ctrl-C, the same command finishes with every
step trained once on exactly the groups the follower's cursor says (nothing lost, nothing trained twice).
"""

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest

from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.loader import LoaderConfig
from rollshard.store.loader.follow import FollowLoader
from rollshard.train.checkpoint import latest_checkpoint
from rollshard.train.loggers import read_metrics

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 600
STEPS, ETA, EVERY, B = 6, 1, 2, 2
KILL_STEPS = 24  # the kill tests' runs: the first checkpoint (step 4) far from the end


def command(model: Path, out: Path, steps: int = STEPS) -> list[str]:
    return [
        sys.executable, "-m", "rollshard.train.loop", "--async", "--model", str(model), "--out", str(out),
        "--steps", str(steps), "--max-staleness", str(ETA), "--update-every", str(EVERY), "--no-progress", "--json",
        "--generate", "--task toy --n-samples 4 --max-new-tokens 8",
        "--train", f"--groups-per-step {B} --lr 5e-3 --mode decoupled --no-tensorboard --save-every 4",
    ]  # fmt: skip


def start(model: Path, out: Path, steps: int = STEPS) -> subprocess.Popen:
    return subprocess.Popen(command(model, out, steps), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=DEADLINE_S)
    return proc.returncode, out, err


def until(condition, what: str) -> None:
    """A gate on what the run wrote (polled; the deadline only bounds a hung run)."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.005)


def replay(data: Path, steps: int) -> list:
    """The trainer's steps, from the final dataset: a follower taking the shards in commit order, its policy
    version moved after each step as the trainer's is (versions 0, 1, ...)."""
    config = LoaderConfig(groups_per_step=B, max_staleness=ETA, current_version="0")
    loader = FollowLoader(data, config, poll_s=0.01, wait_s=5)
    it, out = iter(loader), []
    for s in range(steps):
        out.append(next(it))
        loader.set_current_version(s + 1)
    return out


def check_run(out: Path, steps: int = STEPS) -> None:
    """Every step once, on exactly the groups the follower's cursor covers, no trained row past eta."""
    metrics = read_metrics(out / "train")
    assert [int(m["step"]) for m in metrics] == list(range(1, steps + 1))
    ckpt = latest_checkpoint(out / "train")
    assert ckpt.step == steps and ckpt.weight_version == str(steps)
    state = ckpt.loader_states[0]
    ds = RolloutDataset.open(out / "data")
    groups = {s.path: s.groups for s in ds.shards}
    covered = sum(groups[p] for p in state["used_shards"]) + state["next_group"]
    assert sum(m["loader/groups_examined"] for m in metrics) == covered  # nothing skipped, nothing taken twice
    table = ds.read(columns=["sample_id", "weight_version", "weight_versions"])
    version = dict(zip(table.column("sample_id").to_pylist(), table.column("weight_version").to_pylist()))
    oldest = {
        sid: min([int(version[sid])] + [int(s["version"]) for s in spans or []])
        for sid, spans in zip(table.column("sample_id").to_pylist(), table.column("weight_versions").to_pylist())
    }
    for s, (step, m) in enumerate(zip(replay(out / "data", steps), metrics)):
        ids = [sid for mb in step.micro_batches for sid in mb.sample_ids]
        assert max(s - oldest[sid] for sid in ids) <= ETA
        rewards = [r for mb in step.micro_batches for r in mb.rewards.tolist()]
        assert len(ids) == m["data/sequences"]
        assert sum(rewards) / len(rewards) == pytest.approx(m["reward/mean"], abs=1e-6)  # the rows it trained on


def episodes_by_version(data: Path) -> dict[int, int]:
    t = RolloutDataset.open(data).read(columns=["prompt_id", "weight_version"])
    first = {}
    for p, v in zip(t.column("prompt_id").to_pylist(), t.column("weight_version").to_pylist()):
        first.setdefault(p, int(v))
    return dict(collections.Counter(first.values()))


def test_async_run_gates_generation_pushes_weights_and_trains_within_eta(tiny_gpt2, tmp_path):
    out = tmp_path / "run"
    code, stdout, err = finish(start(tiny_gpt2, out))
    assert code == 0, err
    figures = json.loads(stdout)["async"]
    metrics = read_metrics(out / "train")
    assert figures["steps"] == STEPS and figures["rows_trained"] == sum(m["data/sequences"] for m in metrics)
    assert figures["rows_dropped_stale"] == 0
    check_run(out)
    # The gate: (eta + 1 + v) * B episodes in all may start while the engine serves v, and the engine moves to
    # v = 2 only once the trainer took 2 steps, i.e. 4 episodes: exactly 4 start at 0, 4 more at 2, 4 at 4 (the
    # trainer pushed at 2, 4 and 6; what started at 6 before the end may or may not be committed).
    by_version = episodes_by_version(out / "data")
    assert {v: n for v, n in by_version.items() if v != 6} == {0: 4, 2: 4, 4: 4}
    assert 0 < figures["engine_busy_share"] <= 1 and 0 < figures["trainer_busy_share"] <= 1
    assert figures["staleness_hist"] and set(figures["staleness_hist"]) <= {"0", "1"}
    page = (out / "report.html").read_text()
    assert "Generation and training at once" in page and "staleness of the trained rows" in page
    # Done: the same command again starts nothing.
    code, stdout, _ = finish(start(tiny_gpt2, out))
    assert code == 0


def held_mid_run(model: Path, out: Path) -> subprocess.Popen:
    """A run of KILL_STEPS steps stopped (SIGSTOP) once its first checkpoint (step 4) is written. The loop pushes
    the weights, and the gate admits episodes for at most 2 steps past the version the engine serves: with the loop
    stopped the trainer stalls at most 2 steps past the last push, and the loop would need 10 more push-generate-
    train cycles before the test's next look (every 5 ms) to end the run first."""
    proc = start(model, out, KILL_STEPS)
    until(lambda: latest_checkpoint(out / "train") is not None or proc.poll() is not None, "a first checkpoint")
    assert proc.poll() is None, finish(proc)[2]
    proc.send_signal(signal.SIGSTOP)
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["train", "generate", "serve", "loop"])
def test_kill_9_anywhere_then_the_same_command_finishes_with_nothing_lost(tiny_gpt2, tmp_path, victim):
    out = tmp_path / "run"
    proc = held_mid_run(tiny_gpt2, out)
    family = descendants(proc.pid)  # the stage server and the three stages forked from it
    assert {"train", "generate", "serve"} <= {stage_of(pid) for pid in family}
    os.kill(proc.pid if victim == "loop" else child_pid(proc.pid, victim), signal.SIGKILL)
    proc.send_signal(signal.SIGCONT)
    code, _, err = finish(proc)
    assert code == (-signal.SIGKILL if victim == "loop" else 1), err
    if victim != "loop":
        assert f"{victim} exited with -9" in err
    until(lambda: not any(alive(pid) for pid in family), "the children gone")
    code, _, err = finish(start(tiny_gpt2, out, KILL_STEPS))
    assert code == 0, err
    check_run(out, KILL_STEPS)


@pytest.mark.slow
def test_ctrl_c_stops_all_three_with_130_and_the_rerun_finishes(tiny_gpt2, tmp_path):
    out = tmp_path / "run"
    proc = held_mid_run(tiny_gpt2, out)
    kids = descendants(proc.pid)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGCONT)
    code, _, err = finish(proc)
    assert code == 130, err
    assert "interrupted; rerun the same command to continue" in err
    until(lambda: not any(alive(pid) for pid in kids), "the children gone")  # the stage server exits after the loop
    code, _, err = finish(start(tiny_gpt2, out, KILL_STEPS))
    assert code == 0, err
    check_run(out, KILL_STEPS)


def descendants(pid: int) -> list[int]:
    """Every process under ``pid``: the loop's stage server, and the stages forked from it."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(k) for k in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            continue
        found += kids
        todo += kids
    return found


def stage_of(pid: int) -> str | None:
    """Which stage a process is, by its command line (a forked stage is titled with its command)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split()
    except OSError:
        return None
    if "serve" in args:
        return "serve"
    if "--repeat" in args:
        return "generate"
    return "train" if "rollshard.train" in args else None


def child_pid(loop_pid: int, name: str) -> int:
    for pid in descendants(loop_pid):
        if stage_of(pid) == name:
            return pid
    raise AssertionError(f"no {name} stage under {loop_pid}")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--async"], "--async needs --steps N (>= 1)"),
        (["--async", "--steps", "0"], "--async needs --steps N (>= 1)"),
        (["--steps", "4"], "--steps is for --async runs"),
        (["--max-staleness", "2"], "--max-staleness is for --async runs"),
        (["--async", "--steps", "4", "--max-staleness", "-1"], "--max-staleness, --serve-threads and --train-threads must"),
        (["--async", "--steps", "4", "--window", "2"], "--window is for rounds; --async trains on one live dataset"),
        (["--async", "--steps", "4", "--generate=--repeat"], "--generate may not set --repeat: the loop sets it"),
        (["--async", "--steps", "4", "--train", "--max-steps 3"], "--train may not set --max-steps: the loop sets it"),
    ],
)
def test_async_bad_input_is_one_line(tiny_gpt2, tmp_path, extra, message):
    done = subprocess.run(
        [sys.executable, "-m", "rollshard.train.loop", "--model", str(tiny_gpt2), "--out", str(tmp_path / "r"), *extra],
        cwd=REPO, capture_output=True, text=True,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert not (tmp_path / "r").exists()


def test_a_run_folder_keeps_its_mode(tmp_path):
    import dataclasses

    from rollshard.train.async_loop import AsyncLoop, AsyncSettings
    from rollshard.train.loop import Loop, LoopSettings, UsageError
    from rollshard.train.loop_state import LoopState

    out = tmp_path / "r"
    out.mkdir()
    (out / "loop.json").write_text(json.dumps({"version": 1, "settings": {"mode": "async"}, "rounds": []}))
    rounds = LoopSettings(model="m", engine="embedded", window=1, seed=0, generate=[], train=[])
    with pytest.raises(UsageError, match="is an --async run; rerun it with --async"):
        Loop(out, rounds, [], progress=False).reconcile(LoopState.read(out))
    settings = AsyncSettings(model="m", engine="embedded", seed=0, generate=[], train=[], max_staleness=1,
                             update_every=1, serve_threads=1, train_threads=0, steps=4)
    with pytest.raises(UsageError, match="holds rounds of the synchronous loop; choose a new --out for --async"):
        AsyncLoop(out, settings, progress=False).check_state(LoopState(settings=rounds.to_json()))
    AsyncLoop(out, dataclasses.replace(settings, steps=8), progress=False).check_state(
        LoopState(settings=settings.to_json()))  # --steps may grow
    with pytest.raises(UsageError, match=r"another max_staleness \(1 there, 2 now\)"):
        AsyncLoop(out, dataclasses.replace(settings, max_staleness=2), progress=False).check_state(
            LoopState(settings=settings.to_json()))


def test_dry_run_prints_the_three_commands_and_writes_nothing(tiny_gpt2, tiny_moe, tmp_path):
    out = tmp_path / "r"
    argv = command(tiny_gpt2, out)
    argv.remove("--json")
    done = subprocess.run([*argv, "--dry-run"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    serve, generate, train = done.stdout.splitlines()
    assert f"-m rollshard.generate serve --model {tiny_gpt2} --port 0 --weight-version 0" in serve
    assert "--enable-return-routed-experts" not in serve
    assert f"--repeat --max-ahead {ETA} --step-episodes {B} --first-version 0 --commit-every {B}" in generate
    assert f"--follow --model {tiny_gpt2} --out {out / 'train'} --max-steps {STEPS} --export-every {EVERY}" in train
    assert not out.exists()
    # A mixture of experts: the engine returns its routing (the generator's auto stores it, the trainer replays it).
    argv = command(tiny_moe, out)
    argv.remove("--json")
    done = subprocess.run([*argv, "--dry-run"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.splitlines()[0].endswith("--enable-return-routed-experts")
