"""API keys on megarl's servers: the embedded engine server (`create_engine_app`, `python -m
megarl.rollout.serve`) refuses every route but the health checks without `Authorization:
Bearer <key>`, as SGLang's `--api-key` does; refused requests never reach the engine; the key
is compared in constant time, travels to server processes through the environment only, and
stays out of the saved config and the tracker's params. The fleet's servers and router with
a generated key are in tests/test_sglang_fleet.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from fastapi.testclient import TestClient

from megarl import http_auth
from megarl.config import load_config
from megarl.config_loader import dump_config, flatten_config
from megarl.rollout import sglang_api
from megarl.rollout.engine import GenerationOutput
from megarl.rollout.http import create_engine_app

KEY = "s3cret-key_of-this-run"


class RecordingEngine:
    """Answers as a healthy engine would and records every call a route makes."""
    weight_version = 0

    def __init__(self):
        self.calls = []

    async def generate(self, ids, params):
        self.calls.append("generate")
        return GenerationOutput(token_ids=[3], log_probs=[-0.5], finish_reason="length")

    async def health(self):
        self.calls.append("health")
        return True

    async def weight_checksums(self):
        self.calls.append("weight_checksums")
        return {}

    def __getattr__(self, name):  # pause, resume, flush_cache, release/resume_memory, update_weights
        async def call(*args, **kwargs):
            self.calls.append(name)
        return call


def route_table() -> list[tuple[str, str]]:
    """(path, method) of every route the embedded server serves, read from the app itself: a
    route added later is covered without touching this file."""
    app = create_engine_app(RecordingEngine(), api_key=KEY)
    return sorted((r.path, sorted(r.methods - {"HEAD"})[0]) for r in app.routes if getattr(r, "methods", None))


ROUTES = route_table()
GUARDED = [(p, m) for p, m in ROUTES if not sglang_api.open_without_key(p)]


@pytest.fixture
def served():
    engine = RecordingEngine()
    with TestClient(create_engine_app(engine, api_key=KEY)) as client:
        yield client, engine


def test_the_route_table_is_the_servers():
    """What is open and what is guarded, worked out from SGLang 0.5.23's rule (paths that start
    with /health, /ready or /metrics are open) and the routes megarl's server has."""
    paths = {p for p, _ in ROUTES}
    assert {"/health", "/health_generate"} == paths - {p for p, _ in GUARDED}
    assert {"/generate", "/pause_generation", "/continue_generation", "/flush_cache", "/release_memory_occupation",
            "/resume_memory_occupation", "/update_weights_from_disk", "/init_weights_update_group",
            "/destroy_weights_update_group", "/update_weights_from_distributed", "/update_weights_from_tensor",
            "/get_server_info", "/get_model_info", "/weight_checksums", "/openapi.json", "/docs"} <= paths


