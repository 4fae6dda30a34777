"""The retrieval server's API key: optional on loopback (Search-R1's own client sends none),
required to bind any other address unless the user allows unauthenticated access; with a key,
/retrieve refuses requests without it (401) and /health stays open; megarl's client sends it
and is told at start when the server refuses it."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from megarl.retrieval import Document, RetrievalClient, write_jsonl_corpus
from megarl.retrieval.commands import add_retrieval_commands
from megarl.retrieval.errors import RetrievalError
from megarl.retrieval.server import BackgroundServer, check_bind, create_app
from test_retrieval_client import EchoRetriever

KEY = "retrieval-key-of-this-run"


@pytest.mark.parametrize("host, key, allowed, starts", [
    ("127.0.0.1", None, False, True),
    ("127.0.0.2", None, False, True),  # all of 127/8 is loopback
    ("localhost", None, False, True),
    ("::1", None, False, True),
    ("0.0.0.0", None, False, False),  # every interface
    ("::", None, False, False),
    ("192.0.2.7", None, False, False),  # a node's address (the slurm recipes bind it)
    ("node12", None, False, False),  # a name may resolve to any address
    ("0.0.0.0", KEY, False, True),
    ("192.0.2.7", None, True, True),  # --allow-unauthenticated
])
def test_check_bind(host, key, allowed, starts):
    if starts:
        check_bind(host, key, allowed)
    else:
        with pytest.raises(RetrievalError, match=r"MEGARL_RETRIEVAL_API_KEY.*--allow-unauthenticated"):
            check_bind(host, key, allowed)


def parse(argv):
    parser = argparse.ArgumentParser(prog="megarl")
    add_retrieval_commands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_serve_refuses_an_open_address_without_a_key_before_loading_the_index(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MEGARL_RETRIEVAL_API_KEY", raising=False)
    args = parse(["retrieval", "serve", "--index", str(tmp_path / "no-index-here"), "--host", "0.0.0.0"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "--host 0.0.0.0 can be reached from other machines" in err
    assert "no-index-here" not in err  # refused before the index was opened


@pytest.fixture
def keyed():
    with BackgroundServer(create_app(EchoRetriever(), api_key=KEY)) as server:
        yield server


@pytest.mark.parametrize("headers", [{}, {"Authorization": f"Bearer {KEY}x"}, {"Authorization": KEY}])
def test_retrieve_needs_the_key(keyed, headers):
    answer = httpx.post(keyed.url + "/retrieve", json={"queries": ["q"]}, headers=headers, timeout=30)
    assert answer.status_code == 401 and "Authorization: Bearer" in answer.json()["message"]


def test_health_is_open_and_the_key_is_taken(keyed):
    assert httpx.get(keyed.url + "/health", timeout=30).status_code == 200
    answer = httpx.post(keyed.url + "/retrieve", json={"queries": ["q"], "topk": 2},
                        headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert answer.status_code == 200
    assert [d["id"] for d in answer.json()["result"][0]] == ["q/0", "q/1"]


def test_megarls_client_sends_the_key(keyed):
    async def go(client):
        try:
            return await client.search(["cat"], topk=1)
        finally:
            await client.aclose()

    (found,) = asyncio.run(go(RetrievalClient(keyed.url, api_key=KEY, max_retries=0)))
    assert found.ok and [d.id for d in found.docs] == ["cat/0"]
    (refused,) = asyncio.run(go(RetrievalClient(keyed.url, max_retries=3, backoff_s=0.01)))
    assert refused.error.startswith("retrieval request rejected (HTTP 401): no Authorization header")


def test_check_access_tells_a_refused_key_at_start(keyed):
    assert RetrievalClient(keyed.url, api_key=KEY).check_access() is None
    assert "HTTP 401: wrong API key" in RetrievalClient(keyed.url, api_key="other").check_access()
    assert "HTTP 401: no Authorization header" in RetrievalClient(keyed.url).check_access()
    with BackgroundServer(create_app(EchoRetriever())) as open_server:  # no key: Search-R1's client works too
        assert RetrievalClient(open_server.url).check_access() is None
        assert httpx.post(open_server.url + "/retrieve", json={"queries": []}, timeout=30).json() == {"result": []}
    assert RetrievalClient("http://127.0.0.1:1").check_access() is None  # not up: left to the searches


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(180)
def test_megarl_retrieval_serve_on_every_interface_with_the_key_from_the_environment(tmp_path):
    corpus = write_jsonl_corpus(tmp_path / "c.jsonl", [Document("0", "The cat sat."), Document("1", "dog")])
    build = subprocess.run([sys.executable, "-m", "megarl.cli", "retrieval", "build", "--corpus", str(corpus), "--out",
                            str(tmp_path / "idx"), "--quiet"], capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    port = free_port()
    env = {**os.environ, "MEGARL_RETRIEVAL_API_KEY": KEY}
    server = subprocess.Popen([sys.executable, "-m", "megarl.cli", "retrieval", "serve", "--index", str(tmp_path / "idx"),
                               "--host", "0.0.0.0", "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        assert server.poll() is None, server.stderr.read().decode()
        assert httpx.post(url + "/retrieve", json={"queries": ["cat"]}, timeout=30).status_code == 401
        answer = httpx.post(url + "/retrieve", json={"queries": ["cat"]}, headers={"Authorization": f"Bearer {KEY}"},
                            timeout=30)
        assert answer.status_code == 200 and answer.json()["result"][0][0]["id"] == "0"
        with open(f"/proc/{server.pid}/cmdline", "rb") as f:
            assert KEY.encode() not in f.read()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def test_the_server_a_run_starts_takes_the_runs_key_and_its_client_sends_it(tmp_path, monkeypatch):
    """build_components with megarl's own retrieval server (the quickstart's, in this process):
    a fresh key when none is configured, the server refuses requests without it, the run's
    searches carry it."""
    from megarl.components import build_components
    from megarl.config import load_config
    from megarl.quickstart import prepare
    from test_quickstart import CONFIG, TINY

    monkeypatch.chdir(tmp_path)  # the config's paths are relative: outputs/quickstart/...
    monkeypatch.delenv("MEGARL_RETRIEVAL_API_KEY", raising=False)
    prepare(Path("outputs/quickstart"), TINY)
    cfg = load_config(str(CONFIG), ["cluster.launcher=inprocess", "agent.retrieval.port=0"])
    c = build_components(cfg)
    try:
        key = c.runtime.retrieval_api_key
        assert key and len(key) >= 43
        url = c.runtime.retrieval_url + "/retrieve"
        assert httpx.post(url, json={"queries": ["q"]}, timeout=30).status_code == 401
        (found,) = asyncio.run(c.searcher.search(["q"], topk=1))
        assert found.ok  # refused, it would carry the 401 as its error
    finally:
        c.close()
