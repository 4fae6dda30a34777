"""`megarl export` of a LoRA run (actor.lora): PEFT loads the exported adapter onto the base model
and gives the trainer's log-probs; the merged export gives them too."""

from __future__ import annotations

import json

import torch
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM

from megarl import checkpoint
from megarl.backends.batch import TrainBatch
from megarl.backends.torch.worker import TorchTrainWorker
from megarl.cli import main
from megarl.config import load_config
from test_backend_torch_worker import CFG
from tiny_models import reference_log_probs, tiny_model, tiny_tokenizer

LORA = {"r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj", "o_proj", "up_proj"]}
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [40, 41]]
RESPONSES = [[20, 21, 22, 23], [30, 31], [50, 51, 52, 53, 54, 55]]


def by_row(log_probs: torch.Tensor) -> list[torch.Tensor]:
    """The response tokens' log-probs of each row (rows start at column 0)."""
    return [log_probs[i, len(p):len(p) + len(r)] for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES))]


def test_the_exported_adapter_gives_the_trainers_log_probs(tmp_path):
    vocab = len(tiny_tokenizer())
    tiny_model("qwen2", vocab_size=vocab, seed=0).save_pretrained(tmp_path / "base")
    tiny_tokenizer().save_pretrained(tmp_path / "base")
    overrides = [f"model.path={tmp_path / 'base'}", "model.dtype=float32", f"actor.lora.r={LORA['r']}",
                 f"actor.lora.lora_alpha={LORA['lora_alpha']}",
                 f"actor.lora.target_modules=[{','.join(LORA['target_modules'])}]"]
    cfg = load_config(None, CFG + overrides)
    worker = TorchTrainWorker(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), cfg, total_steps=2)
    batch = TrainBatch.from_sequences(PROMPTS, RESPONSES, [[1] * len(r) for r in RESPONSES])
    g = torch.Generator().manual_seed(0)
    for _ in range(2):  # two steps: B moves off zero, then A and B both train
        old, _ = worker.compute_log_prob(batch)
        worker.update_actor(batch.with_fields(old_log_probs=old, advantages=torch.randn(old.shape, generator=g)))
    trainer = by_row(worker.compute_log_prob(batch)[0])

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"path": str(tmp_path / "base"), "dtype": "float32"},
                                                     "actor": {"lora": LORA}}))
    checkpoint.save_atomically(run / "checkpoints", 2, worker.save_checkpoint, {"step": 2})
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "hf")]) == 0

    adapter = tmp_path / "hf" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8.0, sorted(LORA["target_modules"]))
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), adapter).eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        torch.testing.assert_close(reference_log_probs(peft_model, p, r), trainer[i], atol=1e-5, rtol=0)
        torch.testing.assert_close(reference_log_probs(merged, p, r), trainer[i], atol=1e-5, rtol=0)
        assert not torch.allclose(reference_log_probs(plain, p, r), trainer[i], atol=1e-4)  # the adapters matter
    assert not any(name.startswith("base_model") or ".lora_" in name for name in merged.state_dict())
