"""`megarl convert` (the ckpt_convert library's command line): what it writes and how it fails
on bad input. `python -m ckpt_convert.megatron_to_hf` is the same command
(tests/test_checkpoint_faults.py runs it that way)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from megarl.backends.torch.logprobs import token_log_probs
from megarl.cli import main
from megatron_cases import logprobs_from_dist, save_initial
from megatron_dist import run_distributed
from test_megatron_numerics import a_batch
from tiny_models import tiny_hf_model

pytestmark = pytest.mark.megatron  # megatron-core runs here: make test-compat runs these on its newest release too


def hf_to_megatron(argv: list[str]) -> int:
    return main(["convert", "hf-to-megatron", *argv])


def megatron_to_hf(argv: list[str]) -> int:
    return main(["convert", "megatron-to-hf", *argv])


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
    ("qwen2", False, 2, dict(tp=2, pp=2)), ("qwen3", True, 1, dict(tp=2)), ("llama", True, 2, dict(pp=2, vpp=2)),
    ("qwen3_moe", False, 1, dict(ep=2)), ("qwen3_moe", True, 2, dict(tp=2, ep=2, etp=1))])  # experts over 2 ranks
def test_hf_to_megatron_loads_in_any_layout_and_round_trips_exactly(tmp_path, family, tied, tp, load_layout):
    import math

    from transformers import AutoModelForCausalLM

    from megarl.models.hf_layout import checkpoint_views

    model = tiny_hf_model(family, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")  # several HF files with an index
    ep = ["--ep", str(load_layout["ep"])] if "ep" in load_layout else []
    assert hf_to_megatron(["--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "dist"), "--tp", str(tp), *ep]) == 0
    assert json.loads((tmp_path / "dist" / "conversion.json").read_text())["tp"] == tp

    batch = a_batch(model.config.vocab_size)
    with torch.no_grad():
        want, _ = token_log_probs(model, batch.input_ids, batch.attention_mask)
    model_parallel = load_layout.get("tp", 1) * load_layout.get("pp", 1)
    world = math.lcm(model_parallel, load_layout.get("ep", 1) * load_layout.get("pp", 1))
    got = run_distributed(world, logprobs_from_dist, str(tmp_path / "hf"), load_layout, str(tmp_path / "dist"), batch)[0]
    real = batch.attention_mask.bool().clone()
    real[:, 0] = False
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-5)

    assert megatron_to_hf(["--ckpt", str(tmp_path / "dist"), "--out", str(tmp_path / "back")]) == 0  # hf_config/ inside
    back = checkpoint_views(AutoModelForCausalLM.from_pretrained(tmp_path / "back"))
    for name, tensor in checkpoint_views(model).items():
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


def convert_fails(args, tmp_path, capsys) -> str:
    """megatron_to_hf exits 2 and leaves neither the output directory nor a temporary one."""
    assert megatron_to_hf(args + ["--out", str(tmp_path / "out")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.name == "out" or p.name.startswith(".tmp-")) == []
    return capsys.readouterr().err


def test_megatron_to_hf_names_a_truncated_distcp_and_leaves_no_output(checkpoint, tmp_path, capsys):
    root, _ = checkpoint
    step = tmp_path / "step"
    shutil.copytree(root / "step", step)
    distcp = step / "actor" / "__0_0.distcp"
    size = distcp.stat().st_size
    with open(distcp, "r+b") as fh:
        fh.truncate(size // 2)
    err = convert_fails(["--ckpt", str(step), "--hf-config", str(root / "hf")], tmp_path, capsys)
    assert err.startswith(f"megatron_to_hf: {distcp} is truncated: {size // 2} bytes, but "
                          f"{step / 'actor' / '.metadata'} places chunks up to byte ")
    assert len(err.splitlines()) == 1


def test_megatron_to_hf_fails_mid_way_on_a_damaged_chunk_and_leaves_no_output(checkpoint, tmp_path, capsys):
    from megarl.backends.megatron.dist_format import read_dist_metadata

    root, _ = checkpoint
    step = tmp_path / "step"
    shutil.copytree(root / "step", step)
    # the final norm is read last (after the layers): tiny shards were written before it fails
    (info,) = [i for x, i in read_dist_metadata(step / "actor").storage_data.items()
               if x.fqn == "decoder.final_layernorm.weight"]
    with open(step / "actor" / info.relative_path, "r+b") as fh:
        fh.seek(info.offset)
        fh.write(b"\0" * info.length)  # same length: only reading the chunk finds it
    err = convert_fails(["--ckpt", str(step), "--hf-config", str(root / "hf"), "--max-shard-gb", str(20_000 / 2**30)],
                        tmp_path, capsys)
    last = err.splitlines()[-1]  # after the progress bar
    assert last.startswith(f"megatron_to_hf: {step / 'actor' / info.relative_path} (the chunk of decoder."
                           f"final_layernorm.weight at byte {info.offset}) could not be read, it is truncated or "
                           "damaged (UnpicklingError: ")  # then torch's reason


def test_megatron_to_hf_checks_a_training_checkpoints_recorded_files(checkpoint, tmp_path, capsys):
    from megarl.checkpoint import save_atomically

    root, _ = checkpoint
    step = save_atomically(tmp_path / "checkpoints", 1, lambda d: shutil.copytree(root / "step", d, dirs_exist_ok=True),
                           {})
    # the largest shard file (megatron-core 0.16 writes two a rank, __0_0 and __0_1; 0.19 one)
    distcp = max((step / "actor").glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = bytearray(distcp.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte of tensor data: torch would read it without complaint
    distcp.write_bytes(bytes(data))
    err = convert_fails(["--ckpt", str(step), "--hf-config", str(root / "hf")], tmp_path, capsys)
    assert err.startswith(f"megatron_to_hf: {distcp} is damaged: its CRC32 is ")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("")
    assert megatron_to_hf(["--ckpt", str(root / "step"), "--out", str(tmp_path / "out")]) == 2
    assert "is not empty" in capsys.readouterr().err
