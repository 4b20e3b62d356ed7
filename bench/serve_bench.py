"""Serving benchmark: throughput and latency of `verispec serve` with and without speculation, at several concurrencies.

One server process is started and warmed up. For each concurrency level the same fixed workload
runs in several rounds; a round runs it with plain decoding (`"speculate": false`) and with
speculative decoding (the server's drafter) back to back, alternating which goes first, so the two
meet the same machine state and a drift in load favours neither. The speedup of a level is the
median over rounds of the round's speculative/plain throughput ratio: on a shared machine a ratio of
paired runs is far steadier than either throughput. Each request streams (so time to first token is
measured) with greedy decoding; every output must equal plain decoding's, and the report says so.
The server's /metrics split each run's worker time by phase (prefill, draft, target pass, verify,
other) and count target passes by width. Writes a Markdown table and JSON to bench/reports/.

Defaults: smollm2-135m with the server's `auto` drafter and draft length, as `verispec serve` starts: SmolLM2
has no smaller sibling to draft for it, so that is its own int4 copy drafting on its cache (n-gram lookup with
`--drafter ngram`), with the adaptive draft length (`--draft-len 4` for a fixed one). For the Qwen pair:
--target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b.

    python bench/serve_bench.py                      # smollm2-135m, int4 self copy, concurrency 1 4 16, 3 rounds
    python bench/serve_bench.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import httpx

from verispec.server import ServerProcess
from verispec.server.process import ServerStartError

DEFAULT_PROMPTS = "spec_bench"  # the Spec-Bench prompts bundled with verispec


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default=None, help="draft model; omit for n-gram drafting")
    p.add_argument("--drafter", default="auto", help="auto | model | ngram")
    p.add_argument("--draft-len", default="auto", help="int, or 'auto' (default: auto, as `verispec serve` runs)")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS, help="the bundled 'spec_bench' set or a Spec-Bench JSONL file ({category, turns})")
    p.add_argument("--num-prompts", type=int, default=8, help="fixed sample: the first prompt of each category, in file order")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rounds", type=int, default=3, help="plain/speculative pairs per concurrency level (default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads in the server (OMP_NUM_THREADS; default: torch's choice)")
    p.add_argument("--port", type=int, default=None, help="default: a free port")
    p.add_argument("--out", default="bench/reports")
    p.add_argument("--name", default=None, help="report file stem (default: serve-<target>)")
    p.add_argument("--merge", action="store_true",
                   help="keep the levels of an existing report with the same settings that this run does not measure "
                        "(to measure a level at a time on a shared machine)")
    return p.parse_args(argv)


def read_prompts(path: str, count: int) -> list[dict]:
    """The first turn of the first row of each category, in file order, until `count` prompts."""
    from verispec.bench import prompt_text

    rows = [json.loads(line) for line in prompt_text(path).splitlines() if line.strip()]
    prompts, seen = [], set()
    for row in rows:
        if row["category"] not in seen:
            seen.add(row["category"])
            prompts.append({"category": row["category"], "id": row["question_id"], "text": row["turns"][0]})
        if len(prompts) == count:
            break
    return prompts


def server_args(args) -> list[str]:
    out = ["--target", args.target, "--drafter", args.drafter, "--draft-len", str(args.draft_len),
           "--max-batch", str(args.max_batch)]
    return out + (["--draft", args.draft] if args.draft else [])


WORKER_METRICS = re.compile(r'^verispec_(worker_seconds_total\{phase|target_passes_by_width_total\{width|'
                            r'target_pass_seconds_total\{width|target_pass_rows_total\{width)="(\w+)"\} (\S+)$')


def worker_counters(url: str) -> dict[str, float]:
    """The server's worker counters from /metrics: 'phase:<name>' -> seconds, '<metric>:<width>' -> value."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        match = WORKER_METRICS.match(line)
        if match:
            kind, label, value = match.groups()
            key = "phase" if kind.startswith("worker") else kind.split("_total")[0]
            out[f"{key}:{label}"] = float(value)
    return out


