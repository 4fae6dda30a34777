"""The engine-server fleet on CPU: two of megarl's embedded engine servers (SGLang's HTTP
API) launched by Ray actors, the real sglang-router in front; generation, a killed engine
restarted with its requests re-sent, and weight updates over disk and over a gloo process
group, each checked against a plain forward pass of the model holding those weights."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group

from megarl.config import load_config
from megarl.errors import ComponentDied
from megarl.http_auth import bearer
from megarl.rollout.engine import SamplingParams
from megarl.rollout.sglang import SGLangFleet
from megarl.rollout.sglang_launch import free_port, launch_fleet, stop_fleet
from megarl.weights.buckets import group_tensors, hf_tensors, weight_checksums
from megarl.weights.group import (DistributedSender, group_ranks, init_group_body, join_update_group,
                                  leave_update_group, open_update_group)
from tiny_models import reference_log_probs, tiny_model, tiny_tokenizer

PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18], [19, 20, 21], [22, 23], [24, 25, 26], [27, 28]]


@pytest.fixture(scope="module")
def fleet_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    tok = tiny_tokenizer()
    model = tiny_model("qwen2", vocab_size=len(tok), eos_token_id=None)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    cfg = load_config(None, [f"model.path={root / 'model'}", "rollout.engine=sglang", "rollout.sglang.server=embedded",
                             "rollout.num_engines=2", f"trainer.output_dir={root / 'run'}", "model.dtype=float32",
                             "rollout.sglang.startup_timeout_s=120", "rollout.sglang.health_timeout_s=20"])
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    pg = placement_group([{"CPU": 1}] * 3)
    ray.get(pg.ready(), timeout=60)
    (root / "weights").mkdir()
    fleet = launch_fleet(cfg, pg, [[0], [1]], 2, str(root / "logs"), str(root / "weights"))
    yield fleet, model, cfg, root
    asyncio.run(fleet.close())
    stop_fleet(fleet)
    remove_placement_group(pg)
    ray.shutdown()


def generate_all(fleet, prompts, max_new_tokens=6, seed0=100):
    async def go():
        return await asyncio.gather(*[fleet.generate(p, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.9, ignore_eos=True,
                                                                        seed=seed0 + i)) for i, p in enumerate(prompts)])
    return asyncio.run(go())


def assert_matches(model, prompts, outs, temperature=0.9):
    for prompt, out in zip(prompts, outs):
        assert out.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(out.log_probs),
                                   reference_log_probs(model, prompt, out.token_ids, temperature), atol=1e-5, rtol=0)


def test_generate_through_the_router(fleet_setup):
    fleet, model, _, _ = fleet_setup
    assert fleet.router_url is not None and len(fleet.engine_urls) == 2
    outs = generate_all(fleet, PROMPTS)
    assert_matches(model, PROMPTS, outs)
    assert all(o.weight_version == 0 for o in outs)
    again = generate_all(fleet, PROMPTS)  # seeded requests give the same tokens on either engine
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


def test_the_runs_key_is_required_by_every_server_and_the_router(fleet_setup):
    """launch_fleet made a key for the run (none in the config or the environment): each engine
    and the router refuse requests without it or with another (401) and answer their health
    checks; the fleet's own requests carry it (test_generate_through_the_router). The embedded
    server's every route is covered in tests/test_api_keys.py."""
    fleet, _, _, _ = fleet_setup
    key = fleet.api_key
    assert key and len(key) >= 43 and key != os.environ.get("MEGARL_ENGINE_API_KEY")
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    outsiders = [{}, bearer(key[:-1]), bearer(key.upper()), {"Authorization": key}]
    for url in [*fleet.engine_urls, fleet.router_url]:
        for headers in outsiders:
            assert httpx.post(url + "/generate", json=body, headers=headers, timeout=30).status_code == 401, url
            assert httpx.post(url + "/flush_cache", headers=headers, timeout=30).status_code == 401, url
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        assert httpx.post(url + "/generate", json=body, headers=bearer(key), timeout=60).status_code == 200
    assert httpx.get(fleet.router_url + "/workers", timeout=30).status_code == 401  # the router's worker list
    control = [("/pause_generation", {"mode": "retract"}), ("/update_weights_from_disk", {"model_path": "/"}),
               ("/release_memory_occupation", {"tags": None}),
               ("/init_weights_update_group", init_group_body("192.0.2.1", 9, 1, 2, "outsider", "gloo"))]
    for url in fleet.engine_urls:
        for route, request in control:
            for headers in outsiders:
                assert httpx.post(url + route, json=request, headers=headers, timeout=30).status_code == 401, route
    assert_matches(fleet_setup[1], PROMPTS[:2], generate_all(fleet, PROMPTS[:2]))  # nothing was paused or released


