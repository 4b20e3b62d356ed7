"""`verispec serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.

Two threads share the work. The event loop (FastAPI under uvicorn) checks each request, turns text
into token ids and token ids back into text, and answers in OpenAI's JSON or server-sent events.
One worker thread owns the models and every `DecodeBatch`: between steps it takes new requests and
cancellations from its inbox, admits waiting requests (at most `max_batch` rows in flight), steps
every batch once, and hands each request its `TokenEvent`s through a thread-safe callback.

Requests are grouped into *lanes* by how they are decoded: the server's draft length, a per-request
`draft_len`, or plain decoding (`"speculate": false`). Each lane is a `DecodeBatch` with its own
drafter; the worker steps the lanes in turn. A lane also stops taking new rows once its shared slot
axis carries too many slots no live row can see, and is dropped when its last row leaves, so a
long-running server does not drag dead cache slots along for ever.

The server knows nothing about how tokens are drafted or verified: it only passes settings through.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import itertools
import json
import logging
import os
import queue
import threading
import time
import uuid
from bisect import bisect_left
from collections import defaultdict
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.api import load, make_drafter
from verispec.drafters.base import Drafter
from verispec.engine import DecodeBatch, Request as EngineRequest, TokenEvent
from verispec.errors import VerispecError
from verispec.models.base import CausalLM
from verispec.policy import DraftPolicy, make_policy
from verispec.sampling import SamplingParams
from verispec.stats import SpecStats
from verispec.text import IncrementalText, StopSequences, encode_chat, final_text

log = logging.getLogger("verispec.server")

MAX_DRAFT_LEN = 16  # largest per-request draft_len: each distinct value is a lane of its own
MAX_CHOICES = 16  # most sequences (prompts x n) one HTTP request may ask for
MAX_STOP = 4  # stop sequences per request, as in OpenAI's API
MAX_WASTED_SLOTS = 256  # a lane stops admitting rows once its slot axis is this much longer than its longest row
DISCONNECT_POLL_SECONDS = 0.5  # how often a waiting non-streamed request checks that its client is still there

# How a lane decodes: None = plain decoding, an int = fixed draft length, "auto" = adaptive draft length.
DraftSetting = int | str | None


# ---------------------------------------------------------------------------------------------------
# Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------------------------------------
# The worker: one thread owns the models and the batches.


@dataclass
class JobFailed:
    """Delivered instead of TokenEvents when a request cannot finish."""

    status: int  # 400: the engine refused the request; 500: the engine failed; 503: the server is stopping
    message: str


@dataclass
class Job:
    """One sequence for the worker: an engine request, how to decode it, and where its events go."""

    request: EngineRequest  # request.id is the job id
    draft: DraftSetting
    deliver: Callable[[TokenEvent | JobFailed], None]  # called on the worker thread; must not block

    @property
    def id(self) -> int:
        return self.request.id


@dataclass
class Lane:
    """A DecodeBatch for requests that share a draft setting."""

    draft: DraftSetting
    batch: DecodeBatch
    open: bool = True  # still admitting rows
    jobs: dict[int, Job] = field(default_factory=dict)


class Scheduler:
    """Continuous batching on a worker thread: admit between steps, step every lane, route events.

    submit() and cancel() may be called from any thread; everything else runs on the worker.
    """

    def __init__(self, target: CausalLM, new_drafter: Callable[[bool], Drafter], max_batch: int,
                 stats: SpecStats | None = None, on_admit: Callable[[Job], None] | None = None):
        self.target = target
        self.new_drafter = new_drafter  # speculate? -> a fresh drafter (a DecodeBatch needs its own)
        self.max_batch = max_batch
        self.stats = stats if stats is not None else SpecStats()  # every lane's steps, server-wide
        self.on_admit = on_admit
        self.policies: dict[DraftSetting, DraftPolicy] = {}  # kept across lanes, so adaptive estimates survive
        self.inbox: queue.Queue = queue.Queue()
        self.waiting: list[Job] = []
        self.lanes: list[Lane] = []
        self.step_failures = 0
        self.thread = threading.Thread(target=self._run, name="verispec-worker", daemon=True)

    # -- any thread --

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.inbox.put(("stop", None))
        self.thread.join(timeout)

    def submit(self, jobs: list[Job]) -> None:
        self.inbox.put(("submit", jobs))

    def cancel(self, job_ids: list[int]) -> None:
        self.inbox.put(("cancel", job_ids))

    @property
    def running(self) -> int:
        return sum(len(lane.jobs) for lane in list(self.lanes))

    @property
    def queue_depth(self) -> int:
        return len(self.waiting) + self.inbox.qsize()

    # -- worker thread --

    def _run(self) -> None:
        while True:
            try:
                if not self._take_messages(block=not self.waiting and not self.lanes):
                    break
                self._admit()
                for lane in list(self.lanes):
                    self._step(lane)
                self.lanes = [lane for lane in self.lanes if lane.jobs]
            except Exception:  # a bug in the loop itself: fail everything in flight, keep serving
                log.exception("worker loop failed; failing the requests in flight")
                for lane in self.lanes:
                    self._fail_lane(lane, "internal error in the decoding loop")
                self.lanes = []
        for job in self.waiting + [job for lane in self.lanes for job in lane.jobs.values()]:
            job.deliver(JobFailed(503, "the server is shutting down"))

    def _take_messages(self, block: bool) -> bool:
        """Apply every message in the inbox (waiting for one if `block`). False once told to stop."""
        while True:
            try:
                kind, payload = self.inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "submit":
                self.waiting.extend(payload)
            elif kind == "cancel":
                self._cancel(set(payload))

    def _cancel(self, job_ids: set[int]) -> None:
        self.waiting = [job for job in self.waiting if job.id not in job_ids]
        for lane in self.lanes:
            for job_id in job_ids & lane.jobs.keys():
                lane.batch.remove(job_id)  # frees the row's slot now, not when it would have finished
                del lane.jobs[job_id]
        # An emptied DecodeBatch keeps stale slot bookkeeping (its KV store forgets its slots, the SlotCache
        # does not), so a request must never join one: drop empty lanes before the next admission.
        self.lanes = [lane for lane in self.lanes if lane.jobs]

    def _admit(self) -> None:
        room = self.max_batch - self.running
        if room <= 0 or not self.waiting:
            return
        admitted, self.waiting = self.waiting[:room], self.waiting[room:]
        by_setting: dict[DraftSetting, list[Job]] = defaultdict(list)
        for job in admitted:
            by_setting[job.draft].append(job)
        for setting, jobs in by_setting.items():
            lane = self._open_lane(setting)
            accepted = []
            for job in jobs:
                try:
                    lane.batch.check(job.request)
                except VerispecError as exc:  # this request alone is bad
                    job.deliver(JobFailed(400, str(exc)))
                    continue
                accepted.append(job)
            if not accepted:
                continue
            try:
                lane.batch.add([job.request for job in accepted])
            except Exception:
                # The batch may be half-updated: drop it with everything in it.
                log.exception("admitting %d requests failed", len(accepted))
                self.step_failures += 1
                for job in accepted:
                    job.deliver(JobFailed(500, "internal error while reading the prompt"))
                self._fail_lane(lane, "internal error while admitting another request into this batch")
                self.lanes.remove(lane)
                continue
            for job in accepted:
                lane.jobs[job.id] = job
                if self.on_admit is not None:
                    self.on_admit(job)

    def _open_lane(self, setting: DraftSetting) -> Lane:
        for lane in self.lanes:
            if lane.open and lane.draft == setting and len(lane.batch):
                return lane
        if setting is None:
            drafter, policy = self.new_drafter(False), 1  # no drafter: k is never used
        else:
            drafter = self.new_drafter(True)
            policy = self.policies.setdefault(setting, make_policy(setting))
        lane = Lane(setting, DecodeBatch(self.target, drafter, policy, stats=self.stats))
        self.lanes.append(lane)
        return lane

    def _step(self, lane: Lane) -> None:
        if not lane.jobs:
            return
        try:
            events = lane.batch.step()
        except Exception:
            # The batch's caches may be inconsistent now: fail its rows, and the lane is dropped.
            log.exception("decoding step failed for a batch of %d", len(lane.jobs))
            self.step_failures += 1
            self._fail_lane(lane, "internal error in the decoding step")
            return
        for event in events:
            job = lane.jobs.get(event.request_id)
            if job is None:
                continue
            if event.finish_reason is not None:
                del lane.jobs[event.request_id]
            job.deliver(event)
        if lane.open and lane.jobs and self._wasted_slots(lane.batch) > MAX_WASTED_SLOTS:
            lane.open = False  # new rows go to a fresh lane; this one drains

    @staticmethod
    def _wasted_slots(batch: DecodeBatch) -> int:
        """Cache slots past what the longest row needs: holes and left padding of rows long gone."""
        return batch.cache.slots.length - max((len(row.sequence) for row in batch.rows), default=0)

    def _fail_lane(self, lane: Lane, message: str) -> None:
        for job in lane.jobs.values():
            job.deliver(JobFailed(500, message))
        lane.jobs.clear()


# ---------------------------------------------------------------------------------------------------
# Metrics, in Prometheus' text format.

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value

    def lines(self, name: str, labels: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip([*map(_number, self.buckets), "+Inf"], self.counts):
            total += count
            out.append(f'{name}_bucket{{{labels}{"," if labels else ""}le="{bound}"}} {total}')
        out.append(f"{name}_sum{{{labels}}} {_number(self.sum)}")
        out.append(f"{name}_count{{{labels}}} {total}")
        return out


def _number(x: float) -> str:
    return repr(float(x)) if isinstance(x, float) else str(x)


class Metrics:
    """Counters updated by both threads (under one lock), rendered with the engine's own stats."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)  # (endpoint, status) -> count
        self.prompt_tokens = 0  # tokens prefilled (a prompt with n choices counts n times)
        self.latency: dict[str, Histogram] = {}
        self.ttft: dict[str, Histogram] = {}

    def count_request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1

    def count_prompt(self, tokens: int) -> None:
        with self.lock:
            self.prompt_tokens += tokens

    def observe(self, endpoint: str, latency: float | None = None, ttft: float | None = None) -> None:
        with self.lock:
            if latency is not None:
                self.latency.setdefault(endpoint, Histogram(LATENCY_BUCKETS)).observe(latency)
            if ttft is not None:
                self.ttft.setdefault(endpoint, Histogram(TTFT_BUCKETS)).observe(ttft)

    def render(self, stats: SpecStats, scheduler: Scheduler) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]] | float) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples if isinstance(samples, list) else [("", samples)]:
                out.append(f"{name}{{{labels}}} {_number(value)}" if labels else f"{name} {_number(value)}")

        with self.lock:
            requests = sorted(self.requests.items())
            prompt_tokens = self.prompt_tokens
            latency = {k: (h.buckets, list(h.counts), h.sum) for k, h in self.latency.items()}
            ttft = {k: (h.buckets, list(h.counts), h.sum) for k, h in self.ttft.items()}
        metric("verispec_requests_total", "counter", "HTTP requests by endpoint and status code.",
               [(f'endpoint="{e}",status="{s}"', n) for (e, s), n in requests])
        metric("verispec_prompt_tokens_total", "counter", "Prompt tokens prefilled.", prompt_tokens)
        metric("verispec_generation_tokens_total", "counter", "Tokens generated and handed out.", stats.emitted_tokens)
        metric("verispec_target_passes_total", "counter", "Target forward passes (decoding steps, all batches).", stats.target_passes)
        metric("verispec_drafted_tokens_total", "counter", "Draft tokens proposed.", stats.drafted_tokens)
        metric("verispec_accepted_tokens_total", "counter", "Draft tokens accepted by verification.", stats.accepted_tokens)
        drafted_at, accepted_at = list(stats.drafted_at), list(stats.accepted_at)
        positions = range(min(len(drafted_at), len(accepted_at)))
        metric("verispec_draft_position_proposed_total", "counter", "Draft tokens proposed, by position in the draft (1 = first).",
               [(f'position="{i + 1}"', drafted_at[i]) for i in positions])
        metric("verispec_draft_position_accepted_total", "counter", "Draft tokens accepted, by position in the draft (1 = first).",
               [(f'position="{i + 1}"', accepted_at[i]) for i in positions])
        metric("verispec_acceptance_by_position", "gauge", "Acceptance rate by draft position since start.",
               [(f'position="{i + 1}"', accepted_at[i] / drafted_at[i] if drafted_at[i] else 0.0) for i in positions])
        metric("verispec_mean_accepted_tokens", "gauge", "Tokens gained per target pass per sequence since start (1.0 = plain decoding).",
               stats.mean_accepted_tokens)
        metric("verispec_batch_size", "gauge", "Sequences being decoded now.", scheduler.running)
        metric("verispec_queue_depth", "gauge", "Sequences waiting to be admitted.", scheduler.queue_depth)
        metric("verispec_batches", "gauge", "Decode batches (lanes) in flight.", len(scheduler.lanes))
        metric("verispec_step_failures_total", "counter", "Decoding steps or admissions that failed (their batch was failed with 500).",
               scheduler.step_failures)
        for name, help_text, histograms in (
            ("verispec_request_latency_seconds", "Time from request to last token.", latency),
            ("verispec_time_to_first_token_seconds", "Time from request to first generated token.", ttft),
        ):
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} histogram")
            for endpoint, (buckets, counts, total) in sorted(histograms.items()):
                h = Histogram(buckets)
                h.counts, h.sum = counts, total
                out.extend(h.lines(name, f'endpoint="{endpoint}"'))
        return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------------
