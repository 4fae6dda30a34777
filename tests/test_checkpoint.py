import pytest

from megarl.checkpoint import latest_checkpoint, list_checkpoints, prune, read_meta, save_atomically


def write_file(name, text="x"):
    def write(directory):
        (directory / name).write_text(text)
    return write


def test_save_find_and_prune(tmp_path):
    for step in (2, 10, 4):
        save_atomically(tmp_path, step, write_file("w.txt", str(step)), {"run_id": "abc"})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002", "step_000004", "step_000010"]
    newest = latest_checkpoint(tmp_path)
    assert newest.name == "step_000010" and (newest / "w.txt").read_text() == "10"
    assert read_meta(newest) == {"step": 10, "run_id": "abc"}
    removed = prune(tmp_path, keep=2)
    assert [p.name for p in removed] == ["step_000002"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000004", "step_000010"]


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
    with pytest.raises(FileNotFoundError, match="not a complete"):
        read_meta(tmp_path / "step_000007")
    prune(tmp_path, keep=1)
    assert not (tmp_path / ".tmp-step_000008-abc").exists()


def test_saving_the_same_step_again_replaces_it(tmp_path):
    save_atomically(tmp_path, 3, write_file("a.txt"), {})
    save_atomically(tmp_path, 3, write_file("b.txt"), {})
    assert sorted(p.name for p in (tmp_path / "step_000003").iterdir()) == ["b.txt", "meta.json"]