def test_the_key_is_in_no_log_and_on_no_command_line(fleet_setup):
    fleet, _, _, root = fleet_setup
    key = fleet.api_key
    logs = {p.name: p.read_text(errors="replace") for p in (root / "logs").glob("*.log")}
    assert {"engine0.log", "engine1.log", "router.log"} <= set(logs)
    assert all("=== megarl: start 1 of" in text and key not in text for text in logs.values())
    ray_logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    assert [p for p in ray_logs.rglob("*") if p.is_file() and key.encode() in p.read_bytes()] == []
    for actor in [s.unit.actors[0] for s in fleet.servers] + [fleet.router_actor]:
        pid = ray.get(actor.pid.remote())
        assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()


def test_without_router_requests_spread_over_engines(fleet_setup):
    fleet, model, cfg, _ = fleet_setup
    direct = SGLangFleet([(s.name, s.unit, s.url, s.tp) for s in fleet.servers], cfg.rollout.sglang,
                         api_key=fleet.api_key)
    seen = []
    for s in direct.servers:  # count what each engine's client is asked
        original = s.client.generate

        async def counted(ids, params, _orig=original, _name=s.name):
            seen.append(_name)
            return await _orig(ids, params)
        s.client.generate = counted
    outs = generate_all(direct, PROMPTS)
    assert_matches(model, PROMPTS, outs)
    assert sorted(set(seen)) == ["engine0", "engine1"] and len(seen) == len(PROMPTS)
    asyncio.run(direct.close())


LONG = 900  # tokens per request: generation lasts seconds, so the kill lands mid-flight


def kill_during_generation(fleet, victim, prompts, seed0):
    """Generate while engine `victim`'s server is killed (SIGKILL) half a second in; the
    generation must still be running then (checked)."""
    pid = ray.get(victim.unit.actors[0].pid.remote())
    done, mid_flight, busy = threading.Event(), [], []

    def kill():
        mid_flight.append(not done.is_set())
        busy.append(victim.in_flight)  # counted by megarl's own routing (not behind the router)
        os.killpg(pid, signal.SIGKILL)
    timer = threading.Timer(0.5, kill)
    timer.start()
    outs = generate_all(fleet, prompts, max_new_tokens=LONG, seed0=seed0)
    done.set()
    timer.join()
    assert mid_flight == [True], "generation finished before the kill: make it longer"
    return pid, outs, busy[0]


@pytest.mark.parametrize("router", [pytest.param(True, marks=pytest.mark.full), False])
def test_a_killed_engine_is_restarted_and_its_requests_resent(fleet_setup, router):
    fleet, model, cfg, _ = fleet_setup
    if not router:  # megarl routes and re-sends itself
        fleet = SGLangFleet([(s.name, s.unit, s.url, s.tp) for s in fleet.servers], cfg.rollout.sglang,
                            api_key=fleet.api_key)
    prompts = PROMPTS * 3
    expected = generate_all(fleet, prompts, max_new_tokens=LONG, seed0=500)
    victim = fleet.servers[0]
    pid, outs, busy = kill_during_generation(fleet, victim, prompts, seed0=500)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]  # nothing lost, nothing changed
    assert_matches(model, prompts, outs)
    if router:  # the router re-sent the dead engine's requests; the check before the next sync restarts it
        asyncio.run(fleet.check_engines())
    else:  # the victim had requests in flight: they failed and were sent again
        assert busy > 0 and fleet.metrics()["rollout/resent_requests"] >= 1
    assert fleet.metrics()["rollout/engine_restarts"] == 1
    assert ray.get(victim.unit.actors[0].alive.remote()) and ray.get(victim.unit.actors[0].pid.remote()) != pid
    assert_matches(model, prompts[:4], generate_all(fleet, prompts[:4]))  # the restarted engine serves again
    if not router:
        asyncio.run(fleet.close())


