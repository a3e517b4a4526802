"""rollshard-generate into a dataset on S3 (a real S3-protocol server on 127.0.0.1): killed and rerun, and
four writers at once; every row equals the uninterrupted local run's."""

import signal

import pytest

from rollshard.store.io.dataset import RolloutDataset
from tests import forked
from tests.gated_main import Gate, fork_gated, wait_for_gate
from tests.generate.test_run import N_PROMPTS, assert_valid, base_args, reference, rows_of  # noqa: F401
from tests.store.test_s3 import _keys, _uploads

pytestmark = pytest.mark.s3

KILL_POINTS = {
    # the run stops right after its first shard is committed (manifest saved)
    "after-commit": Gate("rollshard.store.io.writer:ShardWriter.commit", 1, ""),
    # ... or with its second shard complete on S3 and not yet in its manifest (save 1 is at open)
    "before-manifest": Gate("rollshard.store.io.writer:ShardWriter.save_manifest", 3, "", before=True),
}


@pytest.mark.parametrize("point", KILL_POINTS)
def test_kill_9_and_rerun_on_s3_equals_one_run(point, reference, tiny_gpt2, s3_dataset, tmp_path):  # noqa: F811
    args = base_args(tiny_gpt2, s3_dataset, "--commit-every", "1")
    gate = KILL_POINTS[point]
    gate = Gate(gate.target, gate.count, str(tmp_path / "gate"), before=gate.before)
    proc = fork_gated([gate], "rollshard.generate", *args)
    wait_for_gate(proc, gate)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, proc.communicate()[1]
    partial = {r["prompt_id"] for r in rows_of(s3_dataset)}
    assert len(partial) == 1  # one episode committed
    if point == "before-manifest":
        assert len([k for k in _keys(s3_dataset) if k.startswith("shards/")]) == 2  # one of them not listed
    rerun = forked.run("rollshard.generate", *args)
    assert rerun.returncode == 0, rerun.stderr
    redone = N_PROMPTS - 1 - (point == "before-manifest")  # the listed-late shard is adopted, not redone
    assert f"{redone} of {N_PROMPTS} prompts done" in rerun.stderr
    assert rows_of(s3_dataset) == rows_of(reference)  # nothing lost, nothing twice
    assert_valid(s3_dataset)
    assert _uploads(s3_dataset) == [] and not any(k.endswith(".lease") for k in _keys(s3_dataset))


def test_four_writers_at_once_into_one_s3_dataset(reference, tiny_gpt2, s3_dataset):  # noqa: F811
    procs = [forked.start("rollshard.generate", *base_args(tiny_gpt2, s3_dataset, "--shard-index", i, "--num-shards", 4))
             for i in range(4)]
    for p in procs:
        assert p.wait(timeout=600) == 0, p.communicate()[1]
    ds = RolloutDataset.open(s3_dataset)
    assert [m.writer_id for m in ds.manifests] == [f"gen-{i}-of-4" for i in range(4)]
    assert rows_of(s3_dataset) == rows_of(reference)  # the union, exactly
    assert_valid(s3_dataset)


def test_training_from_s3_equals_training_from_the_local_copy(reference, tiny_gpt2, s3_dataset, tmp_path):  # noqa: F811
    import json

    from rollshard.store.io.writer import ShardWriter
    from rollshard.train.cli import main as train

    with ShardWriter(s3_dataset, writer_id="copy") as w:  # the reference's groups, uploaded
        w.write_groups(RolloutDataset.open(reference).read())
    losses: dict[str, list[dict]] = {}
    for name, data in (("s3", s3_dataset), ("local", reference)):
        out = tmp_path / name
        assert train(["--data", str(data), "--model", str(tiny_gpt2), "--out", str(out), "--groups-per-step", "2",
                      "--max-steps", "3", "--lr", "1e-3", "--no-progress", "--no-tensorboard"]) == 0
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [{k: v for k, v in r.items() if k != "time" and not k.startswith("perf/")} for r in records]
    # the same groups in the same steps: token counts, logprob mismatches, losses, gradient norms
    assert len(losses["s3"]) == 3 and losses["s3"] == losses["local"]
