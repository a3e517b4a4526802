"""The loop's stages forked from a warm server (train/launcher.py): what a stage sees, writes and answers is what
the process it stands for would, and the loop's kill and Ctrl-C rules hold."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rollshard.store.io.dataset import RolloutDataset
from rollshard.train.launcher import ForkedStage, StageLauncher
from rollshard.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 120.0  # a bound for a broken run, not an expectation of speed
PROBE = [sys.executable, "-m", "tests.train.stage_probe"]


@pytest.fixture(scope="module")
def launchers() -> dict[str, StageLauncher]:
    return {"fresh": StageLauncher(fresh=True), "warm": StageLauncher()}


def test_the_loops_import_neither_torch_nor_transformers():
    """The loop checks its flags and starts processes while the server imports torch: its own process needs
    neither (``rollshard-loop --help`` answered in 2.5 s when the loop read checkpoints through torch's modules)."""
    code = ("import sys, rollshard.train.loop, rollshard.train.async_loop; "
            "print(sorted(m for m in ('torch', 'transformers', 'safetensors.torch') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_tests_forked_run_answers_as_subprocess_run(tmp_path):
    """tests/forked.py's run: a command's exit status, stdout and stderr as ``subprocess.run`` gives them; past its
    timeout the command is killed and TimeoutExpired raised."""
    from tests import forked

    for argv in (["rollshard.store", "stats", str(tmp_path / "none")],
                 ["tests.train.stage_probe", str(tmp_path / "seen.json"), "--exit", "3"]):
        want = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=DEADLINE_S)
        got = forked.run(*argv, timeout=DEADLINE_S)
        assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)
    assert (got.returncode, got.stdout, got.stderr) == (3, "to stdout\n", "to stderr\n")
    ready = tmp_path / "ready"
    with pytest.raises(subprocess.TimeoutExpired):  # it waits for a signal: it never ends by itself
        forked.run("tests.train.stage_probe", str(tmp_path / "held.json"), "--wait", str(ready), timeout=1)
    if ready.exists():
        until(lambda: not alive(int(ready.read_text())), "end of the killed run")


def until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"no {what} in {DEADLINE_S:.0f} s"
        time.sleep(0.01)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_forked_stage_sees_writes_and_exits_as_a_started_one(launchers, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    seen = {}
    for mode, launcher in launchers.items():
        out, err = tmp_path / f"{mode}.out", tmp_path / f"{mode}.err"
        stage = launcher.start([*PROBE, "probe.json", "--exit", "3", "--threads"], stdout=out, stderr=err,
                               env={**os.environ, "PROBE": mode, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})  # fmt: skip
        assert isinstance(stage, ForkedStage) == (mode == "warm")
        assert stage.wait() == 3
        seen[mode] = json.loads((tmp_path / "probe.json").read_text())
        assert seen[mode].pop("probe") == mode
        assert (out.read_text(), err.read_text()) == ("to stdout\n", "to stderr\n")
    assert seen["warm"] == seen["fresh"]
    assert seen["warm"] == {
        "argv": ["probe.json", "--exit", "3", "--threads"], "cwd": str(tmp_path), "leads_its_group": True,
        "sigint": True, "sigterm": True, "blocked": [], "threads": 1,
        "cmdline": f"{sys.executable} -m tests.train.stage_probe probe.json --exit 3 --threads",
    }  # fmt: skip


@pytest.mark.parametrize("ignored", [False, True], ids=["loop-handles-signals", "loop-run-with-nohup"])
def test_a_signal_sent_as_the_stage_starts_ends_it(tmp_path, ignored):
    """The loop forwards a Ctrl-C that came while it started the stage right after start() returns: the fork may not
    have its handlers yet, and the signal must end it all the same (130: interrupted; -15: SIGTERM), also when the
    loop was started with SIGINT and SIGTERM ignored (nohup, a script's background job). tests/train/gated_fork.py
    holds each fork, before the server restores its handlers, until the signal is pending."""
    script = (
        "import signal, sys\n"
        "from rollshard.train import launcher\n"
        "launcher.PRELOAD = (*launcher.PRELOAD, 'tests.train.gated_fork')\n"
        "warm = launcher.StageLauncher()\n"
        "for sig in (signal.SIGINT, signal.SIGTERM):\n"
        f"    stage = warm.start([*{PROBE!r}, {str(tmp_path / 'probe.json')!r}, '--wait', {str(tmp_path / 'ready')!r}])\n"
        "    stage.send_signal(sig)\n"
        f"    print(stage.wait(timeout={DEADLINE_S}), flush=True)\n"
    )

    def ignore_them():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)

    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          preexec_fn=ignore_them if ignored else None, timeout=3 * DEADLINE_S)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["130", str(-signal.SIGTERM)]