def test_a_frozen_engine_is_found_by_the_progress_deadline_restarted_and_its_requests_resent(fleet_setup):
    # SIGSTOP: the server's process lives and holds its connections, so nothing fails by itself;
    # the requests on it make no progress for progress_timeout_s (2 s), its health check fails,
    # and they are re-sent after the restart (megarl routes them itself here)
    fleet, model, cfg, _ = fleet_setup
    liveness = replace(cfg.cluster.liveness, progress_timeout_s=2.0)
    direct = SGLangFleet([(s.name, s.unit, s.url, s.tp) for s in fleet.servers],
                         replace(cfg.rollout.sglang, health_timeout_s=3.0), liveness=liveness, api_key=fleet.api_key)
    prompts = PROMPTS * 2
    expected = generate_all(direct, prompts, max_new_tokens=LONG, seed0=700)
    victim = direct.servers[0]
    pid = ray.get(victim.unit.actors[0].pid.remote())
    timer = threading.Timer(0.5, lambda: os.killpg(pid, signal.SIGSTOP))
    timer.start()
    started = time.monotonic()
    outs = generate_all(direct, prompts, max_new_tokens=LONG, seed0=700)
    timer.join()
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]  # nothing lost, nothing changed
    assert direct.metrics()["rollout/resent_requests"] >= 1 and direct.metrics()["rollout/engine_restarts"] == 1
    assert ray.get(victim.unit.actors[0].pid.remote()) != pid
    assert time.monotonic() - started < 120  # not request_timeout_s (3600 s)
    asyncio.run(direct.close())


def joined_sender(fleet, name: str, timeout_s: float) -> DistributedSender:
    """A trainer's sender hosting the gloo update group `name` (its collectives time out after
    `timeout_s`), every engine of the fleet joined."""
    world, _ = group_ranks(fleet)
    port, joined = free_port(), {}
    trainer = threading.Thread(target=lambda: joined.setdefault(
        "group", open_update_group("gloo", "127.0.0.1", port, 0, world, name, timeout_s=timeout_s)))
    trainer.start()
    asyncio.run(join_update_group(fleet, "127.0.0.1", port, name, "gloo", timeout_s=60))
    trainer.join()
    return DistributedSender(joined["group"], fleet.engine_urls, name, api_key=fleet.api_key)


def test_weights_through_disk_then_a_gloo_group(fleet_setup):
    fleet, _, _, _ = fleet_setup
    new = tiny_model("qwen2", vocab_size=fleet_setup[1].config.vocab_size, seed=7, eos_token_id=None)
    asyncio.run(fleet.update_weights(group_tensors(hf_tensors(new), 20_000), version=3))
    outs = generate_all(fleet, PROMPTS[:3])
    assert_matches(new, PROMPTS[:3], outs)
    assert {o.weight_version for o in outs} == {3}
    assert asyncio.run(fleet.weight_checksums()) == weight_checksums(hf_tensors(new))

    newer = tiny_model("qwen2", vocab_size=new.config.vocab_size, seed=8, eos_token_id=None)
    assert group_ranks(fleet) == (3, [1, 2])
    sender = joined_sender(fleet, "test-sync", timeout_s=60)
    asyncio.run(fleet.begin_weight_update())  # pause, and open each engine's weight-update session
    sent = sender.send(group_tensors(hf_tensors(newer), 20_000), version=4)
    asyncio.run(fleet.end_weight_update())
    assert sent > 1  # several buckets, each one broadcast
    outs = generate_all(fleet, PROMPTS[:3])
    assert_matches(newer, PROMPTS[:3], outs)
    assert {o.weight_version for o in outs} == {4}
    assert asyncio.run(fleet.weight_checksums()) == weight_checksums(hf_tensors(newer))
    asyncio.run(leave_update_group(fleet, "test-sync"))
    sender.close()


def test_a_bucket_sent_outside_a_weight_update_session_fails_with_the_engines_refusal(fleet_setup):
    """SGLang 0.5.23 refuses a process-group update outside a session without joining the
    broadcast: the sender's broadcast times out, and its error says what the engines answered."""
    fleet = fleet_setup[0]
    sender = joined_sender(fleet, "test-no-session", timeout_s=5)
    head = dict(hf_tensors(fleet_setup[1]))["lm_head.weight"]
    with pytest.raises(RuntimeError, match="must run between begin_weight_update") as failed:
        sender.send([{"lm_head.weight": head}], version=9)
    assert all(url in str(failed.value) for url in fleet.engine_urls)  # every engine refused, by name
    asyncio.run(leave_update_group(fleet, "test-no-session"))
    sender.close()


