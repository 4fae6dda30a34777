"""An engine across nodes as the fleet handles it: each node rank's arguments, its bundles and
GPUs, the CUDA IPC plan over its nodes, and the unit of server processes (started together,
alive only while every rank is, restarted and stopped together).

The processes here are a stand-in that serves /health and keeps its argv, kept by megarl's own
ServerProcess; SGLang's own servers across two ranks are tests/sglang_real/test_engine_across_nodes.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megarl.rollout.engine_unit import EngineUnit, rank_args
from megarl.rollout.sglang_launch import ServerProcess, cpu_server_env, node_ranks
from megarl.weights.ipc import ipc_plan
from megarl.weights.transport import RankPlace
from in_this_process import InThisProcess

# serves 200 on every GET at --host/--port (appended by ServerProcess), whatever else it is given
HEALTH_ONLY = r"""
import http.server, sys
a = sys.argv
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *_):
        pass
http.server.HTTPServer((a[a.index("--host") + 1], int(a[a.index("--port") + 1])), Health).serve_forever()
"""


def test_rank_args_are_sglangs_multi_node_options():
    assert rank_args(1, 0, "10.0.0.1:5000") == []
    assert rank_args(2, 1, "10.0.0.1:5000") == ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr",
                                                "10.0.0.1:5000"]


def test_node_ranks_split_an_engines_gpus_by_node_in_tp_order():
    devices = {i: ("10.0.0.1" if i < 4 else "10.0.0.2", [str(i % 4)]) for i in range(8)}
    assert node_ranks(0, list(range(8)), devices, 2, gpus=True) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert node_ranks(0, [0, 1, 2, 3], devices, 1, gpus=True) == [[0, 1, 2, 3]]
    mixed = {**devices, 3: ("10.0.0.2", ["0"]), 4: ("10.0.0.1", ["3"])}  # a GPU of each node on the other
    with pytest.raises(RuntimeError, match="each of its 2 node\\(s\\) must hold 4 of them"):
        node_ranks(1, list(range(8)), mixed, 2, gpus=True)
    one_node = {i: ("10.0.0.1", [str(i)]) for i in range(8)}
    with pytest.raises(RuntimeError, match="landed on"):
        node_ranks(1, list(range(8)), one_node, 2, gpus=True)
    assert node_ranks(0, [5, 6], {5: ("a", []), 6: ("a", [])}, 2, gpus=False) == [[5], [6]]  # CPU: a rank a bundle


def test_cpu_ranks_bind_their_threads_to_their_machines_cores():
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in cpu_server_env(1)
    cores = f"0-{(os.cpu_count() or 1) - 1}"
    assert cpu_server_env(2)["SGLANG_CPU_OMP_THREADS_BIND"] == f"{cores}|{cores}"
    assert cpu_server_env(2)["SGLANG_USE_CPU_ENGINE"] == "1"


def test_the_ipc_plan_pairs_each_tp_rank_with_the_train_rank_on_its_node_and_gpu():
    """An engine of TP 4 over two nodes of 2 GPUs, colocated with 4 train ranks: its TP ranks 2, 3
    are on node b; the handles of all four go to its rank 0's API (through train rank 0)."""
    places = [RankPlace(r, "a" if r < 2 else "b", str(r % 2), 0, r == 0) for r in range(4)]
    engine = SimpleNamespace(name="engine0", url="http://a:1", tp=4, node="a", gpus=("0", "1", "0", "1"),
                             rank_nodes=("a", "a", "b", "b"))
    leads, makers = ipc_plan(places, [engine])
    assert leads == {0: [("http://a:1", [0, 1, 2, 3])], 1: [], 2: [], 3: []} and makers == {0, 1, 2, 3}
    wrong = SimpleNamespace(**{**vars(engine), "rank_nodes": ("a", "a", "c", "c")})
    with pytest.raises(RuntimeError, match="TP rank 2 of engine engine0 runs on GPU 0 of node c"):
        ipc_plan(places, [wrong])


def cmdline(process: ServerProcess) -> list[str]:
    return Path(f"/proc/{process.pid()}/cmdline").read_bytes().decode().split("\0")


