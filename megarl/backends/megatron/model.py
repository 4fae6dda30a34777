"""megatron-core GPT models from HF configs: layouts, building, HF weight loading and export.

    layout = Layout(tp=2, pp=2)
    layout.check(spec, world_size)                 # every problem at once, before allocating
    initialize(layout, seed=0)                      # megatron's process groups and RNG
    chunks = build_model(spec, layout)              # one GPTModel per virtual pipeline stage
    load_hf_weights(chunks, spec, "path/to/hf")     # this rank's shards, tensor by tensor
    for name, tensor in export_hf_tensors(chunks, spec): ...   # this stage's HF tensors, TP-gathered

The HF ⇄ megatron correspondence is `megarl.models.mapping`; this module only places
tensors. Layer names inside a chunk are local (`decoder.layers.0` is the chunk's first
layer); `layer_offset` turns them into global numbers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from megarl.models import ModelSpec, rope_inv_freq
from megarl.models.hf_files import tensor_files
from megarl.models.mapping import TensorRule, embedding_rule, experts_of_rank, for_expert, head_rules, \
    hf_from_shards, layer_rules, local_expert_name, shard_from_hf, te_name

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LayoutError(ValueError):
    """The parallel layout does not fit the model or the world size."""


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    vpp: int | None = None  # virtual pipeline stages per PP rank (interleaved schedule)
    sequence_parallel: bool = False
    ep: int = 1  # expert parallelism (mixture-of-experts models)
    etp: int | None = None  # expert tensor parallelism; None: as tp (megatron's default)

    def dp(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def check(self, spec: ModelSpec, world_size: int, training: bool = True) -> None:
        """Raise LayoutError listing every way this layout does not fit `spec` and the world
        (`training`: also the rules megatron applies to training only)."""
        p = []
        if min(self.tp, self.pp, self.cp) < 1 or (self.vpp is not None and self.vpp < 1):
            p.append(f"parallel sizes must be positive (tp={self.tp}, pp={self.pp}, cp={self.cp}, vpp={self.vpp})")
        else:
            if spec.num_heads % self.tp:
                p.append(f"{spec.num_heads} attention heads do not divide over tp={self.tp}")
            if spec.num_kv_heads % self.tp:
                p.append(f"{spec.num_kv_heads} key/value heads (query groups) do not divide over tp={self.tp}")
            stages = self.pp * (self.vpp or 1)
            if spec.num_layers % stages:
                p.append(f"{spec.num_layers} layers do not divide into pp={self.pp} x vpp={self.vpp or 1} stages")
            if self.vpp is not None and self.pp == 1:
                p.append("virtual pipeline stages (vpp) need pp > 1")
            if self.sequence_parallel and self.tp == 1:
                p.append("sequence parallelism needs tp > 1")
            if world_size % (self.tp * self.pp * self.cp):
                p.append(f"world size {world_size} is not a multiple of tp x pp x cp = {self.tp * self.pp * self.cp}")
            p += self._expert_problems(spec, world_size)
            if training and spec.is_moe and self.tp > 1 and not self.sequence_parallel:
                p.append("a mixture of experts with tp > 1 trains only with sequence_parallel=true (megatron's "
                         "MoE layer refuses otherwise; megatron's local layers, the CPU path, have no sequence "
                         "parallelism: there use ep, pp and data parallelism)")
        if p:
            raise LayoutError("parallel layout does not fit: " + "; ".join(p))


    def _expert_problems(self, spec: ModelSpec, world_size: int) -> list[str]:
        if self.ep < 1 or self.expert_tp < 1:
            return [f"expert parallel sizes must be positive (ep={self.ep}, etp={self.etp})"]
        if not spec.is_moe:
            return ["expert parallelism (ep > 1 or etp) needs a mixture-of-experts model"] \
                if self.ep > 1 or self.etp is not None else []
        p = []
        if spec.num_experts % self.ep:
            p.append(f"{spec.num_experts} experts do not divide over ep={self.ep}")
        if spec.moe_ffn_hidden_size % self.expert_tp:
            p.append(f"the experts' intermediate size {spec.moe_ffn_hidden_size} does not divide over "
                     f"expert tp={self.expert_tp}")
        # megatron lays the experts' ranks out as expert-TP x EP x expert-DP within each pipeline stage
        if world_size % (self.expert_tp * self.ep * self.pp):
            p.append(f"world size {world_size} is not a multiple of expert tp x ep x pp = "
                     f"{self.expert_tp * self.ep * self.pp}")
        return p


def rank_environment(tp: int, cp: int = 1) -> dict[str, str]:
    """Environment variables a megatron rank of this layout needs before CUDA starts in its
    process (the driver reads them when it creates the context). With TP > 1 or CP > 1:
    CUDA_DEVICE_MAX_CONNECTIONS=1, one hardware work queue, so kernels start in the order
    they are issued: megatron issues each tensor-parallel all-gather, reduce-scatter and
    all-reduce (sequence parallelism's among them; Transformer Engine its context-parallel
    exchanges) before the computation it is meant to overlap, and relies on that order
    (tensor_parallel/layers.py); Megatron-LM refuses to start TP or CP without it on GPUs before
    Blackwell. Set on Blackwell too, where it is no longer needed: asking for the
    architecture would start CUDA. Nothing for other layouts (DP, PP)."""
    return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if tp > 1 or cp > 1 else {}


def initialize(layout: Layout, seed: int = 0) -> None:
    """megatron's process groups (torch.distributed must be initialised) and its RNG tracker."""
    from megarl.backends.megatron.cpu import enable_cpu_mode, silence_known_warnings

    silence_known_warnings()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    enable_cpu_mode()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(layout.tp, layout.pp, layout.vpp, context_parallel_size=layout.cp,
                                             expert_model_parallel_size=layout.ep,
                                             expert_tensor_parallel_size=layout.etp)
    model_parallel_cuda_manual_seed(seed)


