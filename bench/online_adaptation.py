"""Online adaptation of Medusa heads on a shifting workload: static heads against the same heads learning
from the traffic (`heads.online.OnlineMedusa`, its worker thread running), in one served run.

The workload is served request by request, as a user of the engine would: first Spec-Bench chat questions
(chat template, no coding category), then HumanEval prompts (raw completion). Each request runs twice back
to back, once with the static heads and once with the online ones (which one first alternates), so a noisy
neighbour hits both alike; only the online run's traffic trains the online heads. Greedy, a fixed draft
length, so tokens per target pass measure the heads alone; both texts must equal each other (both are the
target's greedy text).

The heads start cold (`medusa_head_from_target`: each LM head the target's rows, residual blocks the
identity) over the draft vocabulary of the target's first `--draft-vocab` ids (BPE ids follow merge order,
roughly frequency; SmolLM2's first 8192 cover ~80% of the tokens it generates here) or from a trained head
(`--head DIR`, e.g. trained on the other domain).

Overhead: the learner's busy share of the wall clock, and an A/B of plain decoding (no drafter) with a
learner training in the background at the same budget against none, interleaved per prompt (medians of
per-prompt ratios of tokens/s and of CPU seconds per token). Run the A/B with OMP_WAIT_POLICY=PASSIVE: with
OpenMP's default waiting, plain decoding on the shared 2-core machine ran 2.4x *faster* beside a busy learner
(idle OpenMP workers spinning, throttled once a second team exists, is the likely cause), which hides the
learner's cost.

    PYTHONPATH=src python bench/online_adaptation.py --out bench/reports/online_adaptation
    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=src python bench/online_adaptation.py --overhead-only --overhead-prompts 6
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

import verispec
from verispec.bench import read_prompts
from verispec.heads import OnlineConfig, OnlineMedusa
from verispec.heads.train_medusa import medusa_head_from_target
from verispec.text import encode_prompt

CHAT = "/work/shared/data/spec_bench_dev.jsonl"
CODE = "/work/shared/data/humaneval_dev.jsonl"
CHAT_CATEGORIES = ("qa", "writing", "roleplay", "reasoning", "stem", "humanities", "math_reasoning", "extraction", "math")


def workload(target, chat: int, code: int) -> list[tuple[str, list[int]]]:
    """(phase, prompt ids): `chat` Spec-Bench questions round-robin over CHAT_CATEGORIES, then `code` HumanEval prompts."""
    by_category: dict[str, list] = {}
    for p in read_prompts(CHAT, 8):
        by_category.setdefault(p.category, []).append(p)
    questions = [q for round_ in zip(*(by_category[c] for c in CHAT_CATEGORIES)) for q in round_][:chat]
    tasks = read_prompts(CODE, code)[:code]
    encode = lambda p: encode_prompt(target.tokenizer, p.text, chat=p.chat)  # noqa: E731
    return [("chat", encode(q)) for q in questions] + [("code", encode(t)) for t in tasks]


def record(phase: str, arm: str, result, served_before: int) -> dict:
    stats = result.stats
    return {"phase": phase, "arm": arm, "served_before": served_before, "tokens": len(result.token_ids),
            "passes": stats.sequence_steps, "accepted": stats.accepted_tokens,
            "tokens_per_pass": round((stats.accepted_tokens + stats.sequence_steps) / max(stats.sequence_steps, 1), 4),
            "seconds": round(stats.total_seconds, 4), "target_seconds": round(stats.target_seconds, 4),
            "draft_seconds": round(stats.draft_seconds, 4), "ids": result.token_ids}


def overhead_ab(target, head, options: OnlineConfig, buffer, prompts, max_new_tokens: int) -> dict:
    """Plain decoding with a learner training in the background (its own copy of the heads, windows of served
    traffic in `buffer`, credit for a full backlog, so it trains at its max_busy share throughout) against
    none, interleaved per prompt. Two ratios, busy over idle: wall-clock tokens/s, which on a shared machine
    also moves with the neighbours' load (an extra runnable thread wins CPU from them too), and the process's
    CPU seconds per token (every thread: the target's and the learner's), the compute the learner adds."""
    wall, cpu, busy_shares = [], [], []
    for i, ids in enumerate(prompts):
        timed = {}
        for arm in (("busy", "idle") if i % 2 == 0 else ("idle", "busy")):
            learner = None
            if arm == "busy":
                learner = OnlineMedusa(head, options)
                learner.buffer = buffer
                learner.start()
                learner.served(10**6)
            started, started_cpu = time.perf_counter(), time.process_time()
            result = verispec.generate(target, ids, drafter="none", max_new_tokens=max_new_tokens)
            seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - started_cpu
            timed[arm] = (len(result.token_ids) / seconds, cpu_seconds / len(result.token_ids))
            if learner is not None:
                learner.close()
                busy_shares.append(learner.busy_seconds / seconds)
        wall.append(timed["busy"][0] / timed["idle"][0])
        cpu.append(timed["busy"][1] / timed["idle"][1])
    return {"plain_tokens_per_second_ratio_busy_over_idle": round(statistics.median(wall), 4),
            "plain_cpu_seconds_per_token_ratio_busy_over_idle": round(statistics.median(cpu), 4),
            "per_prompt_wall": [round(r, 4) for r in wall], "per_prompt_cpu": [round(r, 4) for r in cpu],
            "learner_busy_share": round(statistics.median(busy_shares), 4), "prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "(unset)")}


def summarize(rows: list[dict], arm: str, phase: str, part: slice = slice(None)) -> dict:
    chosen = [r for r in rows if r["arm"] == arm and r["phase"] == phase][part]
    return {"requests": len(chosen), "tokens_per_pass": round(sum(r["accepted"] + r["passes"] for r in chosen)
                                                               / max(sum(r["passes"] for r in chosen), 1), 4),
            "median_tokens_per_pass": round(statistics.median(r["tokens_per_pass"] for r in chosen), 4) if chosen else None,
            "tokens_per_second": round(sum(r["tokens"] for r in chosen) / max(sum(r["seconds"] for r in chosen), 1e-9), 3),
            "target_seconds_per_pass": round(sum(r["target_seconds"] for r in chosen) / max(sum(r["passes"] for r in chosen), 1), 5),
            "draft_seconds_per_pass": round(sum(r["draft_seconds"] for r in chosen) / max(sum(r["passes"] for r in chosen), 1), 5)}


def plot(rows: list[dict], shift: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for arm, colour in (("static", "tab:gray"), ("online", "tab:blue")):
        chosen = [r for r in rows if r["arm"] == arm]
        x, y, served = [], [], 0
        for r in chosen:
            served += r["tokens"]
            x.append(served)
            y.append(r["tokens_per_pass"])
        ax.plot(x, y, "o", color=colour, alpha=0.35, markersize=4)
        smooth = [statistics.mean(y[max(0, i - 3): i + 1]) for i in range(len(y))]
        ax.plot(x, smooth, "-", color=colour, label=f"{arm} heads (mean of the last 4 requests)")
    ax.axvline(shift, color="tab:red", linestyle="--", label="workload shifts: chat -> code")
    ax.set_xlabel("tokens served (per arm)")
    ax.set_ylabel("tokens per target pass (greedy)")
    ax.set_title("Medusa heads learning from their own traffic (smollm2-135m)")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)


def rerun_overhead(target, head, options: OnlineConfig, requests, args) -> None:
    """The overhead A/B alone, written into the existing report (its buffer: windows of the first requests'
    traffic, served with a worker-less learner)."""
    out = Path(args.out)
    report = json.loads(out.with_suffix(".json").read_text())
    filler = OnlineMedusa(head, options)
    for _, ids in requests[:3]:
        verispec.generate(target, ids, draft=filler, draft_len=args.draft_len, max_new_tokens=args.max_new_tokens)
    prompts = [ids for _, ids in requests[3 : 3 + args.overhead_prompts]]
    report["overhead"] = overhead_ab(target, head, options, filler.buffer, prompts, args.max_new_tokens)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report))
    print(json.dumps(report["overhead"], indent=1))


def markdown(report: dict) -> str:
    """The report's tables: tokens per pass by phase and arm (all requests, the second half of each phase, the
    first four code requests right after the shift), speed, the learner, the overhead A/B."""
    lines = [f"# Online adaptation of Medusa heads, {report['date']}", "",
             f"{report['settings']['target']}, greedy, draft_len {report['settings']['draft_len']}, "
             f"{report['settings']['max_new_tokens']} new tokens per request; {report['machine']}. "
             f"Heads: {report['settings']['head'] or 'cold start'}; identical texts (static vs online): {report['identical']}.", "",
             "| arm | phase | requests | tokens/pass | 2nd half tokens/pass | tokens/s | target s/pass | draft s/pass |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for arm in ("static", "online"):
        for phase in ("chat", "code"):
            a, b = report["summary"][arm][phase], report["second_half"][arm][phase]
            lines.append(f"| {arm} | {phase} | {a['requests']} | {a['tokens_per_pass']} | {b['tokens_per_pass']} | "
                         f"{a['tokens_per_second']} | {a['target_seconds_per_pass']} | {a['draft_seconds_per_pass']} |")
    first = report["first_4_code"]
    learner, overhead = report["learner"], report["overhead"]
    lines += ["", f"First 4 code requests after the shift: static {first['static']['tokens_per_pass']}, online "
              f"{first['online']['tokens_per_pass']} tokens/pass.", "",
              f"Learner: {learner['steps']} steps, {learner['version']} swaps, {learner['served_tokens']} served tokens, "
              f"{learner['windows_added']} windows, busy {learner['busy_seconds']} s = {learner['busy_share_of_run']:.0%} of "
              f"the run's {report['wall_seconds']} s; last batch loss {learner['loss']}, head accuracies {learner['accuracy']}.", "",
              f"Overhead A/B (OMP_WAIT_POLICY {overhead.get('OMP_WAIT_POLICY', '(unset)')}), plain decoding of "
              f"{overhead['prompts']} prompts ({overhead['max_new_tokens']} tokens) with a "
              f"learner training in the background at this budget (busy {overhead['learner_busy_share']:.0%} of the time) "
              f"against none, medians of per-prompt ratios busy/idle: CPU seconds per token (all threads) "
              f"{overhead['plain_cpu_seconds_per_token_ratio_busy_over_idle']}x {overhead['per_prompt_cpu']}; wall-clock "
              f"tokens/s {overhead['plain_tokens_per_second_ratio_busy_over_idle']}x {overhead['per_prompt_wall']} (on a "
              "shared machine an extra runnable thread also wins CPU from the neighbours).", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--head", default=None, help="a trained Medusa head directory to start from (default: a cold start)")
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--chat", type=int, default=12)
    parser.add_argument("--code", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--draft-len", type=int, default=3)
    parser.add_argument("--tokens-per-step", type=float, default=8.0)
    parser.add_argument("--max-busy", type=float, default=0.5)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--overhead-prompts", type=int, default=4)
    parser.add_argument("--out", default="bench/reports/online_adaptation")
    parser.add_argument("--overhead-only", action="store_true",
                        help="rerun only the overhead A/B (its buffer filled by serving the first prompts) into --out's report")
    args = parser.parse_args()

    target = verispec.load(args.target)
    if args.head:
        head = verispec.load_head(args.head, target)
    else:
        ids = torch.unique(torch.cat([torch.arange(args.draft_vocab), torch.tensor(sorted(target.eos_token_ids))]))
        head = medusa_head_from_target(target, ids, num_heads=args.heads)
    options = OnlineConfig(tokens_per_step=args.tokens_per_step, max_busy=args.max_busy, lr=args.lr)
    requests = workload(target, args.chat, args.code)
    if args.overhead_only:
        return rerun_overhead(target, head, options, requests, args)
    verispec.generate(target, requests[0][1], draft=head, draft_len=args.draft_len, max_new_tokens=8)  # warm up

    rows, started = [], time.perf_counter()
    online = OnlineMedusa(head, options).start()
    served = {"static": 0, "online": 0}
    for i, (phase, ids) in enumerate(requests):
        for arm in (("online", "static") if i % 2 == 0 else ("static", "online")):
            draft = online if arm == "online" else head
            result = verispec.generate(target, ids, draft=draft, draft_len=args.draft_len, max_new_tokens=args.max_new_tokens)
            rows.append(record(phase, arm, result, served[arm]))
            served[arm] += len(result.token_ids)
        same = rows[-1]["ids"] == rows[-2]["ids"]
        print(f"{i:3d} {phase}: static {rows[-1 if rows[-1]['arm'] == 'static' else -2]['tokens_per_pass']:.2f} "
              f"online {rows[-1 if rows[-1]['arm'] == 'online' else -2]['tokens_per_pass']:.2f} tokens/pass; "
              f"learner {online.steps} steps, loss {online.history[-1]['loss'] if online.history else None}; "
              f"identical {same}", flush=True)
    wall = time.perf_counter() - started
    online.close()
    learner = online.summary()
    learner["busy_share_of_run"] = round(online.busy_seconds / wall, 4)
    identical = sum(a["ids"] == b["ids"] for a, b in zip(rows[0::2], rows[1::2]))
    shift = sum(r["tokens"] for r in rows if r["arm"] == "online" and r["phase"] == "chat")

    overhead = overhead_ab(target, head, options, online.buffer, [ids for _, ids in requests[: args.overhead_prompts]],
                           args.max_new_tokens)
    half = lambda n: slice(n // 2, None)  # noqa: E731 - the second half of a phase: after some learning on it
    report = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads (2-core AMD EPYC Zen 5, shared with other jobs)",
        "settings": {**vars(args), "online": learner.pop("options")},
        "summary": {arm: {phase: summarize(rows, arm, phase) for phase in ("chat", "code")} for arm in ("static", "online")},
        "second_half": {arm: {phase: summarize(rows, arm, phase, half(args.chat if phase == "chat" else args.code))
                              for phase in ("chat", "code")} for arm in ("static", "online")},
        "first_4_code": {arm: summarize(rows, arm, "code", slice(0, 4)) for arm in ("static", "online")},
        "identical": f"{identical}/{len(requests)}", "learner": learner, "overhead": overhead,
        "wall_seconds": round(wall, 1), "requests": [{k: v for k, v in r.items() if k != "ids"} for r in rows],
        "learning_curve": online.history,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report))
    plot(rows, shift, out.with_suffix(".png"))
    print(json.dumps({k: report[k] for k in ("summary", "second_half", "first_4_code", "identical", "overhead")}, indent=1))
    print(json.dumps({k: v for k, v in learner.items()}, indent=1))


if __name__ == "__main__":
    main()
