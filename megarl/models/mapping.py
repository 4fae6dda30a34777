"""HF ⇄ Megatron tensor mapping for the families of `megarl.models.spec`.

One table serves loading, export, checkpoint conversion and weight sync. Each megatron
parameter has a `TensorRule`: the HF tensors it is made of, how they are fused, and the
axis along which tensor parallelism splits it. Names use megatron-core's local layer spec
with global layer numbers (`decoder.layers.{i}.…`); `te_name` gives the Transformer Engine
spec's name, where the norms live inside the following linear layer.

Fused layouts (megatron-core's):
- linear_qkv: per query group g, [the group's query heads, its key head, its value head]
  stacked along the output rows; TP gives each rank a contiguous run of groups.
- linear_fc1: [gate; up] per TP rank, i.e. rank r holds cat(gate_r, up_r).
- embedding / output_layer: the vocabulary padded with zero rows to
  `spec.padded_vocab_size(tp)`, split by rows across ranks; padding never leaves.
- mixture-of-experts layers: `mlp.router.weight` (the HF `mlp.gate.weight`, whole on every
  rank) and, per expert e, linear_fc1 ([gate; up] per expert-TP rank) and linear_fc2 from the
  HF checkpoint's `mlp.experts.{e}.{gate,up,down}_proj.weight`. The table names expert e as
  megatron's sequential experts do with one expert-parallel rank
  (`mlp.experts.local_experts.{e}.…`); expert parallelism gives rank r the experts
  r * E / EP .. (r + 1) * E / EP - 1, which `local_expert_name` renames to the rank's own index,
  in the sequential layout or Transformer Engine's grouped one (`mlp.experts.linear_fc1.weight{k}`).
  Expert tensor parallelism splits them as TP splits the dense MLP.

`shard_from_hf` builds one rank's shard from HF tensors; `hf_from_shards` inverts it from
all ranks' shards. Both are exact (slicing and concatenation only).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from megarl.models.spec import ModelSpec

COPY, QKV, GLU = "copy", "qkv", "glu"


@dataclass(frozen=True)
class TensorRule:
    megatron: str
    hf: tuple[str, ...]
    kind: str = COPY
    tp_axis: int | None = None  # None: every TP rank holds the whole tensor
    vocab: bool = False  # rows are vocabulary entries (padded on the megatron side)
    expert: int | None = None  # the (global) expert this tensor belongs to; split by expert TP, not TP


def layer_rules(spec: ModelSpec, i: int) -> list[TensorRule]:
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    att, mlp = h + "self_attn.", h + "mlp."
    rules = [
        TensorRule(m + "input_layernorm.weight", (h + "input_layernorm.weight",)),
        TensorRule(m + "self_attention.linear_qkv.weight",
                   (att + "q_proj.weight", att + "k_proj.weight", att + "v_proj.weight"), QKV, 0),
    ]
    if spec.qkv_bias:
        rules.append(TensorRule(m + "self_attention.linear_qkv.bias",
                                (att + "q_proj.bias", att + "k_proj.bias", att + "v_proj.bias"), QKV, 0))
    if spec.qk_norm:
        rules += [TensorRule(m + "self_attention.q_layernorm.weight", (att + "q_norm.weight",)),
                  TensorRule(m + "self_attention.k_layernorm.weight", (att + "k_norm.weight",))]
    rules += [
        TensorRule(m + "self_attention.linear_proj.weight", (att + "o_proj.weight",), COPY, 1),
        TensorRule(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",)),
    ]
    if not spec.is_moe_layer(i):
        return rules + [
            TensorRule(m + "mlp.linear_fc1.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"), GLU, 0),
            TensorRule(m + "mlp.linear_fc2.weight", (mlp + "down_proj.weight",), COPY, 1),
        ]
    rules.append(TensorRule(m + "mlp.router.weight", (mlp + "gate.weight",)))
    for e in range(spec.num_experts):
        mine, hf = f"{m}mlp.experts.local_experts.{e}.", f"{mlp}experts.{e}."
        rules += [TensorRule(mine + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"), GLU, 0,
                             expert=e),
                  TensorRule(mine + "linear_fc2.weight", (hf + "down_proj.weight",), COPY, 1, expert=e)]
    return rules


def experts_of_rank(spec: ModelSpec, ep_rank: int, ep_size: int) -> range:
    """The global experts expert-parallel rank `ep_rank` holds (megatron: contiguous runs)."""
    per = spec.num_experts // ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


def for_expert(rule: TensorRule, expert: int) -> TensorRule:
    """An expert rule with its names moved to another expert of the same layer."""
    was, now = f"experts.{rule.expert}.", f"experts.{expert}."
    return replace(rule, megatron=rule.megatron.replace(f"local_{was}", f"local_{now}"),
                   hf=tuple(n.replace(was, now) for n in rule.hf), expert=expert)


def local_expert_name(name: str, local: int, grouped: bool = False) -> str:
    """An expert rule's megatron name (`…mlp.experts.local_experts.{e}.linear_fc1.weight`) as
    the rank holding the expert as its `local`-th names it: sequential experts
    (`…local_experts.{local}.linear_fc1.weight`), or Transformer Engine's grouped GEMM
    (`…mlp.experts.linear_fc1.weight{local}`)."""
    head, rest = name.split("mlp.experts.local_experts.", 1)
    _, tensor = rest.split(".", 1)
    if grouped:
        return f"{head}mlp.experts.{tensor}{local}"
    return f"{head}mlp.experts.local_experts.{local}.{tensor}"


def embedding_rule() -> TensorRule:
    return TensorRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), COPY, 0, vocab=True)


def head_rules(spec: ModelSpec) -> list[TensorRule]:
    """The final norm and, unless the embeddings are tied, the output layer."""
    rules = [TensorRule("decoder.final_layernorm.weight", ("model.norm.weight",))]
    if not spec.tied_embeddings:
        rules.append(TensorRule("output_layer.weight", ("lm_head.weight",), COPY, 0, vocab=True))
    return rules


def all_rules(spec: ModelSpec) -> list[TensorRule]:
    return [embedding_rule()] + [r for i in range(spec.num_layers) for r in layer_rules(spec, i)] + head_rules(spec)


def hf_names(spec: ModelSpec) -> list[str]:
    """Every tensor name of the HF checkpoint, in megatron order (tied: no lm_head)."""
    return [n for r in all_rules(spec) for n in r.hf]


_TE_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def te_name(name: str, moe_layer: bool = False) -> str:
    """The Transformer Engine layer spec's name for a local-spec parameter name. In a layer with
    experts the norm before them stays a module of its own (there is no linear_fc1 to fuse it into)."""
    for local, te in _TE_NAMES.items():
        if name.endswith(local) and ".layers." in name and not (moe_layer and local.startswith("pre_mlp")):
            return name[: -len(local)] + te
    return name


def shard_from_hf(rule: TensorRule, tensors: dict[str, torch.Tensor], spec: ModelSpec, tp_rank: int,
                  tp_size: int) -> torch.Tensor:
    """This TP rank's megatron tensor for `rule`, from the HF tensors it names."""
    parts = [tensors[n] for n in rule.hf]
    if rule.kind == QKV:
        return _qkv_shard(parts, spec, tp_rank, tp_size)
    if rule.kind == GLU:
        gate, up = (_split(t, 0, tp_rank, tp_size) for t in parts)
        return torch.cat([gate, up], dim=0)
    (tensor,) = parts
    if rule.vocab:
        tensor = _pad_rows(tensor, spec.padded_vocab_size(tp_size))
    return tensor if rule.tp_axis is None else _split(tensor, rule.tp_axis, tp_rank, tp_size)