def worker_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    """What one run added: seconds by phase, and per target-pass width its passes, seconds and mean batch size."""
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    phases = {k.split(":")[1]: round(v, 3) for k, v in delta.items() if k.startswith("phase:")}
    widths = {}
    for key, passes in delta.items():
        if key.startswith("target_passes_by_width:") and passes:
            w = key.split(":")[1]
            widths[w] = {"passes": int(passes), "seconds": round(delta[f"target_pass_seconds:{w}"], 3),
                         "mean_batch": round(delta[f"target_pass_rows:{w}"] / passes, 2),
                         "ms_per_pass": round(1000 * delta[f"target_pass_seconds:{w}"] / passes, 1)}
    return {"phases": phases, "widths": dict(sorted(widths.items(), key=lambda kv: int(kv[0])))}


async def one_request(client: httpx.AsyncClient, prompt: str, max_tokens: int, speculate: bool) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "speculate": speculate}
    started = time.perf_counter()
    first, text, usage = None, [], None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                content = choice["delta"].get("content")
                if content:
                    first = first or time.perf_counter()
                    text.append(content)
    ended = time.perf_counter()
    return {"latency": ended - started, "ttft": (first or ended) - started, "text": "".join(text), "usage": usage}


async def run_level(url: str, prompts: list[dict], concurrency: int, max_tokens: int, speculate: bool) -> dict:
    """Every prompt at least once, and at least `concurrency` requests, at most `concurrency` in flight."""
    workload = [prompts[i % len(prompts)] for i in range(max(len(prompts), concurrency))]
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600), limits=limits) as client:
        async def run(p):
            async with gate:
                return p, await one_request(client, p["text"], max_tokens, speculate)

        started = time.perf_counter()
        done = await asyncio.gather(*(run(p) for p in workload))
        wall = time.perf_counter() - started
    tokens = sum(r["usage"]["completion_tokens"] for _, r in done)
    drafted = sum(r["usage"]["speculative"]["drafted_tokens"] for _, r in done)
    accepted = sum(r["usage"]["speculative"]["accepted_tokens"] for _, r in done)
    passes = sum(r["usage"]["speculative"]["target_passes"] for _, r in done)
    latencies = sorted(r["latency"] for _, r in done)
    ttfts = sorted(r["ttft"] for _, r in done)
    return {
        "concurrency": concurrency,
        "speculate": speculate,
        "requests": len(done),
        "completion_tokens": tokens,
        "wall_seconds": round(wall, 3),
        "tokens_per_second": round(tokens / wall, 2),
        "latency_p50": round(statistics.median(latencies), 3),
        "latency_p90": round(quantile(latencies, 0.9), 3),
        "ttft_p50": round(statistics.median(ttfts), 3),
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "tokens_per_pass": round(tokens / passes, 3) if passes else 0.0,  # per sequence, stop cuts included
        "texts": {str(p["id"]): r["text"] for p, r in done},
        "per_request": [{"id": p["id"], "category": p["category"], "prompt_tokens": r["usage"]["prompt_tokens"],
                         "completion_tokens": r["usage"]["completion_tokens"], "latency": round(r["latency"], 3),
                         "ttft": round(r["ttft"], 3)} for p, r in done],
    }


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile of already sorted values."""
    position = (len(sorted_values) - 1) * q
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def run(url: str, prompts: list[dict], concurrency: int, max_tokens: int, speculate: bool) -> dict:
    """One run of a level's workload, with what the server's worker did meanwhile."""
    before = worker_counters(url)
    result = asyncio.run(run_level(url, prompts, concurrency, max_tokens, speculate))
    result["worker"] = worker_delta(before, worker_counters(url))
    return result


def summarize(runs: list[dict]) -> dict:
    """A decoding mode's runs at one level: medians over rounds, and the worker's time summed."""
    median = lambda key: round(statistics.median(r[key] for r in runs), 3)  # noqa: E731
    phases: dict[str, float] = {}
    widths: dict[str, dict] = {}
    for r in runs:
        for phase, seconds in r["worker"]["phases"].items():
            phases[phase] = round(phases.get(phase, 0.0) + seconds, 3)
        for w, v in r["worker"]["widths"].items():
            total = widths.setdefault(w, {"passes": 0, "seconds": 0.0, "rows": 0.0})
            total["passes"] += v["passes"]
            total["seconds"] += v["seconds"]
            total["rows"] += v["mean_batch"] * v["passes"]
    return {
        "requests": runs[0]["requests"], "completion_tokens": runs[0]["completion_tokens"],
        "tokens_per_second": median("tokens_per_second"), "latency_p50": median("latency_p50"),
        "latency_p90": median("latency_p90"), "ttft_p50": median("ttft_p50"),
        "acceptance_rate": median("acceptance_rate"), "tokens_per_pass": median("tokens_per_pass"),
        "worker_seconds": phases,
        "target_passes": {w: {"passes": v["passes"], "ms_per_pass": round(1000 * v["seconds"] / v["passes"], 1),
                              "mean_batch": round(v["rows"] / v["passes"], 2)}
                          for w, v in sorted(widths.items(), key=lambda kv: int(kv[0]))},
    }


def dates(report: dict) -> str:
    measured = sorted({level.get("date", report["config"]["date"]) for level in report["levels"]})
    return measured[0] if len(measured) == 1 else "levels measured " + ", ".join(measured)


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [
        f"# verispec serve: {c['target']} ({c['drafter_description']}, draft_len {c['draft_len']})",
        "",
        f"{c['num_prompts']} Spec-Bench prompts (chat, greedy, {c['max_tokens']} max tokens), max batch {c['max_batch']}, "
        f"{c['machine']}, {dates(report)}. Plain decoding is the same server with `\"speculate\": false`. Each concurrency level "
        f"ran {c['rounds']} rounds; a round runs plain and speculative decoding back to back, alternating which goes first. "
        "**Speedup is the median over rounds of the per-round ratio** speculative tokens/s / plain tokens/s (its range in "
        "brackets); tokens/s, latency and TTFT are medians over rounds. Tokens/s = completion tokens / wall time of a run.",
        "",
        "| concurrency | decoding | requests | tokens | tokens/s | speedup (median of ratios) | latency p50 (s) | latency p90 (s) | "
        "TTFT p50 (s) | acceptance | tokens/pass | same text |",
        "| ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for level in report["levels"]:
        for mode in ("plain", "speculative"):
            row = level[mode]
            spec = mode == "speculative"
            low, high = level["speedup_range"]
            speedup = f"**{level['speedup']:.2f}x** [{low:.2f}–{high:.2f}]" if spec else "1.00x"
            lines.append(
                f"| {level['concurrency']} | {mode} | {row['requests']} | {row['completion_tokens']} | "
                f"{row['tokens_per_second']:.1f} | {speedup} | {row['latency_p50']:.2f} | {row['latency_p90']:.2f} | "
                f"{row['ttft_p50']:.2f} | {row['acceptance_rate']:.2f} | {row['tokens_per_pass']:.2f} | "
                f"{'' if not spec else ('yes' if level['identical'] else 'NO')} |"
            )
    lines += [
        "",
        "Where the server's worker spent its time, summed over the rounds (seconds), and its target passes by width "
        "(width = 1 + draft tokens per row): passes × ms per pass @ mean batch size.",
        "",
        "| concurrency | decoding | prefill | draft | target | verify | other | target passes by width |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for level in report["levels"]:
        for mode in ("plain", "speculative"):
            row = level[mode]
            t = row["worker_seconds"]
            widths = ", ".join(f"w{w}: {v['passes']} × {v['ms_per_pass']:.0f} ms @ {v['mean_batch']:.1f}"
                               for w, v in row["target_passes"].items())
            lines.append(f"| {level['concurrency']} | {mode} | " + " | ".join(f"{t.get(p, 0.0):.2f}" for p in
                         ("prefill", "draft", "target", "verify", "other")) + f" | {widths} |")
    return "\n".join(lines) + "\n"


SAME_SETTINGS = ("target", "draft", "drafter", "draft_len", "max_tokens", "max_batch", "rounds", "prompts", "machine")


def earlier_levels(path: Path, config: dict) -> list[dict]:
    """The levels of the report at `path`, which must have been measured with the same settings (for --merge)."""
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    differ = [k for k in SAME_SETTINGS if old["config"].get(k) != config[k]]
    if differ:
        sys.exit(f"--merge: {path} was measured with other settings ({', '.join(differ)}): use another --name")
    return old["levels"]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    prompts = read_prompts(args.prompts, args.num_prompts)
    drafter = args.drafter if args.drafter != "auto" or args.draft is None else "model"
    # the server resolves "auto" without a draft model itself: the target's int4 copy where it can have one, else n-gram
    description = (f"draft {args.draft}" if drafter == "model" else
                   "auto drafting: the target's int4 copy where it can have one, else n-gram" if drafter == "auto" else f"{drafter} drafting")
    config = {
        "target": args.target, "draft": args.draft, "drafter": drafter, "drafter_description": description,
        "draft_len": args.draft_len, "max_tokens": args.max_tokens, "max_batch": args.max_batch, "rounds": args.rounds,
        "num_prompts": len(prompts), "prompts": [{k: p[k] for k in ("category", "id")} for p in prompts],
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, server threads {args.threads or 'default'}",
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    out = Path(args.out)
    stem = args.name or f"serve-{args.target}"
    earlier = earlier_levels(out / f"{stem}.json", config) if args.merge else []  # checked before measuring
    server = ServerProcess(server_args(args), threads=args.threads, port=args.port).start()
    try:
        try:
            server.wait_ready(timeout=600)
        except ServerStartError as exc:
            sys.exit(str(exc))
        url = server.url
        print(f"[serve-bench] {args.target} ({description}, draft_len {args.draft_len}) on {url}; {len(prompts)} prompts, "
              f"{args.rounds} rounds", file=sys.stderr)
        asyncio.run(run_level(url, prompts[:2], 2, 8, True))  # warm-up: both lanes, first-call costs
        asyncio.run(run_level(url, prompts[:2], 2, 8, False))
        levels = []
        for concurrency in args.concurrency:
            rounds = []
            for r in range(args.rounds):
                order = (False, True) if r % 2 == 0 else (True, False)
                results = {speculate: run(url, prompts, concurrency, args.max_tokens, speculate) for speculate in order}
                plain, speculative = results[False], results[True]
                ratio = speculative["tokens_per_second"] / plain["tokens_per_second"]
                rounds.append({"plain": plain, "speculative": speculative, "ratio": round(ratio, 4),
                               "identical": plain["texts"] == speculative["texts"]})
                print(f"[serve-bench] concurrency {concurrency}, round {r + 1}: plain {plain['tokens_per_second']} tok/s, "
                      f"speculative {speculative['tokens_per_second']} tok/s ({ratio:.2f}x), "
                      f"identical text: {rounds[-1]['identical']}", file=sys.stderr)
            ratios = [r["ratio"] for r in rounds]
            reference = rounds[0]["plain"]["texts"]
            levels.append({
                "concurrency": concurrency,
                "date": time.strftime("%Y-%m-%d %H:%M"),
                "speedup": round(statistics.median(ratios), 4),
                "speedup_range": [min(ratios), max(ratios)],
                "identical": all(run[mode]["texts"] == reference for run in rounds for mode in ("plain", "speculative")),
                "plain": summarize([r["plain"] for r in rounds]),
                "speculative": summarize([r["speculative"] for r in rounds]),
                "rounds": rounds,
            })
    finally:
        server.stop()
    measured = {level["concurrency"] for level in levels}
    levels = sorted([level for level in earlier if level["concurrency"] not in measured] + levels,
                    key=lambda level: level["concurrency"])
    report = {"config": config, "levels": levels}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (out / f"{stem}.md").write_text(table)
    print(table)
    return report


if __name__ == "__main__":
    main()
