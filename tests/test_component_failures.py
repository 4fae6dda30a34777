"""A dead or frozen retrieval server, engine, train rank or reward actor stops the run with its
name, in bounded time; so does an engine that answers but produces nothing."""

import asyncio
import os
import re
import signal
import socket
import time
from dataclasses import replace

import psutil
import pytest
import ray

from megarl.components import ComponentDied, build_components
from megarl.config import load_config
from megarl.quickstart import QuickstartSettings, prepare
from megarl import train as train_module
from megarl.rollout.agent import Trajectory
from megarl.train import train_step

TINY = replace(QuickstartSettings(), num_entities=12, vocab_size=600, hidden_size=32, num_heads=4, num_kv_heads=2,
               read_steps=2, mix_steps=2, batch_size=4, search_fraction=1.0)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("qs"), TINY)


def config(world, out, launcher):
    return load_config(None, config_overrides(world, out, launcher))


def config_overrides(world, out, launcher) -> list[str]:
    return [
        f"model.path={world / 'model'}", f"data.train_files=[{world / 'data' / 'train.parquet'}]",
        "data.train_batch_size=2", "data.gen_batch_size=2", "data.max_prompt_length=256", "rollout.n=2",
        "rollout.max_response_length=48", "algorithm.overlong.buffer_len=8", "algorithm.dynamic_sampling.enable=false",
        "agent.max_turns=1", "agent.max_turn_length=12", "agent.max_obs_length=32",
        f"agent.retrieval.index_dir={world / 'index'}", "agent.retrieval.port=0", "agent.retrieval.max_retries=0",
        "agent.retrieval.timeout_s=5", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=4",
        f"trainer.output_dir={out}", "tracking.backend=none", f"cluster.launcher={launcher}"]


def test_stopped_in_process_retrieval_server_is_named(world, tmp_path, monkeypatch):
    c = build_components(config(world, tmp_path, "inprocess"))
    try:
        c.check_retrieval()  # alive: passes
        c.runtime.retrieval_server.stop()
        with pytest.raises(ComponentDied, match=r"retrieval server at http://127\.0\.0\.1:\d+ is not answering"):
            c.check_retrieval()

        # a rollout whose searches failed asks for the check (the tiny model rarely searches by itself)
        async def failed_searches(engine, tokenizer, prompts, settings, searcher, seeds):
            return [Trajectory(prompt_ids=p, response_ids=[1], loss_mask=[1], rollout_log_probs=[0.0],
                               tool_calls={"search": 1}, tool_failures={"search": 1}) for p in prompts]

        monkeypatch.setattr(train_module, "run_trajectories", failed_searches)
        with pytest.raises(ComponentDied, match="retrieval server"):
            train_step(c, 0)
    finally:
        c.close()


def kill(actor) -> None:
    """ray.kill, then wait until the actor is really gone (the kill is asynchronous)."""
    ray.kill(actor)
    for _ in range(300):
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError("the actor outlived ray.kill")


def test_dead_ray_actors_are_named(world, tmp_path):
    c = build_components(config(world, tmp_path, "ray"))
    try:
        train_step(c, 0)  # everything alive: a normal step
        c.check_retrieval()
        assert c.runtime.lost_parts() == ""
        # the one train rank and the engine each use the node's cores, not the one Ray gives
        # an actor of num_cpus=1 (cluster.threads_per_rank)
        for actor in (c.runtime.worker_actors[0], c.runtime.engine_actor):
            threads = ray.get(actor.__ray_call__.remote(lambda self: __import__("torch").get_num_threads()))
            assert threads == len(os.sched_getaffinity(0))
        c.runtime.transport.connect(c.runtime.ranks)  # as a sync begins, after the rollouts
        kill(c.runtime.retrieval_actor)
        with pytest.raises(ComponentDied, match=r"retrieval server at http://\S+ \(Ray actor RetrievalActor\)"):
            c.check_retrieval()
        kill(c.runtime.reward_actor)
        with pytest.raises(ComponentDied, match="reward workers \\(Ray actor RewardActor\\) died"):
            c.reward_pool.compute([])
        kill(c.runtime.engine_actor)
        # an engine lost between the rollouts and the sync: named in one line
        for sync in (lambda: c.runtime.ranks.push(1 << 20, 1),  # the rank's own call into the engine
                     lambda: c.runtime.sync_weights(1)):  # the whole sync
            with pytest.raises(ComponentDied) as died:
                sync()
            assert str(died.value).startswith("rollout engine (Ray actor EngineActor) died (on 127.0.0.1): ")
            assert len(str(died.value).splitlines()) == 1
        with pytest.raises(ComponentDied, match="rollout engine \\(Ray actor EngineActor\\) died"):
            train_step(c, 5)
        # what a failed run adds to its error: the parts gone, by node (the train rank is alive)
        assert c.runtime.lost_parts() == (f"gone on node {socket.gethostname()} (127.0.0.1): "
                                          "rollout engine, reward workers, retrieval server")
    finally:
        c.close()
    assert not ray.is_initialized()


