"""rollshard-train on the command line: config file + flags, errors, kill -9 then --resume, Ctrl-C/SIGTERM,
non-finite steps, and what the command says."""

from __future__ import annotations

import os
import signal

import pytest
import yaml
from safetensors.torch import load_file

from rollshard.train.checkpoint import CONFIG_FILE, latest_checkpoint
from rollshard.train.cli import main
from rollshard.train.metrics import read_metrics
from tests.gated_main import Gate, fork_gated, wait_for_gate
from tests.train.conftest import SINGLE_THREAD_ENV


def args_for(data, model, out, *extra):
    return [
        "--data", str(data), "--model", str(model), "--out", str(out), "--groups-per-step", "2",
        "--micro-batch-tokens", "128", "--lr", "1e-3", "--no-progress", "--no-tensorboard", *map(str, extra),
    ]


def test_config_file_and_flags(tiny_dataset, tiny_gpt2, tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"loss": {"eps_high": 0.3, "agg": "seq-mean-token-mean"}, "optim": {"lr": 0.5}}))
    out = tmp_path / "run"
    assert main(["--config", str(cfg), *args_for(tiny_dataset, tiny_gpt2, out, "--max-steps", "1")]) == 0
    saved = yaml.safe_load((latest_checkpoint(out).path / CONFIG_FILE).read_text())
    assert saved["loss"]["eps_high"] == 0.3 and saved["loss"]["agg"] == "seq-mean-token-mean"  # from the file
    assert saved["optim"]["lr"] == 1e-3  # the flag overrides the file
    assert saved["loss"]["mode"] == "bypass" and saved["loss"]["eps_low"] == 0.2  # defaults
    assert "1 steps" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model", "m", "--out", "o"], "--data"),
        (["--data", "d", "--model", "m", "--out", "o", "--eps-low", "1.5"], "--eps-low"),
        (["--data", "d", "--model", "m", "--out", "o", "--dual-clip-c", "0.5"], "--dual-clip-c"),
    ],
)
def test_usage_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rollshard-train: error:") and message in err and "\n" not in err


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--mode", "foo", "--mode: 'foo' is not one of bypass, decoupled"),
        ("--lr", "abc", "--lr: could not convert string to float: 'abc'"),
        ("--ratio-level", "row", "--ratio-level: 'row' is not one of token, sequence"),
    ],
)
def test_a_value_of_the_wrong_kind_is_named_by_the_flag_it_was_given_with(flag, value, message, tmp_path, capsys):
    assert main(["--data", "d", "--model", "m", "--out", "o", flag, value]) == 2
    assert capsys.readouterr().err == f"rollshard-train: error: {message}\n"
    (tmp_path / "train.yaml").write_text("loss:\n  mode: foo\n")  # a config file's value: named by its key there
    assert main(["--config", str(tmp_path / "train.yaml"), "--data", "d", "--model", "m", "--out", "o"]) == 2
    message = f"{tmp_path / 'train.yaml'}: loss.mode: 'foo' is not one of bypass, decoupled"
    assert capsys.readouterr().err == f"rollshard-train: error: {message}\n"


def test_missing_dataset_is_a_clear_error(tiny_gpt2, tmp_path, capsys):
    assert main(args_for(tmp_path / "nowhere", tiny_gpt2, tmp_path / "run")) == 2
    assert "no rollshard dataset" in capsys.readouterr().err


def test_killed_run_resumes_to_the_same_losses(tiny_dataset, tiny_gpt2, tmp_path):
    steps = 10
    common = ["--max-steps", steps, "--num-epochs", 3, "--save-every", 1, "--keep-last", 2]
    # Uninterrupted reference, in process.
    assert main(args_for(tiny_dataset, tiny_gpt2, tmp_path / "ref", *common)) == 0
    reference = read_metrics(tmp_path / "ref")
    assert [r["step"] for r in reference] == list(range(1, steps + 1))

    # The same run as a real process, gated after its second checkpoint is saved, then killed with SIGKILL.
    out = tmp_path / "killed"
    gate = Gate("rollshard.train.trainer:save_checkpoint", 2, str(tmp_path / "at-step-2"))
    proc = fork_gated([gate], "rollshard.train", *args_for(tiny_dataset, tiny_gpt2, out, *common))
    try:
        wait_for_gate(proc, gate)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL and latest_checkpoint(out).step == 2

    assert main(args_for(tiny_dataset, tiny_gpt2, out, *common, "--resume")) == 0
    resumed = read_metrics(out)
    assert [r["step"] for r in resumed] == list(range(1, steps + 1))
    for a, b in zip(reference, resumed):
        assert b["loss/total"] == pytest.approx(a["loss/total"], rel=1e-5, abs=1e-7), a["step"]
        assert b["reward/mean"] == pytest.approx(a["reward/mean"], abs=1e-7), a["step"]
    w_ref = load_file(str(latest_checkpoint(tmp_path / "ref").path / "model.safetensors"))
    w_res = load_file(str(latest_checkpoint(out).path / "model.safetensors"))
    assert max((w_res[k] - w_ref[k]).abs().max().item() for k in w_ref) < 1e-6


