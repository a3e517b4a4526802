"""Hugging Face safetensors names and layout <-> megatron-core's, split by tensor-, pipeline- and expert-parallel rank.

Pure functions of state dicts (no process group): :func:`to_megatron` gives one rank's piece of a Hugging
Face checkpoint under the names of that rank's ``GPTModel``; :func:`to_hf` puts every rank's pieces back
together. The round trip is bit-exact (tests/train/test_megatron_weights.py), since it only slices and
concatenates.

Layout, per decoder layer (``H`` hidden, ``d`` head dim, ``g`` key/value heads, ``q = heads / g``):

* ``linear_qkv`` ``[g * (q + 2) * d, H]``: per key/value group its ``q`` query heads, then its key, then its
  value head (megatron's interleaving; the qkv bias likewise). Split by groups: rank ``r`` of ``tp`` holds
  groups ``[r g/tp, (r+1) g/tp)``, a contiguous block of rows.
* ``linear_fc1`` ``[2 F / tp, H]``: rank ``r``'s rows of gate then its rows of up (SwiGLU's fusion),
  so each rank's block is ``cat(gate_r, up_r)``, not a slice of ``cat(gate, up)``.
* ``linear_proj`` (o_proj) and ``linear_fc2`` (down_proj): split along the input dimension (row parallel).
* norms, q/k norms and the MoE router: whole on every rank.
* word embeddings and an untied output layer: split along the vocabulary.
* experts (Qwen3-MoE, ``SequentialMLP``): expert ``e`` is local expert ``e - ep_rank E/ep`` on its expert-parallel
  rank, its fc1/fc2 split by tensor rank as a dense MLP's.

Pipeline stages hold layers ``[s L/pp, (s+1) L/pp)`` numbered from 0 locally; the first stage holds the
embeddings, the last the final norm and the output layer (a tied one on the last stage too when it is not
the first: megatron keeps a copy there, equal to the embedding, which the export ignores).

Transformer Engine's spec fuses the pre-attention and pre-MLP norms into ``linear_qkv`` / ``linear_fc1``
(``...layer_norm_weight``): :func:`te_names` renames to and from it.
"""

from __future__ import annotations

import re

import torch

from rollshard.train.backends.megatron.model import Arch

Tensor = torch.Tensor
HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
MG_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Whole-tensor renames inside a layer (norms), Hugging Face -> megatron (local spec).
LAYER_NORMS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}
TE_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def is_split(name: str) -> bool:
    """Whether tensor-parallel ranks hold pieces of this megatron weight (else each holds it whole): all but the
    norms and the MoE router."""
    return not (name.endswith("layernorm.weight") or name.endswith("layer_norm_weight") or ".router." in name)


def te_names(sd: dict[str, Tensor], *, to_te: bool) -> dict[str, Tensor]:
    """Local-spec names <-> Transformer Engine spec names (the norms fused into the next linear)."""
    pairs = TE_NORMS if to_te else {v: k for k, v in TE_NORMS.items()}
    out = {}
    for name, t in sd.items():
        m = MG_LAYER.match(name)
        if m and m.group(2) in pairs:
            name = f"decoder.layers.{m.group(1)}.{pairs[m.group(2)]}"
        out[name] = t
    return out


def _qkv(q: Tensor, k: Tensor, v: Tensor, a: Arch) -> Tensor:
    """Megatron's fused, group-interleaved qkv of the whole layer (weight ``[*, H]`` or bias ``[*]``)."""
    g, per = a.kv_heads, a.heads // a.kv_heads
    tail = q.shape[1:]
    parts = (q.reshape(g, per * a.head_dim, *tail), k.reshape(g, a.head_dim, *tail), v.reshape(g, a.head_dim, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def _unqkv(qkv: Tensor, a: Arch) -> tuple[Tensor, Tensor, Tensor]:
    g, per, d = a.kv_heads, a.heads // a.kv_heads, a.head_dim
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, (per + 2) * d, *tail)
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _fc1(gate: Tensor, up: Tensor, r: int, tp: int) -> Tensor:
    return torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])


def _chunk(t: Tensor, r: int, n: int, dim: int = 0) -> Tensor:
    return t.chunk(n, dim=dim)[r].clone()


