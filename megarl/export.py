"""`megarl export`: a trainer checkpoint -> an HF model directory (safetensors, config, tokenizer).

Reads the run's resolved config (for the base model's architecture and tokenizer) and the
checkpoint's actor weights (the torch backend's safetensors, or the megatron backend's
distributed checkpoint in any layout), its files verified first (megarl.checkpoint.verify).
A LoRA run's checkpoint (actor.lora) holds the adapters alone: the export is the merged model,
and beside it PEFT's adapter directory (adapter_config.json, adapter_model.safetensors), which
`PeftModel.from_pretrained(base, directory)` loads onto model.path's weights.
Main entry point: `export_checkpoint`.
"""

from __future__ import annotations

from pathlib import Path

from megarl import checkpoint
from megarl.config import load_config


def export_checkpoint(run_dir: str | Path, out_dir: str | Path, step_dir: str | Path | None = None,
                      adapter_dir: str | Path | None = None) -> Path:
    """The checkpoint (`step_dir`, default the newest whole one) as an HF model in `out_dir`; for a
    LoRA run also PEFT's adapter directory in `adapter_dir` (default `out_dir`/adapter)."""
    import torch
    from safetensors.torch import load_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from megarl.models.hf_layout import checkpoint_views

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run's directory (no config.yaml in it): give --run the "
                                "trainer.output_dir of a run that has saved a checkpoint")
    cfg = load_config(run_dir / "config.yaml", [])
    if step_dir:
        source = Path(step_dir)
        checkpoint.verify(source)
    else:
        source = checkpoint.newest_intact(run_dir / "checkpoints")  # a damaged newer one skipped, with a warning
    if source is None:
        raise FileNotFoundError(f"no complete checkpoint under {run_dir / 'checkpoints'}")
    adapter_files = sorted(source.glob(ADAPTER_FILES))
    if adapter_files:
        out_dir = Path(out_dir)
        _export_lora(cfg, adapter_files, out_dir, Path(adapter_dir) if adapter_dir else out_dir / "adapter")
        AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path).save_pretrained(out_dir)
        return out_dir
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model.path))
    if (source / "megatron_trainer.json").exists():  # written by actor.backend=megatron, any layout
        from megarl.backends.megatron.dist_format import actor_checkpoint, read_hf_tensors
        from megarl.models import ModelSpec

        # checkpoint names (per expert in a mixture of experts): copied into the model's own layout
        state = dict(read_hf_tensors(actor_checkpoint(source), ModelSpec.from_hf(cfg.model.path)))
        views = checkpoint_views(model)
        missing, unexpected = [n for n in views if n not in state], [n for n in state if n not in views]
        if not missing and not unexpected:
            with torch.no_grad():
                for name, tensor in state.items():
                    views[name].copy_(tensor)
    else:  # the torch backend's: the model's own names
        # saved with safetensors' save_model, which keeps one name of tied weights (either one):
        # its load_model fills the others
        missing, unexpected = load_model(model, str(source / "actor.safetensors"), strict=False)
        missing, unexpected = list(missing), list(unexpected)
    if missing or unexpected:
        raise ValueError(f"{source} does not fit {cfg.model.path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path).save_pretrained(out_dir)
    return out_dir


# a LoRA run's adapters in a checkpoint, as PEFT names them: the torch backend's one file
# (actor_adapter.safetensors), the megatron backend's one a pipeline stage (actor_adapter-00001-of-00002...)
ADAPTER_FILES = "actor_adapter*.safetensors"


def _export_lora(cfg, adapter_files: list[Path], out_dir: Path, adapter_dir: Path) -> None:
    """The base (model.path's weights) with the checkpoint's adapters: PEFT's directory, then the merged model."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megarl.backends.torch.lora import load_adapter_state, merged_hf_tensors, with_adapters

    base = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=getattr(torch, cfg.model.dtype))
    model = with_adapters(base, cfg.actor.lora, seed=cfg.trainer.seed)
    state = {}
    for file in adapter_files:
        state.update(load_file(str(file)))
    load_adapter_state(model, state, ", ".join(str(f) for f in adapter_files))
    model.save_pretrained(adapter_dir)
    merged = dict(merged_hf_tensors(model))
    model.get_base_model().save_pretrained(out_dir, state_dict=merged, safe_serialization=True)