def fused_softmax_available() -> bool:
    """Whether the CUDA extensions behind megatron's fused softmax import here. megatron-core
    (fusions/fused_softmax.py) imports `scaled_masked_softmax_cuda` to pick the kernel and
    `scaled_upper_triang_masked_softmax_cuda` to run the causal one; neither ships with
    megatron-core: Apex (or Megatron-LM's fused_kernels) builds them."""
    try:
        import scaled_masked_softmax_cuda  # noqa: F401
        import scaled_upper_triang_masked_softmax_cuda  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def use_fused_softmax(*, cuda: bool, kernels: bool, explicit_mask: bool, cp: int) -> bool:
    """megatron's `masked_softmax_fusion` for the local layers' attention (Transformer Engine's
    attention has its own kernels and ignores it): only on a GPU where the kernels import
    (`kernels`: fused_softmax_available(); asked for without them, megatron's local attention
    raises ImportError in a bf16 / fp16 forward whose shapes suit the kernel), and only for the
    plain causal mask: with masks of megarl's own (`explicit_mask`: packed sequences; cp > 1:
    context parallelism) the causal kernel would ignore them."""
    return cuda and kernels and not explicit_mask and cp == 1


def transformer_config(spec: ModelSpec, layout: Layout, dtype: str = "float32", recompute: str | None = None,
                       fp8: dict | None = None, explicit_mask: bool = False, impl: str = "local",
                       aux_loss_coeff: float | None = None):
    """megatron's TransformerConfig for `spec`; `fp8` holds TransformerConfig's FP8 fields
    (fp8, fp8_recipe, fp8_param), passed through to Transformer Engine. `explicit_mask`:
    the local layers get attention masks of their own (packed sequences); see use_fused_softmax."""
    from megatron.core.transformer import TransformerConfig

    torch_dtype = DTYPES[dtype]
    cpu = not torch.cuda.is_available()
    fused_softmax = use_fused_softmax(cuda=not cpu, kernels=not cpu and fused_softmax_available(),
                                      explicit_mask=explicit_mask, cp=layout.cp)
    return TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads, num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim,
        normalization="RMSNorm", layernorm_epsilon=spec.norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp, context_parallel_size=layout.cp,
        sequence_parallel=layout.sequence_parallel, params_dtype=torch_dtype, pipeline_dtype=torch_dtype,
        bf16=torch_dtype == torch.bfloat16, fp16=torch_dtype == torch.float16,
        # perform_initialization: megatron marks weights as tensor-parallel only while initialising
        # them; without the marks the optimizer's grad norm would skip TP shards (weights are then
        # overwritten by load_hf_weights anyway)
        use_cpu_initialization=cpu, perform_initialization=True,
        bias_activation_fusion=not cpu, bias_dropout_fusion=not cpu, apply_rope_fusion=False,  # (torch-only fusions)
        # persist_layer_norm: only Apex's FusedLayerNorm has it; megarl's norms are RMSNorm, which megatron's
        # local spec builds as WrappedTorchNorm (which refuses the flag) and Transformer Engine's as TENorm
        masked_softmax_fusion=fused_softmax, persist_layer_norm=False, gradient_accumulation_fusion=False,
        recompute_granularity=recompute, recompute_method="uniform" if recompute == "full" else None,
        recompute_num_layers=1 if recompute == "full" else None, **(fp8 or {}),
        **moe_config(spec, layout, impl, aux_loss_coeff),
    )


