"""``rollshard-generate --ray``: a real one-machine Ray cluster (started by the command, on 127.0.0.1) running the
shards as tasks against two real ``rollshard-generate serve`` processes; compared with one process."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rollshard.generate.run import main
from rollshard.generate.tasks import get_task, load_prompts
from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.io.validate import validate_dataset

from .conftest import free_port

pytestmark = [pytest.mark.cluster, pytest.mark.slow]  # a Ray cluster per test: ~90 s, the slow tier

REPO = Path(__file__).resolve().parents[2]
N_PROMPTS = 8
DEADLINE_S = 600.0  # for a broken run, not an expectation of speed
STOP_S = 150.0  # a driver left running by a failed test: its tasks' cancellation, then SIGKILL
COMMON = [
    "--agents", "single", "--task", "toy", "--n-samples", "2", "--max-new-tokens", "6", "--limit", str(N_PROMPTS),
    "--concurrency", "2", "--commit-every", "1", "--no-progress",
]  # fmt: skip


def engine(urls) -> list[str]:
    return ["--engine", ",".join(urls)]


@pytest.fixture
def ray_tmp():
    """Ray's session folder: short (its socket paths are limited to 107 bytes), removed after the test."""
    path = tempfile.mkdtemp(prefix="rs-ray-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def driver(args, ray_tmp, log: Path):
    """``rollshard-generate ARGS`` in a subprocess; stopped (SIGTERM: it stops its tasks and its cluster, then
    SIGKILL) if the test leaves it running, so a failed assertion leaves no cluster behind."""
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollshard.generate", *map(str, args)], cwd=REPO, env=env, stdout=f, stderr=f
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def sample_ids(path) -> list[str]:
    return sorted(RolloutDataset.open(path).read(columns=["sample_id"]).column("sample_id").to_pylist())


@pytest.fixture(scope="module")
def reference(two_servers, tmp_path_factory):
    """The same job in one process over both servers."""
    out = tmp_path_factory.mktemp("one-process") / "ds"
    assert main([*engine(two_servers), *COMMON, "--out", str(out)]) == 0
    return out


def test_ray_run_equals_one_process_and_reruns_as_a_no_op(reference, two_servers, tmp_path, ray_tmp):
    out = tmp_path / "ds"
    args = ["--ray", "--num-shards", 2, *engine(two_servers), *COMMON, "--out", out]
    with driver(args, ray_tmp, tmp_path / "driver.log") as proc:
        assert proc.wait(timeout=DEADLINE_S) == 0, (tmp_path / "driver.log").read_text()[-3000:]
    log = (tmp_path / "driver.log").read_text()
    ids = sample_ids(out)
    assert ids == sample_ids(reference) and len(ids) == len(set(ids)) == 2 * N_PROMPTS
    assert validate_dataset(out).problems == []
    ds = RolloutDataset.open(out)
    assert sorted(m.writer_id for m in ds.manifests) == ["gen-0-of-2", "gen-1-of-2"]
    positions = {p.prompt_id: p.index for p in load_prompts(get_task("toy").default_prompts())}
    for m in ds.manifests:  # each task wrote its own shard of the prompts, with the run's config
        shard = int(m.writer_id.split("-")[1])
        assert m.config["shard_index"] == shard and m.config["num_shards"] == 2
        assert m.config["sampling"] == ds.manifests[0].config["sampling"]
    for shard in (0, 1):
        mine = {
            r["prompt_id"]
            for m in ds.manifests if m.writer_id == f"gen-{shard}-of-2"
            for s in m.shards
            for r in _read(out / s.path)
        }  # fmt: skip
        assert mine and all(positions[p] % 2 == shard for p in mine)
        assert f"shard {shard} of 2: {N_PROMPTS // 2} of {N_PROMPTS // 2} prompts done" in log
    assert "2 Ray tasks in " in log and f"holds {N_PROMPTS} of {N_PROMPTS} prompts, {2 * N_PROMPTS} rows" in log
    assert "failed" not in log

    with driver(args, ray_tmp, tmp_path / "rerun.log") as rerun:
        assert rerun.wait(timeout=DEADLINE_S) == 0
    log = (tmp_path / "rerun.log").read_text()
    assert f"shard 0 of 2: 0 of {N_PROMPTS // 2} prompts done" in log and f"{N_PROMPTS // 2} already there" in log
    assert sample_ids(out) == ids


@pytest.mark.s3
def test_ray_run_into_s3_equals_one_process(reference, two_servers, s3_dataset, tmp_path, ray_tmp):
    # The tasks find the dataset through the environment they inherit (AWS_ENDPOINT_URL, credentials).
    args = ["--ray", "--num-shards", 2, *engine(two_servers), *COMMON, "--out", s3_dataset]
    with driver(args, ray_tmp, tmp_path / "driver.log") as proc:
        assert proc.wait(timeout=DEADLINE_S) == 0, (tmp_path / "driver.log").read_text()[-3000:]
    assert sample_ids(s3_dataset) == sample_ids(reference)
    assert sorted(m.writer_id for m in RolloutDataset.open(s3_dataset).manifests) == ["gen-0-of-2", "gen-1-of-2"]
    assert validate_dataset(s3_dataset).problems == []


def _read(path):
    return pq.read_table(path, columns=["prompt_id"]).to_pylist()


def test_a_killed_task_is_reported_and_rerun_nothing_lost_or_doubled(reference, two_servers, tmp_path, ray_tmp):
    out, gate = tmp_path / "ds", tmp_path / "gate"
    # Shard 0's worker stops right after its first commit, until this test kills it (tests/ray_gates.py).
    spec = {"target": "rollshard.store.io.writer:ShardWriter.commit", "writer_id": "gen-0-of-2", "count": 1,
            "signal": str(gate)}  # fmt: skip
    runtime_env = {"worker_process_setup_hook": "tests.ray_gates.install",
                   "env_vars": {"ROLLSHARD_TEST_GATE": json.dumps(spec), "PYTHONPATH": str(REPO)}}  # fmt: skip
    args = ["--ray", "--num-shards", 2, "--ray-runtime-env", json.dumps(runtime_env), *engine(two_servers), *COMMON,
            "--out", out]  # fmt: skip
    with driver(args, ray_tmp, tmp_path / "driver.log") as proc:
        deadline = time.monotonic() + DEADLINE_S
        while not gate.exists():
            assert proc.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "shard 0 never reached its first commit"
            time.sleep(0.05)  # waiting for the gate, not for time to pass
        worker = int(gate.read_text())
        try:
            ds = RolloutDataset.open(out)
            committed = [m for m in ds.manifests if m.writer_id == "gen-0-of-2"]
            assert [len(m.shards) for m in committed] == [1]  # killed mid-shard: after its first commit
            # The first commit holds the episodes finished by then: one, or two when both in flight (--concurrency 2)
            # finished together, as on a busy machine.
            first = {p for shard in committed[0].shards
                     for p in pq.read_table(out / shard.path, columns=["prompt_id"]).column("prompt_id").to_pylist()}
            assert 1 <= len(first) < N_PROMPTS // 2
        finally:
            os.kill(worker, signal.SIGKILL)  # a worker held at the gate stops no other way
        assert proc.wait(timeout=DEADLINE_S) == 0, (tmp_path / "driver.log").read_text()[-3000:]
    log = (tmp_path / "driver.log").read_text()
    assert "shard 0 of 2 failed (attempt 1 of 3): WorkerCrashedError" in log
    done, there = N_PROMPTS // 2 - len(first), len(first)
    assert f"shard 0 of 2: {done} of {N_PROMPTS // 2} prompts done" in log and f"; {there} already there" in log, log
    assert "shard 1 of 2 failed" not in log
    ids = sample_ids(out)
    assert ids == sample_ids(reference) and len(ids) == len(set(ids))  # the union exact: nothing lost or doubled
    assert validate_dataset(out).problems == []


def test_ray_usage_errors_are_one_line(tiny_gpt2, tmp_path, capsys, monkeypatch):
    base = ["--engine", f"embedded:{tiny_gpt2}", "--task", "toy", "--limit", "2", "--out", str(tmp_path / "ds")]
    cases = [
        (["--ray", "not an address"], "--ray 'not an address': expected a Ray cluster address"),
        (["--ray", f"127.0.0.1:{free_port()}"], "nothing answers there ("),
        (["--ray", "--shard-index", "1", "--num-shards", "2"], "--shard-index is not for --ray"),
        (["--ray", "--ray-retries", "-1"], "--ray-retries must be >= 0"),
        (["--ray", "--ray-runtime-env", "{nope"], "--ray-runtime-env is not JSON"),
        (["--ray", "--ray-runtime-env", "[1]"], "--ray-runtime-env must be a JSON object, got list"),
        (["--ray", "--prompts", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
    ]
    for extra, message in cases:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("rollshard-generate: error: ") and message in err, err
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    assert main([*base, "--ray"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--ray needs Ray, which is not installed: pip install 'rollshard[ray]'" in err
    assert not (tmp_path / "ds").exists()
    # A resume with other settings is refused by the driver, before Ray (still "not installed") is needed.
    small = [*base, "--n-samples", "1", "--max-new-tokens", "2", "--no-progress"]
    assert main(small) == 0
    capsys.readouterr()
    assert main([*small, "--ray", "--temperature", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds rows generated with another sampling.temperature (1.0 there, 0.5 now" in err


def test_progress_reports_absolute_counts_at_start_and_end(tiny_gpt2, tmp_path):
    # What each Ray task sends the driver's bar: (prompts done, prompts of the shard), absolute, so a rerun of a
    # shard (which starts from its committed prompts) replaces its count instead of adding to it.
    args = ["--engine", f"embedded:{tiny_gpt2}", "--agents", "single", "--task", "toy", "--n-samples", "1",
            "--max-new-tokens", "2", "--limit", "3", "--concurrency", "1", "--no-progress", "--out", str(tmp_path / "ds")]  # fmt: skip
    calls = []
    assert main([*args, "--limit", "2"], progress=lambda done, total: calls.append((done, total))) == 0
    assert calls[0] == (0, 2) and calls[-1] == (2, 2) and all(a <= b for (a, _), (b, _) in zip(calls, calls[1:]))
    calls.clear()
    assert main(args, progress=lambda done, total: calls.append((done, total))) == 0  # one prompt more: resumes
    assert calls[0] == (2, 3) and calls[-1] == (3, 3)
