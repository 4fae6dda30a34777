"""Fault injection on checkpoints, through the paths a user runs (issue 17): a damaged newest
checkpoint on resume, every checkpoint damaged, a truncated file of an older checkpoint, and a
crafted distributed checkpoint whose pickles would run a command. Each case is bounded in time;
a crafted payload would create a marker file, which must not exist afterwards."""

from __future__ import annotations

import json
import logging
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megarl.backends.megatron.dist_format import check_dist_checkpoint, read_dist_metadata
from megarl.checkpoint import CheckpointError, list_checkpoints, save_atomically, verify
from megarl.cli import main
from megarl.config import load_config, save_config
from megarl.train import train
from train_fixtures import tiny_overrides, write_tiny_run_inputs


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_tiny_run_inputs(tmp_path_factory.mktemp("inputs"))


def truncate_to_half(path):
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)


@pytest.mark.timeout(300)
def test_a_damaged_newest_checkpoint_resumes_from_the_one_before(inputs, tmp_path, caplog, capsys):
    out = tmp_path / "run"
    train(load_config(None, tiny_overrides(inputs, out, steps=2)))
    step2 = out / "checkpoints" / "step_000002"
    written = load_file(str(step2 / "actor.safetensors"))
    truncate_to_half(step2 / "actor_optim.pt")
    with caplog.at_level(logging.INFO):
        train(load_config(None, tiny_overrides(inputs, out, steps=3)))
    assert f"{step2 / 'actor_optim.pt'} is damaged" in caplog.text
    assert f"megarl: resumed from {out / 'checkpoints' / 'step_000001'} (step 1)" in capsys.readouterr().err
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_000002", "step_000003"]
    verify(step2)  # written again, whole
    again = load_file(str(step2 / "actor.safetensors"))  # resume is exact: step 2 redone gives the same weights
    assert sorted(again) == sorted(written)
    for name in written:
        assert torch.equal(again[name], written[name]), name


@pytest.mark.timeout(120)
def test_every_checkpoint_damaged_stops_before_starting_and_names_the_files(inputs, tmp_path, capsys):
    out = tmp_path / "run"
    for step in (1, 2):
        save_atomically(out / "checkpoints", step, lambda d: (d / "actor.safetensors").write_bytes(b"w" * 400), {})
        truncate_to_half(out / "checkpoints" / f"step_{step:06d}" / "actor.safetensors")
    assert main(["train", *tiny_overrides(inputs, out, steps=3)]) == 1
    err = capsys.readouterr().err
    assert f"every checkpoint under {out / 'checkpoints'} is damaged" in err
    for step in (1, 2):
        assert f"{out / 'checkpoints' / f'step_{step:06d}' / 'actor.safetensors'} is damaged: 200 bytes where 400" in err
    assert "Traceback" not in err
    # a checkpoint named by trainer.resume is not replaced by another one: the error names its file
    named = out / "checkpoints" / "step_000001"
    assert main(["train", *tiny_overrides(inputs, out, steps=3), f"trainer.resume={named}"]) == 1
    assert f"{named / 'actor.safetensors'} is damaged" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_a_truncated_file_of_an_unrecorded_checkpoint_is_named_in_one_line(inputs, tmp_path):
    from megarl.backends.torch.worker import TorchTrainWorker
    from tiny_models import tiny_model

    cfg = load_config(None, tiny_overrides(inputs, tmp_path / "run"))
    worker = TorchTrainWorker(tiny_model("qwen2"), cfg, total_steps=2)
    for name in ("actor.safetensors", "actor_optim.pt", "rng.pt"):
        directory = tmp_path / name  # as an older megarl wrote it: no sizes or hashes to check first
        worker.save_checkpoint(directory)
        truncate_to_half(directory / name)
        with pytest.raises(CheckpointError, match="truncated or damaged") as error:
            worker.load_checkpoint(directory)
        assert str(error.value).startswith(f"{directory / name} could not be read")
        assert "\n" not in str(error.value)


@pytest.mark.timeout(120)
def test_a_full_disk_while_the_worker_saves_names_the_disk_and_keeps_the_last_checkpoint(inputs, tmp_path):
    from megarl.backends.torch.worker import TorchTrainWorker
    from test_checkpoint import small_disk
    from tiny_models import tiny_model

    worker = TorchTrainWorker(tiny_model("qwen2"), load_config(None, tiny_overrides(inputs, tmp_path)), total_steps=2)
    with small_disk(tmp_path / "small_disk", "640k") as mount:  # one checkpoint of the tiny model is 424 kB
        root = mount / "checkpoints"
        save_atomically(root, 1, worker.save_checkpoint, {})
        with pytest.raises(CheckpointError) as error:
            save_atomically(root, 2, worker.save_checkpoint, {})
        assert str(error.value).startswith(f"checkpoint step 2 was not saved: the disk holding {root} is full "
                                           f"(the filesystem mounted at {mount}: ")
        assert [p.name for p in root.iterdir()] == ["step_000001"]
        verify(root / "step_000001")
        worker.load_checkpoint(root / "step_000001")


# -- a crafted distributed checkpoint ------------------------------------------------------------

