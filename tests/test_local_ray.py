"""The Ray a run starts on its own machine (megarl.runtime.local_ray) answers on loopback only:
every port its processes listen on, the Prometheus metrics servers included, is bound to
127.0.0.1, and actors run with that address."""

from __future__ import annotations

import ipaddress
import os
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


@pytest.mark.timeout(240)
def test_a_local_ray_listens_on_loopback_only():
    if ray.is_initialized():
        pytest.skip("another test left Ray running in this process")
    before = os.environ.get(NO_CLUSTER_ENV)
    # what this test process listened on before Ray started is another test's (a gloo store left
    # by a test on the same xdist worker listens on "::"): not Ray's
    earlier = listening({os.getpid()})
    init_local_ray(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        assert os.environ.get(NO_CLUSTER_ENV) == before  # put back for the rest of this process

        @ray.remote(num_cpus=0)
        def where():
            return ray.util.get_node_ip_address()

        assert ray.get(where.remote(), timeout=120) == "127.0.0.1"
        ours = {p.pid for p in psutil.Process().children(recursive=True)} | {os.getpid()}
        seen: set = set()
        deadline = time.monotonic() + 20  # Ray's agents open their ports a while after start
        while time.monotonic() < deadline:
            seen |= listening(ours | {p.pid for p in psutil.Process().children(recursive=True)}) - earlier
            time.sleep(2)
        names = {name for _, _, name in seen}
        assert {"gcs_server", "raylet"} <= names, seen  # the check saw Ray's own processes
        assert [s for s in seen if not is_loopback(s[0])] == []
    finally:
        ray.shutdown()
