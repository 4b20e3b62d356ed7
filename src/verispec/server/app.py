"""The HTTP layer: OpenAI's API over the scheduler, with FastAPI under uvicorn, and `verispec serve`.

The event loop only moves bytes: it reads a body (at most `max_body_bytes`, else 413), hands the
parsing, checking (`protocol`) and tokenizing of it to a thread, and answers in OpenAI's JSON or
server-sent events, so a huge or slow request cannot stall /health or other streams. The worker
thread (`scheduler`) owns the models and decodes; each request's `TokenEvent`s come back to the loop
through a thread-safe callback. A request that does not fit in the queue now gets a 503 at once; one
that could never fit, a 400. Every request is counted on /metrics with the status it ended with (a
stream that fails after its 200 header counts as its error), and a fault inside one request's
handling is that request's 500, never the server's.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import itertools
import json
import logging
import os
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import verispec
from verispec import zoo
from verispec.api import load, load_draft, make_drafter, resolve_drafter, suffix_index
from verispec.engine import Request as EngineRequest
from verispec.errors import VerispecError
from verispec.grammar import ll_tokenizer
from verispec.heads import MedusaHead, OnlineConfig, OnlineMedusa
from verispec.prefill import Chunking
from verispec.prefix_cache import PrefixCache
from verispec.options import DRAFTER_NAMES, WEIGHT_DTYPES, DraftLen, draft_vocab as parse_draft_vocab, flag, positive_int
from verispec.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, Metrics
from verispec.server.protocol import (ApiError, ServerConfig, Spec, chat_messages, check_text_fits, parse_chat, parse_completion,
                                      render_chat, show)
from verispec.sampling import TokenLogprob
from verispec.server.scheduler import PREFILL_SECONDS_PER_STEP, Job, JobFailed, QueueFull, Scheduler
from verispec.server.tools import CallStream, ToolError, parse_calls, read_tools
from verispec.stats import SpecStats
from verispec.text import IncrementalText, StopSequences, final_text

DISCONNECT_POLL_SECONDS = 0.5  # how often a waiting non-streamed request checks that its client is still there
RETRY_AFTER_SECONDS = 1  # the Retry-After a client gets with a 503 when the queue is full
MAX_BODY_BYTES = 4 * 2**20  # default limit of a request body: ~1M tokens of text, far past any context here
# default prefix cache budget: ~20k tokens of a Qwen2.5 0.5B's keys and values (24 KiB a token), ~11k of SmolLM2 135M's
PREFIX_CACHE_BYTES = 512 * 2**20

log = logging.getLogger(__name__)



class LockedTokenizer:
    """The tokenizer behind a lock: the event loop encodes and decodes while the worker checks stop sequences.

    chat_template: the server's own template (--chat-template), used in place of the tokenizer's without
    changing the tokenizer, which a loaded model shares with every other user of it in this process."""

    def __init__(self, tokenizer, chat_template: str | None = None):
        self._tokenizer = tokenizer
        self._template = chat_template
        self._lock = threading.Lock()

    def __call__(self, *args, **kwargs):
        with self._lock:
            return self._tokenizer(*args, **kwargs)

    def decode(self, *args, **kwargs):
        with self._lock:
            return self._tokenizer.decode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        if self._template is not None:
            kwargs["chat_template"] = self._template
        with self._lock:
            return self._tokenizer.apply_chat_template(*args, **kwargs)

    @property
    def chat_template(self):
        return self._template if self._template is not None else getattr(self._tokenizer, "chat_template", None)


@dataclass
class Choice:
    index: int
    job: Job
    stats: SpecStats
    text: IncrementalText
    prompt: int = 0  # which prompt of the request
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, when the request asked for them
    logprobs_sent: int = 0  # how many of them a stream has sent
    text_offset: int = 0  # characters before the next token's text in a completion's logprobs (text_offset)
    calls: CallStream | None = None  # a streamed chat answer with tools: its tool calls, parsed as they close
    calls_sent: int = 0  # how many tool calls a stream has sent


_job_ids = itertools.count()


class Generation:
    """The choices of one HTTP request; events reach it through an asyncio queue fed by the worker."""

    def __init__(self, spec: Spec, tokenizer: LockedTokenizer, loop: asyncio.AbstractEventLoop,
                 on_gap: Callable[[float], None] | None = None, tenant=None, cache_salt: str = ""):
        """on_gap: called with the seconds between two deliveries of tokens (inter-token latency). tenant: whose
        request this is (`tenant_of`): drafters that keep earlier outputs draft it from that tenant's only.
        cache_salt: the prefix cache's salt for its prompts (`cache_salt_of`)."""
        self.spec = spec
        self.on_gap = on_gap
        self.last_tokens_at = 0.0
        self.events: asyncio.Queue = asyncio.Queue()
        self.started = time.perf_counter()
        self.first_token_at: float | None = None
        self.counted = False  # a streamed response: counted on /metrics yet
        checker = StopSequences(tokenizer, spec.stop) if spec.stop else None
        self.choices = []
        for p, ids in enumerate(spec.prompts):
            for j in range(spec.n):
                index = p * spec.n + j
                # Choice i of a seeded request uses seed + i: each is reproducible alone, and they differ.
                sampling = replace(spec.sampling, seed=None if spec.sampling.seed is None else spec.sampling.seed + index)
                stats = SpecStats()
                request = EngineRequest(prompt=ids, sampling=sampling, max_new_tokens=spec.max_tokens[p],
                                        stop_checker=checker, id=next(_job_ids), stats=stats, logprobs=spec.logprobs,
                                        processed_logprobs=spec.processed_logprobs, grammar=spec.grammar, tenant=tenant,
                                        cache_salt=cache_salt)
                deliver = (lambda item, index=index: _post(loop, self.events, (index, item)))
                job = Job(request, spec.draft, deliver)
                calls = CallStream(spec.tools.parallel, spec.tools.names) if spec.tools is not None else None
                self.choices.append(Choice(index, job, stats, IncrementalText(tokenizer, spec.stop), prompt=p, calls=calls))

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def unfinished_jobs(self) -> list[int]:
        return [c.job.id for c in self.choices if c.finish_reason is None]

    async def updates(self, is_disconnected: Callable[[], Any] | None) -> AsyncIterator[tuple[Choice, str]]:
        """(choice, new visible text) per step, until every choice has finished. Raises ApiError if one fails.

        is_disconnected: polled while waiting (for responses that cannot notice a disconnect by writing)."""
        last_check = time.monotonic()
        while not self.finished:
            # Check the client every poll interval whether or not events keep arriving: a fast model
            # may never leave the queue empty for a whole interval.
            if is_disconnected and time.monotonic() - last_check >= DISCONNECT_POLL_SECONDS:
                last_check = time.monotonic()
                if await is_disconnected():
                    raise ApiError(499, "the client disconnected", code="client_disconnected")
            try:
                timeout = DISCONNECT_POLL_SECONDS if is_disconnected else None
                index, item = await asyncio.wait_for(self.events.get(), timeout)
            except asyncio.TimeoutError:
                continue
            choice = self.choices[index]
            if isinstance(item, JobFailed):
                raise ApiError(item.status, item.message, code="engine_error" if item.status >= 500 else "invalid_request")
            if item.tokens:
                now = time.perf_counter()
                if self.first_token_at is None:
                    self.first_token_at = now
                elif self.on_gap is not None:
                    self.on_gap(now - self.last_tokens_at)
                self.last_tokens_at = now
            choice.tokens.extend(item.tokens)
            if item.logprobs:
                choice.logprobs.extend(item.logprobs)
            choice.finish_reason = item.finish_reason
            delta = choice.text.push(item.tokens, item.finish_reason is not None)
            yield choice, delta

    def outcome(self) -> tuple[int, list[str]]:
        """(tokens generated in all, each choice's finish reason)."""
        return sum(len(c.tokens) for c in self.choices), [c.finish_reason or "abort" for c in self.choices]

    def timings(self) -> tuple[float, float | None]:
        """(seconds from request to now, seconds from request to the first token or None)."""
        first = None if self.first_token_at is None else self.first_token_at - self.started
        return time.perf_counter() - self.started, first

    def usage(self) -> dict:
        completion = sum(len(c.tokens) for c in self.choices)
        prompt = sum(len(ids) for ids in self.spec.prompts)
        stats = SpecStats()
        for c in self.choices:  # every choice's own figures, summed
            stats.target_passes += c.stats.target_passes
            stats.sequence_steps += c.stats.sequence_steps
            stats.drafted_tokens += c.stats.drafted_tokens
            stats.accepted_tokens += c.stats.accepted_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "speculative": {
                "drafted_tokens": stats.drafted_tokens,
                "accepted_tokens": stats.accepted_tokens,
                "acceptance_rate": round(stats.acceptance_rate, 4),
                "mean_accepted_tokens": round(stats.mean_accepted_tokens, 4),
                "target_passes": stats.target_passes,
                # asked for a lossy rule (typical acceptance, a cascade): the text is not the target's own
                **({"lossy": True} if self.spec.sampling.lossy else {}),
            },
        }


