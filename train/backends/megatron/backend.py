"""The ``megatron`` backend: a megatron-core GPTModel with tensor, pipeline and data parallelism.

* Weights come from the Hugging Face safetensors of ``--model`` (or a checkpoint), each rank reading only
  the tensors its piece needs (:mod:`.weights`), as fp32 master weights; compute is fp32 on CPU and
  bf16 autocast on GPUs (the head and log softmax in fp32 either way).
* Logprobs: :mod:`.forward` (packed sequences, explicit block-diagonal mask, vocabulary-parallel log
  softmax of ``logits / temperature``). Every rank returns the same ``logp [T]``; the trainer's loss is
  computed on each of them (one replica per model-parallel group).
* Pipeline parallel: stage by stage per micro-batch. A stage receives the previous stage's hidden states
  (``[T, 1, H]``, its size known from the batch), runs its layers and sends them on; the last stage
  computes the logprobs and broadcasts them over the pipeline group. ``backward`` runs the last stage's
  backward from the loss and hands each stage's input gradient back down. The trainer computes its loss
  outside the model, one micro-batch at a time, so megatron-core's pipeline schedules (which own the loss
  function and interleave micro-batches) are not used: stages run in turn, for memory, not overlap. (Nor could
  they run on CPU: megatron-core 0.16.1's schedules allocate ``torch.zeros(..., device="cuda")`` for their token
  count and its p2p layer calls ``torch.cuda.synchronize``.)
* Gradients of the q/k norms (Qwen3) are summed over the tensor-parallel group: each rank applies them to its
  own heads only (megatron-core's ``finalize_model_grads`` does the same).
* MoE under tensor parallelism (no sequence parallelism): the allgather token dispatcher gives each expert the
  tokens of every tensor-parallel rank, tp copies of the same tokens, so expert gradients are divided by tp.
* MoE routing replay (R3, ``--routing-replay``): the micro-batch's stored routing is set on the routers of the
  model that runs (policy or reference), this stage's layers, for the forward (:mod:`.routing`); the routing
  agreement of the policy's forwards is summed over the pipeline stages (:meth:`MegatronBackend.routing_agreement`).
* Data parallel: gradients are summed over the data-parallel group before the update (each rank's loss
  is normalized by the global token count, so the sum is the global gradient); expert gradients over the
  expert-data-parallel group (the ranks holding the same experts; under ``--ep`` the others hold other ones); the tied embedding's
  gradient is summed over megatron's embedding group (first and last stage) when ``pp > 1``.
* Optimizer: torch AdamW over the local parameters (elementwise, so a split parameter's update is the
  slice of the whole one's), global gradient-norm clipping over every model-parallel rank (a parameter
  held whole by every tensor-parallel rank counted once), a non-finite norm skipping the update.
  megatron-core's distributed optimizer needs CUDA and its DDP buffers; this one runs on both.
* Checkpoints: ``save_state`` writes each rank's fp32 weights (megatron names) and AdamW state to its own
  safetensors file in ``shards/`` (``shard-{global rank + 1:05d}-model-00001-of-00001.safetensors``, its
  tp/pp/ep layout in the header); ``load_state`` reads it back bit for bit, refusing another layout.
  ``export_model`` writes the Hugging Face model folder: each model-parallel rank of data-parallel rank 0
  writes its piece, rank 0 joins them (:func:`.weights.to_hf`, the whole model in its memory once) and
  writes ``model.safetensors`` with the source folder's config and tokenizer files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rollshard.store.loader.packing import positions_from_cu_seqlens, token_temperatures
from rollshard.train.backends.base import Backend
from rollshard.train.backends.megatron import weights as W
from rollshard.train.backends.megatron.forward import head_logprobs, pad_as_sequences, stage_hidden
from rollshard.train.backends.megatron.model import arch_of, build_model, check_layout, transformer_config
from rollshard.train.backends.megatron.parallel import ParallelEnv
from rollshard.train.backends.megatron.routing import MegatronRouting
from rollshard.train.config import ModelConfig, OptimConfig
from rollshard.train.logprobs import (
    Support,
    SupportLogprobs,
    chunk_rows,
    loss_positions,
    sampling_temperature,
    support_elements,
)
from rollshard.train.routing import batch_routing, replay_shape

WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")
SAFE_WEIGHTS, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
PIECES_DIR = ".megatron-pieces"  # each model-parallel rank's piece while an export joins them
MODEL_KEY, OPTIM_KEY, OPTIM_META = "model/", "optim/", "optimizer.json"


class HFWeights:
    """The tensors of a Hugging Face safetensors folder by name, each read when asked (one file or an index)."""

    def __init__(self, folder: Path):
        index = folder / SAFE_INDEX
        if index.is_file():
            files = json.loads(index.read_text())["weight_map"]
            self.where = {k: folder / f for k, f in files.items()}
        elif (folder / SAFE_WEIGHTS).is_file():
            with safe_open(str(folder / SAFE_WEIGHTS), framework="pt") as f:
                self.where = {k: folder / SAFE_WEIGHTS for k in f.keys()}
        else:
            raise ValueError(f"{folder} holds no {SAFE_WEIGHTS} (or index); --backend megatron loads safetensors weights")

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise ValueError(f"the checkpoint lacks weight {name!r}, which this architecture needs; is --model complete?")
        with safe_open(str(self.where[name]), framework="pt") as f:
            return f.get_tensor(name).float()


def _shard_file(rank: int) -> str:
    return f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors"


class MegatronBackend(Backend):
    """Policy (and optional reference) model split over tensor/pipeline ranks, AdamW, and the update step."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        optim_cfg: OptimConfig,
        *,
        env: ParallelEnv,
        total_updates: int | None,
        weights_from: str | Path | None = None,
        need_reference: bool = False,
    ):
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig

        super().__init__(model_cfg, optim_cfg, env=env, total_updates=total_updates)
        try:
            self.hf_config = AutoConfig.from_pretrained(str(self.source))
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read a model config from {self.source}: {e}; --model takes a Hugging Face model folder") from e
        self.arch = arch_of(self.hf_config)
        check_layout(self.arch, tp=env.tp, pp=env.pp, ep=env.ep)
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.ep_rank = ps.get_expert_model_parallel_rank() if self.arch.moe else 0
        self.first, self.last = self.pp_rank == 0, self.pp_rank == env.pp - 1
        self.bf16 = self.device.type == "cuda" and model_cfg.dtype in ("auto", "bfloat16") and torch.cuda.is_bf16_supported()
        self.mcfg = transformer_config(self.arch, tp=env.tp, pp=env.pp, ep=env.ep, bf16=self.bf16)
        self.chunk = chunk_rows(self.arch.vocab // env.tp, model_cfg.logprob_chunk_mib)
        self.routing_shape = replay_shape(self.source, model_cfg.routing_replay)  # routing replay (.routing)
        self.model = self._load(Path(weights_from) if weights_from else self.source)
        self.routing = self._routing(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.names = {p: n for n, p in self.model.named_parameters()}
        self.optimizer = torch.optim.AdamW(
            self.params, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), eps=optim_cfg.adam_eps,
            weight_decay=optim_cfg.weight_decay,
        )
        self.reference = self.ref_routing = None
        if need_reference:
            self.reference = self._load(self.source)
            self.reference.requires_grad_(False)
            self.ref_routing = self._routing(self.reference)
        self._freqs = self.model.rotary_pos_emb(self.arch.max_positions)  # [P, 1, 1, D]
        self._pending: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []  # (stage input, stage output)

    # -- setup ---------------------------------------------------------------------------------

    def _load(self, folder: Path):
        model = build_model(self.arch, self.mcfg, pre_process=self.first, post_process=self.last).to(self.device)
        piece = W.to_megatron(
            HFWeights(folder), self.arch, tp_rank=self.tp_rank, tp=self.env.tp, pp_rank=self.pp_rank, pp=self.env.pp,
            ep_rank=self.ep_rank, ep=self.env.ep,
        )
        self._assign(model, piece)
        return model

    def _routing(self, model) -> MegatronRouting | None:
        """Each model its own routers' replay (policy and reference), this stage's layers."""
        if self.routing_shape is None:
            return None
        return MegatronRouting(model, self.routing_shape, replay=self.cfg.routing_replay != "off")

    def _assign(self, model, piece: dict[str, torch.Tensor]) -> None:
        from rollshard.train.backends.megatron.model import have_transformer_engine

        if have_transformer_engine():
            piece = W.te_names(piece, to_te=True)
        params = dict(model.named_parameters())
        missing = sorted(set(params) - set(piece))
        extra = sorted(set(piece) - set(params))
        assert not missing and not extra, (missing, extra)  # weights.py and model.py describe one layout
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(piece[name])

    def local_weights(self, model=None) -> dict[str, torch.Tensor]:
        """This rank's weights under megatron's local-spec names (fp32, detached)."""
        from rollshard.train.backends.megatron.model import have_transformer_engine

        sd = {n: p.detach() for n, p in (model or self.model).named_parameters()}
        return W.te_names(sd, to_te=False) if have_transformer_engine() else sd

    # -- compute -------------------------------------------------------------------------------

    def _p2p(self, tensor: torch.Tensor, *, send: bool, peer_stage: int) -> None:
        from megatron.core import parallel_state as ps

        ranks = ps.get_pipeline_model_parallel_group()
        peer = dist.get_global_rank(ranks, peer_stage)
        (dist.send if send else dist.recv)(tensor, peer)

    def logprobs(self, batch: Any, *, grad: bool, entropy: bool = False, reference: bool = False, support: bool = False):
        """``(logp [T], entropy [T] | None)`` of one packed micro-batch (the same on every rank); with ``support``
        a third element: the batch's ``SupportLogprobs``, or None when it has no sampling supports."""
        model = self.reference if reference else self.model
        if model is None:
            raise RuntimeError("no reference model: it is built only when kl_coef > 0")
        dev = self.device
        ids, cu, T = batch.input_ids.to(dev), batch.cu_seqlens.to(dev), batch.num_tokens
        pos = positions_from_cu_seqlens(cu, T)  # [T] derived on the device (store/loader/packing.py)
        mask = batch.loss_mask.to(dev)
        at = loss_positions(mask)  # [K]
        temp = token_temperatures(batch.temperatures.to(dev), cu, T)  # [T] derived on the device too
        temp = sampling_temperature(temp.float()).index_select(0, at)  # [K]
        sup = Support.of(batch) if support else None
        rows_ids = ()
        if sup is not None:
            sup = Support(has_support=sup.has_support.to(dev), ids=sup.ids.to(dev), offsets=sup.offsets.to(dev))
            rows_ids = support_elements(sup, at, ids.index_select(0, at))  # [M], [M]
        pad = self._expert_parallel_pad(T)
        routing = self.ref_routing if reference else self.routing
        if routing is not None:  # the batch's stored routing on this stage's routers for this forward
            stored = batch_routing(batch, self.routing_shape, self.cfg.routing_replay, dev)
            if stored is not None and pad:  # the padding tokens route on their own
                stored = (F.pad(stored[0], (0, 0, 0, 0, 0, pad)), F.pad(stored[1], (0, pad)))
            routing.set(stored)
        # Under --ep the padding is sequences of its own after the batch's (attention never crosses into them);
        # their outputs are cut off below, so nothing depends on them and no gradient flows from them.
        ids_f, pos_f, cu_f = ids, pos, batch.cu_seqlens
        if pad:
            ids_f = F.pad(ids, (0, pad))
            pos_f, cu_f = pad_as_sequences(pos, batch.cu_seqlens, pad, self.arch.max_positions)
        autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.bf16)
        with torch.set_grad_enabled(grad), autocast:
            inp = None
            if not self.first:
                inp = torch.empty(T, 1, self.arch.hidden, device=dev, dtype=torch.float32)
                self._p2p(inp, send=False, peer_stage=self.pp_rank - 1)
                inp.requires_grad_(grad)
                model.set_input_tensor(F.pad(inp, (0, 0, 0, 0, 0, pad)) if pad else inp)
            try:
                out = stage_hidden(model, ids_f, pos_f, cu_f, self._freqs)[:T]  # [T, 1, H]
            finally:
                if routing is not None:
                    routing.set(None)  # no recompute in this backend: the backward needs no routing state
            if not self.last:
                self._p2p(out.detach().float().contiguous(), send=True, peer_stage=self.pp_rank + 1)
                K = at.numel()
                results = [torch.empty(K, device=dev), torch.empty(K, device=dev) if entropy else None]
                results += [torch.empty(K, device=dev), torch.empty(K, device=dev)] if rows_ids else []
            else:
                results = list(head_logprobs(
                    model, out.float(), ids, at, temp, with_entropy=entropy, chunk_tokens=self.chunk,
                    **(dict(zip(("support_rows", "support_ids"), rows_ids))),
                ))
        if grad:
            self._pending.append((inp, out))
        if self.env.pp > 1:  # the last stage's results on every stage
            from megatron.core import parallel_state as ps

            group, src = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_last_rank()
            for t in results:
                if t is not None:
                    shared = t.detach().clone() if self.last else t
                    dist.broadcast(shared, src, group=group)
                    if not self.last:
                        t.copy_(shared)

        def scatter(v: torch.Tensor | None) -> torch.Tensor | None:  # [K] -> [T]
            return None if v is None else torch.zeros(T, dtype=v.dtype, device=v.device).index_copy(0, at, v)

        lp, ent = scatter(results[0]), scatter(results[1])
        if not support:
            return lp, ent
        if sup is None:
            return lp, ent, None
        has = sup.has_support & (mask > 0)  # [T]
        return lp, ent, SupportLogprobs(logp=scatter(results[2]), mass=scatter(results[3]), has_support=has)

    def _expert_parallel_pad(self, T: int) -> int:
        """Tokens to add so that every rank of the tensor x expert-parallel group forwards as many: the allgather
        token dispatcher gathers equal shares (megatron-core 0.16.1 passes it no split sizes), and under --ep the
        ranks hold different micro-batches. Collective over that group; 0 without expert parallelism."""
        if not (self.arch.moe and self.env.ep > 1):
            return 0
        from megatron.core import parallel_state as ps

        most = torch.tensor([T], dtype=torch.int64, device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=ps.get_expert_tensor_and_model_parallel_group())
        return int(most) - T

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab

    def routing_agreement(self) -> tuple[float, float]:
        """(pairs whose own top-k equals the stored one, pairs with stored routing) of the policy's forwards since
        the last call (train/routing.py); (0, 0) for a dense model or data without routing. Collective over the
        pipeline group (each stage counts its own layers; the tensor-parallel ranks of a stage count the same pairs,
        once); the caller sums over data-parallel ranks."""
        if self.routing is None:
            return (0.0, 0.0)
        same, pairs = self.routing.agreement.take()
        if self.env.pp > 1:
            from megatron.core import parallel_state as ps

            t = torch.tensor([same, pairs], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, group=ps.get_pipeline_model_parallel_group())
            same, pairs = t.tolist()
        return same, pairs

    def set_gradient_sync(self, sync: bool) -> None:
        """Gradients are summed over the data-parallel group in :meth:`optimizer_step`, once per update."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of this rank's loss replica through its stage; the stages hand input gradients down."""
        inp, out = self._pending.pop(0)
        if self.last:
            loss.backward()
        else:
            grad = torch.empty(out.shape, device=self.device, dtype=torch.float32)
            self._p2p(grad, send=False, peer_stage=self.pp_rank + 1)
            torch.autograd.backward(out, grad.to(out.dtype))
        if not self.first:
            g = inp.grad if inp.grad is not None else torch.zeros_like(inp)
            self._p2p(g.contiguous(), send=True, peer_stage=self.pp_rank - 1)

    def _is_tied_copy(self, name: str) -> bool:
        """The last stage's copy of a tied embedding (pp > 1): counted on the first stage only."""
        return self.arch.tied and not self.first and name == "output_layer.weight"

    def _reduce_grads(self) -> None:
        from megatron.core import parallel_state as ps

        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.env.tp > 1 and self.arch.qk_norm:
            # Each rank's q/k norms saw its own heads only: the whole gradient is the sum (megatron-core's
            # finalize_model_grads does the same).
            for p in self.params:
                if "q_layernorm" in self.names[p] or "k_layernorm" in self.names[p]:
                    dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        if self.arch.moe and self.env.tp > 1:
            # Without sequence parallelism every tensor-parallel rank holds all T tokens, and the allgather
            # dispatcher hands each expert the tokens of all tp ranks: tp copies of each, whose gradients add up.
            for p in self.params:
                if ".experts." in self.names[p]:
                    p.grad.div_(self.env.tp)
        if self.env.world_size > 1:
            # Experts: summed over the ranks holding the same experts (expert data parallel), not over all
            # data-parallel ranks, some of which hold other experts (expert parallel).
            dense, experts = ps.get_data_parallel_group(), ps.get_expert_data_parallel_group() if self.arch.moe else None
            for p in self.params:
                group = experts if self._is_expert(p) else dense
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(p.grad, group=group)
        if self.arch.tied and self.env.pp > 1 and (self.first or self.last):
            shared = self.model.shared_embedding_or_output_weight()
            dist.all_reduce(shared.grad, group=ps.get_embedding_group())

    def grad_norm(self) -> float:
        """The global gradient norm: every element of the whole model once."""
        from megatron.core import parallel_state as ps

        zero = torch.zeros((), dtype=torch.float64)
        dense, experts = zero.clone(), zero.clone()
        for p in self.params:
            if self._is_tied_copy(self.names[p]):
                continue
            sq = p.grad.detach().double().pow(2).sum().cpu()
            sq = sq if W.is_split(self.names[p]) else sq / self.env.tp  # a whole one is held by each of the tp ranks
            if self._is_expert(p):
                experts += sq
            else:
                dense += sq
        # Dense parameters: summed over tp x pp. Experts: over tp x ep x pp (each ep rank holds other experts).
        dense = dense.to(self.device)
        if self.env.tp * self.env.pp > 1:
            dist.all_reduce(dense, group=ps.get_model_parallel_group())
        total = dense
        if self.arch.moe:
            experts = experts.to(self.device)
            group = ps.get_expert_tensor_model_pipeline_parallel_group()
            if dist.get_world_size(group) > 1:
                dist.all_reduce(experts, group=group)
            total = dense + experts
        return float(total.sqrt())

    def _is_expert(self, p: torch.Tensor) -> bool:
        return ".experts." in self.names[p]

    def optimizer_step(self) -> dict[str, float]:
        """Sum gradients over data-parallel ranks, clip, step (unless the norm is not finite), zero them."""
        lr = self.lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._reduce_grads()
        norm = self.grad_norm()
        finite = norm == norm and norm != float("inf")
        max_norm = self.optim_cfg.max_grad_norm
        if finite and max_norm is not None:
            coef = min(max_norm / (norm + 1e-6), 1.0)  # torch.nn.utils.clip_grad_norm_'s factor
            for p in self.params:
                p.grad.mul_(coef)
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        return {"optim/grad_norm": norm, "optim/lr": lr, "optim/skipped": 0.0 if finite else 1.0}

    # -- state -----------------------------------------------------------------------------------

    def _layout(self) -> dict[str, str]:
        e = self.env
        return {"tp": str(e.tp), "pp": str(e.pp), "ep": str(e.ep), "tp_rank": str(self.tp_rank),
                "pp_rank": str(self.pp_rank), "ep_rank": str(self.ep_rank), "dp_rank": str(e.rank)}

    def save_state(self, folder: Path, *, weights: bool = True) -> None:
        """Every rank's weights and AdamW state, each in its own file (collective only through the caller's barriers).
        The weights always: its export is gathered across the parallel layout (``exports_held_weights`` False)."""
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {MODEL_KEY + n: t.contiguous() for n, t in self.local_weights().items()}
        scalars: dict[str, dict[str, Any]] = {}
        for p, name in self.names.items():
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{OPTIM_KEY}{name}/{key}"] = value.detach().contiguous()
                else:
                    scalars.setdefault(name, {})[key] = value
        save_file(tensors, str(folder / _shard_file(self.env.global_rank)), metadata=self._layout())
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
                  for g in self.optimizer.param_groups]
        meta = {"param_groups": groups, "scalars": scalars}
        (folder / f"optimizer-{self.env.global_rank + 1:05d}.json").write_text(json.dumps(meta, indent=1))
        if self.env.is_main:
            (folder / OPTIM_META).write_text(json.dumps({"backend": "megatron", **self._layout()}, indent=1))

    def load_state(self, folder: Path, *, weights: bool = True) -> None:
        """This rank's file of a :meth:`save_state` folder, bit for bit; ValueError for another parallel layout."""
        path = folder / _shard_file(self.env.global_rank)
        if not path.is_file():
            raise ValueError(f"{folder} holds no {path.name}: it was not written by --backend megatron with this layout")
        with safe_open(str(path), framework="pt") as f:
            layout = f.metadata() or {}
        mine = self._layout()
        keys = ("tp", "pp", "ep", "tp_rank", "pp_rank", "ep_rank")
        if any(layout.get(k) != mine[k] for k in keys):
            raise ValueError(
                f"{folder} was written with --tp {layout.get('tp')} --pp {layout.get('pp')} --ep {layout.get('ep')}; "
                f"resume with the same layout (this run: --tp {mine['tp']} --pp {mine['pp']} --ep {mine['ep']})"
            )
        tensors = load_file(str(path))
        meta = json.loads((folder / f"optimizer-{self.env.global_rank + 1:05d}.json").read_text())
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(tensors[MODEL_KEY + name])
        for group, saved in zip(self.optimizer.param_groups, meta["param_groups"]):
            group.update({k: (tuple(v) if isinstance(group.get(k), tuple) else v) for k, v in saved.items()})
        for p, name in self.names.items():
            state = {k[len(f"{OPTIM_KEY}{name}/"):]: v for k, v in tensors.items() if k.startswith(f"{OPTIM_KEY}{name}/")}
            state.update(meta["scalars"].get(name, {}))
            if state:
                self.optimizer.state[p] = state

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        raise ValueError("format-1 checkpoints hold hf backend optimizer state; resume them with --backend hf")

    def _writes_piece(self) -> bool:
        """One rank per (pp, tp, ep) piece: data-parallel rank 0 (MoE: expert-data-parallel rank 0, whose
        expert-parallel ranks hold the other experts)."""
        from megatron.core import parallel_state as ps

        return ps.get_expert_data_parallel_rank() == 0 if self.arch.moe else self.env.rank == 0

    def export_model(self, folder: Path) -> None:
        """The Hugging Face model folder of the fp32 master weights (collective: rank 0 joins every piece)."""
        pieces = folder / PIECES_DIR
        if self.env.is_main:
            folder.mkdir(parents=True, exist_ok=True)
            if pieces.exists():
                shutil.rmtree(pieces)
            pieces.mkdir()
        self.env.barrier()
        if self._writes_piece():
            name = f"pp{self.pp_rank}-tp{self.tp_rank}-ep{self.ep_rank}.safetensors"
            save_file({n: t.contiguous() for n, t in self.local_weights().items()}, str(pieces / name))
        self.env.barrier()
        if self.env.is_main:
            e = self.env
            parts = {
                (s, r, x): load_file(str(pieces / f"pp{s}-tp{r}-ep{x}.safetensors"))
                for s in range(e.pp) for r in range(e.tp) for x in range(e.ep if self.arch.moe else 1)
            }
            ep = e.ep if self.arch.moe else 1
            hf = W.to_hf(parts, self.arch, tp=e.tp, pp=e.pp, ep=ep)
            save_file({k: v.contiguous() for k, v in hf.items()}, str(folder / SAFE_WEIGHTS), metadata={"format": "pt"})
            shutil.rmtree(pieces)
            for f in self.source.iterdir():
                if f.is_file() and not f.name.endswith(WEIGHT_FILE_SUFFIXES):
                    shutil.copy2(f, folder / f.name)
            cfg_path = folder / "config.json"
            cfg = json.loads(cfg_path.read_text())
            cfg["dtype"] = cfg["torch_dtype"] = "float32"  # the master weights written
            cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
