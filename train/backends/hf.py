"""The ``hf`` backend: a transformers causal LM, AdamW, and FSDP2 for more than one process.

* Weights: ``AutoModelForCausalLM`` in fp32 (master weights). On a GPU that supports
  it the compute runs in bfloat16 (``torch.autocast`` on one device, FSDP2's
  ``MixedPrecisionPolicy`` with fp32 gradient reduction under torchrun); on CPU in fp32.
  With ``fp32_lm_head`` (default) the output head and log softmax run in fp32 on fp32
  weights: autocast is turned off around the head, and under FSDP2 the decoder layers alone
  take the bf16 parameter policy (their outputs cast back to fp32) while the root, which holds
  the embeddings, final norm and head, keeps fp32 parameters. Without it the head runs in
  bf16 and is upcast after (~0.025 mean / 0.08 max nats of noise).
* The model is checked at start-up (:func:`~rollshard.train.logprobs.check_model`, fp32,
  a few ms on the tiny models): packed logprobs must equal per-sequence ones and the model's
  own ``forward``; a model that fails is refused with a ``ModelCheckError``.
* The model runs in eval mode: dropout off, so the recomputed logprobs are those of
  the policy that sampled (the engine has no dropout either). Gradient checkpointing
  turns ``training`` on for the checkpointed decoder layers alone, which is the flag
  transformers checks for it; their dropouts stay off.
* Data parallel: under torchrun with N > 1 processes every decoder layer and then
  the whole model are ``fully_shard``-ed (torch.distributed.fsdp, FSDP2), on GPUs with
  NCCL and on CPU with gloo. The root never casts its inputs, so the row temperatures stay fp32
  (a bf16 0.7 is 0.6992). FSDP averages gradients over ranks; each rank's loss is
  already normalized by the global token count (losses.LossNorm), so backward runs
  on ``loss * world_size`` and the average is the sum the global loss needs (a
  custom divide factor would be exact too, but gloo lacks the PREMUL_SUM it uses).
  Gradient sync is skipped on all but the last micro-batch of an update.
* AdamW, global gradient-norm clipping (a non-finite norm skips the update), and the
  learning rate set before each update from :func:`~rollshard.train.backends.schedule.lr_factor`.
* A frozen reference copy of the initial weights is built only when the KL term is on.
* State for checkpoints (rollshard.train.checkpoint): ``save_state`` / ``load_state`` move the
  sharded weights and AdamW state through torch.distributed.checkpoint, each rank its own shards
  (rollshard.train.sharded); ``export_model`` writes the engines' model folder, gathering one
  tensor at a time.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rollshard.store.loader.packing import positions_from_cu_seqlens, token_temperatures
from rollshard.train.backends.base import Backend
from rollshard.train.backends.distributed import DistEnv
from rollshard.train.config import ModelConfig, OptimConfig
from rollshard.train.logprobs import PackedPolicy, Support, check_model, chunk_rows, packed_logprobs
from rollshard.train.routing import HFRouting, RoutingReplayError, batch_routing, replay_shape
from rollshard.train.sharded import load_sharded, save_gathered, save_sharded, tied_aliases

# Files of a model folder that are weights (rewritten by a checkpoint); everything else
# (tokenizer, chat template, generation config) is copied from the source folder verbatim.
WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")
SAFE_WEIGHTS = "model.safetensors"
POLICY_PREFIX = "model."  # PackedPolicy holds the transformers model as .model; checkpoints use transformers names


def converts_weights(model: nn.Module) -> bool:
    """Whether the model's transformers class converts weights on load (``_weight_conversions``, transformers 5:
    e.g. fused MoE experts), so that its held weights are not the ones a model folder stores."""
    return bool(getattr(model, "_weight_conversions", None))


class HFBackend(Backend):
    """Policy (and optional reference) model, optimizer and the update step."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        optim_cfg: OptimConfig,
        *,
        env: DistEnv,
        total_updates: int | None,
        weights_from: str | Path | None = None,
        need_reference: bool = False,
    ):
        super().__init__(model_cfg, optim_cfg, env=env, total_updates=total_updates)
        self.bf16 = self._use_bf16(model_cfg.dtype)

        model = self._load(weights_from or self.source).to(self.device)
        self.hf_model = model
        chunk = chunk_rows(model.get_output_embeddings().weight.shape[0], model_cfg.logprob_chunk_mib)
        # Before sharding: the check runs the whole fp32 model (every rank holds it at this point anyway).
        self.model_check = check_model(model, chunk_tokens=chunk)
        self.routing_shape = replay_shape(self.source, model_cfg.routing_replay)  # schema 1.2 (train/routing.py)
        self.routing = self._routing(model)
        fp32_head = model_cfg.fp32_lm_head
        self.policy = self._wrap(PackedPolicy(model, chunk_tokens=chunk, fp32_head=fp32_head))
        if model_cfg.gradient_checkpointing:
            self._enable_gradient_checkpointing(model)
        self.params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=optim_cfg.lr,
            betas=tuple(optim_cfg.betas),
            eps=optim_cfg.adam_eps,
            weight_decay=optim_cfg.weight_decay,
        )
        self.reference = self.ref_routing = None
        if need_reference:
            ref = self._load(self.source)
            ref.requires_grad_(False)
            self.ref_routing = self._routing(ref)
            self.reference = self._wrap(PackedPolicy(ref, chunk_tokens=chunk, fp32_head=fp32_head))

    # -- setup ---------------------------------------------------------------------------------

    def _routing(self, model: nn.Module) -> HFRouting | None:
        """The model's routing replay; None for a dense model, and under auto/off for routers replay does not
        reproduce (the model then trains as without it; ``on`` refuses them)."""
        if self.routing_shape is None:
            return None
        try:
            routing = HFRouting(model, self.routing_shape)
        except RoutingReplayError as e:
            if self.cfg.routing_replay == "on":
                raise RoutingReplayError(f"--routing-replay on: {e}") from e
            self.routing_shape = None
            return None
        routing.replay = self.cfg.routing_replay != "off"
        return routing

    def _use_bf16(self, dtype: str) -> bool:
        supported = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        if dtype == "bfloat16" and self.device.type != "cuda":
            return True  # asked for explicitly: CPU autocast to bf16 works, slowly
        return dtype in ("auto", "bfloat16") and supported

    def _load(self, path: str | Path) -> nn.Module:
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=torch.float32, attn_implementation=self.cfg.attn_implementation
            )
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load a causal LM from {path}: {e}; --model takes a Hugging Face model folder") from e
        model.config.use_cache = False
        model.eval()
        return model

    def _wrap(self, policy: PackedPolicy) -> nn.Module:
        if not self.env.enabled:
            return policy.to(self.device)
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy.to(self.device)
        layer_kw, root_kw = {}, {}
        if self.bf16:
            f32, bf16 = torch.float32, torch.bfloat16
            if self.cfg.fp32_lm_head:
                # Layer outputs back in fp32: the fp32 final norm (GPT-2's LayerNorm refuses a bf16 input with
                # fp32 weights) and head take them; the next layer's input cast to bf16 is exact.
                layer_mp = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32, output_dtype=f32)
                root_mp = MixedPrecisionPolicy(reduce_dtype=f32, cast_forward_inputs=False)
            else:
                layer_mp = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32)
                root_mp = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32, cast_forward_inputs=False)
            layer_kw, root_kw = {"mp_policy": layer_mp}, {"mp_policy": root_mp}
        layer_types = set(getattr(policy.model, "_no_split_modules", None) or [])
        for module in policy.model.modules():
            if type(module).__name__ in layer_types:
                fully_shard(module, **layer_kw)
        fully_shard(policy, **root_kw)
        return policy

    @staticmethod
    def _enable_gradient_checkpointing(model: nn.Module) -> None:
        from transformers.modeling_layers import GradientCheckpointingLayer

        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for module in model.modules():
            if isinstance(module, GradientCheckpointingLayer):
                module.training = True  # the flag transformers checks; submodules (dropout) stay in eval

    # -- compute -------------------------------------------------------------------------------

    def _autocast(self):
        if self.bf16 and not self.env.enabled:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def logprobs(
        self, batch: Any, *, grad: bool, entropy: bool = False, reference: bool = False, support: bool = False
    ):
        """``(logp [T], entropy [T] | None)`` of one packed micro-batch under the policy (or the reference); with
        ``support``, a third element: the batch's ``SupportLogprobs``, or None when it has no sampling supports."""
        module = self.reference if reference else self.policy
        if module is None:
            raise RuntimeError("no reference model: it is built only when kl_coef > 0")
        dev = self.device
        sup = Support.of(batch) if support else None
        if sup is not None:
            sup = Support(has_support=sup.has_support.to(dev), ids=sup.ids.to(dev), offsets=sup.offsets.to(dev))
        cu, T = batch.cu_seqlens.to(dev), batch.num_tokens
        routing = self.ref_routing if reference else self.routing
        if routing is not None:  # the batch's stored routing, in force until the next call (and its backward)
            routing.set(batch_routing(batch, self.routing_shape, self.cfg.routing_replay, dev))
        with torch.set_grad_enabled(grad), self._autocast():
            out = packed_logprobs(
                module,
                input_ids=batch.input_ids.to(dev),
                position_ids=positions_from_cu_seqlens(cu, T),  # [T] derived on the device (store/loader/packing.py)
                loss_mask=batch.loss_mask.to(dev),
                temperature=token_temperatures(batch.temperatures.to(dev), cu, T),  # [T]
                with_entropy=entropy,
                support=sup,
            )
        return (*out, None) if support and sup is None else out

    @property
    def vocab_size(self) -> int:
        return self.hf_model.get_input_embeddings().weight.shape[0]

    def routing_agreement(self) -> tuple[float, float]:
        """(pairs whose own top-k equals the stored one, pairs with stored routing) of the policy's forwards since
        the last call (train/routing.py); (0, 0) for a dense model or data without routing."""
        return (0.0, 0.0) if self.routing is None else self.routing.agreement.take()

    def set_gradient_sync(self, sync: bool) -> None:
        """Under FSDP, reduce gradients only on the last micro-batch of an update."""
        if self.env.enabled:
            self.policy.set_requires_gradient_sync(sync)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of this rank's share of the global loss (scaled for FSDP's gradient average)."""
        (loss * self.env.world_size if self.env.enabled else loss).backward()

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step (unless the gradient norm is not finite), zero the gradients."""
        lr = self.lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        max_norm = self.optim_cfg.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm if max_norm is not None else float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        norm = float(norm)
        finite = norm == norm and norm != float("inf")
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        return {"optim/grad_norm": norm, "optim/lr": lr, "optim/skipped": 0.0 if finite else 1.0}

    # -- state -----------------------------------------------------------------------------------

    @property
    def exports_held_weights(self) -> bool:
        """Whether :meth:`export_model` writes every weight as held: not for a model whose class converts weights
        on load (its export is ``save_pretrained``'s, reverted) or that leaves some out of its saves."""
        model = self.hf_model
        return not converts_weights(model) and not model._keys_to_ignore_on_save

    def save_state(self, folder: Path, *, weights: bool = True) -> None:
        """Optimizer state (and weights), sharded as they are held (collective: each rank writes its own file)."""
        save_sharded(folder, self.policy, self.optimizer, env=self.env, strip=POLICY_PREFIX, weights=weights)

    def load_state(self, folder: Path, *, weights: bool = True) -> None:
        """A :meth:`save_state` folder into the shards this process holds (collective; any world size wrote it)."""
        load_sharded(folder, self.policy, self.optimizer, env=self.env, strip=POLICY_PREFIX, weights=weights)

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """A full (unsharded) optimizer state keyed by parameter name: checkpoints of format 1."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        tuples = [{k for k, v in g.items() if isinstance(v, tuple)} for g in self.optimizer.param_groups]
        set_optimizer_state_dict(self.policy, self.optimizer, state, options=StateDictOptions(full_state_dict=True))
        for group, keys in zip(self.optimizer.param_groups, tuples):
            group.update({k: tuple(group[k]) for k in keys})  # the full-state path hands betas back as a list

    def export_model(self, folder: Path) -> None:
        """A Hugging Face model folder of the fp32 master weights: ``model.safetensors``, config and the source's
        tokenizer files (collective under FSDP: the weights are gathered one tensor at a time, rank 0 writes).

        Peak memory on rank 0 beyond its shards: the largest tensor (the embedding). A model whose
        transformers class converts weights on load (``_weight_conversions``, e.g. fused MoE experts) is
        exported by ``save_pretrained``, which reverts them, from a full gather instead: one whole model."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        main = self.env.is_main
        if main:
            folder.mkdir(parents=True, exist_ok=True)
            for f in self.source.iterdir():
                if f.is_file() and not f.name.endswith(WEIGHT_FILE_SUFFIXES) and f.name != "config.json":
                    shutil.copy2(f, folder / f.name)
        model = self.hf_model
        if converts_weights(model):
            full = get_model_state_dict(self.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if main:
                model.save_pretrained(folder, state_dict={k.removeprefix(POLICY_PREFIX): v for k, v in full.items()})
        else:
            skip = set(tied_aliases(self.policy)) | {POLICY_PREFIX + k for k in model._keys_to_ignore_on_save or ()}
            sharded = get_model_state_dict(self.policy)  # DTensor shards under FSDP2: nothing gathered yet
            tensors = {k.removeprefix(POLICY_PREFIX): v for k, v in sharded.items() if k not in skip}
            save_gathered(folder / SAFE_WEIGHTS, tensors, write=main)
            if main:  # the config files save_pretrained writes beside its weights
                model.config.dtype = str(model.dtype).removeprefix("torch.")
                model.config.architectures = [type(model).__name__]
                model.config.save_pretrained(folder)
                if model.can_generate():
                    model.generation_config.save_pretrained(folder)
        if main:
            # transformers 5 writes "dtype"; 4.x (the SGLang environment) reads "torch_dtype".
            cfg_path = folder / "config.json"
            cfg = json.loads(cfg_path.read_text())
            cfg.setdefault("torch_dtype", cfg.get("dtype", "float32"))
            # Training turned the KV cache off; the engines decode with the source folder's setting.
            cfg["use_cache"] = json.loads((self.source / "config.json").read_text()).get("use_cache", True)
            cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
