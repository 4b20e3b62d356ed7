"""Continuous batching on one worker thread: the models and every `DecodeBatch` belong to it.

Between steps the worker takes new jobs and cancellations from its inbox, gives waiting jobs free rows
(at most `max_batch` reading or decoding), reads prompts, steps every lane once and hands each job its
`TokenEvent`s through a callback. `submit` refuses jobs beyond `max_batch` running plus `max_queue`
waiting (`QueueFull`), so a burst cannot pile up unbounded work. Reading prompts (prefill) makes the
decoding rows wait, so a prompt is read in the model's chunks (`prefill.PromptReader`), at most
`prefill_tokens` prompt tokens and about `prefill_seconds` of reading between two steps (always at least one
chunk; seconds become tokens at the rate each model has been reading prompts, `ReadRates`), both scaled up by
the ratio of reading jobs to decoding rows where they outnumber them: a 6000-token prompt delays the running
streams by about a quarter of a second (or one chunk's pass) per step, not by its whole prefill, while a burst
that outnumbers the running rows is read at once (the few rows it delays gain more from a full batch). Where the
lane's drafter reads prompts on a draft model of its own (`Drafter.reads_prompt_readers`), the draft model reads
it the same way, after the target, within the same budget (`PromptReads`). A job whose prompt is read joins its
lane. With a `PrefixCache`, a prompt starts from the longest prefix of it already read (bitwise the keys and
values a fresh read computes) and its chunks are stored for later requests.

Jobs are grouped into *lanes* by how they are decoded: the server's draft length, a per-request
`draft_len`, or plain decoding. Each lane is a `DecodeBatch` with its own drafter. A lane stops
taking new rows once its shared slot axis carries too many slots no live row can see, and is dropped
when its last row leaves, so a long-running server does not drag dead cache slots along for ever.

The scheduler knows nothing about HTTP or text, nor about how tokens are drafted or verified.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable
from weakref import WeakKeyDictionary

from verispec.drafters.base import Drafter
from verispec.engine import DecodeBatch, Request as EngineRequest, TokenEvent, check_request
from verispec.errors import VerispecError
from verispec.models.base import CausalLM
from verispec.options import DraftLen
from verispec.policy import DraftPolicy, FixedDraftLen, make_policy
from verispec.prefill import PromptReader
from verispec.prefix_cache import PrefixCache
from verispec.stats import SpecStats

log = logging.getLogger("verispec.server")

MAX_WASTED_SLOTS = 256  # a lane stops admitting rows once its slot axis is this much longer than its longest row
PREFILL_TOKENS_PER_STEP = 512  # prompt tokens admitted between two steps while rows are decoding
# ... and at most about this many seconds of reading (at the rate each model has read prompts at): 512 tokens are
# ~3.6 s of the q8 1.5B target on 2 CPU cores, ~4 ms on a GPU, and the stall is what a decoding stream feels.
PREFILL_SECONDS_PER_STEP = 0.25


def _malloc_trim() -> Callable[[], None] | None:
    """glibc's malloc_trim(0), or None where the C library has none (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


# Hands the pages that freed allocations left inside the C heap back to the system. Requests free their keys,
# values and logits as they finish, but glibc keeps the pages in per-thread arenas, so a server's RSS after a
# burst stays at the burst's peak and wanders by ~100 MB from one idle moment to the next (which arena a
# thread's allocations landed in). The worker calls it when it goes idle after work: it costs a few ms then.
release_free_memory = _malloc_trim()

# How a lane decodes: None = plain decoding, else its draft length (a DraftLen, or anything DraftLen.parse takes).
DraftSetting = DraftLen | int | str | None


@dataclass
class JobFailed:
    """Delivered instead of TokenEvents when a job cannot finish."""

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


class QueueFull(Exception):
    """submit() refused: the jobs would not fit in the running batch plus the waiting queue."""

    def __init__(self, in_flight: int, capacity: int):
        super().__init__(f"{in_flight} sequences are already running or waiting (the limit is {capacity})")
        self.in_flight, self.capacity = in_flight, capacity


