"""Checkpoints: optimizer state round trip without pickle, latest link, pruning, a crash while saving."""

from __future__ import annotations

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
