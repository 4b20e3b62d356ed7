"""/metrics: what the HTTP layer and the worker count, in Prometheus' text format through `prometheus_client`.

Two families of names. `verispec_*` are verispec's own (the worker's phases, pass widths, the queue).
`verispec:*` carry vLLM's names and meanings (`vllm:spec_decode_num_drafts`, `vllm:time_to_first_token_seconds`,
...), with a `model_name` label, so a dashboard built for vLLM reads them by swapping the prefix.
Request-level figures (latencies, status codes) are observed as they happen; engine-level ones are read
from the engine's `SpecStats` and the scheduler at scrape time (a custom collector), so there is one
source for each number. Knows nothing about decoding.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from verispec.server.scheduler import Scheduler
from verispec.stats import SpecStats

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

disable_created_metrics()  # no `_created` sample beside every counter (vLLM turns them off too)


class Metrics:
    """The server's metrics registry. Observed from the event loop (requests) and the worker (admissions);
    prometheus_client's metrics are thread-safe."""

    def __init__(self, model_name: str, stats: SpecStats, scheduler: Scheduler):
        self.registry = CollectorRegistry(auto_describe=True)
        model = [model_name]
        self._requests = Counter("verispec_requests", "HTTP requests by endpoint and the status they ended with "
                                 "(499: the client left).", ["endpoint", "status"], registry=self.registry)
        self._latency = Histogram("verispec_request_latency_seconds", "Time from request to last token.", ["endpoint"],
                                  buckets=LATENCY_BUCKETS, registry=self.registry)
        self._ttft = Histogram("verispec_time_to_first_token_seconds", "Time from request to first generated token.",
                               ["endpoint"], buckets=TTFT_BUCKETS, registry=self.registry)
        self._prompt_tokens = Counter("verispec_prompt_tokens", "Prompt tokens prefilled (a prompt with n choices counts n times).",
                                      registry=self.registry)
        self._lossy = Counter("verispec_lossy_sequences", "Sequences decoded with typical acceptance or a speculative cascade (asked for; lossy: "
                              "not exact samples of the target).", registry=self.registry)
        # vLLM's request-level names.
        self._e2e = Histogram("verispec:e2e_request_latency_seconds", "End to end request latency in seconds.",
                              ["model_name"], buckets=LATENCY_BUCKETS, registry=self.registry).labels(*model)
        self._vllm_ttft = Histogram("verispec:time_to_first_token_seconds", "Time to first token in seconds.",
                                    ["model_name"], buckets=TTFT_BUCKETS, registry=self.registry).labels(*model)
        self._itl = Histogram("verispec:inter_token_latency_seconds", "Time between two deliveries of tokens to a request "
                              "(a speculative step delivers several tokens at once).", ["model_name"],
                              buckets=TOKEN_BUCKETS, registry=self.registry).labels(*model)
        self._tpot = Histogram("verispec:request_time_per_output_token_seconds", "Per request: (latency - time to first "
                               "token) / (output tokens - 1).", ["model_name"], buckets=TOKEN_BUCKETS,
                               registry=self.registry).labels(*model)
        self._success = Counter("verispec:request_success", "Requests finished, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self._model_name = model_name
        self.registry.register(_EngineCollector(model_name, stats, scheduler, self))

    def count_request(self, endpoint: str, status: int) -> None:
        self._requests.labels(endpoint, str(status)).inc()

    def count_admitted(self, prompt_tokens: int, lossy: bool) -> None:
        self._prompt_tokens.inc(prompt_tokens)
        if lossy:
            self._lossy.inc()

    def observe(self, endpoint: str, latency: float, ttft: float | None, output_tokens: int,
                finish_reasons: list[str]) -> None:
        """A request that finished: its latency, time to first token, tokens and each choice's finish reason."""
        self._latency.labels(endpoint).observe(latency)
        self._e2e.observe(latency)
        if ttft is not None:
            self._ttft.labels(endpoint).observe(ttft)
            self._vllm_ttft.observe(ttft)
            if output_tokens > 1:
                self._tpot.observe((latency - ttft) / (output_tokens - 1))
        for reason in finish_reasons:
            self._success.labels(self._model_name, reason).inc()

    def observe_delivery_gap(self, seconds: float) -> None:
        self._itl.observe(seconds)

    @property
    def prompt_tokens(self) -> int:
        return int(self._prompt_tokens._value.get())

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Engine and scheduler figures, read when /metrics is scraped."""

    def __init__(self, model_name: str, stats: SpecStats, scheduler: Scheduler, metrics: Metrics):
        self.model_name, self.stats, self.scheduler, self.metrics = model_name, stats, scheduler, metrics

    def describe(self):
        return []  # read at scrape time: nothing to check at registration

    def collect(self):
        stats, scheduler, model = self.stats, self.scheduler, [self.model_name]

        def counter(name, help_text, value, labels=(), label_values=()):
            family = CounterMetricFamily(name, help_text, labels=list(labels))
            family.add_metric(list(label_values), value)
            return family

        def gauge(name, help_text, value, labels=(), label_values=()):
            family = GaugeMetricFamily(name, help_text, labels=list(labels))
            family.add_metric(list(label_values), value)
            return family

        def by(kind, name, help_text, label, pairs, extra=()):
            family = kind(name, help_text, labels=[*(l for l, _ in extra), label])
            for key, value in pairs:
                family.add_metric([*(v for _, v in extra), str(key)], value)
            return family

        drafted_at, accepted_at = list(stats.drafted_at), list(stats.accepted_at)
        positions = range(min(len(drafted_at), len(accepted_at)))
        yield counter("verispec_generation_tokens", "Tokens generated and handed out.", stats.emitted_tokens)
        yield counter("verispec_target_passes", "Target forward passes (decoding steps, all batches).", stats.target_passes)
        yield counter("verispec_drafted_tokens", "Draft tokens proposed.", stats.drafted_tokens)
        yield counter("verispec_accepted_tokens", "Draft tokens accepted by verification.", stats.accepted_tokens)
        yield by(CounterMetricFamily, "verispec_draft_position_proposed", "Draft tokens proposed, by position in the draft (1 = first).",
                 "position", [(i + 1, drafted_at[i]) for i in positions])
        yield by(CounterMetricFamily, "verispec_draft_position_accepted", "Draft tokens accepted, by position in the draft (1 = first).",
                 "position", [(i + 1, accepted_at[i]) for i in positions])
        yield by(GaugeMetricFamily, "verispec_acceptance_by_position", "Acceptance rate by draft position since start.",
                 "position", [(i + 1, accepted_at[i] / drafted_at[i] if drafted_at[i] else 0.0) for i in positions])
        yield gauge("verispec_mean_accepted_tokens", "Tokens gained per target pass per sequence since start (1.0 = plain decoding).",
                    stats.mean_accepted_tokens)
        yield gauge("verispec_batch_size", "Sequences being decoded now.", scheduler.running)
        yield gauge("verispec_queue_depth", "Sequences waiting to be admitted.", scheduler.queue_depth)
        yield gauge("verispec_batches", "Decode batches (lanes) in flight.", len(scheduler.lanes))
        yield gauge("verispec_queue_limit", "Most sequences that may wait for a row (--max-queue); more get 503.", scheduler.max_queue)
        yield counter("verispec_queue_rejected", "Sequences refused because the queue was full.", scheduler.rejected)
        yield counter("verispec_step_failures", "Decoding steps or admissions that failed (their batch was failed with 500).",
                      scheduler.step_failures)
        yield by(CounterMetricFamily, "verispec_sequence_failures", "Sequences the worker could not finish, by the status their "
                 "request got (400 refused by the engine, 500 failed in it, 503 the server stopping).", "status",
                 sorted(dict(scheduler.failed).items()))
        phases, widths = scheduler.clock.snapshot()
        yield by(CounterMetricFamily, "verispec_worker_seconds", "Worker time by phase: prefill (admitting prompts), draft, target "
                 "(forward pass), verify (acceptance and rollback), other (the rest of a step: stop checks, per-request stats, "
                 "handing out tokens).", "phase", phases.items())
        yield by(CounterMetricFamily, "verispec_target_passes_by_width", "Target passes by width (1 + draft tokens per row).",
                 "width", [(w, n) for w, (n, _, _) in sorted(widths.items())])
        yield by(CounterMetricFamily, "verispec_target_pass_seconds", "Seconds in target passes, by width.",
                 "width", [(w, s) for w, (_, s, _) in sorted(widths.items())])
        yield by(CounterMetricFamily, "verispec_target_pass_rows", "Rows (sequences) in target passes, by width: rows / passes = "
                 "mean batch size.", "width", [(w, r) for w, (_, _, r) in sorted(widths.items())])
        cache = scheduler.prefix_cache
        if cache is not None:
            yield gauge("verispec_prefix_cache_bytes", "Bytes of keys and values held by the prefix cache.", cache.bytes)
            yield gauge("verispec_prefix_cache_capacity_bytes", "The prefix cache's budget (--prefix-cache-mb).", cache.capacity_bytes)
            yield gauge("verispec_prefix_cache_blocks", "Blocks (prefill chunks) held by the prefix cache.", len(cache))
            yield counter("verispec_prefix_cache_evictions", "Blocks dropped from the prefix cache for room.", cache.evicted)
        # vLLM's names and meanings.
        labels, values = ["model_name"], model
        if cache is not None:
            yield counter("verispec:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", cache.queries,
                          labels, values)
            yield counter("verispec:prefix_cache_hits", "Of the prompt tokens looked up, those found in the prefix cache.",
                          cache.hits, labels, values)
        yield gauge("verispec:num_requests_running", "Sequences being decoded.", scheduler.running, labels, values)
        yield gauge("verispec:num_requests_waiting", "Sequences waiting to be admitted.", scheduler.queue_depth, labels, values)
        yield counter("verispec:prompt_tokens", "Prefill tokens processed.", self.metrics.prompt_tokens, labels, values)
        yield counter("verispec:generation_tokens", "Generation tokens processed.", stats.emitted_tokens, labels, values)
        yield counter("verispec:spec_decode_num_drafts", "Drafts proposed (sequence steps with at least one draft token).",
                      drafted_at[0] if drafted_at else 0, labels, values)
        yield counter("verispec:spec_decode_num_draft_tokens", "Draft tokens proposed.", stats.drafted_tokens, labels, values)
        yield counter("verispec:spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.accepted_tokens, labels, values)
        yield by(CounterMetricFamily, "verispec:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position "
                 "(0 = first).", "position", [(i, accepted_at[i]) for i in positions], extra=[("model_name", self.model_name)])