@dataclass
class Lane:
    """A DecodeBatch for jobs that share a draft setting."""

    draft: DraftSetting
    batch: DecodeBatch
    open: bool = True  # still admitting rows
    jobs: dict[int, Job] = field(default_factory=dict)


class WorkerClock:
    """Where the worker's time goes, for /metrics. Updated on the worker, read from any thread.

    Phases: "prefill" (admitting: the prompt pass), and per decoding step "draft", "target" (the
    target's forward pass), "verify" (acceptance and rollback) and "other" (the rest of the step:
    cutting at stop/length, per-request stats, routing events)."""

    PHASES = ("prefill", "draft", "target", "verify", "other")

    def __init__(self):
        self._lock = threading.Lock()
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.passes_by_width: dict[int, int] = defaultdict(int)  # target pass width (1 + draft tokens) -> passes
        self.seconds_by_width: dict[int, float] = defaultdict(float)  # ... -> seconds in the target pass
        self.rows_by_width: dict[int, int] = defaultdict(int)  # ... -> sum of batch sizes (mean batch = rows / passes)

    def add_prefill(self, seconds: float) -> None:
        with self._lock:
            self.seconds["prefill"] += seconds

    def add_step(self, rows: int, width: int, draft: float, target: float, verify: float, other: float) -> None:
        with self._lock:
            for phase, seconds in (("draft", draft), ("target", target), ("verify", verify), ("other", other)):
                self.seconds[phase] += seconds
            self.passes_by_width[width] += 1
            self.seconds_by_width[width] += target
            self.rows_by_width[width] += rows

    def snapshot(self) -> tuple[dict[str, float], dict[int, tuple[int, float, int]]]:
        """(seconds by phase, width -> (passes, target seconds, rows))."""
        with self._lock:
            widths = {w: (n, self.seconds_by_width[w], self.rows_by_width[w]) for w, n in self.passes_by_width.items()}
            return dict(self.seconds), widths


