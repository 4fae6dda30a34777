"""ckpt_convert command lines: what they write and how they fail on bad input."""

from __future__ import annotations

import json

import pytest
import torch

from ckpt_convert.hf_to_megatron import main as hf_to_megatron
from ckpt_convert.megatron_to_hf import main as megatron_to_hf
from megarl.backends.torch.logprobs import token_log_probs
from megatron_cases import logprobs_from_dist, save_initial
from megatron_dist import run_distributed
from test_megatron_numerics import a_batch
from tiny_models import tiny_hf_model

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    model = tiny_hf_model("qwen2")
    model.save_pretrained(root / "hf")
    run_distributed(1, save_initial, str(root / "hf"), str(root / "step"))
    return root, model


def test_megatron_to_hf_writes_shards_an_index_and_the_config(checkpoint, tmp_path):
    root, model = checkpoint
    assert megatron_to_hf(["--ckpt", str(root / "step"), "--out", str(tmp_path / "out"), "--hf-config",
                           str(root / "hf"), "--max-shard-gb", str(60_000 / 2**30)]) == 0
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    # 60 kB shards: the largest tensors (300 x 64 embeddings, 96 x 64 MLP weights) are 76.8 and
    # 24.6 kB, so several files; every name of the HF model is there exactly once
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(index["weight_map"]) == sorted(model.state_dict())
    from safetensors.torch import load_file

    loaded = {n: t for f in files for n, t in load_file(str(tmp_path / "out" / f)).items()}
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded[name], tensor), name
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in loaded.values())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"


def test_megatron_to_hf_says_what_is_wrong(checkpoint, tmp_path, capsys):
    root, _ = checkpoint
    assert megatron_to_hf(["--ckpt", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "not a megatron distributed checkpoint (no metadata.json)" in capsys.readouterr().err
    assert megatron_to_hf(["--ckpt", str(root / "step"), "--out", str(tmp_path / "o")]) == 2
    assert "pass --hf-config HF_DIR" in capsys.readouterr().err
    other = tiny_hf_model("qwen2", hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    other.save_pretrained(tmp_path / "other")
    assert megatron_to_hf(["--ckpt", str(root / "step"), "--out", str(tmp_path / "o"), "--hf-config",
                           str(tmp_path / "other")]) == 2
    assert "does not hold the model of" in capsys.readouterr().err


@pytest.mark.parametrize("family, tied, tp, load_layout", [
    ("qwen2", False, 2, dict(tp=2, pp=2)), ("qwen3", True, 1, dict(tp=2)), ("llama", True, 2, dict(pp=2, vpp=2))])
def test_hf_to_megatron_loads_in_any_layout_and_round_trips_exactly(tmp_path, family, tied, tp, load_layout):
    from transformers import AutoModelForCausalLM

    model = tiny_hf_model(family, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")  # several HF files with an index
    assert hf_to_megatron(["--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "dist"), "--tp", str(tp)]) == 0
    assert json.loads((tmp_path / "dist" / "conversion.json").read_text())["tp"] == tp

    batch = a_batch(model.config.vocab_size)
    with torch.no_grad():
        want, _ = token_log_probs(model, batch.input_ids, batch.attention_mask)
    world = load_layout.get("tp", 1) * load_layout.get("pp", 1)
    got = run_distributed(world, logprobs_from_dist, str(tmp_path / "hf"), load_layout, str(tmp_path / "dist"), batch)[0]
    real = batch.attention_mask.bool().clone()
    real[:, 0] = False
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-5)

    assert megatron_to_hf(["--ckpt", str(tmp_path / "dist"), "--out", str(tmp_path / "back")]) == 0  # hf_config/ inside
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(back[name], tensor), name


def test_hf_to_megatron_says_what_is_wrong(tmp_path, capsys):
    model = tiny_hf_model("qwen2")
    model.save_pretrained(tmp_path / "hf")
    assert hf_to_megatron(["--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "o"), "--tp", "4"]) == 2
    assert "2 key/value heads (query groups) do not divide over tp=4" in capsys.readouterr().err
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "gemma").mkdir()
    (tmp_path / "gemma" / "config.json").write_text(json.dumps({**config, "model_type": "gemma2"}))
    assert hf_to_megatron(["--hf", str(tmp_path / "gemma"), "--out", str(tmp_path / "o")]) == 2
    assert "model_type 'gemma2' is not supported" in capsys.readouterr().err
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "x").write_text("")
    assert hf_to_megatron(["--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "o")]) == 2
    assert "is not empty" in capsys.readouterr().err