def hf_from_shards(rule: TensorRule, shards: list[torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The HF tensors of `rule` from every TP rank's shard (in rank order)."""
    if rule.tp_axis is None:
        return {rule.hf[0]: shards[0]}
    if rule.kind == QKV:
        return dict(zip(rule.hf, _qkv_unfuse(torch.cat(shards, dim=0), spec), strict=True))
    if rule.kind == GLU:
        halves = [s.chunk(2, dim=0) for s in shards]
        return {rule.hf[0]: torch.cat([g for g, _ in halves]), rule.hf[1]: torch.cat([u for _, u in halves])}
    full = torch.cat(shards, dim=rule.tp_axis)
    return {rule.hf[0]: full[: spec.vocab_size] if rule.vocab else full}


def _split(t: torch.Tensor, axis: int, rank: int, size: int) -> torch.Tensor:
    if t.shape[axis] % size:
        raise ValueError(f"dimension {axis} of a {tuple(t.shape)} tensor does not split over {size} TP ranks")
    return t.chunk(size, dim=axis)[rank]


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))], dim=0)


def _qkv_shard(parts: list[torch.Tensor], spec: ModelSpec, rank: int, size: int) -> torch.Tensor:
    q, k, v = parts
    d, per = spec.head_dim, spec.heads_per_group
    groups = spec.num_kv_heads // size
    rest = q.shape[1:]
    q = q.reshape(spec.num_kv_heads, per * d, *rest)
    k = k.reshape(spec.num_kv_heads, d, *rest)
    v = v.reshape(spec.num_kv_heads, d, *rest)
    mine = slice(rank * groups, (rank + 1) * groups)
    return torch.cat([q[mine], k[mine], v[mine]], dim=1).reshape(-1, *rest)


def _qkv_unfuse(fused: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, per = spec.head_dim, spec.heads_per_group
    rest = fused.shape[1:]
    grouped = fused.reshape(spec.num_kv_heads, (per + 2) * d, *rest)
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)