def moe_config(spec: ModelSpec, layout: Layout, impl: str = "local", aux_loss_coeff: float | None = None) -> dict:
    """TransformerConfig's mixture-of-experts fields for `spec` (none for a dense model).
    Routing as HF's Qwen3-MoE: softmax over all experts, the top k, renormalised when
    norm_topk_prob (megatron: top k of the logits, then a softmax over them, which is the same)
    and left as they are otherwise (megatron's pre-softmax routing). The router runs in fp32.
    `aux_loss_coeff` (None: the HF config's) scales megatron's load-balancing loss."""
    if not spec.is_moe:
        return {}
    coeff = spec.router_aux_loss_coef if aux_loss_coeff is None else aux_loss_coeff
    return dict(
        num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_topk=spec.moe_topk, moe_router_pre_softmax=not spec.moe_norm_topk, moe_router_dtype="fp32",
        moe_layer_freq=[1 if spec.is_moe_layer(i) else 0 for i in range(spec.num_layers)],
        moe_router_load_balancing_type="aux_loss" if coeff > 0 else "none", moe_aux_loss_coeff=coeff,
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=impl == "transformer_engine",
        moe_permute_fusion=False, expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
    )


def layer_spec(spec: ModelSpec, impl: str = "local", cp: int = 1, config=None, vp_stage: int | None = None):
    """megatron's layer spec for `impl`; under context parallelism the local layers' core
    attention is megarl's all-gathering one (megatron's local attention has no CP path). A
    mixture of experts gets the block spec of this (virtual) stage's layers, experts or dense
    by layer (`config`: its TransformerConfig)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if impl not in ("local", "transformer_engine"):
        raise ValueError(f"transformer_impl {impl!r}: use local or transformer_engine")
    if spec.is_moe:
        block = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=impl == "transformer_engine",
                                                           normalization="RMSNorm", vp_stage=vp_stage)
        layers = block.layer_specs
    elif impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_norm)
    else:
        block = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=spec.qk_norm, normalization="RMSNorm")
        layers = [block]
    if cp > 1 and impl == "local":
        from megarl.backends.megatron.context import ContextParallelAttention

        for layer in layers:
            layer.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    return block


def build_model(spec: ModelSpec, layout: Layout, dtype: str = "float32", impl: str = "local",
                recompute: str | None = None, fp8: dict | None = None,
                explicit_mask: bool = False, aux_loss_coeff: float | None = None) -> list[torch.nn.Module]:
    """This rank's GPTModel chunks (one per virtual stage; one without vpp), weights
    uninitialised; `explicit_mask` and `aux_loss_coeff` as in `transformer_config`."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(spec, layout, dtype, recompute, fp8, explicit_mask, impl, aux_loss_coeff)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    chunks = []
    for vp in range(layout.vpp or 1):
        vp_stage = vp if layout.vpp else None
        model = GPTModel(
            config, layer_spec(spec, impl, layout.cp, config, vp_stage), vocab_size=spec.padded_vocab_size(layout.tp),
            max_sequence_length=spec.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=True, share_embeddings_and_output_weights=spec.tied_embeddings,
            position_embedding_type="rope", rotary_base=int(spec.rope_theta), vp_stage=vp_stage)
        if hasattr(model, "rotary_pos_emb"):  # HF's frequencies (llama3 scaling with its own parameters)
            model.rotary_pos_emb.inv_freq = rope_inv_freq(spec).to(model.rotary_pos_emb.inv_freq.device)
        chunks.append(model.to(device))
    return chunks