class EventStream(StreamingResponse):
    """Server-sent events; `on_close` runs however the response ends, even if its body never started
    (the client left before the first byte), so the jobs behind it never run on unread."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None], headers: dict[str, str] | None = None):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _post(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, item) -> None:
    """Hand an item from the worker thread to the event loop (dropped if the loop has closed)."""
    try:
        loop.call_soon_threadsafe(events.put_nowait, item)
    except RuntimeError:
        pass


# ---------------------------------------------------------------------------------------------------
# The HTTP application.


class Endpoint:
    """How one endpoint shapes its answers: a text completion or a chat completion."""

    def __init__(self, path: str, parse: Callable, chat: bool):
        self.path, self.parse, self.chat = path, parse, chat
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self.id_prefix = "chatcmpl-" if chat else "cmpl-"

    def choice(self, choice: Choice, text: str, tokenizer, spec: Spec) -> dict:
        logprobs = self.logprobs(choice, tokenizer, spec)
        if self.chat:
            message, finish_reason = {"role": "assistant", "content": text}, choice.finish_reason
            if spec.tools is not None:
                content, calls = parse_calls(text, spec.tools.parallel, spec.tools.names)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            return {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        if spec.echo is not None:
            text = spec.echo[choice.prompt] + text
        return {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason}

    def chunk_choice(self, choice: Choice, delta: str | None, finish_reason: str | None, tokenizer=None, spec: Spec | None = None,
                     tool_calls: list[dict] | None = None) -> dict:
        """tool_calls: calls that closed in this chunk (chat with tools), sent whole in OpenAI's delta shape."""
        logprobs = self.logprobs(choice, tokenizer, spec) if spec is not None and delta is not None else None
        if self.chat:
            content = {"role": "assistant", "content": ""} if delta is None else ({"content": delta} if delta else {})
            if tool_calls:
                content["tool_calls"] = [{"index": choice.calls_sent + i, **call} for i, call in enumerate(tool_calls)]
                choice.calls_sent += len(tool_calls)
            if finish_reason == "stop" and choice.calls_sent:
                finish_reason = "tool_calls"
            return {"index": choice.index, "delta": content, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": choice.index, "text": delta or "", "logprobs": logprobs, "finish_reason": finish_reason}

    def logprobs(self, choice: Choice, tokenizer, spec: Spec) -> dict | None:
        """The log-probabilities of the choice's tokens not sent yet, in this endpoint's shape (None if not
        asked for): completions {tokens, token_logprobs, top_logprobs, text_offset}, where top_logprobs also
        holds the chosen token, as OpenAI's legacy API does; chat {content: [{token, logprob, bytes,
        top_logprobs}]}. Token text is each token decoded alone."""
        if spec.logprobs is None:
            return None
        new, choice.logprobs_sent = choice.logprobs[choice.logprobs_sent :], len(choice.logprobs)
        piece = lambda token: tokenizer.decode([token])  # noqa: E731
        if self.chat:
            entry = lambda token, logprob: {"token": piece(token), "logprob": logprob, "bytes": list(piece(token).encode())}  # noqa: E731
            return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(token, lp) for token, lp in t.top]}
                                for t in new]}
        if choice.text_offset == 0 and spec.echo is not None:
            choice.text_offset = len(spec.echo[choice.prompt])
        offsets = []
        for t in new:
            offsets.append(choice.text_offset)
            choice.text_offset += len(piece(t.token))
        return {"tokens": [piece(t.token) for t in new], "token_logprobs": [t.logprob for t in new],
                "top_logprobs": [{piece(t.token): t.logprob, **{piece(token): lp for token, lp in t.top}} for t in new],
                "text_offset": offsets}


