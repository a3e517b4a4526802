"""Routing replay (R3) on the hf backend: the experts the forward used are the stored ones, the gate weights are
the router's over them, agreement is measured, and rollshard-train --routing-replay refuses what it cannot do."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch

from rollshard.store.loader.packing import Sequences, pack
from rollshard.train.backends.distributed import DistEnv
from rollshard.train.backends.hf import HFBackend
from rollshard.train.config import ModelConfig, OptimConfig
from rollshard.train.routing import RoutingReplayError
from tests import forked

LAYERS, TOP_K, EXPERTS = 2, 2, 4
LENGTHS = [(4, 5), (3, 6), (5, 2)]  # (prompt, response) of each sequence


def _backend(path, mode: str = "auto") -> HFBackend:
    return HFBackend(ModelConfig(path=str(path), routing_replay=mode), OptimConfig(lr=1e-2), env=DistEnv(),
                     total_updates=None)


def _sequences(routing: list[np.ndarray | None] | None, seed: int = 0) -> Sequences:
    g = np.random.default_rng(seed)
    prompt = [g.integers(3, 100, p).astype(np.int32) for p, _ in LENGTHS]
    response = [g.integers(3, 100, r).astype(np.int32) for _, r in LENGTHS]
    return Sequences(prompt=prompt, response=response, logprobs=[np.full(r, -1.0, np.float32) for _, r in LENGTHS],
                     mask=[np.ones(r, np.uint8) for _, r in LENGTHS], temperature=np.ones(3, np.float32),
                     reward=np.array([0, 1, 0.5], np.float32), group=np.zeros(3, np.int64), agent=["a"] * 3,
                     sample_id=[f"s{i}" for i in range(3)], weight_version=["0"] * 3, routing=routing)


def _forward(backend: HFBackend, seqs: Sequences, *, grad: bool = False):
    """The micro-batch, its logprobs, and ``[T, layers, top_k]`` the expert ids each layer's experts module was
    handed (captured at its input, not taken from the replay's own bookkeeping)."""
    (mb,) = pack(seqs, 4096)[0]
    experts = [m for m in backend.hf_model.modules() if type(m).__name__ == "Qwen3MoeExperts"]
    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append(args[1].detach().clone())) for m in experts]
    try:
        logp, _ = backend.logprobs(mb, grad=grad)
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == LAYERS
    return mb, logp, torch.stack(seen, dim=1)


def _own_and_other(backend: HFBackend, seqs: Sequences) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per sequence ``[P + R - 1, layers x top_k]``: the router's own top-k, and the experts it did not choose."""
    _, _, own = _forward(backend, dataclasses_replace(seqs, routing=None))
    lowest = []
    own = own.numpy()
    starts = np.cumsum([0] + [p + r for p, r in LENGTHS])
    per_seq_own = [own[s : s + p + r - 1].reshape(-1, LAYERS * TOP_K) for s, (p, r) in zip(starts, LENGTHS)]
    for o in per_seq_own:
        o3 = o.reshape(-1, LAYERS, TOP_K)
        low = np.empty_like(o3)
        for t in range(len(o3)):
            for layer in range(LAYERS):
                low[t, layer] = [e for e in range(EXPERTS) if e not in o3[t, layer]][:TOP_K]  # the unchosen ones
        lowest.append(low.reshape(-1, LAYERS * TOP_K).astype(np.uint8))
    return [o.astype(np.uint8) for o in per_seq_own], lowest


def dataclasses_replace(seqs: Sequences, **kw) -> Sequences:
    import dataclasses

    return dataclasses.replace(seqs, **kw)


def find(backend: HFBackend):
    from rollshard.store.format.routing import find_routers

    return find_routers(backend.hf_model)