def test_the_stage_and_the_server_die_with_a_killed_loop(tmp_path):
    ready = tmp_path / "ready"
    loop = subprocess.Popen(
        [sys.executable, "-c", "import sys; from rollshard.train.launcher import StageLauncher\n"
         f"stage = StageLauncher().start([*{PROBE!r}, {str(tmp_path / 'probe.json')!r}, '--wait', {str(ready)!r}])\n"
         "stage.wait()"],
        cwd=REPO,
    )  # fmt: skip
    until(ready.exists, "stage")
    stage = int(ready.read_text())
    server = int(Path(f"/proc/{stage}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert server != loop.pid  # forked from the server, not started by the loop
    loop.kill()
    loop.wait()
    until(lambda: not alive(stage) and not alive(server), "end of the stage and its server")


def test_a_ctrl_c_while_the_server_imports_neither_kills_it_nor_stops_a_stage(tmp_path):
    """A terminal's Ctrl-C goes to every process of the foreground group: the loop (which handles it) and the
    server it just started, still importing torch. The server lives on and forks the next stage."""
    script = (
        "import os, signal, sys\n"
        "from rollshard.train.launcher import StageLauncher\n"
        "signal.signal(signal.SIGINT, lambda *_: print('loop: SIGINT', flush=True))\n"
        "launcher = StageLauncher()\n"
        "os.killpg(0, signal.SIGINT)\n"
        f"stage = launcher.start([*{PROBE!r}, {str(tmp_path / 'probe.json')!r}])\n"
        "print(type(stage).__name__, stage.wait(), flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          process_group=0, timeout=DEADLINE_S)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["loop: SIGINT", "ForkedStage 0"], done.stderr
    assert "server is gone" not in done.stderr


def test_generate_and_train_forked_write_what_started_ones_write(launchers, tiny_gpt2, tmp_path):
    """The same rows (one prompt at a time: their order does not follow timing), then the same training on them,
    bit for bit: nothing the server imported (torch's seeds and threads, transformers) leaks into a stage."""
    data, weights, losses = {}, {}, {}
    for mode, launcher in launchers.items():
        out = tmp_path / mode
        generate = [sys.executable, "-m", "rollshard.generate", "--engine", f"embedded:{tiny_gpt2}", "--task", "toy",
                    "--agents", "single", "--n-samples", "4", "--max-new-tokens", "8", "--limit", "4",
                    "--concurrency", "1", "--seed", "7", "--no-progress", "--out", str(out / "data")]  # fmt: skip
        assert launcher.start(generate).wait() == 0
        train = [sys.executable, "-m", "rollshard.train", "--data", str(tmp_path / "fresh" / "data"), "--model",
                 str(tiny_gpt2), "--out", str(out / "train"), "--groups-per-step", "1", "--lr", "5e-3",
                 "--no-tensorboard", "--no-progress"]  # fmt: skip
        assert launcher.start(train).wait() == 0
        data[mode] = RolloutDataset.open(out / "data").scan().drop("created_at").collect()
        weights[mode] = load_file(out / "train" / "checkpoints" / "latest" / "model.safetensors")
        losses[mode] = [m["loss/total"] for m in read_metrics(out / "train")]
    assert data["warm"].height == 16 and data["warm"].equals(data["fresh"])
    assert len(losses["warm"]) == 4 and losses["warm"] == losses["fresh"]
    assert weights["warm"].keys() == weights["fresh"].keys()
    assert all(weights["warm"][k].equal(weights["fresh"][k]) for k in weights["warm"])