# Reading OpenAI request bodies: every field is honoured or refused with a 400 that names it.


class Fields:
    """An OpenAI request body, read one field at a time."""

    def __init__(self, body: Any, allowed: set[str]):
        if not isinstance(body, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_body")
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise ApiError(400, f"unknown parameter {unknown[0]!r}: this server accepts {', '.join(sorted(allowed))}",
                           param=unknown[0], code="unknown_parameter")
        self.body = body

    def get(self, name: str, default=None):
        value = self.body.get(name)
        return default if value is None else value

    def integer(self, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
        value = self.get(name, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ApiError(400, f"{name} must be an integer, got {value!r}", param=name, code="invalid_type")
        if value < low or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"between {low} and {high}"
            raise ApiError(400, f"{name} must be {bounds}, got {value}", param=name, code="invalid_value")
        return value

    def number(self, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
        value = self.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ApiError(400, f"{name} must be a number, got {value!r}", param=name, code="invalid_type")
        if not (low < value if low_open else low <= value) or not value <= high:
            bounds = f"in ({low}, {high}]" if low_open else f"between {low} and {high}"
            raise ApiError(400, f"{name} must be {bounds}, got {value}", param=name, code="invalid_value")
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        value = self.get(name, default)
        if not isinstance(value, bool):
            raise ApiError(400, f"{name} must be true or false, got {value!r}", param=name, code="invalid_type")
        return value

    def only_default(self, name: str, *defaults, why: str = "is not supported by this server") -> None:
        """Refuse any value but the defaults (the feature is not implemented, so it must not be asked for)."""
        value = self.body.get(name)
        if value is None or any(type(value) is type(d) and value == d for d in defaults):
            return
        raise ApiError(400, f"{name}={value!r} {why}", param=name, code="unsupported_parameter")


COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop", "seed",
                 "user", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "draft_len", "speculate"}
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


@dataclass
class ServerConfig:
    target: CausalLM
    model_name: str
    draft_len: DraftSetting  # the server's own setting; None when it was started without a drafter


def parse_common(fields: Fields, config: ServerConfig, prompts: list[list[int]], prompt_param: str,
                 max_tokens: int | None, default_max_tokens: int | None) -> Spec:
    """Everything the two endpoints share. default_max_tokens None = up to the context."""
    model = fields.body.get("model")
    if model is not None and model != config.model_name:
        raise ApiError(404, f"the model {model!r} does not exist: this server serves {config.model_name!r}",
                       param="model", code="model_not_found")
    fields.only_default("presence_penalty", 0, 0.0)
    fields.only_default("frequency_penalty", 0, 0.0)
    fields.only_default("logit_bias", {})

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
    try:
        sampling = SamplingParams(
            temperature=fields.number("temperature", 1.0, 0.0, 2.0),  # OpenAI's default is 1
            top_p=fields.number("top_p", 1.0, 0.0, 1.0, low_open=True),
            top_k=fields.integer("top_k", 0, 0),
            seed=seed,
        )
    except VerispecError as exc:
        raise ApiError(400, str(exc), code="invalid_value") from exc

    stop = fields.body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise ApiError(400, f"stop must be a non-empty string or a list of them, got {stop!r}", param="stop", code="invalid_value")
    if stop is not None and len(stop) > MAX_STOP:
        raise ApiError(400, f"stop takes at most {MAX_STOP} sequences, got {len(stop)}", param="stop", code="invalid_value")

    context = config.target.max_context
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

    return Spec(prompts, budgets, n, sampling, stop or [], parse_draft(fields, config), stream, include_usage)


def parse_draft(fields: Fields, config: ServerConfig) -> DraftSetting:
    """Per-request speculation: "speculate": false decodes plainly; "draft_len": k (or "auto") drafts k tokens a step."""
    speculate = fields.boolean("speculate", True)
    draft_len = fields.body.get("draft_len")
    if draft_len is not None and draft_len != "auto":
        draft_len = fields.integer("draft_len", None, 1, MAX_DRAFT_LEN)
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
    fields.only_default("logprobs", why="(log probabilities) is not supported by this server")
    fields.only_default("echo", False)
    fields.only_default("suffix", "")
    fields.only_default("best_of", 1)
    prompts = completion_prompts(fields.body.get("prompt"), tokenizer)
    max_tokens = fields.integer("max_tokens", None, 1)
    return parse_common(fields, config, prompts, "prompt", max_tokens, default_max_tokens=16)


def completion_prompts(prompt: Any, tokenizer) -> list[list[int]]:
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
            p = list(tokenizer(p)["input_ids"])
        out.append(p)
    return out


def parse_chat(body: Any, config: ServerConfig, tokenizer) -> Spec:
    fields = Fields(body, CHAT_FIELDS)
    fields.only_default("logprobs", False, why="(log probabilities) is not supported by this server")
    fields.only_default("top_logprobs", 0, why="(log probabilities) is not supported by this server")
    fields.only_default("tools", [], why="(tool calling) is not supported by this server")
    fields.only_default("tool_choice", "none", why="(tool calling) is not supported by this server")
    fields.only_default("functions", [], why="(function calling) is not supported by this server")
    fields.only_default("function_call", "none", why="(function calling) is not supported by this server")
    fields.only_default("response_format", {"type": "text"}, why="(structured output) is not supported by this server")
    fields.boolean("parallel_tool_calls", True)  # meaningless without tools, which are refused above
    if fields.body.get("max_tokens") is not None and fields.body.get("max_completion_tokens") is not None:
        raise ApiError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens", code="invalid_value")
    max_tokens = fields.integer("max_tokens", None, 1)
    if max_tokens is None:
        max_tokens = fields.integer("max_completion_tokens", None, 1)
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, f"{config.model_name} has no chat template: use /v1/completions", param="messages", code="unsupported_model")
    ids = encode_chat(tokenizer, chat_messages(fields.body.get("messages")))
    return parse_common(fields, config, [ids], "messages", max_tokens, default_max_tokens=None)


def chat_messages(messages: Any) -> list[dict]:
    """OpenAI messages -> [{"role", "content": str}] for the chat template; text parts only."""
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
        if role not in ("system", "user", "assistant"):
            raise ApiError(400, f"{param}.role must be system, developer, user or assistant, got {role!r}", param=f"{param}.role", code="invalid_value")
        if isinstance(content, list):
            if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content):
                raise ApiError(400, f"{param}.content: only text parts are supported", param=f"{param}.content", code="invalid_value")
            content = "".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise ApiError(400, f"{param}.content must be a string or a list of text parts", param=f"{param}.content", code="invalid_type")
        extra = set(message) - {"role", "content", "name"}
        if extra:
            raise ApiError(400, f"{param} has fields this server does not support: {sorted(extra)}", param=param, code="unsupported_parameter")
        out.append({"role": role, "content": content})
    return out


# ---------------------------------------------------------------------------------------------------
# One HTTP request in flight: its choices, their jobs, and the events coming back.


class LockedTokenizer:
    """The tokenizer behind a lock: the event loop encodes and decodes while the worker checks stop sequences."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._lock = threading.Lock()

    def __call__(self, *args, **kwargs):
        with self._lock:
            return self._tokenizer(*args, **kwargs)

    def decode(self, *args, **kwargs):
        with self._lock:
            return self._tokenizer.decode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        with self._lock:
            return self._tokenizer.apply_chat_template(*args, **kwargs)

    @property
    def chat_template(self):
        return getattr(self._tokenizer, "chat_template", None)


@dataclass
class Choice:
    index: int
    job: Job
    stats: SpecStats
    text: IncrementalText
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None


_job_ids = itertools.count()


class Generation:
    """The choices of one HTTP request; events reach it through an asyncio queue fed by the worker."""

    def __init__(self, spec: Spec, tokenizer: LockedTokenizer, loop: asyncio.AbstractEventLoop):
        self.spec = spec
        self.events: asyncio.Queue = asyncio.Queue()
        self.started = time.perf_counter()
        self.first_token_at: float | None = None
        checker = StopSequences(tokenizer, spec.stop) if spec.stop else None
        self.choices = []
        for p, ids in enumerate(spec.prompts):
            for j in range(spec.n):
                index = p * spec.n + j
                # Choice i of a seeded request uses seed + i: each is reproducible alone, and they differ.
                sampling = replace(spec.sampling, seed=None if spec.sampling.seed is None else spec.sampling.seed + index)
                stats = SpecStats()
                request = EngineRequest(prompt=ids, sampling=sampling, max_new_tokens=spec.max_tokens[p],
                                        stop_checker=checker, id=next(_job_ids), stats=stats)
                deliver = (lambda item, index=index: _post(loop, self.events, (index, item)))
                job = Job(request, spec.draft, deliver)
                self.choices.append(Choice(index, job, stats, IncrementalText(tokenizer, spec.stop)))

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
            if item.tokens and self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            choice.tokens.extend(item.tokens)
            choice.finish_reason = item.finish_reason
            delta = choice.text.push(item.tokens, item.finish_reason is not None)
            yield choice, delta

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
            },
        }


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

    def choice(self, choice: Choice, text: str) -> dict:
        if self.chat:
            return {"index": choice.index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": choice.finish_reason}
        return {"index": choice.index, "text": text, "logprobs": None, "finish_reason": choice.finish_reason}

    def chunk_choice(self, choice: Choice, delta: str | None, finish_reason: str | None) -> dict:
        if self.chat:
            content = {"role": "assistant", "content": ""} if delta is None else ({"content": delta} if delta else {})
            return {"index": choice.index, "delta": content, "logprobs": None, "finish_reason": finish_reason}
        return {"index": choice.index, "text": delta or "", "logprobs": None, "finish_reason": finish_reason}


def build_app(target, draft=None, drafter: str = "auto", draft_len: int | str = 4, api_key: str | None = None,
              max_batch: int = 8, model_name: str | None = None):
    """A FastAPI app serving `target` (a zoo name, path or loaded model) with OpenAI's API.

    draft / drafter / draft_len: as for `verispec.generate` (drafter "none" serves plain decoding);
    draft_len is an int >= 1 or "auto". api_key: when set, /v1/* needs `Authorization: Bearer KEY`.
    max_batch: most sequences decoded at once. The models load now; the worker starts with the app.
    """
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise VerispecError(f"max_batch must be an integer >= 1, got {max_batch!r}")
    make_policy(draft_len)  # validates it now
    target_model = load(target)
    draft_model = load(draft) if draft is not None else None
    if target_model.tokenizer is None:
        raise VerispecError(f"{target_model.name} has no tokenizer: the server needs one to read and write text")
    make_drafter(target_model, draft_model, drafter)  # fails now on a bad choice (unknown name, vocabularies differ)
    speculative = drafter != "none"
    name = model_name or (target if isinstance(target, str) else target_model.name)
    config = ServerConfig(target_model, name, draft_len if speculative else None)
    tokenizer = LockedTokenizer(target_model.tokenizer)
    metrics = Metrics()
    stats = SpecStats()
    scheduler = Scheduler(
        target_model,
        new_drafter=lambda speculate: make_drafter(target_model, draft_model, drafter if speculate else "none"),
        max_batch=max_batch,
        stats=stats,
        on_admit=lambda job: metrics.count_prompt(len(job.request.prompt)),
    )
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="verispec", lifespan=lifespan)
    app.state.scheduler, app.state.metrics, app.state.stats, app.state.config = scheduler, metrics, stats, config

    def error_response(error: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None))

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer YOUR_KEY'", code="invalid_api_key")

    @app.get("/health")
    async def health():
        if not scheduler.thread.is_alive():
            return JSONResponse({"status": "error", "message": "the decoding worker has stopped"}, status_code=503)
        return {"status": "ok", "model": name, "running": scheduler.running, "waiting": scheduler.queue_depth}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(stats, scheduler), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            check_key(request)
        except ApiError as error:
            return error_response(error)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "verispec"}]}

    async def generate(request: Request, endpoint: Endpoint):
        status = 200
        try:
            check_key(request)
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
            spec = endpoint.parse(body, config, tokenizer)
            generation = Generation(spec, tokenizer, asyncio.get_running_loop())
            if spec.stream:
                return StreamingResponse(stream(generation, endpoint), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return JSONResponse(await complete(generation, endpoint, request))
        except ApiError as error:
            status = error.status
            return error_response(error)
        except asyncio.CancelledError:
            status = 499  # the client went away (nginx's code for it)
            raise
        finally:
            metrics.count_request(endpoint.path, status)

    async def complete(generation: Generation, endpoint: Endpoint, request: Request) -> dict:
        scheduler.submit([c.job for c in generation.choices])
        try:
            async for _ in generation.updates(is_disconnected=request.is_disconnected):
                pass
        finally:
            if not generation.finished:
                scheduler.cancel(generation.unfinished_jobs())
        metrics.observe(endpoint.path, *generation.timings())
        choices = [endpoint.choice(c, final_text(tokenizer, c.tokens, generation.spec.stop)) for c in generation.choices]
        return {"id": endpoint.id_prefix + uuid.uuid4().hex, "object": endpoint.object, "created": int(time.time()),
                "model": name, "choices": choices, "usage": generation.usage()}

    async def stream(generation: Generation, endpoint: Endpoint) -> AsyncIterator[str]:
        # Submitted on the first read, so a client gone before the response started costs nothing.
        head = {"id": endpoint.id_prefix + uuid.uuid4().hex, "object": endpoint.chunk_object, "created": int(time.time()), "model": name}
        sse = lambda payload: f"data: {json.dumps(payload)}\n\n"
        scheduler.submit([c.job for c in generation.choices])
        try:
            if endpoint.chat:
                yield sse({**head, "choices": [endpoint.chunk_choice(c, None, None) for c in generation.choices]})
            async for choice, delta in generation.updates(is_disconnected=None):
                # Starlette cancels this generator when the client disconnects; `finally` frees the slots.
                if delta or choice.finish_reason is not None:
                    yield sse({**head, "choices": [endpoint.chunk_choice(choice, delta, choice.finish_reason)]})
            if generation.spec.include_usage:
                yield sse({**head, "choices": [], "usage": generation.usage()})
            yield "data: [DONE]\n\n"
            metrics.observe(endpoint.path, *generation.timings())
        except ApiError as error:
            yield sse(error.body())
            yield "data: [DONE]\n\n"
        finally:
            if not generation.finished:
                scheduler.cancel(generation.unfinished_jobs())

    completions_endpoint = Endpoint("/v1/completions", parse_completion, chat=False)
    chat_endpoint = Endpoint("/v1/chat/completions", parse_chat, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, completions_endpoint)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat_endpoint)

    return app


def serve(target, draft=None, drafter: str = "auto", draft_len: int | str = 4, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, max_batch: int = 8, model_name: str | None = None, log_level: str = "info") -> None:
    """Load the models and serve until interrupted."""
    import uvicorn

    app = build_app(target, draft=draft, drafter=drafter, draft_len=draft_len, api_key=api_key, max_batch=max_batch,
                    model_name=model_name)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def _draft_len_arg(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or 'auto', got {value!r}") from None


def main(argv: list[str] | None = None) -> None:
    from verispec.cli import DEFAULT_TARGET

    parser = argparse.ArgumentParser(prog="verispec serve", description="OpenAI-compatible server with speculative decoding.")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="zoo name, local directory, .gguf file or hub id (default: %(default)s)")
    parser.add_argument("--draft", default=None, help="draft model (same tokenizer as the target); omit for n-gram drafting")
    parser.add_argument("--drafter", default="auto", choices=["auto", "model", "ngram", "none"], help="none = plain decoding")
    parser.add_argument("--draft-len", type=_draft_len_arg, default=4, help="draft tokens per step, or 'auto' (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("VERISPEC_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: $VERISPEC_API_KEY, else none)")
    parser.add_argument("--max-batch", type=int, default=8, help="most sequences decoded at once (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(name)s: %(message)s")
    try:
        serve(args.target, draft=args.draft, drafter=args.drafter, draft_len=args.draft_len, host=args.host, port=args.port,
              api_key=args.api_key, max_batch=args.max_batch)
    except VerispecError as exc:
        parser.exit(2, f"verispec serve: error: {exc}\n")


if __name__ == "__main__":
    main()
