"""Checkpoints: sharded state (safetensors, no pickle) that resumes exactly, the engines' model folder written
tensor by tensor, format-1 checkpoints resuming, latest link, pruning, a crash while saving, every rank's shards
checked before publishing."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rollshard.train.backends.distributed import DistEnv
from rollshard.train.backends.hf import HFBackend
from rollshard.train.checkpoint import CKPT_DIR, latest_checkpoint, save_checkpoint
from rollshard.train.config import ModelConfig, OptimConfig
from rollshard.train.checkpoint import SHARDS_DIR
from rollshard.train.sharded import load_sharded, read_sharded, save_sharded
from rollshard.train.trainer import Trainer, dummy_batch
from tests.train import v1_checkpoint
from tests.train.test_trainer import make_config, train


def backend(model, weights_from=None) -> HFBackend:
    return HFBackend(ModelConfig(path=str(model)), OptimConfig(lr=1e-2), env=DistEnv(), total_updates=None,
                     weights_from=weights_from)


def one_update(b: HFBackend) -> None:
    batch = dummy_batch()
    batch.input_ids[:] = torch.tensor([5, 9])
    logp, _ = b.logprobs(batch, grad=True)
    b.backward(-logp.sum())
    b.optimizer_step()


def save(b, out, step, keep_last=2):
    return save_checkpoint(out, step=step, backend=b, loader_states=[{"cursor": step}], weight_version=str(step),
                           env=DistEnv(), config_yaml="trainer: {}\n", keep_last=keep_last)


def assert_same_state(a: HFBackend, b: HFBackend) -> None:
    for (na, pa), (nb, pb) in zip(a.policy.named_parameters(), b.policy.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"] and len(sa["state"]) == len(sb["state"]) > 10
    for k in sa["state"]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa["state"][k][name], sb["state"][k][name]), (k, name)
    assert a.updates == b.updates


def saved_after_two_updates(model, out: Path, version: int):
    """A backend after two updates, and its checkpoint of step 2 (of format ``version``)."""
    a = backend(model)
    one_update(a)
    one_update(a)
    path = save(a, out, 2)
    ckpt = latest_checkpoint(out)
    assert ckpt.path == path and ckpt.version == version and ckpt.updates == 2 and ckpt.loader_states == [{"cursor": 2}]
    return a, path, ckpt


def test_resume_continues_exactly_from_the_model_folder_and_the_shards(tiny_gpt2, tmp_path):
    a, path, ckpt = saved_after_two_updates(tiny_gpt2, tmp_path, 3)
    # The weights are written once, in the model folder; the shards hold the AdamW state only.
    params = dict(a.hf_model.named_parameters())  # lm_head.weight is wte.weight: one parameter
    tensors, _ = read_sharded(path / SHARDS_DIR)
    assert tensors.keys() == {f"optim/{n}/{k}" for n in params for k in ("exp_avg", "exp_avg_sq", "step")}
    moments = 2 * sum(p.numel() * 4 for p in params.values())  # exp_avg + exp_avg_sq, fp32
    shard_bytes = sum(f.stat().st_size for f in (path / SHARDS_DIR).glob("*.safetensors"))
    assert moments < shard_bytes < moments + 4 * len(params) + 16384  # the step counts and the header beside them
    weights = load_file(str(path / "model.safetensors"))
    assert all(torch.equal(weights[n], p.detach()) for n, p in params.items())

    # Built from the checkpoint's model folder, as a resume does; every moment comes from the shards.
    assert ckpt.weights_from == path
    b = backend(tiny_gpt2, weights_from=ckpt.weights_from)
    ckpt.restore(b)
    assert_same_state(a, b)
    assert b.optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    one_update(a)
    one_update(b)
    assert_same_state(a, b)


def test_format_2_resumes_exactly_from_the_shards(tiny_gpt2, tmp_path, monkeypatch):
    # A backend whose export is not its weights as held writes them into the shards too (format 2), as every
    # checkpoint before format 3 did.
    monkeypatch.setattr(HFBackend, "exports_held_weights", False)
    a, _, ckpt = saved_after_two_updates(tiny_gpt2, tmp_path, 2)
    monkeypatch.undo()  # a resume by today's backend reads format 2 as it is

    # Built from --model (the initial weights), as a resume does; every weight and moment comes from the shards.
    assert ckpt.weights_from is None
    b = backend(tiny_gpt2, weights_from=ckpt.weights_from)
    assert not torch.equal(a.hf_model.transformer.h[0].attn.c_attn.weight, b.hf_model.transformer.h[0].attn.c_attn.weight)
    ckpt.restore(b)
    assert_same_state(a, b)
    assert b.optimizer.param_groups[0]["betas"] == (0.9, 0.999)  # a tuple again, as AdamW made it
    one_update(a)
    one_update(b)
    assert_same_state(a, b)


def test_a_model_whose_class_converts_weights_keeps_them_in_the_shards(tiny_moe, tmp_path):
    # Qwen3-MoE's transformers class fuses its experts on load: its export is save_pretrained's (unfused), not the
    # weights as held, so its checkpoints are format 2 and resume from the shards, bitwise.
    a, _, ckpt = saved_after_two_updates(tiny_moe, tmp_path, 2)
    assert not a.exports_held_weights and ckpt.weights_from is None
    b = backend(tiny_moe, weights_from=ckpt.weights_from)
    ckpt.restore(b)
    assert_same_state(a, b)


def test_format_1_checkpoint_resumes_and_the_next_save_is_format_3(tiny_gpt2, tmp_path):
    a = backend(tiny_gpt2)
    one_update(a)
    v1_checkpoint.save_v1(tmp_path, step=1, backend=a, loader_states=[{"cursor": 1}], weight_version="1")
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.version == 1 and ckpt.weights_from == ckpt.path and not (ckpt.path / SHARDS_DIR).exists()
    b = backend(tiny_gpt2, weights_from=ckpt.weights_from)
    ckpt.restore(b)
    assert_same_state(a, b)
    one_update(a)
    one_update(b)
    assert_same_state(a, b)
    save(b, tmp_path, 2)
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.version == 3 and (ckpt.path / SHARDS_DIR).is_dir()
    c = backend(tiny_gpt2, weights_from=ckpt.weights_from)
    ckpt.restore(c)
    assert_same_state(b, c)


def test_shards_are_safetensors_and_json_without_pickle(tiny_gpt2, tmp_path, monkeypatch):
    monkeypatch.setattr(HFBackend, "exports_held_weights", False)  # format 2: the weights in the shards too
    b = backend(tiny_gpt2)
    one_update(b)
    shards = save(b, tmp_path, 1) / SHARDS_DIR
    assert sorted(p.name for p in shards.iterdir()) == ["optimizer.json", "shard-00001-model-00001-of-00001.safetensors"]
    for f in shards.iterdir():
        assert not f.read_bytes().startswith(b"\x80")  # a pickle stream's first byte (protocol 2+)
    with safe_open(str(shards / "shard-00001-model-00001-of-00001.safetensors"), framework="pt") as st:
        assert "DCP_SHARDING_INFO" in st.metadata()  # DCP's chunk offsets: JSON in the safetensors header
    tensors, meta = read_sharded(shards)
    params = dict(b.hf_model.named_parameters())  # lm_head.weight is wte.weight: stored once
    assert {k for k in tensors if k.startswith("model/")} == {f"model/{n}" for n in params}
    for name, p in params.items():
        assert torch.equal(tensors[f"model/{name}"], p.detach())
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(tensors[f"optim/{name}/{key}"], b.optimizer.state[p][key]), (name, key)
    assert meta["param_groups"][0]["lr"] == b.optimizer.param_groups[0]["lr"] > 0
    assert meta["param_groups"][0]["params"][0] == "transformer.wte.weight"  # transformers names, no wrapper prefix


def safetensors_parts(path: Path) -> tuple[dict, dict[str, bytes]]:
    """(a safetensors file's header, its ``__metadata__`` JSON strings parsed, and each tensor's bytes by name)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    meta = {k: json.loads(v) if v.startswith("{") else v for k, v in header.pop("__metadata__").items()}
    data = {k: raw[8 + n + h["data_offsets"][0] : 8 + n + h["data_offsets"][1]] for k, h in header.items()}
    return {"metadata": meta, "tensors": {k: (h["dtype"], h["shape"]) for k, h in header.items()}}, data


