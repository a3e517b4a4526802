"""Checkpoints: optimizer state round trip without pickle, latest link, pruning, a crash while saving."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rollshard.train.backends.distributed import DistEnv
from rollshard.train.backends.hf import HFBackend
from rollshard.train.checkpoint import latest_checkpoint, save_checkpoint
from rollshard.train.config import ModelConfig, OptimConfig
from rollshard.train.trainer import dummy_batch


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
                           world_size=1, config_yaml="trainer: {}\n", is_main=True, keep_last=keep_last)


def test_resume_continues_the_optimizer_exactly(tiny_gpt2, tmp_path):
    a = backend(tiny_gpt2)
    one_update(a)
    path = save(a, tmp_path, 1)
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.path == path and ckpt.updates == 1 and ckpt.loader_states == [{"cursor": 1}]

    b = backend(tiny_gpt2, weights_from=ckpt.path)
    b.load_optimizer_state(ckpt.optimizer_state())
    b.updates = ckpt.updates
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    for k in sa["state"]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa["state"][k][name], sb["state"][k][name])
    one_update(a)
    one_update(b)
    for (na, pa), (nb, pb) in zip(a.policy.named_parameters(), b.policy.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na


def test_latest_link_pruning_and_leftover_tmp(tiny_gpt2, tmp_path):
    b = backend(tiny_gpt2)
    root = tmp_path / "checkpoints"
    (root / ".tmp-step_00000003").mkdir(parents=True)  # what a crash while saving step 3 leaves
    for step in (1, 2, 3):
        save(b, tmp_path, step)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    assert (root / "latest").is_symlink() and (root / "latest").resolve() == root / "step_00000003"
    assert latest_checkpoint(tmp_path).step == 3
    assert latest_checkpoint(tmp_path / "elsewhere") is None


def test_saving_a_step_again_keeps_latest_loadable(tiny_gpt2, tmp_path, monkeypatch):
    import shutil

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
    assert ckpt.optimizer_state()["state"]  # loadable
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
    assert len(on_disk) >= 8  # config, weights, tokenizer files, optimizer/ and its two files, state, config yaml
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
