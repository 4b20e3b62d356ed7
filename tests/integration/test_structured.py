"""Structured output and tool calls on real models, with the clients people use: the `openai` SDK's `.parse()`
and streaming helper, and LangChain's `with_structured_output` and `bind_tools`.

In-process on smollm2-135m: a JSON schema's greedy output is plain constrained decoding's with every drafter, and
valid. Against a real server on qwen2.5-coder-0.5b (its chat template renders tools): `.parse()` with a Pydantic
model equals plain decoding with speculation on, and a tool call goes the whole round trip (tools -> tool_calls ->
a role "tool" message -> the final answer), streamed or not.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel

import verispec
from verispec import zoo
from verispec.server import ServerProcess
from verispec.server.process import ServerStartError

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "age", "languages"], "additionalProperties": False}
PERSON = "Describe a software engineer called Ada, aged 36, who knows three programming languages, as JSON."


@pytest.fixture(scope="module")
def smollm():
    return verispec.load("smollm2-135m")


@pytest.mark.parametrize("drafter", ["ngram", "suffix", "model", "self"])
def test_json_schema_greedy_output_is_plain_constrained_decodings_with_every_drafter(smollm, drafter):
    options = dict(chat=True, max_new_tokens=80, response_format={"type": "json_schema", "json_schema": {"name": "person",
                                                                                                         "schema": SCHEMA}})
    plain = verispec.generate(smollm, PERSON, drafter="none", **options)
    value = json.loads(plain.text)  # complete and valid: the grammar ended it
    assert plain.finish_reason == "stop" and set(value) == {"name", "age", "languages"} and isinstance(value["age"], int)
    draft = verispec.load("smollm2-135m", weight_dtype="int8") if drafter == "model" else None
    spec = verispec.generate(smollm, PERSON, drafter=drafter, draft=draft, draft_len=4, **options)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.drafted_tokens > 0
    free = verispec.generate(smollm, PERSON, drafter="none", chat=True, max_new_tokens=80)
    assert free.text != plain.text  # the schema changed the answer, or this test proves nothing


def test_json_object_and_regex_in_the_python_api(smollm):
    obj = verispec.generate(smollm, "A JSON object with one key, x, set to 1:", chat=True, max_new_tokens=60, drafter="ngram",
                            response_format={"type": "json_object"})
    assert obj.finish_reason == "stop" and json.loads(obj.text) == {"x": 1}
    year = verispec.generate(smollm, "The first Moon landing was in", max_new_tokens=10, drafter="ngram",
                             response_format={"type": "regex", "pattern": " [0-9]{4}"})
    assert len(year.text) == 5 and year.text[1:].isdigit() and year.finish_reason == "stop"
    with pytest.raises(verispec.VerispecError, match="JSON schema"):
        verispec.generate(smollm, "x", response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}})


# --- the server, with real clients -------------------------------------------------------------------

MODEL = "qwen2.5-coder-0.5b"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}}, "required": ["city"],
                   "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]


class Person(BaseModel):
    name: str
    age: int
    languages: list[str]


@pytest.fixture(scope="module")
def server():
    zoo.pull(MODEL)
    # The default drafter: the target's own int4 copy drafting on its cache. One thread: the machine has two cores.
    process = ServerProcess(["--target", MODEL, "--max-batch", "4"], threads=1).start()
    try:
        process.wait_ready(timeout=300)
    except ServerStartError as exc:
        process.stop()
        pytest.fail(str(exc))
    yield process
    process.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_openai_parse_with_a_pydantic_model_equals_plain_decoding(server):
    messages = [{"role": "user", "content": PERSON}]
    spec = client(server).chat.completions.parse(model=MODEL, messages=messages, response_format=Person, temperature=0,
                                                 max_tokens=100)
    person = spec.choices[0].message.parsed
    assert isinstance(person, Person) and person.age == 36 and spec.choices[0].finish_reason == "stop"
    plain = client(server).chat.completions.parse(model=MODEL, messages=messages, response_format=Person, temperature=0,
                                                  max_tokens=100, extra_body={"speculate": False})
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.usage.model_extra["speculative"]["accepted_tokens"] > 0  # speculation did run, and was kept


def test_completions_take_a_response_format_too(server):
    body = {"prompt": "Python was first released in the year", "max_tokens": 8, "temperature": 0,
            "response_format": {"type": "regex", "pattern": " [0-9]{4}"}}
    text = httpx.post(server.url + "/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]
    assert len(text) == 5 and text[1:].isdigit()
    bad = httpx.post(server.url + "/v1/completions", json={**body, "response_format": {"type": "regex", "pattern": "(x"}}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}], ids=str)
def test_a_tool_call_round_trip(server, tool_choice):
    first = client(server).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=tool_choice,
                                                   temperature=0, max_tokens=60, parallel_tool_calls=False)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18, "sky": "cloudy"})}]
    final = client(server).chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                                   temperature=0, max_tokens=40)
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content
    rendered = httpx.post(server.url + "/tokenize", json={"messages": history}, timeout=60).json()["tokens"]
    text = verispec.load(MODEL).tokenizer.decode(rendered)
    assert "<tool_response>" in text and '"temperature_c": 18' in text and '"city": "Paris"' in text  # the template saw both


def test_streamed_tool_calls_assemble_in_the_openai_sdk(server):
    options = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=60,
                   parallel_tool_calls=False)
    whole = client(server).chat.completions.create(**options).choices[0]
    with client(server).chat.completions.stream(**options) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls" == whole.finish_reason
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    raw = client(server).chat.completions.create(**options, stream=True)
    deltas = [chunk.choices[0].delta for chunk in raw if chunk.choices]
    assert not any(d.content for d in deltas)  # the call's text is not sent as content
    assert [d.tool_calls[0].index for d in deltas if d.tool_calls] == [0]


def test_tools_errors_are_400s(server):
    for body, param in [({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
                          "tool_choice": "required"}, "tools"),
                        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
                         "response_format")]:
        response = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, **body}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_langchain_structured_output_and_bind_tools(server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="unused", temperature=0, max_tokens=100, max_retries=0,
                     timeout=300)
    person = llm.with_structured_output(Person).invoke(PERSON)
    assert isinstance(person, Person) and person.age == 36

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return json.dumps({"city": city, "temperature_c": 18})

    answer = llm.bind_tools([get_weather]).invoke(ASK[0]["content"])
    assert [(c["name"], c["args"]) for c in answer.tool_calls] == [("get_weather", {"city": "Paris"})]
    result = get_weather.invoke(answer.tool_calls[0]["args"])
    final = llm.bind_tools([get_weather], tool_choice="none").invoke(
        [HumanMessage(ASK[0]["content"]), answer, ToolMessage(result, tool_call_id=answer.tool_calls[0]["id"])])
    assert final.content and not final.tool_calls
