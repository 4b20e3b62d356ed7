"""Reading OpenAI request bodies: every known field is honoured or refused with a 400 that names it.

Errors take OpenAI's shape, {"error": {"message", "type", "param", "code"}}, and quote a caller's value
only in short (`show`): a 1 MB value does not come back inside its 400. Fields this server does not
know (`metadata`, `store`, ...) are ignored, as vLLM does, and listed in `Spec.ignored` so the caller
can be told; fields it knows but cannot honour (the deprecated functions, echo with logprobs) are
refused, since ignoring them would silently change the answer. Penalties, min_p, logit_bias, min_tokens,
logprobs and response_format are honoured exactly under speculation (`sampling.process_logits`,
`grammar`); tools go through the chat template and come back as tool_calls (`server.tools`). Turns a body
into a checked `Spec` (token ids, sampling, stop sequences, grammar, tools, draft setting); knows nothing
about decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verispec.errors import VerispecError
from verispec.grammar import Grammar, ll_tokenizer, response_format_grammar
from verispec.models.base import CausalLM
from verispec.options import DraftLen
from verispec.sampling import Cascade, SamplingParams, default_coupled
from verispec.server.scheduler import DraftSetting
from verispec.server.tools import CLOSE, OPEN, ToolError, ToolSetup, call_grammar, read_tools, supports_tools, template_message
from verispec.text import encode_chat

MAX_DRAFT_LEN = 16  # largest per-request draft_len: each distinct value is a lane of its own
MAX_CHOICES = 16  # most sequences (prompts x n) one HTTP request may ask for
MAX_STOP = 4  # stop sequences per request, as in OpenAI's API
MAX_TOP_LOGPROBS = 20  # most alternatives listed beside each token (OpenAI: 20 for chat, 5 for completions; vLLM: 20)
MAX_LOGIT_BIAS = 300  # most entries of logit_bias (OpenAI's limit)
SHOWN_CHARS = 60  # most characters of a caller's value quoted back in an error message
# Text past this many characters per token of context is too long unless its tokens average more
# characters than that; only such text is checked by tokenizing a prefix first (`check_text_fits`).
CHARS_PER_TOKEN_BOUND = 32


def show(value: Any) -> str:
    """A caller's value for an error message: its repr, cut to SHOWN_CHARS."""
    text = repr(value) if not isinstance(value, (list, dict)) or len(value) < 100 else f"<{type(value).__name__} of {len(value)} items>"
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body; 4xx are the caller's, 5xx the server's."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class Fields:
    """An OpenAI request body, read one field at a time."""

    def __init__(self, body: Any, allowed: set[str]):
        if not isinstance(body, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_body")
        self.ignored = sorted(set(body) - allowed)  # unknown fields: not read, reported back
        self.body = body

    def get(self, name: str, default=None):
        value = self.body.get(name)
        return default if value is None else value

    def integer(self, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
        value = self.get(name, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ApiError(400, f"{name} must be an integer, got {show(value)}", param=name, code="invalid_type")
        if value < low or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"between {low} and {high}"
            raise ApiError(400, f"{name} must be {bounds}, got {value}", param=name, code="invalid_value")
        return value

    def number(self, name: str, default: float, low: float, high: float, low_open: bool = False, high_open: bool = False) -> float:
        value = self.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ApiError(400, f"{name} must be a number, got {show(value)}", param=name, code="invalid_type")
        if not (low < value if low_open else low <= value) or not (value < high if high_open else value <= high):
            if low_open or high_open:
                bounds = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
            else:
                bounds = f"between {low} and {high}"
            raise ApiError(400, f"{name} must be {bounds}, got {value}", param=name, code="invalid_value")
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        value = self.get(name, default)
        if not isinstance(value, bool):
            raise ApiError(400, f"{name} must be true or false, got {show(value)}", param=name, code="invalid_type")
        return value

    def only_default(self, name: str, *defaults, why: str = "is not supported by this server") -> None:
        """Refuse any value but the defaults (the feature is not implemented, so it must not be asked for)."""
        value = self.body.get(name)
        if value is None or any(type(value) is type(d) and value == d for d in defaults):
            return
        raise ApiError(400, f"{name}={show(value)} {why}", param=name, code="unsupported_parameter")


MAX_CACHE_SALT = 1024  # characters of a cache_salt (vLLM suggests 43: 256 random bits in base64)
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop", "seed",
                 "user", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias",
                 "logprobs", "draft_len", "speculate", "coupled", "blockwise", "typical_acceptance", "cascade", "logprobs_mode",
                 "response_format", "cache_salt"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                               "function_call", "response_format", "parallel_tool_calls"}


@dataclass
class Spec:
    """A checked generation request: what to decode and how to answer."""

    prompts: list[list[int]]  # token ids per prompt
    max_tokens: list[int]  # per prompt
    n: int
    sampling: SamplingParams
    stop: list[str]
    draft: DraftSetting
    stream: bool
    include_usage: bool
    ignored: list[str]  # fields of the body this server does not know, and did not read
    logprobs: int | None = None  # None: no log-probabilities; n: each token's, with the n most likely beside it
    processed_logprobs: bool = False  # logprobs_mode "processed": after logit_bias, min_tokens and penalties
    echo: list[str] | None = None  # completions with echo: each prompt's text, put before its choices' text
    grammar: Grammar | None = None  # response_format, or a forced tool_choice: the output follows it
    tools: ToolSetup | None = None  # chat with tools: tool calls are parsed from the output (unless tool_choice is "none")
    # OpenAI's `user` (the end user): with the API key in use, the tenant whose earlier outputs may draft this request
    user: str | None = None
    # vLLM's `cache_salt`: prompts share prefix-cache blocks only with requests of the same salt (and API key)
    cache_salt: str | None = None


@dataclass
class ServerConfig:
    target: CausalLM
    model_name: str
    draft_len: DraftSetting  # the server's own setting; None when it was started without a drafter
    max_model_len: int  # most tokens of prompt plus answer per request: the model's context, or less if the server says


def parse_common(fields: Fields, config: ServerConfig, prompts: list[list[int]], prompt_param: str,
                 max_tokens: int | None, default_max_tokens: int | None) -> Spec:
    """Everything the two endpoints share. default_max_tokens None = up to the context."""
    model = fields.body.get("model")
    if model is not None and model != config.model_name:
        raise ApiError(404, f"the model {show(model)} does not exist: this server serves {config.model_name!r}",
                       param="model", code="model_not_found")
    stream = fields.boolean("stream", False)
    options = fields.body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options", code="invalid_value")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise ApiError(400, 'stream_options must be {"include_usage": true|false}', param="stream_options", code="invalid_value")
        include_usage = Fields(options, {"include_usage"}).boolean("include_usage", False)

    n = fields.integer("n", 1, 1, MAX_CHOICES)
    if n * len(prompts) > MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompts x n={n} is more than {MAX_CHOICES} sequences in one request", param="n", code="invalid_value")
    seed = fields.integer("seed", None, 0, 2**63 - 1 - MAX_CHOICES)
    temperature = fields.number("temperature", 1.0, 0.0, 2.0)  # OpenAI's default is 1
    typical = fields.number("typical_acceptance", 0.0, 0.0, 1.0, high_open=True)  # verispec extensions: the lossy opt-in ...
    # ... and coupled sampling (SamplingParams.coupled), on by default for a seeded request so that its
    # text is the same every time, whatever the timing, draft lengths and batch mates
    try:  # ... or a speculative cascade, {"rule": "chow"|"diff", "alpha": number} (SamplingParams.cascade)
        cascade = Cascade.parse(fields.body.get("cascade"))
    except VerispecError as exc:
        raise ApiError(400, str(exc), param="cascade", code="invalid_value") from exc
    coupled = fields.boolean("coupled", default_coupled(seed, temperature, typical, cascade))
    if typical and coupled:
        raise ApiError(400, "typical_acceptance is lossy and coupled sampling promises plain sampling's tokens: ask for one",
                       param="typical_acceptance", code="invalid_value")
    if cascade is not None and (coupled or typical):
        raise ApiError(400, "cascade is lossy and " + ("coupled sampling promises plain sampling's tokens" if coupled else
                       "typical_acceptance is another lossy rule") + ": ask for one", param="cascade", code="invalid_value")
    try:
        sampling = SamplingParams(
            temperature=temperature,
            top_p=fields.number("top_p", 1.0, 0.0, 1.0, low_open=True),
            top_k=fields.integer("top_k", 0, 0),
            seed=seed,
            coupled=coupled,
            blockwise=fields.boolean("blockwise", True),  # see SamplingParams.blockwise
            typical_acceptance=typical,
            cascade=cascade,
            presence_penalty=fields.number("presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=fields.number("frequency_penalty", 0.0, -2.0, 2.0),
            repetition_penalty=fields.number("repetition_penalty", 1.0, 0.0, 10.0, low_open=True),
            min_p=fields.number("min_p", 0.0, 0.0, 1.0),
            min_tokens=fields.integer("min_tokens", 0, 0),
            logit_bias=logit_bias(fields, config.target.vocab_size),
        )
    except VerispecError as exc:
        raise ApiError(400, str(exc), code="invalid_value") from exc

    stop = fields.body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise ApiError(400, f"stop must be a non-empty string or a list of them, got {show(stop)}", param="stop", code="invalid_value")
    if stop is not None and len(stop) > MAX_STOP:
        raise ApiError(400, f"stop takes at most {MAX_STOP} sequences, got {len(stop)}", param="stop", code="invalid_value")

    context = config.max_model_len
    for ids in prompts:
        if not ids:
            raise ApiError(400, "the prompt is empty: give at least one token", param=prompt_param, code="invalid_value")
        if len(ids) >= context:
            raise ApiError(400, f"the prompt has {len(ids)} tokens but the model's context window is {context}: shorten it",
                           param=prompt_param, code="context_length_exceeded")
        bad = [t for t in ids if not 0 <= t < config.target.vocab_size]
        if bad:
            raise ApiError(400, f"the prompt has token ids outside the vocabulary [0, {config.target.vocab_size}): {bad[:5]}",
                           param=prompt_param, code="invalid_value")
    budgets = []
    for ids in prompts:
        budget = max_tokens if max_tokens is not None else default_max_tokens or context - len(ids)
        if len(ids) + budget > context:
            raise ApiError(400, f"the model's context window is {context} tokens, but {len(ids)} prompt tokens + max_tokens "
                                f"{budget} exceed it: lower max_tokens or shorten the prompt",
                           param="max_tokens", code="context_length_exceeded")
        budgets.append(budget)
        if sampling.min_tokens > budget:
            raise ApiError(400, f"min_tokens ({sampling.min_tokens}) is more than max_tokens ({budget}): lower min_tokens",
                           param="min_tokens", code="invalid_value")
    mode = fields.get("logprobs_mode", "raw")  # verispec extension, vLLM's --logprobs-mode per request
    if mode not in ("raw", "processed"):
        raise ApiError(400, f'logprobs_mode must be "raw" (the model\'s logits, the default) or "processed" (after logit_bias, '
                            f'min_tokens and penalties), got {show(mode)}', param="logprobs_mode", code="invalid_value")
    user = fields.body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, f"user must be a string, got {show(user)}", param="user", code="invalid_type")
    salt = fields.body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT):
        raise ApiError(400, f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters, got {show(salt)}",
                       param="cache_salt", code="invalid_value")
    return Spec(prompts, budgets, n, sampling, stop or [], parse_draft(fields, config), stream, include_usage, fields.ignored,
                processed_logprobs=mode == "processed", grammar=response_format(fields, config, sampling), user=user or None,
                cache_salt=salt)


def response_format(fields: Fields, config: ServerConfig, sampling: SamplingParams) -> Grammar | None:
    """response_format (OpenAI's json_object and json_schema, verispec's regex and lark) -> a grammar the output
    follows, compiled and checked now (on the request's parsing thread, not the worker)."""
    value = fields.body.get("response_format")
    if value is None or value == {"type": "text"}:
        return None
    target = config.target
    try:
        grammar = response_format_grammar(value, target.tokenizer, target.vocab_size, target.eos_token_ids)
    except VerispecError as exc:
        raise ApiError(400, str(exc), param="response_format", code="invalid_value") from exc
    if grammar is not None and sampling.min_tokens:
        raise ApiError(400, "min_tokens cannot be combined with response_format: the grammar decides where the output ends",
                       param="min_tokens", code="invalid_value")
    return grammar


def logit_bias(fields: Fields, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias, {"token id": bias in [-100, 100]} (JSON keys are strings) -> (id, bias) pairs."""
    bias = fields.body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise ApiError(400, f'logit_bias must be an object of token ids to biases, e.g. {{"50256": -100}}, got {show(bias)}',
                       param="logit_bias", code="invalid_type")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}", param="logit_bias", code="invalid_value")
    pairs = []
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12) or int(key) >= vocab_size:
            raise ApiError(400, f"logit_bias keys must be token ids in [0, {vocab_size}), got {show(key)}", param="logit_bias",
                           code="invalid_value")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias values must be numbers in [-100, 100], got {show(value)} for token {key}",
                           param="logit_bias", code="invalid_value")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def parse_draft(fields: Fields, config: ServerConfig) -> DraftSetting:
    """Per-request speculation: "speculate": false decodes plainly; "draft_len": k drafts k tokens a step, "auto"
    adapts, "tree" adapts with token-tree alternates."""
    speculate = fields.boolean("speculate", True)
    draft_len = fields.body.get("draft_len")
    if draft_len is not None:
        try:
            draft_len = DraftLen.parse(draft_len, most=MAX_DRAFT_LEN)
        except VerispecError:
            raise ApiError(400, f"draft_len must be an integer 1-{MAX_DRAFT_LEN}, 'auto' or 'tree', got {show(draft_len)}",
                           param="draft_len", code="invalid_value") from None
    if config.draft_len is None:
        if fields.body.get("speculate") is True or draft_len is not None:
            param = "draft_len" if draft_len is not None else "speculate"
            raise ApiError(400, "this server was started with --drafter none: it cannot speculate", param=param, code="unsupported_parameter")
        return None
    if not speculate:
        if draft_len is not None:
            raise ApiError(400, "draft_len needs speculation: drop it, or drop speculate=false", param="draft_len", code="invalid_value")
        return None
    return draft_len if draft_len is not None else config.draft_len


def parse_completion(body: Any, config: ServerConfig, tokenizer) -> Spec:
    fields = Fields(body, COMPLETION_FIELDS)
    fields.only_default("suffix", "")
    fields.only_default("best_of", 1)
    logprobs = fields.integer("logprobs", None, 0, MAX_TOP_LOGPROBS)  # completions: how many alternatives per token
    echo = fields.boolean("echo", False)
    if echo and logprobs is not None:
        raise ApiError(400, "echo with logprobs would need the prompt's log-probabilities, which this server does not compute: "
                            "drop echo (prepend the prompt yourself) or drop logprobs", param="echo", code="unsupported_parameter")
    prompts = completion_prompts(fields.body.get("prompt"), tokenizer, config.max_model_len)
    max_tokens = fields.integer("max_tokens", None, 1)
    spec = parse_common(fields, config, prompts, "prompt", max_tokens, default_max_tokens=16)
    spec.logprobs = logprobs
    if echo:  # text prompts as given; token prompts decoded
        raw = fields.body.get("prompt")  # already checked by completion_prompts
        given = [raw] if isinstance(raw, str) or all(isinstance(t, int) for t in raw) else raw
        spec.echo = [text if isinstance(text, str) else tokenizer.decode(ids) for text, ids in zip(given, prompts)]
    return spec


def completion_prompts(prompt: Any, tokenizer, context: int) -> list[list[int]]:
    """prompt: text, token ids, or a list of either -> token ids per prompt."""
    def is_ids(x):
        return isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if prompt is None:
        raise ApiError(400, "prompt is required", param="prompt", code="missing_parameter")
    if isinstance(prompt, str) or is_ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(p, str) or is_ids(p) for p in prompt):
        raise ApiError(400, "prompt must be text, a list of token ids, or a non-empty list of either", param="prompt", code="invalid_type")
    if len(prompt) > MAX_CHOICES:
        raise ApiError(400, f"at most {MAX_CHOICES} prompts per request", param="prompt", code="invalid_value")
    out = []
    for p in prompt:
        if isinstance(p, str):
            if not p:
                raise ApiError(400, "the prompt is empty text", param="prompt", code="invalid_value")
            check_text_fits(tokenizer, p, context, "prompt")
            p = list(tokenizer(p)["input_ids"])
        out.append(p)
    return out


def check_text_fits(tokenizer, text: str, context: int, param: str) -> None:
    """Refuse text whose tokens cannot fit in the context, without tokenizing all of a huge text: past
    CHARS_PER_TOKEN_BOUND characters per token of context, its first that many characters are tokenized,
    and if they alone fill the context (with a margin for the tokens a cut can merge), so would the whole."""
    head = context * CHARS_PER_TOKEN_BOUND
    if len(text) > head and len(tokenizer(text[:head])["input_ids"]) > context + 8:
        raise ApiError(400, f"the {param} has {len(text)} characters, more tokens than the model's context window of {context} "
                            "holds: shorten it", param=param, code="context_length_exceeded")


def parse_chat(body: Any, config: ServerConfig, tokenizer) -> Spec:
    fields = Fields(body, CHAT_FIELDS)
    wants_logprobs = fields.boolean("logprobs", False)  # chat: true, with top_logprobs alternatives per token
    top_logprobs = fields.integer("top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top_logprobs is not None and not wants_logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    fields.only_default("functions", [], why="(the deprecated function calling) is not supported by this server: use tools")
    fields.only_default("function_call", "none", why="(the deprecated function calling) is not supported by this server: use tool_choice")
    if fields.body.get("max_tokens") is not None and fields.body.get("max_completion_tokens") is not None:
        raise ApiError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens", code="invalid_value")
    max_tokens = fields.integer("max_tokens", None, 1)
    if max_tokens is None:
        max_tokens = fields.integer("max_completion_tokens", None, 1)
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, f"{config.model_name} has no chat template: use /v1/completions", param="messages", code="unsupported_model")
    try:
        tools = read_tools(fields.body.get("tools"), fields.body.get("tool_choice"), fields.body.get("parallel_tool_calls"))
    except ToolError as exc:
        raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from exc
    if tools is not None and tools.parses and not supports_tools(tokenizer.chat_template):
        raise ApiError(400, f"the chat template of {config.model_name} has no tool support (verispec reads tool calls in the "
                            f"{OPEN}...{CLOSE} format of Qwen2.5 and Hermes templates): drop tools, or serve a model or "
                            "--chat-template that has it", param="tools", code="unsupported_model")
    messages = chat_messages(fields.body.get("messages"))
    check_text_fits(tokenizer, "".join(m.get("content") or "" for m in messages), config.max_model_len, "messages")
    # tool_choice "none": the tools stay out of the prompt, so the model answers in text
    ids = render_chat(tokenizer, messages, tools.tools if tools is not None and tools.parses else None)
    spec = parse_common(fields, config, [ids], "messages", max_tokens, default_max_tokens=None)
    spec.logprobs = (top_logprobs or 0) if wants_logprobs else None
    if tools is not None and tools.parses:
        spec.tools = tools
        if tools.forced:
            if spec.grammar is not None:
                raise ApiError(400, f"tool_choice {show(fields.body.get('tool_choice'))} already decides the output's form: drop "
                                    "response_format, or use tool_choice \"auto\"", param="response_format", code="invalid_value")
            if spec.sampling.min_tokens:
                raise ApiError(400, "min_tokens cannot be combined with a forced tool_choice", param="min_tokens", code="invalid_value")
            spec.grammar = tool_call_grammar(tools, config, tokenizer)
    return spec


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Checked messages (`chat_messages`) and tools -> the prompt's token ids through the chat template, with an
    assistant's tool_calls in the form templates read (`tools.template_message`); /tokenize renders the same way."""
    try:
        return encode_chat(tokenizer, [template_message(m) for m in messages], tools=tools)
    except Exception as exc:  # the template's own checks (jinja raise_exception), e.g. roles out of order
        raise ApiError(400, f"the chat template cannot render these messages: {str(exc)[:200]}", param="messages",
                       code="invalid_value") from exc


def tool_call_grammar(tools: ToolSetup, config: ServerConfig, tokenizer) -> Grammar:
    """The grammar of a forced tool_choice, naming <tool_call> and </tool_call> as the tokenizer's single tokens
    where it has them."""
    target = config.target
    special = {}
    for text in (OPEN, CLOSE):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) == 1:
            special[text] = ids[0]
    try:
        return Grammar(ll_tokenizer(target.tokenizer, target.vocab_size, target.eos_token_ids), call_grammar(tools, special),
                       target.vocab_size, target.eos_token_ids, description="tool call grammar (from the tools' parameters)")
    except VerispecError as exc:
        raise ApiError(400, str(exc), param="tools", code="invalid_value") from exc


def chat_messages(messages: Any) -> list[dict]:
    """OpenAI messages -> [{"role", "content": str, ...}] for the chat template; text parts only. Tool results
    (role "tool", with tool_call_id) and an assistant's tool_calls (content may then be null) are kept."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", param="messages",
                       code="missing_parameter" if messages is None else "invalid_type")
    out = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{param} must be an object with role and content", param=param, code="invalid_type")
        role, content = message.get("role"), message.get("content")
        role = "system" if role == "developer" else role
        if role not in ("system", "user", "assistant", "tool"):
            raise ApiError(400, f"{param}.role must be system, developer, user, assistant or tool, got {show(role)}",
                           param=f"{param}.role", code="invalid_value")
        tool_calls = message.get("tool_calls") if role == "assistant" else None
        if tool_calls is not None:
            tool_calls = checked_tool_calls(tool_calls, f"{param}.tool_calls")
        if isinstance(content, list):
            if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content):
                raise ApiError(400, f"{param}.content: only text parts are supported", param=f"{param}.content", code="invalid_value")
            content = "".join(part["text"] for part in content)
        if content is None and tool_calls:
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"{param}.content must be a string or a list of text parts", param=f"{param}.content", code="invalid_type")
        allowed = {"role", "content", "name"} | ({"tool_calls", "refusal", "annotations"} if role == "assistant" else set()) | (
            {"tool_call_id"} if role == "tool" else set())
        extra = set(message) - allowed
        if extra:
            raise ApiError(400, f"{param} has fields this server does not support: {show(sorted(extra))}", param=param, code="unsupported_parameter")
        entry = {"role": role, "content": content}
        if tool_calls:
            entry["tool_calls"] = tool_calls
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise ApiError(400, f"{param}.tool_call_id must be text", param=f"{param}.tool_call_id", code="invalid_type")
            entry["tool_call_id"] = call_id
        if role == "tool" and isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        out.append(entry)
    return out


def checked_tool_calls(calls: Any, param: str) -> list[dict]:
    """An assistant message's tool_calls: [{"id", "type": "function", "function": {"name", "arguments": JSON text}}]."""
    if not isinstance(calls, list):
        raise ApiError(400, f"{param} must be a list of tool calls", param=param, code="invalid_type")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(function, dict) or not isinstance(function.get("name"), str)
                or not isinstance(function.get("arguments", ""), (str, dict))):
            raise ApiError(400, f'{param}[{j}] must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}',
                           param=f"{param}[{j}]", code="invalid_value")
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": function.get("arguments", "")}})
    return out
