"""Tool calls: OpenAI's `tools` and `tool_choice` in, the model's tool-call text out as OpenAI's `tool_calls`.

The tools are rendered by the model's own chat template (which lists them in the prompt), and the model
answers in its own tool-call format. verispec reads the format of Qwen2.5, Hermes and the many templates that
copied it: each call a JSON object {"name": ..., "arguments": {...}} between <tool_call> and </tool_call>.
With tool_choice "auto" the model writes freely and the calls are parsed from its text; with "required" or a
named function its output is constrained by a grammar to calls of those functions, arguments following each
function's JSON schema (exact under speculation, like every grammar: `verispec.grammar`). Streams hold back
text once a call begins and send each call whole when it closes. Knows nothing about decoding or HTTP.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)


class ToolError(ValueError):
    """A tools, tool_choice or message field the caller got wrong; `param` names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class ToolSetup:
    """What a chat request asked of tools."""

    tools: list[dict]  # OpenAI's tool objects, checked: {"type": "function", "function": {"name", ...}}
    choice: str  # "none", "auto", "required", or the name of the one function to call
    parallel: bool  # several calls in one answer may be returned

    @property
    def forced(self) -> bool:
        """The output must be tool calls (constrained by a grammar)."""
        return self.choice not in ("none", "auto")

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    def functions(self) -> list[dict]:
        named = [t["function"] for t in self.tools]
        return named if self.choice in ("auto", "required") else [f for f in named if f["name"] == self.choice]


def supports_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders `tools` and teaches the <tool_call> format verispec reads."""
    return bool(chat_template) and "tools" in chat_template and OPEN in chat_template


def read_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolSetup | None:
    """The request's tools fields -> a ToolSetup, or None when there are no tools. Raises ToolError."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice needs tools: give the functions in tools", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > 128:
        raise ToolError("tools must be a list of at most 128 {\"type\": \"function\", \"function\": {...}} objects", "tools")
    names = set()
    checked = []
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
            raise ToolError(f'{param} must be {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}', "tools")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ToolError(f"{param}.function.name must be 1-64 letters, digits, _ or -", "tools")
        if name in names:
            raise ToolError(f"{param}: the function {name!r} is given twice", "tools")
        names.add(name)
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolError(f"{param}.function.parameters must be a JSON schema object", "tools")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolError(f"{param}.function.description must be text", "tools")
        entry = {"name": name, "parameters": parameters}
        if description is not None:
            entry["description"] = description
        checked.append({"type": "function", "function": entry})
    if tool_choice is None:
        choice = "auto"
    elif tool_choice in ("none", "auto", "required"):
        choice = tool_choice
    elif (isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(tool_choice.get("function"), dict)
          and isinstance(tool_choice["function"].get("name"), str)):
        choice = tool_choice["function"]["name"]
        if choice not in names:
            raise ToolError(f"tool_choice names the function {choice[:64]!r}, which is not in tools", "tool_choice")
    else:
        raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                        "tool_choice")
    return ToolSetup(checked, choice, parallel_tool_calls is not False)


def call_grammar(setup: ToolSetup, special_ids: dict[str, int]) -> str:
    """Lark text (llguidance's dialect) for the answer a forced tool_choice allows: one call, or several separated
    by newlines if parallel calls are allowed, of the chosen functions, arguments following their schemas.
    special_ids: the tokenizer's single tokens for <tool_call> and </tool_call>, if it has them; the grammar then
    names those tokens (a model emits the token, not its characters)."""
    def mark(text: str) -> str:
        return f"<[{special_ids[text]}]>" if text in special_ids else json.dumps(text)

    several = ' ("\\n" call)*' if setup.parallel and setup.choice == "required" else ""
    rules = [f"start: call{several}"]
    functions = setup.functions()
    rules.append(f'call: {mark(OPEN)} "\\n" ({" | ".join(f"fn_{i}" for i in range(len(functions)))}) "\\n" {mark(CLOSE)}')
    for i, function in enumerate(functions):
        head = '{"name": ' + json.dumps(function["name"]) + ', "arguments": '
        rules.append(f'fn_{i}: {json.dumps(head)} args_{i} "}}"')
        rules.append(f"args_{i}: %json {json.dumps(function['parameters'])}")
    return "\n".join(rules)


