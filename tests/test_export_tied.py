"""`megarl export` of a torch-backend checkpoint whose model ties its embedding and LM head:
safetensors' save_model keeps one name of the tied pair (lm_head.weight here), and the export
gives back the model with both."""

from __future__ import annotations

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_model
from transformers import AutoModelForCausalLM

from megarl import checkpoint
from megarl.export import export_checkpoint
from tiny_models import tiny_model, tiny_tokenizer


def test_a_tied_models_checkpoint_exports_whole(tmp_path):
    base = tiny_model("qwen2", vocab_size=len(tiny_tokenizer()), tie=True, seed=0)
    base.save_pretrained(tmp_path / "base")
    tiny_tokenizer().save_pretrained(tmp_path / "base")
    trained = tiny_model("qwen2", vocab_size=len(tiny_tokenizer()), tie=True, seed=1)  # other weights
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"path": str(tmp_path / "base")}}))
    checkpoint.save_atomically(run / "checkpoints", 1, lambda d: save_model(trained, str(d / "actor.safetensors")),
                               {"step": 1})
    kept = set(load_file(str(run / "checkpoints" / "step_000001" / "actor.safetensors")))
    assert len(kept & {"lm_head.weight", "model.embed_tokens.weight"}) == 1  # the tied pair, stored once

    exported = AutoModelForCausalLM.from_pretrained(export_checkpoint(run, tmp_path / "hf"))
    want = trained.state_dict()
    got = exported.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])


def test_a_directory_that_is_no_run_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"is not a run's directory \(no config.yaml in it\): give --run"):
        export_checkpoint(tmp_path / "my_run", tmp_path / "hf")