DRAFT_DTYPES = WEIGHT_DTYPES
# Tokens of earlier outputs kept per tenant for suffix drafting (`api.SUFFIX_INDEX_DRAFTERS`), oldest out first.
SUFFIX_TOKENS_PER_TENANT = 1 << 16


def key_tenant(key: str) -> str:
    """The tenant an API key stands for: a digest, so the key itself is kept nowhere but the key list."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def tenant_of(key_tenant: str | None, user: str | None) -> tuple[str | None, str | None]:
    """Whose request it is: the API key in use, then OpenAI's `user` within it (where no key distinguishes
    requests, `user` alone does). One tenant's outputs never draft another's (`SuffixIndex` partitions)."""
    return (key_tenant, user)


def cache_salt_of(key_tenant: str | None, cache_salt: str | None) -> str:
    """The prefix cache salt of a request (`engine.Request.cache_salt`): its API key's tenant and its own
    `cache_salt`, so tenants of different keys never share a cached prompt (a hit's shorter time to first
    token would tell one whether another sent it) and a client may split its own requests further. Without
    keys, only `cache_salt` parts requests; `user` does not, so a shared system prompt stays shared."""
    return "\0".join(part for part in (key_tenant, cache_salt) if part is not None)


def read_api_keys(keys: "str | list[str] | tuple[str, ...] | None") -> list[str]:
    """The keys a server accepts (one, several, or none), checked: each a non-empty string without spaces."""
    keys = [keys] if isinstance(keys, str) else list(keys or ())
    for key in keys:
        if not isinstance(key, str) or not key or any(c.isspace() for c in key):
            raise VerispecError("an API key must be a non-empty string without spaces: check --api-key / --api-key-file")
    return keys


def read_key_file(path: str) -> list[str]:
    """--api-key-file: one key per line; blank lines and lines starting with # are skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise VerispecError(f"--api-key-file {path!r} cannot be read: {exc}") from exc
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise VerispecError(f"--api-key-file {path!r} holds no keys: put one key per line")
    return keys


