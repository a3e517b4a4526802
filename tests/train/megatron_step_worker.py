"""Worker of tests/train/test_megatron.py: the megatron backend against the hf backend on the same weights and batch.

    torchrun --standalone --nproc_per_node N megatron_step_worker.py MODEL DATA OUT TP PP [EP]

(or in process, one rank). Every rank builds both backends: hf on one process (no FSDP), megatron split by
``--tp TP --pp PP [--ep EP]``; where that leaves two data-parallel ranks (``--ep 2``) both take the same
batch and each half the loss, so their summed gradients are those of the batch. On the first micro-batches of the dataset's first step (two temperatures among them) both
compute logprobs and entropies, then the same loss (a fixed per-token weighting of logp plus an entropy term),
backward and one AdamW step; with sampling supports added to one micro-batch, the logprobs renormalized over
them and the mass on them. Rank 0 writes ``OUT/report.json``: the largest differences of logprobs and
entropies, of the gradients (megatron's pieces joined into Hugging Face names by weights.to_hf) and of the
exported weights after the step, with the largest gradient and weight change for scale.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rollshard.store.loader import LoaderConfig, RolloutLoader
from rollshard.train.backends.distributed import DistEnv, init_distributed
from rollshard.train.backends.hf import HFBackend
from rollshard.train.backends.megatron import weights as W
from rollshard.train.backends.megatron.backend import MegatronBackend
from rollshard.train.backends.megatron.parallel import close_parallel, init_parallel
from rollshard.train.config import ModelConfig, OptimConfig

LR = 1e-3
MICRO_BATCHES = 2


def loss_of(logp: torch.Tensor, ent: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    w = torch.sin(torch.arange(logp.numel(), dtype=torch.float32)) * mask  # [T] fixed "advantages"
    return -(logp * w).sum() / mask.sum() - 0.01 * (ent * mask).sum() / mask.sum()


def with_supports(mb):
    """The micro-batch with a sampling support at two of every three scored positions: its own token and ids
    from both halves of the vocabulary (so that both tensor-parallel ranks hold some of every support)."""
    T = mb.input_ids.numel()
    has = (mb.loss_mask > 0) & (torch.arange(T) % 3 != 0)  # [T]
    ids, offsets = [], [0]
    for t in range(T):
        if has[t]:
            ids += sorted({int(mb.input_ids[t]), 3, 100, 513, 700, 1000})
        offsets.append(len(ids))
    return dataclasses.replace(
        mb, has_support=has, support_ids=torch.tensor(ids), support_offsets=torch.tensor(offsets),
        sampling_logprobs=torch.zeros(T),
    )


def per_expert(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused in-memory experts (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``)
    under the per-expert names of the safetensors files."""
    out = {}
    for name, t in sd.items():
        if name.endswith("experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            for e, (gate, up) in enumerate(x.chunk(2) for x in t):
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        elif name.endswith("experts.down_proj"):
            base = name.removesuffix("down_proj")
            out.update({f"{base}{e}.down_proj.weight": x for e, x in enumerate(t)})
        else:
            out[name] = t
    return out


def main(model: str, data: str, out: str, tp: int, pp: int, ep: int = 1) -> None:
    out_dir = Path(out)
    env = init_parallel(init_distributed(), tp=tp, pp=pp, ep=ep)
    optim = OptimConfig(lr=LR, max_grad_norm=1.0)
    hf = HFBackend(ModelConfig(path=model), optim, env=DistEnv(), total_updates=None)
    mg = MegatronBackend(ModelConfig(path=model, backend="megatron", tp=tp, pp=pp, ep=ep), optim, env=env,
                         total_updates=None)
    with RolloutLoader(data, LoaderConfig(groups_per_step=4, micro_batch_tokens=96)) as loader:
        mbs = next(iter(loader)).micro_batches[:MICRO_BATCHES]
    diffs = {"logp": 0.0, "entropy": 0.0}
    temps = set()
    for mb in mbs:
        lp_h, ent_h = hf.logprobs(mb, grad=True, entropy=True)
        lp_m, ent_m = mg.logprobs(mb, grad=True, entropy=True)
        mask = mb.loss_mask
        temps |= set(mb.temperature[mask > 0].tolist())  # derived per token from the [S] temperatures
        diffs["logp"] = max(diffs["logp"], float(((lp_h - lp_m).detach() * mask).abs().max()))
        diffs["entropy"] = max(diffs["entropy"], float(((ent_h - ent_m).detach() * mask).abs().max()))
        hf.backward(loss_of(lp_h, ent_h, mask))
        mg.backward(loss_of(lp_m, ent_m, mask) / env.world_size)
    # Renormalized over the supports, and the mass on them (no gradient: the same chunks as above).
    sup_mb = with_supports(mbs[0])
    _, _, sup_h = hf.logprobs(sup_mb, grad=False, support=True)
    _, _, sup_m = mg.logprobs(sup_mb, grad=False, support=True)
    assert bool(sup_h.has_support.any()) and torch.equal(sup_h.has_support, sup_m.has_support)
    diffs["support_logp"] = float((sup_h.logp - sup_m.logp).abs().max())
    diffs["support_mass"] = float((sup_h.mass - sup_m.mass).abs().max())
    diffs["support_mass_range"] = [float(sup_h.mass[sup_h.has_support].min()), float(sup_h.mass.max())]
    name = f"pp{mg.pp_rank}-tp{mg.tp_rank}-ep{mg.ep_rank}.safetensors"
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_grads: dict[str, torch.Tensor] = {}

    def capture(backend, save):  # the gradients the update uses: reduced and clipped
        real = backend.optimizer.step

        def step():
            save()
            return real()

        backend.optimizer.step = step

    capture(hf, lambda: hf_grads.update(per_expert({n: p.grad.detach().clone() for n, p in hf.hf_model.named_parameters()})))
    capture(mg, lambda: mg._writes_piece() and save_file(
        {n: p.grad.contiguous() for n, p in mg.model.named_parameters()}, str(out_dir / f"grad-{name}")
    ))
    norms = (hf.optimizer_step()["optim/grad_norm"], mg.optimizer_step()["optim/grad_norm"])
    mg.export_model(out_dir / "megatron")
    env.barrier()
    if env.is_main:
        hf.export_model(out_dir / "hf")
        parts = {
            (s, r, e): load_file(str(out_dir / f"grad-pp{s}-tp{r}-ep{e}.safetensors"))
            for s in range(pp) for r in range(tp) for e in range(ep)
        }
        grads = W.to_hf(parts, mg.arch, tp=tp, pp=pp, ep=ep)
        a, b = load_file(str(out_dir / "hf" / "model.safetensors")), load_file(str(out_dir / "megatron" / "model.safetensors"))
        before = load_file(str(Path(model) / "model.safetensors"))
        report = {
            **diffs,
            "temperatures": sorted(temps),
            "grad_names": sorted(grads) == sorted(k for k in hf_grads if k in grads) and len(grads),
            "grad": max(float((grads[k] - hf_grads[k]).abs().max()) for k in grads),
            "grad_by_name": {k: float((grads[k] - hf_grads[k]).abs().max()) for k in grads},
            "grad_max": max(float(hf_grads[k].abs().max()) for k in grads),
            "grad_norm": list(norms),
            "weight_names": sorted(a) == sorted(b),
            "weight": max(float((a[k] - b[k]).abs().max()) for k in a),
            "step_max": max(float((a[k] - before[k].float()).abs().max()) for k in a),
            # AdamW's first update is lr * g / (|g| + eps): where |g| is near eps (1e-8) a gradient difference of
            # fp32 rounding moves it by a fraction of lr; elsewhere it is lr * sign(g) on both.
            "weight_big_grad": max(
                float(((a[k] - b[k]).abs() * (hf_grads[k].abs() > 1e-6)).max()) for k in a if k in hf_grads
            ),
        }
        (out_dir / "report.json").write_text(json.dumps(report))
    close_parallel()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:]))
