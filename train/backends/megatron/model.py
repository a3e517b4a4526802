"""A megatron-core ``GPTModel`` from a Hugging Face config, and the parallel state it runs in.

Architectures: Llama-style decoders (``llama``, ``qwen2``, ``qwen3``, ``qwen3_moe``): RMSNorm before
attention and MLP, SwiGLU, RoPE (default scaling only), grouped-query attention, Qwen2's q/k/v bias or Qwen3's per-head q/k RMSNorm, tied or untied embeddings; Qwen3-MoE's
softmax top-k router and experts as megatron-core's local MoE layer (``SequentialMLP``, one MLP per
expert; no grouped GEMM). Anything else (GPT-2's LayerNorm and learned positions, rope scaling,
sliding windows, MLP or output-projection biases, MoE layers interleaved with dense ones) is refused in one line, since
loading it would silently compute another function.

Layer spec: Transformer Engine's where it is installed, else megatron-core's local spec (torch norms,
plain matmuls), the one that runs on CPU; the core attention of both is this backend's per-sequence one
(:mod:`.attention`). Parameters are fp32 (master weights); compute is fp32 on
CPU and bf16 autocast on GPUs, as the hf backend.

Router: Qwen3-MoE takes softmax over all experts, then the top k, renormalized when
``norm_topk_prob``. megatron-core's softmax router with ``pre_softmax=False`` takes the top k logits and
a softmax over them: the same weights as softmax-then-renormalize, so ``norm_topk_prob`` maps to
``pre_softmax=False`` and its absence to ``pre_softmax=True``. No load-balancing loss (the trainer's
loss is the policy loss alone).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Arch:
    """What the weight mapping and the model need to know of a Hugging Face config."""

    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    eps: float
    rope_theta: float
    max_positions: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    experts: int = 0  # 0: dense MLP
    topk: int = 0
    moe_ffn: int = 0
    norm_topk: bool = False

    @property
    def moe(self) -> bool:
        return self.experts > 0


def arch_of(hf: Any) -> Arch:
    """The :class:`Arch` of a transformers config; ValueError (one line, with the fix) for one this backend
    cannot reproduce."""
    mt = getattr(hf, "model_type", "?")
    if mt not in SUPPORTED_TYPES:
        raise ValueError(
            f"--backend megatron builds Llama-style models ({', '.join(SUPPORTED_TYPES)}), not model type {mt!r}; "
            "use --backend hf for it"
        )
    rope = getattr(hf, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", None))
    rtype = rope.get("rope_type", "default")
    legacy = getattr(hf, "rope_scaling", None)
    problems = []
    if rtype != "default" or (legacy and legacy.get("rope_type", legacy.get("type")) not in (None, "default")):
        problems.append(f"rope scaling {rtype!r}")
    if getattr(hf, "hidden_act", "silu") != "silu":
        problems.append(f"activation {hf.hidden_act!r}")
    if getattr(hf, "use_sliding_window", False):
        problems.append("a sliding window")
    if getattr(hf, "mlp_bias", False):
        problems.append("MLP biases")
    if mt != "qwen2" and getattr(hf, "attention_bias", False):
        problems.append("attention biases (o_proj's among them)")
    experts = int(getattr(hf, "num_experts", 0) or 0) if mt == "qwen3_moe" else 0
    if experts and (getattr(hf, "decoder_sparse_step", 1) != 1 or getattr(hf, "mlp_only_layers", [])):
        problems.append("dense layers between the MoE ones (decoder_sparse_step, mlp_only_layers)")
    if problems:
        raise ValueError(
            f"--backend megatron does not reproduce {', '.join(problems)} of this {mt} config; use --backend hf"
        )
    heads = int(hf.num_attention_heads)
    return Arch(
        model_type=mt,
        layers=int(hf.num_hidden_layers),
        hidden=int(hf.hidden_size),
        heads=heads,
        kv_heads=int(getattr(hf, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(hf, "head_dim", None) or hf.hidden_size // heads),
        ffn=int(hf.intermediate_size),
        vocab=int(hf.vocab_size),
        eps=float(hf.rms_norm_eps),
        rope_theta=float(theta if theta is not None else 10000.0),
        max_positions=int(hf.max_position_embeddings),
        tied=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=mt == "qwen2",  # Qwen2's q/k/v biases (o_proj has none)
        qk_norm=mt in ("qwen3", "qwen3_moe"),
        experts=experts,
        topk=int(getattr(hf, "num_experts_per_tok", 0) or 0) if experts else 0,
        moe_ffn=int(getattr(hf, "moe_intermediate_size", 0) or 0) if experts else 0,
        norm_topk=bool(getattr(hf, "norm_topk_prob", False)) if experts else False,
    )


def check_layout(arch: Arch, *, tp: int, pp: int, ep: int) -> None:
    """ValueError (one line) when the model does not split into ``tp`` x ``pp`` (x ``ep``) pieces."""
    checks = [
        (arch.heads % tp == 0 and arch.kv_heads % tp == 0,
         f"--tp {tp} must divide the attention heads ({arch.heads}) and key/value heads ({arch.kv_heads})"),
        (arch.ffn % tp == 0 and arch.vocab % tp == 0,
         f"--tp {tp} must divide the MLP width ({arch.ffn}) and the vocabulary ({arch.vocab})"),
        (arch.layers % pp == 0, f"--pp {pp} must divide the {arch.layers} layers"),
        (ep == 1 or arch.moe, f"--ep {ep} needs a mixture-of-experts model; this {arch.model_type} is dense"),
        (not arch.moe or arch.experts % ep == 0, f"--ep {ep} must divide the {arch.experts} experts"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def transformer_config(arch: Arch, *, tp: int, pp: int, ep: int, bf16: bool):
    from megatron.core.transformer import TransformerConfig

    kw: dict[str, Any] = {}
    if arch.moe:
        kw = dict(
            num_moe_experts=arch.experts,
            moe_router_topk=arch.topk,
            moe_ffn_hidden_size=arch.moe_ffn,
            moe_router_pre_softmax=not arch.norm_topk,
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            moe_token_dispatcher_type="allgather",
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=tp,
        )
    return TransformerConfig(
        num_layers=arch.layers,
        hidden_size=arch.hidden,
        num_attention_heads=arch.heads,
        num_query_groups=arch.kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn,
        normalization="RMSNorm",
        layernorm_epsilon=arch.eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        bf16=bf16,
        use_cpu_initialization=True,
        perform_initialization=False,  # every weight comes from the Hugging Face checkpoint
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        # Fused kernels are CUDA-only (and change rounding); the plain ops are what the hf backend computes.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        **kw,
    )


def have_transformer_engine() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available()


def layer_spec(arch: Arch, config):
    """Transformer Engine's spec where it runs (a GPU with it installed), else the local one; either way with
    :class:`~rollshard.train.backends.megatron.attention.PackedSequenceAttention` as the core attention."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    from rollshard.train.backends.megatron.attention import PackedSequenceAttention

    moe = dict(num_experts=arch.experts or None, moe_grouped_gemm=False)
    if have_transformer_engine():
        spec = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm, **moe)
    else:
        spec = specs.get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm", **moe)
    spec.submodules.self_attention.submodules.core_attention = PackedSequenceAttention  # each packed sequence alone
    return spec


def build_model(arch: Arch, config, *, pre_process: bool, post_process: bool):
    """This pipeline stage's ``GPTModel`` (its layers only; the embedding on the first stage, the final norm and
    head on the last), parameters on the current device in fp32, uninitialized (the caller loads weights)."""
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(arch, config),
        vocab_size=arch.vocab,
        max_sequence_length=arch.max_positions,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,  # logits stay split by vocabulary (forward.vocab_parallel_logprobs)
        share_embeddings_and_output_weights=arch.tied,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        rotary_percent=1.0,
    )
    model.eval()  # dropout is 0 anyway; eval mirrors the hf backend (the engines have none)
    return model
