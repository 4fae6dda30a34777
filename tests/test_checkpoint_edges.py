"""megarl.checkpoint at its edges: what is fsynced and in which order, chunked hashing, a full
disk told by errno or by free space, cleanup that cannot fail a save, and each message's words."""

import errno
import logging
import os
import pickle
import stat
import subprocess
import threading
import types
import uuid
import warnings
import zlib
from collections import namedtuple
from contextlib import contextmanager
from pathlib import Path

import pytest

from megarl import checkpoint
from megarl.checkpoint import CheckpointError, newest_intact, prune, read_meta, save_atomically, unreadable, verify
from test_checkpoint import crc32_by_hand, truncate, write_file

Usage = namedtuple("Usage", "total used free")


@pytest.fixture
def fsynced(monkeypatch):
    """The paths os.fsync was called on, in order (each call still made)."""
    seen, real = [], os.fsync

    def record(fd):
        seen.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return seen


@contextmanager
def undeletable(directory: Path):
    """A real obstacle to removing `directory`: a tmpfs mounted inside it (EBUSY) as root, a
    read-only subdirectory with a file in it (EACCES) otherwise."""
    inner = directory / "obstacle"
    inner.mkdir(parents=True)
    if os.geteuid() == 0:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", f"megarl-test-{uuid.uuid4().hex[:8]}", str(inner)],
                       check=True, capture_output=True, timeout=30)
    else:
        (inner / "f").write_text("x")
        inner.chmod(stat.S_IRUSR | stat.S_IXUSR)
    yield inner


def release(root: Path):
    """Undo every `undeletable` under root."""
    for inner in root.rglob("obstacle"):
        if os.geteuid() == 0:
            subprocess.run(["umount", "--lazy", str(inner)], capture_output=True, timeout=30)
        else:
            inner.chmod(stat.S_IRWXU)


def mount_point_of(path: Path) -> Path:
    """The longest mount point above `path`, read from /proc/self/mounts (not os.path.ismount)."""
    points = [Path(line.split()[1].replace("\\040", " ")) for line in Path("/proc/self/mounts").read_text().splitlines()]
    path = path.resolve()
    return max((p for p in points if path == p or p in path.parents), key=lambda p: len(p.parts))


def test_every_file_and_directory_is_fsynced_deepest_first_and_the_root_last(tmp_path, fsynced):
    def write(directory):
        (directory / "a" / "b").mkdir(parents=True)
        (directory / "a" / "b" / "w.bin").write_bytes(b"1")
        (directory / "top.bin").write_bytes(b"2")

    root = tmp_path / "ckpt"
    final = save_atomically(root, 4, write, {})
    tmp = fsynced[2].parent  # tmp/meta.json, after the files (hashed in parallel, in any order)
    assert tmp.parent == root and tmp.name.startswith(".tmp-step_000004-")
    named = [p.relative_to(tmp).as_posix() if p.is_relative_to(tmp) else p for p in fsynced]
    assert sorted(named[:2]) == ["a/b/w.bin", "top.bin"] and named[2:] == ["meta.json", "a/b", "a", ".", root]
    assert sorted(p.name for p in root.iterdir()) == ["step_000004"] and final == root / "step_000004"


def test_the_temporary_directory_is_named_for_its_step_beside_the_checkpoints(tmp_path):
    seen = []
    save_atomically(tmp_path, 12, lambda d: seen.append(d), {})
    assert seen[0].parent == tmp_path and seen[0].name.startswith(".tmp-step_000012-")


def test_meta_json_is_written_indented_by_two(tmp_path):
    step = save_atomically(tmp_path, 3, write_file("w.txt", "ab"), {"run_id": "r"})
    crc = crc32_by_hand(b"ab")
    assert (step / "meta.json").read_text() == ('{\n  "step": 3,\n  "run_id": "r",\n  "files": {\n    "w.txt": {\n'
                                                f'      "bytes": 2,\n      "crc32": "{crc}"\n    }}\n  }}\n}}')


def test_verify_reads_without_fsyncing(tmp_path, fsynced):
    step = save_atomically(tmp_path, 1, write_file("w.txt"), {})
    fsynced.clear()
    assert verify(step)["step"] == 1
    assert fsynced == []  # a checkpoint on a read-only snapshot is verified as well


def test_a_file_longer_than_one_read_is_hashed_whole(tmp_path):
    data = bytes(range(251)) * (((8 << 20) + 1000) // 251)  # over one 8 MiB read, not a multiple of it
    step = save_atomically(tmp_path, 1, lambda d: (d / "big.bin").write_bytes(data), {})
    assert read_meta(step)["files"]["big.bin"] == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}


def test_hashing_raises_no_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. line buffering asked of a binary file
        step = save_atomically(tmp_path, 1, write_file("w.txt"), {})
        verify(step)


