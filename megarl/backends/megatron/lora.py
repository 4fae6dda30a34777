"""LoRA on the megatron backend: low-rank adapters on a frozen megatron-core GPT model, one per
HF linear layer (PEFT's names), sharded as the layer they adapt.

Each targeted HF module m of layer L gets A (r x in) and B (out x r); its megatron layer adds
(lora_alpha / r) B A x to its output. megatron fuses some HF modules, and the adapters stay
apart (PEFT's layout), their outputs placed where the fused output holds the module's part:

    q_proj, k_proj, v_proj  -> self_attention.linear_qkv  (column-parallel; per query group: its
                               query heads, its key head, its value head)
    o_proj                  -> self_attention.linear_proj (row-parallel)
    gate_proj, up_proj      -> mlp.linear_fc1             (column-parallel; a rank holds [gate; up])
    down_proj               -> mlp.linear_fc2             (row-parallel)

Under tensor parallelism a column-parallel layer's A is whole on every rank and its B split by
output rows; a row-parallel layer's A is split by input columns and its B whole. The forward:

    column:  h = A x   (x sequence-split under sequence parallelism: h all-gathered over the
                        sequence, its gradient reduce-scattered; else h's gradient all-reduced)
             out += scale B_local h
    row:     h = A_local x_local, summed over TP (reduce-scattered over the sequence under
             sequence parallelism);  out += scale B h

A whole parameter whose gradient is partial under sequence parallelism is marked
`sequence_parallel` (megatron's finalize_model_grads sums it over TP). A mixture of experts'
MLP gets no adapters (its experts are not adapted: a run names attention modules only). The adapters are modules of the layer's attention and MLP (`.lora`), so
megatron's sharded state dict names them by their global layer; their forward is a hook on the
linear layer, which keeps every base parameter's name. Transformer Engine's norm-fused column
layers are asked for their norm's output (`return_layernorm_output`), the adapters' input.

Main entry points: `add_adapters`, `adapters_off`, `merged_hf_tensors`, `adapter_hf_tensors`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from megarl.backends.lora_init import initial_a
from megarl.config_lora import SPLIT, LoraConfig, module_shape
from megarl.models import ModelSpec

# HF module -> (the layer's part, megatron's linear, how it is split)
PLACES = {name: (part, linear, SPLIT[name]) for name, part, linear in (
    ("q_proj", "self_attention", "linear_qkv"), ("k_proj", "self_attention", "linear_qkv"),
    ("v_proj", "self_attention", "linear_qkv"), ("o_proj", "self_attention", "linear_proj"),
    ("gate_proj", "mlp", "linear_fc1"), ("up_proj", "mlp", "linear_fc1"), ("down_proj", "mlp", "linear_fc2"))}
HF_PART = {"self_attention": "self_attn", "mlp": "mlp"}


def hf_module(layer: int, name: str) -> str:
    """`model.layers.{layer}.self_attn.q_proj` and the like: the HF module an adapter belongs to."""
    return f"model.layers.{layer}.{HF_PART[PLACES[name][0]]}.{name}"


class Adapter(torch.nn.Module):
    """A and B of one HF module on this rank (see the module docstring for which is split)."""

    def __init__(self, name: str, spec: ModelSpec, lora: LoraConfig, layer: int, tp: int, tp_rank: int,
                 dtype: torch.dtype, device, seed: int, sequence_parallel: bool):
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        super().__init__()
        self.name, self.split = name, PLACES[name][2]
        fan_in, fan_out = module_shape(spec, name)
        whole_a = initial_a(seed, layer, name, lora.r, fan_in)
        if self.split == "column":
            a, b_rows = whole_a, fan_out // tp
        else:
            a, b_rows = whole_a.chunk(tp, dim=1)[tp_rank], fan_out
        self.A = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
        self.B = torch.nn.Parameter(torch.zeros(b_rows, lora.r, device=device, dtype=dtype))
        split, whole = (self.B, self.A) if self.split == "column" else (self.A, self.B)
        set_tensor_model_parallel_attributes(split, tp > 1, 0 if self.split == "column" else 1, 1)
        set_tensor_model_parallel_attributes(whole, False, -1, 1)
        # its input is a sequence shard under sequence parallelism: each rank's gradient is a part
        whole.sequence_parallel = sequence_parallel
        self.scale, self.dropout = lora.scaling, lora.lora_dropout

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """A x (this rank's part of it for a row-parallel layer)."""
        if self.dropout and self.training:
            x = torch.nn.functional.dropout(x, self.dropout)
        return torch.matmul(x, self.A.t())


class LayerAdapters(torch.nn.Module):
    """The adapters of one layer's attention or MLP (`<part>.lora`), by HF module name."""

    def __init__(self, adapters: dict[str, Adapter]):
        super().__init__()
        self.by_name = torch.nn.ModuleDict(adapters)
        self.enabled = True

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """megatron's sharded tensors of A and B, each split along its tensor-parallel axis."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        axes = {f"by_name.{n}.{'B' if a.split == 'column' else 'A'}": 0 if a.split == "column" else 1
                for n, a in self.by_name.items()}
        return make_sharded_tensors_for_checkpoint(state, prefix, axes, sharded_offsets)


def _parallel():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


def _unpack(output, x: torch.Tensor):
    """(out, bias, the adapters' input) from what a megatron linear returned: (out, bias), or
    with Transformer Engine's norm output ((out, norm_out), bias) or (out, bias, norm_out)."""
    if len(output) == 3:
        return output
    out, bias = output
    if isinstance(out, tuple):
        return out[0], bias, out[1]
    return out, bias, x


class _Hook:
    """The forward hook of one megatron linear: its adapters' outputs added to its own."""

    def __init__(self, owner: LayerAdapters, names: list[str], linear: str, spec: ModelSpec, sequence_parallel: bool):
        self.owner, self.names, self.linear, self.spec, self.sp = owner, names, linear, spec, sequence_parallel

    def __call__(self, module, args, output):
        out, bias, x = _unpack(output, args[0])
        if not self.owner.enabled:
            return out, bias
        adapters = [self.owner.by_name[n] for n in self.names]
        if adapters[0].split == "row":
            return out + self._row(adapters[0], x), bias
        return out + self._column(adapters, x).to(out.dtype), bias

    def _row(self, adapter: Adapter, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        h = adapter.project(x)
        h = mappings.reduce_scatter_to_sequence_parallel_region(h) if self.sp \
            else mappings.reduce_from_tensor_model_parallel_region(h)
        return torch.matmul(h, adapter.B.t()) * adapter.scale

    def _column(self, adapters: list[Adapter], x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        parts = {}
        for adapter in adapters:
            h = adapter.project(x)
            h = mappings.gather_from_sequence_parallel_region(h) if self.sp \
                else mappings.copy_to_tensor_model_parallel_region(h)
            parts[adapter.name] = torch.matmul(h, adapter.B.t()) * adapter.scale
        lead = next(iter(parts.values())).shape[:-1]
        tp, _ = _parallel()
        s = self.spec
        if self.linear == "linear_fc1":  # a rank's [gate; up]
            f = s.ffn_hidden_size // tp
            return torch.cat([parts.get(n, x.new_zeros(*lead, f)) for n in ("gate_proj", "up_proj")], dim=-1)
        groups, d = s.num_kv_heads // tp, s.head_dim  # a rank's query groups: [its queries, key, value] each
        per_group = {"q_proj": s.num_heads // s.num_kv_heads * d, "k_proj": d, "v_proj": d}
        pieces = [parts[n].reshape(*lead, groups, w) if n in parts else x.new_zeros(*lead, groups, w)
                  for n, w in per_group.items()]
        return torch.cat(pieces, dim=-1).reshape(*lead, -1)


def add_adapters(chunks: list[torch.nn.Module], spec: ModelSpec, lora: LoraConfig, *, seed: int,
                 sequence_parallel: bool) -> dict[str, Adapter]:
    """Adapters on `chunks` (this rank's model chunks, built and loaded), every base parameter
    frozen; returns {HF module name: its Adapter} of this rank's layers."""
    from megarl.backends.megatron.model import layer_offset

    mlp = [n for n in lora.modules() if PLACES[n][0] == "mlp"]
    if spec.is_moe and mlp:
        raise ValueError(f"actor.lora.target_modules names {mlp}, but {spec.family} is a mixture of experts, whose "
                         "experts megarl does not adapt (PEFT would put these on them): name attention modules only, "
                         "e.g. [q_proj,k_proj,v_proj,o_proj]")
    tp, tp_rank = _parallel()
    found: dict[str, Adapter] = {}
    for chunk in chunks:
        chunk.requires_grad_(False)
        offset = layer_offset(chunk)
        for local, layer in enumerate(chunk.decoder.layers):
            number = offset + local
            for part_name in ("self_attention", "mlp"):
                names = [n for n in lora.modules() if PLACES[n][0] == part_name]
                if not names:
                    continue
                part = getattr(layer, part_name)
                weight = getattr(part, PLACES[names[0]][1]).weight
                adapters = {n: Adapter(n, spec, lora, number, tp, tp_rank, weight.dtype, weight.device, seed,
                                       sequence_parallel) for n in names}
                part.lora = LayerAdapters(adapters)
                for linear in dict.fromkeys(PLACES[n][1] for n in names):
                    module = getattr(part, linear)
                    if hasattr(module, "return_layernorm_output"):  # Transformer Engine's norm-fused layer
                        module.return_layernorm_output, module.return_layernorm_output_gathered = True, False
                    module.register_forward_hook(
                        _Hook(part.lora, [n for n in names if PLACES[n][1] == linear], linear, spec, sequence_parallel))
                found.update({hf_module(number, n): a for n, a in adapters.items()})
    return found


@contextmanager
def adapters_off(chunks: list[torch.nn.Module]) -> Iterator[None]:
    """Forwards within run the base alone (the KL reference)."""
    owners = [m for chunk in chunks for m in chunk.modules() if isinstance(m, LayerAdapters)]
    for owner in owners:
        owner.enabled = False
    try:
        yield
    finally:
        for owner in owners:
            owner.enabled = True


def _whole(adapter: Adapter) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) whole, gathered over TP (a collective of the TP group)."""
    from megarl.backends.megatron.model import _all_gather

    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    a, b = adapter.A.detach(), adapter.B.detach()
    if adapter.split == "column":
        return a, torch.cat(_all_gather(b.contiguous(), group), dim=0)
    return torch.cat(_all_gather(a.contiguous(), group), dim=1), b


def merged_hf_tensors(tensors: Iterator[tuple[str, torch.Tensor]],
                      adapters: dict[str, Adapter]) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors` (export_hf_tensors' HF tensors of this stage) with each adapted weight W as
    W + scale B A (summed in float32, in W's dtype). A collective of the TP group, as the export is."""
    for name, tensor in tensors:
        adapter = adapters.get(name.removesuffix(".weight"))
        if adapter is None:
            yield name, tensor
            continue
        a, b = _whole(adapter)
        yield name, (tensor.float() + adapter.scale * (b.float() @ a.float())).to(tensor.dtype)


def adapter_hf_tensors(adapters: dict[str, Adapter]) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's adapters, whole, under the names of PEFT's adapter_model.safetensors
    (`base_model.model.<module>.lora_A.weight`, `.lora_B.weight`). A collective of the TP group."""
    for module, adapter in adapters.items():
        a, b = _whole(adapter)
        yield f"base_model.model.{module}.lora_A.weight", a
        yield f"base_model.model.{module}.lora_B.weight", b


def load_adapter_tensors(adapters: dict[str, Adapter], tensors: dict[str, torch.Tensor]) -> None:
    """This rank's shards of PEFT-named whole adapters (`tensors` may hold other stages' too)."""
    tp, tp_rank = _parallel()
    with torch.no_grad():
        for module, adapter in adapters.items():
            a = tensors[f"base_model.model.{module}.lora_A.weight"]
            b = tensors[f"base_model.model.{module}.lora_B.weight"]
            if adapter.split == "column":
                b = b.chunk(tp, dim=0)[tp_rank]
            else:
                a = a.chunk(tp, dim=1)[tp_rank]
            adapter.A.copy_(a)
            adapter.B.copy_(b)