def after_step_0(err: str) -> str:
    """stderr without the step-0 mismatch line a fresh run prints after its first step (tests/train/test_no_silent.py)."""
    return "\n".join(line for line in err.splitlines() if not line.startswith("rollshard-train: step-0 mismatch"))


def one_error_line(capsys) -> str:
    err = after_step_0(capsys.readouterr().err).strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("poison", ["loss", "gradient"])
def test_non_finite_step_stops_before_it_is_saved(poison, tiny_dataset, tiny_gpt2, tmp_path, monkeypatch, capsys):
    import torch

    import rollshard.train.trainer as trainer_mod

    steps = {"n": 0}
    real_step, real_loss = trainer_mod.Trainer.train_step, trainer_mod.policy_loss

    def count_steps(self, step):
        steps["n"] += 1
        return real_step(self, step)

    def poisoned(logp, **kw):
        loss, m = real_loss(logp, **kw)
        if steps["n"] == 2 and poison == "loss":
            loss = loss * float("nan")
            m["loss/total"] = loss.detach()
        elif steps["n"] == 2:  # finite value, NaN gradient: d sqrt(x) / dx at 0 is inf, times 0
            loss = loss + 0.0 * torch.sqrt(logp.sum() * 0.0)
        return loss, m

    monkeypatch.setattr(trainer_mod.Trainer, "train_step", count_steps)
    monkeypatch.setattr(trainer_mod, "policy_loss", poisoned)
    out = tmp_path / "run"
    assert main(args_for(tiny_dataset, tiny_gpt2, out, "--max-steps", 3, "--save-every", 1)) == 1
    err = one_error_line(capsys)
    assert err.startswith("rollshard-train: error: step 2: non-finite " + poison), err
    assert "step_00000001 (step 1)" in err and "--resume" in err
    assert latest_checkpoint(out).step == 1  # step 2's weights were never saved
    assert [r["step"] for r in read_metrics(out)] == [1]  # nor its metrics
    assert capsys.readouterr().out == ""  # no summary


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_saves_the_last_finished_step_and_resumes(sig, tiny_dataset, tiny_gpt2, tmp_path):
    common = ["--max-steps", 4, "--num-epochs", 2]
    out = tmp_path / "stopped"
    # Gated after step 2's optimizer updates (train_step returned), the signal arrives, then the gate opens.
    gate = Gate("rollshard.train.trainer:Trainer.train_step", 2, str(tmp_path / "at-2"), str(tmp_path / "go"))
    proc = fork_gated([gate], "rollshard.train", *args_for(tiny_dataset, tiny_gpt2, out, *common),
                      env={**os.environ, **SINGLE_THREAD_ENV})
    try:
        wait_for_gate(proc, gate)
        os.kill(proc.pid, sig)
        (tmp_path / "go").write_text("")
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    name = signal.Signals(sig).name
    assert after_step_0(stderr).strip() == (
        f"rollshard-train: interrupted ({name}); saved step 2 to {out}/checkpoints/step_00000002; "
        "rerun with --resume to continue"
    )
    assert stdout == "" and latest_checkpoint(out).step == 2
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    if sig == signal.SIGTERM:
        return  # the resume is the same for both

    assert main(args_for(tiny_dataset, tiny_gpt2, tmp_path / "ref", *common)) == 0
    assert main(args_for(tiny_dataset, tiny_gpt2, out, *common, "--resume")) == 0
    reference, resumed = read_metrics(tmp_path / "ref"), read_metrics(out)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(reference, resumed):
        assert b["loss/total"] == pytest.approx(a["loss/total"], rel=1e-5, abs=1e-7), a["step"]


def test_a_run_without_a_step_is_an_error_in_flags(tiny_dataset, tiny_gpt2, tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*args_for(tiny_dataset, tiny_gpt2, out), "--groups-per-step", "16"]) == 2
    err = one_error_line(capsys)
    assert err == (
        "rollshard-train: error: no step to train: 8 of 8 groups pass the filters and a step takes 16 "
        "(--groups-per-step 16); lower --groups-per-step, pass --tail partial, or loosen the filters "
        "(--statuses, --agents, --max-staleness, --drop-zero-variance)"
    )
    assert latest_checkpoint(out) is None and capsys.readouterr().out == ""
    # The same with no end of epochs: the loader's own error, said in flags.
    assert main([*args_for(tiny_dataset, tiny_gpt2, tmp_path / "forever"), "--groups-per-step", "16",
                 "--num-epochs", "none", "--max-steps", "3"]) == 2
    assert "pass --tail partial" in one_error_line(capsys)


