"""The per-step loggers: --logger and its config, wandb next to metrics.jsonl and TensorBoard, resumes, failures.

The wandb runs are real (wandb 0.31, WANDB_MODE=offline) in subprocesses whose HOME, config, cache, data and
temporary folders lie under the test's tmp_path, and whose WANDB_BASE_URL points at a closed local port: no
network, no writes elsewhere, and no wandb session shared with the test process. Offline wandb 0.31 writes no
files/wandb-summary.json or config.yaml; everything is read back from the run's ``.wandb`` file, a LevelDB-style
log of ``wandb.proto`` records (:func:`wandb_records`; wandb 0.31 ships no Python reader of its own).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import yaml

from rollshard.train.checkpoint import CONFIG_FILE, latest_checkpoint
from rollshard.train.config import TrainConfig, WandbConfig
from rollshard.train.loggers import WANDB_MISSING, WANDB_RUN_FILE, MetricsLogger
from rollshard.train.metrics import read_metrics
from tests import forked
from tests.gated_main import Gate, fork_gated, wait_for_gate
from tests.train.conftest import SINGLE_THREAD_ENV

WANDB_KEYS = {"_step", "_runtime", "_timestamp"}  # wandb's own keys in every history row
# metrics.jsonl and wandb receive the same Python floats; JSON keeps doubles exact both ways.
SAME_FLOAT = dict(rel=1e-12, abs=0.0)


def args_for(data, model, out, *extra) -> list[str]:
    return [
        "--data", str(data), "--model", str(model), "--out", str(out), "--groups-per-step", "2",
        "--micro-batch-tokens", "128", "--lr", "1e-3", "--no-progress", *map(str, extra),
    ]  # fmt: skip


def wandb_env(tmp_path: Path, mode: str = "offline") -> dict[str, str]:
    """The environment of a training subprocess: wandb offline (or online with no key), every folder it writes
    under ``tmp_path``."""
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(SINGLE_THREAD_ENV)
    env.update({
        "WANDB_MODE": mode, "HOME": str(home), "WANDB_CONFIG_DIR": str(home / "wandb-config"),
        "WANDB_CACHE_DIR": str(home / "wandb-cache"), "WANDB_DATA_DIR": str(home / "wandb-data"),
        "WANDB_BASE_URL": "http://127.0.0.1:9", "XDG_CACHE_HOME": str(home / "cache"),
        "XDG_CONFIG_HOME": str(home / "config"), "TMPDIR": str(tmp_path / "tmp"), "WANDB_SILENT": "true",
    })  # fmt: skip
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return env


def run_cli(argv: list[str], env: dict[str, str], *, prelude: str = "") -> subprocess.CompletedProcess:
    """``rollshard-train ARGV`` in a process of its own (a fork: tests/forked.py), after ``prelude`` (Python run
    first: a patch)."""
    code = prelude + textwrap.dedent(f"""
        import sys
        from rollshard.train.cli import main
        sys.exit(main({argv!r}))
    """)
    return forked.run("tests.run_code", code, env=env)


# -- reading what wandb wrote -------------------------------------------------------------------------------

LOG_BLOCK = 32768  # the LevelDB log format: 32 KiB blocks of records, each with a 7-byte header
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    """The ``wandb.proto`` records of a ``.wandb`` file: a 7-byte W&B header, then LevelDB log records (crc32,
    length, type; a record longer than a block's rest is split FIRST/MIDDLE/LAST; a block's tail under 7 bytes
    is padding)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), path
    out, pos, part = [], 7, b""
    while pos + 7 <= len(data):
        left = LOG_BLOCK - pos % LOG_BLOCK
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding to the block's end
            pos += left
            continue
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        part = payload if kind in (FULL, FIRST) else part + payload
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(part)
            out.append(record)
        assert kind in (FULL, FIRST, MIDDLE, LAST), kind
    return out


def _items(items) -> dict:
    """Items as a dict: ``loss/total`` is one key; a histogram's parts (``staleness`` > ``bins``) nest."""
    out: dict = {}
    for item in items:
        *parents, leaf = list(item.nested_key) or [item.key]
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = json.loads(item.value_json)
    return out


