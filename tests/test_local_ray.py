"""The Ray a run starts on its own machine (megarl.runtime.local_ray) answers on loopback only:
every port its processes listen on, the Prometheus metrics servers included, is bound to
127.0.0.1, and actors run with that address."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import time

import psutil
import pytest
import ray

from megarl.runtime.local_ray import NO_CLUSTER_ENV, init_local_ray


def listening(pids: set[int]) -> set[tuple[str, int, str]]:
    """(address, port, process name) of every TCP socket the processes listen on."""
    found = set()
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            try:
                found.add((c.laddr.ip, c.laddr.port, psutil.Process(c.pid).name()))
            except psutil.NoSuchProcess:
                pass
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


@pytest.mark.parametrize("address, loopback", [("127.0.0.1", True), ("::1", True), ("::ffff:127.0.0.1", True),
                                               ("0.0.0.0", False), ("::", False), ("192.0.2.2", False)])
def test_is_loopback(address, loopback):
    assert is_loopback(address) is loopback


def loopback_report() -> dict:
    """In a process of its own (no Ray started before): start a local Ray, and report where its
    actors say they run, the names of the processes seen listening, and every listening socket
    of this process and its children not on loopback."""
    before = os.environ.get(NO_CLUSTER_ENV)
    init_local_ray(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        env_kept = os.environ.get(NO_CLUSTER_ENV) == before  # put back for the rest of this process

        @ray.remote(num_cpus=0)
        def where():
            return ray.util.get_node_ip_address()

        address = ray.get(where.remote(), timeout=120)
        ours = {p.pid for p in psutil.Process().children(recursive=True)} | {os.getpid()}
        seen: set = set()
        deadline = time.monotonic() + 20  # Ray's agents open their ports a while after start
        while time.monotonic() < deadline:
            seen |= listening(ours | {p.pid for p in psutil.Process().children(recursive=True)})
            time.sleep(2)
        return {"env_kept": env_kept, "where": address, "names": sorted({name for _, _, name in seen}),
                "outside": sorted(s for s in seen if not is_loopback(s[0]))}
    finally:
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_local_ray_listens_on_loopback_only():
    # in a fresh process: a Ray or a listening socket another test left in this one decides nothing
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", "import json, test_local_ray as t; print(json.dumps(t.loopback_report()))"],
                          env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["env_kept"] and report["where"] == "127.0.0.1"
    assert {"gcs_server", "raylet"} <= set(report["names"]), report  # the check saw Ray's own processes
    assert report["outside"] == []