def test_model_path_that_does_not_exist_fails_before_any_hub_call(tiny_dataset, tmp_path, monkeypatch, capsys):
    import rollshard.train.trainer as trainer_mod

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # a hub lookup would be tried, and retried
    touched = []
    monkeypatch.setattr(trainer_mod, "build_backend", lambda *a, **k: touched.append("backend"))
    monkeypatch.setattr(trainer_mod, "build_loader", lambda *a, **k: touched.append("loader"))
    for model, says in [
        (tmp_path / "no-such-model", "no such folder; check the path"),
        ("./missing", "no such folder; check the path"),
        ("~/missing-model", "no such folder; check the path"),
        ("gpt2-nonexistent", "download it first"),
    ]:
        assert main(args_for(tiny_dataset, model, tmp_path / "run")) == 2
        err = one_error_line(capsys)
        assert err.startswith(f"rollshard-train: error: --model {model}") and says in err, err
    assert touched == []


def test_out_that_would_overwrite_data_or_a_model_is_refused(tiny_dataset, tiny_gpt2, tmp_path, capsys):
    for out, says in [
        (tiny_dataset, "is the dataset or inside it"),
        (tiny_dataset / "shards", "is the dataset or inside it"),
        (tiny_gpt2, "is a model folder (it has config.json)"),
    ]:
        assert main(args_for(tiny_dataset, tiny_gpt2, out)) == 2
        err = one_error_line(capsys)
        assert err.startswith(f"rollshard-train: error: --out {out} ") and says in err, err
    assert not (tiny_dataset / "metrics.jsonl").exists() and not (tiny_gpt2 / "metrics.jsonl").exists()


def test_resume_says_where_it_starts_and_tolerates_a_torn_metrics_line(tiny_dataset, tiny_gpt2, tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*args_for(tiny_dataset, tiny_gpt2, out, "--max-steps", 1), "--resume"]) == 0
    captured = capsys.readouterr()
    assert f"rollshard-train: --resume: no checkpoint in {out}; starting fresh from --model" in captured.err
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "loss/tot')  # killed mid-write
    assert main([*args_for(tiny_dataset, tiny_gpt2, out, "--max-steps", 2), "--resume"]) == 0
    err = capsys.readouterr().err
    ckpt = out / "checkpoints" / "step_00000001"
    assert f"rollshard-train: resuming at step 1 from {ckpt} (weight version 1)" in err
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


def test_summary_says_time_throughput_and_where_things_are(tiny_dataset, tiny_gpt2, tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*args_for(tiny_dataset, tiny_gpt2, out, "--max-steps", 2), "--tensorboard"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("rollshard-train: 2 steps (2 in this run, ") and " tokens/s); " in line
    assert f"checkpoint {out}/checkpoints/step_00000002 (weight version 2, linked as {out}/checkpoints/latest)" in line
    assert f"metrics {out}/metrics.jsonl, TensorBoard {out}/tb;" in line and "\n" not in line


def test_data_errors_from_the_loader_are_one_line(tiny_dataset, tiny_gpt2, tmp_path, monkeypatch, capsys):
    import rollshard.train.trainer as trainer_mod

    class DataError(ValueError):  # what the store raises for a corrupt shard
        pass

    real = trainer_mod.build_loader

    from rollshard.store.loader import WrappedLoader

    class Failing(WrappedLoader):
        def __iter__(self):
            for i, step in enumerate(self.inner):
                if i == 1:
                    raise DataError("shards/w-00001.parquet: corrupt row group 3\n  (Parquet: invalid page header)")
                yield step

    monkeypatch.setattr(trainer_mod, "build_loader", lambda *a, **k: Failing(real(*a, **k)))
    assert main(args_for(tiny_dataset, tiny_gpt2, tmp_path / "run", "--max-steps", 3)) == 2
    assert one_error_line(capsys) == (
        "rollshard-train: error: shards/w-00001.parquet: corrupt row group 3; (Parquet: invalid page header)"
    )


def test_a_resumed_run_stopped_before_a_new_step_does_not_claim_a_save(tiny_dataset, tiny_gpt2, tmp_path, capsys,
                                                                      monkeypatch):
    out = tmp_path / "run"
    assert main(args_for(tiny_dataset, tiny_gpt2, out, "--max-steps", "1")) == 0
    capsys.readouterr()
    from rollshard.train import trainer as trainer_mod

    def stopped_at_once(self):  # the signal lands before the first new step finishes
        self.stopped_by = "SIGINT"
        return []

    monkeypatch.setattr(trainer_mod.Trainer, "run", stopped_at_once)
    assert main(args_for(tiny_dataset, tiny_gpt2, out, "--max-steps", "3", "--resume")) == 130
    err = capsys.readouterr().err
    assert "interrupted (SIGINT); no new step finished; the latest checkpoint is" in err and "(step 1)" in err
    assert "saved step" not in err