@pytest.mark.parametrize("path, method", GUARDED)
@pytest.mark.parametrize("authorization, why", [
    (None, "no Authorization header"),
    (f"Bearer {KEY}x", "wrong API key"),
    (f"Bearer {KEY[:-1]}", "wrong API key"),
    (f"Basic {KEY}", "wrong API key"),
    (KEY, "wrong API key"),
    ("Bearer ", "wrong API key"),
])
def test_every_guarded_route_refuses_a_request_without_the_key(served, path, method, authorization, why):
    client, engine = served
    headers = {"Authorization": authorization} if authorization is not None else {}
    response = client.request(method, path, json={}, headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"] == "Unauthorized" and why in response.json()["message"]
    assert KEY not in response.text
    assert engine.calls == []  # the request never reached the engine


@pytest.mark.parametrize("path, method", GUARDED)
def test_every_guarded_route_takes_the_key(served, path, method):
    client, _ = served
    for scheme in ("Bearer", "bearer"):  # the scheme is case-insensitive (RFC 7235), the key is not
        response = client.request(method, path, json={}, headers={"Authorization": f"{scheme} {KEY}"})
        assert response.status_code != 401, response.text


def test_with_the_key_the_routes_do_their_work(served):
    client, engine = served
    auth = {"Authorization": f"Bearer {KEY}"}
    generated = client.post("/generate", json={"input_ids": [5, 6]}, headers=auth)
    assert generated.status_code == 200 and generated.json()["output_ids"] == [3]
    assert client.post("/pause_generation", json={"mode": "retract"}, headers=auth).json()["status"] == "ok"
    assert client.post("/continue_generation", json={}, headers=auth).json()["status"] == "ok"
    assert engine.calls == ["generate", "pause", "resume"]


@pytest.mark.parametrize("path, status", [("/health", 200), ("/health_generate", 200)])
def test_the_health_checks_answer_without_the_key(served, path, status):
    client, _ = served
    assert client.get(path).status_code == status


def test_no_key_no_check():
    with TestClient(create_engine_app(RecordingEngine())) as client:
        assert client.post("/pause_generation", json={"mode": "retract"}).status_code == 200


@pytest.mark.parametrize("path, is_open", [
    ("/health", True), ("/health_generate", True), ("/ready", True), ("/readiness", False), ("/metrics", True),
    ("/generate", False), ("/get_server_info", False), ("/update_weights_from_disk", False), ("/", False),
    ("/docs", False), ("/HEALTH", False), ("/v1/health", False),
])
def test_open_paths_are_sglangs(path, is_open):
    assert sglang_api.open_without_key(path) is is_open


@pytest.mark.parametrize("authorization, expected", [
    (f"Bearer {KEY}", True), (f"bearer {KEY}", True), (f"BEARER {KEY}", True),
    (f"Bearer {KEY} ", False), (f"Bearer  {KEY}", False), (f"Bearer {KEY.upper()}", False),
    (f"Bearer{KEY}", False), (f"Token {KEY}", False), (KEY, False), ("", False), (None, False),
])
def test_key_matches(authorization, expected):
    assert http_auth.key_matches(authorization, KEY) is expected


def test_the_key_is_compared_in_constant_time(monkeypatch):
    compared = []
    monkeypatch.setattr(http_auth.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or a == b)
    assert http_auth.key_matches(f"Bearer {KEY}", KEY)
    assert compared == [(KEY.encode(), KEY.encode())]


def test_generated_keys_are_fresh_and_long():
    keys = {http_auth.new_api_key() for _ in range(100)}
    assert len(keys) == 100 and all(len(k) >= 43 for k in keys)  # 32 random bytes, base64


def test_bearer_headers():
    assert http_auth.bearer(KEY) == {"Authorization": f"Bearer {KEY}"}
    assert http_auth.bearer(None) == {} and http_auth.bearer("") == {}


# -- the key off the command line: megarl.rollout.with_api_key --------------------------------

SHOWS_ITSELF = """
    import multiprocessing, os, sys

    def child(queue):
        queue.put(os.environ.get("MEGARL_ENGINE_API_KEY"))

    if __name__ == "__main__":  # as sglang.launch_server: its workers are spawned processes
        with open("/proc/self/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\\0", b" ").decode()
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        worker = ctx.Process(target=child, args=(queue,))
        worker.start()
        worker.join(60)
        print(repr(sys.argv[1:]), repr(os.environ.get("MEGARL_ENGINE_API_KEY")), repr(cmdline), queue.get(timeout=5),
              worker.exitcode, sep="\\n")
"""


def test_with_api_key_hands_the_key_to_the_module_not_the_command_line(tmp_path):
    (tmp_path / "shows_itself.py").write_text(textwrap.dedent(SHOWS_ITSELF))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]), "MEGARL_ENGINE_API_KEY": KEY}
    done = subprocess.run([sys.executable, "-m", "megarl.rollout.with_api_key", "shows_itself", "--port", "5"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    argv, env_seen, cmdline, child_env, child_exit = done.stdout.splitlines()
    assert argv == repr(["--port", "5", f"--api-key={KEY}"])  # what the server parses
    assert env_seen == "None" and child_env == "None"  # gone from the environment its children inherit
    assert KEY not in cmdline and "shows_itself --port 5" in cmdline  # what `ps` shows
    assert child_exit == "0"


PARSES_ITS_KEY = """
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int)
    parser.add_argument("--api-key")
    print(parser.parse_args().api_key)
"""


def test_a_key_that_starts_with_a_dash_reaches_an_argparse_server(tmp_path):
    # token_urlsafe keys start with "-" one time in 64; as a separate argument argparse takes
    # such a key for an option and the server exits ("--api-key: expected one argument")
    (tmp_path / "parses_its_key.py").write_text(textwrap.dedent(PARSES_ITS_KEY))
    key = "-" + KEY
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]), "MEGARL_ENGINE_API_KEY": key}
    done = subprocess.run([sys.executable, "-m", "megarl.rollout.with_api_key", "parses_its_key", "--port", "5"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == key


def test_with_api_key_refuses_to_start_without_a_key():
    env = {k: v for k, v in os.environ.items() if k != "MEGARL_ENGINE_API_KEY"}
    done = subprocess.run([sys.executable, "-m", "megarl.rollout.with_api_key", "json.tool"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "MEGARL_ENGINE_API_KEY is not set" in done.stderr


# -- the key out of the saved config and the tracker's params ---------------------------------

def test_a_key_in_the_config_is_in_no_dump():
    cfg = load_config(None, [f"rollout.sglang.api_key={KEY}"])
    assert cfg.rollout.sglang.api_key == KEY  # the run uses it
    assert KEY not in dump_config(cfg)  # config.yaml, the tracker's config.yaml artifact, --dry-run
    params = flatten_config(cfg)  # MLflow params
    assert params["rollout.sglang.api_key"] is None and KEY not in repr(params)
    assert KEY not in repr(cfg)  # an error or a log line that prints the config


def test_a_key_on_the_servers_command_line_is_refused():
    from megarl.config import ConfigError

    with pytest.raises(ConfigError, match=r"rollout.sglang.extra_args: gives the servers an API key"):
        load_config(None, ["rollout.engine=sglang", "rollout.sglang.server=embedded", "model.path=m",
                           f"rollout.sglang.extra_args=[--api-key, {KEY}]"])


# -- the fleet's key: where it comes from, and the argv that never holds it -------------------

@pytest.mark.parametrize("configured, in_env, expected", [
    (KEY, "from-the-environment", KEY),
    (None, "from-the-environment", "from-the-environment"),
    (None, None, None),  # a fresh key per run
])
def test_the_fleets_key(monkeypatch, configured, in_env, expected):
    from megarl.config import SGLangConfig
    from megarl.rollout.sglang_launch import fleet_api_key

    if in_env is None:
        monkeypatch.delenv(http_auth.ENGINE_KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(http_auth.ENGINE_KEY_ENV, in_env)
    settings = SGLangConfig(api_key=configured)
    if expected is None:
        first, second = fleet_api_key(settings), fleet_api_key(settings)
        assert first != second and len(first) >= 43
    else:
        assert fleet_api_key(settings) == expected


@pytest.mark.parametrize("server", ["sglang", "embedded"])
def test_the_servers_and_routers_argv_hold_no_key(server):
    from megarl.rollout.sglang_launch import router_command, server_command

    cfg = load_config(None, ["model.path=m", "rollout.engine=sglang", f"rollout.sglang.server={server}",
                             f"rollout.sglang.api_key={KEY}", "cluster.gpus_per_node=1" if server == "sglang" else
                             "cluster.gpus_per_node=0"])
    engine = server_command(cfg, colocated=False)
    router = router_command(cfg.rollout.sglang, ["http://127.0.0.1:1"], 9)
    assert KEY not in " ".join(engine + router) and "--api-key" not in engine + router
    # SGLang and the router read the key from the environment through with_api_key; the embedded
    # server reads $MEGARL_ENGINE_API_KEY itself
    assert engine[1:4] == (["-m", "megarl.rollout.with_api_key", "sglang.launch_server"] if server == "sglang" else
                           ["-m", "megarl.rollout.serve", "--model-path"])
    assert router[1:4] == ["-m", "megarl.rollout.with_api_key", "sglang_router.launch_router"]