def test_replay_forces_the_stored_experts_and_keeps_the_routers_weights(tiny_moe):
    backend = _backend(tiny_moe)
    seqs = _sequences(None)
    _, free_logp, free_used = _forward(backend, seqs)
    assert backend.routing_agreement() == (0.0, 0.0)  # no stored routing: nothing measured
    own, other = _own_and_other(backend, seqs)

    # The router's own choice, replayed: the same experts, the same logprobs (bit for bit), agreement 1.
    mb, logp, used = _forward(backend, dataclasses_replace(seqs, routing=own))
    assert torch.equal(used, free_used) and torch.equal(logp, free_logp)
    same, pairs = backend.routing_agreement()
    assert pairs == sum(p + r - 1 for p, r in LENGTHS) * LAYERS and same == pairs

    # Experts the router did not choose: used at every stored position, the router's own at each sequence's last
    # position; other logprobs; agreement 0.
    mb, logp, used = _forward(backend, dataclasses_replace(seqs, routing=other), grad=True)
    valid = mb.routed_valid
    stored = mb.routed_experts.long().view(-1, LAYERS, TOP_K)
    assert torch.equal(used[valid], stored[valid]) and torch.equal(used[~valid], free_used[~valid])
    assert (logp - free_logp).abs().max() > 1e-3
    assert backend.routing_agreement() == (0.0, float(valid.sum()) * LAYERS)
    # Gradients reach the routers through the gate weights of the forced experts.
    (-logp.sum()).backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in find(backend))

    # Gate weights: the router's softmax over every expert, gathered at the forced ids and renormalized (Qwen3-MoE).
    router = find(backend)[0]
    h = torch.randn(3, router.hidden_dim)
    backend.routing.set((torch.tensor([[[0, 3], [1, 2]]] * 3), torch.tensor([True, True, False])))
    logits, scores, idx = router(h)
    probs = torch.softmax(logits.float(), -1)
    want = probs[:2, [0, 3]] / probs[:2, [0, 3]].sum(-1, keepdim=True)
    torch.testing.assert_close(scores[:2], want, rtol=0, atol=1e-7)
    assert idx[:2].tolist() == [[0, 3], [0, 3]] and idx[2].tolist() == probs[2].topk(2).indices.tolist()

    # Off: the router's own choice with the stored routing at hand; the agreement is still measured.
    off = _backend(tiny_moe, "off")
    (mb,) = pack(dataclasses_replace(seqs, routing=other), 4096)[0]
    logp_off, _ = off.logprobs(mb, grad=False)
    torch.testing.assert_close(logp_off, free_logp, rtol=0, atol=1e-6)
    assert off.routing_agreement()[0] == 0.0


def test_on_refuses_a_dense_model_and_a_row_without_routing(tiny_moe, tiny_qwen3):
    with pytest.raises(RoutingReplayError, match="is not a mixture of experts"):
        _backend(tiny_qwen3, "on")
    backend = _backend(tiny_moe, "on")
    (mb,) = pack(_sequences(None), 4096)[0]
    with pytest.raises(RoutingReplayError, match="row 's0' has no routed experts"):
        backend.logprobs(mb, grad=False)
    wide = [np.zeros((p + r - 1, 6), np.uint8) for p, r in LENGTHS]
    (mb,) = pack(_sequences(wide), 4096)[0]
    with pytest.raises(RoutingReplayError, match="stores 6 expert ids per position; the model routes 2 layers x top-2"):
        backend.logprobs(mb, grad=False)


def _run(*args: str) -> subprocess.CompletedProcess:
    return forked.run("rollshard.train", *args)


def test_train_reports_agreement_and_refuses_on_without_routing(tiny_moe, tmp_path):
    gen = ["rollshard.generate", "--engine", f"embedded:{tiny_moe}", "--task", "toy", "--limit", "4", "--n-samples",
           "2", "--max-new-tokens", "6", "--no-progress"]
    for name, extra in (("with", []), ("without", ["--routed-experts", "off"])):
        res = forked.run(*gen, "--out", str(tmp_path / name), *extra)
        assert res.returncode == 0, res.stderr
    common = ["--model", str(tiny_moe), "--groups-per-step", "2", "--no-progress", "--max-steps", "2"]
    res = _run("--data", str(tmp_path / "with"), "--out", str(tmp_path / "run"), "--routing-replay", "on", *common)
    assert res.returncode == 0, res.stderr
    import json

    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # fp32 engine, fp32 trainer: the same routing but where rounding decides a near tie (packed vs one at a time)
    agreement = [s["routing/agreement"] for s in steps if "routing/agreement" in s]
    assert len(agreement) == 2 and min(agreement) >= 0.95
    res = _run("--data", str(tmp_path / "without"), "--out", str(tmp_path / "run2"), "--routing-replay", "on", *common)
    assert res.returncode == 2 and "Traceback" not in res.stderr and not (tmp_path / "run2").exists()
    assert res.stderr.strip() == (f"rollshard-train: error: --routing-replay on: dataset {tmp_path / 'without'} stores "
                                  "no routed experts (its run config names no routed_experts); generate it with "
                                  "--routed-experts on, or use --routing-replay auto or off")