LIVENESS = ["cluster.liveness.interval_s=1", "cluster.liveness.timeout_s=3", "cluster.liveness.progress_timeout_s=4"]


def pid_of(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("part, named", [
    pytest.param("retrieval", r"retrieval server at http://\S+ \(Ray actor RetrievalActor\) did not answer a health "
                 r"ping within 3 s", marks=pytest.mark.full),
    ("engine", r"^while generating the step's samples: rollout engine \(Ray actor EngineActor\) did not answer a "
               r"health ping within 3 s"),
    ("rank", r"^while computing the old log-probs: train worker rank 0 \(Ray actor TrainWorkerActor\) on node "
             rf"{re.escape(socket.gethostname())} \(127\.0\.0\.1\) did not answer a health ping within 3 s"),
    pytest.param("reward", r"^while generating the step's samples: reward workers \(Ray actor RewardActor\) did not "
                 r"answer a health ping within 3 s", marks=pytest.mark.full),
])
@pytest.mark.slow
def test_a_frozen_actor_stops_the_run_by_name_and_shutdown_is_bounded(world, tmp_path, part, named):
    # SIGSTOP: the actor's process is alive to Ray and its calls never end; before the
    # deadlines the step waited forever and shutdown waited on the frozen engine; then shutdown
    # asked a frozen engine or reward actor to close and waited out the deadline
    c = build_components(load_config(None, [*config_overrides(world, tmp_path, "ray"), *LIVENESS]))
    try:
        train_step(c, 0)
        runtime = c.runtime
        actor = {"engine": runtime.engine_actor, "rank": runtime.worker_actors[0], "reward": runtime.reward_actor,
                 "retrieval": runtime.retrieval_actor}[part]
        pid = pid_of(actor)
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(ComponentDied, match=named):
            if part == "retrieval":  # asked after failed searches (the tiny model may not search at all)
                c.check_retrieval()
            else:
                train_step(c, 1)
        assert time.monotonic() - started < 60
    finally:
        c.runtime.lost_parts()  # what train() asks after a ComponentDied: the frozen part does not answer
        started = time.monotonic()
        c.close()  # with the actor still frozen
    assert [a for _, a in c.runtime.silent] == [actor]  # so it is stopped, not asked to close,
    assert time.monotonic() - started < 28  # which would wait out a close's 30 s
    deadline = time.monotonic() + 30
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gone(pid)


@pytest.mark.slow
def test_an_engine_that_answers_but_produces_nothing_is_named(world, tmp_path):
    c = build_components(load_config(None, [*config_overrides(world, tmp_path, "ray"), *LIVENESS]))
    try:
        asyncio.run(c.engine.pause())  # alive, answers pings, generates no token
        started = time.monotonic()
        with pytest.raises(ComponentDied, match=r"rollout engine \(Ray actor EngineActor\) answers but produced no "
                                                r"token for \d+ s with \d+ generations pending"):
            train_step(c, 0)
        assert time.monotonic() - started < 60
    finally:
        c.close()


def test_a_dead_actor_is_named_with_its_node_and_rays_cause():
    from ray.core.generated.common_pb2 import ActorDiedErrorContext

    from megarl.runtime.liveness import died

    # the error Ray raises for a call into an actor on a node that has died
    context = ActorDiedErrorContext(class_name="ServerProcess", actor_id=bytes(16), pid=42,
                                    node_ip_address="10.231.0.2",
                                    error_message="The actor died because its node has died. Node Id: ab12")
    error = died("rollout engine0", ray.exceptions.ActorDiedError(context))
    assert str(error) == ("rollout engine0 died (on 10.231.0.2): ActorDiedError: The actor died unexpectedly before "
                          "finishing this task. The actor died because its node has died. Node Id: ab12")
    # a name that gives the node already does not get its address twice
    named = died("rollout engine0 on node node2 (10.231.0.2)", ray.exceptions.ActorDiedError(context))
    assert str(named).startswith("rollout engine0 on node node2 (10.231.0.2) died: ActorDiedError: ")
    # a one-line error as it is
    assert str(died("reward workers", RuntimeError("gone"))) == "reward workers died: RuntimeError: gone"
