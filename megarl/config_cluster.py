"""The `cluster` section of a run's configuration (megarl.config): where the run's parts
live, and the deadlines that tell a busy part from a frozen one (megarl.runtime.liveness)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megarl.config_loader import param


@dataclass
class LivenessConfig:
    interval_s: float = param(30.0, "Seconds between health pings of an actor while the driver waits on a call into "
                              "it (a training step, a generation).", gt=0.0)
    timeout_s: float = param(60.0, "Seconds an actor may take to answer a ping before the run stops, naming it as "
                             "frozen or lost.", gt=0.0)
    startup_timeout_s: float = param(900.0, "Seconds an actor may take to start (load its model, spawn its "
                                     "workers) before the run stops, naming it.", gt=0.0)
    progress_timeout_s: float = param(600.0, "Seconds an embedded engine (or an SGLang server) with pending "
                                      "generations may go without producing a token before it counts as stuck.",
                                      gt=0.0)


@dataclass
class ClusterConfig:
    launcher: Literal["auto", "ray", "inprocess"] = param(
        "auto", "ray = train worker and engine as Ray actors (any number of nodes); inprocess = one process, the "
        "same results bit for bit; auto = inprocess for a run on one CPU machine with the torch backend and the "
        "embedded engine (no cluster.ray_address, no reward.sandbox_servers), ray otherwise.")
    ray_address: str | None = param(None, "Ray cluster to join ('auto' on slurm); None = start a local Ray.")
    nnodes: int = param(1, "Nodes of the run.", gt=0)
    gpus_per_node: int = param(0, "GPUs per node; 0 = CPU run.", ge=0)
    cpus_per_node: int | None = param(
        None, "CPUs Ray may use per node (logical slots, not cores: one per train rank, one per engine that has no "
        "GPU of a train rank, one more); None = all, at least that many.", gt=0)
    threads_per_rank: int | None = param(
        None, "CPU threads (torch's pool) of each train rank and of the embedded engine, as Ray actors; None = the "
        "cores of the actor's node shared by the train ranks placed on it (the engine, which generates while the "
        "trainer waits, takes them all; with asynchronous rollouts it shares them too). Ray alone gives an actor as "
        "many threads as its num_cpus: one.", gt=0)
    placement_strategy: Literal["PACK", "SPREAD"] = param(
        "PACK", "How Ray places the run's actors on the nodes: PACK = on as few nodes as fit them (the engines next to "
        "the train ranks whose GPUs they share), SPREAD = over as many nodes as it can.")
    liveness: LivenessConfig = param(help="Deadlines on calls into the run's actors and servers.",
                                     factory=LivenessConfig)