@pytest.mark.parametrize("model", ["tiny_gpt2", "tiny_qwen3"])
def test_one_process_writes_the_files_dcp_writes_without_dcp(model, request, tmp_path, monkeypatch):
    # One process streams its state out itself (DCP serializes each file in memory first, several times slower):
    # the same file names, headers (DCP's chunk offsets in __metadata__) and tensor bytes as DCP's safetensors
    # storage writes, so DCP's reader loads them. Several files: the file size bound is DCP's too.
    import torch.distributed.checkpoint as dcp

    import rollshard.train.sharded as sharded

    monkeypatch.setattr(sharded, "FILE_BYTES_PER_RANK", 100_000)
    b = backend(request.getfixturevalue(model))
    one_update(b)
    tensors, _ = sharded.state_tensors(b.policy, b.optimizer, strip="model.")
    sharded.write_with_dcp(tmp_path / "dcp", tensors, sharded.file_buckets(tensors, world_size=1), env=DistEnv())

    def refuse(*a, **kw):
        raise AssertionError("one process saved through dcp.save")

    monkeypatch.setattr(dcp, "save", refuse)
    b.save_state(tmp_path / "own")
    names = sorted(p.name for p in (tmp_path / "dcp").glob("*.safetensors"))
    assert len(names) > 10 and names == sorted(p.name for p in (tmp_path / "own").glob("*.safetensors"))
    for name in names:
        assert safetensors_parts(tmp_path / "own" / name) == safetensors_parts(tmp_path / "dcp" / name), name
    c = backend(request.getfixturevalue(model))
    c.load_state(tmp_path / "own")
    c.updates = b.updates  # counted in the checkpoint's trainer state, not in the shards
    assert_same_state(b, c)


