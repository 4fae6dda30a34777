"""The retrieval server over real HTTP: Search-R1's request/response shapes, validation, health.

Shapes (search_r1/search/retrieval_server.py): POST /retrieve {"queries", "topk", "return_scores"}
→ {"result": [[{"document": {...}, "score": s}, ...]]} with scores, {"result": [[{...}, ...]]} without.

Differential: what Search-R1's server takes, read by hand from its request model
(`queries: List[str]`, `topk: Optional[int] = None`, `return_scores: bool = False`, validated
by pydantic in lax mode, whose conversion table says: an int field takes whole numbers, 3.0
and numeric strings; a bool field takes 0 / 1, 0.0 / 1.0 and, in any case, the strings
0 off f false n no / 1 on t true y yes) and from its handler (`if not request.topk`: the default).
"""

import math
import threading
import time

import httpx
import pytest

from megarl.retrieval import BackgroundServer, Document, Hit, build_index, create_app, load_index, write_jsonl_corpus
from megarl.retrieval.server import RequestError, parse_retrieve_request

PARIS = Document("0", '"Paris"\nParis is the capital of France.')
BERLIN = Document("1", '"Berlin"\nBerlin is the capital of Germany.')
CAT = Document("2", '"Cat"\nThe cat sat on the mat.')
# lucene BM25 on this corpus (worked out in test_retrieval_bm25.py): tf = 1 → 0.4 · idf
IDF1, IDF2 = math.log(8 / 3), math.log(1.6)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    write_jsonl_corpus(tmp / "corpus.jsonl", [PARIS, BERLIN, CAT])
    retriever = load_index(build_index(tmp / "corpus.jsonl", tmp / "idx", show_progress=False))
    with BackgroundServer(create_app(retriever, default_topk=2, max_queries=5)) as running:
        yield running


def post(server, body):
    return httpx.post(server.url + "/retrieve", json=body, timeout=10)


def test_with_scores_the_search_r1_shape(server):
    response = post(server, {"queries": ["capital of germany", "mat"], "topk": 3, "return_scores": True})
    assert response.status_code == 200
    body = response.json()
    assert body == {
        "result": [
            [
                {"document": {"id": "1", "contents": BERLIN.contents}, "score": pytest.approx((IDF1 + IDF2) * 0.4)},
                {"document": {"id": "0", "contents": PARIS.contents}, "score": pytest.approx(IDF2 * 0.4)},
            ],
            [{"document": {"id": "2", "contents": CAT.contents}, "score": pytest.approx(IDF1 * 0.4)}],
        ]
    }


def test_without_scores_lists_of_documents(server):
    response = post(server, {"queries": ["capital of germany", "zebra"], "topk": 3, "return_scores": False})
    assert response.json() == {
        "result": [[{"id": "1", "contents": BERLIN.contents}, {"id": "0", "contents": PARIS.contents}], []]
    }


def test_defaults_are_the_servers_topk_and_no_scores(server):
    # the fixture's default_topk is 2; "capital paris france berlin" matches all but CAT
    response = post(server, {"queries": ["capital paris france berlin"]})
    assert [doc["id"] for doc in response.json()["result"][0]] == ["0", "1"]
    assert post(server, {"queries": ["mat"], "topk": None, "return_scores": None}).json() == {
        "result": [[{"id": "2", "contents": CAT.contents}]]
    }


def test_no_queries_no_results(server):
    # Search-R1's generation loop posts this when no trajectory of a turn searched (issue 17)
    for body in ({"queries": []}, {"queries": [], "topk": 3, "return_scores": True}):
        response = post(server, body)
        assert (response.status_code, response.json()) == (200, {"result": []})


# Search-R1's server takes these topk values; 0 and null mean its default (2 in the fixture).
@pytest.mark.parametrize(
    "topk, documents",
    [
        (None, 2),
        (0, 2),  # issue 17: zero is the default
        (1, 1),
        (3, 2),  # only two documents match
        (1.0, 1),  # a whole float
        ("1", 1),  # a numeric string
        (" 1 ", 1),
        ("0", 2),
        (True, 1),  # pydantic reads a boolean as 0 / 1
        (False, 2),
    ],
)
def test_topk_as_search_r1_reads_it(server, topk, documents):
    response = post(server, {"queries": ["capital paris france berlin"], "topk": topk})
    assert response.status_code == 200
    assert len(response.json()["result"][0]) == documents


# ... and these return_scores values; a string boolean is any case of the words.
@pytest.mark.parametrize(
    "return_scores, scored",
    [
        (True, True), (False, False), (1, True), (0, False), (1.0, True), (0.0, False),
        ("true", True), ("True", True), ("TRUE", True), ("false", False), ("False", False),
        ("yes", True), ("no", False), ("y", True), ("n", False), ("on", True), ("off", False),
        ("t", True), ("f", False), ("1", True), ("0", False),
        (None, False),  # megarl's difference: null is the default (Search-R1 refuses it)
    ],
)
def test_return_scores_as_search_r1_reads_it(server, return_scores, scored):
    response = post(server, {"queries": ["mat"], "return_scores": return_scores})
    assert response.status_code == 200
    assert response.json() == {
        "result": [[{"document": {"id": "2", "contents": CAT.contents}, "score": pytest.approx(IDF1 * 0.4)}]]
        if scored else [[{"id": "2", "contents": CAT.contents}]]
    }


