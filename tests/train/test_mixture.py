"""rollshard-train on a weighted mixture of datasets (--data a:0.7,b:0.3): per-source metrics, resume through the
trainer's checkpoints, refused changes, and the settings that read every source."""

from __future__ import annotations

import json

import pytest

from rollshard.store.loader.mixture import allocate
from rollshard.train.checkpoint import STATE_FILE, latest_checkpoint
from rollshard.train.cli import main
from rollshard.train.config import TrainConfig
from rollshard.train.metrics import read_metrics
from rollshard.train.setup import check_out_dir
from rollshard.train.trainer import Trainer
from tests.train.conftest import generation_config, write_dataset, write_rows
from tests.train.test_cli import args_for, one_error_line
from tests.train.test_trainer import make_config


@pytest.fixture(scope="module")
def second(tiny_gpt2, tmp_path_factory):
    """4 groups sampled from the tiny model, as a second source next to ``tiny_dataset`` (8 groups)."""
    return write_dataset(tiny_gpt2, tmp_path_factory.mktemp("data") / "b", groups=4, seed=100)


def test_cli_mixes_two_datasets_logs_each_source_and_resumes_exactly(tiny_dataset, second, tiny_gpt2, tmp_path, capsys):
    a, b = "tiny-rollouts", "b"  # the folders' names
    data = f"{tiny_dataset}:0.7,{second}:0.3"
    out = tmp_path / "run"
    assert main(args_for(data, tiny_gpt2, out, "--max-steps", 3)) == 0
    records = read_metrics(out)
    # slots a b | a a | a b | a a (allocate's worked example, two groups a step)
    assert allocate([0.7, 0.3], 8) == [0, 1, 0, 0, 0, 1, 0, 0]
    expected = [(1, 1), (2, 0), (1, 1)]
    assert [(r[f"source/{a}/groups"], r[f"source/{b}/groups"]) for r in records] == expected
    for r in records:
        assert r[f"source/{a}/sequences"] + r[f"source/{b}/sequences"] == r["data/sequences"]
        assert r[f"source/{a}/loss_tokens"] + r[f"source/{b}/loss_tokens"] == r["data/loss_tokens"]
        assert r[f"source/{a}/tokens"] + r[f"source/{b}/tokens"] == r["data/tokens"]
        n_a, n_b = r[f"source/{a}/sequences"], r[f"source/{b}/sequences"]
        by_source = n_a * r[f"source/{a}/reward/mean"] + (n_b * r[f"source/{b}/reward/mean"] if n_b else 0.0)
        assert by_source / (n_a + n_b) == pytest.approx(r["reward/mean"], abs=1e-6)
    assert f"source/{b}/reward/mean" not in records[1]  # no row of b in that step
    state = json.loads((latest_checkpoint(out).path / STATE_FILE).read_text())["loader_states"][0]
    assert state["format"] == "rollshard-loader-mixture" and [s["taken"] for s in state["sources"]] == [4, 2]

    # changed weights: refused before anything trains, one line naming the change
    capsys.readouterr()
    changed = f"{tiny_dataset}:0.6,{second}:0.4"
    assert main(args_for(changed, tiny_gpt2, out, "--max-steps", 4, "--resume")) == 2
    _, error = capsys.readouterr().err.strip().splitlines()  # "resuming at step 3 ...", then the error
    assert error.startswith("rollshard-train: error: loader state has weights") and "the weights changed" in error
    # the same mixture resumes where it stopped: the 4th step takes slots 6 and 7 (a, a)
    assert main(args_for(data, tiny_gpt2, out, "--max-steps", 4, "--resume")) == 0
    resumed = read_metrics(out)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert (resumed[3][f"source/{a}/groups"], resumed[3][f"source/{b}/groups"]) == (2, 0)


@pytest.mark.parametrize("spec,message", [("a:0", "weight 0 must be a positive"), ("a:0.7,b", "b has no weight")])
def test_bad_data_weight_is_exit_2_and_one_line(spec, message, capsys):
    assert main(["--data", spec, "--model", "m", "--out", "o"]) == 2
    err = one_error_line(capsys)
    assert err.startswith("rollshard-train: error: --data") and message in err


def test_norm_len_and_out_dir_read_every_source(tiny_dataset, tiny_gpt2, tmp_path):
    longer = write_rows(tmp_path / "longer", [[0.0, 1.0], [1.0, 0.0]], config=generation_config(tiny_gpt2, 20))
    config = make_config(f"{tiny_dataset}:0.5,{longer}:0.5", tiny_gpt2, tmp_path / "run",
                         loss={"agg": "seq-mean-token-sum-norm"})
    trainer = Trainer(config)
    try:
        assert trainer.norm_len == 20  # max(10, 20) new tokens: the longest row any source allows
    finally:
        trainer.close()
    with pytest.raises(ValueError, match=r"--out .* is the dataset or inside it \(.*longer\)"):
        check_out_dir(str(longer / "run"), data=f"{tiny_dataset}:0.5,{longer}:0.5")
    check_out_dir(str(tmp_path / "elsewhere"), data=f"{tiny_dataset}:0.5,{longer}:0.5")


def test_source_figures_are_summed_over_ranks_and_the_epoch_averaged():
    from types import SimpleNamespace

    from rollshard.store.loader import Step
    from rollshard.train.metrics import MetricAccumulator

    states = []
    for groups in (3.0, 2.0):  # two ranks' shares of one global step
        step = Step(micro_batches=[], group_ids=[f"g{i}" for i in range(int(groups))], epoch=0, index=0,
                    group_sources=["a"] * int(groups), metrics={"source/a/groups": groups,
                    "source/a/loss_tokens": 10 * groups, "source/a/epoch": 1.0, "groups": groups})  # fmt: skip
        acc = MetricAccumulator()
        Trainer.data_metrics(SimpleNamespace(), step, [], acc)
        states.append(acc.state())
    merged = MetricAccumulator.merged(states).result()
    assert (merged["source/a/groups"], merged["source/a/loss_tokens"]) == (5.0, 50.0)
    assert merged["source/a/epoch"] == 1.0 and merged["loader/groups"] == 5.0


def test_yaml_takes_the_string_or_a_list():
    listed = {"data": {"path": [{"path": "s3://b/x", "weight": 0.7}, {"path": "y", "weight": 0.3, "name": "code"}]}}
    assert TrainConfig.from_dict(listed).data.path == "s3://b/x:0.7,code=y:0.3"
    assert TrainConfig.from_dict({"data": {"path": "s3://b/x:0.7,y:0.3"}}).data.path == "s3://b/x:0.7,y:0.3"