def _call(body: str) -> dict | None:
    """One call's JSON text -> OpenAI's tool call, or None if it is not a {"name", "arguments"} object."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", parsed.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": parsed["name"], "arguments": arguments}}


def bare_calls(text: str, names: set[str]) -> list[dict] | None:
    """An answer that is nothing but a call's JSON object (or a list of them), perhaps in a ```json fence, each
    naming a declared function and holding only name and arguments -> its calls; else None."""
    body = text.strip()
    fenced = _FENCE.fullmatch(body)
    if fenced:
        body = fenced.group(1)
    if not body.startswith(("{", "[")):
        return None
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    items = parsed if isinstance(parsed, list) else [parsed]
    if not items or not all(isinstance(item, dict) and item.get("name") in names and set(item) <= {"name", "arguments", "parameters"}
                            for item in items):
        return None
    return [_call(json.dumps(item)) for item in items]


def parse_calls(text: str, parallel: bool = True, names: set[str] = frozenset()) -> tuple[str | None, list[dict]]:
    """A finished answer -> (the text outside the calls, None if there is none; OpenAI's tool_calls). A call whose
    JSON does not parse stays in the text; without parallel calls, only the first call is kept. names: the declared
    functions, for answers that are bare calls (`bare_calls`)."""
    calls, kept, last = [], [], 0
    for match in _CALL.finditer(text):
        call = _call(match.group(1).strip())
        if call is None:
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip()
    if not calls and names:
        bare = bare_calls(text, names)
        if bare:
            content, calls = "", bare
    return (content or None), (calls if parallel else calls[:1])


class CallStream:
    """Tool calls out of a streamed answer: text deltas in; text safe to send and whole calls out. Text is held
    back from where a call may begin ("<tool_call>" or a prefix of it at the end) until the call closes; with
    declared function names, an answer that opens with "{", "[" or "`" is held to its end, since it may be
    bare calls (`bare_calls`)."""

    def __init__(self, parallel: bool = True, names: set[str] = frozenset()):
        self.parallel = parallel
        self.names = names
        self.buffer = ""
        self.in_call = False
        self.calls = 0  # calls sent so far
        self.bare: bool | None = None if names else False  # may the answer be bare calls? None: not known yet
        self.opening = ""  # the answer held while that is decided, or to its end if it may be

    def push(self, delta: str, finished: bool) -> tuple[str, list[dict]]:
        if self.bare is not False:
            self.opening += delta
            start = self.opening.lstrip()[:1]
            if not start and not finished:
                return "", []
            self.bare = start in ("{", "[", "`")
            if self.bare and not finished:
                return "", []
            delta, self.opening, held = self.opening, "", self.bare
            self.bare = False
            calls = bare_calls(delta, self.names) if held else None
            if calls:
                calls = calls if self.parallel else calls[:1]
                self.calls += len(calls)
                return "", calls
        return self._tagged(delta, finished)

    def _tagged(self, delta: str, finished: bool) -> tuple[str, list[dict]]:
        self.buffer += delta
        text, calls = "", []
        while True:
            if not self.in_call:
                start = self.buffer.find(OPEN)
                if start >= 0:
                    text += self.buffer[:start]
                    self.buffer, self.in_call = self.buffer[start + len(OPEN):], True
                    continue
                hold = 0 if finished else next((n for n in range(min(len(OPEN) - 1, len(self.buffer)), 0, -1)
                                                if self.buffer.endswith(OPEN[:n])), 0)
                text += self.buffer[: len(self.buffer) - hold]
                self.buffer = self.buffer[len(self.buffer) - hold:]
                break
            end = self.buffer.find(CLOSE)
            if end < 0:
                if finished:  # a call that never closed (cut by max_tokens) is text
                    text += OPEN + self.buffer
                    self.buffer = ""
                break
            body, self.buffer, self.in_call = self.buffer[:end], self.buffer[end + len(CLOSE):], False
            call = _call(body.strip())
            if call is None:
                text += OPEN + body + CLOSE
            elif self.parallel or self.calls + len(calls) == 0:
                calls.append(call)
        if self.calls + len(calls) and not text.strip():  # whitespace around calls is not content
            text = ""
        self.calls += len(calls)
        return text, calls


def template_message(message: dict) -> dict:
    """A checked chat message in the form chat templates read: an assistant's tool_calls with arguments as objects
    (OpenAI sends them as JSON text; templates such as Qwen2.5's write them with `tojson`)."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        arguments = call["function"]["arguments"]
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            pass  # not JSON: the template gets the text
        calls.append({"id": call.get("id"), "type": "function", "function": {"name": call["function"]["name"], "arguments": arguments}})
    return {**message, "tool_calls": calls}