@pytest.mark.parametrize(
    "body, status, message",
    [
        ([], 422, "the body must be a JSON object with a 'queries' list, got a JSON array"),
        ({}, 422, "the body has no 'queries' list (it has no fields)"),
        ({"query": ["mat"]}, 422, "the body has no 'queries' list (it has ['query'])"),
        ({"queries": None}, 422, "'queries' must be a list of strings, got null"),
        ({"queries": "mat"}, 422, "'queries' must be a list of strings, got string"),
        ({"queries": ["mat", 3]}, 422, "queries[1] must be a string, got number"),
        ({"queries": ["a"] * 6}, 422, "6 queries in one request; this server takes at most 5"),
        ({"queries": ["mat"], "topk": -2}, 422, "'topk' must be between 1 and 100, got -2"),
        ({"queries": ["mat"], "topk": 101}, 422, "'topk' must be between 1 and 100, got 101"),
        ({"queries": ["mat"], "topk": 1.5}, 422, "'topk' must be an integer, got number 1.5"),
        ({"queries": ["mat"], "topk": "three"}, 422, "'topk' must be an integer, got string 'three'"),
        ({"queries": ["mat"], "topk": ""}, 422, "'topk' must be an integer, got string ''"),
        ({"queries": ["mat"], "topk": [3]}, 422, "'topk' must be an integer, got array [3]"),
        ({"queries": ["mat"], "return_scores": "maybe"}, 422, "'return_scores' must be true or false"),
        ({"queries": ["mat"], "return_scores": " true"}, 422, "got string ' true'"),  # no trimming
        ({"queries": ["mat"], "return_scores": 2}, 422, "'return_scores' must be true or false"),
        ({"queries": ["mat"], "return_scores": 0.5}, 422, "'return_scores' must be true or false"),
        ({"queries": ["mat"], "return_scores": []}, 422, "got array []"),
    ],
)
def test_malformed_requests_get_4xx_and_a_message(server, body, status, message):
    response = post(server, body)
    assert response.status_code == status
    assert message in response.json()["detail"]


def test_a_body_that_is_not_json(server):
    response = httpx.post(server.url + "/retrieve", content=b"{queries: [", timeout=10)
    assert response.status_code == 400
    assert "the body is not valid JSON" in response.json()["detail"]


def test_health(server):
    response = httpx.get(server.url + "/health", timeout=10)
    assert response.json() == {"status": "ok", "kind": "bm25", "num_docs": 3}


def test_parse_retrieve_request_fills_defaults():
    req = parse_retrieve_request({"queries": ["a"]}, default_topk=3)
    assert (req.queries, req.topk, req.return_scores) == (["a"], 3, False)
    req = parse_retrieve_request({"queries": [], "topk": "4", "return_scores": "yes"}, default_topk=3)
    assert (req.queries, req.topk, req.return_scores) == ([], 4, True)
    with pytest.raises(RequestError):
        parse_retrieve_request({"queries": ["a"], "topk": 4}, default_topk=3, max_topk=3)


class FakeRetriever:
    """Answers every query with one document; `search` runs `before_search` first."""

    kind = "fake"

    def __init__(self, before_search=lambda: None):
        self.before_search = before_search

    def __len__(self):
        return 1

    def search(self, queries, topk, return_scores=True):
        self.before_search()
        return [[Hit(Document("7", f'"T"\n{q}'), 1.0)] for q in queries]


def test_a_failing_search_is_a_500_with_the_reason():
    def fail():
        raise RuntimeError("index file vanished")

    with BackgroundServer(create_app(FakeRetriever(fail))) as server:
        response = post(server, {"queries": ["x"]})
    assert response.status_code == 500
    assert response.json() == {"detail": "search failed: RuntimeError: index file vanished"}


def test_health_answers_while_a_search_is_running():
    started, release = threading.Event(), threading.Event()

    def block():
        started.set()
        release.wait(10)

    with BackgroundServer(create_app(FakeRetriever(block))) as server:
        answer = {}
        search = threading.Thread(target=lambda: answer.update(r=post(server, {"queries": ["x"]})))
        search.start()
        assert started.wait(5)
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        assert time.monotonic() - t0 < 1.0  # the search holds a worker thread, not the event loop
        release.set()
        search.join(10)
    assert answer["r"].json() == {"result": [[{"id": "7", "contents": '"T"\nx'}]]}


def test_background_server_stops_and_frees_its_port():
    server = BackgroundServer(create_app(FakeRetriever())).start()
    url = server.url
    server.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)