def test_eight_named_threads_hash_files_at_once(tmp_path, monkeypatch):
    names = [f"f{i:02d}.bin" for i in range(16)]
    step = save_atomically(tmp_path, 1, lambda d: [(d / n).write_bytes(n.encode()) for n in names], {})
    barrier, lock, active, seen = threading.Barrier(8, timeout=20), threading.Lock(), [0, 0], set()

    def crc32(data, value=0):
        with lock:
            active[0] += 1
            active[1] = max(active)
            seen.add(threading.current_thread().name.rsplit("_", 1)[0])
        barrier.wait()  # broken (an error) unless eight hash at once
        with lock:
            active[0] -= 1
        return zlib.crc32(data, value)

    monkeypatch.setattr(checkpoint, "zlib", types.SimpleNamespace(crc32=crc32))
    assert verify(step)["step"] == 1
    assert active[1] == 8 and seen == {"checkpoint-hash"}


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_is_told_by_errno_alone_and_through_the_chain(tmp_path, monkeypatch, code):
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: Usage(10**12, 0, 10**12))  # plenty free
    bare = OSError(code, "a device's own words")  # no strerror text to find

    def by_errno(directory):
        raise bare

    def by_cause(directory):
        wrapper = RuntimeError("the rank failed")
        wrapper.__cause__ = bare  # a cause, no context
        raise wrapper

    def by_context(directory):
        try:
            raise bare
        except OSError:
            raise RuntimeError("the rank failed")  # a context, no cause

    for writer in (by_errno, by_cause, by_context):
        with pytest.raises(CheckpointError, match="is full"):
            save_atomically(tmp_path, 1, writer, {})


@pytest.mark.parametrize("free, full", [(checkpoint.DISK_FULL_BYTES - 1, True), (checkpoint.DISK_FULL_BYTES, False)])
def test_a_failed_save_with_almost_no_space_left_is_a_full_disk(tmp_path, monkeypatch, free, full):
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - free, free))

    def failed(directory):
        raise RuntimeError("unexpected pos 64")

    with pytest.raises(CheckpointError if full else RuntimeError, match="is full" if full else "^unexpected pos 64$"):
        save_atomically(tmp_path, 1, failed, {})


def test_free_space_that_cannot_be_read_is_not_a_full_disk(tmp_path, monkeypatch):
    def no_usage(path):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(checkpoint.shutil, "disk_usage", no_usage)
    with pytest.raises(RuntimeError, match="^a bug$"):
        save_atomically(tmp_path, 1, lambda d: (_ for _ in ()).throw(RuntimeError("a bug")), {})


def test_the_full_disk_message_whole(tmp_path, monkeypatch):
    def full(directory):
        raise OSError(errno.ENOSPC, "No space left on device")

    # sizes a hair past a rounding boundary at three decimals (1234.5675 GB, 2469.1355 GB): a divisor
    # off by one part in 10**9 rounds them the other way
    free, total = 1_234_567_500_001, 2_469_135_500_001
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: Usage(total, total - free, free))
    root = tmp_path / "ckpts"
    with pytest.raises(CheckpointError) as error:
        save_atomically(root, 2, full, {})
    mount = mount_point_of(root)
    assert str(error.value) == (
        f"checkpoint step 2 was not saved: the disk holding {root} is full (the filesystem mounted at {mount}: "
        "1234.568 GB free of 2469.136 GB after removing the partial checkpoint). There is no earlier checkpoint. "
        "Free space there, or lower trainer.max_ckpt_to_keep, or set trainer.output_dir to a larger disk, then run "
        "again to resume.")


def test_a_failed_cleanup_does_not_hide_the_error_that_stopped_the_save(tmp_path):
    root = tmp_path / "ckpts"
    try:
        for error in (RuntimeError("a bug"), KeyboardInterrupt()):
            def write(directory):
                with undeletable(directory):
                    raise error

            with pytest.raises(type(error)) as raised:
                save_atomically(root, 1, write, {})
            assert raised.value is error
    finally:
        release(root)


def test_a_replaced_checkpoint_that_cannot_be_removed_does_not_fail_the_save(tmp_path):
    root = tmp_path / "ckpts"
    try:
        first = save_atomically(root, 1, write_file("a.txt"), {})
        with undeletable(first):
            save_atomically(root, 1, write_file("b.txt"), {})
        assert verify(root / "step_000001")["files"].keys() == {"b.txt"}
    finally:
        release(root)


def test_a_replaced_checkpoint_is_removed_and_so_is_one_a_crash_left(tmp_path):
    save_atomically(tmp_path, 1, write_file("a.txt"), {})
    save_atomically(tmp_path, 1, write_file("b.txt"), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]
    stale = tmp_path / ".tmp-step_000001-replaced"  # a crash between the two renames of a replacing save
    stale.mkdir()
    (stale / "a.txt").write_text("x")
    save_atomically(tmp_path, 1, write_file("c.txt"), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]
    assert verify(tmp_path / "step_000001")["files"].keys() == {"c.txt"}


