"""Trainer checkpoints on disk: whole or absent, verified on resume, newest intact one found, last k kept.

A checkpoint is a directory `step_000042/` under `<output_dir>/checkpoints/`. It is written
into a hidden temporary directory, every file and directory fsynced, and renamed into place
only once complete, with a `meta.json` written last inside it: a crash or a full disk
mid-save leaves the previous checkpoint as the newest. `meta.json` lists every file with its
size and CRC32, checked before a checkpoint is read again; a damaged newest checkpoint is
skipped (with a warning) for the newest intact one. Main entry points: `save_atomically`,
`newest_intact`, `verify`, `prune`.

Why CRC32 and not a cryptographic hash: the record guards against accidents (a truncated or
bit-flipped file), not against someone who can write the checkpoint (they could rewrite
`meta.json` too). zlib's CRC32 runs at about 3.5 GB/s a core, over twice sha256's speed even
with SHA-NI (about 1.6 GB/s), and files hash in parallel, so a checkpoint of 64 GB shards
hashes at about the speed the disk reads it; storage systems check integrity the same way
(HDFS and GCS with CRC32C). The size check finds a truncated file without reading it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger(__name__)

META = "meta.json"
PREFIX = "step_"
HASH_THREADS = 8  # files hashed at once: enough to keep a fast disk busy; zlib releases the GIL
DISK_FULL_BYTES = 16 << 20  # a write that failed with less free than this is taken as a full disk


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the file or disk and what to do."""


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"{PREFIX}{step:06d}"


def save_atomically(root: str | Path, step: int, write: Callable[[Path], None], meta: dict) -> Path:
    """Call write(tmp_dir) to fill a checkpoint, record its files' sizes and CRC32s in
    meta.json, fsync everything, then rename it to step_NNNNNN. A full disk raises
    CheckpointError naming the disk; the partial checkpoint is removed either way."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(root, step)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{PREFIX}{step:06d}-"))
    try:
        write(tmp)
        files = _hash_files(tmp, sorted(_relative_files(tmp)), sync=True)
        with open(tmp / META, "w") as fh:
            json.dump({"step": step, **meta, "files": files}, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        for directory in _directories(tmp):
            _fsync_dir(directory)
        old = None
        if final.exists():  # the same step saved again (e.g. after a resume): replace it whole
            old = root / f".tmp-{final.name}-replaced"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except Exception as e:
        full = _disk_full(e, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise CheckpointError(_disk_full_message(root, step)) from e
        raise
    except BaseException:  # Ctrl-C: no leftovers either
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Finished checkpoints (with meta.json), oldest first; temporary leftovers are ignored.
    A finished checkpoint may still be damaged later: `verify` checks its files."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / META).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def read_meta(checkpoint: str | Path) -> dict:
    path = Path(checkpoint) / META
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint} is not a complete megarl checkpoint (no {META})")
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is damaged (not valid JSON: {e})") from None


def verify(checkpoint: str | Path, under: str = "") -> dict:
    """The checkpoint's meta.json, once every file it lists (those under `under`, a relative
    directory, when given) has the size and CRC32 written; CheckpointError naming the first
    damaged file. Checkpoints written before megarl recorded files are taken as they are."""
    checkpoint = Path(checkpoint)
    meta = read_meta(checkpoint)
    files = meta.get("files")
    if files is None:
        log.info("%s lists no file sizes or hashes (an older megarl wrote it): not verified", checkpoint)
        return meta
    prefix = f"{under.strip('/')}/" if under else ""
    wanted = {name: record for name, record in files.items() if name.startswith(prefix)}
    for name, record in wanted.items():  # sizes first: a truncated file is found without reading anything
        path = checkpoint / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: {checkpoint / META} lists it ({record['bytes']} bytes)")
        size = path.stat().st_size
        if size != record["bytes"]:
            raise CheckpointError(f"{path} is damaged: {size} bytes where {record['bytes']} were written "
                                  f"({'truncated' if size < record['bytes'] else 'grown'})")
    found = _hash_files(checkpoint, sorted(wanted), sync=False)
    for name, record in wanted.items():
        if found[name]["crc32"] != record["crc32"]:
            raise CheckpointError(f"{checkpoint / name} is damaged: its CRC32 is {found[name]['crc32']} where "
                                  f"{record['crc32']} was written (same size, different bytes)")
    return meta


def unreadable(path: str | Path, error: BaseException) -> CheckpointError:
    """The error for a checkpoint file its reader could not parse, in one line."""
    text = str(error)
    if "WeightsUnpickler error:" in text:  # torch.load(weights_only=True): its reason, not its advice
        text = text.split("WeightsUnpickler error:", 1)[1]
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return CheckpointError(f"{path} could not be read, it is truncated or damaged ({type(error).__name__}: {first})")


def newest_intact(root: str | Path) -> Path | None:
    """The newest checkpoint under `root` that `verify` accepts, None when there is none; a
    damaged newer one is logged as a warning and skipped. CheckpointError (naming every
    damaged file) when there are checkpoints and all are damaged."""
    damaged = []
    for path in reversed(list_checkpoints(root)):
        try:
            verify(path)
        except CheckpointError as e:
            log.warning("checkpoint %s is damaged, trying the one before: %s", path, e)
            damaged.append(str(e))
            continue
        if damaged:
            log.warning("using checkpoint %s, the newest intact one (%d newer damaged)", path, len(damaged))
        return path
    if damaged:
        raise CheckpointError(f"every checkpoint under {root} is damaged:\n  " + "\n  ".join(damaged) +
                              "\nRestore the files, or start afresh with trainer.resume=disable (or another "
                              "trainer.output_dir).")
    return None


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints and any temporary leftovers; returns the deleted."""
    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1")
    root = Path(root)
    removed = list_checkpoints(root)[:-keep]
    if root.is_dir():
        removed += [p for p in root.iterdir() if p.name.startswith(f".tmp-{PREFIX}")]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _relative_files(directory: Path) -> list[str]:
    return [(Path(d) / f).relative_to(directory).as_posix() for d, _, names in os.walk(directory) for f in names]


