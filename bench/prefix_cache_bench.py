"""Prefix cache and chunked prefill: what they cost and what they save.

Two measurements, each interleaved so a drift in the machine's load favours neither side:

1. Prefill throughput, in this process: a prompt of --prefill-tokens random tokens read in one pass
   against the same prompt read in aligned chunks of C tokens (C = 64, 128, 256, 512), --rounds times in
   rotating order; the median seconds of each. This is what chunked prefill costs, and why C is 256.
2. Time to first token of a conversation's second turn, through the server: two servers of the same
   model, the prefix cache on (default budget) and off (--prefix-cache-mb 0). Each run is a fresh
   conversation (its system prompt of ~--history tokens names the run, so no run finds another's chunks):
   turn 1 (--max-tokens, greedy), then turn 2 streamed, timed from request to first token. The runs
   alternate between the servers; the report gives the median of --runs. Both answers of every run are
   checked to be the same on both servers.

    python bench/prefix_cache_bench.py --target smollm2-135m
    python bench/prefix_cache_bench.py --target qwen2.5-coder-0.5b --runs 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx
import torch

import verispec
from verispec.prefill import PromptReader
from verispec.server import ServerProcess
from verispec.text import encode_chat

WORDS = ["lamp", "chair", "clock", "vase", "crate", "drum", "kettle", "mirror", "violin", "tulip", "comet", "otter"]


def prefill_seconds(target, tokens: list[int], chunk: int | None) -> float:
    """Seconds to read `tokens` in one pass (chunk None) or in aligned chunks of `chunk` tokens."""
    with torch.inference_mode():
        started = time.perf_counter()
        if chunk is None:
            target.forward(torch.tensor([tokens]), target.new_cache(1), last_only=True)
        else:
            cache = target.new_cache(1)
            for begin in range(0, len(tokens), chunk):
                target.forward(torch.tensor([tokens[begin : begin + chunk]]), cache, last_only=True)
        return time.perf_counter() - started


def measure_prefill(target, n: int, rounds: int) -> dict:
    tokens = torch.randint(100, 20000, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    sides = [None, 64, 128, 256, 512]
    times = {str(s): [] for s in sides}
    prefill_seconds(target, tokens[:300], 256)  # warm-up
    for r in range(rounds):
        order = sides[r % len(sides):] + sides[: r % len(sides)]
        for side in order:
            times[str(side)].append(prefill_seconds(target, tokens, side))
    return {side: statistics.median(values) for side, values in times.items()} | {"tokens": n, "rounds": rounds}


def system_prompt(run: int, notes: int) -> str:
    lines = [f"Session {run}. You answer from these notes only."]
    lines += [f"Note {i}: the {WORDS[i % len(WORDS)]} in room {i} weighs {(i * 7 + run) % 50 + 3} kilograms." for i in range(notes)]
    return "\n".join(lines)


def chat(url: str, model: str, messages: list[dict], max_tokens: int) -> tuple[str, float]:
    """(answer, seconds to the first content token), streamed, greedy."""
    started, first, text = time.perf_counter(), None, []
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"]
            if delta and delta[0]["delta"].get("content"):
                first = first if first is not None else time.perf_counter() - started
                text.append(delta[0]["delta"]["content"])
    return "".join(text), first


def measure_ttft(model: str, runs: int, notes: int, max_tokens: int, threads: int | None, extra: list[str]) -> dict:
    servers = {"on": ServerProcess(["--target", model, *extra], threads=threads).start(),
               "off": ServerProcess(["--target", model, "--prefix-cache-mb", "0", *extra], threads=threads).start()}
    results = {name: {"turn1": [], "turn2": []} for name in servers}
    identical, prompt_tokens = 0, []
    try:
        for server in servers.values():
            server.wait_ready(timeout=600)
        tokenizer = verispec.load(model).tokenizer
        for run in range(runs):
            answers = {}
            for name in (["on", "off"] if run % 2 == 0 else ["off", "on"]):
                url = servers[name].url
                messages = [{"role": "system", "content": system_prompt(run, notes)},
                            {"role": "user", "content": "Which note mentions the kettle in room 6?"}]
                first, ttft1 = chat(url, model, messages, max_tokens)
                messages += [{"role": "assistant", "content": first},
                             {"role": "user", "content": "And how much does the mirror in room 7 weigh?"}]
                second, ttft2 = chat(url, model, messages, max_tokens)
                results[name]["turn1"].append(ttft1)
                results[name]["turn2"].append(ttft2)
                answers[name] = (first, second)
                if name == "on":
                    prompt_tokens.append(len(encode_chat(tokenizer, messages)))
            identical += answers["on"] == answers["off"]
            print(f"run {run}: turn 2 ttft on {results['on']['turn2'][-1]:.2f}s off {results['off']['turn2'][-1]:.2f}s", flush=True)
        hits = httpx.get(servers["on"].url + "/metrics", timeout=30).text
    finally:
        for server in servers.values():
            server.stop()
    medians = {name: {turn: statistics.median(v) for turn, v in turns.items()} for name, turns in results.items()}
    cache_lines = [line for line in hits.splitlines() if line.startswith("verispec:prefix_cache")]
    return {"runs": runs, "turn2_prompt_tokens": statistics.median(prompt_tokens), "median": medians, "all": results,
            "identical": f"{identical}/{runs}", "speedup_turn2": medians["off"]["turn2"] / medians["on"]["turn2"],
            "metrics": cache_lines}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="prefill rounds (each side once per round)")
    p.add_argument("--prefill-tokens", type=int, default=1024)
    p.add_argument("--notes", type=int, default=48, help="lines of the system prompt (~20 tokens each)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument("--skip-ttft", action="store_true")
    p.add_argument("--prefill-threads", type=int, default=None, help="torch threads for the prefill measurement")
    p.add_argument("--server-args", default="--drafter ngram", help="more `verispec serve` options, one string")
    args = p.parse_args()
    report = {"target": args.target, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.prefill_threads:
        torch.set_num_threads(args.prefill_threads)
    report["threads"] = torch.get_num_threads()
    if not args.skip_prefill:
        report["prefill"] = measure_prefill(verispec.load(args.target), args.prefill_tokens, args.rounds)
        print(json.dumps(report["prefill"]), flush=True)
    if not args.skip_ttft:
        report["ttft"] = measure_ttft(args.target, args.runs, args.notes, args.max_tokens, args.threads, args.server_args.split())
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
