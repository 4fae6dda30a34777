"""megarl.checkpoint: checkpoints written whole, their files recorded and verified, the newest
intact one found, a full disk named."""

import json
import logging
import os
import re
import shutil
import subprocess
import uuid
from contextlib import contextmanager

import pytest

from megarl.checkpoint import (CheckpointError, latest_checkpoint, list_checkpoints, newest_intact, prune, read_meta,
                               save_atomically, verify)


def write_file(name, text="x"):
    def write(directory):
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text)
    return write


def crc32_by_hand(data: bytes) -> str:
    """CRC-32 (IEEE 802.3) bit by bit: reflected polynomial 0xEDB88320, all-ones start and final xor."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0xEDB88320 if crc & 1 else 0)
    return f"{crc ^ 0xFFFFFFFF:08x}"


def test_crc32_by_hand_matches_the_standard_check_value():
    assert crc32_by_hand(b"123456789") == "cbf43926"  # the check value every CRC-32 catalogue lists


def test_save_find_and_prune(tmp_path):
    for step in (2, 10, 4):
        save_atomically(tmp_path, step, write_file("w.txt", str(step)), {"run_id": "abc"})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002", "step_000004", "step_000010"]
    newest = latest_checkpoint(tmp_path)
    assert newest.name == "step_000010" and (newest / "w.txt").read_text() == "10"
    assert read_meta(newest) == {"step": 10, "run_id": "abc",
                                 "files": {"w.txt": {"bytes": 2, "crc32": crc32_by_hand(b"10")}}}
    removed = prune(tmp_path, keep=2)
    assert [p.name for p in removed] == ["step_000002"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000004", "step_000010"]


def test_every_file_below_the_checkpoint_is_recorded(tmp_path):
    def write(directory):
        (directory / "actor").mkdir()
        (directory / "actor" / ".metadata").write_bytes(b"\x80\x04N.")
        (directory / "actor" / "__0_0.distcp").write_bytes(bytes(range(256)) * 3)

    step = save_atomically(tmp_path, 1, write, {})
    assert read_meta(step)["files"] == {
        "actor/.metadata": {"bytes": 4, "crc32": crc32_by_hand(b"\x80\x04N.")},
        "actor/__0_0.distcp": {"bytes": 768, "crc32": crc32_by_hand(bytes(range(256)) * 3)}}
    assert verify(step)["step"] == 1


def test_a_crash_while_saving_leaves_the_previous_checkpoint_newest(tmp_path):
    save_atomically(tmp_path, 1, write_file("w.txt"), {})

    def crash(directory):
        (directory / "half.bin").write_bytes(b"\0" * 10)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        save_atomically(tmp_path, 2, crash, {})
    assert latest_checkpoint(tmp_path).name == "step_000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]  # no leftovers


def test_incomplete_directories_are_not_checkpoints(tmp_path):
    (tmp_path / "step_000007").mkdir()  # e.g. copied by hand, without meta.json
    (tmp_path / ".tmp-step_000008-abc").mkdir()  # a killed process's leftover
    assert latest_checkpoint(tmp_path) is None
    assert newest_intact(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="not a complete"):
        read_meta(tmp_path / "step_000007")
    prune(tmp_path, keep=1)
    assert not (tmp_path / ".tmp-step_000008-abc").exists()


def test_saving_the_same_step_again_replaces_it(tmp_path):
    save_atomically(tmp_path, 3, write_file("a.txt"), {})
    save_atomically(tmp_path, 3, write_file("b.txt"), {})
    assert sorted(p.name for p in (tmp_path / "step_000003").iterdir()) == ["b.txt", "meta.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003"]


def truncate(path, size):
    with open(path, "r+b") as fh:
        fh.truncate(size)


def flip_byte(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


# (what is done to step 2's files, the words the error must hold besides the file's path)
DAMAGE = [
    ("truncated", lambda d: truncate(d / "actor" / "w.bin", 100), "100 bytes where 1000 were written (truncated)"),
    ("one byte changed", lambda d: flip_byte(d / "actor" / "w.bin", 500), "CRC32"),
    ("deleted", lambda d: (d / "actor" / "w.bin").unlink(), "is missing"),
    ("meta.json cut", lambda d: truncate(d / "meta.json", 20), "not valid JSON"),
]


@pytest.mark.parametrize("what, damage, words", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(tmp_path, caplog, what, damage, words):
    for step in (1, 2):
        save_atomically(tmp_path, step, write_file("actor/w.bin", "y" * 1000), {})
    damage(tmp_path / "step_000002")
    bad = "meta.json" if what == "meta.json cut" else "actor/w.bin"
    with pytest.raises(CheckpointError, match=words.replace("(", r"\(").replace(")", r"\)")) as error:
        verify(tmp_path / "step_000002")
    assert str(tmp_path / "step_000002" / bad) in str(error.value)
    with caplog.at_level(logging.WARNING, logger="megarl.checkpoint"):
        assert newest_intact(tmp_path) == tmp_path / "step_000001"
    assert str(tmp_path / "step_000002" / bad) in caplog.text and "damaged" in caplog.text


def test_every_checkpoint_damaged_is_an_error_naming_each_file(tmp_path):
    for step in (1, 2):
        save_atomically(tmp_path, step, write_file("actor_optim.pt", "z" * 64), {})
        truncate(tmp_path / f"step_{step:06d}" / "actor_optim.pt", 10)
    with pytest.raises(CheckpointError) as error:
        newest_intact(tmp_path)
    message = str(error.value)
    assert f"every checkpoint under {tmp_path} is damaged" in message
    for step in (1, 2):
        assert f"{tmp_path / f'step_{step:06d}' / 'actor_optim.pt'} is damaged: 10 bytes where 64" in message
    assert "trainer.resume=disable" in message


def test_verify_can_check_one_part_and_takes_older_checkpoints_as_they_are(tmp_path):
    def write(directory):
        write_file("actor/a.bin", "a" * 10)(directory)
        write_file("critic/c.bin", "c" * 10)(directory)

    step = save_atomically(tmp_path, 1, write, {})
    truncate(step / "critic" / "c.bin", 3)
    assert verify(step, under="actor")["step"] == 1  # what megatron_to_hf reads of it is whole
    with pytest.raises(CheckpointError, match="c.bin is damaged"):
        verify(step)
    old = tmp_path / "step_000000"  # written before megarl recorded files
    old.mkdir()
    (old / "meta.json").write_text(json.dumps({"step": 0}))
    assert verify(old) == {"step": 0}


@contextmanager
def small_disk(directory, size: str):
    """A tmpfs of `size` mounted at `directory` (root only: skips the test otherwise, with the reason)."""
    if os.geteuid() != 0:
        pytest.skip("a full disk is simulated by mounting a small tmpfs, which needs root")
    directory.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", f"megarl-test-{uuid.uuid4().hex[:8]}",
                             str(directory)], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield directory
    finally:  # lazily: the failed writer's file may still be open in a traceback pytest keeps
        subprocess.run(["umount", "--lazy", str(directory)], timeout=30, check=True)
        shutil.rmtree(directory)


def test_a_full_disk_names_the_disk_and_keeps_the_previous_checkpoint(tmp_path):
    with small_disk(tmp_path / "small_disk", "256k") as mount:
        root = mount / "checkpoints"
        save_atomically(root, 1, write_file("w.bin", "a" * 100_000), {})  # 100 kB of 256 kB

        def too_big(directory):  # 200 kB more than the disk holds: ENOSPC from write()
            (directory / "w.bin").write_bytes(b"b" * 200_000)

        def too_big_for_torch(directory):  # torch.save says only "unexpected pos ..." on a full disk
            import torch

            torch.save(torch.zeros(50_000), directory / "w.pt")

        for writer in (too_big, too_big_for_torch):
            with pytest.raises(CheckpointError) as error:
                save_atomically(root, 2, writer, {})
            message = str(error.value)
            assert f"the disk holding {root} is full (the filesystem mounted at {mount}" in message
            assert f"The newest checkpoint is still {root / 'step_000001'}" in message
            assert [p.name for p in root.iterdir()] == ["step_000001"]  # the partial one removed
            assert verify(root / "step_000001")["step"] == 1


def test_a_train_ranks_full_disk_reaches_the_driver_as_text_and_is_named(tmp_path):
    def rank_failed(directory):  # how a Ray rank's error arrives (megarl.runtime.ray_proxies): text only
        raise RuntimeError("train worker rank 1 of 2 failed (the other ranks are stopped):\n"
                           "OSError: [Errno 28] No space left on device: '__1_0.distcp'")

    with pytest.raises(CheckpointError, match=re.escape(f"step 1 was not saved: the disk holding {tmp_path} is full")):
        save_atomically(tmp_path, 1, rank_failed, {})
    assert list(tmp_path.iterdir()) == []

    def other_failure(directory):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="^a bug$"):  # not taken for a full disk
        save_atomically(tmp_path, 1, other_failure, {})


def test_checkpoints_are_ordered_by_step_past_six_digits(tmp_path):
    from megarl.checkpoint import META, checkpoint_dir, list_checkpoints, prune

    for step in (999_999, 1_000_000, 5):
        checkpoint_dir(tmp_path, step).mkdir()
        (checkpoint_dir(tmp_path, step) / META).write_text("{}")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000005", "step_999999", "step_1000000"]
    prune(tmp_path, keep=1)  # the newest is the one kept
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_1000000"]
    with pytest.raises(ValueError, match=r"^keep=0 must be >= 1$"):
        prune(tmp_path, keep=0)