def test_audit_reports_agreement_and_the_mismatch_both_ways(tiny_moe, tmp_path):
    """Rows whose stored routing is the router's own (an fp32 engine): agreement ~1 (a near tie may round the other
    way), and with replay the engine's logprobs to fp32 rounding. The same rows with routing the router never chose:
    agreement 0, and replaying it moves the logprobs away from the stored ones (the engine's own routing's)."""
    import json

    import pyarrow.parquet as pq

    from rollshard.store.format.routing import RoutingShape
    from rollshard.store.io.writer import ShardWriter

    res = forked.run("rollshard.generate", "--engine", f"embedded:{tiny_moe}", "--task", "toy", "--limit", "4",
                     "--n-samples", "2", "--max-new-tokens", "6", "--no-progress", "--out", str(tmp_path / "own"))
    assert res.returncode == 0, res.stderr
    shape = RoutingShape(layers=LAYERS, top_k=TOP_K, experts=EXPERTS)
    table = pq.read_table(next((tmp_path / "own" / "shards").glob("*.parquet")))
    other = []
    for raw in table.column("routed_experts").to_pylist():
        ids = shape.decode(raw)
        other.append(shape.encode(np.stack([[[e for e in range(EXPERTS) if e not in pair][:TOP_K] for pair in pos]
                                            for pos in ids])))
    table = table.set_column(table.schema.get_field_index("routed_experts"), "routed_experts", [other])
    with ShardWriter(tmp_path / "other", config={"routed_experts": shape.to_config()}) as w:
        w.write_groups(table)

    def audit(data: str) -> dict:
        out = _run("audit", "--data", str(tmp_path / data), "--model", str(tiny_moe), "--json", "--no-progress",
                   "--max-abs-diff", "100")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    own, forced = audit("own"), audit("other")
    r = own["routing"]
    assert r["tokens"] == own["overall"]["tokens"] and r["agreement"] >= 0.95
    assert r["replay_max"] < 1e-5 and r["no_replay_mean"] >= r["replay_mean"] - 1e-7
    r = forced["routing"]
    assert r["agreement"] == 0.0 and r["replay_mean"] > 1e-3 and r["replay_mean"] > 100 * r["no_replay_mean"]
    assert forced["overall"]["mean"] == pytest.approx(r["replay_mean"], rel=1e-5)  # auto: the report is replayed


def test_on_refuses_a_row_without_routing_among_rows_with_it(tiny_moe):
    routing = [np.zeros((p + r - 1, LAYERS * TOP_K), np.uint8) + np.array([0, 1, 2, 3], np.uint8)
               for p, r in LENGTHS]
    routing[1] = None  # the middle row: generated without routing (a resume with --routed-experts off, say)
    (mb,) = pack(_sequences(routing), 4096)[0]
    with pytest.raises(RoutingReplayError, match="row 's1' has no routed experts"):
        _backend(tiny_moe, "on").logprobs(mb, grad=False)
    auto = _backend(tiny_moe, "auto")  # auto: replays the rows that have it, the router's own for s1
    auto.logprobs(mb, grad=False)
    assert auto.routing_agreement()[1] == sum(p + r - 1 for i, (p, r) in enumerate(LENGTHS) if i != 1) * LAYERS


def test_a_moe_whose_routing_is_not_replayed_trains_under_auto_and_is_refused_under_on(tiny_moe, tmp_path):
    """Dense layers between the MoE ones (mlp_only_layers): no routing stored or replayed, but the model serves and
    trains as before; --routing-replay on says why it cannot replay."""
    import json
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from rollshard.generate.engines.embedded import EmbeddedEngine

    config = AutoConfig.from_pretrained(tiny_moe)
    config.mlp_only_layers = [1]
    folder = tmp_path / "mixed"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for f in tiny_moe.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, folder / f.name)
    assert json.loads((folder / "config.json").read_text())["mlp_only_layers"] == [1]
    engine = EmbeddedEngine(folder)
    assert engine.routing_shape is None and "dense layers between its MoE layers" in engine.routing_reason
    backend = _backend(folder, "auto")
    assert backend.routing is None and backend.routing_shape is None
    with pytest.raises(RoutingReplayError, match="--routing-replay on: model type 'qwen3_moe' has dense layers"):
        _backend(folder, "on")