class RunsACommand:
    """Unpickling it runs `touch MARKER` (what a crafted .metadata would do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class EvalsCode(RunsACommand):
    def __reduce__(self):
        return eval, (f"open({self.marker!r}, 'w').close()",)


def nested_in_metadata(marker):
    """A real DCP Metadata whose storage info carries the payload: refused mid-stream too."""
    from torch.distributed.checkpoint.metadata import Metadata

    return Metadata(state_dict_metadata={}, storage_data={"w": RunsACommand(marker)})


CRAFTED = {"os.system": RunsACommand, "builtins.eval": EvalsCode, "inside Metadata": nested_in_metadata}


def crafted_dist_checkpoint(directory, payload) -> bytes:
    directory.mkdir(parents=True)
    (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    data = pickle.dumps(payload)
    (directory / ".metadata").write_bytes(data)
    return data


@pytest.mark.megatron
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", CRAFTED)
def test_a_crafted_metadata_is_refused_without_running_it(tmp_path, kind, capsys):
    from ckpt_convert.megatron_to_hf import main as megatron_to_hf

    live = tmp_path / "live"  # the same payload does run under a plain unpickler: the test is real
    pickle.loads(pickle.dumps(CRAFTED[kind](live)))
    assert live.exists()

    marker = tmp_path / "ran"
    dist = tmp_path / "dist"
    crafted_dist_checkpoint(dist, CRAFTED[kind](marker))
    for read in (read_dist_metadata, check_dist_checkpoint):  # conversion and export; megatron's resume
        with pytest.raises(CheckpointError, match="refused") as error:
            read(dist)
        assert str(error.value).startswith(f"{dist / '.metadata'} refused: it asks to load ")
    assert megatron_to_hf(["--ckpt", str(dist), "--out", str(tmp_path / "hf")]) == 2
    assert f"{dist / '.metadata'} refused" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
    assert not marker.exists()


@pytest.mark.megatron
@pytest.mark.timeout(120)
def test_megarl_export_refuses_a_crafted_megatron_checkpoint(inputs, tmp_path, capsys):
    run, marker = tmp_path / "run", tmp_path / "ran"
    save_config(load_config(None, tiny_overrides(inputs, run)), run / "config.yaml")

    def write(directory):
        (directory / "megatron_trainer.json").write_text(json.dumps({"actor": {"steps": 1}}))
        crafted_dist_checkpoint(directory / "actor", RunsACommand(marker))

    save_atomically(run / "checkpoints", 1, write, {})  # recorded as written: only the allow-list stops it
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert f"{run / 'checkpoints' / 'step_000001' / 'actor' / '.metadata'} refused" in err
    assert not marker.exists()


@pytest.mark.megatron
@pytest.mark.timeout(60)
def test_a_real_dcp_checkpoint_passes_and_a_crafted_stored_object_is_refused(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, load, save

    def dcp(directory, obj):  # a non-tensor value is stored torch.save'd, as megatron stores its objects
        save({"w": torch.arange(6.0).reshape(2, 3), "extra": obj}, storage_writer=FileSystemWriter(str(directory)),
             no_dist=True)

    dcp(tmp_path / "good", [None])  # what megatron stores as a layer's extra state
    check_dist_checkpoint(tmp_path / "good")  # torch's own .metadata needs nothing off the list
    assert sorted(read_dist_metadata(tmp_path / "good").state_dict_metadata) == ["extra", "w"]

    live = tmp_path / "live"  # DCP's own load runs such an object (torch.load with weights_only=False)
    dcp(tmp_path / "live_dcp", RunsACommand(live))
    load({"extra": None}, storage_reader=FileSystemReader(str(tmp_path / "live_dcp")), no_dist=True)
    assert live.exists()

    marker = tmp_path / "ran"
    dcp(tmp_path / "bad", RunsACommand(marker))
    with pytest.raises(CheckpointError, match="the stored object extra names more than tensors") as error:
        check_dist_checkpoint(tmp_path / "bad")
    assert str(error.value).startswith(str(tmp_path / "bad"))
    assert not marker.exists()


def load_crafted_on_a_rank(hf_dir: str, ckpt_dir: str, marker: str) -> str:
    """On one megatron rank: save a worker's checkpoint, replace the actor's .metadata by a
    crafted one, and load it; returns the error's message."""
    from megatron_cases import worker

    w = worker(hf_dir, [])
    w.save_checkpoint(ckpt_dir)
    (Path(ckpt_dir) / "actor" / ".metadata").write_bytes(pickle.dumps(RunsACommand(marker)))
    try:
        w.load_checkpoint(ckpt_dir)
    except CheckpointError as e:
        return str(e)
    return "loaded"


@pytest.mark.megatron
@pytest.mark.timeout(300)
def test_megatron_resume_refuses_a_crafted_metadata(tmp_path):
    from megatron_dist import run_distributed
    from tiny_models import tiny_hf_model

    tiny_hf_model("qwen2").save_pretrained(tmp_path / "hf")
    marker = tmp_path / "ran"
    (message,) = run_distributed(1, load_crafted_on_a_rank, str(tmp_path / "hf"), str(tmp_path / "step"), str(marker))
    assert message.startswith(f"{tmp_path / 'step' / 'actor' / '.metadata'} refused: it asks to load posix.system")
    assert not marker.exists()

