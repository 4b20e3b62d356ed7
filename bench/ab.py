"""What the A/B scripts beside this file share (`draft_vocab_ab.py`, `late_start_ab.py`, `prefill_amx_ab.py`, ...).

Each prompt runs every variant `rounds` times in alternating order, so a noisy minute weighs on all of them alike;
a variant's figures are the medians of its runs and its tokens/s is divided by a baseline variant's; greedy
outputs must equal the baseline's. The report plots those ratios per prompt, one bar per variant.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import verispec
from verispec.api import suffix_index
from verispec.bench import _cpu_name
from verispec.text import encode_prompt


def arguments(description: str, rounds: bool = True) -> argparse.ArgumentParser:
    """The options every A/B script takes (the Qwen pair, the answer length, the prompt folder, the report path;
    `--rounds` where the script runs variants more than its fixed twice); a script adds its own before parsing."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    if rounds:
        parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data", default="../shared/data", help="folder with humaneval_dev.jsonl and spec_bench_dev.jsonl")
    parser.add_argument("--out", required=True)
    return parser


def run_interleaved(variants: list[str], rounds: int, run: Callable[[str], dict]) -> dict[str, list[dict]]:
    """Per variant, the figures `run(name)` returns for each of `rounds` runs (each with "tokens_per_second" and
    "tokens"), the variants run in order, then in reverse, and so on."""
    runs = {name: [] for name in variants}
    for round_ in range(rounds):
        for name in (variants if round_ % 2 == 0 else variants[::-1]):
            runs[name].append(run(name))
    return runs


def forget_outputs(target) -> None:
    """Empty the target's index of earlier outputs before a timed call (as `verispec bench` does): staged drafting and
    suffix lookup draft from it, and a prompt's later runs would draft their answer from its first (until 2026-12-08
    these scripts did not, so every run of `auto` but a prompt's first drafted its answer from memory)."""
    suffix_index(target).clear()


def rows_against_plain(target, prompts, names: list[str], rounds: int, max_new_tokens: int,
                       options: Callable[[str], dict]) -> list[dict]:
    """Per prompt, every variant `rounds` times (`run_interleaved`) through `verispec.generate`, with the keyword
    arguments options(name) returns once it has set the variant up; a row per prompt: each variant's tokens/s over
    "plain"'s, its tokens a pass and prefill seconds (`compare`) and its last run's drafter. Prints a line a prompt."""
    rows = []
    for prompt in prompts:
        ids = encode_prompt(target.tokenizer, prompt.text, chat=prompt.chat)

        def run(name: str) -> dict:
            forget_outputs(target)
            result = verispec.generate(target, ids, max_new_tokens=max_new_tokens, **options(name))
            stats = result.stats
            return {"tokens_per_second": len(result.token_ids) / stats.total_seconds,
                    "tokens_per_pass": stats.mean_accepted_tokens, "prefill_seconds": stats.prefill_seconds,
                    "drafter": stats.drafter, "tokens": result.token_ids}

        runs = run_interleaved(names, rounds, run)
        row = {"category": prompt.category, "id": prompt.id, "prompt_tokens": len(ids),
               "new_tokens": len(runs["plain"][0]["tokens"]),
               "plain_tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs["plain"]),
               **compare(runs, "plain", "vs_plain", ("tokens_per_pass", "prefill_seconds"))}
        for name, got in runs.items():
            row[name]["drafter"] = got[-1]["drafter"]
        rows.append(row)
        print(f"{prompt.category:14s} {row['prompt_tokens']:4d}+{row['new_tokens']:3d} " + " | ".join(
            f"{name} {row[name]['vs_plain']:.2f}x {row[name]['tokens_per_pass']:.2f}/pass" for name in names if name != "plain")
            + f"  ({row[names[-1]]['drafter']})", flush=True)
    return rows


def report_against_plain(args, rows: list[dict], names: list[str], title: str) -> None:
    """`rows_against_plain`'s rows summarized, written to args.out (JSON, with the machine, date and settings) and
    plotted beside it (.png, the 0.97x floor dotted); `title` names what varies."""
    summary = summarize(rows, names, "vs_plain")
    print(json.dumps(summary, indent=1))
    report = {"cpu": _cpu_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "settings": vars(args), "summary": summary, "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=1))
    plot_ratios(rows, summary, [name for name in names if name != "plain"], "vs_plain",
                [f"{r['category']}\n{r['prompt_tokens']}+{r['new_tokens']}" for r in rows], "tokens/s vs plain (end to end)",
                f"{args.target} (q8) with {args.draft}: {title}; {report['cpu']}, {report['date']}",
                Path(args.out).with_suffix(".png"), floor=0.97)


def compare(runs: dict[str, list[dict]], baseline: str, ratio: str, figures: tuple[str, ...] = ()) -> dict[str, dict]:
    """Per variant: its median tokens/s over the baseline's (`ratio`), the medians of `figures`, and whether every
    run's tokens equal the baseline's first run's ("identical")."""
    base = statistics.median(r["tokens_per_second"] for r in runs[baseline])
    reference = runs[baseline][0]["tokens"]
    return {name: {ratio: statistics.median(r["tokens_per_second"] for r in got) / base,
                   **{figure: statistics.median(r[figure] for r in got) for figure in figures},
                   "identical": all(r["tokens"] == reference for r in got)}
            for name, got in runs.items()}


def summarize(rows: list[dict], variants: list[str], ratio: str) -> dict[str, dict]:
    """Per variant, over the prompts: the median, geometric mean and lowest of `ratio`, and how many were identical."""
    return {name: {"median": statistics.median(r[name][ratio] for r in rows),
                   "geomean": statistics.geometric_mean(r[name][ratio] for r in rows),
                   "min": min(r[name][ratio] for r in rows),
                   "identical": f"{sum(r[name]['identical'] for r in rows)}/{len(rows)}"} for name in variants}


def plot_ratios(rows: list[dict], summary: dict[str, dict], variants: list[str], ratio: str, labels: list[str],
                ylabel: str, title: str, path: Path, floor: float | None = None) -> None:
    """One group of bars per prompt (`labels`), one bar per variant; `floor`, if given, is drawn dotted and each
    variant's lowest ratio goes into the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(10, 0.75 * len(rows)), 4.5))
    width = 0.8 / len(variants)
    for i, name in enumerate(variants):
        legend = f"{name} (median {summary[name]['median']:.2f}x" + (f", min {summary[name]['min']:.2f}x)" if floor else ")")
        ax.bar([x + i * width for x in range(len(rows))], [r[name][ratio] for r in rows], width, label=legend)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    if floor:
        ax.axhline(floor, color="red", linewidth=0.6, linestyle=":")
    ratios = [r[name][ratio] for r in rows for name in variants]
    ax.set_ylim(min(0.8, min(ratios) - 0.05), max(ratios) + 0.2)
    ax.set_xticks([x + width * (len(variants) - 1) / 2 for x in range(len(rows))])
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left", ncol=len(variants))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
