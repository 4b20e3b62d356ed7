"""`verispec bench --method M [--method M ...]`: drafters side by side on one target, in one run: plain
decoding, each drafter given, and llama.cpp's plain decoding of the same GGUF file (`--peer llama.cpp`; with
`--peer-draft DRAFT` also its own speculative decoding with that draft GGUF, `llama-speculative-simple`), prompt
by prompt.

Per prompt every method runs `--rounds` times, the methods' order rotating each round (so a noisy
neighbour hits them alike), and its median time counts; the speedups are medians over prompts of
per-prompt tokens/s ratios. Greedy: every drafter's text must equal plain decoding (it is checked and
reported). A method is `plain`, `suffix`, `ngram`, `self`, `model:DRAFT` (a draft model, ggml's Q4_0 blocks
unless `model:DRAFT:fp32|bf16|int8|int4`), `eagle3:DIR[:q4_0|q8_0|int8|int4|bfloat16]` (a trained head, chain; q4_0
unless given) or
`eagle3-tree:DIR[:...]` (an EAGLE-2 dynamic tree grown around the head's chain, priced node by node), `mtp:DIR[:...]`
or `mtp-tree:DIR[:...]` (an MTP module, `verispec train mtp`, likewise), `medusa:DIR` or `medusa-tree:DIR`
(Medusa-1 heads, `verispec train medusa`; float32), `staged:DRAFT[:DTYPE]` (staged drafting: the draft model
itself sped up by suffix proposals; `staged` alone: the target's int4 copy, float32 targets), `auto:DRAFT[:DTYPE]`
(the default mode given a draft model: the drafter `resolve_drafter` picks, or prompt lookup where the draft's
prompt prefill would not pay; each row names the drafter that ran); a draft model's methods take a third field, the
token ids its head scores (`auto:DRAFT:q4_0:all`: the whole head; `api.load_draft`'s vocab, "auto" by default). For staged
methods the report adds stage 2's figures: draft tokens per draft-model pass.

    verispec bench humaneval --target qwen2.5-coder-1.5b --numerics q8 --rows odd --method eagle3:HEAD \
        --method eagle3-tree:HEAD --method model:qwen2.5-coder-0.5b --method suffix --peer llama.cpp --name race_heads
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import verispec
from verispec import options, zoo
from verispec.bench import _cpu_name, _median_run, read_prompts
from verispec.errors import VerispecError
from verispec.options import DraftLen
from verispec.drafters.eagle3 import rounded_copy
from verispec.text import encode_prompt


@dataclass
class Method:
    name: str
    options: dict  # generate()'s keyword arguments


def methods_of(target, specs: list[str]) -> list[Method]:
    """The `--method` strings as generate() options (draft models and heads loaded once, here)."""
    out = [Method("plain", dict(drafter="none"))]
    for spec in specs:
        kind, _, rest = spec.partition(":")
        if kind == "plain":
            continue
        if kind in ("suffix", "rest", "ngram", "self") or spec == "staged":
            out.append(Method(kind, dict(drafter=kind)))
        elif kind in ("staged", "model") or (kind == "auto" and rest):  # a draft model; "auto": the default mode given one
            name, _, rest = rest.partition(":")
            dtype, _, vocab = rest.partition(":")
            vocab = options.draft_vocab(int(vocab) if vocab.isdigit() else vocab or "auto")
            dtype = dtype or verispec.api.Q8_DRAFT_WEIGHTS  # whatever the target's numerics: a race times cheap drafts
            draft = verispec.api.load_draft(name, target, dtype, vocab=vocab)  # its head as `load_draft` sizes it
            head = f" head {len(draft.output_ids)}+read" if draft.output_ids is not None else ""
            out.append(Method(f"{kind} {Path(name).name} {dtype}{head}", dict(draft=draft, drafter=kind)))
        elif kind in ("eagle3", "eagle3-tree", "mtp", "mtp-tree"):
            directory, _, weights = rest.partition(":")
            head = verispec.load_head(directory, target)
            if weights:  # else the drafter's default (q4_0 on a CPU)
                head = rounded_copy(head, weights)
            drafter, _, tree = kind.partition("-")
            out.append(Method(f"{kind} {Path(directory).name} {weights or 'q4_0'}",
                              dict(draft=head, drafter=drafter, **({"draft_len": "tree"} if tree else {}))))
        elif kind == "head+suffix":
            directory, _, weights = rest.partition(":")
            head = verispec.load_head(directory, target)
            if weights:
                head = rounded_copy(head, weights)
            out.append(Method(f"head+suffix {Path(directory).name} {weights or 'q4_0'}", dict(draft=head, drafter="head+suffix")))
        elif kind in ("medusa", "medusa-tree"):
            head = verispec.load_head(rest, target)
            out.append(Method(f"{kind} {Path(rest).name}",
                              dict(draft=head, drafter="medusa", **({"draft_len": "tree"} if kind == "medusa-tree" else {}))))
        else:
            raise VerispecError(f"unknown --method {spec!r}: plain, suffix, ngram, self, model:DRAFT[:DTYPE], auto:DRAFT[:DTYPE], eagle3:DIR, "
                             "eagle3-tree:DIR, mtp:DIR, mtp-tree:DIR, head+suffix:DIR[:WEIGHTS], medusa:DIR, medusa-tree:DIR, staged, staged:DRAFT[:DTYPE[:VOCAB]]")
    return out


def run_method(target, ids: list[int], method: Method, max_new_tokens: int, draft_len="auto"):
    """(the generate() result, its seconds)."""
    # Drafts from this call's text only, as in a first request. Cleared whatever the method: "auto" may resolve to a
    # drafter that reads it (`api.SUFFIX_INDEX_DRAFTERS`), and would then draft a prompt's answer from its other runs.
    verispec.api.suffix_index(target).clear()
    started = time.perf_counter()
    result = verispec.generate(target, ids, max_new_tokens=max_new_tokens, **{"draft_len": draft_len, **method.options})
    return result, time.perf_counter() - started


def race_prompts(source: str, rows: str, per_category: int) -> list:
    """The prompts a race runs: those of `source` in file order, its odd or even rows (or all), the first
    `per_category` of each category."""
    prompts = read_prompts(source, sys.maxsize)
    if rows != "all":
        prompts = prompts[1::2] if rows == "odd" else prompts[0::2]
    by_category: dict[str, list] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p)
    return [p for group in by_category.values() for p in group[:per_category]]


def warm_prompt(target) -> list[int]:
    """A code prompt long enough for the prefill (big-pass) path, to run each method once before timing."""
    return encode_prompt(target.tokenizer, "def f(x):\n    return x + 1\n\n" * 8, chat=False)


def run_race(args) -> dict:
    """The race `verispec bench` runs when given --method (its arguments: `bench.add_bench_arguments`)."""
    threads = torch.get_num_threads()
    draft_len = args.draft_len
    prompts = race_prompts(args.prompts, args.rows, args.per_category)
    target = verispec.load(args.target, numerics=args.numerics)
    methods = methods_of(target, args.method)
    peer = gguf = peer_draft = None
    if args.peer_draft and not args.peer:
        raise VerispecError("--peer-draft times llama.cpp's speculative decoding beside its plain decoding: add --peer llama.cpp")
    if args.peer:
        from verispec.peers import LlamaCpp

        peer, gguf = LlamaCpp(args.peer_bin), zoo.gguf_path(args.target) if args.target in zoo.ZOO else Path(args.target)
        if args.peer_draft:
            peer_draft = Path(args.peer_draft) if args.peer_draft.endswith(".gguf") else zoo.gguf_path(args.peer_draft)
    warm = warm_prompt(target)
    for method in methods:
        run_method(target, warm, method, 32)
    print(f"[race] {len(prompts)} prompts, target {args.target} ({args.numerics}), methods "
          f"{[m.name for m in methods]}, {threads} threads, {_cpu_name()}", file=sys.stderr)

    rows = []
    for n, p in enumerate(prompts):
        ids = encode_prompt(target.tokenizer, p.text, chat=p.chat)
        times: dict[str, list[float]] = {m.name: [] for m in methods}
        results = {}
        for r in range(args.rounds):
            order = methods[r % len(methods):] + methods[: r % len(methods)]
            for method in order:
                result, seconds = run_method(target, ids, method, args.max_new_tokens, draft_len)
                times[method.name].append(seconds)
                results[method.name] = result
        plain = results["plain"].token_ids
        row = {"category": p.category, "id": p.id, "prompt_tokens": len(ids), "methods": {}}
        for method in methods:
            result = results[method.name]
            row["methods"][method.name] = {
                "seconds": statistics.median(times[method.name]), "tokens": len(result.token_ids),
                "tokens_per_pass": result.stats.mean_accepted_tokens, "identical": result.token_ids == plain,
                "draft_seconds_per_token": result.stats.draft_seconds / max(1, result.stats.drafted_tokens),
                "target_seconds_per_pass": result.stats.target_seconds / max(1, result.stats.target_passes),
                "draft_seconds_per_pass": result.stats.draft_seconds / max(1, result.stats.target_passes),
                "prefill_seconds": result.stats.prefill_seconds,  # the target's, and a draft model's own, prompt prefill
                "drafter": result.stats.drafter}
            stage2 = result.stats.drafter_figures
            if "lookup_steps" in stage2:  # head+suffix: how many drafting steps each of its two drafters took
                row["methods"][method.name]["steps_by_drafter"] = {k: stage2[k] for k in ("lookup_steps", "model_steps")}
            if "draft_passes" in stage2:  # a staged drafter's: draft tokens and accepted proposals per draft-model pass
                passes = max(1, stage2["draft_passes"])
                row["methods"][method.name]["stage2"] = {**stage2, "tokens_per_draft_pass": stage2["draft_tokens"] / passes,
                                                         "accepted_per_draft_pass": stage2["proposals_accepted"] / passes}
        if peer is not None:
            text = target.tokenizer.decode(ids, skip_special_tokens=False)
            run = _median_run([peer.complete(gguf, text, args.max_new_tokens, threads) for _ in range(args.rounds)])
            row["methods"]["llama.cpp"] = {"seconds": run.seconds, "tokens": run.new_tokens,
                                           "same_prompt_tokens": run.prompt_tokens == len(ids)}
            if peer_draft is not None:  # llama.cpp's own draft-model speculation (llama-speculative-simple)
                run = _median_run([peer.speculative(gguf, peer_draft, text, args.max_new_tokens, threads) for _ in range(args.rounds)])
                row["methods"]["llama.cpp speculative"] = {"seconds": run.seconds, "tokens": run.new_tokens,
                                                           "accepted": run.accepted, "drafted": run.drafted}
        rows.append(row)
        line = ", ".join(f"{name} {m['tokens'] / m['seconds']:.1f} tok/s" + (f" ({m['tokens_per_pass']:.2f}/pass"
                         f"{'' if m['identical'] else ', DIFFERS'})" if "tokens_per_pass" in m else "")
                         for name, m in row["methods"].items())
        print(f"[race] {n + 1}/{len(prompts)} {p.category}/{p.id}: {line}", file=sys.stderr, flush=True)

    report = summarize(rows, methods, args, threads)
    out = Path(args.out) / (args.name or f"race_{Path(args.prompts).stem}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"summary": report, "rows": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    plot(report, out.with_suffix(".png"))
    print(markdown(report))
    print(f"[race] reports: {out}.json, .md, .png", file=sys.stderr)
    return report


def _rate(m: dict) -> float:
    return m["tokens"] / m["seconds"] if m["seconds"] > 0 and m["tokens"] else float("nan")


def _decode_rate(m: dict) -> float:
    """Tokens per second of decoding, the last round's prompt prefill taken out of the median time."""
    return m["tokens"] / max(1e-9, m["seconds"] - m["prefill_seconds"])