def layer_offset(model: torch.nn.Module) -> int:
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(model.config, model.vp_stage)


def chunk_rules(model: torch.nn.Module, spec: ModelSpec) -> list[tuple[str, TensorRule]]:
    """(this chunk's parameter name, rule) for every parameter the chunk holds: of a mixture of
    experts, the experts of this rank's expert-parallel rank only."""
    names = [n for n, _ in model.named_parameters()]
    te = any(n.endswith("layer_norm_weight") for n in names)
    grouped = any(".mlp.experts.linear_fc1.weight" in n for n in names)  # Transformer Engine's grouped GEMM
    mine = _my_experts(spec)
    out = []
    if model.pre_process:
        out.append(("embedding.word_embeddings.weight", embedding_rule()))
    offset = layer_offset(model)
    for local in range(len(model.decoder.layers)):
        moe_layer = spec.is_moe_layer(offset + local)
        for rule in layer_rules(spec, offset + local):
            if rule.expert is not None and rule.expert not in mine:
                continue
            name = rule.megatron.replace(f"decoder.layers.{offset + local}.", f"decoder.layers.{local}.", 1)
            if rule.expert is not None:
                name = local_expert_name(name, rule.expert - mine.start, grouped)
            out.append((te_name(name, moe_layer) if te else name, rule))
    if model.post_process:
        for rule in head_rules(spec):
            out.append((rule.megatron, rule))
        if spec.tied_embeddings and not model.pre_process:  # the last stage's copy of the shared table
            out.append(("output_layer.weight", embedding_rule()))
    return out


def _my_experts(spec: ModelSpec) -> range:
    from megatron.core import parallel_state

    if not spec.is_moe:
        return range(0)
    return experts_of_rank(spec, parallel_state.get_expert_model_parallel_rank(),
                           parallel_state.get_expert_model_parallel_world_size())


def _split_rank(rule: TensorRule) -> tuple[int, int]:
    """(rank, size) of the group that splits `rule`'s tensor: expert TP for an expert's, TP otherwise."""
    from megatron.core import parallel_state

    if rule.expert is not None:
        return (parallel_state.get_expert_tensor_parallel_rank(),
                parallel_state.get_expert_tensor_parallel_world_size())
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def load_hf_weights(chunks: list[torch.nn.Module], spec: ModelSpec, hf_dir: str | Path,
                    skip: tuple[str, ...] = ()) -> None:
    """Copy an HF safetensors checkpoint into this rank's shards, reading one tensor at a
    time (no process holds the whole model); raises KeyError naming missing tensors.
    Parameters named in `skip` (e.g. the critic's value head) keep their values."""
    from safetensors import safe_open

    where = safetensors_index(Path(hf_dir))
    with torch.no_grad():
        for model in chunks:
            params = dict(model.named_parameters())
            for name, rule in chunk_rules(model, spec):
                if name in skip:
                    continue
                missing = [n for n in rule.hf if n not in where]
                if missing:
                    raise KeyError(f"{hf_dir}: the checkpoint has no {missing} (needed for megatron {rule.megatron})")
                tensors = {}
                for n in rule.hf:
                    with safe_open(where[n], framework="pt") as f:
                        tensors[n] = f.get_tensor(n)
                shard = shard_from_hf(rule, tensors, spec, *_split_rank(rule))
                target = params[name]
                if target.shape != shard.shape:
                    raise ValueError(f"{name}: megatron expects {tuple(target.shape)}, the mapping gave "
                                     f"{tuple(shard.shape)}")
                # an FP8 parameter quantises it: with scales computed from `shard` under the
                # tensorwise and blockwise recipes (see keep_master_source for delayed)
                target.copy_(shard)
                keep_master_source(target, shard)


