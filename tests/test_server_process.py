"""The server processes of the engine fleet, without a fleet: how a ServerProcess starts,
restarts and fails (its log, its port, its environment), and how SGLangFleet tells a lost
connection from a live engine, on stand-in servers started here."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import pytest

from megarl.config import load_config
from megarl.errors import ComponentDied
from megarl.rollout.engine import SamplingParams
from megarl.rollout.sglang import SGLangFleet
from megarl.rollout.sglang_launch import ServerProcess

def test_a_request_held_after_an_abort_has_a_deadline():
    """After abort_requests, new requests wait for the sync's end; not past request_timeout_s."""
    from megarl.config import SGLangConfig

    fleet = SGLangFleet([("engine0", None, "http://127.0.0.1:9", 1)], SGLangConfig(request_timeout_s=0.3))
    fleet._open.clear()  # as abort_requests leaves it
    started = time.monotonic()
    with pytest.raises(ComponentDied, match="held 0 s .* no weight sync ended"):
        asyncio.run(fleet.generate([1, 2], SamplingParams(max_new_tokens=1)))
    assert 0.3 <= time.monotonic() - started < 5


def test_a_server_that_exits_at_start_shows_its_log(tmp_path):
    server = ServerProcess([sys.executable, "-m", "megarl.rollout.serve", "--model-path", str(tmp_path / "missing")],
                           "engine9", log_dir=str(tmp_path), api_key="key-of-engine9")
    with pytest.raises(RuntimeError, match=r"engine9 exited with status 1 while starting(.|\n)*cannot load") as failed:
        server.start(timeout_s=60)
    assert "key-of-engine9" not in str(failed.value)  # the log's tail, with the argv it was started with


# a stand-in server: writes the environment it was started with to argv[1], answers /health
ENV_SERVER = """
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
json.dump(dict(os.environ), open(sys.argv[1], "w"))
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
HTTPServer((sys.argv[sys.argv.index("--host") + 1], int(sys.argv[sys.argv.index("--port") + 1])), Health).serve_forever()
"""


def test_a_server_does_not_inherit_the_trainers_allocator_settings(tmp_path, monkeypatch):
    # expandable segments in the trainer would change how SGLang's memory saver maps memory
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("MEGARL_TEST_INHERITED", "kept")
    seen = tmp_path / "env.json"
    server = ServerProcess([sys.executable, "-c", ENV_SERVER, str(seen)], "envcheck", log_dir=str(tmp_path),
                           env={"MEGARL_TEST_OWN": "own"}, api_key="key-of-envcheck")
    try:
        server.start(timeout_s=60)
    finally:
        server.stop()
    env = json.loads(seen.read_text())
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env and "PYTORCH_ALLOC_CONF" not in env
    assert (env["MEGARL_TEST_INHERITED"], env["MEGARL_TEST_OWN"]) == ("kept", "own")
    assert env["MEGARL_ENGINE_API_KEY"] == "key-of-envcheck"


def test_a_server_whose_free_port_was_taken_first_starts_on_another(tmp_path, monkeypatch):
    # two servers of a node pick free ports at once and may be given the same; the one that
    # loses the bind exits "Address already in use" and is started again on a new port
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()  # the other process, which also answers /health: only the exit tells
    import megarl.rollout.sglang_launch as launch
    ports = iter([taken.getsockname()[1], launch.free_port()])
    monkeypatch.setattr(launch, "free_port", lambda host="127.0.0.1": next(ports))
    server = ServerProcess([sys.executable, "-c", ENV_SERVER, str(tmp_path / "env.json")], "engine3",
                           log_dir=str(tmp_path))
    lost = server.port
    try:
        url = server.start(timeout_s=60)
    finally:
        server.stop()
        taken.close()
    assert server.starts == 2 and server.port != lost and url == f"http://127.0.0.1:{server.port}"
    assert "Address already in use" in (tmp_path / "engine3.log").read_text()