def summarize(rows: list[dict], methods: list[Method], args, threads: int) -> dict:
    names = [m.name for m in methods] + (["llama.cpp"] if args.peer else []) + (["llama.cpp speculative"] if args.peer_draft else [])
    categories = sorted({r["category"] for r in rows})
    table = {}
    for category in categories + ["all"]:
        rs = [r for r in rows if category in ("all", r["category"])]
        entry = {}
        for name in names:
            ms = [r["methods"][name] for r in rs]
            entry[name] = {
                "vs_plain": statistics.median(_rate(m) / _rate(r["methods"]["plain"]) for m, r in zip(ms, rs)),
                "tokens_per_second": statistics.median(_rate(m) for m in ms)}
            if "prefill_seconds" in ms[0]:  # decoding alone: each run's prompt prefill (a draft model's too) taken out
                entry[name]["vs_plain_after_prefill"] = statistics.median(
                    _decode_rate(m) / _decode_rate(r["methods"]["plain"]) for m, r in zip(ms, rs))
            if args.peer:
                entry[name]["vs_llama_cpp"] = statistics.median(_rate(m) / _rate(r["methods"]["llama.cpp"]) for m, r in zip(ms, rs))
            if "tokens_per_pass" in ms[0]:
                entry[name]["tokens_per_pass"] = statistics.median(m["tokens_per_pass"] for m in ms)
                entry[name]["identical"] = f"{sum(m['identical'] for m in ms)}/{len(ms)}"
                entry[name]["draft_ms_per_token"] = 1e3 * statistics.median(m["draft_seconds_per_token"] for m in ms)
                entry[name]["target_ms_per_pass"] = 1e3 * statistics.median(m["target_seconds_per_pass"] for m in ms)
                entry[name]["draft_ms_per_pass"] = 1e3 * statistics.median(m["draft_seconds_per_pass"] for m in ms)
            if "stage2" in ms[0]:
                entry[name]["stage2_tokens_per_draft_pass"] = statistics.median(m["stage2"]["tokens_per_draft_pass"] for m in ms)
        table[category] = entry
    return {"target": args.target, "numerics": args.numerics, "prompts": args.prompts, "rows": args.rows,
            "count": len(rows), "max_new_tokens": args.max_new_tokens, "draft_len": str(DraftLen.parse(args.draft_len).setting), "rounds": args.rounds,
            "threads": threads,
            "cpu": _cpu_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "table": table}