def wandb_segments(root: Path) -> list[dict]:
    """Each run folder under ``root/wandb`` (one per start of the trainer), in start order: its run record's
    id, project, name, tags and config, its history rows and its exit code."""
    segments = []
    for folder in root.glob("wandb/offline-run-*"):
        (path,) = folder.glob("run-*.wandb")
        seg = {"history": [], "summary": {}, "config": {}, "exit_code": None}
        for r in wandb_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                seg.update(id=r.run.run_id, project=r.run.project, name=r.run.display_name, tags=list(r.run.tags),
                           start=r.run.start_time.ToNanoseconds())
                seg["config"].update(_items(r.run.config.update))
            elif kind == "config":
                seg["config"].update(_items(r.config.update))
            elif kind == "history":
                seg["history"].append(_items(r.history.item))
            elif kind == "summary":
                seg["summary"].update(_items(r.summary.update))
            elif kind == "exit":
                seg["exit_code"] = r.exit.exit_code
        segments.append(seg)
    return sorted(segments, key=lambda s: s["start"])


def assert_logged_as_jsonl(row: dict, record: dict) -> None:
    """A wandb history row holds exactly the scalars of its metrics.jsonl record, equal, and the staleness
    histogram of the step's rows."""
    scalars = {k: v for k, v in row.items() if k not in WANDB_KEYS and k != "staleness"}
    assert set(scalars) == set(record) - {"step", "time"}
    for k, v in scalars.items():
        assert v == pytest.approx(record[k], **SAME_FLOAT), (record["step"], k)
    hist = row["staleness"]
    assert hist["_type"] == "histogram" and sum(hist["values"]) == record["data/sequences"]
    lags = {k.rsplit("/", 1)[1]: n for k, n in record.items() if k.startswith("staleness/hist/")}
    for count, lo, hi in zip(hist["values"], hist["bins"], hist["bins"][1:]):  # one bin per lag, centred on it
        lag = lo + 0.5
        assert hi - lo == 1.0 and lag == int(lag) and count == lags.get(str(int(lag)), 0)


# -- a run with every logger ----------------------------------------------------------------------------------


def test_wandb_logs_every_step_as_metrics_jsonl(tiny_dataset, tiny_gpt2, tmp_path):
    out = tmp_path / "run-a"
    argv = args_for(tiny_dataset, tiny_gpt2, out, "--max-steps", 3, "--logger", "jsonl,tensorboard,wandb",
                    "--wandb-tags", "tiny,grpo")
    done = run_cli(argv, wandb_env(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("rollshard-train: 3 steps") and f"TensorBoard {out}/tb" in done.stdout
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]

    (seg,) = wandb_segments(out)  # under --out: the default wandb dir
    assert seg["id"] == json.loads((out / WANDB_RUN_FILE).read_text())["id"]
    assert (seg["project"], seg["name"], seg["tags"]) == ("rollshard", "run-a", ["tiny", "grpo"])
    resolved = yaml.safe_load((latest_checkpoint(out).path / CONFIG_FILE).read_text())
    assert {k: v for k, v in seg["config"].items() if k != "_wandb"} == resolved  # the run's config
    assert resolved["trainer"]["logger"] == ["jsonl", "tensorboard", "wandb"]
    assert [row["_step"] for row in seg["history"]] == [1, 2, 3]  # step= the trainer step
    for row, record in zip(seg["history"], records, strict=True):
        assert_logged_as_jsonl(row, record)
    assert seg["summary"]["loss/total"] == pytest.approx(records[-1]["loss/total"], **SAME_FLOAT)
    assert seg["exit_code"] == 0  # finished

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("loss/total")] == pytest.approx([r["loss/total"] for r in records])
    assert not list((tmp_path / "home").rglob("*.wandb"))  # the run lives in --out only


# -- resume: a crash after a step was logged, Ctrl-C, then to the end -----------------------------------------

CRASH_SAVING_STEP_2 = textwrap.dedent("""
    import rollshard.train.trainer as trainer_mod

    real_save = trainer_mod.save_checkpoint

    def save(out, *, step, **kw):  # step 2 is logged, then its save fails
        if step == 2:
            raise OSError(28, "No space left on device")
        return real_save(out, step=step, **kw)

    trainer_mod.save_checkpoint = save
""")


