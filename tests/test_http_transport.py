"""megarl.http_transport: httpx's API over aiohttp's pool, thousands of requests in flight at
once (a fleet's /generate calls through the router), and a lost connection raised as the httpx
error the fleet retries."""

import asyncio
import contextlib
import threading
from unittest import mock

import aiohttp
import httpx
import pytest

from megarl.http_transport import PooledTransport
from megarl.retrieval.client import RetrievalClient
from megarl.rollout.engine import SamplingParams
from megarl.rollout.http import HTTPEngine


async def start_server(handle, connections: list | None = None):
    """An HTTP/1.1 server on 127.0.0.1 whose `handle(body)` gives each POST's JSON answer (or None: close
    the connection without one); each connection it accepts is appended to `connections`."""
    async def serve(reader, writer):
        if connections is not None:
            connections.append(writer)
        while head := await reader.readuntil(b"\r\n\r\n"):
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
            answer = await handle(await reader.readexactly(length))
            if answer is None:
                writer.close()
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(answer), answer))
            await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def test_hundreds_of_generate_calls_are_in_flight_at_once():
    # the server answers none until all 300 have arrived: httpx's own pool (100 connections by
    # default) would hold the rest back and never get there
    calls = 300

    async def go():
        arrived, everyone = [0], asyncio.Event()

        async def handle(body):
            arrived[0] += 1
            if arrived[0] == calls:
                everyone.set()
            await everyone.wait()
            return (b'{"output_ids": [7], "meta_info": {"finish_reason": {"type": "length", "length": 1}, '
                    b'"output_token_logprobs": [[-0.25, 7, null]], "prompt_tokens": 2}}')

        server, url = await start_server(handle)
        engine = HTTPEngine(url)
        try:
            outs = await asyncio.wait_for(asyncio.gather(*[engine.generate([1, 2], SamplingParams(max_new_tokens=1))
                                                           for _ in range(calls)]), 30)
        finally:
            await engine.close()
            server.close()
        return outs

    outs = asyncio.run(go())
    assert [(o.token_ids, o.log_probs, o.finish_reason) for o in outs] == [([7], [-0.25], "length")] * calls


@pytest.mark.parametrize("server_does, error", [
    ("refuses", httpx.ConnectError),  # nothing listens on the port
    ("closes", httpx.RemoteProtocolError),  # the connection ends before an answer (a server that died)
    ("stalls", httpx.ReadTimeout),  # no answer within the client's timeout
])
def test_transport_failures_are_httpx_transport_errors(server_does, error):
    async def go():
        async def handle(body):
            if server_does == "stalls":
                await asyncio.sleep(5)
            return None

        server, url = await start_server(handle)
        if server_does == "refuses":
            server.close()
            await server.wait_closed()
        async with httpx.AsyncClient(transport=PooledTransport(), timeout=0.5) as client:
            try:
                await client.post(url + "/generate", json={"input_ids": [1]})
            finally:
                server.close()

    with pytest.raises(error) as failed:
        asyncio.run(go())
    assert isinstance(failed.value, httpx.TransportError)  # what SGLangFleet.generate re-sends after a health pass


@pytest.mark.parametrize("keepalive_s, connections", [(0.1, 2), (30.0, 1)])
def test_an_idle_connection_is_reused_within_its_keepalive_only(keepalive_s, connections):
    # a server that keeps idle connections open (the router) is given longer than uvicorn's 5 s
    async def go():
        accepted = []

        async def handle(body):
            return b'{"ok": true}'

        server, url = await start_server(handle, accepted)
        engine = HTTPEngine(url, keepalive_s=keepalive_s)
        try:
            await engine.post("/x", {})
            await asyncio.sleep(0.3)
            await engine.post("/x", {})
        finally:
            await engine.close()
            server.close()
        return len(accepted)

    assert asyncio.run(go()) == connections