class ReadRates:
    """The tokens per second each model has read prompts at, decayed, so a budget of seconds becomes one of
    tokens per model: prefill speed differs by orders of magnitude across models, numerics and devices."""

    def __init__(self, decay: float = 0.7):
        self.decay = decay
        self._rates: WeakKeyDictionary = WeakKeyDictionary()  # model -> tokens per second

    def tokens(self, model: CausalLM, seconds: float) -> float:
        """The tokens `model` reads in `seconds` (unbounded before it has been measured)."""
        rate = self._rates.get(model)
        return float("inf") if rate is None else max(0.0, seconds) * rate

    def record(self, model: CausalLM, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        rate, old = tokens / seconds, self._rates.get(model)
        self._rates[model] = rate if old is None else self.decay * old + (1 - self.decay) * rate


class PromptReads:
    """A job's prompt being read between steps: by the target, then by the draft model its lane's drafter reads
    prompts on (`Drafter.reads_prompt_readers`), so neither prefill stalls the rows decoding meanwhile."""

    def __init__(self, target: PromptReader, draft: PromptReader | None = None):
        self.target, self.draft = target, draft

    @property
    def done(self) -> bool:
        return self.target.done and (self.draft is None or self.draft.done)

    @property
    def tokens(self) -> list[int]:
        return self.target.tokens

    def advance(self, tokens: float, seconds: float, rates: ReadRates, at_least_one: bool) -> tuple[int, float]:
        """Read at most `tokens` more tokens (either model's count) in about `seconds` (at `rates`), the target's
        first; with `at_least_one`, one chunk even past the budget. Returns the tokens read and the seconds it took."""
        read, spent = 0, 0.0
        for reader in (self.target, self.draft):
            if reader is None or reader.done:
                continue
            first = at_least_one and not read
            allowed = min(tokens - read, rates.tokens(reader.model, seconds - spent))
            if allowed <= 0 and not first:
                break
            before = reader.seconds
            got = reader.advance(allowed, first)
            rates.record(reader.model, got, reader.seconds - before)
            read, spent = read + got, spent + reader.seconds - before
            if not reader.done:
                break
        return read, spent


class Scheduler:
    """Continuous batching on a worker thread: admit between steps, step every lane, route events.

    submit() and cancel() may be called from any thread; everything else runs on the worker.
    max_queue: most jobs waiting for a row beyond the `max_batch` running ones. prefill_tokens, prefill_seconds:
    most prompt tokens, and about the most seconds, read between two steps while rows are decoding (scaled as
    the module says; prefill_seconds None: tokens alone).
    """

    def __init__(self, target: CausalLM, new_drafter: Callable[[bool], Drafter], max_batch: int, max_queue: int = 256,
                 stats: SpecStats | None = None, on_admit: Callable[[Job], None] | None = None,
                 prefill_tokens: int = PREFILL_TOKENS_PER_STEP, prefix_cache: PrefixCache | None = None,
                 prefill_seconds: float | None = PREFILL_SECONDS_PER_STEP):
        self.target = target
        self.new_drafter = new_drafter  # speculate? -> a fresh drafter (a DecodeBatch needs its own)
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.prefill_tokens, self.prefill_seconds = prefill_tokens, prefill_seconds
        self.read_rates = ReadRates()
        self.stats = stats if stats is not None else SpecStats()  # every lane's steps, server-wide
        self.clock = WorkerClock()
        self.on_admit = on_admit
        self.policies: dict[DraftSetting, DraftPolicy] = {}  # kept across lanes, so adaptive estimates survive
        self.inbox: queue.Queue = queue.Queue()
        self.waiting: list[Job] = []
        self.reading: list[tuple[Job, PromptReads]] = []  # jobs with a row, their prompts being read or joining a lane
        self.prefix_cache = prefix_cache  # shared by every lane: one target, one set of numbers
        self._lane_taps: dict[DraftSetting, tuple[tuple[int, ...] | None, int | None]] = {}
        # per setting, the model its lane's drafter reads prompts on through readers (`Drafter.reads_prompt_readers`)
        self._lane_readers: dict[DraftSetting, CausalLM | None] = {}
        self.lanes: list[Lane] = []
        self.step_failures = 0
        self.failed: dict[int, int] = defaultdict(int)  # JobFailed status -> sequences failed with it
        self.rejected = 0  # jobs refused by submit() because the queue was full
        self._in_flight: set[int] = set()  # ids of jobs submitted and not yet finished, failed or cancelled
        self._in_flight_lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="verispec-worker", daemon=True)

    # -- any thread --

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.inbox.put(("stop", None))
        self.thread.join(timeout)

    def submit(self, jobs: list[Job]) -> None:
        """Queue jobs for decoding, all or none: raises QueueFull when they do not fit."""
        capacity = self.max_batch + self.max_queue
        with self._in_flight_lock:
            if len(self._in_flight) + len(jobs) > capacity:
                self.rejected += len(jobs)
                raise QueueFull(len(self._in_flight), capacity)
            self._in_flight.update(job.id for job in jobs)
        self.inbox.put(("submit", jobs))

    def cancel(self, job_ids: list[int]) -> None:
        self.inbox.put(("cancel", job_ids))

    @property
    def running(self) -> int:
        """Jobs holding a row: decoding, or reading their prompts."""
        return sum(len(lane.jobs) for lane in list(self.lanes)) + len(self.reading)

    @property
    def in_flight(self) -> int:
        """Jobs submitted and not yet finished: running plus waiting."""
        return len(self._in_flight)

    @property
    def queue_depth(self) -> int:
        """Jobs waiting for a row."""
        return max(0, self.in_flight - self.running)

    # -- worker thread --

    def _run(self) -> None:
        worked = False  # since the worker last went idle
        while True:
            try:
                idle = not self.waiting and not self.lanes and not self.reading
                if idle and worked and release_free_memory is not None:
                    release_free_memory()
                worked = not idle
                if not self._take_messages(block=idle):
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
                for job, _ in self.reading:
                    self._finish(job, JobFailed(500, "internal error in the decoding loop"))
                self.reading = []
        for job in self.waiting + [job for job, _ in self.reading] + [job for lane in self.lanes for job in lane.jobs.values()]:
            self._finish(job, JobFailed(503, "the server is shutting down"))

    def _finish(self, job: Job, item: TokenEvent | JobFailed) -> None:
        """Deliver a job's last item; it no longer counts against the queue limit."""
        self._release([job.id])
        if isinstance(item, JobFailed):
            self.failed[item.status] += 1
        job.deliver(item)

    def _release(self, job_ids) -> None:
        with self._in_flight_lock:
            self._in_flight.difference_update(job_ids)

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
        self._release(job_ids)
        self.waiting = [job for job in self.waiting if job.id not in job_ids]
        self.reading = [(job, reader) for job, reader in self.reading if job.id not in job_ids]
        for lane in self.lanes:
            for job_id in job_ids & lane.jobs.keys():
                del lane.jobs[job_id]
                try:
                    lane.batch.remove(job_id)  # frees the row's slot now, not when it would have finished
                except Exception:
                    # The batch may be half-updated: its other rows fail, the other lanes go on.
                    log.exception("removing a cancelled row failed for a batch of %d", len(lane.jobs) + 1)
                    self.step_failures += 1
                    self._fail_lane(lane, "internal error while removing another request from this batch")
                    break
        # An emptied DecodeBatch keeps stale slot bookkeeping (its KV store forgets its slots, the SlotCache
        # does not), so a request must never join one: drop empty lanes before the next admission.
        self.lanes = [lane for lane in self.lanes if lane.jobs]

    def _admit(self) -> None:
        """Waiting jobs take free rows and start reading their prompts; prompts are read, within the step's
        budget; the jobs whose prompts are read join a lane."""
        self._start_reading()
        self._read_prompts()

    def _start_reading(self) -> None:
        """First come, first served, within the free rows: each job is checked, looked up in the prefix cache,
        and queued for reading."""
        room = self.max_batch - self.running
        if room <= 0 or not self.waiting:
            return
        taken, self.waiting = self.waiting[:room], self.waiting[room:]
        for job in taken:
            try:
                check_request(self.target, job.request)
            except VerispecError as exc:  # this request alone is bad
                self._finish(job, JobFailed(400, str(exc)))
                continue
            try:
                taps, tap_last = self._taps(job.draft)
                prompt = job.request.prompt[:-1]
                reader = PromptReader(self.target, prompt, self.prefix_cache, taps, salt=job.request.cache_salt, tap_last=tap_last)
                draft_model = self._lane_readers[job.draft]
                reader = PromptReads(reader, PromptReader(draft_model, prompt) if draft_model is not None else None)
            except Exception:
                log.exception("looking up a prompt in the prefix cache failed")
                self.step_failures += 1
                self._finish(job, JobFailed(500, "internal error while reading the prompt"))
                continue
            self.reading.append((job, reader))

    def _read_prompts(self) -> None:
        """Read prompts in arrival order. While rows decode, read at most `prefill_tokens` tokens and about
        `prefill_seconds` between two steps (at least one chunk), both scaled up by the ratio of reading jobs to
        decoding rows where they outnumber them; with none decoding, read everything at once."""
        if not self.reading:
            return
        decoding = sum(len(lane.jobs) for lane in self.lanes)
        scale = max(1.0, len(self.reading) / decoding) if decoding else float("inf")
        tokens = self.prefill_tokens * scale
        seconds = self.prefill_seconds * scale if self.prefill_seconds is not None else float("inf")
        started = time.perf_counter()
        ready: dict[DraftSetting, list[tuple[Job, PromptReads]]] = defaultdict(list)
        still = []
        moved = False  # whether a prompt moved on this time (the first one always does)
        for job, reader in self.reading:
            if tokens > 0 and seconds > 0 and not reader.done:
                try:
                    read, spent = reader.advance(tokens, seconds, self.read_rates, at_least_one=not moved)
                    tokens, seconds = tokens - read, seconds - spent
                    moved = moved or read > 0
                except Exception:
                    log.exception("reading a prompt of %d tokens failed", len(reader.tokens))
                    self.step_failures += 1
                    self._finish(job, JobFailed(500, "internal error while reading the prompt"))
                    continue
            if reader.done:
                ready[job.draft].append((job, reader))
            else:
                still.append((job, reader))
        # Read jobs stay in `reading` until they are in a lane: they hold their rows meanwhile (/metrics counts them
        # running), and a failure before they join fails them with the rest (`_run`), rather than losing them.
        self.reading = still + [pair for pairs in ready.values() for pair in pairs]
        self.clock.add_prefill(time.perf_counter() - started)
        for setting, pairs in ready.items():
            self._join(self._open_lane(setting), pairs)
            joined = {id(pair) for pair in pairs}
            self.reading = [pair for pair in self.reading if id(pair) not in joined]

    def _join(self, lane: Lane, pairs: list[tuple[Job, PromptReads]]) -> None:
        """Jobs whose prompts are read join `lane`'s batch."""
        started = time.perf_counter()
        drafts = [reads.draft for _, reads in pairs]
        try:
            lane.batch.add([job.request for job, _ in pairs], [reads.target for _, reads in pairs],
                           draft_readers=drafts if all(draft is not None for draft in drafts) else None)
        except Exception:
            # The batch may be half-updated: drop it with everything in it.
            log.exception("admitting %d requests failed", len(pairs))
            self.step_failures += 1
            for job, _ in pairs:
                self._finish(job, JobFailed(500, "internal error while reading the prompt"))
            self._fail_lane(lane, "internal error while admitting another request into this batch")
            self.lanes.remove(lane)
            return
        finally:
            self.clock.add_prefill(time.perf_counter() - started)
        for job, _ in pairs:
            lane.jobs[job.id] = job
            if self.on_admit is not None:
                self.on_admit(job)

    def _taps(self, setting: DraftSetting) -> tuple[tuple[int, ...] | None, int | None]:
        """The target layers whose hidden states the drafter of `setting` reads (`Drafter.target_taps`), and of how
        many last prompt tokens (`Drafter.prompt_taps`): a prompt read for it collects them. Learnt from the
        first lane of that setting."""
        if setting not in self._lane_taps:
            self._open_lane(setting)
        return self._lane_taps[setting]

    def _open_lane(self, setting: DraftSetting) -> Lane:
        for lane in self.lanes:
            if lane.open and lane.draft == setting and len(lane.batch):
                return lane
        if setting is None:
            drafter, policy = self.new_drafter(False), FixedDraftLen(1)  # no drafter: k is never used
        else:
            drafter = self.new_drafter(True)
            policy = self.policies.setdefault(setting, make_policy(setting))
        lane = Lane(setting, DecodeBatch(self.target, drafter, policy, stats=self.stats, prefix_cache=self.prefix_cache))
        self._lane_taps[setting] = drafter.target_taps, drafter.prompt_taps
        self._lane_readers[setting] = drafter.prefill_model if drafter.reads_prompt_readers else None
        self.lanes.append(lane)
        return lane

    def _step(self, lane: Lane) -> None:
        if not lane.jobs:
            return
        stats, rows = lane.batch.stats, len(lane.batch)
        before = (stats.draft_seconds, stats.target_seconds, stats.overhead_seconds, stats.draft_len_sum)
        started = time.perf_counter()
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
                self._finish(job, event)
            else:
                job.deliver(event)
        if lane.open and lane.jobs and self._wasted_slots(lane.batch) > MAX_WASTED_SLOTS:
            lane.open = False  # new rows go to a fresh lane; this one drains
        draft, target, verify = (stats.draft_seconds - before[0], stats.target_seconds - before[1],
                                 stats.overhead_seconds - before[2])
        width = 1 + stats.draft_len_sum - before[3]  # the step records its draft width in draft_len_sum
        self.clock.add_step(rows, width, draft, target, verify, time.perf_counter() - started - draft - target - verify)

    @staticmethod
    def _wasted_slots(batch: DecodeBatch) -> int:
        """Cache slots past what the longest row needs: holes and left padding of rows long gone."""
        return batch.cache.slots.length - max((len(row.sequence) for row in batch.rows), default=0)

    def _fail_lane(self, lane: Lane, message: str) -> None:
        for job in list(lane.jobs.values()):
            self._finish(job, JobFailed(500, message))
        lane.jobs.clear()
