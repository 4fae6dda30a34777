"""open-r1's code rewards: extraction, output comparison, the scores by hand, clear errors for a
malformed verification_info, and the sandbox service (queue bound, key) giving the local
sandbox's results."""

from __future__ import annotations

import json
import os
import shutil
import threading

import httpx
import pytest

from megarl.reward import compute_score
from megarl.reward.code import extract_code, output_matches

if shutil.which("bwrap") is None:
    if os.environ.get("CI"):
        pytest.fail("bubblewrap is not installed: `make setup` should have installed it", pytrace=False)
    pytest.skip("bubblewrap (bwrap) is not installed: apt-get install bubblewrap", allow_module_level=True)

SUM = "a, b = map(int, input().split())\nprint(a + b)"
CASES = [{"input": "1 2\n", "output": "3\n", "type": "stdin_stdout"}, {"input": "5 5\n", "output": "10"},
         {"input": "-4 4\n", "output": "0"}, {"input": "7 8", "output": "15\n"}]
INFO = {"language": "python", "test_cases": CASES}


def fenced(code: str, language: str = "python") -> str:
    return f"Here it is:\n```{language}\n{code}\n```\n"


def test_the_last_block_of_the_language_is_the_program():
    text = "```python\nfirst\n```\n```cpp\nother\n```\n```python\nsecond\n```"
    assert extract_code(text, "python") == "second\n" and extract_code(text, "cpp") == "other\n"
    assert extract_code("```py\nx\n```", "python") == "" and extract_code("no code", "python") == ""


def test_outputs_match_by_stripped_lines():
    assert output_matches(" 3 \n4\n\n", "3\n 4")
    assert not output_matches("3\n", "3\n4")  # open-r1 (zip) would pass a missing last line
    assert not output_matches("34", "3\n4") and not output_matches("", "0")


def test_scores_by_hand():
    wrong_on_5 = SUM.replace("print(a + b)", "print(0 if a == 5 else a + b)")
    assert compute_score("code", fenced(SUM), INFO) == {"score": 1.0, "acc": True, "pred": "4/4"}
    assert compute_score("code", fenced(wrong_on_5), json.dumps(INFO)) == {"score": 0.75, "acc": False, "pred": "3/4"}
    assert compute_score("code_binary", fenced(wrong_on_5), INFO)["score"] == 0.0
    assert compute_score("code_binary", fenced(SUM), INFO)["score"] == 1.0
    assert compute_score("code", "I cannot write code.", INFO)["score"] == 0.0
    crashing = "raise SystemExit(3)"
    assert compute_score("code", fenced(crashing), INFO)["score"] == 0.0


def test_ioi_subtasks_score_their_points_when_all_their_cases_pass():
    # the program is wrong when a == 5: subtask 1 (30 points) has such a case, subtask 0 (20) does not
    info = {"language": "python", "subtasks": [{"points": 20, "test_cases": [CASES[0], CASES[2]]},
                                               {"points": 30, "test_cases": [CASES[1], CASES[3]]},
                                               {"points": 50, "test_cases": [CASES[3]]}]}
    wrong_on_5 = SUM.replace("print(a + b)", "print(0 if a == 5 else a + b)")
    assert compute_score("ioi", fenced(wrong_on_5), info) == {"score": 0.7, "acc": False, "pred": "70/100 points"}
    assert compute_score("ioi", fenced(SUM), info)["acc"] is True


def test_code_format_as_open_r1():
    good = "<think>\nadd them\n</think>\n<answer>\n```python\nprint(1)\n```\n</answer>"
    assert compute_score("code_format", good, INFO)["score"] == 1.0
    assert compute_score("code_format", good.replace("python", "cpp"), INFO)["score"] == 0.0
    assert compute_score("code_format", "```python\nprint(1)\n```", INFO)["score"] == 0.0


