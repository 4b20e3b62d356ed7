"""`verispec bench`: speedup over plain decoding and over Hugging Face, per prompt category.

For each prompt, in one interleaved run: plain decoding through the verispec engine (the baseline),
speculative decoding (greedy outputs must be identical to the baseline), and the peers Hugging Face
`generate()`, `generate(assistant_model=draft)` and `generate(prompt_lookup_num_tokens=...)`.
Speedups are per-prompt time ratios against a run on the same machine in the same process, summarised
by their median (and geometric mean) per category. Writes JSON, Markdown and PNG plots.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from verispec import zoo
from verispec.errors import VerispecError
from verispec.options import DRAFTER_NAMES, DraftLen, flag

# Prompt sets shipped in the package (src/verispec/data/, licences in LICENSES.md there): the first 10
# HumanEval dev problems, and the first 2 Spec-Bench dev questions of each of its 13 categories.
BUNDLED_PROMPTS = {"humaneval": "humaneval.jsonl", "spec_bench": "spec_bench.jsonl", "code_edit": "code_edit.jsonl"}
DEFAULT_PROMPTS = "humaneval"


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="?", default=DEFAULT_PROMPTS,
                   help=f"a bundled prompt set ({', '.join(BUNDLED_PROMPTS)}; default: %(default)s) or a JSONL file in "
                        "Spec-Bench ({category, turns}) or HumanEval ({task_id, prompt}) form")
    p.add_argument("--target", default=zoo.DEFAULT_TARGET)
    p.add_argument("--draft", default=zoo.DEFAULT_DRAFT, help="draft model; 'none' for n-gram only")
    p.add_argument("--drafter", default="auto", choices=DRAFTER_NAMES, help="auto (model with a draft; with --draft none, self where the target allows (not a q8 target), else ngram) | model | self (the target's int4 copy on its cache; use with --draft none) | hybrid | staged (the draft, or with --draft none the int4 copy, sped up by suffix proposals) | ngram | suffix")
    p.add_argument("--draft-len", type=flag(DraftLen.parse), default=DraftLen("auto"), help="int, 'auto' (adaptive) or 'tree' (auto plus token-tree alternates)")
    p.add_argument("--draft-dtype", default="int4", help="matrix dtype of a native-backend draft: fp32, bf16 (half the bytes), int8 (weight-only, a quarter), int4 (grouped, ~1/7), q4_0 (ggml's blocks, ~1/7, llama.cpp's numerics) or q3_0 (the same, the MLP's gate and up in 3 bits: the fastest) (default: %(default)s)")
    p.add_argument("--gguf-blocks", action="store_true",
                   help="the target keeps its GGUF's Q4_K/Q6_K blocks, rebuilt exactly, instead of float32 matrices (same output)")
    p.add_argument("--numerics", choices=("float32", "q8"), default="float32",
                   help="the target's numbers: float32, or q8 (llama.cpp's: the GGUF's own blocks, 8-bit activations)")
    p.add_argument("--draft-int8", action="store_true", help="PyTorch dynamic int8 for the draft model (transformers backend; see --draft-dtype int8 for the native one)")
    p.add_argument("--draft-vocab", type=int, default=None, help="the draft scores only the first N token ids (+ specials)")
    p.add_argument("--draft-confidence", type=float, default=0.0, help="stop drafting at a token the draft gives less than this")
    p.add_argument("--per-category", type=int, default=2, help="prompts per category (fixed sample: the first N)")
    p.add_argument("--categories", default=None, help="comma-separated categories to keep (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--coupled", action="store_true",
                   help="sample by the Gumbel-max coupling: sampled outputs are then compared with plain sampling token by token")
    p.add_argument("--token-verification", action="store_true",
                   help="verify sampled drafts token by token instead of as blocks (the default)")
    p.add_argument("--typical-acceptance", type=float, default=0.0, metavar="EPS",
                   help="LOSSY: verify speculative runs by typical acceptance (Medusa's rule, e.g. 0.09); plain runs stay plain sampling")
    p.add_argument("--rounds", type=int, default=1,
                   help="time plain and speculative decoding of each prompt this many times, in alternating order, and take each one's median "
                        "(a shared machine's load moves single timings by ~10%%)")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face peers")
    p.add_argument("--peer", choices=("llama.cpp",), default=None,
                   help="also time llama.cpp's plain decoding of the target's GGUF file, greedy, same prompts and threads "
                        "(build it with bench/peers/build_llama_cpp.sh; --peer-bin or VERISPEC_LLAMA_CPP to point elsewhere)")
    p.add_argument("--peer-bin", default=None, help="folder holding llama.cpp's llama-completion")
    p.add_argument("--peer-draft", default=None,
                   help="also time llama.cpp's own speculative decoding (llama-speculative-simple) with this draft GGUF "
                        "(a zoo name or a .gguf file)")
    p.add_argument("--sweep", default="1,2,3,4,6,8", help="fixed draft lengths to measure against the formula ('' to skip)")
    p.add_argument("--sweep-prompts", type=int, default=3, help="prompts used for the draft-length sweep")
    p.add_argument("--widths", default="1,2,3,4,5,6,8,9,12,16", help="target forward widths for the verify cost curve")
    p.add_argument("--quick", action="store_true", help="1 prompt per category, 32 new tokens: a few minutes")
    p.add_argument("--method", action="append", default=[], metavar="M",
                   help="race drafters side by side instead, in one run (repeatable): plain decoding and each method, e.g. "
                        "suffix, ngram, self, model:DRAFT[:DTYPE], staged:DRAFT, eagle3:DIR[:q4_0|int4|...], eagle3-tree:DIR, head+suffix:DIR[:q4_0|int4|...], mtp:DIR, "
                        "medusa:DIR (see verispec.race); with --peer llama.cpp too")
    p.add_argument("--rows", default="all", choices=("all", "odd", "even"),
                   help="with --method: every other prompt of the file (odd / even), e.g. the half a head was not trained on")
    p.add_argument("--out", default="bench/reports", help="directory for JSON, Markdown and PNG reports")
    p.add_argument("--name", default=None, help="report file stem (default: derived from the prompt file)")


@dataclass
class Prompt:
    category: str
    id: str
    text: str
    chat: bool  # Spec-Bench turns are instructions (chat template); HumanEval prompts are code to continue


def prompt_text(source: str) -> str:
    """The JSONL text of a bundled prompt set (by name) or of a file (by path)."""
    if source in BUNDLED_PROMPTS:
        return resources.files("verispec").joinpath("data", BUNDLED_PROMPTS[source]).read_text(encoding="utf-8")
    path = Path(source)
    if not path.is_file():
        raise VerispecError(f"no prompt file {source!r}: give a JSONL file, or a bundled set ({', '.join(BUNDLED_PROMPTS)})")
    return path.read_text(encoding="utf-8")


def read_prompts(source: str, per_category: int) -> list[Prompt]:
    """The first `per_category` prompts of each category of `source` (a bundled set's name or a JSONL path)."""
    rows = []
    for number, line in enumerate(prompt_text(source).splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise VerispecError(f"{source}, line {number}: not JSON ({exc.msg}): each line must be one JSON object") from None
    prompts, taken = [], defaultdict(int)
    for row in rows:
        if not isinstance(row, dict):
            raise VerispecError(f"{source}: a row is {type(row).__name__}, not an object with 'turns' or 'prompt'")
        if "turns" in row:
            p = Prompt(row.get("category", "spec_bench"), str(row.get("question_id")), row["turns"][0], chat=True)
        elif "prompt" in row:
            p = Prompt("humaneval", str(row.get("task_id")), row["prompt"], chat=False)
        else:
            raise VerispecError(f"{source}: a row has neither 'turns' (Spec-Bench) nor 'prompt' (HumanEval): {sorted(row)}")
        if taken[p.category] < per_category:
            taken[p.category] += 1
            prompts.append(p)
    return prompts


@dataclass
class Measurement:
    prompt: Prompt
    seconds: dict = field(default_factory=dict)  # method -> seconds
    tokens: dict = field(default_factory=dict)  # method -> new tokens
    identical: bool | None = None
    stats: dict = field(default_factory=dict)
    prefill_seconds: float = 0.0  # the target's prompt prefill in the plain run: a cost every method pays once


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _paired_runs(plain, speculative, rounds: int):
    """Run plain and speculative decoding `rounds` times each, back to back, plain first in even rounds and
    second in odd ones (so neither always meets the machine's state the other left behind).

    Returns (a plain result, the speculative result of the median-time round, median plain seconds,
    median speculative seconds, median target prefill seconds of the plain runs). Greedy and coupled runs
    give the same tokens every round; a sampled run's length may differ, so its median-time round
    speaks for its tokens and stats."""
    plains, specs = [], []
    for r in range(rounds):
        order = [(plain, plains), (speculative, specs)]
        for run, into in order if r % 2 == 0 else order[::-1]:
            into.append(_timed(run))
    specs.sort(key=lambda pair: pair[1])
    spec, _ = specs[(len(specs) - 1) // 2]
    return (plains[0][0], spec, _median([s for _, s in plains]), _median([s for _, s in specs]),
            _median([out.stats.prefill_seconds for out, _ in plains]))


def _speculative_run(target, ids: list[int], spec_options: dict, args):
    """One timed speculative call. A drafter that drafts from earlier calls' outputs (`api.SUFFIX_INDEX_DRAFTERS`)
    starts each run with none, or a prompt's later rounds would draft their answer from its first
    (bench/suffix_repeat.py measures that memory on purpose). Cleared whatever --drafter says, since "auto" may
    resolve to one of them."""
    from verispec.api import generate, suffix_index

    suffix_index(target).clear()
    return generate(target, ids, **spec_options)


def _peer(args):
    """(the peer, the GGUF file it reads) for --peer, else (None, None). The peer runs greedy on the file
    the target was made from, so it needs a GGUF target (a zoo name or a .gguf path)."""
    if not args.peer:
        return None, None
    from verispec.peers import LlamaCpp

    if args.temperature > 0:
        raise SystemExit("--peer llama.cpp is timed greedy only: drop --temperature")
    gguf = Path(args.target)
    if gguf.suffix.lower() != ".gguf":
        if args.target not in zoo.ZOO:
            raise SystemExit(f"--peer llama.cpp needs a GGUF target (a zoo name or a .gguf file), not {args.target}")
        gguf = zoo.gguf_path(args.target)
    return LlamaCpp(args.peer_bin), gguf


def _median_run(runs):
    """The run of median time (the lower middle of an even count), as _paired_runs picks a speculative round."""
    return sorted(runs, key=lambda run: run.seconds)[(len(runs) - 1) // 2]


def _time_peer(peer, gguf, tokenizer, ids: list[int], reference: list[int], m: "Measurement", args) -> None:
    """The peer's median time over `args.rounds` runs of the prompt, and how many leading tokens of its text
    agree with verispec's plain decoding (llama.cpp's own numerics differ in the last bits from every verispec
    mode, so its greedy text may part from verispec's where two tokens are nearly tied)."""
    text = tokenizer.decode(ids, skip_special_tokens=False)
    threads = getattr(args, "threads", None) or torch.get_num_threads()
    run = _median_run([peer.complete(gguf, text, args.max_new_tokens, threads) for _ in range(args.rounds)])
    m.seconds[peer.name], m.tokens[peer.name] = run.seconds, run.new_tokens
    m.stats["peer_prompt_tokens"] = run.prompt_tokens
    m.stats["peer_read_the_same_prompt"] = run.prompt_tokens == len(ids)
    m.stats["peer_prompt_seconds"] = run.prompt_seconds
    theirs = tokenizer.encode(run.text, add_special_tokens=False)
    m.stats["peer_agreeing_tokens"] = next((i for i, (a, b) in enumerate(zip(theirs, reference)) if a != b),
                                           min(len(theirs), len(reference)))
    if args.peer_draft:
        draft = Path(args.peer_draft) if args.peer_draft.endswith(".gguf") else zoo.gguf_path(args.peer_draft)
        run = _median_run([peer.speculative(gguf, draft, text, args.max_new_tokens, threads) for _ in range(args.rounds)])
        m.seconds["llama.cpp speculative"], m.tokens["llama.cpp speculative"] = run.seconds, run.new_tokens
        m.stats["peer_speculative_accepted"] = [run.accepted, run.drafted]


def _hf_generate(model, input_ids, max_new_tokens, eos_ids, pad_id, **extra):
    out = model.generate(torch.tensor([input_ids], device=model.device), attention_mask=torch.ones(1, len(input_ids), dtype=torch.long, device=model.device),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_ids, pad_token_id=pad_id, **extra)
    return out[0, len(input_ids):].tolist()


def run_bench(args) -> dict:
    import verispec
    from verispec.api import resolve_drafter
    from verispec.text import encode_prompt

    if args.quick:
        args.per_category, args.max_new_tokens = 1, 32
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    draft_len = args.draft_len
    peer, peer_gguf = _peer(args)
    prompts = read_prompts(args.prompts, args.per_category)
    if args.categories:
        keep = set(args.categories.split(","))
        prompts = [p for p in prompts if p.category in keep]
        if not prompts:
            raise SystemExit(f"no prompts in categories {sorted(keep)} of {args.prompts}")
    target = verispec.load(args.target, gguf_blocks=True if args.gguf_blocks else None, numerics=args.numerics)
    # The cheap draft variants rewrite transformers modules, so such a draft runs on that backend.
    draft = None
    if args.draft and args.draft != "none":
        draft = verispec.load(args.draft, backend="hf" if args.draft_int8 else "auto",
                              weight_dtype=None if args.draft_int8 else args.draft_dtype)
    hf_draft = (getattr(draft, "hf_model", None) or getattr(draft, "model", None)) if draft is not None else None
    draft = cheap_draft(draft, args)
    hf_target = getattr(target, "hf_model", None) or getattr(target, "model", None)
    # "auto" resolved once, for a run of many calls: a self copy is made now, not inside a timed call.
    args.drafter = resolve_drafter(target, draft, args.drafter)
    eos_ids = sorted(target.eos_token_ids)
    pad_id = eos_ids[0]
    sampled = args.temperature > 0
    print(f"[bench] {len(prompts)} prompts from {args.prompts}, target {args.target}, draft {args.draft}, "
          f"drafter {args.drafter}, draft_len {draft_len}, {args.max_new_tokens} new tokens, temperature {args.temperature}, "
          f"torch threads {torch.get_num_threads()}", file=sys.stderr)

    # Warm up every path once so first-call costs do not land on the first prompt: a prompt long
    # enough for the prefill (big-pass) path, which widens a quantized draft's matrices once.
    warm = encode_prompt(target.tokenizer, "def f(x):\n    return x + 1\n\n" * 8, chat=False)
    verispec.generate(target, warm, drafter="none", max_new_tokens=4)
    verispec.generate(target, warm, draft=draft, drafter=args.drafter, draft_len=draft_len, max_new_tokens=4)
    if args.temperature > 0 and not args.coupled:
        print("[bench] sampling: outputs are not compared token by token (exactness is a distribution "
              "property, tested statistically by the test suite); Hugging Face peers are greedy-only here", file=sys.stderr)

    common = dict(temperature=args.temperature, seed=args.seed, coupled=args.coupled, max_new_tokens=args.max_new_tokens,
                  blockwise=not args.token_verification)
    spec_options = dict(draft=draft, drafter=args.drafter, draft_len=draft_len, draft_confidence=args.draft_confidence,
                        typical_acceptance=args.typical_acceptance, **common)
    results = []
    for i, p in enumerate(prompts):
        ids = encode_prompt(target.tokenizer, p.text, chat=p.chat)
        m = Measurement(p)
        base, spec, m.seconds["plain"], m.seconds["verispec"], m.prefill_seconds = _paired_runs(
            lambda: verispec.generate(target, ids, drafter="none", **common),
            lambda: _speculative_run(target, ids, spec_options, args), args.rounds)
        m.tokens["plain"], m.tokens["verispec"] = len(base.token_ids), len(spec.token_ids)
        # a coupled sample is plain sampling's sample for the seed: comparable token by token like greedy
        m.identical = None if sampled and not args.coupled else base.token_ids == spec.token_ids
        m.stats = spec.stats.to_dict()
        if not args.no_hf and hf_target is not None and not sampled:
            out, m.seconds["hf"] = _timed(lambda: _hf_generate(hf_target, ids, args.max_new_tokens, eos_ids, pad_id))
            m.tokens["hf"] = len(out)
            if hf_draft is not None:
                out, m.seconds["hf_assisted"] = _timed(lambda: _hf_generate(hf_target, ids, args.max_new_tokens, eos_ids, pad_id, assistant_model=hf_draft))
                m.tokens["hf_assisted"] = len(out)
            out, m.seconds["hf_prompt_lookup"] = _timed(lambda: _hf_generate(hf_target, ids, args.max_new_tokens, eos_ids, pad_id, prompt_lookup_num_tokens=10))
            m.tokens["hf_prompt_lookup"] = len(out)
        if peer is not None:
            _time_peer(peer, peer_gguf, target.tokenizer, ids, base.token_ids, m, args)
        results.append(m)
        ratio = _speedups([m], "plain", "verispec")[0]  # tokens/s, as in the tables (sampled runs differ in length)
        extra = "".join(f", {k} {m.seconds[k]:.1f}s" for k in ("hf", "hf_assisted", "hf_prompt_lookup", "llama.cpp", "llama.cpp speculative") if k in m.seconds)
        print(f"[bench] {i + 1}/{len(prompts)} {p.category}/{p.id}: plain {m.tokens['plain']} tokens in {m.seconds['plain']:.1f}s, "
              f"verispec {m.tokens['verispec']} in {m.seconds['verispec']:.1f}s ({ratio:.2f}x tokens/s, "
              f"{m.stats['mean_accepted_tokens']:.2f} tok/pass, identical={m.identical}){extra}", file=sys.stderr)

    verify_cost = measure_verify_curve(target, args)
    report = summarize(results, args, {int(w): r for w, r in verify_cost["ratio"].items()})
    report["target_matrices"] = target_matrices(target)
    report["verify_cost"] = verify_cost
    if args.sweep and draft is not None:
        report["sweep"] = sweep_draft_len(target, results[: args.sweep_prompts], spec_options, report["verify_cost"], args)
    write_reports(report, results, args)
    return report


def _cpu_name() -> str:
    """The CPU's model name and the vector width verispec's kernels use on it ("AMD EPYC, AVX2"; "..., AVX-512 + AMX"
    where a q8 model's wide passes run on AMX tiles, which a peer built without them does not use)."""
    from verispec.models import kernels

    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    vector = {512: "AVX-512", 256: "AVX2"}.get(kernels.isa(), "no C kernels")
    return f"{cpu_label(cpuinfo, platform.processor() or platform.machine())}, {vector}" \
           f"{' + AMX' if kernels.available() and kernels.amx() else ''}"


def cpu_label(cpuinfo: str, fallback: str) -> str:
    """The first processor's model name in /proc/cpuinfo's text, with its CPUID family and model where the name
    alone does not tell generations apart: a cloud VM's "AMD EPYC" is a Zen 3, 4 or 5 (family 25, model 1 or 17;
    family 26), which run the same kernels at up to twice the speed of one another."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or fallback
    family, model = fields.get("cpu family"), fields.get("model")
    if family and model and not any(ch.isdigit() for ch in name):
        name += f" (family {family}, model {model})"
    return name


def measure_verify_curve(target, args) -> dict:
    """cost(width) / cost(1) of the target: the term that decides speculation on a CPU."""
    from verispec.costs import measure_width_costs

    widths = sorted({int(w) for w in args.widths.split(",") if w})
    seconds = measure_width_costs(target, widths, repeats=5)
    ratio = {w: seconds[w] / seconds[1] for w in widths}
    print("[bench] verify cost, target forward of width w relative to width 1 (median of 5): "
          + ", ".join(f"w={w}: {r:.2f}" for w, r in ratio.items()), file=sys.stderr)
    return {"seconds": seconds, "ratio": ratio}


def predicted_curve(acceptance: list[float], cost_ratio: float, verify_ratio: dict, max_k: int) -> dict[int, float]:
    """Speedup(k) = E(k) / (k c + v(k + 1)), with E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j and v the
    measured verify cost relative to one plain step (v = 1 is the GPU textbook case)."""
    curve = {}
    for k in range(1, max_k + 1):
        if k + 1 > max(verify_ratio):
            break
        verify = _verify_ratio(verify_ratio, k + 1)
        expected, survive = 1.0, 1.0
        for a in acceptance[:k]:
            survive *= a
            expected += survive
        curve[k] = expected / (k * cost_ratio + verify)
    return curve


def conditional_acceptance(drafted_at: list[int], accepted_at: list[int]) -> list[float]:
    """a_j = P(position j accepted | position j - 1 accepted), from per-position counters."""
    out = []
    for j, accepted in enumerate(accepted_at):
        reached = drafted_at[0] if j == 0 else accepted_at[j - 1]
        out.append(accepted / reached if reached else 0.0)
    return out


def sweep_draft_len(target, results: list[Measurement], spec_options: dict, verify_cost: dict, args) -> dict:
    """Measured speedup over plain decoding at fixed draft lengths, beside the formula's prediction."""
    import verispec
    from verispec.text import encode_prompt

    ks = [int(k) for k in args.sweep.split(",") if k]
    measured, acceptance_runs, draft_costs = {}, [], []
    # Plain decoding is timed again here, beside the sweep: the machine's speed drifts over a run, and a
    # ratio to a plain run from minutes earlier would measure the drift too.
    prompt_ids = {m.prompt.id: encode_prompt(target.tokenizer, m.prompt.text, chat=m.prompt.chat) for m in results}
    plain, plain_options = {}, {key: spec_options[key] for key in ("temperature", "seed", "coupled", "max_new_tokens", "blockwise")}
    for m in results:
        base, seconds = _timed(lambda: verispec.generate(target, prompt_ids[m.prompt.id], drafter="none", **plain_options))
        plain[m.prompt.id] = (len(base.token_ids), seconds, base.stats.prefill_seconds)
    for k in ks:
        ratios = []
        for m in results:
            spec, seconds = _timed(lambda: verispec.generate(target, prompt_ids[m.prompt.id], **{**spec_options, "draft_len": k}))
            # after the target's prefill, like the formula (which prices decoding steps only)
            tokens, plain_seconds, prefill = plain[m.prompt.id]
            ratios.append((len(spec.token_ids) / (seconds - prefill)) / (tokens / (plain_seconds - prefill)))
            st = spec.stats
            if k == max(ks):
                acceptance_runs.append(conditional_acceptance(st.drafted_at, st.accepted_at))
            if st.drafted_tokens:
                draft_costs.append((st.draft_seconds / st.draft_len_sum) / (plain_seconds / max(tokens, 1)))
        measured[k] = statistics.median(ratios)
        print(f"[bench] sweep draft_len={k}: {measured[k]:.2f}x over plain (median of {len(ratios)})", file=sys.stderr)
    depth = max(len(a) for a in acceptance_runs) if acceptance_runs else 0
    acceptance = [statistics.mean(a[j] for a in acceptance_runs if len(a) > j) for j in range(depth)]
    cost_ratio = statistics.median(draft_costs) if draft_costs else 0.0
    predicted = predicted_curve(acceptance, cost_ratio, {int(w): r for w, r in verify_cost["ratio"].items()}, max(ks))
    return {"measured": measured, "predicted": predicted, "acceptance": acceptance, "draft_cost_ratio": cost_ratio}


def cheap_draft(draft, args):
    """Apply the draft options that trade draft accuracy for draft speed (never output exactness)."""
    from verispec.models.draft_variants import quantize_int8, restrict_vocabulary

    if draft is None:
        return None
    if args.draft_vocab:
        draft = restrict_vocabulary(draft, args.draft_vocab)
    if args.draft_int8:
        draft = quantize_int8(draft)
    return draft


def _median(xs):
    return statistics.median(xs) if xs else None


def _geomean(xs):
    return statistics.geometric_mean(xs) if xs else None


def _speedups(ms: list[Measurement], over: str, of: str) -> list[float]:
    """Per-prompt speedup of method `of` over method `over`, in tokens/s (so different lengths compare fairly)."""
    out = []
    for m in ms:
        if over in m.seconds and of in m.seconds and m.tokens.get(of) and m.tokens.get(over):
            out.append((m.tokens[of] / m.seconds[of]) / (m.tokens[over] / m.seconds[over]))
    return out


def _decode_speedups(ms: list[Measurement]) -> list[float]:
    """Speedup over plain decoding after the prompt: the target's prefill (the same computation in both
    runs) is taken out of both times; the draft's own prefill stays charged to speculation."""
    out = []
    for m in ms:
        plain, spec = m.seconds["plain"] - m.prefill_seconds, m.seconds["verispec"] - m.prefill_seconds
        if plain > 0 and spec > 0 and m.tokens.get("plain") and m.tokens.get("verispec"):
            out.append((m.tokens["verispec"] / spec) / (m.tokens["plain"] / plain))
    return out


def _verify_ratio(verify_ratio: dict[int, float], width: float) -> float:
    """v(width): the measured cost of a target pass of `width` tokens over one of 1, interpolated."""
    widths = sorted(verify_ratio)
    width = min(max(width, widths[0]), widths[-1])
    lo, hi = max(w for w in widths if w <= width), min(w for w in widths if w >= width)
    return verify_ratio[lo] if lo == hi else verify_ratio[lo] + (verify_ratio[hi] - verify_ratio[lo]) * (width - lo) / (hi - lo)


def _predicted(m: Measurement, verify_ratio: dict[int, float]) -> float | None:
    """E / (k c' + v(k + 1)) from the run's own E and k (drafted per step) and the measured v, with c'
    the draft's cost per token relative to a plain step (the run's c is relative to its verify pass)."""
    s = m.stats
    if not s.get("mean_accepted_tokens"):
        return None
    k = s.get("mean_draft_len", 0.0)
    v = _verify_ratio(verify_ratio, 1 + k)
    return s["mean_accepted_tokens"] / (v * (k * s.get("cost_ratio", 0.0) + 1))


def summarize(results: list[Measurement], args, verify_ratio: dict[int, float]) -> dict:
    by_cat = defaultdict(list)
    for m in results:
        by_cat[m.prompt.category].append(m)
    by_cat["overall"] = results
    rows = {}
    for cat, ms in by_cat.items():
        accepted_pos = [m.stats["acceptance_by_position"] for m in ms]
        depth = max((len(a) for a in accepted_pos), default=0)
        rows[cat] = {
            "prompts": len(ms),
            "speedup_vs_plain": _median(_speedups(ms, "plain", "verispec")),
            "speedup_vs_plain_geomean": _geomean(_speedups(ms, "plain", "verispec")),
            "decode_speedup_vs_plain": _median(_decode_speedups(ms)),
            "speedup_vs_hf": _median(_speedups(ms, "hf", "verispec")),
            "plain_vs_hf": _median(_speedups(ms, "hf", "plain")),
            "hf_assisted_vs_hf": _median(_speedups(ms, "hf", "hf_assisted")),
            "hf_prompt_lookup_vs_hf": _median(_speedups(ms, "hf", "hf_prompt_lookup")),
            "verispec_vs_hf_assisted": _median(_speedups(ms, "hf_assisted", "verispec")),
            "verispec_vs_hf_prompt_lookup": _median(_speedups(ms, "hf_prompt_lookup", "verispec")),
            "speedup_vs_llama_cpp": _median(_speedups(ms, "llama.cpp", "verispec")),
            "plain_vs_llama_cpp": _median(_speedups(ms, "llama.cpp", "plain")),
            "llama_cpp_speculative_vs_llama_cpp": _median(_speedups(ms, "llama.cpp", "llama.cpp speculative")),
            "mean_accepted_tokens": statistics.mean(m.stats["mean_accepted_tokens"] for m in ms),
            "acceptance_rate": statistics.mean(m.stats["acceptance_rate"] for m in ms),
            "acceptance_by_position": [statistics.mean(a[i] for a in accepted_pos if len(a) > i) for i in range(depth)],
            # the formula with the measured verify cost, against the measured speedup after prefill
            # (the formula prices decoding steps): their ratio is how well the cost model fits
            "predicted_speedup": _median([p for m in ms if (p := _predicted(m, verify_ratio))]),
            "measured_over_predicted": _median([d / p for m in ms for d in _decode_speedups([m]) if (p := _predicted(m, verify_ratio))]),
            "cost_ratio": statistics.mean(m.stats["cost_ratio"] for m in ms),
            "identical": None if any(m.identical is None for m in ms) else sum(m.identical for m in ms),
        }
    return {
        "settings": {k: v.setting if isinstance(v, DraftLen) else v for k, v in vars(args).items() if k not in ("run",)},
        "machine": {"platform": platform.platform(), "processor": _cpu_name(),
                    "cpus": torch.get_num_threads(), "torch": torch.__version__, "cuda": torch.cuda.is_available()},
        "categories": rows,
        "prompts": [{"category": m.prompt.category, "id": m.prompt.id, "seconds": m.seconds, "tokens": m.tokens,
                     "target_prefill_seconds": round(m.prefill_seconds, 4),
                     "identical": m.identical, "stats": m.stats} for m in results],
    }


def target_matrices(model) -> str:
    """How the target's matrices are stored, for the report: float32, or exact GGUF blocks for how many."""
    from verispec.models import kernels

    if getattr(model, "numerics", "float32") == "q8":
        return "the GGUF's own k-quant blocks with llama.cpp's numerics (numerics=q8)"
    if not getattr(model, "layers", None):
        return "float32 matrices"
    matrices = model.matrices()
    exact = sum(isinstance(m, kernels.ExactBlocks) for m in matrices)
    return f"exact GGUF Q4_K/Q6_K blocks for {exact} of {len(matrices)} matrices" if exact else "float32 matrices"


def _draft_variant(settings: dict) -> str:
    if settings.get("draft") in (None, "none"):
        if settings.get("drafter") == "self":
            return "the target's own int4 copy, drafting on the target's cache"
        return "no draft model"
    kind = "transformers dynamic int8" if settings.get("draft_int8") else f"{settings.get('draft_dtype', 'fp32')} matrices"
    return kind + (f", head restricted to {settings['draft_vocab']} tokens" if settings.get("draft_vocab") else "")


def _fmt(x, suffix="x"):
    return "–" if x is None else f"{x:.2f}{suffix}"


def markdown_table(report: dict) -> str:
    lines = [
        "| category | prompts | speedup vs plain | after prefill | vs HF generate | HF assisted vs HF | HF prompt lookup vs HF | verispec / HF assisted | tokens per pass | acceptance | predicted | measured / predicted | identical |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cat, r in report["categories"].items():
        identical = "–" if r["identical"] is None else f"{r['identical']}/{r['prompts']}"
        lines.append(
            f"| {cat} | {r['prompts']} | {_fmt(r['speedup_vs_plain'])} | {_fmt(r.get('decode_speedup_vs_plain'))} | {_fmt(r['speedup_vs_hf'])} | {_fmt(r['hf_assisted_vs_hf'])} | "
            f"{_fmt(r['hf_prompt_lookup_vs_hf'])} | {_fmt(r['verispec_vs_hf_assisted'])} | {r['mean_accepted_tokens']:.2f} | "
            f"{r['acceptance_rate']:.0%} | {_fmt(r['predicted_speedup'])} | {_fmt(r.get('measured_over_predicted'), '')} | {identical} |"
        )
    return "\n".join(lines)


def write_reports(report: dict, results: list[Measurement], args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or Path(args.prompts).stem + ("_t%g" % args.temperature if args.temperature else "")
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    s = report["settings"]
    runs = s.get("rounds", 1)
    rounds = f"; each prompt's plain and speculative times are medians of {runs} runs in alternating order" if runs > 1 else ""
    lossy = f" (LOSSY typical acceptance, eps {s['typical_acceptance']})" if s.get("typical_acceptance") else ""
    header = (f"verispec bench: `{s['prompts']}`, target `{s['target']}` ({report.get('target_matrices', 'float32 matrices')}), draft `{s['draft']}` ({_draft_variant(s)}), drafter {s['drafter']}, "
              f"draft_len {s['draft_len']}, {s['max_new_tokens']} new tokens, temperature {s['temperature']}"
              f"{' (coupled sampling)' if s.get('coupled') else ''}{' (token-by-token verification)' if s.get('token_verification') else ''}{lossy}, machine: {report['machine']['processor']}, {report['machine']['cpus']} threads, torch {report['machine']['torch']}. "
              "Speedups are medians of per-prompt tokens/s ratios measured in the same run, end to end (prompt prefill "
              f"included){rounds}; 'after prefill' takes the target's prompt prefill, which plain decoding pays too, out of both times.")
    table = markdown_table(report)
    extra = ""
    if "verify_cost" in report:
        ratio = report["verify_cost"]["ratio"]
        extra += ("\n\nTarget forward cost by width, relative to width 1: "
                  + ", ".join(f"{w}: {r:.2f}" for w, r in ratio.items()) + "\n")
    gave_way = [f"{p['category']} {p['id']}" for p in report.get("prompts", []) if p["stats"].get("drafter") == "NgramDrafter"
                and s["drafter"] == "auto" and s["draft"] not in (None, "none")]
    if gave_way:
        extra += (f"\nThe draft model's prompt prefill could not pay for itself on {len(gave_way)} prompt(s), which drafted by "
                  f"prompt lookup instead: {', '.join(gave_way)}.\n")
    if any(r.get("speedup_vs_llama_cpp") for r in report["categories"].values()):
        extra += ("\n| category | verispec vs llama.cpp plain | verispec plain vs llama.cpp plain | llama.cpp speculative vs llama.cpp plain | leading tokens equal to llama.cpp's |\n"
                  "| --- | --- | --- | --- | --- |\n")
        for cat, r in report["categories"].items():
            agree = [p["stats"].get("peer_agreeing_tokens") for p in report["prompts"] if cat in ("overall", p["category"])]
            extra += (f"| {cat} | {_fmt(r.get('speedup_vs_llama_cpp'))} | {_fmt(r.get('plain_vs_llama_cpp'))} | "
                      f"{_fmt(r.get('llama_cpp_speculative_vs_llama_cpp'))} | "
                      f"median {_median([a for a in agree if a is not None])} |\n")
    if report.get("sweep", {}).get("measured"):
        sw = report["sweep"]
        extra += "\n| draft length k | measured speedup (after prefill) | predicted E/(k·c + v(k+1)) |\n| --- | --- | --- |\n"
        extra += "\n".join(f"| {k} | {v:.2f}x | {_fmt(sw['predicted'].get(k))} |" for k, v in sw["measured"].items()) + "\n"
    (out / f"{stem}.md").write_text(header + "\n\n" + table + "\n" + extra)
    print(table)
    try:
        plot(report, out / f"{stem}.png")
    except ImportError:
        print("[bench] no plot: matplotlib is not installed (pip install 'verispec[plot]')", file=sys.stderr)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = [c for c in report["categories"]]
    has_verify, has_sweep = "verify_cost" in report, bool(report.get("sweep", {}).get("measured"))
    panels = 2 + has_verify + has_sweep  # no empty panels for what the run did not measure
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.5))
    ax1, ax2, *rest = axes
    ax3 = rest.pop(0) if has_verify else None
    ax4 = rest.pop(0) if has_sweep else None
    names = [("speedup_vs_plain", "verispec vs plain"), ("decode_speedup_vs_plain", "verispec vs plain, after prefill"),
             ("speedup_vs_hf", "verispec vs HF generate"), ("hf_assisted_vs_hf", "HF assisted vs HF"),
             ("hf_prompt_lookup_vs_hf", "HF prompt lookup vs HF")]
    names = [(key, label) for key, label in names if any(report["categories"][c].get(key) for c in cats)]  # what ran
    width = 0.8 / len(names)
    for j, (key, label) in enumerate(names):
        ys = [report["categories"][c].get(key) or 0 for c in cats]
        ax1.bar([i + j * width for i in range(len(cats))], ys, width, label=label)
    ax1.axhline(1.0, color="k", lw=0.8)
    ax1.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=45, ha="right")
    ax1.set_ylabel("speedup (median over prompts)")
    ax1.legend(fontsize=8)
    ax1.set_title("Speedup by category")
    for c in cats:
        acc = report["categories"][c]["acceptance_by_position"]
        ax2.plot(range(1, len(acc) + 1), acc, marker="o", label=c)
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("acceptance rate")
    ax2.set_ylim(0, 1)
    ax2.set_title("Acceptance by draft position")
    ax2.legend(fontsize=7)
    if has_verify:
        ratio = report["verify_cost"]["ratio"]
        ws = sorted(int(w) for w in ratio)
        ax3.plot(ws, [ratio[w] if w in ratio else ratio[str(w)] for w in ws], marker="o", label="measured")
        ax3.plot(ws, [1.0] * len(ws), "k--", lw=0.8, label="ideal (memory-bound)")
        ax3.set_xlabel("target forward width (tokens)")
        ax3.set_ylabel("cost / cost(width 1)")
        ax3.set_title("Verify cost by width")
        ax3.legend(fontsize=8)
    if has_sweep:
        # keys are ints in a fresh report, strings in one read back from its JSON
        measured = {int(k): v for k, v in report["sweep"]["measured"].items()}
        predicted = {int(k): v for k, v in report["sweep"]["predicted"].items()}
        ax4.plot(sorted(measured), [measured[k] for k in sorted(measured)], "o", label="measured")
        ax4.plot(sorted(predicted), [predicted[k] for k in sorted(predicted)], "-", label="E/(k·c + v(k+1))")
        ax4.axhline(1.0, color="k", lw=0.8)
        ax4.set_xlabel("draft length k")
        ax4.set_ylabel("speedup over plain (after prefill)")
        ax4.set_title("Speedup vs draft length")
        ax4.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
