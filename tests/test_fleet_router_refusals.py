"""sglang-router's "no available workers" (503) while every engine is alive: the fleet waits
for the router to take its engines back instead of spending the request's attempts on it, up to
rollout.sglang.startup_timeout_s; other engine failures still spend them. In a CI run the router
held both engines out for 23 s after one was killed and restarted, and the request's 4 attempts
ran out in that time (tests/sglang_real/test_train.py's asynchronous kill)."""

from __future__ import annotations

import asyncio

import pytest

from megarl.config import load_config
from megarl.errors import ComponentDied
from megarl.rollout import sglang as fleet_module
from megarl.rollout.engine import GenerationOutput, SamplingParams
from megarl.rollout.http import ServerError
from megarl.rollout.sglang import SGLangFleet
from megarl.rollout.sglang_launch import router_command

ROUTER = "http://127.0.0.1:9"
NO_WORKER = ('{"error":{"type":"Service Unavailable","code":"no_available_workers",'
             '"message":"No available workers (all circuits open or unhealthy)"}}')
ANSWER = GenerationOutput(token_ids=[7, 8], log_probs=[-0.5, -0.25], finish_reason="length")


class _Alive:
    """A ServerActor double whose server runs; counts the fleet's health passes."""

    class _Call:
        def __init__(self):
            self.calls = 0

        async def remote(self, *args):
            self.calls += 1
            return True

    def __init__(self):
        self.alive = self._Call()


def fleet_answering(errors, monkeypatch, startup_timeout_s=900.0):
    """A fleet behind a router double that raises `errors` in turn, then answers ANSWER."""
    settings = load_config(None, [f"rollout.sglang.startup_timeout_s={startup_timeout_s}"]).rollout.sglang
    actors = [_Alive(), _Alive()]
    fleet = SGLangFleet([(f"engine{i}", a, f"http://127.0.0.1:{10 + i}", 1) for i, a in enumerate(actors)],
                        settings, router=(None, ROUTER))
    pending, sent = list(errors), []

    async def generate(prompt_ids, params):
        sent.append(prompt_ids)
        if pending:
            raise pending.pop(0)
        return ANSWER

    async def healthy(timeout_s=30.0):
        return True
    monkeypatch.setattr(fleet.front, "generate", generate)
    for server in fleet.servers:
        monkeypatch.setattr(server.client, "health", healthy)
    monkeypatch.setattr(fleet_module, "ROUTER_WAIT_S", 0.01)
    return fleet, actors, sent


def generate(fleet):
    async def go():
        try:
            return await fleet.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
        finally:
            await fleet.close()
    return asyncio.run(go())


def refusal():
    return ServerError(ROUTER + "/generate", 503, NO_WORKER)


def test_a_router_without_workers_is_waited_for_not_counted_as_attempts(monkeypatch):
    # 6 refusals: more than the 4 attempts (max_request_retries 3) a failing engine gets
    fleet, actors, sent = fleet_answering([refusal() for _ in range(6)], monkeypatch)
    assert generate(fleet) == ANSWER
    assert len(sent) == 7
    assert [a.alive.calls for a in actors] == [6, 6]  # a health pass after each refusal
    assert fleet.metrics()["rollout/resent_requests"] == 1  # one refusal episode, counted (and logged) once


def test_the_wait_for_the_router_is_bounded_by_the_startup_timeout(monkeypatch):
    fleet, _, sent = fleet_answering([refusal() for _ in range(1000)], monkeypatch, startup_timeout_s=0.05)
    with pytest.raises(ComponentDied, match="failed 4 times.*no_available_workers"):
        generate(fleet)
    assert 5 < len(sent) < 1000  # waited a while, then spent its 4 attempts


@pytest.mark.parametrize("status", [502, 503])
def test_other_engine_failures_spend_the_requests_attempts(monkeypatch, status):
    fleet, _, sent = fleet_answering([ServerError(ROUTER + "/generate", status, "upstream failed")
                                      for _ in range(4)], monkeypatch)
    with pytest.raises(ComponentDied, match="failed 4 times"):
        generate(fleet)
    assert len(sent) == 4


def test_the_routers_circuit_breaker_is_off():
    """The fleet restarts dead engines on their addresses; an open circuit would keep a
    restarted engine out of the router for its 60 s."""
    settings = load_config(None, []).rollout.sglang
    assert "--disable-circuit-breaker" in router_command(settings, ["http://127.0.0.1:1"], 9)
