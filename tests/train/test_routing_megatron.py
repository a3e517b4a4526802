"""Routing replay (R3) on the megatron backend (train/backends/megatron/routing.py), on tiny-qwen3-moe (2 layers, 4
experts, top-2): the experts the MoE layers dispatch to are the stored ones at every valid (position, layer) and the
router's own elsewhere, the gate weights are the router's over the forced set (the hf backend's logprobs and router
gradients under the same forced routing), replaying the router's own choice is no replay, and the agreement counts.

The forced routing is each layer's *lowest*-ranked experts (with top-2 of 4: the complement of the router's own,
so the agreement is 0): layer l's router input depends on the experts forced in the layers before it, so it is
found layer by layer, each from a forward with the layers below already forced.

Run as a script (under torchrun) this file is the multi-process worker: the same batch and routing under
``--tp 2``, ``--ep 2`` or ``--pp 2``::

    torchrun --standalone --nproc_per_node 2 test_routing_megatron.py MODEL CASE.pt OUT TP PP EP
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
LOGPROB_TOL = 1e-5  # tests/train/test_megatron.py: megatron vs hf logprobs
LENGTHS, PROMPT = (9, 12, 7), 4


def packed_batch(vocab: int, seed: int = 0):
    """Three sequences of PROMPT prompt tokens and a response, packed (no routing yet)."""
    from rollshard.store.loader.packing import PackedBatch

    g = torch.Generator().manual_seed(seed)
    T, S = sum(LENGTHS), len(LENGTHS)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    mask = torch.zeros(T)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        mask[a + PROMPT : b] = 1.0
    return PackedBatch(
        input_ids=torch.randint(0, vocab, (T,), generator=g), cu_seqlens=cu, loss_mask=mask,
        rollout_logprobs=torch.zeros(T), temperatures=torch.tensor([1.0, 0.7, 1.0]),
        response_start=cu[:-1].long() + PROMPT, seq_group=torch.arange(S), rewards=torch.zeros(S),
        agents=["a"] * S, sample_ids=[f"s{i}" for i in range(S)], weight_versions=[None] * S,
        num_tokens=T, num_loss_tokens=int(mask.sum()),
    )


def last_positions(batch) -> torch.Tensor:  # [T] bool: each sequence's last position
    last = torch.zeros(batch.num_tokens, dtype=torch.bool)
    last[batch.cu_seqlens[1:].long() - 1] = True
    return last


def with_routing(batch, ids: torch.Tensor):
    """``batch`` storing ``ids [T, layers, k]`` as the loader packs them: uint8, valid except each sequence's last
    position (0 there)."""
    valid = ~last_positions(batch)
    flat = (ids * valid[:, None, None]).reshape(batch.num_tokens, -1).to(torch.uint8)
    return dataclasses.replace(batch, routed_experts=flat, routed_valid=valid)


class Capture:
    """Forward hooks on a megatron model's routers: each layer's router logits ``[T, E]`` (the gating of the
    router's input) and the routing map it handed the token dispatcher (as sorted ids ``[T, k]``)."""

    def __init__(self, model):
        from rollshard.train.backends.megatron.routing import moe_routers

        self.logits: dict[int, torch.Tensor] = {}
        self.used: dict[int, torch.Tensor] = {}
        self.hooks = []
        for r in moe_routers(model):
            layer = r.layer_number - 1

            def pre(m, args, layer=layer):
                with torch.no_grad():
                    self.logits[layer] = m.gating(args[0]).reshape(-1, m.config.num_moe_experts).float()

            def post(m, args, out, layer=layer):
                routing_map = out[1]  # [T, E] bool, what the dispatcher sends
                k = m.topk
                assert bool((routing_map.sum(-1) == k).all())
                self.used[layer] = routing_map.nonzero()[:, 1].view(-1, k)  # sorted per row

            self.hooks += [r.register_forward_pre_hook(pre), r.register_forward_hook(post)]

    def own(self, layer: int, k: int) -> torch.Tensor:  # [T, k] the router's own top-k (sorted)
        return self.logits[layer].topk(k, dim=-1).indices.sort(-1).values

    def check_used(self, layer: int, stored: torch.Tensor, valid: torch.Tensor) -> bool:
        """The dispatched experts are ``stored [T, k]`` where valid, the router's own elsewhere."""
        k = stored.shape[1]
        want = torch.where(valid[:, None], stored.sort(-1).values, self.own(layer, k))
        return torch.equal(self.used[layer], want)


def megatron_backend(model: Path, mode: str = "auto", *, env=None, tp=1, pp=1, ep=1, reference=False):
    from rollshard.train.backends.megatron.backend import MegatronBackend
    from rollshard.train.config import ModelConfig, OptimConfig

    cfg = ModelConfig(path=str(model), backend="megatron", tp=tp, pp=pp, ep=ep, routing_replay=mode)
    return MegatronBackend(cfg, OptimConfig(lr=1e-3), env=env, total_updates=None, need_reference=reference)


def router_grads(backend) -> dict[int, torch.Tensor]:
    from rollshard.train.backends.megatron.routing import moe_routers

    return {r.layer_number - 1: r.weight.grad.detach().clone() for r in moe_routers(backend.model)}


@pytest.fixture(scope="module")
def single(tiny_moe):
    """Everything of one process (megatron tp=pp=ep=1, and the hf backend) the tests assert on."""
    from rollshard.train.backends.distributed import DistEnv
    from rollshard.train.backends.hf import HFBackend
    from rollshard.train.backends.megatron.parallel import close_parallel, init_parallel
    from rollshard.train.config import ModelConfig, OptimConfig

    torch.manual_seed(0)
    env = init_parallel(DistEnv(), tp=1, pp=1, ep=1)  # one process: a gloo world of one
    try:
        mg = megatron_backend(tiny_moe, env=env, reference=True)
        shape = mg.routing_shape
        L, K = shape.layers, shape.top_k
        batch = packed_batch(mg.arch.vocab)
        T, mask = batch.num_tokens, batch.loss_mask
        valid = ~last_positions(batch)
        cap = Capture(mg.model)
        r: dict = {"shape": shape, "valid": valid, "mask": mask}

        # No routing stored: the router's own choice.
        r["lp_none"] = mg.logprobs(batch, grad=False)[0]
        own = torch.stack([cap.own(l, K) for l in range(L)], 1)  # [T, L, K]
        r["none_used_own"] = all(torch.equal(cap.used[l], own[:, l]) for l in range(L))
        r["agreement_none"] = mg.routing_agreement()  # nothing stored: no pairs

        # The lowest-ranked experts, layer by layer (each with the layers below forced).
        low = own.clone()
        for l in range(L):
            if l:
                mg.logprobs(with_routing(batch, low), grad=False)
            low[:, l] = cap.logits[l].topk(K, dim=-1, largest=False).indices
        mg.routing_agreement()
        low_batch = with_routing(batch, low)
        r["low_batch"], r["low"] = low_batch, low
        r["lp_low"] = mg.logprobs(low_batch, grad=False)[0]
        r["low_used_ok"] = [cap.check_used(l, low[:, l], valid) for l in range(L)]
        r["low_disjoint"] = all(  # the router's own top-k in this forward is the complement (valid positions)
            not bool((cap.own(l, K)[valid][:, :, None] == low[valid][:, l][:, None, :]).any()) for l in range(L)
        )
        r["agreement_low"] = mg.routing_agreement()
        r["lp_low_reference"] = mg.logprobs(low_batch, grad=False, reference=True)[0]  # the reference replays too
        r["agreement_after_reference"] = mg.routing_agreement()  # the policy's alone

        # The router's own choice stored: no replay, bit for bit.
        r["lp_own"] = mg.logprobs(with_routing(batch, own), grad=False)[0]
        r["own_used_ok"] = [cap.check_used(l, own[:, l], valid) for l in range(L)]
        r["agreement_own"] = mg.routing_agreement()

        # Gradients under the low routing reach the routers (compared with the hf backend below).
        lp = mg.logprobs(low_batch, grad=True)[0]
        mg.backward(-(lp * mask).sum() / mask.sum())
        r["mg_router_grads"] = router_grads(mg)
        mg.optimizer.zero_grad(set_to_none=True)
        mg.routing_agreement()

        # --routing-replay off: measured, never forced.
        off = megatron_backend(tiny_moe, "off", env=env)
        Capture(off.model)
        r["lp_off"] = off.logprobs(low_batch, grad=False)[0]
        r["agreement_off"] = off.routing_agreement()

        # The hf backend forced to the same routing.
        hf = HFBackend(ModelConfig(path=str(tiny_moe)), OptimConfig(lr=1e-3), env=DistEnv(), total_updates=None)
        r["hf_lp_low"] = hf.logprobs(low_batch, grad=False)[0]
        r["hf_agreement_low"] = hf.routing_agreement()
        lp_h = hf.logprobs(low_batch, grad=True)[0]
        hf.backward(-(lp_h * mask).sum() / mask.sum())
        r["hf_router_grads"] = {l: hf.hf_model.model.layers[l].mlp.gate.weight.grad.detach().clone() for l in range(L)}
        for h in cap.hooks:
            h.remove()
        from rollshard.train.backends.base import Backend

        r["backends"] = [(type(b).__name__, isinstance(b, Backend), b.vocab_size, b.set_routing_replay(False),
                          b.set_routing_replay(True)) for b in (mg, hf)]
        return r
    finally:
        close_parallel()


def test_both_backends_are_the_trainers_backend(single):
    # What the trainer and the audit use of a backend, the same on both: the vocabulary, the replay switch (which
    # says the setting it replaces: replay was on, then off).
    assert single["backends"] == [("MegatronBackend", True, 1024, True, False), ("HFBackend", True, 1024, True, False)]


def test_megatron_replays_the_stored_routing(single):
    r, mask, valid = single, single["mask"] > 0, single["valid"]
    L = r["shape"].layers
    pairs = float(valid.sum()) * L
    assert r["none_used_own"] and r["agreement_none"] == (0.0, 0.0)
    # The stored experts dispatched at every valid (position, layer), the router's own at each row's last.
    assert r["low_used_ok"] == [True] * L
    assert r["low_disjoint"] and r["agreement_low"] == (0.0, pairs)
    assert float((r["lp_low"] - r["lp_none"])[mask].abs().max()) > 1e-3  # the forcing changes the logprobs
    # The reference model replays the same routing (same weights); its forwards count in no agreement taken.
    assert float((r["lp_low_reference"] - r["lp_low"]).abs().max()) == 0.0
    assert r["agreement_after_reference"] == (0.0, 0.0)
    # Replaying the router's own choice is no replay.
    assert r["own_used_ok"] == [True] * L
    assert float((r["lp_own"] - r["lp_none"]).abs().max()) <= 1e-6
    assert r["agreement_own"] == (pairs, pairs)
    # --routing-replay off: the router's own choice, the agreement still measured.
    assert float((r["lp_off"] - r["lp_none"]).abs().max()) <= 1e-6 and r["agreement_off"] == (0.0, pairs)


def test_megatron_replay_matches_the_hf_backend(single):
    r, mask = single, single["mask"] > 0
    assert float((r["lp_low"] - r["hf_lp_low"])[mask].abs().max()) <= LOGPROB_TOL
    assert r["hf_agreement_low"] == r["agreement_low"]
    # The router's gradient over the forced set: megatron's equals the hf backend's.
    for l, g in r["mg_router_grads"].items():
        h = r["hf_router_grads"][l]
        assert float(g.abs().max()) > 0
        assert float((g - h).abs().max()) <= 1e-6 + 1e-5 * float(h.abs().max()), l


@pytest.mark.slow  # three torchrun runs of two processes
@pytest.mark.parametrize("tp, pp, ep", [(2, 1, 1), (1, 1, 2), (1, 2, 1)])
def test_replay_under_model_parallelism(tp, pp, ep, single, tiny_moe, tmp_path):
    case = tmp_path / "case.pt"
    torch.save({"batch": single["low_batch"], "low": single["low"]}, case)
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", str(Path(__file__).resolve()),
         str(tiny_moe), str(case), str(tmp_path), str(tp), str(pp), str(ep)],
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    L = single["shape"].layers
    layers = sorted({l for rep in reports for l in rep["layers"]})
    assert layers == list(range(L))  # every layer checked (pp: one per stage)
    pairs = float(single["valid"].sum()) * L
    mask = single["mask"] > 0
    for rep in reports:
        assert rep["used_ok"] and rep["layers"]
        assert rep["agreement"] == [0.0, pairs]  # pp: both stages' layers summed
        diff = (torch.tensor(rep["logp"]) - single["lp_low"])[mask].abs().max()
        assert float(diff) <= LOGPROB_TOL