def build_app(target, draft=None, drafter: str = "auto", draft_len: DraftLen | int | str = "auto",
              api_key: str | list[str] | None = None, max_batch: int = 8, max_queue: int = 256, draft_dtype: str | None = None,
              draft_vocab: int | str | None = "auto", model_name: str | None = None, max_body_bytes: int = MAX_BODY_BYTES, max_model_len: int | None = None,
              chat_template: str | None = None, numerics: str = "float32", prefix_cache_bytes: int = PREFIX_CACHE_BYTES,
              suffix_tokens_per_tenant: int = SUFFIX_TOKENS_PER_TENANT, online: OnlineConfig | None = None,
              prefill_seconds: float | None = PREFILL_SECONDS_PER_STEP):
    """A FastAPI app serving `target` (a zoo name, path or loaded model) with OpenAI's API.

    draft / drafter / draft_len: as for `verispec.generate` (drafter "none" serves plain decoding);
    draft_len is an int >= 1, "auto" or "tree". api_key: a key, or a list of keys (one per tenant): when set,
    /v1/* needs `Authorization: Bearer KEY` with one of them. Each key, and within it each OpenAI `user`, is a
    tenant: suffix drafting (`api.SUFFIX_INDEX_DRAFTERS`) drafts a request only from its own tenant's earlier outputs,
    at most `suffix_tokens_per_tenant` tokens of them (its oldest evicted first).
    max_batch: most sequences decoded at once; max_queue: most sequences waiting for a row (a request
    beyond it gets a 503). draft_dtype: "fp32", "bf16", "int8", "int4" (weight-only), "q4_0" (ggml's blocks) or "q3_0" (the same, gate and up in 3 bits), the draft model's
    matrices on the native backend (default: q3_0 beside a q8 target, else fp32: `api.load_draft`). draft_vocab: the token
    ids the draft's LM head scores, "auto", "all" or N (`api.load_draft`'s vocab). max_body_bytes: largest request body read (larger ones get a 413).
    model_name: the name clients send and see (default: the target's). max_model_len: most tokens of prompt
    plus answer a request may ask for (default and upper bound: the model's context). chat_template: a Jinja
    chat template (text, or a path to a file holding it) in place of the tokenizer's. numerics: the target's,
    as for `verispec.load` ("float32" or "q8"). prefix_cache_bytes: most bytes of prompt keys and values
    kept for reuse by later requests (`prefix_cache.PrefixCache`; 0 turns it off). online: Medusa heads
    keep learning from the traffic (`heads.online`), starting from `draft` (a Medusa head directory) or, with
    no draft, from a cold start (the target's LM head copied into 4 heads); output stays exact. prefill_seconds:
    about the most seconds of prompt reading between two decoding steps while rows decode (None: 512 tokens
    alone; `server.scheduler`). The models load now; the worker (and the learner's) starts with the app.
    """
    api_keys = {key_tenant(key): key for key in read_api_keys(api_key)}
    for option, value, low in (("max_batch", max_batch, 1), ("max_queue", max_queue, 0), ("max_body_bytes", max_body_bytes, 1),
                               ("prefix_cache_bytes", prefix_cache_bytes, 0), ("suffix_tokens_per_tenant", suffix_tokens_per_tenant, 2),
                               ("max_model_len", 2 if max_model_len is None else max_model_len, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise VerispecError(f"{option} must be an integer >= {low}, got {value!r}")
    if prefill_seconds is not None and (isinstance(prefill_seconds, bool) or not isinstance(prefill_seconds, (int, float))
                                        or not prefill_seconds > 0):
        raise VerispecError(f"prefill_seconds must be a number of seconds > 0, or None for a budget of tokens alone, "
                            f"got {prefill_seconds!r}")
    if draft_dtype is not None and draft_dtype not in DRAFT_DTYPES:
        raise VerispecError(f"draft_dtype must be one of {', '.join(DRAFT_DTYPES)}, got {draft_dtype!r}")
    if draft is None and draft_dtype is not None:
        raise VerispecError("draft_dtype applies to a draft model: give one with --draft, or drop --draft-dtype")
    draft_vocab = parse_draft_vocab(draft_vocab)
    if draft is None and draft_vocab != "auto":
        raise VerispecError("draft_vocab applies to a draft model: give one with --draft, or drop --draft-vocab")
    draft_len = DraftLen.parse(draft_len)
    target_model = load(target, numerics=numerics) if isinstance(target, str) else load(target)
    draft_model = load_draft(draft, target_model, draft_dtype, vocab=draft_vocab) if draft is not None else None
    if online is not None:
        if drafter not in ("auto", "medusa"):
            raise VerispecError(f"--online learns Medusa heads, which draft with drafter 'medusa', not {drafter!r}: drop --drafter")
        draft_model, drafter = online_heads(target_model, draft_model, online), "medusa"
    if target_model.tokenizer is None:
        raise VerispecError(f"{target_model.name} has no tokenizer: the server needs one to read and write text")
    # prompt chunks end after the chat template's turn start, which a model derives from its tokenizer once: now,
    # before a self copy shares it and the event loop's threads use the tokenizer beside the worker
    log.info("prompt chunks: %s", Chunking.of(target_model))
    drafter = resolve_drafter(target_model, draft_model, drafter)  # a server makes many calls: "auto" may make a self copy
    make_drafter(target_model, draft_model, drafter)  # fails now on a bad choice (unknown name, vocabularies differ)
    log.info("drafter: %s", drafter)
    suffix_index(target_model).limit_tenants(suffix_tokens_per_tenant)  # what "suffix" and "staged" draft from
    speculative = drafter != "none"
    name = model_name or (target if isinstance(target, str) else target_model.name)
    context = min(target_model.max_context, max_model_len or target_model.max_context)
    config = ServerConfig(target_model, name, draft_len if speculative else None, context)
    template = read_chat_template(chat_template) if chat_template is not None else None
    tokenizer = LockedTokenizer(target_model.tokenizer, template)
    try:  # llguidance's view of the vocabulary, for response_format and tools: ~2 s for 150k tokens, paid now
        ll_tokenizer(target_model.tokenizer, target_model.vocab_size, target_model.eos_token_ids)
    except VerispecError as exc:
        log.warning("structured output and forced tool calls are unavailable: %s", exc)
    stats = SpecStats()
    scheduler = Scheduler(
        target_model,
        new_drafter=lambda speculate: make_drafter(target_model, draft_model, drafter if speculate else "none"),
        max_batch=max_batch,
        max_queue=max_queue,
        stats=stats,
        on_admit=lambda job: metrics.count_admitted(len(job.request.prompt), job.request.sampling.lossy),
        prefix_cache=PrefixCache.for_model(target_model, prefix_cache_bytes),
        prefill_seconds=prefill_seconds,
    )
    metrics = Metrics(name, stats, scheduler)  # on_admit above reaches it once the worker starts
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        if online is not None:
            draft_model.start()
        try:
            yield
        finally:
            scheduler.stop()
            if online is not None:
                draft_model.close()
                log.info("online: %s", {k: v for k, v in draft_model.summary().items() if k != "options"})

    app = FastAPI(title="verispec", lifespan=lifespan)
    app.state.scheduler, app.state.metrics, app.state.stats, app.state.config = scheduler, metrics, stats, config
    app.state.online = draft_model if online is not None else None  # the learning heads, for tests and operators

    def error_response(error: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
        if error.code == "server_busy":
            headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    def release(generation: Generation) -> None:
        """The response is over (sent, failed or abandoned): stop decoding what it no longer needs."""
        if not generation.finished:
            scheduler.cancel(generation.unfinished_jobs())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None))

    def check_key(request: Request) -> str | None:
        """The tenant of the request's API key (`key_tenant`), None when the server takes no keys; else a 401.
        Every key is compared, in constant time each, so the time taken says nothing about which one matched."""
        if not api_keys:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        given = given.strip().encode()
        matched = None
        for tenant, key in api_keys.items():
            if hmac.compare_digest(given, key.encode()):
                matched = tenant
        if scheme.lower() != "bearer" or matched is None:
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer YOUR_KEY'", code="invalid_api_key")
        return matched

    @app.get("/health")
    async def health():
        if not scheduler.thread.is_alive():
            return JSONResponse({"status": "error", "message": "the decoding worker has stopped"}, status_code=503)
        return {"status": "ok", "model": name, "running": scheduler.running, "waiting": scheduler.queue_depth}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            check_key(request)
        except ApiError as error:
            return error_response(error)
        return {"object": "list", "data": [model_card()]}

    def model_card() -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "verispec", "max_model_len": context}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        try:
            check_key(request)
            if model_id != name:
                raise ApiError(404, f"the model {show(model_id)} does not exist: this server serves {name!r}",
                               param="model", code="model_not_found")
        except ApiError as error:
            return error_response(error)
        return model_card()

    @app.get("/version")
    async def version():
        return {"version": verispec.__version__}

    async def tokenizer_call(request: Request, work: Callable[[dict], dict]):
        """/tokenize and /detokenize (vLLM's and llama-server's): the body parsed and the work done on a thread."""
        try:
            check_key(request)
            raw = await read_body(request)

            def run() -> dict:
                body = parse_json(raw)
                if not isinstance(body, dict):
                    raise ApiError(400, "the request body must be a JSON object", code="invalid_body")
                return work(body)

            return await asyncio.to_thread(run)
        except ApiError as error:
            return error_response(error)

    def tokenize_body(body: dict) -> dict:
        if "messages" in body:
            try:
                tools = read_tools(body.get("tools"), None, None)
            except ToolError as exc:
                raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from exc
            ids = render_chat(tokenizer, chat_messages(body["messages"]), tools.tools if tools is not None else None)
        elif isinstance(body.get("prompt"), str):
            check_text_fits(tokenizer, body["prompt"], 2 * context, "prompt")
            ids = list(tokenizer(body["prompt"], add_special_tokens=body.get("add_special_tokens", True) is not False)["input_ids"])
        else:
            raise ApiError(400, "give prompt (text) or messages", param="prompt", code="missing_parameter")
        return {"tokens": ids, "count": len(ids), "max_model_len": context}

    def detokenize_body(body: dict) -> dict:
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < target_model.vocab_size
                                                for t in ids):
            raise ApiError(400, f"tokens must be a list of token ids in [0, {target_model.vocab_size})", param="tokens",
                           code="invalid_value")
        return {"prompt": tokenizer.decode(ids)}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await tokenizer_call(request, tokenize_body)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await tokenizer_call(request, detokenize_body)

    async def read_body(request: Request) -> bytes:
        """The body, refused with a 413 once it passes max_body_bytes (before reading it, if it says its length)."""
        too_large = ApiError(413, f"the request body is larger than this server's limit of {max_body_bytes} bytes: "
                                  "shorten the prompt (or start the server with a larger --max-body-mb)", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_bytes:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def parse(raw: bytes, endpoint: Endpoint) -> Spec:
        """Body bytes -> a checked Spec; runs on a thread, since tokenizing a long prompt takes a while."""
        return endpoint.parse(parse_json(raw), config, tokenizer)

    def parse_json(raw: bytes) -> Any:
        """Body bytes -> JSON that is also valid text throughout, or a 400."""
        try:
            body = json.loads(raw)
        except RecursionError as exc:
            raise ApiError(400, "the request body nests JSON too deeply", code="invalid_json") from exc
        except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, and integers of more than 4300 digits
            raise ApiError(400, f"the request body is not valid JSON: {str(exc)[:200]}", code="invalid_json") from exc
        try:  # a lone UTF-16 surrogate ("\ud800") is valid JSON but not text any tokenizer can read
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError as exc:
            raise ApiError(400, "the request body holds a lone UTF-16 surrogate (an invalid \\u escape): send valid "
                                "Unicode text", code="invalid_json") from exc
        except RecursionError as exc:
            raise ApiError(400, "the request body nests JSON too deeply", code="invalid_json") from exc
        return body

    async def generate(request: Request, endpoint: Endpoint):
        status = 200
        try:
            key = check_key(request)
            spec = await asyncio.to_thread(parse, await read_body(request), endpoint)
            if spec.ignored:
                log.warning("%s: ignored fields this server does not know: %s", endpoint.path, ", ".join(spec.ignored[:10]))
            headers = {"X-Verispec-Ignored-Fields": ",".join(spec.ignored[:10])[:200]} if spec.ignored else None
            generation = Generation(spec, tokenizer, asyncio.get_running_loop(), metrics.observe_delivery_gap,
                                    tenant=tenant_of(key, spec.user), cache_salt=cache_salt_of(key, spec.cache_salt))
            jobs = [c.job for c in generation.choices]
            capacity = scheduler.max_batch + scheduler.max_queue
            if len(jobs) > capacity:  # would get a 503 for ever: retrying cannot help
                raise ApiError(400, f"the request asks for {len(jobs)} sequences but this server holds at most {capacity} "
                                    "running and waiting: ask for fewer prompts or a smaller n", param="n", code="invalid_value")
            try:
                scheduler.submit(jobs)
            except QueueFull as exc:
                raise ApiError(503, f"the server is busy: {exc}. Retry later.", code="server_busy") from exc
            if spec.stream:
                status = None  # counted by the stream, with the status it ends with
                return EventStream(stream(generation, endpoint), on_close=lambda: close_stream(generation, endpoint), headers=headers)
            try:
                return JSONResponse(await complete(generation, endpoint, request), headers=headers)
            finally:
                release(generation)
        except ApiError as error:
            status = error.status
            return error_response(error)
        except asyncio.CancelledError:
            status = 499  # the client went away (nginx's code for it)
            raise
        except Exception:  # a bug in handling this request: its 500, not the server's
            log.exception("handling a request to %s failed", endpoint.path)
            status = 500
            return error_response(ApiError(500, "internal error while handling the request", code="internal_error"))
        finally:
            if status is not None:
                metrics.count_request(endpoint.path, status)

    async def complete(generation: Generation, endpoint: Endpoint, request: Request) -> dict:
        async for _ in generation.updates(is_disconnected=request.is_disconnected):
            pass
        metrics.observe(endpoint.path, *generation.timings(), *generation.outcome())
        choices = [endpoint.choice(c, final_text(tokenizer, c.tokens, generation.spec.stop), tokenizer, generation.spec)
                   for c in generation.choices]
        return {"id": endpoint.id_prefix + uuid.uuid4().hex, "object": endpoint.object, "created": int(time.time()),
                "model": name, "choices": choices, "usage": generation.usage()}

    async def stream(generation: Generation, endpoint: Endpoint) -> AsyncIterator[str]:
        head = {"id": endpoint.id_prefix + uuid.uuid4().hex, "object": endpoint.chunk_object, "created": int(time.time()), "model": name}
        sse = lambda payload: f"data: {json.dumps(payload)}\n\n"
        status = 499  # unless it ends otherwise: the client went away and Starlette cancelled this generator
        try:
            spec = generation.spec
            if endpoint.chat:
                yield sse({**head, "choices": [endpoint.chunk_choice(c, None, None) for c in generation.choices]})
            elif spec.echo is not None:
                yield sse({**head, "choices": [endpoint.chunk_choice(c, spec.echo[c.prompt], None) for c in generation.choices]})
            async for choice, delta in generation.updates(is_disconnected=None):
                # Starlette cancels this generator when the client disconnects; `finally` frees the slots.
                # A chunk goes out with new text or tool calls, at the end, and with log-probabilities of tokens
                # whose text is held back.
                calls = None
                if choice.calls is not None:  # text inside a tool call is held back until the call closes
                    delta, calls = choice.calls.push(delta, choice.finish_reason is not None)
                if delta or calls or choice.finish_reason is not None or len(choice.logprobs) > choice.logprobs_sent:
                    yield sse({**head, "choices": [endpoint.chunk_choice(choice, delta, choice.finish_reason, tokenizer, spec, calls)]})
            if generation.spec.include_usage:
                yield sse({**head, "choices": [], "usage": generation.usage()})
            status = 200
            yield "data: [DONE]\n\n"
            metrics.observe(endpoint.path, *generation.timings(), *generation.outcome())
        except ApiError as error:
            status = error.status
            yield sse(error.body())
            yield "data: [DONE]\n\n"
        except Exception:
            log.exception("streaming a response of %s failed", endpoint.path)
            status = 500
            yield sse(ApiError(500, "internal error while streaming the response", code="internal_error").body())
            yield "data: [DONE]\n\n"
        finally:
            metrics.count_request(endpoint.path, status)
            generation.counted = True
            release(generation)

    def close_stream(generation: Generation, endpoint: Endpoint) -> None:
        """The stream's response is over; one whose body never started (the client left first) is a 499."""
        release(generation)
        if not generation.counted:
            generation.counted = True
            metrics.count_request(endpoint.path, 499)

    completions_endpoint = Endpoint("/v1/completions", parse_completion, chat=False)
    chat_endpoint = Endpoint("/v1/chat/completions", parse_chat, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, completions_endpoint)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat_endpoint)

    return app


