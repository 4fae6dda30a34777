"""The search agent: actions, masks, token exactness across turns, limits, malformed output."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megarl.retrieval.client import SearchResult
from megarl.retrieval.documents import Document
from megarl.rollout.agent import (INVALID_ACTION_MESSAGE, AgentSettings, build_search_prompt, run_trajectories,
                                  run_trajectory)
from megarl.tools.search import SEARCH_TOOLS
from megarl.rollout.engine import GenerationOutput, SamplingParams
from megarl.rollout.local import LocalEngine
from tiny_models import reference_log_probs, tiny_model, tiny_tokenizer

TOK = tiny_tokenizer()


class ScriptedEngine:
    """Test double: answers turn k with the token ids scripted for it, records the prompts."""

    def __init__(self, turns: list[list[int]], finish: list[str] | None = None):
        self.turns, self.finish = turns, finish or ["stop"] * len(turns)
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []

    async def generate(self, prompt_ids, params):
        k = len(self.prompts)
        self.prompts.append(list(prompt_ids))
        self.params.append(params)
        ids = self.turns[k][: params.max_new_tokens]
        reason = self.finish[k] if len(ids) == len(self.turns[k]) else "length"
        return GenerationOutput(ids, [-0.5 - 0.01 * i for i in range(len(ids))], reason, weight_version=2)


class FakeSearcher:
    def __init__(self, fail: bool = False):
        self.queries: list[str] = []
        self.fail = fail

    async def search(self, queries, topk=3):
        self.queries += queries
        if self.fail:
            return [SearchResult(error="retrieval failed after 3 retries: connection refused") for _ in queries]
        return [SearchResult(docs=[Document("7", '"Zorbia"\nThe capital of Zorbia is Quux.')]) for _ in queries]


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


SETTINGS = AgentSettings(max_turns=3, max_turn_length=64, max_obs_length=200, max_response_length=1000)


def run(engine, settings=SETTINGS, searcher=None, prompt=None):
    return asyncio.run(run_trajectory(engine, TOK, prompt or ids("Question: capital of Zorbia?"), settings,
                                      searcher if searcher is not None else FakeSearcher()))


@pytest.mark.parametrize("text, expected", [
    ("<think>x</think><search> capital of Zorbia </search>", ("search", "capital of Zorbia")),
    ("<answer> Quux </answer>", ("answer", "Quux")),
    ("<search> a <search> b </search>", ("search", "b")),  # nearest opening tag before the close
    ("<search></search>", ("invalid", "")),  # empty query
    ("<search>   </search>", ("invalid", "")),
    ("<search> unclosed", ("invalid", "")),
    ("just text", ("invalid", "")),
    ("<answer> A </answer> trailing <search> q </search>", ("answer", "A")),  # first closing tag wins
    ("<search> q </search> <answer> A </answer>", ("search", "q")),
    ("<answer> 東京 </answer>", ("answer", "東京")),
])
def test_parse_action(text, expected):
    action = SEARCH_TOOLS.parse(text)
    got = {"call": ("search", (action.arguments or {}).get("query")), "answer": ("answer", action.content),
           "invalid": ("invalid", "")}[action.kind]
    assert got == expected


def test_the_invalid_action_message_is_search_r1s():
    assert INVALID_ACTION_MESSAGE == (  # Search-R1's generation.py, word for word
        "\nMy previous action is invalid. If I want to search, I should put the query between <search> and </search>. "
        "If I want to give the final answer, I should put the answer between <answer> and </answer>. Let me try again.\n")


def test_search_then_answer_masks_and_token_exactness():
    turn1 = ids("<think> need facts </think> <search> capital of Zorbia </search>")
    turn2 = ids("<think> got it </think> <answer> Quux </answer>")
    engine = ScriptedEngine([turn1, turn2])
    searcher = FakeSearcher()
    prompt = ids("Question: capital of Zorbia?")
    traj = run(engine, searcher=searcher, prompt=prompt)
    observation = ids("\n\n<information>Doc 1(Title: \"Zorbia\") The capital of Zorbia is Quux.</information>\n\n")
    assert searcher.queries == ["capital of Zorbia"]
    assert traj.response_ids == turn1 + observation + turn2
    assert traj.loss_mask == [1] * len(turn1) + [0] * len(observation) + [1] * len(turn2)
    assert traj.rollout_log_probs[len(turn1): len(turn1) + len(observation)] == [0.0] * len(observation)
    # turn 2 was prompted with exactly the tokens so far, nothing re-encoded
    assert engine.prompts == [prompt, prompt + turn1 + observation]
    assert (traj.finish_reason, traj.num_turns, traj.num_searches, traj.num_valid_actions) == ("answer", 2, 1, 2)
    assert traj.weight_version == 2
    assert engine.params[0].stop == ("</search>", "</answer>")


def test_tokens_split_across_tags_and_multibyte_characters_survive():
    # the model's tokens split the tags and the CJK characters differently from how the
    # tokenizer would encode the same text; the trajectory must keep the sampled split
    turn1 = [i for text in ["<sea", "rch> ", "東", "京", " </se", "arch>"] for i in ids(text)]
    turn2 = ids("<answer> 東京 </answer>")
    assert TOK.decode(turn1) == "<search> 東京 </search>" and turn1 != ids("<search> 東京 </search>")
    engine = ScriptedEngine([turn1, turn2])
    searcher = FakeSearcher()
    traj = run(engine, searcher=searcher)
    assert searcher.queries == ["東京"]
    model_tokens = [t for t, m in zip(traj.response_ids, traj.loss_mask) if m]
    assert model_tokens == turn1 + turn2  # exactly the sampled ids, not a re-encoding of their text
    assert engine.prompts[1][-len(traj.response_ids) + len(turn2):] == traj.response_ids[: -len(turn2)]


def test_invalid_action_gets_the_message_and_another_turn():
    turn1 = ids("I am not sure")
    turn2 = ids("<answer> Quux </answer>")
    engine = ScriptedEngine([turn1, turn2])
    traj = run(engine)
    message = ids(INVALID_ACTION_MESSAGE)
    assert traj.response_ids == turn1 + message + turn2
    assert (traj.num_valid_actions, traj.num_searches, traj.finish_reason) == (1, 0, "answer")


def test_max_turns_then_a_final_turn_without_search():
    search = ids("<search> q </search>")
    engine = ScriptedEngine([search, search, search])
    settings = AgentSettings(max_turns=2, max_turn_length=64, max_obs_length=200, max_response_length=1000)
    searcher = FakeSearcher()
    traj = run(engine, settings, searcher)
    assert len(engine.prompts) == 3 and searcher.queries == ["q", "q"]  # the last turn's search is not run
    assert engine.params[-1].stop == ("</answer>",)
    assert (traj.finish_reason, traj.num_turns, traj.num_searches) == ("max_turns", 3, 2)


def test_observation_truncated_and_total_budget_enforced():
    search = ids("<search> q </search>")
    settings = AgentSettings(max_turns=3, max_turn_length=64, max_obs_length=5, max_response_length=len(search) * 2 + 7)
    engine = ScriptedEngine([search, search, search, search])
    traj = run(engine, settings)
    assert traj.loss_mask.count(0) == 5 + 2  # a 5-token observation, then what room was left
    assert len(traj.response_ids) == settings.max_response_length
    assert traj.finish_reason == "length"
    assert engine.params[1].max_new_tokens == settings.max_response_length - len(search) - 5


def test_search_outage_continues_with_a_failure_observation():
    turn1, turn2 = ids("<search> q </search>"), ids("<answer> x </answer>")
    traj = run(ScriptedEngine([turn1, turn2]), searcher=FakeSearcher(fail=True))
    text = TOK.decode([t for t, m in zip(traj.response_ids, traj.loss_mask) if not m])
    assert "<information>Search failed: retrieval failed after 3 retries" in text
    assert (traj.num_failed_searches, traj.finish_reason) == (1, "answer")


def test_turn_cut_at_length_is_an_invalid_action():
    long_turn = ids("thinking " * 40)
    engine = ScriptedEngine([long_turn, ids("<answer> y </answer>")])
    settings = AgentSettings(max_turns=2, max_turn_length=10, max_obs_length=50, max_response_length=1000)
    traj = run(engine, settings)
    assert traj.response_ids[:10] == long_turn[:10]
    assert traj.finish_reason == "answer" and traj.num_valid_actions == 1


def test_single_turn_uses_the_whole_budget_and_no_tags():
    engine = ScriptedEngine([ids("Answer: 7")])
    settings = AgentSettings(max_turns=0, max_response_length=300)
    traj = asyncio.run(run_trajectory(engine, TOK, ids("1+6?"), settings))
    assert engine.params[0].max_new_tokens == 300 and engine.params[0].stop == ()
    assert traj.finish_reason == "eos" and traj.loss_mask == [1] * len(traj.response_ids)


def test_real_engine_trajectories_are_consistent():
    """With the embedded engine: log-probs of model tokens equal a forward pass over the whole
    trajectory (observations included as context), masks align, budgets hold."""
    model = tiny_model("qwen2", vocab_size=len(TOK))
    engine = LocalEngine(model, TOK, max_batch_size=4)
    settings = AgentSettings(max_turns=2, max_turn_length=12, max_obs_length=20, max_response_length=60)
    prompts = [ids("Question: capital of Zorbia?"), ids("Question: 東京?"), ids("Answer: 7")]

    async def go():
        out = await run_trajectories(engine, TOK, prompts, settings, FakeSearcher(), seeds=[1, 2, 3])
        await engine.close()
        return out

    for prompt, traj in zip(prompts, asyncio.run(go())):
        assert len(traj.response_ids) == len(traj.loss_mask) == len(traj.rollout_log_probs) <= 60
        ref = reference_log_probs(model, prompt, traj.response_ids)
        mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(traj.rollout_log_probs)[mask], ref[mask], atol=1e-5, rtol=0)
        assert traj.finish_reason in ("answer", "max_turns", "length", "abort")


def test_search_prompt_plain_and_with_chat_template():
    plain = TOK.decode(build_search_prompt(TOK, " Who founded Zorbia? "))
    assert plain.startswith("Answer the given question.") and plain.endswith("Question: Who founded Zorbia?\n")
    for tag in ("<think>", "<search>", "<information>", "<answer>"):
        assert tag in plain
    chat = tiny_tokenizer()
    chat.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    ids_ = build_search_prompt(chat, "Who founded Zorbia?")
    assert ids_[0] == chat.convert_tokens_to_ids("<|im_start|>")
    assert chat.decode(ids_) == f"<|im_start|>user\n{plain}<|im_end|>\n<|im_start|>assistant\n"