@pytest.mark.parametrize("model", ["tiny_gpt2", "tiny_qwen3"])
def test_model_folder_is_what_save_pretrained_writes(model, request, tmp_path, monkeypatch):
    # The export streams one tensor at a time; format 1 handed the whole state dict to save_pretrained.
    b = backend(request.getfixturevalue(model))
    one_update(b)
    b.export_model(tmp_path / "streamed")
    v1_checkpoint.write(tmp_path / "pretrained", b, *v1_checkpoint.gather(b))
    names = sorted(p.name for p in (tmp_path / "streamed").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "pretrained").iterdir() if p.name != "optimizer")
    assert "model.safetensors" in names and "config.json" in names and "tokenizer.json" in names
    for name in names:
        assert (tmp_path / "streamed" / name).read_bytes() == (tmp_path / "pretrained" / name).read_bytes(), name

    # A model whose class converts weights on load is exported by save_pretrained (which reverts them) instead:
    # loaded from a checkpoint's "norm_saved", the final norm is saved under that name again.
    from transformers.core_model_loading import WeightRenaming

    norm, saved = {"tiny_gpt2": ("transformer.ln_f.", "transformer.ln_f_saved."),
                   "tiny_qwen3": ("model.norm.", "model.norm_saved.")}[model]
    monkeypatch.setattr(b.hf_model, "_weight_conversions", [WeightRenaming(saved, norm)], raising=False)
    b.export_model(tmp_path / "converted")
    streamed = load_file(str(tmp_path / "streamed" / "model.safetensors"))
    converted = load_file(str(tmp_path / "converted" / "model.safetensors"))
    assert norm + "weight" in streamed and saved + "weight" in converted and norm + "weight" not in converted
    assert set(converted) == {k.replace(norm, saved) for k in streamed}
    assert all(torch.equal(v, converted[k.replace(norm, saved)]) for k, v in streamed.items())