def test_resume_continues_the_wandb_run_and_logs_each_step_once(tiny_dataset, tiny_gpt2, tmp_path):
    out, env = tmp_path / "run", wandb_env(tmp_path)
    argv = args_for(tiny_dataset, tiny_gpt2, out, "--max-steps", 4, "--num-epochs", 2, "--save-every", 1,
                    "--logger", "jsonl,wandb")

    # 1. Steps 1 and 2 are logged; step 2's checkpoint fails (exit 1): the latest checkpoint is step 1.
    crashed = run_cli(argv, env, prelude=CRASH_SAVING_STEP_2)
    assert crashed.returncode == 1 and "No space left on device" in crashed.stderr, crashed.stderr
    assert latest_checkpoint(out).step == 1 and [r["step"] for r in read_metrics(out)] == [1, 2]
    first_step_2 = read_metrics(out)[1]

    # 2. --resume re-runs step 2 from the checkpoint, then Ctrl-C after step 3 (exit 130, step 3 saved).
    gate = Gate("rollshard.train.trainer:Trainer.train_step", 2, str(tmp_path / "at-3"), str(tmp_path / "go"))
    proc = fork_gated([gate], "rollshard.train", *argv, "--resume", env=env)
    try:
        wait_for_gate(proc, gate)
        os.kill(proc.pid, signal.SIGINT)
        (tmp_path / "go").write_text("")
        _, stderr = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "rollshard-train: interrupted (SIGINT); saved step 3" in stderr

    # 3. --resume to the end.
    done = run_cli([*argv, "--resume"], env)
    assert done.returncode == 0, done.stderr

    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    segments = wandb_segments(out)
    run_id = json.loads((out / WANDB_RUN_FILE).read_text())["id"]
    assert [s["id"] for s in segments] == [run_id] * 3  # one run, three starts
    assert [s["exit_code"] for s in segments] == [1, 130, 0]  # finished on the error, the signal, the end
    assert [[row["_step"] for row in s["history"]] for s in segments] == [[1, 2], [3], [4]]  # each step once
    rows = [row for s in segments for row in s["history"]]
    for row, record in zip(rows, records, strict=True):
        if record["step"] == 2:  # wandb keeps the values of the crashed attempt, metrics.jsonl the re-run's
            assert_logged_as_jsonl(row, first_step_2)
            assert row["loss/total"] == pytest.approx(record["loss/total"], rel=1e-5, abs=1e-7)
        else:
            assert_logged_as_jsonl(row, record)


# -- failures: one line, exit 2, nothing written ----------------------------------------------------------------


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


NO_WANDB_AND_NOTHING_LOADED = textwrap.dedent("""
    import sys
    import rollshard.train.trainer as trainer_mod

    sys.modules["wandb"] = None  # as if not installed

    def loaded(*args, **kwargs):
        sys.exit("the data or the model was loaded")

    trainer_mod.build_loader = trainer_mod.build_backend = loaded
""")


def test_missing_wandb_is_one_line_before_anything_runs(tiny_dataset, tiny_gpt2, tmp_path):
    out = tmp_path / "run"
    done = run_cli(args_for(tiny_dataset, tiny_gpt2, out, "--logger", "jsonl,wandb"), wandb_env(tmp_path),
                   prelude=NO_WANDB_AND_NOTHING_LOADED)
    assert done.returncode == 2
    assert done.stderr == f"rollshard-train: error: {WANDB_MISSING}\n" and done.stdout == ""
    assert not out.exists()


def test_missing_wandb_at_the_logger_itself(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ValueError, match=r"^--logger wandb needs wandb: pip install 'rollshard\[wandb\]'$"):
        MetricsLogger(tmp_path / "run", wandb=WandbConfig())
    assert not (tmp_path / "run").exists()


