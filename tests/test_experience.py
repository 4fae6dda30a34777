"""Rollouts -> training batch: overlong shaping, batch layout, advantages broadcast onto tokens."""

import copy

import pytest
import torch

from megarl.config import AlgorithmConfig, OverlongConfig
from megarl.data.prompts import PromptRecord
from megarl.experience import Sample, compute_advantages, reward_requests, shape_overlong, to_train_batch
from megarl.rollout.agent import Trajectory
from tiny_models import tiny_tokenizer

TOK = tiny_tokenizer()


def sample(prompt, response, mask, group, source="nq"):
    t = Trajectory(prompt_ids=prompt, response_ids=response, loss_mask=mask,
                   rollout_log_probs=[-0.5 if m else 0.0 for m in mask])
    return Sample(PromptRecord(prompt, source, {"target": ["x"]}), group, t)


SAMPLES = [sample([5, 6], [7, 8, 9], [1, 0, 1], 0), sample([5, 6], [10], [1], 0),
           sample([11], [12, 13], [1, 1], 1), sample([11], [14, 15, 16, 17], [1, 1, 0, 1], 1)]


def test_overlong_shaping_by_hand():
    algo = AlgorithmConfig(overlong=OverlongConfig(enable=True, buffer_len=4, penalty_factor=1.0))
    # max 10, buffer 4: lengths <= 6 unpunished; 8 -> -(8-6)/4 = -0.5; 10 -> -1.0
    assert shape_overlong([1.0, 1.0, 0.0], [6, 8, 10], 10, algo) == [1.0, 0.5, -1.0]
    off = AlgorithmConfig(overlong=OverlongConfig(enable=False))
    assert shape_overlong([1.0], [10], 10, off) == [1.0]


def test_reward_requests_carry_the_decoded_response():
    s = sample([5], TOK.encode("<answer> x </answer>", add_special_tokens=False), [1] * 5, 3)
    s.trajectory.loss_mask = [1] * len(s.trajectory.response_ids)
    (req,) = reward_requests([s], TOK)
    assert req.solution_str == "<answer> x </answer>" and req.group_id == 3
    assert req.response_length == len(s.trajectory.response_ids)


def test_train_batch_and_grpo_advantages_on_tokens():
    batch = to_train_batch(SAMPLES)  # packed: the rows end to end
    assert batch.lengths.tolist() == [5, 3, 3, 5]
    assert batch.input_ids.tolist() == [5, 6, 7, 8, 9, 5, 6, 10, 11, 12, 13, 11, 14, 15, 16, 17]
    assert batch.input_ids.dtype == torch.int32 and batch.loss_mask.dtype == torch.bool
    assert batch.loss_mask.tolist() == [bool(m) for m in [0, 0, 1, 0, 1, 0, 0, 1, 0, 1, 1, 0, 1, 1, 0, 1]]
    assert batch.rollout_log_probs[:5].tolist() == [0, 0, -0.5, 0, -0.5]
    rows = batch.padded()  # as a worker takes them
    assert rows.input_ids.tolist()[0] == [5, 6, 7, 8, 9] and rows.input_ids.tolist()[1] == [5, 6, 10, 0, 0]
    assert rows.loss_mask.tolist()[3] == [0, 1, 1, 0, 1] and rows.loss_mask.tolist()[1] == [0, 0, 1, 0, 0]
    adv, returns, _ = compute_advantages(batch, [1.0, 0.0, 0.0, 0.0], [0, 0, 1, 1], AlgorithmConfig())
    # group 0 = {1, 0}: mean 0.5, sample std 0.7071 -> ±0.7071; group 1 constant -> 0
    a = 0.5 / (2 ** 0.5 / 2 + 1e-6)
    expected = torch.tensor([0, 0, a, 0, a, 0, 0, -a] + [0] * 8, dtype=torch.float32)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(returns, expected)


def test_gae_needs_values_and_kl_in_reward_needs_log_probs():
    batch = to_train_batch(SAMPLES)
    with pytest.raises(ValueError, match="values"):
        compute_advantages(batch, [1, 0, 0, 0], [0, 0, 1, 1], AlgorithmConfig(adv_estimator="gae"))
    with pytest.raises(ValueError, match="reference"):
        compute_advantages(batch, [1, 0, 0, 0], [0, 0, 1, 1],
                           AlgorithmConfig(adv_estimator="reinforce_plus_plus", use_kl_in_reward=True))


def test_gae_with_zero_values_and_unit_discount_is_the_score_on_every_loss_token():
    # V = 0, γ = λ = 1: A_t = sum of future rewards = the score, on every loss token; then whitened
    batch = to_train_batch(SAMPLES)
    batch = batch.with_fields(values=torch.zeros(batch.num_tokens))
    scores = [1.0, 0.0, 2.0, 0.0]
    _, returns, _ = compute_advantages(batch, scores, [0, 0, 1, 1], AlgorithmConfig(adv_estimator="gae"))
    expected = [m * scores[row] for row, t in enumerate(s.trajectory for s in SAMPLES)
                for m in [0] * len(t.prompt_ids) + t.loss_mask]
    torch.testing.assert_close(returns, torch.tensor(expected, dtype=torch.float32))


