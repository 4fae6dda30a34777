"""Agent tools: the calculator's arithmetic, reading a turn's action in both call formats,
failures as observations, the loop over a set of tools, and tools named in a run's config."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from dataclasses import replace
from fractions import Fraction

import pytest

from megarl.config import ConfigError, load_config
from megarl.rollout.agent import AgentSettings, run_trajectory
from megarl.tools import build_toolset
from megarl.tools.base import ChatToolFrame, Tool, ToolError, ToolSet
from megarl.tools.calculator import Calculator, evaluate, format_number
from megarl.tools.search import SearchTool
from test_rollout_agent import FakeSearcher, ScriptedEngine, ids
from tiny_models import tiny_tokenizer

TOK = tiny_tokenizer()


@pytest.mark.parametrize("expression, value", [
    ("37 * 48", Fraction(1776)),
    ("0.1 + 0.2", Fraction(3, 10)),  # exact: not 0.30000000000000004
    ("1/3*3", Fraction(1)),
    ("2^10", Fraction(1024)),  # ^ as models write a power
    ("7 / 2", Fraction(7, 2)),
    ("-(3 + 4) * 2", Fraction(-14)),
    ("10 // 3", Fraction(3)),
    ("17 % 5", Fraction(2)),
    ("12 × 11", Fraction(132)),
    ("2 ** -2", Fraction(1, 4)),
    ("1e3", Fraction(1000)),
])
def test_the_calculator_evaluates_exactly(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("2 ** 0.5", "only whole-number powers"),
    ("9 ** 9 ** 9", "an exponent above 64"),  # would take the machine's memory
    ("10 ** 60 * 10 ** 60", "more than 100 digits"),
    ("__import__('os').system('true')", "is not arithmetic"),
    ("abs(-3)", "is not arithmetic"),
    ("x + 1", "is not arithmetic"),
    ("'a' * 3", "is not arithmetic"),
    ("3 +", "cannot read"),
    ("", "empty"),
    ("1+" * 150 + "1", "longer than 200 characters"),
])
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expression, message):
    with pytest.raises(ToolError, match=message):
        evaluate(expression)


@pytest.mark.parametrize("x, text", [(Fraction(1776), "1776"), (Fraction(-7, 2), "-3.5"),
                                     (Fraction(2, 3), "0.666666666667"), (Fraction(10**15), "1000000000000000")])
def test_numbers_are_written_as_a_model_reads_them(x, text):
    assert format_number(x) == text


class Slow(Tool):
    name, timeout_s = "slow", 0.05

    async def call(self, arguments):
        await asyncio.sleep(5)


class Broken(Tool):
    name = "broken"

    async def call(self, arguments):
        raise KeyError("a bug in the tool")


class Forgetful(Tool):  # a forgotten return, or a dict handed back as it is
    name = "forgetful"

    async def call(self, arguments):
        return None if arguments["input"] == "none" else {"temperature": 21}


TOOLS = ToolSet([Calculator(), SearchTool(FakeSearcher()), Slow(), Broken()])


@pytest.mark.parametrize("text, kind, tool, arguments", [
    ("<calculator> 37 * 48 </calculator>", "call", "calculator", {"expression": "37 * 48"}),
    ("<search> Zorbia </search><calculator>1+1</calculator>", "call", "search", {"query": "Zorbia"}),
    ("<calculator>1+1</calculator><search> Zorbia </search>", "call", "calculator", {"expression": "1+1"}),
    ("<answer> 1776 </answer>", "answer", "", None),
    ("<calculator>  </calculator>", "invalid", "", None),
    ("I think it is 1776", "invalid", "", None),
])
def test_a_turn_calls_the_tool_whose_closing_tag_comes_first(text, kind, tool, arguments):
    action = TOOLS.parse(text)
    assert (action.kind, action.tool, action.arguments) == (kind, tool, arguments)


def test_the_stop_strings_are_every_tools_closing_tag_and_the_answers():
    assert TOOLS.stop_strings(final=False) == ("</calculator>", "</search>", "</slow>", "</broken>", "</answer>")
    assert TOOLS.stop_strings(final=True) == ("</answer>",)


def test_the_invalid_action_message_names_every_tool():
    two = ToolSet([SearchTool(None), Calculator()])
    assert two.invalid_message() == (
        "\nMy previous action is invalid. If I want to search, I should put the query between <search> and </search>. "
        "If I want to calculate, I should put the expression between <calculator> and </calculator>. "
        "If I want to give the final answer, I should put the answer between <answer> and </answer>. Let me try again.\n")


@pytest.mark.parametrize("text, observation, failed", [
    ("<calculator>37*48</calculator>", "\n\n<result>1776</result>\n\n", False),
    ("<calculator>1/0</calculator>", "\n\n<result>Calculator failed: division by zero</result>\n\n", True),
    ("<slow>x</slow>", "\n\n<result>slow failed: no result within 0.05 s</result>\n\n", True),
    ("<broken>x</broken>", "\n\n<result>broken failed: KeyError: 'a bug in the tool'</result>\n\n", True),
    ("<search>q</search>", "\n\n<information>Doc 1(Title: \"Zorbia\") The capital of Zorbia is Quux.</information>\n\n",
     False),
])
def test_errors_timeouts_and_bugs_are_observations_the_model_reads(text, observation, failed):
    result = asyncio.run(TOOLS.run(TOOLS.parse(text)))
    assert (result.text, result.failed) == (observation, failed)


@pytest.mark.parametrize("text, kind", [("none", "NoneType"), ("x", "dict")])
def test_a_result_that_is_not_text_is_a_failed_call_named_by_its_type(text, kind):
    # before: str(None) -> "None", read by the model and counted a success
    result = asyncio.run(ToolSet([Forgetful()]).run(ToolSet([Forgetful()]).parse(f"<forgetful>{text}</forgetful>")))
    assert (result.text, result.failed) == (f"\n\n<result>Forgetful failed: the tool returned {kind}, not text"
                                            "</result>\n\n", True)


CHATML_WITH_TOOLS = (  # Qwen2.5's layout of assistant and tool messages, reduced to what the test needs
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}{% if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user"
    "{% endif %}{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture
def chat_tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = CHATML_WITH_TOOLS
    return tok


def test_a_tool_call_observation_is_the_chat_templates_tool_message(chat_tokenizer):
    frame = ChatToolFrame(chat_tokenizer)
    assert frame.render("6") == "<|im_end|>\n<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n" \
                                "<|im_start|>assistant\n"


@pytest.mark.parametrize("text, kind, tool, arguments, error", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>', "call", "calculator",
     {"expression": "2*3"}, ""),
    ('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2*3\\"}"}</tool_call>', "call",
     "calculator", {"expression": "2*3"}, ""),  # the arguments as a JSON string
    ('<tool_call>{"name": "weather"}</tool_call>', "call", "", None,  # counted as "unknown", not as a new metric
     "there is no tool 'weather'; the tools are calculator"),
    ('<tool_call>{"name": "web.search(\'x\')!' + "y" * 60 + '"}</tool_call>', "call", "", None,
     "there is no tool \"web.search('x')!" + "y" * 24 + '..."; the tools are calculator'),
    ("<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>", "call", "", None,
     "the tool call is nested too deeply to read"),  # json's recursion limit, not a failed step
    ('<tool_call>{"name": calculator}</tool_call>', "call", "", None,
     "the tool call is not JSON (Expecting value at character 9)"),
    ("The answer is 6.", "reply", "", None, ""),
])
def test_tool_calls_in_the_chat_templates_format(chat_tokenizer, text, kind, tool, arguments, error):
    action = ToolSet([Calculator()], "tool_call", chat_tokenizer).parse(text)
    assert (action.kind, action.tool, action.arguments, action.error) == (kind, tool, arguments, error)


SETTINGS = AgentSettings(max_turns=3, max_turn_length=64, max_obs_length=200, max_response_length=1000)


def test_the_loop_calls_the_calculator_and_masks_its_result():
    turn1, turn2 = ids("<calculator> 37 * 48 </calculator>"), ids("<answer> 1776 </answer>")
    engine = ScriptedEngine([turn1, turn2])
    prompt = ids("Question: 37 * 48?")
    traj = asyncio.run(run_trajectory(engine, TOK, prompt, SETTINGS, ToolSet([Calculator(), SearchTool(None)])))
    observation = ids("\n\n<result>1776</result>\n\n")
    assert traj.response_ids == turn1 + observation + turn2
    assert traj.loss_mask == [1] * len(turn1) + [0] * len(observation) + [1] * len(turn2)
    assert engine.prompts == [prompt, prompt + turn1 + observation]
    assert engine.params[0].stop == ("</calculator>", "</search>", "</answer>")
    assert (traj.tool_calls, traj.tool_failures, traj.num_searches, traj.finish_reason) == (
        {"calculator": 1}, {"calculator": 0}, 0, "answer")


def test_in_the_tool_call_format_a_reply_ends_the_trajectory(chat_tokenizer):
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
    turn1, turn2 = ids(call), ids("It is 6.")
    engine = ScriptedEngine([turn1, turn2])
    tools = ToolSet([Calculator()], "tool_call", chat_tokenizer)
    traj = asyncio.run(run_trajectory(engine, TOK, ids("2*3?"), replace(SETTINGS, max_turn_length=200), tools))
    observation = ids("<|im_end|>\n<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert traj.response_ids == turn1 + observation + turn2
    assert engine.params[0].stop == ("</tool_call>", "</answer>")
    assert (traj.finish_reason, traj.num_turns, traj.tool_calls) == ("eos", 2, {"calculator": 1})


def test_a_failed_call_is_counted_and_the_trajectory_goes_on():
    turn1, turn2 = ids("<calculator> 1/0 </calculator>"), ids("<answer> none </answer>")
    traj = asyncio.run(run_trajectory(ScriptedEngine([turn1, turn2]), TOK, ids("q"), SETTINGS,
                                      ToolSet([Calculator()])))
    assert (traj.tool_calls, traj.tool_failures, traj.finish_reason) == ({"calculator": 1}, {"calculator": 1}, "answer")
    assert "Calculator failed: division by zero" in TOK.decode(traj.response_ids)


# ---- tools named in a run's config ----

WEATHER = '''
from megarl.tools.base import Tool, ToolError


class Weather(Tool):
    name = "weather"
    purpose, argument = "ask for the weather", "city"

    def __init__(self, sunny: list[str]):
        self.sunny = sunny

    async def call(self, arguments):
        city = arguments["city"]
        return "sunny" if city in self.sunny else "rain"
'''


@pytest.fixture
def weather_module(tmp_path, monkeypatch):
    (tmp_path / "my_weather.py").write_text(textwrap.dedent(WEATHER))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_weather", None)
    return "my_weather:Weather"


def test_a_tool_outside_the_package_runs_from_the_config(weather_module):
    cfg = load_config(None, ["agent.max_turns=2", f"agent.tools={{forecast: {{class: '{weather_module}', "
                             "sunny: [Rome], timeout_s: 2}, calculator: {}}"])
    assert not cfg.agent.uses_search()  # no retrieval server is needed, or started
    tools = build_toolset(cfg.agent.tools)
    assert list(tools.tools) == ["forecast", "calculator"] and tools.tools["forecast"].timeout_s == 2.0
    result = asyncio.run(tools.run(tools.parse("<forecast> Rome </forecast>")))
    assert result.text == "\n\n<result>sunny</result>\n\n"


@pytest.mark.parametrize("tools, key, message", [
    ("{calculater: {}}", "agent.tools.calculater", "no built-in tool has this name"),
    ("{calculator: {max_digit: 5}}", "agent.tools.calculator", "cannot take {'max_digit': 5}"),
    ("{calculator: {timeout_s: 0}}", "agent.tools.calculator.timeout_s", "not a number of seconds > 0"),
    ("{search: {topk: 5}}", "agent.tools.search", "are not search settings"),
    ("{w: {class: 'no_such_module:Tool'}}", "agent.tools.w.class", "cannot import module 'no_such_module'"),
    ("{w: {class: 'megarl.tools.calculator:evaluate'}}", "agent.tools.w.class", "not a subclass"),
    ("{answer: {class: 'megarl.tools.calculator:Calculator'}}", "agent.tools.answer", "tag name"),
    ("{}", "agent.tools", "is empty"),
    ("{calculator: {ray: true}}", "agent.tools.calculator.ray", "cluster.launcher=inprocess runs no Ray actor"),
])
def test_a_wrong_tool_in_the_config_stops_the_run_by_its_key(tools, key, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, ["agent.max_turns=2", f"agent.tools={tools}", "agent.retrieval.url=http://127.0.0.1:1",
                           "cluster.launcher=inprocess"])
    assert any(p.key == key and message in p.what for p in error.value.problems), error.value


def test_a_tool_in_a_ray_actor_makes_auto_launch_ray_on_one_machine():
    tools = ["agent.max_turns=2", "agent.tools={calculator: {}}"]
    assert load_config(None, tools).launcher() == "inprocess"  # one CPU machine, the embedded engine
    assert load_config(None, ["agent.max_turns=2", "agent.tools={calculator: {ray: true}}"]).launcher() == "ray"
    assert load_config(None, ["agent.max_turns=0", "agent.tools={calculator: {ray: true}}"]).launcher() == "inprocess"


def test_only_a_search_tool_needs_a_retrieval_server():
    with pytest.raises(ConfigError, match="agent.retrieval"):
        load_config(None, ["agent.max_turns=2"])  # the default tools: search
    load_config(None, ["agent.max_turns=2", "agent.tools={calculator: {}}"])


def test_a_huge_tool_output_is_cut_before_it_is_tokenized():
    """A 10 MB output (the issue's took 32.9 s and 3.66 GB to tokenize whole): the observation is
    the first max_obs_length tokens of the whole text, computed from a cut that never passes
    (max_obs_length + 8) x the tokenizer's longest token in characters."""
    from megarl.rollout import agent

    words = [f"fact{i % 97} value{i % 13}" for i in range(1_000_000)]
    huge = " ".join(words)
    assert len(huge) > 10_000_000
    longest = agent.longest_token_chars(TOK)
    # the slow reference: a prefix long enough to hold the first 200 tokens whatever the cut
    reference = agent.ids_of(TOK, huge[:100_000])[:200]
    seen = []
    real_ids_of = agent.ids_of

    def counting(tokenizer, text):
        seen.append(len(text))
        return real_ids_of(tokenizer, text)

    agent.ids_of = counting
    try:
        got = agent.observation_ids(TOK, huge, 200)
    finally:
        agent.ids_of = real_ids_of
    assert got == reference
    assert seen == [(200 + 8) * longest] and seen[0] < 100_000
    assert longest >= max(len(TOK.convert_tokens_to_string([t])) for t in TOK.get_vocab())  # a bound on any token


def test_a_tool_in_an_actor_that_returns_no_text_fails_the_same_way():
    from megarl.tools import call_in_actor

    assert asyncio.run(call_in_actor(Forgetful(), {"input": "none"})) == (False, "the tool returned NoneType, not text")
    assert asyncio.run(call_in_actor(Calculator(), {"expression": "2*3"})) == (True, "6")
