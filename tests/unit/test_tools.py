"""Tool calls (`verispec.server.tools`), offline: reading tools and tool_choice, the forced-call grammar, parsing
calls out of text, streamed or whole, and history messages in the form chat templates read."""

from __future__ import annotations

import json

import pytest

from conftest import EOS, toy_grammar, toy_ids
from verispec.server.tools import (CallStream, ToolError, call_grammar, parse_calls, read_tools, supports_tools,
                                   template_message)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}

ANSWER = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_tool_choice_forms():
    assert read_tools(None, None, None) is None and read_tools([], "none", None) is None
    setup = read_tools([WEATHER, TIME], None, None)
    assert setup.choice == "auto" and setup.parallel and not setup.forced and setup.parses
    assert read_tools([WEATHER], "none", None).parses is False
    assert read_tools([WEATHER], "required", False).forced and not read_tools([WEATHER], "required", False).parallel
    named = read_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None)
    assert named.forced and [f["name"] for f in named.functions()] == ["get_time"]
    assert named.tools[1]["function"]["parameters"] == {"type": "object", "properties": {}}  # none given: no arguments


@pytest.mark.parametrize("tools, choice, parallel, param", [
    ([{"type": "function"}], None, None, "tools"),
    ("get_weather", None, None, "tools"),
    ([{"type": "function", "function": {"name": "get weather!"}}], None, None, "tools"),
    ([WEATHER, WEATHER], None, None, "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "object"}}], None, None, "tools"),
    ([WEATHER], "sometimes", None, "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, None, "tool_choice"),
    (None, "required", None, "tool_choice"),
    ([WEATHER], None, "yes", "parallel_tool_calls"),
], ids=str)
def test_bad_tools_name_the_field(tools, choice, parallel, param):
    with pytest.raises(ToolError) as error:
        read_tools(tools, choice, parallel)
    assert error.value.param == param


def test_parse_calls_from_a_finished_answer():
    content, calls = parse_calls(ANSWER)
    assert content == "Let me check."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {})]
    assert calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]
    assert len(parse_calls(ANSWER, parallel=False)[1]) == 1
    assert parse_calls("no calls here") == ("no calls here", [])
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_calls(broken) == (broken, [])  # not a call: stays text
    assert parse_calls('<tool_call>{"name": "f", "arguments": {"a": 1}}')[1] == []  # never closed (cut by max_tokens)


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_a_streamed_answer_gives_the_calls_and_text_of_the_whole(step):
    stream = CallStream()
    text, calls = "", []
    pieces = [ANSWER[i : i + step] for i in range(0, len(ANSWER), step)]
    for i, piece in enumerate(pieces):
        delta, closed = stream.push(piece, i == len(pieces) - 1)
        assert "<" not in delta  # nothing of a call leaks out as text
        text, calls = text + delta, calls + closed
    content, whole = parse_calls(ANSWER)
    assert text.strip() == content
    assert [c["function"] for c in calls] == [c["function"] for c in whole]


BARE = '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'


@pytest.mark.parametrize("answer", [BARE, '{"name": "get_weather", "arguments": {"city": "Paris"}}',
                                    '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'])
def test_an_answer_of_bare_calls_to_declared_functions_is_read_as_calls(answer):
    content, calls = parse_calls(answer, names={"get_weather"})
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    stream = CallStream(names={"get_weather"})
    pieces = [stream.push(answer[i : i + 3], i + 3 >= len(answer)) for i in range(0, len(answer), 3)]
    assert "".join(text for text, _ in pieces) == "" and [c["function"] for _, closed in pieces for c in closed] == [
        c["function"] for c in calls]


@pytest.mark.parametrize("answer", ['{"name": "get_time", "arguments": {}}', '{"name": "get_weather", "city": "Paris"}',
                                    'Here: {"name": "get_weather", "arguments": {}}', '```python\nprint(1)\n```'])
def test_other_json_answers_stay_text(answer):
    assert parse_calls(answer, names={"get_weather"}) == (answer, [])
    stream = CallStream(names={"get_weather"})
    pieces = [stream.push(answer[i : i + 3], i + 3 >= len(answer)) for i in range(0, len(answer), 3)]
    assert "".join(text for text, _ in pieces) == answer and not any(closed for _, closed in pieces)


def test_a_stream_releases_held_text_that_was_not_a_call():
    stream = CallStream()
    assert stream.push("a < b and <tool", False) == ("a < b and ", [])
    assert stream.push("tip>", True) == ("<tooltip>", [])
    unclosed = CallStream()
    assert unclosed.push("<tool_call>{", False) == ("", [])
    assert unclosed.push('"x"', True) == ('<tool_call>{"x"', [])


def allowed_along(grammar, text: str) -> list[bool]:
    """Per character of text: whether the grammar allows it after the ones before."""
    ids = toy_ids(text)
    return [mask is not None and bool(mask[token]) for mask, token in zip(grammar.constraint().allowed(
        [ids[:j] for j in range(len(ids))]), ids)]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "x"}}\n</tool_call>'


def test_forced_calls_follow_the_grammar():
    """Over the toy vocabulary, which has no <tool_call> token, so the grammar spells the tags out: the named
    function and its schema are enforced, and one call completes the answer unless several are allowed."""
    named = toy_grammar("lark", call_grammar(read_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}},
                                                        None), {}))
    assert all(allowed_along(named, CALL))
    constraint = named.constraint()
    constraint.advance(toy_ids(CALL))
    assert constraint.finished  # one call, then only EOS
    assert not all(allowed_along(named, CALL.replace("get_weather", "get_time")))  # not the named function
    assert not all(allowed_along(named, CALL.replace('"city"', '"town"')))  # not its schema
    assert not all(allowed_along(named, "sure " + CALL))  # nothing but the call

    several = toy_grammar("lark", call_grammar(read_tools([WEATHER, TIME], "required", None), {}))
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert all(allowed_along(several, CALL + "\n" + time_call))
    constraint = several.constraint()
    constraint.advance(toy_ids(CALL))
    assert not constraint.finished and bool(constraint.allowed([[]])[0][EOS])  # another call, or the end
    single = toy_grammar("lark", call_grammar(read_tools([WEATHER, TIME], "required", False), {}))
    assert not all(allowed_along(single, CALL + "\n" + time_call))


def test_the_grammar_names_the_tokenizers_own_tag_tokens():
    lark = call_grammar(read_tools([WEATHER], "required", None), {"<tool_call>": 151657, "</tool_call>": 151658})
    assert "<[151657]>" in lark and "<[151658]>" in lark and '"<tool_call>"' not in lark


def test_supports_tools_and_template_messages():
    assert supports_tools("{% if tools %}<tool_call>{% endif %}") and not supports_tools("{{ messages }}") and not supports_tools(None)
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert template_message(message)["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert template_message({"role": "user", "content": "hi"}) == {"role": "user", "content": "hi"}