class JSONServer:
    """An HTTP server on 127.0.0.1 in threads of its own, answering every request `{"result": [[]]}`
    (a retrieval answer, and a control answer an HTTPEngine takes); `keep_alive`: whether it keeps
    a connection open after its answer. It closes its own sockets, so that every unclosed one
    left at the end is the client's."""

    def __init__(self, keep_alive: bool = True):
        import http.server

        class Answer(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", "16")
                self.end_headers()
                self.wfile.write(b'{"result": [[]]}')

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def nothing_left_unclosed():
    """Fails unless every aiohttp session the block makes is closed at its end, with its connector
    (what aiohttp's "Unclosed client session" and "Unclosed connector" errors report when the
    garbage collector finds one open). The sessions are held until then, so the check does not
    depend on when the collector runs, nor on what earlier tests on the same worker left to it."""
    made = []
    make = aiohttp.ClientSession.__init__

    def record(session, *args, **kwargs):
        made.append(session)
        make(session, *args, **kwargs)

    with mock.patch.object(aiohttp.ClientSession, "__init__", record):
        yield
    assert made, "the block made no session: nothing was checked"
    assert [s for s in made if not s.closed] == []
    assert [s for s in made if s.connector is not None and not s.connector.closed] == []


def test_an_engine_s_sessions_are_closed_across_event_loops():
    # the trainer may run each step's rollouts in a fresh loop (asyncio.run): each loop's session
    # is closed at its end, and the engine's close closes the current one
    server = JSONServer()
    try:
        with nothing_left_unclosed():
            engine = HTTPEngine(server.url)
            for _ in range(2):
                asyncio.run(engine.post("/x", {}))
            asyncio.run(engine.post("/x", {}))
            asyncio.run(engine.close())
            del engine
    finally:
        server.close()


def test_an_engine_used_in_a_loop_closed_without_asyncio_run_detaches_its_session():
    # a loop closed by hand can run nothing more, not even the session's close: it is let go
    # without aiohttp's warnings when the next loop comes (the server closes its connections)
    server = JSONServer(keep_alive=False)
    try:
        with nothing_left_unclosed():
            engine = HTTPEngine(server.url)
            loop = asyncio.new_event_loop()
            loop.run_until_complete(engine.post("/x", {}))
            loop.close()
            asyncio.run(engine.post("/x", {}))
            loop = asyncio.new_event_loop()
            loop.run_until_complete(engine.post("/x", {}))
            loop.close()
            asyncio.run(engine.close())
            del engine, loop
    finally:
        server.close()


def test_an_engine_closes_the_session_of_a_loop_running_in_another_thread():
    server = JSONServer()
    other = asyncio.new_event_loop()
    thread = threading.Thread(target=other.run_forever, daemon=True)
    thread.start()
    try:
        with nothing_left_unclosed():
            engine = HTTPEngine(server.url)
            asyncio.run_coroutine_threadsafe(engine.post("/x", {}), other).result(10)
            asyncio.run(engine.post("/x", {}))  # the other loop's client is still its own
            asyncio.run(engine.close())
            other.call_soon_threadsafe(other.stop)
            thread.join(10)
            other.close()
            del engine
    finally:
        server.close()


def test_a_retrieval_client_s_sessions_are_closed():
    server = JSONServer()
    try:
        with nothing_left_unclosed():
            client = RetrievalClient(server.url, max_retries=0)
            for _ in range(2):
                assert asyncio.run(client.search(["q"]))[0].error is None
            asyncio.run(client.search(["q"]))
            asyncio.run(client.aclose())
            del client
    finally:
        server.close()


@pytest.mark.parametrize("shutdown_fails", [False, True])
def test_a_run_s_close_closes_its_retrieval_client(shutdown_fails):
    # the searches run on the driver loop, which lives as long as the process: without a close
    # the session is left to the interpreter's exit; a runtime that fails to shut down changes nothing
    from megarl.components import Components
    from megarl.driver_loop import run_async

    class Runtime:
        def shutdown(self):
            if shutdown_fails:
                raise RuntimeError("a node is gone")

    server = JSONServer()
    try:
        with nothing_left_unclosed():
            client = RetrievalClient(server.url, max_retries=0)
            assert run_async(client.search(["q"]))[0].error is None
            with pytest.raises(RuntimeError) if shutdown_fails else contextlib.nullcontext():
                Components(None, None, [], [], None, Runtime(), client, None, 1, 0).close()
            del client
    finally:
        server.close()


def test_a_server_that_accepts_and_never_answers_ends_in_httpx_s_read_timeout_in_time():
    # the kernel accepts the connection; nobody reads or answers. Each call ends within its
    # deadline, in the error it had under httpx: generate's a ReadTimeout naming the server (the
    # fleet re-sends it after a health pass), a health check's False, a control call's RuntimeError
    import socket

    from megarl.rollout.sglang import _connection_lost

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def timed(call):
        t0 = asyncio.get_running_loop().time()
        try:
            return await call, asyncio.get_running_loop().time() - t0
        except Exception as e:
            return e, asyncio.get_running_loop().time() - t0

    async def go():
        engine = HTTPEngine(url, timeout_s=1.0)
        try:
            return (await timed(engine.generate([1, 2], SamplingParams(max_new_tokens=1))),
                    await timed(engine.health(timeout_s=0.1)), await timed(engine.post("/pause_generation", {})))
        finally:
            await engine.close()

    try:
        (lost, lost_s), (healthy, health_s), (refused, post_s) = asyncio.run(go())
    finally:
        sock.close()
    assert isinstance(lost, httpx.ReadTimeout) and _connection_lost(lost)
    assert f"{url}/generate" in str(lost) and str(lost.request.url) == f"{url}/generate"
    # each call ends at its own deadline (the lower bounds), not at another's or never: the
    # upper bounds leave a loaded machine seconds of slack and are still far below a missing
    # deadline (the server never answers; pytest's timeout would end the test)
    assert 1.0 <= lost_s < 10
    assert healthy is False and 0.1 <= health_s < 1.0
    assert isinstance(refused, RuntimeError) and _connection_lost(refused)
    assert str(refused).startswith(f"{url}/pause_generation failed: ReadTimeout") and 1.0 <= post_s < 10


class FailingSession:
    """An aiohttp session whose every request fails with `error`."""

    closed = False

    def __init__(self, error):
        self.error = error

    def request(self, *args, **kwargs):
        error = self.error

        class Failing:
            async def __aenter__(self):
                raise error

            async def __aexit__(self, *exc):
                return False

        return Failing()


@pytest.mark.parametrize("aiohttp_error, httpx_error", [
    (aiohttp.ConnectionTimeoutError(), httpx.ConnectTimeout),  # no connection within connect_s
    (aiohttp.SocketTimeoutError(), httpx.ReadTimeout),  # no answer within read_s
    (asyncio.TimeoutError(), httpx.ReadTimeout),
    (aiohttp.ServerDisconnectedError(), httpx.RemoteProtocolError),  # the server died mid-answer
    (aiohttp.ClientPayloadError("cut short"), httpx.RemoteProtocolError),
    (aiohttp.ClientOSError(104, "Connection reset by peer"), httpx.NetworkError),
])
def test_aiohttp_s_errors_are_httpx_s_naming_the_request(aiohttp_error, httpx_error):
    from megarl.rollout.sglang import _connection_lost

    async def go():
        transport = PooledTransport()
        transport._session = FailingSession(aiohttp_error)
        await transport.send("POST", "http://engine-3:30000/generate", [], b"{}", 5.0, 60.0)

    with pytest.raises(httpx_error) as failed:
        asyncio.run(go())
    assert type(failed.value) is httpx_error and _connection_lost(failed.value)  # re-sent after a health pass
    assert str(failed.value).startswith("POST http://engine-3:30000/generate: ")
    assert str(failed.value.request.url) == "http://engine-3:30000/generate"


def test_a_retrieval_client_that_fails_to_close_leaves_the_run_s_shutdown_done():
    from megarl.components import Components

    shut = []

    class Runtime:
        def shutdown(self):
            shut.append(True)

    class Searcher:
        async def aclose(self):
            raise RuntimeError("broken")

    with pytest.raises(RuntimeError, match="broken"):
        Components(None, None, [], [], None, Runtime(), Searcher(), None, 1, 0).close()
    assert shut == [True]  # the engines and servers are stopped all the same