@pytest.mark.parametrize("info, words", [
    (None, "must be a dict"),
    ("{not json", "not valid JSON"),
    ({"test_cases": CASES}, "language None"),
    ({"language": "rust", "test_cases": CASES}, "language 'rust'"),
    ({"language": "python"}, "no test_cases"),
    ({"language": "python", "test_cases": [{"input": "1"}]}, "test case 0 needs string 'input' and 'output'"),
    ({"language": "python", "test_cases": [{"input": "1", "output": "1", "type": "function_call"}]}, "stdin_stdout"),
])
def test_a_malformed_verification_info_is_an_error_naming_the_row(info, words):
    with pytest.raises(ValueError, match=f"row 17.*{words}"):
        compute_score("code", fenced(SUM), info, {"index": 17})


@pytest.fixture
def service():
    from megarl.http_server import BackgroundServer
    from megarl.reward.sandbox import LocalSandbox
    from megarl.reward.sandbox_service import create_sandbox_app

    app = create_sandbox_app(LocalSandbox(), api_key="k3y", max_concurrency=1, max_queue=1)
    with BackgroundServer(app) as server:
        yield server.url


def test_the_service_gives_the_local_results_with_the_key(service, monkeypatch):
    from megarl.reward.sandbox_service import SandboxClient

    wrong_on_5 = SUM.replace("print(a + b)", "print(0 if a == 5 else a + b)")
    monkeypatch.setenv("MEGARL_SANDBOX_API_KEY", "k3y")
    for code in (SUM, wrong_on_5):
        local = compute_score("code", fenced(code), INFO)
        assert compute_score("code", fenced(code), INFO, code_sandbox_url=service) == local
    assert httpx.get(f"{service}/health").json()["healthy"] is True  # open without the key
    with pytest.raises(RuntimeError, match="401"):
        SandboxClient(service, api_key="wrong").run("python", SUM, ["1 2\n"])


def test_the_service_refuses_past_its_queue(service):
    from megarl.reward.sandbox_service import SandboxClient

    client = SandboxClient(service, api_key="k3y")
    outcomes = []

    def slow():
        try:
            outcomes.append(client.run("python", "import time\ntime.sleep(1.5)\nprint(1)", ["\n"])[0].stdout)
        except RuntimeError as e:
            outcomes.append(str(e))

    threads = [threading.Thread(target=slow) for _ in range(3)]  # one runs, one waits, one is refused
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert outcomes.count("1\n") == 2
    (refused,) = [o for o in outcomes if o != "1\n"]
    assert "answered 503" in refused and "queue is full" in refused


@pytest.mark.slow
def test_a_ray_run_starts_sandbox_services_and_its_reward_workers_use_them(tmp_path):
    # reward.sandbox_servers under cluster.launcher=ray: a sandbox service per server, spread over
    # the nodes; the reward actor's workers send the code rewards to it with its key
    from dataclasses import replace

    import ray

    from megarl.config import load_config
    from megarl.quickstart import CodeSettings, prepare_code
    from megarl.reward import RewardRequest
    from megarl.runtime import build_runtime

    out = prepare_code(tmp_path / "code", replace(CodeSettings(), num_val=2, vocab_size=300, hidden_size=32, steps=2,
                                                  batch_size=4))
    cfg = load_config(None, [f"model.path={out / 'model'}", f"data.train_files=[{out / 'data' / 'train.parquet'}]",
                             "cluster.launcher=ray", "reward.sandbox_servers=1", "reward.num_workers=1",
                             f"trainer.output_dir={tmp_path / 'run'}", "agent.max_turns=0"])
    runtime = build_runtime(cfg, total_steps=1)
    try:
        assert "sandbox services on 127.0.0.1" in runtime.placement()
        url = ray.get(runtime.sandbox_actors[0].url.remote())
        wrong_on_5 = SUM.replace("print(a + b)", "print(0 if a == 5 else a + b)")
        requests = [RewardRequest("code", fenced(code), INFO) for code in (SUM, wrong_on_5)]
        results, _ = runtime.reward_pool.compute(requests)
        assert [(r.score, r.error) for r in results] == [(1.0, None), (0.75, None)]
        assert httpx.get(f"{url}/health").json()["served"] == 2  # both through the service
        assert httpx.post(f"{url}/run", json={"language": "python", "source": SUM, "inputs": ["1 2\n"]}).status_code == 401
    finally:
        runtime.shutdown()