def to_megatron(
    hf: dict[str, Tensor], a: Arch, *, tp_rank: int = 0, tp: int = 1, pp_rank: int = 0, pp: int = 1,
    ep_rank: int = 0, ep: int = 1,
) -> dict[str, Tensor]:
    """The piece of the Hugging Face weights ``hf`` that rank (tp_rank, pp_rank, ep_rank) holds, under its names."""
    r = tp_rank
    per_stage = a.layers // pp
    first, last = pp_rank == 0, pp_rank == pp - 1
    out: dict[str, Tensor] = {}
    embed = hf["model.embed_tokens.weight"]
    if first:
        out["embedding.word_embeddings.weight"] = _chunk(embed, r, tp)
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not a.tied:
            out["output_layer.weight"] = _chunk(hf["lm_head.weight"], r, tp)
        elif not first:
            out["output_layer.weight"] = _chunk(embed, r, tp)  # megatron's copy of the tied embedding
    for local in range(per_stage):
        i = pp_rank * per_stage + local
        src, dst = f"model.layers.{i}.", f"decoder.layers.{local}."
        for h, m in LAYER_NORMS.items():
            if src + h in hf:
                out[dst + m] = hf[src + h].clone()
        att = src + "self_attn."
        qkv = _qkv(hf[att + "q_proj.weight"], hf[att + "k_proj.weight"], hf[att + "v_proj.weight"], a)
        out[dst + "self_attention.linear_qkv.weight"] = _chunk(qkv, r, tp)
        if a.qkv_bias:
            qkv_b = _qkv(hf[att + "q_proj.bias"], hf[att + "k_proj.bias"], hf[att + "v_proj.bias"], a)
            out[dst + "self_attention.linear_qkv.bias"] = _chunk(qkv_b, r, tp)
        out[dst + "self_attention.linear_proj.weight"] = _chunk(hf[att + "o_proj.weight"], r, tp, dim=1)
        mlp = src + "mlp."
        if not a.moe:
            out[dst + "mlp.linear_fc1.weight"] = _fc1(hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"], r, tp)
            out[dst + "mlp.linear_fc2.weight"] = _chunk(hf[mlp + "down_proj.weight"], r, tp, dim=1)
            continue
        out[dst + "mlp.router.weight"] = hf[mlp + "gate.weight"].clone()
        local_experts = a.experts // ep
        for j in range(local_experts):
            e = ep_rank * local_experts + j
            ex, mx = f"{mlp}experts.{e}.", f"{dst}mlp.experts.local_experts.{j}."
            out[mx + "linear_fc1.weight"] = _fc1(hf[ex + "gate_proj.weight"], hf[ex + "up_proj.weight"], r, tp)
            out[mx + "linear_fc2.weight"] = _chunk(hf[ex + "down_proj.weight"], r, tp, dim=1)
    return out


def to_hf(parts: dict[tuple[int, int, int], dict[str, Tensor]], a: Arch, *, tp: int, pp: int, ep: int) -> dict[str, Tensor]:
    """The whole Hugging Face weights from every rank's piece: ``parts[(pp_rank, tp_rank, ep_rank)]`` (megatron
    names, as :func:`to_megatron` gives them). A tied model gets no ``lm_head.weight`` (transformers ties it)."""
    per_stage = a.layers // pp

    def cat(pp_rank: int, name: str, dim: int = 0, ep_rank: int = 0) -> Tensor:
        return torch.cat([parts[(pp_rank, r, ep_rank)][name] for r in range(tp)], dim=dim)

    hf: dict[str, Tensor] = {"model.embed_tokens.weight": cat(0, "embedding.word_embeddings.weight")}
    hf["model.norm.weight"] = parts[(pp - 1, 0, 0)]["decoder.final_layernorm.weight"].clone()
    if not a.tied:
        hf["lm_head.weight"] = cat(pp - 1, "output_layer.weight")
    inverse = {m: h for h, m in LAYER_NORMS.items()}
    for s in range(pp):
        for local in range(per_stage):
            i = s * per_stage + local
            src, dst = f"decoder.layers.{local}.", f"model.layers.{i}."
            piece = parts[(s, 0, 0)]
            for m, h in inverse.items():
                if src + m in piece:
                    hf[dst + h] = piece[src + m].clone()
            q, k, v = _unqkv(cat(s, src + "self_attention.linear_qkv.weight"), a)
            hf.update({dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k, dst + "self_attn.v_proj.weight": v})
            if a.qkv_bias:
                q, k, v = _unqkv(cat(s, src + "self_attention.linear_qkv.bias"), a)
                hf.update({dst + "self_attn.q_proj.bias": q, dst + "self_attn.k_proj.bias": k, dst + "self_attn.v_proj.bias": v})
            hf[dst + "self_attn.o_proj.weight"] = cat(s, src + "self_attention.linear_proj.weight", dim=1)

            def unfc1(pieces: list[Tensor]) -> tuple[Tensor, Tensor]:
                halves = [p.chunk(2) for p in pieces]
                return torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])

            if not a.moe:
                gate, up = unfc1([parts[(s, r, 0)][src + "mlp.linear_fc1.weight"] for r in range(tp)])
                hf[dst + "mlp.gate_proj.weight"], hf[dst + "mlp.up_proj.weight"] = gate, up
                hf[dst + "mlp.down_proj.weight"] = cat(s, src + "mlp.linear_fc2.weight", dim=1)
                continue
            hf[dst + "mlp.gate.weight"] = piece[src + "mlp.router.weight"].clone()
            local_experts = a.experts // ep
            for e in range(a.experts):
                er, j = divmod(e, local_experts)
                mx, ex = f"{src}mlp.experts.local_experts.{j}.", f"{dst}mlp.experts.{e}."
                gate, up = unfc1([parts[(s, r, er)][mx + "linear_fc1.weight"] for r in range(tp)])
                hf[ex + "gate_proj.weight"], hf[ex + "up_proj.weight"] = gate, up
                hf[ex + "down_proj.weight"] = cat(s, mx + "linear_fc2.weight", dim=1, ep_rank=er)
    return hf