def test_wandb_init_failure_is_one_line_and_leaves_out_as_it_was(tiny_dataset, tiny_gpt2, tmp_path):
    from rollshard.train.cli import main

    env = wandb_env(tmp_path, mode="online")  # online, and no API key anywhere: wandb.init refuses
    fresh = tmp_path / "fresh"
    done = run_cli(args_for(tiny_dataset, tiny_gpt2, fresh, "--max-steps", 1, "--logger", "jsonl,wandb"), env)
    assert done.returncode == 2 and done.stdout == ""
    err = done.stderr.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("rollshard-train: error: --logger wandb: wandb could not start the run (")
    assert "wandb login" in err and "WANDB_MODE=offline" in err
    assert not fresh.exists()

    resumed = tmp_path / "resumed"  # a run of one step, then a --resume with wandb that cannot start
    assert main(args_for(tiny_dataset, tiny_gpt2, resumed, "--max-steps", 1)) == 0
    before = tree(resumed)
    done = run_cli(args_for(tiny_dataset, tiny_gpt2, resumed, "--max-steps", 2, "--logger", "jsonl,wandb",
                            "--resume"), env)
    assert done.returncode == 2 and "wandb could not start the run" in done.stderr
    assert tree(resumed) == before


# -- the wandb logger's choices, against a stand-in wandb module --------------------------------------------------