def worker(model: str, case: str, out: str, tp: int, pp: int, ep: int) -> None:
    from rollshard.train.backends.distributed import init_distributed
    from rollshard.train.backends.megatron.parallel import close_parallel, init_parallel

    env = init_parallel(init_distributed(), tp=tp, pp=pp, ep=ep)
    data = torch.load(case, weights_only=False)
    batch, low = data["batch"], data["low"]
    mg = megatron_backend(Path(model), env=env, tp=tp, pp=pp, ep=ep)
    cap = Capture(mg.model)
    lp = mg.logprobs(batch, grad=False)[0]  # under ep=2 both data-parallel ranks take the same batch
    layers = sorted(cap.used)
    report = {
        "layers": layers,
        "used_ok": all(cap.check_used(l, low[:, l], batch.routed_valid) for l in layers),
        "agreement": list(mg.routing_agreement()),
        "logp": lp.tolist(),
    }
    (Path(out) / f"rank{env.global_rank}.json").write_text(json.dumps(report))
    close_parallel()


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:]))


@pytest.mark.slow  # a generation and a two-process megatron run: ~20 s
def test_expert_parallel_ranks_with_micro_batches_of_different_lengths_train(tiny_moe, tmp_path):
    """Under --ep 2 the two ranks hold different groups, so their micro-batches differ in tokens; the allgather
    dispatcher gathers equal shares, so the backend pads the shorter to the longer (a sequence of its own, cut off
    after the forward). Without it the run died in the dispatcher's all-gather (gloo: received data size doesn't
    match). The padding changes no logprob: the step-0 mismatch stays at fp32 rounding, and the replay agrees."""
    from tests import forked  # not at the top: torchrun runs this file as its workers' script

    gen = forked.run("rollshard.generate", "--engine", f"embedded:{tiny_moe}", "--task", "toy", "--limit", "4",
                     "--n-samples", "2", "--max-new-tokens", "8", "--no-progress", "--out", tmp_path / "data")
    assert gen.returncode == 0, gen.stderr
    torchrun = Path(sys.executable).with_name("torchrun")
    run = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "rollshard.train", "--data",
         str(tmp_path / "data"), "--model", str(tiny_moe), "--out", str(tmp_path / "run"), "--backend", "megatron",
         "--ep", "2", "--groups-per-step", "1", "--max-steps", "2", "--no-progress", "--no-tensorboard",
         "--routing-replay", "on"],
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and steps[0]["mismatch/abs_diff_max"] < 1e-5
    assert min(s["routing/agreement"] for s in steps) >= 0.95  # (a near tie may round the other way)
