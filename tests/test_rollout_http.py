"""The SGLang-compatible HTTP API over real HTTP: the embedded engine served, `HTTPEngine` as client."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import torch
import uvicorn

from megarl.rollout.engine import RolloutEngine, SamplingParams
from megarl.rollout.http import HTTPEngine, create_engine_app
from megarl.rollout.local import LocalEngine
from tiny_models import reference_log_probs, tiny_model, tiny_tokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served():
    tok = tiny_tokenizer()
    model = tiny_model("qwen2", vocab_size=len(tok))
    engine = LocalEngine(model, tok, eos_token_ids=[])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_engine_app(engine, tok), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started, "engine server did not start"
    yield f"http://127.0.0.1:{port}", model, tok
    server.should_exit = True
    thread.join(timeout=10)


def test_generate_round_trip(served):
    url, model, tok = served
    prompt = tok.encode("<search> capital of")

    async def go():
        client = HTTPEngine(url)
        assert isinstance(client, RolloutEngine)
        out = await client.generate(prompt, SamplingParams(max_new_tokens=7, temperature=0.8, seed=5))
        again = await client.generate(prompt, SamplingParams(max_new_tokens=7, temperature=0.8, seed=5))
        healthy = await client.health()
        await client.close()
        return out, again, healthy

    out, again, healthy = asyncio.run(go())
    assert healthy and len(out.token_ids) == 7 and out.finish_reason == "length"
    assert out.token_ids == again.token_ids
    torch.testing.assert_close(torch.tensor(out.log_probs), reference_log_probs(model, prompt, out.token_ids, 0.8),
                               atol=1e-5, rtol=0)


def test_raw_payload_shapes(served):
    url, _, tok = served
    with httpx.Client(base_url=url, timeout=60) as http:
        single = http.post("/generate", json={"input_ids": [5, 6, 7], "return_logprob": True,
                                              "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).json()
        assert set(single) == {"text", "output_ids", "meta_info"}
        meta = single["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 3}
        assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 3
        assert [item[1] for item in meta["output_token_logprobs"]] == single["output_ids"]
        assert single["text"] == tok.decode(single["output_ids"])
        batch = http.post("/generate", json={"input_ids": [[5, 6, 7], [8, 9]],
                                             "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).json()
        assert len(batch) == 2 and batch[0]["output_ids"] == single["output_ids"][:2]
        assert "output_token_logprobs" not in batch[0]["meta_info"]
        stop_id = single["output_ids"][1]
        stopped = http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 3, "temperature": 0, "stop_token_ids": [stop_id]}}).json()
        assert stopped["meta_info"]["finish_reason"]["type"] == "stop"
        assert stopped["meta_info"]["finish_reason"]["matched"] == stop_id


@pytest.mark.parametrize("body, words", [
    ({"text": "hello"}, "input_ids"),
    ({"input_ids": []}, "non-empty"),
    ({"input_ids": ["a"]}, "token ids"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 2}}, "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 1}}, "unsupported"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "1 sampling_params for 2 prompts"),
])
def test_bad_requests_get_400(served, body, words):
    url, _, _ = served
    response = httpx.post(f"{url}/generate", json=body, timeout=30)
    assert response.status_code == 400 and words in response.text


def test_update_weights_through_disk(served, tmp_path):
    url, model, tok = served
    other = tiny_model("qwen2", vocab_size=len(tok), seed=11)
    prompt = tok.encode("the quick")

    async def go():
        client = HTTPEngine(url, weight_dir=str(tmp_path))
        state = {k: v.clone() for k, v in other.state_dict().items()}
        await client.update_weights([state], version=4)
        out = await client.generate(prompt, SamplingParams(max_new_tokens=5, temperature=0.0))
        await client.close()
        return out

    try:
        out = asyncio.run(go())
        assert out.weight_version == 4
        torch.testing.assert_close(torch.tensor(out.log_probs), reference_log_probs(other, prompt, out.token_ids),
                                   atol=1e-5, rtol=0)
    finally:  # put the original weights back for the other tests of this module
        original = tiny_model("qwen2", vocab_size=len(tok))
        model.load_state_dict(original.state_dict())
    assert list(tmp_path.iterdir()) == []  # the staging directory is removed


def test_pause_and_continue(served):
    url, _, _ = served
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.post("/pause_generation", json={"mode": "retract"}).json()["status"] == "ok"
        refused = http.post("/pause_generation", json={"mode": "abort"})  # SGLang's default would end requests
        assert refused.status_code == 400 and "retract" in refused.text
        assert http.post("/continue_generation", json={}).json()["status"] == "ok"
        assert http.get("/health_generate").status_code == 200
        assert http.get("/flush_cache").json() == {"success": True}


def test_a_preempted_request_is_continued_over_http(served):
    """abort_requests over /abort_request: the request in flight answers abort with what it has
    (here: nothing, the engine is paused), marked as ours, and the agent loop continues it."""
    from megarl.rollout.agent import Trajectory, generate_continued

    url, model, tok = served
    prompt = tok.encode("the quick")

    async def go():
        client = HTTPEngine(url)
        await client.pause()  # the request waits in the queue, so the abort finds it there
        task = asyncio.ensure_future(generate_continued(client, tok, prompt, SamplingParams(
            max_new_tokens=6, temperature=0.0), traj := Trajectory(prompt_ids=prompt)))
        while not client._in_flight:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # the request has reached the engine's queue
        await client.abort_requests()
        await client.resume()
        out = await task
        await client.close()
        return out, traj

    out, traj = asyncio.run(go())
    assert traj.num_continued == 1 and len(out.token_ids) == 6 and out.finish_reason == "length"
    torch.testing.assert_close(torch.tensor(out.log_probs), reference_log_probs(model, prompt, out.token_ids),
                               atol=1e-5, rtol=0)
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.post("/abort_request", json={"rid": "x"}).status_code == 400  # one request by id: not served


def test_every_control_body_of_the_fleet_is_accepted(served):
    """The bodies megarl.rollout.sglang_api builds (checked against SGLang's own structs in
    test_sglang_contract) are the ones the embedded server takes, route by route."""
    from megarl.weights import group, ipc

    url, _, _ = served

    async def go():
        client = HTTPEngine(url)
        await client.pause()
        await client.flush_cache()
        await client.resume()
        await client.release_memory()
        await client.resume_memory(["weights"])
        await client.resume_memory(["kv_cache"])
        with pytest.raises(RuntimeError, match="no update group megarl-x"):
            await client.post("/destroy_weights_update_group", group.destroy_group_body("megarl-x"))
        update = group.distributed_update_body(["lm_head.weight"], ["float32"], [[2, 2]], "megarl-x", 1)
        with pytest.raises(RuntimeError, match="must run between begin_weight_update"):
            await client.post("/update_weights_from_distributed", update)  # no session open
        await client.open_update_session()
        with pytest.raises(RuntimeError, match="call /init_weights_update_group first"):
            await client.post("/update_weights_from_distributed", update)
        await client.close_update_session()
        with pytest.raises(RuntimeError, match="CUDA IPC handles"):
            await client.post("/update_weights_from_tensor", ipc.tensor_update_body(["x"], 1))
        healthy = await client.health()
        await client.close()
        return healthy

    assert asyncio.run(go())


def test_the_weight_update_session_is_sglangs(served):
    """As SGLang 0.5.23: one session at a time, no end without a begin; a session left open is
    closed by the next sync's begin, and an engine without one (restarted) may be closed."""
    url, _, _ = served

    async def go():
        client = HTTPEngine(url)
        answers = []
        for route in ("/end_weight_update", "/begin_weight_update", "/begin_weight_update", "/end_weight_update"):
            try:
                answers.append((await client.post(route, {}))["success"])
            except RuntimeError as e:
                answers.append(str(e))
        await client.open_update_session()
        await client.open_update_session()  # the one left open is closed first
        await client.close_update_session()
        with pytest.raises(RuntimeError, match="no weight-update session"):
            await client.close_update_session()
        await client.close_update_session(missing_ok=True)
        await client.close()
        return answers

    end_first, begin, begin_again, end = asyncio.run(go())
    assert "400" in end_first and "no weight-update session is open" in end_first
    assert begin is True and end is True
    assert "a weight-update session is already open" in begin_again


def test_an_answer_with_what_only_json_reads_is_still_read():
    # orjson reads the answers; a server that writes NaN or Infinity (Python's json does) is read by json
    from megarl.rollout.http import _loads

    assert _loads(b'{"output_ids": [7, 8]}') == {"output_ids": [7, 8]}
    log_probs = _loads(b'[[-Infinity, 7, null], [NaN, 8, null]]')
    assert log_probs[0][0] == float("-inf") and log_probs[0][1:] == [7, None]
    assert log_probs[1][0] != log_probs[1][0] and log_probs[1][1] == 8  # NaN
