"""The Ray proxy of the train ranks sends each data-parallel rank its share of a packed batch, not
the batch: checked with rank actors that record what reached them (2 data-parallel ranks of 2
ranks each), against the rows worked out by hand."""

import pytest
import ray
import torch

from megarl.backends.packed import DataShare, PackedBatch
from megarl.config_cluster import LivenessConfig
from megarl.runtime.ray_proxies import RemoteTrainWorker
from megarl.runtime.stored_rows import cuts, fetched


@ray.remote(num_cpus=0)
class RecordingRank:
    """Answers as a rank of data-parallel rank `dp` of 2 would, and records the rows it was sent."""

    def __init__(self, dp: int):
        self.dp, self.seen = dp, []

    def ping(self) -> int:
        return 0

    def run(self, method: str, *args):
        if method == "data_parallel":
            return self.dp, 2
        share = fetched(args)[0]  # as TrainWorkerActor.run: a share's stored routing read
        assert isinstance(share, DataShare) and share.dp_rank == self.dp
        routed = share.batch.routed_experts
        self.seen.append((method, share.batch.input_ids[share.batch.starts()].tolist(), share.minis,
                          None if routed is None else [r.tolist() for r in routed.rows]))
        if method == "compute_log_prob":
            return share.batch.input_ids.float() / 1000, None  # per token, from the rows it holds
        return {"rank": float(self.dp)}

    def report(self):
        """The calls since the last report."""
        out, self.seen = self.seen, []
        return out


@pytest.fixture(scope="module")
def ranks():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    actors = [RecordingRank.remote(dp) for dp in (0, 0, 1, 1)]
    yield actors
    ray.shutdown()


def test_each_rank_gets_its_share_and_one_answer_per_share_comes_back(ranks):
    # rows whose first token names them (10, 11, ...), of 2 to 4 tokens; row r's response masked fully
    prompts = [[10 + r] for r in range(6)]
    responses = [[1] * (1 + r % 3) for r in range(6)]
    batch = PackedBatch.from_sequences(prompts, responses, [[1] * len(x) for x in responses])
    worker = RemoteTrainWorker(ranks, False, LivenessConfig(), mini_rows={"actor": 4})

    log_probs, entropy = worker.compute_log_prob(batch)
    torch.testing.assert_close(log_probs, batch.input_ids.float() / 1000)  # rank order = row order
    assert entropy is None
    assert worker.update_actor(batch.with_fields(old_log_probs=torch.zeros(batch.num_tokens),
                                                 advantages=torch.zeros(batch.num_tokens))) == {"rank": 0.0}
    seen = ray.get([a.report.remote() for a in ranks])
    # forward: rows 0-2 to DP 0, rows 3-5 to DP 1. Update: mini-batches rows 0-3 and 4-5, each
    # split in two: DP 0 rows 0, 1, 4; DP 1 rows 2, 3, 5. Loss tokens: rows 0-3 hold 1+2+3+1 = 7,
    # rows 4-5 hold 2+3 = 5
    want = {0: [("compute_log_prob", [10, 11, 12], (), None), ("update_actor", [10, 11, 14], ((2, 7, 4), (1, 5, 2)), None)],
            1: [("compute_log_prob", [13, 14, 15], (), None), ("update_actor", [12, 13, 15], ((2, 7, 4), (1, 5, 2)), None)]}
    assert seen == [want[0], want[0], want[1], want[1]]


def test_the_routing_crosses_once_for_the_log_probs_and_the_update(ranks):
    # the same 6 rows with routing (row r: its positions, width 1, values 100 r + position): each
    # rank reads its rows' own routing in both calls, and the driver put each row's routing in the
    # object store once; the pieces go when the batch does
    import gc

    prompts = [[10 + r] for r in range(6)]
    responses = [[1] * (1 + r % 3) for r in range(6)]
    routing = [torch.arange(len(responses[r]), dtype=torch.int16).reshape(-1, 1) + 100 * r for r in range(6)]
    batch = PackedBatch.from_sequences(prompts, responses, [[1] * len(x) for x in responses], routed_experts=routing)
    worker = RemoteTrainWorker(ranks, False, LivenessConfig(), mini_rows={"actor": 4})
    ray.get([a.report.remote() for a in ranks])  # forget the calls of the test before
    worker.compute_log_prob(batch)
    worker.update_actor(batch.with_fields(old_log_probs=torch.zeros(batch.num_tokens),
                                          advantages=torch.zeros(batch.num_tokens)))
    seen = ray.get([a.report.remote() for a in ranks])
    rows = lambda *r: [routing[i].tolist() for i in r]  # noqa: E731
    assert [[call[3] for call in rank] for rank in seen] == [[rows(0, 1, 2), rows(0, 1, 4)]] * 2 + \
        [[rows(3, 4, 5), rows(2, 3, 5)]] * 2
    assert worker.routing.stored_bytes == sum(r.numel() * 2 for r in routing)  # once, not once a call
    assert len(worker.routing) == 5  # rows cut at 0, 2, 3, 4, 5, 6 (below)
    del batch
    gc.collect()
    assert len(worker.routing) == 0


def test_the_cuts_are_those_of_every_share_by_hand():
    # 6 rows, 2 DP ranks: forward shares rows 0-2 and 3-5; mini-batches of 4 (rows 0-3: 0-1, 2-3;
    # rows 4-5: 4, 5); of 3 (rows 0-2: one each of 0-1, the third row left out; rows 3-5: 3, 4)
    assert cuts(6, 2, [4]) == [0, 2, 3, 4, 5, 6]
    assert cuts(6, 2, [4, 3]) == [0, 1, 2, 3, 4, 5, 6]
    assert cuts(7, 2, []) == [0, 3, 7]