def test_an_engine_past_its_restart_budget_stops_the_run(fleet_setup):
    fleet, _, cfg, _ = fleet_setup
    settings = type(cfg.rollout.sglang)(**{**cfg.rollout.sglang.__dict__, "max_restarts": 0,
                                           "max_request_retries": 1, "router": False})
    strict = SGLangFleet([(s.name, s.unit, s.url, s.tp) for s in fleet.servers[:1]], settings, api_key=fleet.api_key)
    os.killpg(ray.get(fleet.servers[0].unit.actors[0].pid.remote()), signal.SIGKILL)
    with pytest.raises(ComponentDied, match="engine0 .* failed again after 0 restarts"):
        generate_all(strict, PROMPTS[:1])
    asyncio.run(strict.close())
    ray.get(fleet.servers[0].unit.actors[0].restart.remote(60))  # leave the shared fleet whole


def test_an_engine_restarted_mid_rollout_without_weights_to_reload_stops_the_run(fleet_setup):
    """After a sync by a transport that keeps no copy (nccl, ipc: no weights on disk), a
    restarted engine would serve the checkpoint's weights as the trainer's: refused, by name.
    A restart in the health pass before a sync is fine (the sync brings it the weights)."""
    fleet, _, cfg, _ = fleet_setup
    settings = replace(cfg.rollout.sglang, max_request_retries=1, router=False)
    direct = SGLangFleet([(s.name, s.unit, s.url, s.tp) for s in fleet.servers[:1]], settings, api_key=fleet.api_key)
    asyncio.run(direct.begin_weight_update())  # a sync whose weights came over a process group
    asyncio.run(direct.end_weight_update())
    os.killpg(ray.get(fleet.servers[0].unit.actors[0].pid.remote()), signal.SIGKILL)
    with pytest.raises(ComponentDied, match="engine0 .* restarted mid-rollout and holds the checkpoint's weights"):
        generate_all(direct, PROMPTS[:1])
    os.killpg(ray.get(fleet.servers[0].unit.actors[0].pid.remote()), signal.SIGKILL)
    asyncio.run(direct.check_engines())  # the health pass of the next sync restarts it without complaint
    assert direct.metrics()["rollout/engine_restarts"] == 2
    asyncio.run(direct.close())


def test_an_engine_that_dies_during_a_sync_is_restarted_and_gets_the_new_weights(fleet_setup):
    """Killed after the sync paused the engines: the load fails on it, the fleet restarts it
    (only it: the others are paused, and a health check would wait on them) and loads the
    sync's weights into it; the sync ends and every engine serves them."""
    fleet, model, _, _ = fleet_setup
    new = tiny_model("qwen2", vocab_size=model.config.vocab_size, seed=11, eos_token_id=None)
    restarts = fleet.metrics()["rollout/engine_restarts"]
    asyncio.run(fleet.begin_weight_update())
    os.killpg(ray.get(fleet.servers[1].unit.actors[0].pid.remote()), signal.SIGKILL)
    asyncio.run(fleet.update_weights(group_tensors(hf_tensors(new), 20_000), version=12))
    asyncio.run(fleet.end_weight_update())
    assert fleet.metrics()["rollout/engine_restarts"] == restarts + 1
    assert asyncio.run(fleet.weight_checksums()) == weight_checksums(hf_tensors(new))  # both engines
    assert_matches(new, PROMPTS[:3], generate_all(fleet, PROMPTS[:3]))


