"""Serving benchmark: throughput and latency of `verispec serve` with and without speculation, at several concurrencies.

One server process is started and warmed up; for each concurrency level the same fixed workload runs
twice, plain decoding (`"speculate": false`) and speculative decoding (the server's drafter),
back to back, so both meet the same machine state. Each request streams (so time to first token is
measured) with greedy decoding; the two outputs of every prompt must be identical, and the report
says so. Writes a Markdown table and JSON to bench/reports/.

Defaults: smollm2-135m with n-gram drafting. SmolLM2 has no smaller sibling to draft for it, and a
model drafting for itself costs as much per token as the target, so n-gram lookup is the drafter
that can pay on a CPU. For the Qwen pair: --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b.

    python bench/serve_bench.py                      # smollm2-135m, n-gram, concurrency 1 4 16
    python bench/serve_bench.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

DEFAULT_PROMPTS = "/work/shared/data/spec_bench_dev.jsonl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default=None, help="draft model; omit for n-gram drafting")
    p.add_argument("--drafter", default="auto", help="auto | model | ngram")
    p.add_argument("--draft-len", default="4", help="int, or 'auto'")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS, help="Spec-Bench JSONL ({category, turns})")
    p.add_argument("--num-prompts", type=int, default=8, help="fixed sample: the first prompt of each category, in file order")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads in the server (OMP_NUM_THREADS; default: torch's choice)")
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--out", default="bench/reports")
    p.add_argument("--name", default=None, help="report file stem (default: serve-<target>)")
    return p.parse_args(argv)


def read_prompts(path: str, count: int) -> list[dict]:
    """The first turn of the first row of each category, in file order, until `count` prompts."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    prompts, seen = [], set()
    for row in rows:
        if row["category"] not in seen:
            seen.add(row["category"])
            prompts.append({"category": row["category"], "id": row["question_id"], "text": row["turns"][0]})
        if len(prompts) == count:
            break
    return prompts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "verispec.server", "--target", args.target, "--drafter", args.drafter,
           "--draft-len", str(args.draft_len), "--port", str(port), "--max-batch", str(args.max_batch)]
    if args.draft:
        cmd += ["--draft", args.draft]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            sys.exit(f"the server exited with {proc.returncode}:\n{log.read()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit("the server did not come up within 600 s")


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


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [
        f"# verispec serve: {c['target']} ({c['drafter_description']}, draft_len {c['draft_len']})",
        "",
        f"{c['num_prompts']} Spec-Bench prompts (chat, greedy, {c['max_tokens']} max tokens), max batch {c['max_batch']}, "
        f"{c['machine']}, {c['date']}. Plain decoding is the same server with `\"speculate\": false`, run right before "
        "speculative decoding at each concurrency. Tokens/s = completion tokens / wall time of the level.",
        "",
        "| concurrency | decoding | requests | tokens | tokens/s | speedup | latency p50 (s) | latency p90 (s) | TTFT p50 (s) | acceptance | tokens/pass | same text |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for level in report["levels"]:
        for row in (level["plain"], level["speculative"]):
            spec = row["speculate"]
            speedup = f"{row['tokens_per_second'] / level['plain']['tokens_per_second']:.2f}x" if spec else "1.00x"
            lines.append(
                f"| {row['concurrency']} | {'speculative' if spec else 'plain'} | {row['requests']} | {row['completion_tokens']} | "
                f"{row['tokens_per_second']:.1f} | {speedup} | {row['latency_p50']:.2f} | {row['latency_p90']:.2f} | "
                f"{row['ttft_p50']:.2f} | {row['acceptance_rate']:.2f} | {row['tokens_per_pass']:.2f} | "
                f"{'' if not spec else ('yes' if level['identical'] else 'NO')} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    prompts = read_prompts(args.prompts, args.num_prompts)
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    drafter = args.drafter if args.drafter != "auto" else ("model" if args.draft else "ngram")
    description = f"draft {args.draft}" if drafter == "model" else f"{drafter} drafting"
    with tempfile.TemporaryFile("w+") as log:
        proc = start_server(args, port, log)
        try:
            print(f"[serve-bench] {args.target} ({description}, draft_len {args.draft_len}) on {url}; {len(prompts)} prompts",
                  file=sys.stderr)
            asyncio.run(run_level(url, prompts[:2], 2, 8, True))  # warm-up: both lanes, first-call costs
            asyncio.run(run_level(url, prompts[:2], 2, 8, False))
            levels = []
            for concurrency in args.concurrency:
                plain = asyncio.run(run_level(url, prompts, concurrency, args.max_tokens, speculate=False))
                speculative = asyncio.run(run_level(url, prompts, concurrency, args.max_tokens, speculate=True))
                identical = plain["texts"] == speculative["texts"]
                levels.append({"concurrency": concurrency, "plain": plain, "speculative": speculative, "identical": identical})
                print(f"[serve-bench] concurrency {concurrency}: plain {plain['tokens_per_second']} tok/s, "
                      f"speculative {speculative['tokens_per_second']} tok/s, identical text: {identical}", file=sys.stderr)
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
    report = {
        "config": {
            "target": args.target, "draft": args.draft, "drafter": drafter, "drafter_description": description,
            "draft_len": args.draft_len, "max_tokens": args.max_tokens, "max_batch": args.max_batch,
            "num_prompts": len(prompts), "prompts": [{k: p[k] for k in ("category", "id")} for p in prompts],
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, server threads {args.threads or 'default'}",
            "date": time.strftime("%Y-%m-%d %H:%M"),
        },
        "levels": levels,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"serve-{args.target}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (out / f"{stem}.md").write_text(table)
    print(table)
    return report


if __name__ == "__main__":
    main()