def test_a_crash_while_saving_leaves_the_previous_checkpoint_latest(tiny_gpt2, tmp_path, monkeypatch):
    b = backend(tiny_gpt2)
    one_update(b)
    save(b, tmp_path, 1)
    one_update(b)

    def disk_full(folder):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(b, "export_model", disk_full)  # after the shards of step 2 are written
    with pytest.raises(OSError, match="No space"):
        save(b, tmp_path, 2)
    root = tmp_path / "checkpoints"
    assert (root / ".tmp-step_00000002" / SHARDS_DIR / "optimizer.json").exists()
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.step == 1 and ckpt.updates == 1
    ckpt.restore(backend(tiny_gpt2))  # still complete
    monkeypatch.undo()
    save(b, tmp_path, 2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001", "step_00000002"]
    assert latest_checkpoint(tmp_path).updates == 2


def test_shards_of_another_model_are_refused(tiny_gpt2, tiny_qwen3, tmp_path):
    path = save(backend(tiny_gpt2), tmp_path, 1)
    with pytest.raises(ValueError, match="other parameters than this model; resume with the run's --model"):
        backend(tiny_qwen3).load_state(path / SHARDS_DIR)


def test_shards_of_other_sizes_are_refused_in_one_line(tmp_path):
    # The same parameter names, other shapes: DCP's planner raises a ValueError, which DCP wraps (with every rank's
    # traceback) in a CheckpointException, a BaseException, in one process too.
    def linear(rows):
        m = torch.nn.Linear(4, rows)
        return m, torch.optim.AdamW(m.parameters())

    save_sharded(tmp_path, *linear(2), env=DistEnv())
    with pytest.raises(ValueError, match=r"does not match this model and optimizer \(rank 0: Size mismatch .* for "
                                         r"model/\w+\); resume with the run's --model") as e:
        load_sharded(tmp_path, *linear(3), env=DistEnv())
    assert "\n" not in str(e.value)  # what the CLI prints: one line, no traceback


def test_latest_link_pruning_and_leftover_tmp(tiny_gpt2, tmp_path):
    b = backend(tiny_gpt2)
    root = tmp_path / "checkpoints"
    (root / ".tmp-step_00000003").mkdir(parents=True)  # what a crash while saving step 3 leaves
    (root / ".tmp-step_00000009" / SHARDS_DIR).mkdir(parents=True)  # and of a step this run does not reach
    save(b, tmp_path, 1)
    assert not list(root.glob(".tmp-*"))  # the first save clears the torn ones of every step
    for step in (2, 3):
        save(b, tmp_path, step)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    assert (root / "latest").is_symlink() and (root / "latest").resolve() == root / "step_00000003"
    assert latest_checkpoint(tmp_path).step == 3
    assert latest_checkpoint(tmp_path / "elsewhere") is None


def test_pruning_keeps_the_checkpoint_just_published_and_drops_a_later_one(tiny_gpt2, tmp_path, monkeypatch):
    import rollshard.train.checkpoint as ckpt_mod

    b = backend(tiny_gpt2)
    save(b, tmp_path, 1, keep_last=1)

    def crash(link, target):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(ckpt_mod, "_link_atomic", crash)  # step 3 renamed in, then a crash before the latest link
    with pytest.raises(OSError, match="Input/output"):
        save(b, tmp_path, 3, keep_last=1)
    monkeypatch.undo()
    root = tmp_path / "checkpoints"
    assert latest_checkpoint(tmp_path).step == 1 and (root / "step_00000003").is_dir()
    # The run resumes from step 1 and saves step 2: step 3 is an abandoned future; step 2 is kept and latest.
    path = save(b, tmp_path, 2, keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002"]
    assert latest_checkpoint(tmp_path).path == path
    save(b, tmp_path, 4, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000004"]


def test_saving_a_step_again_keeps_latest_loadable(tiny_gpt2, tmp_path, monkeypatch):
    import rollshard.train.checkpoint as ckpt_mod

    b = backend(tiny_gpt2)
    one_update(b)
    save(b, tmp_path, 1)
    one_update(b)
    real_rmtree = shutil.rmtree
    deleted = []

    def rmtree_then_check(path, *a, **kw):
        real_rmtree(path, *a, **kw)
        deleted.append(Path(path).name)
        # Whatever was deleted, latest still names a complete checkpoint.
        assert latest_checkpoint(tmp_path).updates in (1, 2)

    monkeypatch.setattr(ckpt_mod.shutil, "rmtree", rmtree_then_check)
    path = save(b, tmp_path, 1)  # a resumed run repeating step 1, with 2 updates now
    assert deleted == [".old-step_00000001"]
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.path == path and ckpt.step == 1 and ckpt.updates == 2
    tensors, _ = read_sharded(ckpt.path / SHARDS_DIR)  # loadable
    assert tensors["optim/transformer.wte.weight/step"].item() == 2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_00000001"]


def test_files_and_folders_are_fsynced_before_the_rename(tiny_gpt2, tmp_path, monkeypatch):
    import rollshard.train.checkpoint as ckpt_mod

    b = backend(tiny_gpt2)
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(ckpt_mod.os, "fsync", fsync)
    monkeypatch.setattr(ckpt_mod.os, "replace", replace)
    final = save(b, tmp_path, 4)
    root = tmp_path / "checkpoints"
    tmp = root / ".tmp-step_00000004"
    publish = events.index(("replace", str(tmp), str(final)))
    synced_before = {e[1] for e in events[:publish] if e[0] == "fsync"}
    on_disk = {str(tmp / p.relative_to(final)) for p in final.rglob("*")} | {str(tmp)}
    assert len(on_disk) >= 8  # config, weights, tokenizer files, shards/ and its two files, state, config yaml
    assert str(tmp / SHARDS_DIR / "shard-00001-model-00001-of-00001.safetensors") in on_disk
    assert on_disk <= synced_before, sorted(on_disk - synced_before)
    # The parent folder after the checkpoint's rename, and again after the latest link's.
    after = events[publish + 1:]
    assert ("fsync", str(root)) in after
    link = after.index(("replace", str(root / "latest.tmp"), str(root / "latest")))
    assert ("fsync", str(root)) in after[link + 1:]


def test_interrupted_resave_is_recovered(tiny_gpt2, tmp_path):
    b = backend(tiny_gpt2)
    save(b, tmp_path, 1)
    root = tmp_path / "checkpoints"
    os.replace(root / "step_00000001", root / ".old-step_00000001")  # a crash right after moving it aside
    save(b, tmp_path, 2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001", "step_00000002"]
    assert latest_checkpoint(tmp_path).step == 2


def test_resume_recovers_a_resave_torn_between_its_renames(tiny_dataset, tiny_gpt2, tmp_path):
    out = tmp_path / "run"
    train(make_config(tiny_dataset, tiny_gpt2, out, trainer={"max_steps": 2, "save_every": 1}))
    root = out / CKPT_DIR
    # A resumed run saving step 2 again: its new folder complete, the old one moved aside, then a crash before the
    # new one is renamed in. latest names step_00000002, which is not there.
    shutil.copytree(root / "step_00000002", root / ".tmp-step_00000002")
    os.replace(root / "step_00000002", root / ".old-step_00000002")
    trainer = Trainer(make_config(tiny_dataset, tiny_gpt2, out, trainer={"max_steps": 3, "resume": True}))
    try:
        assert trainer.step == 2 and trainer.backend.updates == 2
        assert latest_checkpoint(out).step == 2 and not (root / ".old-step_00000002").exists()
    finally:
        trainer.close()


def test_a_rank_state_spreads_over_files_of_bounded_size(tiny_gpt2, tmp_path, monkeypatch):
    import rollshard.train.sharded as sharded

    # Tensors of 400, 400 and 1200 bytes; per rank of 2: 200, 200, 600. Under a 500-byte limit a and b share a
    # file (400), c starts one (400 + 600 > 500; alone it may pass the limit). On one rank: 400 + 400 > 500.
    t = {"a": torch.zeros(100), "b": torch.zeros(100), "c": torch.zeros(300)}
    monkeypatch.setattr(sharded, "FILE_BYTES_PER_RANK", 500)
    assert sharded.file_buckets(t, world_size=2) == {"a": 1, "b": 1, "c": 2}
    assert sharded.file_buckets(t, world_size=1) == {"a": 1, "b": 2, "c": 3}

    monkeypatch.setattr(sharded, "FILE_BYTES_PER_RANK", 100_000)
    a = backend(tiny_gpt2)
    one_update(a)
    shards = save(a, tmp_path, 1) / SHARDS_DIR
    files = sorted(shards.glob("shard-00001-model-*.safetensors"))
    assert len(files) > 10
    biggest = 1024 * 64 * 4  # wte, 1024 x 64 fp32: a file of its own
    assert all(f.stat().st_size <= max(100_000, biggest) + 8192 for f in files)  # + the JSON header
    ckpt = latest_checkpoint(tmp_path)
    b = backend(tiny_gpt2, weights_from=ckpt.weights_from)
    ckpt.restore(b)
    assert_same_state(a, b)


def test_a_checkpoint_without_every_rank_shards_is_not_published(tiny_gpt2, tmp_path, monkeypatch):
    import rollshard.train.checkpoint as ckpt_mod

    # Rank R's files are shard-{R + 1:05d}-model-...; ranks 1 and 3 wrote theirs to a disk rank 0 does not see.
    shards = tmp_path / "shards"
    shards.mkdir()
    for name in ("shard-00001-model-00001-of-00002", "shard-00001-model-00002-of-00002",
                 "shard-00003-model-00002-of-00002"):
        (shards / f"{name}.safetensors").touch()
    assert ckpt_mod.missing_shards(shards, 1) is None
    why = ckpt_mod.missing_shards(shards, 4)
    assert f"{shards} holds no shard file of rank 1, 3 (world size 4)" in why and "\n" not in why
    assert why.endswith("under torchrun --out must be on a file system every rank shares")

    # In a save: the files this rank wrote are not in the folder rank 0 publishes.
    b = backend(tiny_gpt2)
    save(b, tmp_path, 1)
    real = b.save_state

    def written_elsewhere(folder, **kw):
        real(folder, **kw)
        for f in folder.glob("shard-*.safetensors"):
            f.unlink()

    monkeypatch.setattr(b, "save_state", written_elsewhere)
    with pytest.raises(ValueError, match=r"no shard file of rank 0 \(world size 1\), so the checkpoint is not published"):
        save(b, tmp_path, 2)
    root = tmp_path / CKPT_DIR
    assert latest_checkpoint(tmp_path).step == 1 and not (root / "step_00000002").exists()


def test_a_resume_with_another_model_is_refused(tiny_dataset, tiny_gpt2, tiny_qwen3, tmp_path):
    # A format-3 resume builds its model from the checkpoint's folder, so --model is compared with it: another
    # architecture is refused in one line, naming what differs, before anything is built.
    train(make_config(tiny_dataset, tiny_gpt2, tmp_path, trainer={"max_steps": 1}))
    other = make_config(tiny_dataset, tiny_qwen3, tmp_path, trainer={"max_steps": 2, "resume": True})
    with pytest.raises(ValueError, match=r"step_00000001 is of another model than --model .*tiny.* \(model_type gpt2 "
                                         r"against qwen3, .*\); resume with the run's --model") as e:
        Trainer(other)
    assert "\n" not in str(e.value)
    assert latest_checkpoint(tmp_path).step == 1
