"""Worker of tests/train/test_fsdp.py: the dtypes FSDP2's bf16 policy gives each part of the model.

    torchrun --standalone --nproc_per_node 2 fsdp_dtype_worker.py OUT MODEL_NAME=MODEL_PATH...

For every model and ``fp32_lm_head`` in (True, False) it builds the ``hf`` backend with
``dtype=bfloat16`` (FSDP2 mixed precision, gloo on CPU), runs one no-grad logprob forward
and records, from forward hooks, the dtype of the unsharded weight, the input and the
output of the input embedding, a decoder layer's first linear, the final norm and the
output head, and the dtype of the temperatures the root receives. It also compares the
logprobs with a pure fp32 head + log softmax applied to the same hidden states (those the
head received). Rank 0 writes ``OUT/dtypes.json``.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from rollshard.train.backends.distributed import close_distributed, init_distributed
from rollshard.train.backends.hf import HFBackend
from rollshard.train.config import ModelConfig, OptimConfig

# Head weights scaled to give logits in a trained LM's range (+-30; see test_logprobs.HEAD_SCALE).
HEAD_SCALE = 16.0


def _parts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    base = model.base_model
    norm = getattr(base, "norm", None) or getattr(base, "ln_f")
    layer_types = set(model._no_split_modules)  # fully_shard subclasses each layer: look along the MRO
    layer = next(m for m in base.modules() if any(c.__name__ in layer_types for c in type(m).__mro__))
    first_linear = next(m for m in layer.modules() if m is not layer and hasattr(m, "weight") and m.weight.dim() == 2)
    return {"embedding": model.get_input_embeddings(), "layer": first_linear, "norm": norm,
            "head": model.get_output_embeddings()}


def _dtype(x) -> str:
    return str(x.dtype).removeprefix("torch.") if isinstance(x, torch.Tensor) else type(x).__name__


def measure(path: str, fp32_lm_head: bool, env) -> dict:
    backend = HFBackend(
        ModelConfig(path=path, dtype="bfloat16", fp32_lm_head=fp32_lm_head), OptimConfig(), env=env, total_updates=None
    )
    with torch.no_grad():
        backend.hf_model.get_output_embeddings().weight.mul_(HEAD_SCALE)  # the local shard: every rank scales its own
    # Before the forward: FSDP2 keeps the root unsharded (in its compute dtype) after one.
    seen: dict = {"master": sorted({_dtype(p) for p in backend.policy.parameters()})}
    for name, module in _parts(backend.hf_model).items():
        def hook(mod, args, out, name=name):
            seen[name] = {"weight": _dtype(mod.weight), "input": _dtype(args[0]), "output": _dtype(out)}
            if name == "head":
                seen["h"], seen["w"] = args[0].detach().float(), mod.weight.detach().float()
        module.register_forward_hook(hook)
    backend.policy.register_forward_pre_hook(lambda mod, args: seen.update(temperature=_dtype(args[3])))

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, backend.hf_model.config.vocab_size, (12,), generator=g)
    positions = torch.cat([torch.arange(5), torch.arange(7)])
    mask = (positions > 1).float()
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)  # two sequences, of 5 and 7 tokens
    batch = SimpleNamespace(input_ids=ids, cu_seqlens=cu, num_tokens=12, loss_mask=mask,
                            temperatures=torch.full((2,), 0.7))
    logp, _ = backend.logprobs(batch, grad=False)
    at = torch.nonzero(mask).flatten()
    logits = torch.nn.functional.linear(seen.pop("h"), seen.pop("w"))  # [K, V] pure fp32 on the same hidden states
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, ids[at][:, None]).squeeze(-1)  # [K]
    err = (logp[at] - expected).abs()
    seen["err_max"], seen["err_mean"] = float(err.max()), float(err.mean())
    return seen


if __name__ == "__main__":
    env = init_distributed()
    try:
        report = {}
        for spec in sys.argv[2:]:
            name, path = spec.split("=", 1)
            for fp32 in (True, False):
                report[f"{name}/fp32_lm_head={fp32}"] = measure(path, fp32, env)
                # Both ranks done with this model before its sharded tensors are freed and the next one is built:
                # freeing them while the other rank still runs collectives on them aborted a rank now and then.
                gc.collect()
                torch.distributed.barrier()
        if env.is_main:
            Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
            (Path(sys.argv[1]) / "dtypes.json").write_text(json.dumps(report, indent=1))
    finally:
        close_distributed(env)
