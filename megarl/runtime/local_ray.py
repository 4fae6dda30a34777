"""A local Ray (one machine, no `cluster.ray_address`) that answers on loopback only.

Ray binds its ports (GCS, raylet, workers, the dashboard agent, and the Prometheus metrics
servers, which need no token) to every interface unless the node's address is a loopback one,
and on Linux it replaces a loopback node address by the machine's routable one unless told
that this Ray is no cluster (ray_constants.ENABLE_RAY_CLUSTER, read from
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when Ray is imported). A run that starts its own Ray has
every part on this machine, so it tells Ray exactly that while Ray starts its processes
(they inherit the setting); nothing of Ray can then be reached from another machine. A Ray
cluster that megarl joins is started by `ray start` (tools/ray_on_slurm.sh) and is not
touched here. Main entry point: `init_local_ray`.
"""

from __future__ import annotations

import contextlib
import logging
import os

import ray

log = logging.getLogger(__name__)

# Ray's switch (ray/_private/ray_constants.py): false = local Ray only, node address 127.0.0.1
NO_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def init_local_ray(**init_kwargs) -> None:
    """`ray.init(**init_kwargs)` for a Ray of this machine alone, every port on loopback."""
    with _no_cluster():
        ray.init(**init_kwargs)
    address = ray.util.get_node_ip_address()
    if address != "127.0.0.1":  # a Ray that no longer reads the switch: say so, do not fail the run
        log.warning("the local Ray runs on %s, not loopback: its ports (metrics included) may answer on every "
                    "interface of this machine", address)


@contextlib.contextmanager
def _no_cluster():
    from ray._private import ray_constants

    saved_env, saved_constant = os.environ.get(NO_CLUSTER_ENV), getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    os.environ[NO_CLUSTER_ENV] = "0"  # for the processes Ray starts
    ray_constants.ENABLE_RAY_CLUSTER = False  # this process read the variable when it imported Ray
    try:
        yield
    finally:
        if saved_env is None:
            os.environ.pop(NO_CLUSTER_ENV, None)
        else:
            os.environ[NO_CLUSTER_ENV] = saved_env
        if saved_constant is not None:
            ray_constants.ENABLE_RAY_CLUSTER = saved_constant