def test_an_engine_restarted_and_reloaded_is_probed(fleet_setup):
    """A restarted engine reloads the kept weights (the disk transport) and is probed against the
    trainer's log-probs for them; one that still serves other weights after a second load stops
    the run by name."""
    from megarl.weights.probe import WeightProbe, WrongWeights

    fleet, model, cfg, _ = fleet_setup
    new = tiny_model("qwen2", vocab_size=model.config.vocab_size, seed=13, eos_token_id=None)
    asyncio.run(fleet.update_weights(group_tensors(hf_tensors(new), 20_000), version=14))
    direct = SGLangFleet([(s.name, s.unit, s.url, s.tp) for s in fleet.servers[:1]], cfg.rollout.sglang,
                         api_key=fleet.api_key)
    direct.last_weights = fleet.last_weights
    sequences = [PROMPTS[3], PROMPTS[1]]

    def expect(hf_model, version):
        probe = WeightProbe(sequences, tolerance=1e-4)
        probe.expected = [reference_log_probs(hf_model, s[:1], s[1:], 1.0) for s in sequences]
        probe.version = version
        return probe

    try:
        direct.probe = expect(new, 14)  # the trainer's log-probs of the weights kept on disk
        asyncio.run(direct._restart(direct.servers[0], before_sync=False))
        direct.probe = expect(model, 14)  # the trainer's say the weights are others: a reload cannot help
        with pytest.raises(WrongWeights, match=r"rollout engine engine0 at .* serves other weights than the "
                                               r"trainer's \(version 14\) after its restart and reload, and again"):
            asyncio.run(direct._restart(direct.servers[0], before_sync=False))
        assert direct.metrics()["rollout/engine_restarts"] == 2
    finally:
        asyncio.run(direct.close())


def test_an_engine_killed_before_the_probe_is_restarted_and_answers_it(fleet_setup):
    """Killed between a sync and its probe: the probe restarts it and takes its answer, with the
    weights it reloaded (kept on disk), or without a copy to reload with the checkpoint's, which
    the probe then finds wrong (the runtime syncs again); the run does not stop."""
    fleet, model, cfg, _ = fleet_setup
    new = tiny_model("qwen2", vocab_size=model.config.vocab_size, seed=17, eos_token_id=None)
    sequences = [PROMPTS[3], PROMPTS[1]]

    def log_probs_of(hf_model):
        return [reference_log_probs(hf_model, s[:1], s[1:], 1.0) for s in sequences]

    def assert_answers(answers, want):
        for got in answers:
            for g, w in zip(got, want):
                torch.testing.assert_close(torch.tensor(g), w, atol=1e-4, rtol=0)

    asyncio.run(fleet.update_weights(group_tensors(hf_tensors(new), 20_000), version=15))
    restarts = fleet.metrics()["rollout/engine_restarts"]
    os.killpg(ray.get(fleet.servers[1].unit.actors[0].pid.remote()), signal.SIGKILL)
    answers = asyncio.run(fleet.probe_log_probs(sequences))
    assert len(answers) == 2 and fleet.metrics()["rollout/engine_restarts"] == restarts + 1
    assert_answers(answers.values(), log_probs_of(new))

    settings = replace(cfg.rollout.sglang, router=False)
    direct = SGLangFleet([(s.name, s.unit, s.url, s.tp) for s in fleet.servers[:1]], settings, api_key=fleet.api_key)
    try:
        asyncio.run(direct.begin_weight_update())  # a sync whose weights came over a process group: no copy
        asyncio.run(direct.end_weight_update())
        os.killpg(ray.get(fleet.servers[0].unit.actors[0].pid.remote()), signal.SIGKILL)
        assert_answers(asyncio.run(direct.probe_log_probs(sequences)).values(), log_probs_of(model))
        assert direct.metrics()["rollout/engine_restarts"] == 1
    finally:
        asyncio.run(direct.close())


def test_a_dead_router_is_restarted_and_the_request_resent(fleet_setup):
    fleet, model, _, _ = fleet_setup
    asyncio.run(fleet.update_weights(group_tensors(hf_tensors(model), 20_000), version=9))  # earlier tests changed them
    before = generate_all(fleet, PROMPTS[:3])
    assert_matches(model, PROMPTS[:3], before)
    pid = ray.get(fleet.router_actor.pid.remote())
    os.killpg(pid, signal.SIGKILL)
    outs = generate_all(fleet, PROMPTS[:3])
    assert [o.token_ids for o in outs] == [o.token_ids for o in before]
    for out, earlier in zip(outs, before):  # batch composition moves the last float bits only
        torch.testing.assert_close(torch.tensor(out.log_probs), torch.tensor(earlier.log_probs), atol=1e-5, rtol=0)
    assert fleet.metrics()["rollout/router_restarts"] == 1
    assert ray.get(fleet.router_actor.pid.remote()) != pid