class FakeRun:
    def __init__(self, kw: dict, starting_step: int):
        self.id = kw.get("id") or kw["resume_from"].split("?")[0]
        self.kw, self.starting_step, self.logged, self.exit_code, self.dir = kw, starting_step, [], None, "d"

    def log(self, data, *, step):
        self.logged.append((step, data))

    def finish(self, exit_code):
        self.exit_code = exit_code


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in ``wandb`` module that records ``init`` and the run's calls; ``starting_step`` is the step a
    server would resume the run at (0 offline)."""
    module = types.ModuleType("wandb")
    module.runs, module.starting_step = [], 0
    module.errors = types.SimpleNamespace(Error=RuntimeError)
    module.Histogram = lambda np_histogram: ("histogram", [list(a) for a in np_histogram])

    def init(**kw):
        module.runs.append(FakeRun(kw, module.starting_step))
        return module.runs[-1]

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    for var in ("WANDB_PROJECT", "WANDB_NAME", "WANDB_DIR", "WANDB_ENTITY", "WANDB_TAGS"):
        monkeypatch.delenv(var, raising=False)
    return module


def test_a_fresh_run_starts_a_new_wandb_run_named_after_out(fake_wandb, tmp_path):
    out = tmp_path / "my-run"
    log = MetricsLogger(out, tensorboard=False, wandb=WandbConfig(), run_config={"optim": {"lr": 0.1}})
    log.log(1, {"loss/total": 0.5}, histograms={"staleness": [0.0, 0.0, 2.0]})
    log.close(exit_code=0)
    (run,) = fake_wandb.runs
    assert {k: run.kw[k] for k in ("project", "name", "dir", "config", "entity", "tags")} == {
        "project": "rollshard", "name": "my-run", "dir": str(out), "config": {"optim": {"lr": 0.1}},
        "entity": None, "tags": None,
    }
    assert "resume" not in run.kw and "resume_from" not in run.kw and len(run.id) == 8
    # lags 0, 0, 2: one bin per integer lag from -0.5 to 2.5
    assert run.logged == [(1, {"loss/total": 0.5, "staleness": ("histogram", [[2, 0, 1], [-0.5, 0.5, 1.5, 2.5]])})]
    assert run.exit_code == 0
    assert json.loads((out / WANDB_RUN_FILE).read_text()) == {"id": run.id, "step": 1}


def test_settings_then_wandb_environment_then_defaults(fake_wandb, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.setenv("WANDB_NAME", "env-name")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "env-dir"))
    MetricsLogger(tmp_path / "a", tensorboard=False, wandb=WandbConfig()).close()
    MetricsLogger(tmp_path / "b", tensorboard=False,
                  wandb=WandbConfig(project="p", name="n", dir=str(tmp_path / "d"), entity="e", tags=("x",))).close()
    env_run, set_run = fake_wandb.runs
    assert (env_run.kw["project"], env_run.kw["name"], env_run.kw["dir"]) == ("from-env", "env-name",
                                                                             str(tmp_path / "env-dir"))
    assert [set_run.kw[k] for k in ("project", "name", "dir", "entity", "tags")] == ["p", "n", str(tmp_path / "d"),
                                                                                     "e", ["x"]]


@pytest.mark.parametrize("mode,starting_step,init_kw,first_logged", [
    ("allow", 0, {"id": "abc", "resume": "allow"}, 4),  # offline: steps up to 3 were given to the run
    ("allow", 6, {"id": "abc", "resume": "allow"}, 6),  # online: the server holds up to step 5
    ("rewind", 3, {"resume_from": "abc?_step=2"}, 3),  # history cut after the checkpoint: 3 is logged again
])  # fmt: skip
def test_resume_continues_the_recorded_run(fake_wandb, tmp_path, mode, starting_step, init_kw, first_logged):
    out = tmp_path / "run"
    out.mkdir()
    (out / WANDB_RUN_FILE).write_text(json.dumps({"id": "abc", "step": 3}))  # checkpoint at 2, step 3 logged
    fake_wandb.starting_step = starting_step
    log = MetricsLogger(out, tensorboard=False, wandb=WandbConfig(resume=mode), resume_step=2)
    for step in range(3, 8):
        log.log(step, {"loss/total": float(step)})
    log.close(exit_code=130)
    (run,) = fake_wandb.runs
    assert {k: run.kw[k] for k in init_kw} == init_kw and ("id" in init_kw) != ("resume_from" in run.kw)
    assert [step for step, _ in run.logged] == list(range(first_logged, 8)) and run.exit_code == 130
    assert json.loads((out / WANDB_RUN_FILE).read_text()) == {"id": "abc", "step": 7}


@pytest.mark.parametrize("mode,init_kw,first_logged", [
    ("allow", {"id": "abc", "resume": "allow"}, 4),
    ("rewind", {"resume_from": "abc?_step=0"}, 1),
])  # fmt: skip
def test_a_restart_from_step_0_continues_the_wandb_run_of_its_out(fake_wandb, tmp_path, capsys, mode, init_kw,
                                                                   first_logged):
    out = tmp_path / "run"
    out.mkdir()
    (out / WANDB_RUN_FILE).write_text(json.dumps({"id": "abc", "step": 3}))  # killed at step 3, never saved
    log = MetricsLogger(out, tensorboard=False, wandb=WandbConfig(resume=mode), resume_step=None)
    for step in range(1, 6):
        log.log(step, {"loss/total": float(step)})
    log.close(exit_code=0)
    (run,) = fake_wandb.runs  # the same run, not a second one beside it
    assert {k: run.kw[k] for k in init_kw} == init_kw
    assert [step for step, _ in run.logged] == list(range(first_logged, 6))
    assert "continuing its wandb run abc" in capsys.readouterr().err


def test_a_resume_replaces_metrics_jsonl_whole(tmp_path, monkeypatch):
    from rollshard.train import loggers

    out = tmp_path / "run"
    out.mkdir()
    lines = [json.dumps({"step": s, "loss/total": float(s)}) for s in (1, 2, 3)]
    (out / "metrics.jsonl").write_text("".join(ln + "\n" for ln in lines))
    replaced = []
    real_replace = os.replace
    monkeypatch.setattr(loggers.os, "replace", lambda a, b: (replaced.append((Path(a).name, Path(b).name)),
                                                             real_replace(a, b)))
    log = MetricsLogger(out, tensorboard=False, resume_step=2)
    log.close(exit_code=0)
    # Never truncated in place: a temporary file beside it, renamed over it (Storage.write_atomic).
    assert any(a.startswith(".metrics.jsonl.") and a.endswith(".tmp") and b == "metrics.jsonl" for a, b in replaced)
    assert [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_init_failure_removes_what_wandb_wrote(fake_wandb, tmp_path):
    out = tmp_path / "run"

    def failing_init(**kw):
        (Path(kw["dir"]) / "wandb" / "run-x").mkdir(parents=True)  # what an init may leave before failing
        raise RuntimeError("No API key configured. Use `wandb login` to log in.")

    fake_wandb.init = failing_init
    with pytest.raises(ValueError, match=r"wandb could not start the run \(No API key configured.*WANDB_MODE=offline"):
        MetricsLogger(out, tensorboard=False, wandb=WandbConfig())
    assert not out.exists()


def test_only_rank_0_logs_and_every_rank_raises_its_failure(fake_wandb, tmp_path):
    from rollshard.train.backends.distributed import DistEnv
    from rollshard.train.trainer import Trainer

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Rank(DistEnv):
        world_size: int = 2
        gathered: str | None = None  # what rank 0 sends (None: its loggers started)

        def all_gather_json(self, obj):
            return [obj if self.rank == 0 else self.gathered, obj]

    cfg = TrainConfig.from_dict({"trainer": {"logger": "jsonl,wandb"}}).validate(require_paths=False)
    rank1 = types.SimpleNamespace(cfg=cfg, out=tmp_path / "run", env=Rank(rank=1))
    assert not Trainer.open_logger(rank1, resume_step=None).enabled
    assert fake_wandb.runs == [] and not (tmp_path / "run").exists()
    rank1.env = Rank(rank=1, gathered="--logger wandb: wandb could not start the run (no key); ...")
    with pytest.raises(ValueError, match="could not start the run"):
        Trainer.open_logger(rank1, resume_step=None)
    rank0 = types.SimpleNamespace(cfg=cfg, out=tmp_path / "run", env=Rank(rank=0))
    logger = Trainer.open_logger(rank0, resume_step=None)
    logger.close()
    (run,) = fake_wandb.runs
    assert run.kw["config"] == cfg.to_dict() and run.exit_code == 0


# -- --logger and --tensorboard -------------------------------------------------------------------------------------


def resolve_flags(*argv: str) -> TrainConfig:
    import argparse

    from rollshard.train.config import add_config_flags, resolve

    p = argparse.ArgumentParser()
    p.add_argument("--config")
    add_config_flags(p)
    return resolve(p.parse_args(["--data", "d", "--model", "m", "--out", "o", *argv]))


@pytest.mark.parametrize("argv,loggers", [
    ((), ("jsonl", "tensorboard")),
    (("--tensorboard",), ("jsonl", "tensorboard")),
    (("--no-tensorboard",), ("jsonl",)),
    (("--logger", "wandb"), ("jsonl", "wandb")),  # jsonl is always written
    (("--logger", "wandb,tensorboard,jsonl,wandb"), ("jsonl", "tensorboard", "wandb")),
    (("--logger", "jsonl", "--no-tensorboard"), ("jsonl",)),
    (("--logger", "tensorboard,wandb", "--tensorboard"), ("jsonl", "tensorboard", "wandb")),
])  # fmt: skip
def test_logger_flag_resolves_to_the_loggers_that_run(argv, loggers):
    tr = resolve_flags(*argv).trainer
    assert tr.logger == loggers and tr.tensorboard == ("tensorboard" in loggers)
    again = TrainConfig.from_dict(resolve_flags(*argv).to_dict()).validate()  # the saved config resolves the same
    assert again.trainer == tr


@pytest.mark.parametrize("argv,message", [
    (("--logger", "jsonl,tensorboard", "--no-tensorboard"),
     "--no-tensorboard contradicts --logger jsonl,tensorboard; say it once"),
    (("--logger", "wandb", "--tensorboard"), "--tensorboard contradicts --logger wandb"),
    (("--logger", "jsonl,mlflow"), "--logger jsonl,mlflow: unknown logger 'mlflow'; choose from jsonl, tensorboard, wandb"),
    (("--wandb-resume", "never"), "wandb.resume"),
])  # fmt: skip
def test_contradicting_or_unknown_loggers_are_refused(argv, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_flags(*argv)


def test_wandb_flags_fill_the_wandb_section():
    w = resolve_flags("--wandb-project", "p", "--wandb-name", "n", "--wandb-entity", "team", "--wandb-dir", "/x",
                      "--wandb-tags", "a,b", "--wandb-resume", "rewind").wandb
    assert (w.project, w.name, w.entity, w.dir, w.tags, w.resume) == ("p", "n", "team", "/x", ("a", "b"), "rewind")
    assert resolve_flags().wandb == WandbConfig(project=None, name=None, entity=None, dir=None, tags=None,
                                                resume="allow")
