"""The two worked examples of docs/architecture.md, run as the page writes them: a new weight
transport (one module plus one registry line) and a new reward scorer (one module plus two
registry entries). Each example's code is read from the page itself, so the page cannot drift
from what works."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megarl import weights
from megarl.config import ConfigError, load_config
from megarl.reward import registry
from megarl.weights.buckets import group_tensors
from megarl.weights.transport import RankPlace

PAGE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def example(title: str) -> str:
    """The first python block after the heading `title` on the architecture page."""
    text = PAGE.read_text()
    section = text[text.index(title):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def module_from_page(tmp_path, monkeypatch):
    def load(name: str, title: str):
        (tmp_path / f"{name}.py").write_text(example(title))
        monkeypatch.syspath_prepend(str(tmp_path))
        sys.modules.pop(name, None)
        return importlib.import_module(name)
    return load


class OneRank:
    """Test double of TrainRanks: one source rank in this process."""

    def __init__(self):
        self.sender = None

    def places(self):
        return [RankPlace(rank=0, node="127.0.0.1", gpu="", stage=0, is_source=True)]

    def open_senders(self, senders):
        (self.sender,) = senders.values()
        self.sender.open()
        return lambda: None

    def push(self, bucket_bytes, version, stage=None):
        return self.sender.send(group_tensors(TENSORS.items(), bucket_bytes), version)


class LoadingEngines:
    """Test double of EngineServers: records what the engines were told to load."""

    def __init__(self):
        self.loaded = []

    async def load_from_disk(self, directory, version):
        self.loaded.append((directory, version))


TENSORS = {"a.weight": torch.arange(6.0).reshape(2, 3), "b.bias": torch.ones(4)}


def test_the_transport_example_is_two_files_of_work(module_from_page, monkeypatch, tmp_path):
    shm = module_from_page("shm_example", "### Worked example: a new transport")
    monkeypatch.setattr(shm, "ROOT", tmp_path / "shm")  # the page writes to /dev/shm
    monkeypatch.setitem(weights.TRANSPORTS, "shm", "shm_example:ShmTransport")  # the registry line

    fleet = ["rollout.engine=sglang", "rollout.sglang.server=embedded", "sync.transport=shm"]
    cfg = load_config(None, fleet)  # the config takes the new name, with the transport's own rules
    with pytest.raises(ConfigError, match="shm stays on one node"):
        load_config(None, fleet + ["cluster.nnodes=2"])
    with pytest.raises(ConfigError, match="shm is for engine servers"):
        load_config(None, ["sync.transport=shm"])

    engines, ranks = LoadingEngines(), OneRank()
    transport = weights.transport_class("shm")(cfg, engines)
    transport.connect(ranks)
    assert ranks.push(bucket_bytes=32, version=3) == 2  # 24 + 16 bytes: two buckets
    transport.finish(3)
    assert engines.loaded == [(str(tmp_path / "shm" / "v000003"), 3)]
    files = sorted((tmp_path / "shm" / "v000003").glob("*.safetensors"))
    got = {k: v for f in files for k, v in load_file(f).items()}
    assert set(got) == set(TENSORS) and all(torch.equal(got[k], TENSORS[k]) for k in TENSORS)


def test_the_reward_example_is_two_files_of_work(module_from_page, monkeypatch):
    scorer = module_from_page("last_integer_example", "### Worked example: a new reward scorer")
    monkeypatch.setitem(registry.SCORERS, "last_integer", registry.Scorer(scorer.last_integer_score))
    monkeypatch.setattr(registry, "ROUTES",
                        registry.ROUTES + (registry.Route("last_integer", names=frozenset({"counting"})),))

    right = registry.compute_score("counting", "3 apples and 4 pears: 7", 7)
    wrong = registry.compute_score("counting", "I count 8", "7")
    assert (right["score"], right["acc"], right["pred"]) == (1.0, True, "7")
    assert (wrong["score"], wrong["acc"]) == (0.0, False)
    assert registry.compute_score("counting", "no number", 7)["pred"] is None
    load_config(None, ["reward.custom_function=last_integer"])  # a built-in name now