def _directories(directory: Path) -> list[Path]:
    """`directory` and everything below it, deepest first (each fsynced after its entries)."""
    return [Path(d) for d, _, _ in os.walk(directory, topdown=False)]


def _hash_files(directory: Path, names: list[str], sync: bool) -> dict[str, dict]:
    """{name: {"bytes", "crc32"}} of the files, read in parallel; `sync` also fsyncs each
    (written by whatever process: a read-only descriptor flushes the file's pages on Linux)."""
    def one(name: str) -> dict:
        crc, size, buf = 0, 0, bytearray(8 << 20)
        with open(directory / name, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                crc, size = zlib.crc32(memoryview(buf)[:n], crc), size + n
            if sync:
                os.fsync(fh.fileno())
        return {"bytes": size, "crc32": f"{crc:08x}"}

    with ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="checkpoint-hash") as pool:
        return dict(zip(names, pool.map(one, names)))


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _disk_full(error: BaseException, path: Path) -> bool:
    """Whether a failed save ran out of space: ENOSPC / EDQUOT anywhere in the error's chain or
    text (a train rank's error reaches the driver as text), or almost no space left where
    it wrote (torch.save reports a full disk as 'unexpected pos ...')."""
    seen: BaseException | None = error
    while seen is not None:
        if getattr(seen, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or any(
                os.strerror(code) in str(seen) for code in (errno.ENOSPC, errno.EDQUOT)):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return shutil.disk_usage(path).free < DISK_FULL_BYTES
    except OSError:
        return False


def _disk_full_message(root: Path, step: int) -> str:
    mount = root.resolve()
    while not os.path.ismount(mount):
        mount = mount.parent
    usage = shutil.disk_usage(root)
    previous = latest_checkpoint(root)
    kept = f"The newest checkpoint is still {previous}" if previous else "There is no earlier checkpoint"
    return (f"checkpoint step {step} was not saved: the disk holding {root} is full (the filesystem mounted at "
            f"{mount}: {usage.free / 1e9:.3f} GB free of {usage.total / 1e9:.3f} GB after removing the partial "
            f"checkpoint). {kept}. Free space there, or lower trainer.max_ckpt_to_keep, or set trainer.output_dir "
            "to a larger disk, then run again to resume.")