# as SGLang's server on a taken port: the HTTP server logs the failed bind and gives up, while
# the scheduler it started keeps the process alive
STUCK_SERVER = """
import sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
address = (sys.argv[sys.argv.index("--host") + 1], int(sys.argv[sys.argv.index("--port") + 1]))
try:
    server = HTTPServer(address, Health)
except OSError as e:
    print(f"ERROR:    [Errno 98] error while attempting to bind on address {address}: address already in use", flush=True)
    time.sleep(600)
server.serve_forever()
"""


def test_a_server_that_lost_its_port_but_lives_on_is_started_on_another(tmp_path, monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    import megarl.rollout.sglang_launch as launch
    ports = iter([taken.getsockname()[1], launch.free_port()])
    monkeypatch.setattr(launch, "free_port", lambda host="127.0.0.1": next(ports))
    server = ServerProcess([sys.executable, "-c", STUCK_SERVER], "engine5", log_dir=str(tmp_path))
    lost = server.port
    started = time.monotonic()
    try:
        url = server.start(timeout_s=120)
        first = server.process
    finally:
        server.stop()
        taken.close()
    assert time.monotonic() - started < 60  # not the deadline's wait
    assert server.starts == 2 and server.port != lost and url == f"http://127.0.0.1:{server.port}"
    assert first.returncode is not None  # the stuck one was stopped, not left behind


def test_a_restarted_server_that_lost_its_port_fails_at_once(tmp_path):
    server = ServerProcess([sys.executable, "-c", STUCK_SERVER], "engine6", log_dir=str(tmp_path))
    server.start(timeout_s=60)
    server.stop()
    taken = socket.socket()
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    taken.bind(("127.0.0.1", server.port))
    taken.listen()
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"engine6 could not bind its port(.|\n)*address already in use"):
            server.start(timeout_s=120)
    finally:
        taken.close()
    assert time.monotonic() - started < 60 and not server.alive()


def test_a_restarted_server_keeps_its_port_and_names_the_taken_one(tmp_path):
    server = ServerProcess([sys.executable, "-c", ENV_SERVER, str(tmp_path / "env.json")], "engine4",
                           log_dir=str(tmp_path))
    server.start(timeout_s=60)
    server.stop()
    taken = socket.socket()
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the stopped server's TIME_WAIT
    taken.bind(("127.0.0.1", server.port))
    taken.listen()
    try:
        with pytest.raises(RuntimeError, match=r"engine4 exited with status 1(.|\n)*Address already in use"):
            server.start(timeout_s=60)
    finally:
        taken.close()


def test_a_server_that_never_answers_times_out_and_is_stopped(tmp_path):
    server = ServerProcess([sys.executable, "-c", "import time; print('warming up', flush=True); time.sleep(600)"],
                           "slow", log_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match=r"did not answer /health within 2 s(.|\n)*warming up"):
        server.start(timeout_s=2)
    assert not server.alive()


# a server whose connection breaks a second before its process is gone, as a killed SGLang
# server's does: the socket closes with the process's files, the process is reaped only once
# every thread has exited (seen in test-sglang: SIGKILL during a sync's /end_weight_update)
DYING_SERVER = """
import socket, struct, sys, time
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen()
open(sys.argv[1] + ".part", "w").write(str(s.getsockname()[1]))
__import__("os").replace(sys.argv[1] + ".part", sys.argv[1])
conn, _ = s.accept()
conn.recv(65536)
conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
conn.close()  # reset
time.sleep(1.0)
"""


def test_a_connection_lost_before_the_process_is_reaped_is_a_dead_engine(tmp_path):
    from gpu_harness import ServerActor

    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-c", DYING_SERVER, str(port_file)])
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        (tmp_path / "engine0.log").write_text("")
        actor = ServerActor([proc], 0, tmp_path / "engine0.log")  # its restart says it was asked
        settings = load_config(None, ["rollout.sglang.router=false"]).rollout.sglang
        fleet = SGLangFleet([("engine0", actor, f"http://127.0.0.1:{port_file.read_text()}", 1)], settings)
        # before: the process was still alive when the error came back, and the sync failed on
        # the broken connection instead of restarting the engine
        with pytest.raises(ComponentDied, match="engine0 could not be restarted: this harness server cannot be restarted"):
            asyncio.run(fleet._each("close_update_session", True))
    finally:
        proc.kill()
        proc.wait()
