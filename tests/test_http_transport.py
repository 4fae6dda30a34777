"""megarl.http_transport: httpx's API over aiohttp's pool, thousands of requests in flight at
once (a fleet's /generate calls through the router), and a lost connection raised as the httpx
error the fleet retries."""

import asyncio

import httpx
import pytest

from megarl.http_transport import PooledTransport
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