@pytest.mark.parametrize("clean_up", [False, True])
def test_all_rows_decoded_at_once_as_one_at_a_time(clean_up):
    """decode_all (one call to the fast tokenizer's backend, or row by row where HF would clean up
    spaces) gives tokenizer.decode's text: special tokens dropped, characters split across tokens
    as HF shows them."""
    from megarl.experience import decode_all
    from megarl.rollout.agent import TokenRow

    tok = copy.deepcopy(TOK)
    tok.clean_up_tokenization_spaces = clean_up
    texts = ["<answer> x </answer> 東京 , don 't", "a .", ""]
    rows = [TokenRow("i", tok.encode(t, add_special_tokens=False) + [tok.eos_token_id]) for t in texts]
    rows.append(TokenRow("i", tok.encode("東", add_special_tokens=False)[:1]))  # half a character
    want = [tok.decode(list(r), skip_special_tokens=True) for r in rows]
    assert decode_all(tok, rows) == want


def test_samples_are_scored_in_parts_of_whole_groups(monkeypatch):
    # parts of about SCORED_AT_ONCE samples, each ending at a group's end (a group's reward
    # components see the whole group); every sample scored once, in order
    import threading
    from types import SimpleNamespace

    from megarl import train
    from megarl.config import RunConfig
    from megarl.reward.pool import RewardStats
    from megarl.reward.scoring import RewardResult

    sent = []

    class Pool:
        def compute(self, requests):
            sent.append([r.group_id for r in requests])
            return ([RewardResult(score=float(r.group_id), acc=r.group_id % 2 == 0) for r in requests],
                    RewardStats(len(requests), 0, 0, 0, 0.0))

    monkeypatch.setattr(train, "SCORED_AT_ONCE", 3)
    groups = [0, 0, 1, 1, 1, 2, 3, 3]
    samples = [sample([5], [7, 8], [1, 1], g) for g in groups]
    c = SimpleNamespace(reward_lock=threading.Lock(), reward_pool=Pool(), tokenizer=TOK, cfg=RunConfig())
    assert train.score_samples(c, samples, validation=True) == 0
    assert sent == [[0, 0, 1, 1, 1], [2, 3, 3]]
    assert [(s.score, s.acc) for s in samples] == [(float(g), g % 2 == 0) for g in groups]


@pytest.mark.parametrize("clean_up", [False, True])
def test_the_tails_decoded_from_the_last_tokens_are_the_whole_texts_ends(clean_up):
    # against decoding every row whole: characters of several bytes cut between tokens, special
    # tokens that decode to nothing (the tail is then taken again from more tokens), short rows
    import random

    from megarl.experience import decode_tails
    from megarl.rollout.agent import TokenRow

    tok = copy.deepcopy(TOK)
    tok.clean_up_tokenization_spaces = clean_up
    pieces = ["Answer: 42", " 東京", " don 't", " a .", "\n", " 🙂", " x", "<answer>", " ünïcödé"]
    rnd = random.Random(0)
    rows = []
    for n in [0, 1, 3, 40, 200, 900]:
        text = "".join(rnd.choice(pieces) for _ in range(n))
        ids = tok.encode(text, add_special_tokens=False)
        rows.append(TokenRow("i", ids + [tok.eos_token_id]))
        rows.append(TokenRow("i", ids[: len(ids) // 2] + [tok.eos_token_id] * 500 + ids[len(ids) // 2:]))
    rows.append(TokenRow("i", tok.encode("🙂" * 100, add_special_tokens=False) + [tok.eos_token_id]))  # a byte a token
    want = [tok.decode(list(r), skip_special_tokens=True)[-30:] for r in rows]
    assert decode_tails(tok, rows, 30) == want
    assert any(len(w) == 30 for w in want) and any(len(w) < 30 for w in want)


def test_only_a_reward_that_reads_the_last_characters_alone_gets_them():
    from megarl.reward.scoring import characters_read
    from megarl.reward.settings import RewardConfig

    assert characters_read(RewardConfig(), "math_dapo") == 300  # DAPO's reward: the last 300 characters
    assert characters_read(RewardConfig(custom_function="dapo_math"), "nq") == 300
    assert characters_read(RewardConfig(), "nq") is None  # exact match reads the whole answer
    assert characters_read(RewardConfig(), "no_such_source") is None  # scoring names it
    assert characters_read(RewardConfig(custom_function="reward_fixtures:length_score"), "math_dapo") is None
    assert characters_read(RewardConfig(weights={"task_score": 1.0, "format": 0.5}), "math_dapo") is None


def test_a_dapo_response_is_scored_on_its_tail_as_on_its_whole_text():
    # an "Answer:" line while reasoning and the last one; the request holds the last 300
    # characters, and each sample scores as its whole text does
    from megarl.reward.scoring import score_one
    from megarl.reward.settings import RewardConfig

    cfg = RewardConfig()
    texts = ["Answer: 7\n" + "so on " * 200 + "\nAnswer: 3", "Answer: 3\n" + "so on " * 200, "Answer: 3"]
    samples = [sample([5], TOK.encode(t, add_special_tokens=False), [1] * len(TOK.encode(t)), i, source="math_dapo")
               for i, t in enumerate(texts)]
    for s in samples:
        s.record = PromptRecord([5], "math_dapo", "3")
    requests = reward_requests(samples, TOK, cfg)
    assert [r.solution_str for r in requests] == [t[-300:] for t in texts]
    whole = reward_requests(samples, TOK)
    assert [r.solution_str for r in whole] == texts
    assert [score_one(cfg, r).score for r in requests] == [score_one(cfg, r).score for r in whole] == [1.0, -1.0, 1.0]