def test_only_a_directory_is_fsynced_as_one(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError):
        checkpoint._fsync_dir(tmp_path / "f")


def test_prune_takes_a_checkpoint_another_process_removed_meanwhile(tmp_path, monkeypatch):
    for step in (1, 2, 3):
        save_atomically(tmp_path, step, write_file("w.txt"), {})
    real = checkpoint.list_checkpoints

    def listed_then_removed(root):
        found = real(root)
        for path in found[:-1]:
            (path / "w.txt").unlink()
            (path / "meta.json").unlink()
            path.rmdir()  # the other process got there first
        return found

    monkeypatch.setattr(checkpoint, "list_checkpoints", listed_then_removed)
    assert [p.name for p in prune(tmp_path, keep=1)] == ["step_000001", "step_000002"]


def test_verify_names_a_truncated_and_a_grown_file(tmp_path):
    step = save_atomically(tmp_path, 1, write_file("w.bin", "y" * 10), {})
    truncate(step / "w.bin", 4)
    with pytest.raises(CheckpointError) as error:
        verify(step)
    assert str(error.value) == f"{step / 'w.bin'} is damaged: 4 bytes where 10 were written (truncated)"
    (step / "w.bin").write_text("y" * 12)
    with pytest.raises(CheckpointError) as error:
        verify(step)
    assert str(error.value) == f"{step / 'w.bin'} is damaged: 12 bytes where 10 were written (grown)"


@pytest.mark.parametrize("under", ["X", "/X/", "X/"])
def test_verify_of_one_part_checks_that_part(tmp_path, under):
    step = save_atomically(tmp_path, 1, write_file("X/w.bin", "y" * 10), {})
    truncate(step / "X" / "w.bin", 4)
    with pytest.raises(CheckpointError, match="4 bytes where 10"):
        verify(step, under=under)


def test_an_unrecorded_checkpoint_is_logged_as_not_verified(tmp_path, caplog):
    (tmp_path / "meta.json").write_text('{"step": 5}')
    with caplog.at_level(logging.INFO, logger="megarl.checkpoint"):
        assert verify(tmp_path) == {"step": 5}
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path} lists no file sizes or hashes (an older megarl wrote it): not verified"]


def test_the_damaged_ones_warnings_and_the_all_damaged_error_word_for_word(tmp_path, caplog):
    for step in (1, 2, 3):
        save_atomically(tmp_path, step, write_file("w.bin", "y" * 10), {})
    for step in (2, 3):
        truncate(tmp_path / f"step_00000{step}" / "w.bin", step)
    with caplog.at_level(logging.WARNING, logger="megarl.checkpoint"):
        assert newest_intact(tmp_path) == tmp_path / "step_000001"
    damaged = [f"{tmp_path / f'step_00000{s}' / 'w.bin'} is damaged: {s} bytes where 10 were written (truncated)"
               for s in (3, 2)]
    assert [r.getMessage() for r in caplog.records] == [
        f"checkpoint {tmp_path / 'step_000003'} is damaged, trying the one before: {damaged[0]}",
        f"checkpoint {tmp_path / 'step_000002'} is damaged, trying the one before: {damaged[1]}",
        f"using checkpoint {tmp_path / 'step_000001'}, the newest intact one (2 newer damaged)"]
    truncate(tmp_path / "step_000001" / "w.bin", 1)
    with pytest.raises(CheckpointError) as error:
        newest_intact(tmp_path)
    first = f"{tmp_path / 'step_000001' / 'w.bin'} is damaged: 1 bytes where 10 were written (truncated)"
    assert str(error.value) == (f"every checkpoint under {tmp_path} is damaged:\n  {damaged[0]}\n  {damaged[1]}\n"
                                f"  {first}\nRestore the files, or start afresh with trainer.resume=disable (or "
                                "another trainer.output_dir).")


TORCH_REFUSAL = ("Weights only load failed. This file can still be loaded, to do so you have two options.\n"
                 "WeightsUnpickler error: Unsupported global: GLOBAL os.system was not an allowed global\n\n"
                 "Check the documentation of torch.load to learn more.")


@pytest.mark.parametrize("error, words", [
    (pickle.UnpicklingError(TORCH_REFUSAL), "UnpicklingError: Unsupported global: GLOBAL os.system was not an "
                                            "allowed global"),
    (pickle.UnpicklingError("x WeightsUnpickler error: a WeightsUnpickler error: b"),
     "UnpicklingError: a WeightsUnpickler error: b"),  # the first marker's reason, whole
    (RuntimeError("\n\n  PytorchStreamReader failed reading zip archive  \nmore"),
     "RuntimeError: PytorchStreamReader failed reading zip archive"),
    (EOFError(), "EOFError: "),
])
def test_an_unreadable_file_is_told_in_one_line(tmp_path, error, words):
    assert str(unreadable(tmp_path / "w.pt", error)) == (
        f"{tmp_path / 'w.pt'} could not be read, it is truncated or damaged ({words})")