def keep_master_source(param: torch.Tensor, value: torch.Tensor) -> None:
    """Make `value` the source of `param`'s FP32 master weights. An FP8 parameter
    (fp8_param_gather) built by megatron inside Transformer Engine's fp8_model_init keeps a
    high-precision copy of its random initial value (get_high_precision_init_val, in host memory),
    and megatron's distributed optimizer builds the FP32 master weights from that copy when it is
    created (optimizer/distrib_optimizer.py): left alone, the first step writes the random
    initialisation back. Written here, with the optimizer built after the weights are loaded
    (the worker's order), the masters start from the loaded values at full precision.
    (Megatron-LM instead calls optimizer.reload_model_params() after loading, which
    dequantises the FP8 weights: masters rounded to FP8.) A parameter without the copy (no FP8,
    or already consumed by an optimizer) is left as it is.

    The FP8 weight itself is what `copy_` made of `value`. Under the tensorwise and blockwise
    recipes its scales are computed from `value`, as the optimizer's own re-quantisation of the
    masters (megatron's quantize_param_shard) computes them. Under delayed scaling both would
    cast with the scale the recipe holds, 1.0 until an FP8 forward pass has recorded an amax, so
    the weights until the first step (and a frozen reference's for good) would be cast badly:
    config validation refuses fp8_param_gather with the delayed recipe."""
    source = getattr(param, "get_high_precision_init_val", None)
    held = source() if source is not None else None
    if held is not None:
        held.copy_(value)


def free_master_sources(chunks: list[torch.nn.Module]) -> None:
    """Free the high-precision copies of the FP8 parameters' initial values (see
    keep_master_source) once nothing will build master weights from them: after the
    distributed optimizer is built (it frees only the copies of the parameters whose shard
    this DP rank updates), and right after loading a frozen model (the reference), which gets
    no optimizer and would otherwise hold a bf16 copy of its FP8 weights in host memory for the
    whole run. Parameters without a copy are left alone."""
    for chunk in chunks:
        for param in chunk.parameters():
            clear = getattr(param, "clear_high_precision_init_val", None)
            if clear is not None:
                clear()


def high_precision(param: torch.Tensor) -> torch.Tensor:
    """`param`'s values as a plain tensor of its nominal dtype. Transformer Engine's FP8
    parameters (fp8_param_gather: QuantizedTensor, TE >= 2.0) hold FP8 bytes and scales, and are
    dequantised; megatron's is_float8tensor recognises them (False wherever TE is absent). Not
    duck typing on `dequantize`: every torch tensor has that method, returning a float32 copy."""
    from megatron.core.fp8_utils import is_float8tensor

    if is_float8tensor(param):
        return param.dequantize().detach()
    return param.detach()


