"""The weights probe (megarl.weights.probe, sync.probe): the engines' log-probs of fixed token
sequences against the trainer's after every event that loads or could lose their weights; one
reload on a mismatch, then the run stops naming the engine, the event and the figures."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
import torch

from megarl.rollout.http import HTTPEngine, create_engine_app
from megarl.rollout.local import LocalEngine
from megarl.weights.probe import WeightProbe, WrongWeights, probe_sequences
from tiny_models import reference_log_probs, tiny_model


@pytest.mark.parametrize("count, tokens, want", [
    (2, 3, [[5, 6, 7], [9, 10, 11]]),  # the longest two (a tie kept in file order), cut to 3 tokens
    (4, 10, [[5, 6, 7, 8], [9, 10, 11, 12], [1, 2, 3]]),  # [4] has no second token to score
])
def test_probe_sequences_are_the_longest_prompts_cut_short(count, tokens, want):
    assert probe_sequences([[1, 2, 3], [4], [5, 6, 7, 8], [9, 10, 11, 12]], count, tokens) == want


def test_compare_gives_the_mean_and_largest_difference_a_token():
    probe = WeightProbe([[1, 2, 3], [4, 5]], tolerance=0.2)
    probe.expected = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    m = probe.compare("e", [[-1.1, -2.0], [-0.2]])  # differences 0.1, 0, 0.3
    assert (m.engine, m.tokens) == ("e", 3)
    assert m.mean_abs == pytest.approx(0.4 / 3) and m.max_abs == pytest.approx(0.3)
    assert math.isinf(probe.compare("e", [[-1.0], [-0.5]]).mean_abs)  # a token missing: never a pass


class Answers:
    """An engine (or fleet) that answers the probe with fixed numbers."""

    def __init__(self, answers):
        self.answers = answers

    async def probe_log_probs(self, sequences):
        return self.answers


@pytest.mark.parametrize("answers, bad", [
    ({"e0": [[-1.0, -2.0]], "e1": [[-1.05, -2.0]]}, []),  # 0.025 a token: within 0.05
    ({"e0": [[-1.0, -2.0]], "e1": [[-1.0, -2.2]]}, ["e1"]),  # 0.1 a token
    ({"e0": [[float("nan"), -2.0]]}, ["e0"]),  # NaN (wiped weights) never passes
])
def test_mismatches_names_each_engine_beyond_the_tolerance(answers, bad):
    probe = WeightProbe([[1, 2, 3]], tolerance=0.05)
    probe.expected = [torch.tensor([-1.0, -2.0])]
    assert [m.engine for m in asyncio.run(probe.mismatches(Answers(answers)))] == bad


def test_the_embedded_engine_and_its_server_score_a_prompt_as_a_plain_forward_pass():
    model = tiny_model()
    tokens = [3, 17, 42, 5, 99, 100, 7]
    want = reference_log_probs(model, tokens[:1], tokens[1:])
    engine = LocalEngine(model)
    # the server answers SGLang's /generate with logprob_start_len 0 (input_token_logprobs)
    client = HTTPEngine("http://engine", transport=httpx.ASGITransport(create_engine_app(engine)))

    async def both():
        try:
            return (await engine.prompt_log_probs(tokens),
                    (await client.probe_log_probs([tokens]))["http://engine"][0])
        finally:
            await client.close()
            await engine.close()

    direct, served = asyncio.run(both())
    torch.testing.assert_close(torch.tensor(direct), want, rtol=0, atol=1e-6)
    assert served == direct


# -- the runtime: the embedded engine beside the torch trainer, in this process

@pytest.fixture
def runtime(tiny_inputs, tmp_path):
    from megarl.components import build_components
    from megarl.config import load_config
    from train_fixtures import tiny_overrides

    c = build_components(load_config(None, tiny_overrides(tiny_inputs, tmp_path)))
    yield c.runtime
    c.close()


def perturb(engine: LocalEngine, scale: float = 1.5) -> None:
    """Weights changed behind the run's back: one layer's MLP scaled."""
    with torch.no_grad():
        engine.model.model.layers[0].mlp.down_proj.weight.mul_(scale)


def test_the_first_generation_probes_the_engines_start_and_a_wrong_engine_is_reloaded(runtime):
    assert runtime.probe is not None and runtime.probe.tolerance == 1e-4  # float32 on the CPU
    perturb(runtime.engine)  # the engine started from other weights than the trainer's
    runtime.for_generation()
    assert runtime.weight_reloads == 1
    mismatch = runtime.probe.compare("e", asyncio.run(runtime.engine.probe_log_probs(
        runtime.probe.sequences))["embedded engine"])
    assert mismatch.mean_abs < 1e-5  # the trainer's weights again


def test_a_sync_is_probed_and_a_repaired_engine_goes_on(runtime):
    runtime.sync_weights(1)
    assert runtime.weight_reloads == 0
    perturb(runtime.engine)
    runtime.check_engine_weights("a test's event")
    assert runtime.weight_reloads == 1
    runtime.check_engine_weights("a test's event")  # in agreement now: nothing reloaded
    assert runtime.weight_reloads == 1


def test_an_engine_that_keeps_other_weights_stops_the_run_by_name(runtime, monkeypatch):
    runtime.for_generation()  # the engines' start: the first probe calibrates (the floor is far below 1e-4)
    load = runtime.engine.update_weights

    async def loads_wrong(buckets, version):  # every load lands scaled, as a broken transport would
        await load(buckets, version)
        perturb(runtime.engine)

    monkeypatch.setattr(runtime.engine, "update_weights", loads_wrong)
    with pytest.raises(WrongWeights, match=r"embedded engine serves other weights than the trainer's \(version 3\) "
                                           r"after the weight sync to version 3, and again after they were loaded once "
                                           r"more: embedded engine: mean \|engine - trainer\| log-prob [0-9.e-]+ a token "
                                           r"over \d+ probe tokens \(largest [0-9.e-]+; tolerance 0.0001\)"):
        runtime.sync_weights(3)
    assert runtime.weight_reloads == 1


def test_asynchronous_rollouts_probe_the_engines_before_generating(tiny_inputs, tmp_path):
    from megarl.async_rollouts import start_rollouts
    from megarl.components import build_components
    from megarl.config import load_config
    from train_fixtures import tiny_overrides

    c = build_components(load_config(None, tiny_overrides(tiny_inputs, tmp_path) + [
        "trainer.async_rollout.enable=true", "algorithm.tis_cap=2.0"]))
    try:
        perturb(c.runtime.engine)  # the engine started from other weights than the trainer's
        rollouts = start_rollouts(c, lambda *_: [], 0)  # a producer that generates nothing: only the start matters
        rollouts.close()
        assert c.runtime.weight_reloads == 1
    finally:
        c.close()


def test_the_probe_can_be_turned_off(tiny_inputs, tmp_path):
    from megarl.components import build_components
    from megarl.config import load_config
    from train_fixtures import tiny_overrides

    c = build_components(load_config(None, tiny_overrides(tiny_inputs, tmp_path) + ["sync.probe.enable=false"]))
    try:
        perturb(c.runtime.engine)
        c.runtime.for_generation()
        assert c.runtime.probe is None and c.runtime.weight_reloads == 0
    finally:
        c.close()


class _LiveProcess:
    """A ServerActor double whose server process runs (it is not gone): the fleet must not restart it."""

    class _Call:
        def __init__(self, answer):
            self.answer, self.calls = answer, []

        async def remote(self, *args):
            self.calls.append(args)
            return self.answer

    def __init__(self):
        self.gone_within, self.alive = self._Call(False), self._Call(True)


def test_an_engine_that_does_not_answer_the_probe_is_named():
    """The fleet's probe of a server whose process runs but does not answer: ComponentDied
    naming it, not an HTTP error, and no restart (one whose process died is restarted:
    tests/test_sglang_fleet.py)."""
    from megarl.config import load_config
    from megarl.errors import ComponentDied
    from megarl.rollout.sglang import SGLangFleet
    from megarl.rollout.sglang_launch import free_port

    settings = load_config(None, ["rollout.sglang.router=false"]).rollout.sglang
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    process = _LiveProcess()
    fleet = SGLangFleet([("engine0", process, url, 1)], settings)
    with pytest.raises(ComponentDied, match=rf"rollout engine engine0 at {url} did not answer the weights probe"):
        asyncio.run(fleet.probe_log_probs([[1, 2, 3]]))
    assert process.gone_within.calls == [(10.0,)] and fleet.metrics()["rollout/engine_restarts"] == 0
    asyncio.run(fleet.close())
