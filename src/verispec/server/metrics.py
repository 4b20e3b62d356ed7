"""/metrics: counters of the HTTP layer and the worker, rendered in Prometheus' text format.

Knows nothing about decoding: it reads the engine's `SpecStats` and the scheduler's counters.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import defaultdict

from verispec.server.scheduler import Scheduler
from verispec.stats import SpecStats

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
        self.lossy_sequences = 0  # sequences that asked for a lossy acceptance rule (typical acceptance)
        self.latency: dict[str, Histogram] = {}
        self.ttft: dict[str, Histogram] = {}

    def count_request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1

    def count_admitted(self, prompt_tokens: int, lossy: bool) -> None:
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.lossy_sequences += lossy

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
            lossy_sequences = self.lossy_sequences
            latency = {k: (h.buckets, list(h.counts), h.sum) for k, h in self.latency.items()}
            ttft = {k: (h.buckets, list(h.counts), h.sum) for k, h in self.ttft.items()}
        metric("verispec_requests_total", "counter", "HTTP requests by endpoint and status code.",
               [(f'endpoint="{e}",status="{s}"', n) for (e, s), n in requests])
        metric("verispec_prompt_tokens_total", "counter", "Prompt tokens prefilled.", prompt_tokens)
        metric("verispec_lossy_sequences_total", "counter",
               "Sequences decoded with typical acceptance (asked for; lossy: not exact samples of the target).", lossy_sequences)
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
        metric("verispec_queue_limit", "gauge", "Most sequences that may wait for a row (--max-queue); more get 503.",
               scheduler.max_queue)
        metric("verispec_queue_rejected_total", "counter", "Sequences refused because the queue was full.", scheduler.rejected)
        metric("verispec_step_failures_total", "counter", "Decoding steps or admissions that failed (their batch was failed with 500).",
               scheduler.step_failures)
        metric("verispec_sequence_failures_total", "counter",
               "Sequences the worker could not finish, by the status their request got (400 refused by the engine, "
               "500 failed in it, 503 the server stopping).", [(f'status="{s}"', n) for s, n in sorted(dict(scheduler.failed).items())])
        phases, widths = scheduler.clock.snapshot()
        metric("verispec_worker_seconds_total", "counter",
               "Worker time by phase: prefill (admitting prompts), draft, target (forward pass), verify (acceptance and "
               "rollback), other (the rest of a step: stop checks, per-request stats, handing out tokens).",
               [(f'phase="{phase}"', seconds) for phase, seconds in phases.items()])
        metric("verispec_target_passes_by_width_total", "counter", "Target passes by width (1 + draft tokens per row).",
               [(f'width="{w}"', n) for w, (n, _, _) in sorted(widths.items())])
        metric("verispec_target_pass_seconds_total", "counter", "Seconds in target passes, by width.",
               [(f'width="{w}"', s) for w, (_, s, _) in sorted(widths.items())])
        metric("verispec_target_pass_rows_total", "counter", "Rows (sequences) in target passes, by width: rows / passes = mean batch size.",
               [(f'width="{w}"', r) for w, (_, _, r) in sorted(widths.items())])
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


