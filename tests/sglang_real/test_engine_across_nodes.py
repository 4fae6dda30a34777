"""One SGLang 0.5.23 engine across two nodes, on the CPU: TP 2 with one TP rank in each of two
server processes (`--nnodes 2 --node-rank 0|1 --dist-init-addr`), started, fed and restarted
as one unit by megarl's fleet (EngineUnit over two ServerProcesses, the ranks' arguments from
megarl.rollout.engine_unit). Both processes run on this machine; the ranks meet over TCP as
they would between hosts (tests/multinode runs them on two nodes of the simulated cluster).

Each TP rank holds half of every sharded weight, so the engine serves HF's greedy tokens and
log-probs only while both ranks hold the same model: after a weight update by the disk
transport, by the nccl transport's group over gloo (world 1 + 2 TP ranks) and after the unit is
restarted because one rank died, the served model is checked against HF's.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest

from megarl.http_auth import bearer
from megarl.rollout.engine_unit import EngineUnit
from megarl.rollout.sglang_launch import ServerProcess, cpu_server_env, free_port, server_command
from megarl.weights.buckets import group_tensors, hf_tensors
from in_this_process import InThisProcess
from test_server import KEY, model_with, saved_model, served_is

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def engine(tmp_path_factory, sglang_env):
    from megarl.config import SGLangConfig
    from megarl.rollout.sglang import SGLangFleet

    root = tmp_path_factory.mktemp("sglang2n")
    model, vocab, cfg = saved_model(root, sglang_env, "rollout.tensor_parallel_size=2", "rollout.nodes_per_engine=2")
    processes = [ServerProcess(server_command(cfg, colocated=False), f"engine0-node{n}", log_dir=str(root),
                               api_key=KEY, env=cpu_server_env(2), health_route=None if n else "/health")
                 for n in range(2)]  # as launch_fleet starts them
    unit = EngineUnit([InThisProcess(p) for p in processes])
    url = asyncio.run(unit.start(300))
    fleet = SGLangFleet([("engine0", unit, url, 2)], SGLangConfig(router=False, startup_timeout_s=300),
                        weight_dir=str(root), api_key=KEY)
    yield fleet, processes, model, vocab
    asyncio.run(unit.stop())


def test_the_two_ranks_serve_hfs_tokens_as_one_engine(engine):
    fleet, processes, model, _ = engine
    served_is(fleet.servers[0].client, model)
    info = httpx.get(processes[0].url + "/server_info", headers=bearer(KEY), timeout=30).json()
    assert (info["tp_size"], info["nnodes"], info["node_rank"]) == (2, 2, 0)
    meet = info["dist_init_addr"]
    rank1 = Path(f"/proc/{processes[1].pid()}/cmdline").read_bytes().split(b"\0")
    assert rank1[rank1.index(b"--node-rank") + 1] == b"1"
    assert rank1[rank1.index(b"--dist-init-addr") + 1] == meet.encode()
    assert processes[1].alive()


def test_weights_from_disk_reach_both_ranks(engine):
    fleet, _, _, vocab = engine
    new = model_with(vocab, seed=1)
    asyncio.run(fleet.begin_weight_update())
    asyncio.run(fleet.update_weights(group_tensors(hf_tensors(new), 40_000), version=1))
    asyncio.run(fleet.end_weight_update())
    served_is(fleet.servers[0].client, new, version=1)


def test_weights_over_a_gloo_update_group_reach_both_ranks(engine):
    """The nccl transport's group: the sender is rank 0 of a world of 1 + the engine's 2 TP ranks,
    which join at its offset 1 through node rank 0's API."""
    from megarl.weights.group import GroupSender, group_ranks, join_update_group, leave_update_group

    fleet, _, _, vocab = engine
    world, offsets = group_ranks(fleet)
    assert (world, offsets) == (3, [1])
    port, name = free_port(), "megarl-2n"
    sender = GroupSender("gloo", "127.0.0.1", port, world, name, fleet.engine_urls, KEY, timeout_s=120)
    opened = threading.Thread(target=sender.open)
    opened.start()
    asyncio.run(join_update_group(fleet, "127.0.0.1", port, name, "gloo", 120))
    opened.join()
    new = model_with(vocab, seed=2)
    asyncio.run(fleet.begin_weight_update())
    assert sender.send(group_tensors(hf_tensors(new), 40_000), version=2) >= 1
    asyncio.run(fleet.end_weight_update())
    served_is(fleet.servers[0].client, new, version=2)
    sender.close()
    asyncio.run(leave_update_group(fleet, name))


def test_a_dead_rank_restarts_the_whole_engine_with_the_newest_weights_from_disk(engine):
    """Rank 1's processes killed: the engine is not alive, the health pass before a sync restarts
    both ranks (new processes, a new meeting port) and they reload the disk transport's newest
    weights (pushed here, whatever the tests before left loaded)."""
    fleet, processes, _, vocab = engine
    newest = model_with(vocab, seed=3)
    asyncio.run(fleet.begin_weight_update())
    asyncio.run(fleet.update_weights(group_tensors(hf_tensors(newest), 40_000), version=3))
    asyncio.run(fleet.end_weight_update())
    before = [p.pid() for p in processes]
    os.killpg(before[1], signal.SIGKILL)
    assert processes[1].gone_within(30)
    server = fleet.servers[0]
    assert not asyncio.run(server.unit.alive()) and asyncio.run(server.unit.gone_within(1.0))
    asyncio.run(fleet.check_engines())
    assert server.restarts == 1 and all(p.alive() for p in processes)
    assert all(new != old for new, old in zip([p.pid() for p in processes], before))
    assert fleet.last_weights[1] == 3
    served_is(server.client, newest, version=3)
