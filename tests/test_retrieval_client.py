"""The async retrieval client: batching, bounded retries, and failed searches that do not raise.

Servers here are real (uvicorn on 127.0.0.1 in a background thread); "down" is a port with
a bound socket that is not listening (connection refused) or one that accepts and never answers.
"""

import asyncio
import socket
import threading
import time

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from megarl.retrieval import BackgroundServer, Document, Hit, RetrievalClient, SearchResult, create_app
from megarl.retrieval.client import parse_retrieve_response


class EchoRetriever:
    """Each query q gets topk documents "q/0", "q/1", ... with scores 1, 1/2, ...;
    `fail_first` searches raise (→ HTTP 500)."""

    kind = "echo"

    def __init__(self, fail_first=0):
        self.fail_first = fail_first
        self.calls = 0

    def __len__(self):
        return 100

    def search(self, queries, topk, return_scores=True):
        self.calls += 1
        if self.calls <= self.fail_first:
            raise RuntimeError(f"failure {self.calls}")
        return [[Hit(Document(f"{q}/{i}", f'"{q}"\ntext {i}'), 1 / (i + 1)) for i in range(topk)] for q in queries]


def search(client, queries, topk=3):
    return asyncio.run(client.search(queries, topk))


def unused_port_socket():
    """A bound socket that does not listen: connecting to its port is refused until a server uses it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def test_search_returns_documents_and_scores_per_query():
    with BackgroundServer(create_app(EchoRetriever())) as server:
        client = RetrievalClient(server.url)
        results = search(client, ["a", "b"], topk=2)
    assert results == [
        SearchResult(docs=[Document("a/0", '"a"\ntext 0'), Document("a/1", '"a"\ntext 1')], scores=[1.0, 0.5]),
        SearchResult(docs=[Document("b/0", '"b"\ntext 0'), Document("b/1", '"b"\ntext 1')], scores=[1.0, 0.5]),
    ]
    assert all(result.ok for result in results)
    assert client.stats.as_dict() == {"requests": 1, "retries": 0, "failures": 0, "failed_queries": 0}
    assert client.url == server.url + "/retrieve"
    assert RetrievalClient(server.url + "/retrieve/").url == server.url + "/retrieve"  # Search-R1's search_url


def test_large_searches_are_split_into_batches_and_kept_in_order():
    # the server takes at most 2 queries per request, so batch_size 2 is required
    with BackgroundServer(create_app(EchoRetriever(), max_queries=2)) as server:
        client = RetrievalClient(server.url, batch_size=2, max_concurrency=2)
        results = search(client, ["q1", "q2", "q3", "q4", "q5"], topk=1)
        assert [r.docs[0].id for r in results] == ["q1/0", "q2/0", "q3/0", "q4/0", "q5/0"]
        assert client.stats.requests == 3  # 2 + 2 + 1
        assert search(client, [], topk=1) == []  # the same client on a new event loop


def test_a_server_that_fails_twice_is_retried_until_it_answers():
    retriever = EchoRetriever(fail_first=2)
    with BackgroundServer(create_app(retriever)) as server:
        client = RetrievalClient(server.url, max_retries=3, backoff_s=0.01)
        [result] = search(client, ["q"], topk=1)
    assert result.ok and result.docs == [Document("q/0", '"q"\ntext 0')]
    assert client.stats.as_dict() == {"requests": 3, "retries": 2, "failures": 0, "failed_queries": 0}


def test_a_server_that_starts_late_is_reached_by_retrying():
    sock = unused_port_socket()
    port = sock.getsockname()[1]
    server = BackgroundServer(create_app(EchoRetriever()), sock=sock)
    timer = threading.Timer(0.3, server.start)
    timer.start()
    try:
        # backoff 0.1 s doubling (at least half of it): the 6th retry comes after >= 3.15 s
        client = RetrievalClient(f"http://127.0.0.1:{port}", max_retries=6, backoff_s=0.1)
        [result] = search(client, ["q"], topk=1)
    finally:
        timer.join()
        server.stop()
    assert result.ok and result.docs[0].id == "q/0"
    assert client.stats.retries >= 1 and client.stats.failures == 0


def test_an_outage_gives_failed_results_and_counters_not_exceptions():
    sock = unused_port_socket()
    client = RetrievalClient(f"http://127.0.0.1:{sock.getsockname()[1]}", max_retries=3, backoff_s=0.01)
    t0 = time.monotonic()
    results = search(client, ["q1", "q2"])
    elapsed = time.monotonic() - t0
    sock.close()
    assert elapsed < 5.0
    assert [r.docs for r in results] == [[], []]
    assert all(r.error.startswith("retrieval failed after 3 retries: ConnectError") for r in results)
    assert client.stats.as_dict() == {"requests": 4, "retries": 3, "failures": 1, "failed_queries": 2}


def test_a_server_that_never_answers_times_out():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # the kernel accepts connections; nobody ever reads or answers
    client = RetrievalClient(f"http://127.0.0.1:{sock.getsockname()[1]}", timeout_s=0.3, max_retries=1, backoff_s=0.01)
    t0 = time.monotonic()
    [result] = search(client, ["q"])
    elapsed = time.monotonic() - t0
    sock.close()
    assert 0.6 <= elapsed < 3.0  # two attempts of 0.3 s
    assert result.error.startswith("retrieval failed after 1 retries: no answer from")
    assert "within 0.3 s" in result.error
    assert client.stats.as_dict() == {"requests": 2, "retries": 1, "failures": 1, "failed_queries": 1}


def test_a_rejected_request_is_not_retried():
    with BackgroundServer(create_app(EchoRetriever(), max_topk=5)) as server:
        client = RetrievalClient(server.url, max_retries=3, backoff_s=0.01)
        [result] = search(client, ["q"], topk=6)
    assert result.docs == []
    assert result.error == "retrieval request rejected (HTTP 422): 'topk' must be between 1 and 5, got 6"
    assert client.stats.as_dict() == {"requests": 1, "retries": 0, "failures": 1, "failed_queries": 1}


def test_a_malformed_answer_is_a_failed_search():
    app = FastAPI()

    @app.post("/retrieve")
    async def wrong_length() -> dict:
        return {"result": []}

    with BackgroundServer(app) as server:
        client = RetrievalClient(server.url, max_retries=3, backoff_s=0.01)
        [result] = search(client, ["q"])
    assert result.error.startswith("malformed answer from")
    assert "with 1 lists" in result.error
    assert client.stats.requests == 1


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"result": [[]]}, [SearchResult(docs=[], scores=[])]),
        (  # scored, as requested by Search-R1's agent
            {"result": [[{"document": {"id": "5", "contents": "c"}, "score": 2}]]},
            [SearchResult(docs=[Document("5", "c")], scores=[2.0])],
        ),
        (  # unscored: plain documents
            {"result": [[{"id": 5, "contents": "c"}]]},
            [SearchResult(docs=[Document("5", "c")], scores=None)],
        ),
        (  # Search-R1's BM25 server returns title/text/contents without an id
            {"result": [[{"document": {"title": "T", "text": "x", "contents": '"T"\nx'}, "score": 1.5}]]},
            [SearchResult(docs=[Document("", '"T"\nx')], scores=[1.5])],
        ),
    ],
)
def test_parse_retrieve_response(body, expected):
    assert parse_retrieve_response(body, len(expected)) == expected


@pytest.mark.parametrize(
    "body, num_queries",
    [
        ([], 1),  # not an object
        ({"result": [[]]}, 2),  # one list for two queries
        ({"result": [{"id": "1"}]}, 1),  # a document where a list should be
        ({"result": [[{"document": {"id": "1"}}]]}, 1),  # a document without contents
    ],
)
def test_parse_retrieve_response_rejects_other_shapes(body, num_queries):
    with pytest.raises(ValueError, match="expected"):
        parse_retrieve_response(body, num_queries)


def test_programming_errors_do_raise():
    with pytest.raises(ValueError, match="must start with http:// or https://"):
        RetrievalClient("localhost:8000")
    with pytest.raises(ValueError, match="max_retries >= 0"):
        RetrievalClient("http://127.0.0.1:1", max_retries=-1)
    with pytest.raises(ValueError, match="topk"):
        search(RetrievalClient("http://127.0.0.1:1"), ["q"], topk=0)


def test_concurrent_searches_wait_for_a_free_request_and_go_together():
    # one search per trajectory, many at once: while max_concurrency requests are in flight the
    # others queue and share the next request (one per topk); a lone search goes at once
    with BackgroundServer(create_app(EchoRetriever())) as server:
        client = RetrievalClient(server.url, max_concurrency=1)

        async def many():
            return await asyncio.gather(*[client.search([f"q{i}"], 1 + (i >= 40)) for i in range(50)])

        results = asyncio.run(many())
        assert [[d.id for d in r.docs] for (r,) in results] == (
            [[f"q{i}/0"] for i in range(40)] + [[f"q{i}/0", f"q{i}/1"] for i in range(40, 50)])
        assert client.stats.requests == 3  # q0 alone; then q1-q39 (topk 1) and q40-q49 (topk 2)
        assert search(client, ["alone"], 1)[0].docs[0].id == "alone/0"
        assert client.stats.requests == 4


class FailBatchesOnce(EchoRetriever):
    """Echoes, but a request of more than one query fails (HTTP 500) the first time it comes."""

    def __init__(self):
        super().__init__()
        self.failed = set()

    def search(self, queries, topk, return_scores=True):
        if len(queries) > 1 and tuple(queries) not in self.failed:
            self.failed.add(tuple(queries))
            raise RuntimeError("batch failure")
        return super().search(queries, topk, return_scores)


def searches_behind_a_first_one(client, first, rest, topk=1, cancel=()):
    """`first` goes alone; the searches of `rest` (lists of queries) wait behind it and go together.
    Those whose index is in `cancel` are cancelled while they wait."""
    async def go():
        first_search = asyncio.ensure_future(client.search(first, topk))
        await asyncio.sleep(0)  # it is sent; the others queue behind it (max_concurrency=1)
        waiting = [asyncio.ensure_future(client.search(queries, topk)) for queries in rest]
        await asyncio.sleep(0)
        for i in cancel:
            waiting[i].cancel()
        return await first_search, await asyncio.gather(*waiting, return_exceptions=True)

    return asyncio.run(go())


def test_a_failed_request_fails_every_search_in_it_as_a_lone_search_would():
    app = FastAPI()

    @app.post("/retrieve")
    async def loading():
        return JSONResponse({"detail": "index still loading"}, status_code=503)

    with BackgroundServer(app) as server:
        alone = RetrievalClient(server.url, max_retries=1, backoff_s=0.01, max_concurrency=1)
        [lone_result] = search(alone, ["x"])
        client = RetrievalClient(server.url, max_retries=1, backoff_s=0.01, max_concurrency=1)
        first, rest = searches_behind_a_first_one(client, ["q0"], [["q1"], ["q2", "q3"], ["q4"]])
    assert lone_result.error == f"retrieval failed after 1 retries: HTTP 503 from {alone.url}: index still loading"
    assert first + [r for results in rest for r in results] == [SearchResult(error=lone_result.error)] * 5
    # two requests given up on (q0 alone, then q1-q4 together), each sent twice
    assert client.stats.as_dict() == {"requests": 4, "retries": 2, "failures": 2, "failed_queries": 5}


def test_a_failed_request_is_retried_for_every_search_in_it():
    with BackgroundServer(create_app(FailBatchesOnce())) as server:
        client = RetrievalClient(server.url, max_retries=1, backoff_s=0.01, max_concurrency=1)
        _, rest = searches_behind_a_first_one(client, ["q0"], [["q1"], ["q2", "q3"], ["q4"]])
    assert [[r.docs[0].id for r in results] for results in rest] == [["q1/0"], ["q2/0", "q3/0"], ["q4/0"]]
    assert client.stats.as_dict() == {"requests": 3, "retries": 1, "failures": 0, "failed_queries": 0}


def test_each_search_gets_the_results_of_its_own_queries():
    # searches of 1 to 3 queries, two of them cancelled while they wait, share requests of at most
    # 4 queries: every search that was not cancelled gets its queries' documents, in its order
    rest = [[f"s{i}q{j}" for j in range(1 + i % 3)] for i in range(12)]
    with BackgroundServer(create_app(EchoRetriever())) as server:
        client = RetrievalClient(server.url, max_concurrency=1, batch_size=4)
        first, results = searches_behind_a_first_one(client, ["a", "b"], rest, topk=2, cancel=(3, 7))
    assert [[d.id for d in r.docs] for r in first] == [["a/0", "a/1"], ["b/0", "b/1"]]
    for i, (queries, got) in enumerate(zip(rest, results)):
        if i in (3, 7):
            assert isinstance(got, asyncio.CancelledError)
        else:
            assert [[d.id for d in r.docs] for r in got] == [[f"{q}/0", f"{q}/1"] for q in queries]
    sent = sum(len(queries) for i, queries in enumerate(rest) if i not in (3, 7))
    assert client.stats.requests == 1 + -(-sent // 4)  # the cancelled searches' queries were not sent


def test_a_malformed_answer_to_a_shared_request_fails_all_its_searches_and_hands_none_another_s_result():
    app = FastAPI()

    @app.post("/retrieve")
    async def one_row_short(body: dict) -> dict:  # a row per query but the last
        return {"result": [[{"id": q, "contents": q}] for q in body["queries"][:-1]]}

    with BackgroundServer(app) as server:
        client = RetrievalClient(server.url, max_retries=0, max_concurrency=1)
        _, rest = searches_behind_a_first_one(client, ["q0"], [["q1"], ["q2", "q3"]])
    assert all(r.docs == [] and r.error.startswith("malformed answer from") for results in rest for r in results)
    assert client.stats.failed_queries == 4


def test_a_score_that_is_no_number_is_a_failed_search_not_an_exception():
    app = FastAPI()

    @app.post("/retrieve")
    async def null_scores(body: dict) -> dict:
        return {"result": [[{"document": {"contents": q}, "score": None}] for q in body["queries"]]}

    with BackgroundServer(app) as server:
        client = RetrievalClient(server.url, max_retries=0)
        results = search(client, ["a", "b"])
    assert [r.error for r in results] == [f"malformed answer from {client.url}: expected a number as a document's "
                                          "score, got None"] * 2


def test_a_bug_in_a_shared_request_reaches_its_searches_and_is_not_logged_as_never_retrieved(caplog, monkeypatch):
    async def broken(self, http, queries, topk):
        raise RuntimeError("a bug")

    monkeypatch.setattr(RetrievalClient, "_search_batch", broken)
    client = RetrievalClient("http://127.0.0.1:1")

    async def go():
        return await asyncio.gather(client.search(["a"]), client.search(["b"]), return_exceptions=True)

    assert [str(e) for e in asyncio.run(go())] == ["a bug", "a bug"]
    import gc

    gc.collect()
    assert [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()] == []


def test_searches_from_two_event_loops_at_once_all_end():
    # two threads with loops of their own (a test's, a tool's next to the driver loop): a search
    # queued on one is never dropped by a search on the other
    class Slow(EchoRetriever):
        def search(self, queries, topk, return_scores=True):
            time.sleep(0.05)
            return super().search(queries, topk, return_scores)

    with BackgroundServer(create_app(Slow())) as server:
        client = RetrievalClient(server.url, max_concurrency=1)
        results = {}

        def searches(name):
            async def go():
                return await asyncio.wait_for(
                    asyncio.gather(*[client.search([f"{name}{i}"], 1) for i in range(20)]), 10)
            try:
                results[name] = [r.docs[0].id for (r,) in asyncio.run(go())]
            except Exception as e:
                results[name] = repr(e)

        threads = [threading.Thread(target=searches, args=(name,)) for name in "ab"]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        asyncio.run(client.aclose())
    assert results == {name: [f"{name}{i}/0" for i in range(20)] for name in "ab"}