def markdown(report: dict) -> str:
    lines = [f"# Drafters on {report['target']} ({report['numerics']}), {report['prompts']} ({report['rows']} rows)", "",
             f"{report['count']} prompts, greedy, {report['max_new_tokens']} new tokens, draft_len "
             f"{report.get('draft_len', 'auto')} (trees: 'tree'), median of {report['rounds']} rounds "
             f"per method, {report['threads']} threads, {report['cpu']}, {report['date']}. Speedups are medians over "
             "prompts of per-prompt tokens/s ratios, end to end (prefill included).", ""]
    for category, entry in report["table"].items():
        lines += [f"## {category}", "", "| method | tokens/s | vs plain | after prefill | vs llama.cpp | tokens/pass | draft ms/token | "
                  "draft ms/pass | target ms/pass | draft tokens per draft pass | identical |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for name, m in entry.items():
            get = lambda key, fmt: fmt.format(m[key]) if key in m else "-"  # noqa: E731
            lines.append(f"| {name} | {m['tokens_per_second']:.1f} | {m['vs_plain']:.2f}x | {get('vs_plain_after_prefill', '{:.2f}x')} | "
                         f"{get('vs_llama_cpp', '{:.2f}x')} | "
                         f"{get('tokens_per_pass', '{:.2f}')} | {get('draft_ms_per_token', '{:.2f}')} | "
                         f"{get('draft_ms_per_pass', '{:.1f}')} | {get('target_ms_per_pass', '{:.1f}')} | "
                         f"{get('stage2_tokens_per_draft_pass', '{:.2f}')} | {m.get('identical', '-')} |")
        lines.append("")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    categories = list(report["table"])
    names = list(report["table"]["all"])
    key = "vs_llama_cpp" if "vs_llama_cpp" in report["table"]["all"][names[0]] else "vs_plain"
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(categories) * len(names) / 3), 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar([c + i * width for c in range(len(categories))], [report["table"][c][name][key] for c in categories],
               width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(categories))], categories, rotation=20)
    ax.set_ylabel(f"tokens/s {key.replace('_', ' ')}")
    ax.set_title(f"{report['target']} ({report['numerics']}), {report['threads']} threads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
