"""Bad inputs found before anything starts, each named with its path and what to do (issue 17,
failures 4): damaged model files, an output directory that cannot be written, an index built
from another corpus than the data's. (Bad data lines and empty prompts: test_data_prompts.py.)

The safetensors files here are written byte by byte, so every size in an expected message is
counted by hand: 8 bytes of header length, the JSON header, then the tensors' bytes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import ray
from safetensors.torch import load_file

from megarl.cli import main
from megarl.components import _warn_if_other_corpus
from megarl.data.prepare import write_rows
from megarl.data.prompts import data_corpus
from megarl.models.hf_files import ModelFilesError, check_model_files, tensor_files
from megarl.quickstart.worlds import write_search_world
from megarl.retrieval.corpus import corpus_info
from megarl.retrieval.index import build_index, corpus_warnings
from megarl.train import check_output_dir
from train_fixtures import tiny_overrides, write_tiny_run_inputs

W_HEADER = b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'  # 55 bytes; 4 float32 = 16 bytes
V_HEADER = b'{"v":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'  # 54 bytes; 2 float32 = 8 bytes
W_FILE = struct.pack("<Q", 55) + W_HEADER + bytes(16)  # 8 + 55 + 16 = 79 bytes
V_FILE = struct.pack("<Q", 54) + V_HEADER + bytes(8)  # 8 + 54 + 8 = 70 bytes
AGAIN = "copy or download it again"


def model_dir(root: Path, files: dict[str, bytes], config: bytes | None = b"{}") -> Path:
    root.mkdir()
    if config is not None:
        (root / "config.json").write_bytes(config)
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root


def index(weight_map: dict[str, str]) -> bytes:
    return json.dumps({"metadata": {}, "weight_map": weight_map}).encode()


def test_the_hand_made_files_are_what_safetensors_reads(tmp_path):
    # the reference: the safetensors library itself loads the bytes these tests build
    (tmp_path / "w.safetensors").write_bytes(W_FILE)
    (tmp_path / "v.safetensors").write_bytes(V_FILE)
    assert load_file(tmp_path / "w.safetensors")["w"].tolist() == [0.0] * 4
    assert load_file(tmp_path / "v.safetensors")["v"].tolist() == [0.0] * 2


GOOD = {"model.safetensors.index.json": index({"w": "a.safetensors", "v": "b.safetensors"}),
        "a.safetensors": W_FILE, "b.safetensors": V_FILE}


@pytest.mark.parametrize("files, config, problem", [
    ({"model.safetensors": W_FILE[:70]}, b"{}", f"D/model.safetensors is truncated: 70 bytes, its header describes 79; "
                                                f"{AGAIN}"),
    ({"model.safetensors": W_FILE[:40]}, b"{}", f"D/model.safetensors is truncated: 40 bytes, shorter than its own "
                                                f"header (55 bytes); {AGAIN}"),
    ({"model.safetensors": W_FILE[:5]}, b"{}", f"D/model.safetensors is 5 bytes, too short for a safetensors file; "
                                               f"{AGAIN}"),
    ({"model.safetensors": W_FILE + bytes(4)}, b"{}", f"D/model.safetensors is 83 bytes, 4 more than its header "
                                                      f"describes (79); {AGAIN}"),
    ({"model.safetensors": b"PK\x03\x04\x14\x00\x00\x00" + bytes(100)}, b"{}",  # a torch.save zip under that name
     f"D/model.safetensors is not a safetensors file (its first 8 bytes give a header of 85,966,670,672 bytes); "
     f"{AGAIN}"),
    ({"model.safetensors": struct.pack("<Q", 55) + b"x" * 55 + bytes(16)}, b"{}",
     "D/model.safetensors: its safetensors header does not parse (JSONDecodeError: Expecting value: line 1 column 1 "
     f"(char 0)); {AGAIN}"),
    ({**GOOD, "b.safetensors": V_FILE[:-1]}, b"{}", f"D/b.safetensors is truncated: 69 bytes, its header describes 70; "
                                                    f"{AGAIN}"),
    ({**GOOD, "model.safetensors.index.json": index({"w": "a.safetensors", "v": "c.safetensors"})}, b"{}",
     "D/c.safetensors, which model.safetensors.index.json lists, is missing; copy the model again"),
    ({**GOOD, "model.safetensors.index.json": index({"w": "a.safetensors", "u": "a.safetensors"})}, b"{}",
     "D/a.safetensors has no tensor u, which model.safetensors.index.json puts in it; the file and the index are "
     "from different models or copies"),
    ({**GOOD, "model.safetensors.index.json": b'{"metadata": {}}'}, b"{}",
     "D/model.safetensors.index.json has no weight_map {tensor: file}; copy the model again"),
    ({"model.safetensors": W_FILE}, b'{"hidden_size": 64,',
     "D/config.json is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 20 (char 19)); "
     "copy the model again"),
])
def test_a_damaged_model_file_is_named(tmp_path, files, config, problem):
    directory = model_dir(tmp_path / "m", files, config)
    with pytest.raises(ModelFilesError) as error:
        check_model_files(directory)
    assert str(error.value) == f"model.path={directory}: " + problem.replace("D/", f"{directory}/")


@pytest.mark.parametrize("files, config, message", [
    ({"model.safetensors": W_FILE}, None, "model.path=D is not an HF model directory (no config.json)"),
    ({}, b"{}", "model.path=D holds no weights (no model.safetensors, model.safetensors.index.json or *.bin)"),
])
def test_a_directory_that_is_not_a_model_is_named(tmp_path, files, config, message):
    directory = model_dir(tmp_path / "m", files, config)
    with pytest.raises(ModelFilesError) as error:
        check_model_files(directory)
    assert str(error.value) == message.replace("D", str(directory), 1)


def test_whole_model_files_pass_and_map_every_tensor(tmp_path):
    sharded = model_dir(tmp_path / "sharded", GOOD)
    check_model_files(sharded)
    assert tensor_files(sharded) == {"w": sharded / "a.safetensors", "v": sharded / "b.safetensors"}
    single = model_dir(tmp_path / "single", {"model.safetensors": W_FILE})
    assert tensor_files(single) == {"w": single / "model.safetensors"}
    check_model_files(model_dir(tmp_path / "bin", {"pytorch_model.bin": b"not checked"}))  # no header to check


def test_a_model_saved_by_transformers_passes_whole_and_sharded(tmp_path):
    from tiny_models import tiny_model

    model = tiny_model()
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "shards", max_shard_size="100KB")
    assert len(list((tmp_path / "shards").glob("*.safetensors"))) > 1
    for directory in (tmp_path / "one", tmp_path / "shards"):
        check_model_files(directory)
        assert set(tensor_files(directory)) == set(model.state_dict())


@pytest.fixture(scope="module")
def run_inputs(tmp_path_factory):
    return write_tiny_run_inputs(tmp_path_factory.mktemp("inputs"))


@pytest.mark.timeout(120)
def test_a_truncated_model_stops_megarl_train_before_ray_starts(run_inputs, tmp_path, capsys):
    # before: a 57-line traceback from a worker (safetensors' "incomplete metadata, file not fully covered"), no path
    model = tmp_path / "model"
    model.mkdir()
    for f in Path(run_inputs["model"]).iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    weights = model / "model.safetensors"
    whole = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: whole // 2])
    start = time.monotonic()
    status = main(["train", *tiny_overrides({**run_inputs, "model": str(model)}, tmp_path / "run", steps=1),
                   "cluster.launcher=ray"])
    assert status == 1 and time.monotonic() - start < 60
    assert not ray.is_initialized()
    assert capsys.readouterr().err == (f"megarl: error: model.path={model}: {weights} is truncated: {whole // 2:,} "
                                       f"bytes, its header describes {whole:,}; {AGAIN}\n")


@contextlib.contextmanager
def read_only_directory(directory: Path):
    """A directory this process cannot write in: a read-only tmpfs as root (root writes through
    permissions), mode 0o555 otherwise."""
    directory.mkdir()
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            yield directory
        finally:
            directory.chmod(0o755)
        return
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", f"megarl-test-{uuid.uuid4().hex[:8]}",
                             str(directory)], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {result.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], timeout=30, check=True)


FIX = "choose a directory this user can write to, or fix its permissions"


@pytest.mark.timeout(120)
def test_an_output_directory_that_cannot_be_written_is_named_before_anything_starts(tmp_path, capsys):
    # before: NotADirectoryError's traceback from save_config; a read-only one failed at its first write
    (tmp_path / "afile").write_text("x")
    with read_only_directory(tmp_path / "ro") as ro:
        cases = [
            (tmp_path / "afile", f"trainer.output_dir={tmp_path / 'afile'} is a file, not a directory; choose another "
                                 "trainer.output_dir"),
            (tmp_path / "afile" / "run", f"trainer.output_dir={tmp_path / 'afile' / 'run'} is under "
                                         f"{tmp_path / 'afile'}, which is a file, not a directory; choose another "
                                         "trainer.output_dir"),
            (ro / "run", f"trainer.output_dir={ro / 'run'} cannot be created (Permission denied: {ro / 'run'}); {FIX}"
             if os.geteuid() else
             f"trainer.output_dir={ro / 'run'} cannot be created (Read-only file system: {ro / 'run'}); {FIX}"),
            (ro, f"trainer.output_dir={ro} is not writable "
                 f"({'Permission denied' if os.geteuid() else 'Read-only file system'}); {FIX}"),
        ]
        for out, message in cases:
            assert main(["train", f"trainer.output_dir={out}", f"model.path={tmp_path / 'no-model'}"]) == 1
            assert capsys.readouterr().err == f"megarl: error: {message}\n"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "ro"]  # nothing written anywhere
        check_output_dir(tmp_path / "new" / "run")  # a writable one is created
        assert (tmp_path / "new" / "run").is_dir() and not any((tmp_path / "new" / "run").iterdir())


CORPUS_A = b'{"id": "0", "contents": "\\"Zorbia\\"\\nThe capital of Zorbia is Quell."}\n'
CORPUS_B = CORPUS_A + b'{"id": "1", "contents": "\\"Vell\\"\\nVell is a river."}\n'
QUESTION = {"data_source": "nq", "prompt": [{"role": "user", "content": "capital of Zorbia?"}],
            "reward_model": {"ground_truth": {"target": ["Quell"]}}}


@pytest.fixture
def corpora(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(CORPUS_A)
    (tmp_path / "b.jsonl").write_bytes(CORPUS_B)
    return tmp_path / "a.jsonl", tmp_path / "b.jsonl"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_an_index_of_another_corpus_is_warned_with_both_hashes(tmp_path, corpora, caplog):
    # before: the run trained on whatever the index served, silently
    a, b = corpora
    build_index(a, tmp_path / "index", show_progress=False)
    write_rows([QUESTION], tmp_path / "on_a.parquet", corpus=corpus_info(a))
    write_rows([QUESTION], tmp_path / "on_b.parquet", corpus=corpus_info(b))
    assert data_corpus(tmp_path / "on_b.parquet") == {"path": str(b), "bytes": len(CORPUS_B), "sha256": sha(CORPUS_B)}
    caplog.set_level(logging.WARNING, "megarl.components")
    _warn_if_other_corpus(str(tmp_path / "index"), [str(tmp_path / "on_a.parquet"), str(tmp_path / "on_b.parquet")])
    assert [r.getMessage() for r in caplog.records] == [
        f"megarl: warning: the retrieval index {tmp_path / 'index'} was built from another corpus than "
        f"{tmp_path / 'on_b.parquet'} was prepared against: index: {a} (sha256 {sha(CORPUS_A)}), data: {b} "
        f"(sha256 {sha(CORPUS_B)}); rebuild the index from the data's corpus (megarl retrieval build --corpus ...) "
        "or prepare the data against the index's corpus"]


def test_what_the_corpus_check_can_and_cannot_see(tmp_path, corpora):
    a, b = corpora
    build_index(a, tmp_path / "hashed", show_progress=False)
    build_index(a, tmp_path / "unhashed", show_progress=False, checksum=False)
    (tmp_path / "q.jsonl").write_text(json.dumps(QUESTION) + "\n")
    on_b = write_rows([QUESTION], tmp_path / "on_b.parquet", corpus=corpus_info(b))
    assert data_corpus(tmp_path / "q.jsonl") is None  # a jsonl file records no corpus: nothing to compare
    assert corpus_warnings(tmp_path / "hashed", {}) == []
    assert corpus_warnings(tmp_path / "hashed", {"on_a": corpus_info(a)}) == []
    # an index built with --no-checksum: the sizes still differ (71 and 125 bytes)
    assert corpus_warnings(tmp_path / "unhashed", {str(on_b): data_corpus(on_b)}) == [
        f"the retrieval index {tmp_path / 'unhashed'} was built from another corpus than {on_b} was prepared "
        f"against: index: {a} (71 bytes, no sha256), data: {b} (sha256 {sha(CORPUS_B)}); rebuild the index from "
        "the data's corpus (megarl retrieval build --corpus ...) or prepare the data against the index's corpus"]
    # the corpus file rewritten after the build: the index still serves the old documents
    a.write_bytes(CORPUS_B)
    assert corpus_warnings(tmp_path / "hashed", {}) == [
        f"the corpus {a} changed since the retrieval index {tmp_path / 'hashed'} was built from it (71 bytes then, "
        f"125 now; sha256 then {sha(CORPUS_A)}): the index serves the old documents; rebuild it if the run should "
        "search the new ones"]


def test_the_quickstart_world_records_the_corpus_its_index_is_built_from(tmp_path):
    paths = write_search_world(tmp_path / "world", num_entities=6, seed=0)
    build_index(paths["corpus"], tmp_path / "index", show_progress=False)
    recorded = {str(paths[k]): data_corpus(paths[k]) for k in ("train", "val")}
    assert all(r == corpus_info(paths["corpus"]) for r in recorded.values())
    assert corpus_warnings(tmp_path / "index", recorded) == []
