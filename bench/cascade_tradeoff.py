"""Speculative cascades (lossy, `generate(cascade=...)`): the speed they buy against how far they move from the
target, in one run. Greedy decoding of HumanEval problems by plain decoding, exact speculation with a draft
model, and cascades at a few deferral settings, each with the same draft model and draft length.

Speed: tokens per target pass, and per-problem tokens/s ratios against plain decoding and against exact
speculation (medians over problems; the methods' order rotates per problem so a noisy neighbour hits them
alike). Deviation: the target's mean log-likelihood per generated token (its own log-probabilities of the
text, `generate(logprobs=0)`), minus plain decoding's; and HumanEval pass@1 (greedy): prompt + completion
+ the problem's tests, run in a subprocess with a timeout. The tests come from OpenAI's HumanEval release
(github.com/openai/human-eval, data/HumanEval.jsonl.gz, MIT); the problems from /work/shared/data's dev half.

    python bench/cascade_tradeoff.py --problems 8 --max-new-tokens 128 --tests /tmp/HumanEval.jsonl.gz \\
        --cascade chow:0.1 --cascade chow:0.3 --cascade diff:0 --out bench/reports/cascade_tradeoff
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import verispec
from verispec.bench import _cpu_name
from verispec.text import encode_prompt

# Codex's stop sequences for HumanEval: the function body ends where top-level code starts.
STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"]


def passes(problem: dict, completion: str, timeout: float = 10.0) -> bool:
    """Whether prompt + completion passes the problem's tests (a fresh interpreter, killed after `timeout` s)."""
    program = problem["prompt"] + completion + "\n\n" + problem["test"] + f"\n\ncheck({problem['entry_point']})\n"
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "program.py"
        path.write_text(program)
        try:
            run = subprocess.run([sys.executable, str(path)], cwd=directory, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
    return run.returncode == 0


def run(target, ids: list[int], options: dict, max_new_tokens: int) -> dict:
    started = time.perf_counter()
    result = verispec.generate(target, ids, max_new_tokens=max_new_tokens, stop=STOP, logprobs=0, **options)
    seconds = time.perf_counter() - started
    logprobs = [t.logprob for t in result.logprobs]
    return {"text": result.text, "tokens": len(result.token_ids), "seconds": seconds,
            "tokens_per_second": len(result.token_ids) / seconds,
            "decode_tokens_per_second": result.stats.decode_tokens_per_second, "mean_logprob": sum(logprobs) / max(1, len(logprobs)),
            "tokens_per_pass": result.stats.mean_accepted_tokens, "acceptance_rate": result.stats.acceptance_rate,
            "lossy": result.stats.lossy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--numerics", default="q8", choices=("float32", "q8"))
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--draft-dtype", default="int4", help="the draft model's matrices (as verispec bench --method model:DRAFT)")
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--problems", default="/work/shared/data/humaneval_dev.jsonl")
    parser.add_argument("--tests", required=True, help="HumanEval.jsonl.gz (or .jsonl) of the OpenAI release: the tests")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--cascade", action="append", default=[], help='repeatable: "rule:alpha", e.g. chow:0.3')
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", required=True, help="report path without extension (.json, .md and .png are written)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    opener = gzip.open if args.tests.endswith(".gz") else open
    with opener(args.tests, "rt") as f:
        tests = {row["task_id"]: row for row in map(json.loads, f)}
    with open(args.problems) as f:
        problems = [tests[json.loads(line)["task_id"]] for line in f if line.strip()][: args.limit]

    target = verispec.load(args.target, numerics=args.numerics)
    draft = verispec.load(args.draft, weight_dtype=args.draft_dtype)
    speculative = dict(draft=draft, drafter="model", draft_len=args.draft_len)
    methods = {"plain": dict(drafter="none"), "speculative (exact)": speculative}
    methods.update({f"cascade {c}": dict(speculative, cascade=c) for c in args.cascade})
    warm = encode_prompt(target.tokenizer, "def f(x):\n    return x + 1\n\n" * 4, chat=False)
    for options in methods.values():
        run(target, warm, options, 8)
    print(f"[cascade] {len(problems)} problems, target {args.target} ({args.numerics}), draft {args.draft} "
          f"{args.draft_dtype}, k={args.draft_len}, {torch.get_num_threads()} threads, {_cpu_name()}", file=sys.stderr)

    names = list(methods)
    per_problem = []
    for i, problem in enumerate(problems):
        ids = encode_prompt(target.tokenizer, problem["prompt"], chat=False)
        order = names[i % len(names):] + names[: i % len(names)]
        results = {name: run(target, ids, methods[name], args.max_new_tokens) for name in order}
        for name, r in results.items():
            r["passed"] = passes(problem, r["text"])
        per_problem.append({"task_id": problem["task_id"], "results": {name: results[name] for name in names}})
        print(f"[cascade] {problem['task_id']}: " + ", ".join(
            f"{name} {r['tokens_per_second']:.1f} tok/s {r['tokens_per_pass']:.2f}/pass ll {r['mean_logprob']:.3f} "
            f"{'pass' if r['passed'] else 'fail'}" for name, r in per_problem[-1]["results"].items()), file=sys.stderr)

    report = summarize(args, per_problem, names)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report))
    plot(report, out.with_suffix(".png"))
    print(markdown(report))


