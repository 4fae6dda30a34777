"""The CPU threads of a Ray actor of the run (megarl.runtime.ray_actors.use_threads): the
configured number, or the cores it may run on shared by the train ranks of its node. (That a
Ray run's actors get them: test_component_failures.test_dead_ray_actors_are_named.)"""

from __future__ import annotations

import os

import pytest
import torch

from megarl.config import load_config
from megarl.runtime.ray_actors import sharers, use_threads


@pytest.fixture
def threads_restored(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("configured, sharing, cores, want", [
    (None, 1, 2, 2),  # one rank on a 2-core node: both cores
    (None, 2, 2, 1),  # two ranks: one each
    (None, 3, 2, 1),  # more ranks than cores: still one
    (None, 2, 16, 8),
    (3, 2, 16, 3),  # cluster.threads_per_rank wins
])
def test_threads_of_an_actor(threads_restored, monkeypatch, configured, sharing, cores, want):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert use_threads(configured, sharing) == want
    assert torch.get_num_threads() == want and os.environ["OMP_NUM_THREADS"] == str(want)


def test_the_setting_is_checked():
    assert load_config(None, []).cluster.threads_per_rank is None
    with pytest.raises(Exception, match="threads_per_rank"):
        load_config(None, ["cluster.threads_per_rank=0"])


def test_the_service_actors_module_does_not_import_torch():
    # a Ray worker imports its actor's module: the retrieval, reward and sandbox actors' processes
    # start without torch's seconds of imports
    import subprocess
    import sys

    code = "import sys, megarl.runtime.service_actors; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("nodes, world, concurrent, want", [
    ({0: "a", 1: "a"}, 1, False, [1, 1]),  # one rank, the engine: each alone while it computes
    ({0: "a", 1: "a"}, 1, True, [2, 2]),  # asynchronous: the engine generates while the rank trains
    ({0: "a", 1: "a", 2: "b", 3: "a", 4: "a"}, 3, False, [2, 2, 1, 1]),  # bundle 4: reward and retrieval
    ({0: "a", 1: "a", 2: "b", 3: "a", 4: "b"}, 3, True, [3, 3, 1, 3]),  # the engine on node a, with 2 ranks
    ({0: "a", 1: "a", 2: "b", 3: "b", 4: "a"}, 3, True, [2, 2, 2, 2]),  # the engine on b, with 1 rank
])
def test_actors_that_compute_at_once_share_their_nodes_cores(nodes, world, concurrent, want):
    assert sharers(nodes, world, concurrent) == want