@pytest.fixture
def unit(tmp_path):
    processes = [ServerProcess([sys.executable, "-c", HEALTH_ONLY], f"engine0-node{n}", log_dir=str(tmp_path),
                               health_route=None if n else "/health") for n in range(2)]  # as launch_fleet does
    yield EngineUnit([InThisProcess(p) for p in processes]), processes
    for p in processes:
        p.stop()


def test_the_ranks_start_together_and_meet_at_rank_0s_address(unit):
    engine, processes = unit
    url = asyncio.run(engine.start(30))
    assert url == processes[0].url and all(p.alive() for p in processes)
    args = [cmdline(p) for p in processes]
    meet = {a[a.index("--dist-init-addr") + 1] for a in args}
    assert len(meet) == 1 and meet.pop().startswith("127.0.0.1:")
    assert [a[a.index("--node-rank") + 1] for a in args] == ["0", "1"]
    assert all(a[a.index("--nnodes") + 1] == "2" for a in args)
    # where the other nodes reach each rank (SGLang's queue between nodes): its own address
    assert all(f"SGLANG_HOST_IP={p.host}".encode() in Path(f"/proc/{p.pid()}/environ").read_bytes().split(b"\0")
               for p in processes)
    assert asyncio.run(engine.alive()) and not asyncio.run(engine.gone_within(0.1))


def test_a_rank_that_exits_while_the_engine_starts_fails_the_start_with_its_log(tmp_path):
    slow = "import time; time.sleep(2)\n" + HEALTH_ONLY  # rank 0 answers after rank 1 has exited
    processes = [ServerProcess([sys.executable, "-c", slow], "engine0-node0", log_dir=str(tmp_path)),
                 ServerProcess([sys.executable, "-c", "print('rank 1 gave up'); raise SystemExit(3)"],
                               "engine0-node1", log_dir=str(tmp_path), health_route=None)]
    try:
        with pytest.raises(RuntimeError, match=r"node ranks \[1\] .* exited while it started(.|\n)*rank 1 gave up"):
            asyncio.run(EngineUnit([InThisProcess(p) for p in processes]).start(30))
    finally:
        for p in processes:
            p.stop()


def test_one_dead_rank_is_a_dead_engine_restarted_whole(unit):
    engine, processes = unit
    asyncio.run(engine.start(30))
    first = [p.pid() for p in processes]
    os.killpg(first[1], signal.SIGKILL)
    assert processes[1].gone_within(10)
    assert not asyncio.run(engine.alive()) and asyncio.run(engine.gone_within(0.1))
    url = asyncio.run(engine.restart(30))
    assert url == processes[0].url and all(p.alive() for p in processes)
    assert all(p.pid() != old for p, old in zip(processes, first))  # rank 0 too: it cannot go on alone
    assert [p.starts for p in processes] == [2, 2]
    args = [cmdline(p) for p in processes]
    assert len({a[a.index("--dist-init-addr") + 1] for a in args}) == 1  # they meet again, at one address
    tail = asyncio.run(engine.log_tail())
    assert "--- node rank 0:" in tail and "--- node rank 1:" in tail and "start 2 of engine0-node1" in tail
    asyncio.run(engine.stop())
    assert not any(p.alive() for p in processes)


def test_the_fleet_restarts_an_engine_whose_other_node_died(unit):
    """The health pass before a sync: rank 0 still answers, but its engine is not alive."""
    from megarl.config import SGLangConfig
    from megarl.rollout.sglang import SGLangFleet

    engine, processes = unit
    url = asyncio.run(engine.start(30))
    fleet = SGLangFleet([("engine0", engine, url, 2, "127.0.0.1", (), ("127.0.0.1", "127.0.0.1"))],
                        SGLangConfig(router=False, startup_timeout_s=30))
    assert fleet.servers[0].rank_nodes == ("127.0.0.1", "127.0.0.1")
    os.killpg(processes[1].pid(), signal.SIGKILL)
    assert processes[1].gone_within(10)
    asyncio.run(fleet.check_engines())
    assert fleet.engine_restarts == 1 and all(p.alive() for p in processes)
    asyncio.run(fleet.check_engines())  # healthy now: nothing restarted
    assert fleet.engine_restarts == 1
    asyncio.run(fleet.close())