def summarize(args, per_problem: list[dict], names: list[str]) -> dict:
    def ratio(name: str, base: str, key: str = "tokens_per_second") -> float:
        return statistics.median(p["results"][name][key] / p["results"][base][key] for p in per_problem)

    table = {}
    for name in names:
        rows = [p["results"][name] for p in per_problem]
        table[name] = {
            "lossy": any(r["lossy"] for r in rows),
            "tokens_per_pass": statistics.mean(r["tokens_per_pass"] for r in rows),
            "acceptance_rate": statistics.mean(r["acceptance_rate"] for r in rows),
            "tokens_per_second": statistics.median(r["tokens_per_second"] for r in rows),
            "vs_plain": ratio(name, "plain"),
            "vs_speculative": ratio(name, "speculative (exact)"),
            "decode_vs_plain": ratio(name, "plain", "decode_tokens_per_second"),  # after the prompt's prefill (the draft's too)
            "decode_vs_speculative": ratio(name, "speculative (exact)", "decode_tokens_per_second"),
            "mean_logprob": statistics.mean(r["mean_logprob"] for r in rows),
            # per problem, this method's mean log-likelihood per token minus plain decoding's, then the mean
            "logprob_vs_plain": statistics.mean(r["mean_logprob"] - p["results"]["plain"]["mean_logprob"]
                                                for r, p in zip(rows, per_problem)),
            "identical_to_plain": sum(r["text"] == p["results"]["plain"]["text"] for r, p in zip(rows, per_problem)),
            "pass_rate": sum(r["passed"] for r in rows) / len(rows),
            "passed": sum(r["passed"] for r in rows),
        }
    return {"target": args.target, "numerics": args.numerics, "draft": f"{args.draft} {args.draft_dtype}",
            "draft_len": args.draft_len, "problems": len(per_problem), "max_new_tokens": args.max_new_tokens,
            "threads": torch.get_num_threads(), "cpu": _cpu_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "table": table, "per_problem": per_problem}


def markdown(report: dict) -> str:
    lines = [f"# Speculative cascades on {report['target']} ({report['numerics']}), draft {report['draft']}, k={report['draft_len']}",
             "", f"{report['problems']} HumanEval dev problems, greedy, up to {report['max_new_tokens']} new tokens (Codex's stop "
             f"sequences), one run per method per problem in rotating order, {report['threads']} threads, {report['cpu']}, "
             f"{report['date']}. Speed ratios are medians over problems of per-problem tokens/s ratios, end to end and, in "
             "brackets, of decoding alone (after the prompt's prefill, which for a draft model includes its own). "
             "Log-likelihood: the target's mean log-probability per generated token, minus plain decoding's (mean over "
             "problems; 0 = as likely to the target as its own greedy text).", "",
             "| method | LOSSY | tokens/pass | vs plain | vs exact spec | target log-lik/token | vs plain | same text as plain | HumanEval pass |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, m in report["table"].items():
        lines.append(f"| {name} | {'yes' if m['lossy'] else 'no'} | {m['tokens_per_pass']:.2f} | {m['vs_plain']:.2f}x ({m['decode_vs_plain']:.2f}x) | "
                     f"{m['vs_speculative']:.2f}x ({m['decode_vs_speculative']:.2f}x) | {m['mean_logprob']:.3f} | {m['logprob_vs_plain']:+.3f} | "
                     f"{m['identical_to_plain']}/{report['problems']} | {m['passed']}/{report['problems']} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Tokens per target pass and decoding speed against the target log-likelihood given up, one marker per
    method (squares: LOSSY), named in the legend."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (passes, speed) = plt.subplots(1, 2, figsize=(10, 4.6), sharex=True)
    for i, (name, m) in enumerate(report["table"].items()):
        style = dict(s=45, marker="s" if m["lossy"] else "o", color=f"C{i}", alpha=0.85,
                     label=f"{name}: {m['passed']}/{report['problems']} pass")
        passes.scatter(m["logprob_vs_plain"], m["tokens_per_pass"], **style)
        speed.scatter(m["logprob_vs_plain"], m["decode_vs_plain"], **style)
    passes.set_ylabel("tokens per target pass")
    speed.set_ylabel("decode tokens/s vs plain (median)")
    speed.axhline(1.0, color="black", linewidth=0.6)
    for ax in (passes, speed):
        ax.axvline(0.0, color="black", linewidth=0.6)
        ax.set_xlabel("target log-lik per token minus plain's (nats)")
    passes.legend(fontsize=7, loc="lower left")
    fig.suptitle(f"Speculative cascades: {report['target']} ({report['numerics']}), draft {report['draft']}, "
                 f"k={report['draft_len']}, {report['problems']} HumanEval problems, {report['threads']} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
