"""An HF safetensors checkpoint -> a megatron distributed checkpoint.

    megarl convert hf-to-megatron --hf HF_DIR --out DIR [--tp N --pp M --ep E]

The HF config is checked against the families megarl maps (Qwen2 / Qwen2.5, Llama 3, Qwen3,
Qwen3-MoE) and the layout against the model before anything is written. Tensors stream one mapping
rule at a time (a layer's fused QKV is read, fused and written before the next is read), so
memory stays at a few times the largest tensor. A distributed checkpoint is layout-free:
megatron loads it at any TP / PP / EP / DP; --tp only sets the embedding's padding (a multiple
of 128 x TP, as megatron pads it) and, with --pp and --ep, the layout that is checked. The output holds the
weights (`metadata.json`, `.metadata`, `__0_0.distcp`, `common.pt`), `hf_config/` (the config and
tokenizer, for megarl convert megatron-to-hf) and `conversion.json`. Main entry point: `convert`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from megarl.models.hf_files import copy_config_and_tokenizer
from megarl.backends.megatron.dist_format import write_hf_as_dist
from megarl.models import ModelSpec
from megarl.models.mapping import all_rules

def convert(hf_dir: str | Path, out: str | Path, tp: int = 1, pp: int = 1, progress: bool = True,
            ep: int = 1) -> dict:
    import math

    from megarl.backends.megatron.model import Layout

    hf_dir, out = Path(hf_dir), Path(out)
    spec = ModelSpec.from_hf(hf_dir)
    Layout(tp=tp, pp=pp, ep=ep).check(spec, math.lcm(tp * pp, ep * tp * pp), training=False)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; give a new directory")
    start = time.perf_counter()
    with tqdm(desc="HF -> megatron", unit="B", unit_scale=True, disable=not progress) as bar:
        written = write_hf_as_dist(hf_dir, out, spec, tp=tp, progress=bar)
    seconds = time.perf_counter() - start
    copy_config_and_tokenizer(hf_dir, out / "hf_config")
    summary = {"source": str(hf_dir), "family": spec.family, "tp": tp, "pp": pp, "ep": ep,
               "tensors": len(all_rules(spec)), "bytes_written": written, "seconds": round(seconds, 3)}
    (out / "conversion.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    """`megarl convert hf-to-megatron` (megarl.convert_command)."""
    from megarl.convert_command import module_main

    return module_main("hf-to-megatron", argv)


if __name__ == "__main__":
    sys.exit(main())