def export_hf_tensors(chunks: list[torch.nn.Module], spec: ModelSpec,
                      expert_gather_bytes: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """This pipeline stage's HF-named tensors, gathered across its TP group, and an expert's
    across its expert-TP and expert-parallel groups (every rank of those groups yields the same
    tensors). A layer's experts are gathered at most `expert_gather_bytes` at a time (None: a
    layer's at once). The tied output layer of a last stage is not exported (the first stage
    exports the shared table). A collective: all ranks of the TP and expert-parallel groups must iterate."""
    from megatron.core import parallel_state

    for model in chunks:
        params = dict(model.named_parameters())
        experts: dict[TensorRule, list[tuple[str, TensorRule]]] = {}  # a layer's experts of one tensor
        for name, rule in chunk_rules(model, spec):
            if name == "output_layer.weight" and spec.tied_embeddings:
                continue
            if rule.expert is None:
                group = parallel_state.get_tensor_model_parallel_group()
                yield from hf_from_shards(rule, _gather(high_precision(params[name]), rule, group), spec).items()
            else:
                experts.setdefault(for_expert(rule, 0), []).append((name, rule))
        for group in experts.values():
            yield from _export_experts(group, params, spec, expert_gather_bytes)


def experts_per_gather(expert_bytes: int, ep: int, local_experts: int, limit: int | None) -> int:
    """How many of its `local_experts` each of `ep` expert-parallel ranks puts into one gather,
    so that what the gather brings (that many whole experts of every rank, `expert_bytes` each)
    stays within `limit` bytes: at least one (an expert is not split), at most all."""
    if limit is None:
        return local_experts
    return max(1, min(local_experts, limit // (ep * expert_bytes)))


def _export_experts(group: list[tuple[str, TensorRule]], params: dict, spec: ModelSpec, limit: int | None):
    """HF tensors of one layer's experts of one kind (fc1 or fc2), chunk by chunk of this rank's
    local experts: each chunk stacked, then gathered in one collective over expert TP and one
    over EP (not one per expert: 18k for a Qwen3-30B-A3B sync), at most `limit` bytes at once
    (a layer's fc1 experts are 0.8 GB for Qwen3-30B-A3B, 3.2 GB for 235B-A22B in bf16; the
    expert-TP gather brings 1/EP of that again). Engines load by name, in any order."""
    from megatron.core import parallel_state

    first = group[0][1]
    split = parallel_state.get_expert_tensor_parallel_world_size() if first.tp_axis is not None else 1
    local = params[group[0][0]]  # its nominal dtype (an FP8 parameter's too): what high_precision gives
    ep = parallel_state.get_expert_model_parallel_world_size()
    per = experts_per_gather(local.numel() * local.dtype.itemsize * split, ep, len(group), limit)
    mine = _my_experts(spec)
    for start in range(0, len(group), per):
        part = group[start:start + per]
        stacked = torch.stack([high_precision(params[name]) for name, _ in part])
        shards = _gather(stacked, first, parallel_state.get_expert_tensor_parallel_group())
        # each expert-TP shard of the stack on every expert-parallel rank r: global experts r * per + local
        by_rank = [_all_gather(shard, parallel_state.get_expert_model_parallel_group()) for shard in shards]
        del stacked, shards  # freed before the yields (a suspended generator keeps its locals)
        for r in range(ep):
            for i, (_, rule) in enumerate(part):
                theirs = for_expert(rule, rule.expert - mine.start + r * len(mine))
                yield from hf_from_shards(theirs, [ranks[r][i] for ranks in by_rank], spec).items()


def _gather(local: torch.Tensor, rule: TensorRule, group) -> list[torch.Tensor]:
    """The shards of `rule`'s tensor over `group` (rank order); [local] when it is not split."""
    if rule.tp_axis is None or torch.distributed.get_world_size(group) == 1:
        return [local]
    return _all_gather(local.contiguous(), group)


def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    size = torch.distributed.get_world_size(group)
    if size == 1:
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(out, tensor.contiguous(), group=group)
    return out


def safetensors_index(hf_dir: Path) -> dict[str, Path]:
    """{HF tensor name: safetensors file}, each file checked (megarl.models.hf_files)."""
    return tensor_files(hf_dir, key="HF checkpoint")