def online_heads(target, draft, options: OnlineConfig) -> OnlineMedusa:
    """The learning heads `--online` serves: from a Medusa head, or a cold start without one."""
    from verispec.heads.train_medusa import medusa_head_from_target

    if draft is None:
        draft = medusa_head_from_target(target)
        log.info("online: cold-start Medusa heads (%d heads over %d tokens)", draft.config.num_heads, draft.config.draft_vocab_size)
    if not isinstance(draft, MedusaHead):
        raise VerispecError("--online trains Medusa heads: give --draft a Medusa head directory (verispec train medusa), "
                            "or no --draft to start them cold from the target's own LM head")
    return OnlineMedusa(draft, options)


def read_chat_template(template: str) -> str:
    """A chat template given as text, or as the path of a file holding it (vLLM's --chat-template)."""
    if "{" not in template:
        try:
            with open(template, encoding="utf-8") as f:
                return f.read()
        except OSError as exc:
            raise VerispecError(f"--chat-template {template!r} is neither a Jinja template nor a readable file: {exc}") from exc
    return template


def serve(target, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", **options) -> None:
    """Load the models and serve until interrupted; options are build_app's."""
    import uvicorn

    uvicorn.run(build_app(target, **options), host=host, port=port, log_level=log_level)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="verispec serve", description="OpenAI-compatible server with speculative decoding.")
    parser.add_argument("--target", default=zoo.DEFAULT_TARGET, help="zoo name, local directory, .gguf file or hub id (default: %(default)s)")
    parser.add_argument("--draft", default=None, help="draft model (any tokenizer: with another vocabulary than the target's it drafts through text); omit to draft with the target's own int4 copy (or n-gram where it cannot have one)")
    parser.add_argument("--draft-dtype", default=None, choices=DRAFT_DTYPES,
                        help="the draft model's matrices on the native backend: bf16 halves their bytes, int8 quarters them, int4 and q4_0 "
                             "leave ~1/7, q3_0 ~1/9 of the MLP's gate and up (default: q3_0 with --numerics q8, else fp32)")
    parser.add_argument("--draft-vocab", type=flag(parse_draft_vocab), default="auto",
                        help="token ids the draft model's LM head scores: auto (the first 32768, the special tokens and the text's own, "
                             "beside a q8 target with a vocabulary of 64k or more), all, or N")
    parser.add_argument("--drafter", default="auto", choices=DRAFTER_NAMES, help="auto = model with --draft, else self where the target allows (a native float32 target on verispec's CPU kernels), else ngram; self = the target's int4 copy drafting on its cache; suffix = suffix decoding over the prompt and the same tenant's earlier outputs; staged = the draft model (or the int4 copy) itself sped up by suffix proposals; none = plain decoding")
    parser.add_argument("--draft-len", type=flag(DraftLen.parse), default=DraftLen("auto"), help="draft tokens per step, 'auto', or 'tree' (auto plus token-tree alternates) (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", action="append", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/*; repeat for several keys, each a tenant whose "
                             "outputs draft only its own requests (default: $VERISPEC_API_KEY, else none)")
    parser.add_argument("--api-key-file", default=None, help="a file of API keys, one per line (adds to --api-key)")
    parser.add_argument("--suffix-tokens-per-tenant", type=flag(lambda text: positive_int("--suffix-tokens-per-tenant", text)),
                        default=SUFFIX_TOKENS_PER_TENANT,
                        help="tokens of earlier outputs kept per tenant (API key and `user`) for --drafter suffix or "
                             "staged; a tenant's oldest go first (default: %(default)s)")
    parser.add_argument("--max-batch", type=int, default=8, help="most sequences decoded at once (default: %(default)s)")
    parser.add_argument("--max-queue", type=int, default=256,
                        help="most sequences waiting for a free row; beyond it requests get 503 (default: %(default)s)")
    parser.add_argument("--max-body-mb", type=float, default=MAX_BODY_BYTES / 2**20,
                        help="largest request body read, in MiB; larger ones get 413 (default: %(default)s)")
    parser.add_argument("--prefix-cache-mb", type=float, default=PREFIX_CACHE_BYTES / 2**20,
                        help="MiB of prompt keys and values kept for reuse by later requests (a conversation's next turn, a "
                             "shared system prompt); least recently used out first; 0 turns it off (default: %(default)s)")
    parser.add_argument("--prefill-seconds", type=float, default=PREFILL_SECONDS_PER_STEP,
                        help="while rows decode, about the most seconds of prompt reading between two steps, so a long "
                             "prompt stalls the running streams that long per step; 0: a budget of 512 tokens alone "
                             "(default: %(default)s)")
    parser.add_argument("--served-model-name", default=None, help="the model name clients send and see (default: --target)")
    parser.add_argument("--max-model-len", type=flag(lambda text: positive_int("--max-model-len", text)), default=None,
                        help="most tokens of prompt plus answer per request (default: the model's context window)")
    parser.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one, instead of the tokenizer's")
    parser.add_argument("--numerics", choices=("float32", "q8"), default="float32",
                        help="the target's numbers, as for `verispec generate` (default: %(default)s)")
    parser.add_argument("--threads", type=flag(lambda text: positive_int("--threads", text)), default=None,
                        help="CPU threads for PyTorch and verispec's kernels (default: PyTorch's choice)")
    parser.add_argument("--online", action="store_true",
                        help="Medusa heads keep learning from the traffic in a background thread (--draft: a Medusa head "
                             "directory to start from; none: a cold start from the target's LM head); output stays exact")
    parser.add_argument("--online-tokens-per-step", type=float, default=OnlineConfig.tokens_per_step,
                        help="with --online: at most one training step per this many served tokens (default: %(default)s)")
    parser.add_argument("--online-max-busy", type=float, default=OnlineConfig.max_busy,
                        help="with --online: the most of the wall time the learner may spend training (default: %(default)s)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                        help="the server's and uvicorn's log level (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    try:
        keys = args.api_key or ([os.environ["VERISPEC_API_KEY"]] if os.environ.get("VERISPEC_API_KEY") else [])
        if args.api_key_file:
            keys = keys + read_key_file(args.api_key_file)
        serve(args.target, host=args.host, port=args.port, log_level=args.log_level, draft=args.draft, draft_dtype=args.draft_dtype, draft_vocab=args.draft_vocab,
              drafter=args.drafter, draft_len=args.draft_len, api_key=keys or None, max_batch=args.max_batch,
              max_queue=args.max_queue, max_body_bytes=max(1, int(args.max_body_mb * 2**20)), model_name=args.served_model_name,
              prefix_cache_bytes=max(0, int(args.prefix_cache_mb * 2**20)), prefill_seconds=args.prefill_seconds or None,
              max_model_len=args.max_model_len, chat_template=args.chat_template, numerics=args.numerics,
              suffix_tokens_per_tenant=args.suffix_tokens_per_tenant,
              online=OnlineConfig(tokens_per_step=args.online_tokens_per_step, max_busy=args.online_max_busy)
              if args.online else None)
    except VerispecError as exc:
        parser.exit(2, f"verispec serve: error: {exc}\n")


if __name__ == "__main__":
    main()
