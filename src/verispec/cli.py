"""The `verispec` command: pull, list, rm, generate, chat, bench, demo, certify, serve. A thin layer over the Python API.

Every flag is checked (`options`, `SamplingParams`) before a model loads, so a typo fails at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys

import verispec
from verispec import options, zoo
from verispec.errors import VerispecError
from verispec.options import DRAFTER_NAMES, WEIGHT_DTYPES, DraftLen, flag
from verispec.sampling import Cascade

# Escape sequences a flag's text may carry, as in C and llama.cpp (`--stop '\n'` stops at a newline).
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\", "'": "'", '"': '"'}


def unescape(text: str) -> str:
    r"""`text` with \n, \t, \r, \0, \\, \', \" and \xHH replaced by the characters they stand for;
    any other backslash is kept as it is."""
    def one(match: re.Match) -> str:
        code = match.group(1)
        return chr(int(code[1:], 16)) if code[0] == "x" else _ESCAPES.get(code, match.group(0))

    return re.sub(r"\\(x[0-9a-fA-F]{2}|.)", one, text, flags=re.DOTALL)


def _add_generation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=zoo.DEFAULT_TARGET, help="zoo name, local directory, .gguf file or hub id (default: %(default)s)")
    p.add_argument("--draft", default=None, help="draft model (any tokenizer: with another vocabulary than the target's it drafts through text, drafter cross_tokenizer); omit to draft with the target's own int4 copy where it can have one (see --drafter), else n-gram")
    p.add_argument("--drafter", default="auto", choices=DRAFTER_NAMES, help="auto (the draft model when one is given; else self for a native float32 target on verispec's CPU kernels and at least 32 new tokens or a copy made before, never for a q8 target; else ngram) | model | cross_tokenizer (a draft model with another tokenizer, through text; what auto and model pick for one) | self (the target's own int4 copy, drafting on its cache) | hybrid (prompt lookup, else the draft model) | staged (the draft model, or the int4 copy, itself sped up by suffix proposals) | ngram | suffix (suffix decoding: the prompt and earlier outputs of this process) | rest (suffix, and a datastore of the installed packages' Python sources where those match less: REST) | eagle3, medusa, mtp (a trained head given with --draft DIR; auto picks it) | head+suffix (suffix lookup where it is expected to do as well as the head given with --draft DIR, else the head) | none (plain decoding)")
    p.add_argument("--draft-len", type=flag(DraftLen.parse), default=DraftLen("auto"),
                   help="draft tokens per step, 'auto' (the default: adaptive), or 'tree' (auto plus token-tree alternates)")
    p.add_argument("--draft-dtype", default=None, choices=WEIGHT_DTYPES,
                   help="the draft's matrices on the native backend (cheaper drafts; output unchanged; default: q3_0 with "
                        "--numerics q8, else fp32)")
    p.add_argument("--draft-vocab", type=flag(options.draft_vocab), default="auto",
                   help="token ids the draft model's LM head scores: auto (the first 32768, the special tokens and the "
                        "text's own, beside a q8 target with a vocabulary of 64k or more), all, or N (the first N and the rest as auto)")
    p.add_argument("--max-new-tokens", type=flag(options.max_new_tokens), default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--coupled", action=argparse.BooleanOptionalAction, default=None,
                   help="sample by the Gumbel-max coupling: a seed gives the same text with or without a draft "
                        "(default: on when --seed is given and sampling is exact; --no-coupled keeps speculative sampling)")
    p.add_argument("--token-verification", action="store_true",
                   help="verify sampled drafts token by token instead of as blocks (the default; both exact)")
    p.add_argument("--typical-acceptance", type=float, default=0.0, metavar="EPS",
                   help="LOSSY, sampling only: keep draft tokens the target finds typical (Medusa's rule, e.g. 0.09) "
                        "instead of exact speculative sampling")
    p.add_argument("--cascade", type=flag(Cascade.parse), default=None, metavar="RULE:ALPHA",
                   help="LOSSY, greedy too: a speculative cascade; where the deferral rule finds the draft model good "
                        "enough, its token stands unchecked (chow:A trusts it where its top probability > 1 - A, diff:A "
                        "where > the target's - A; e.g. chow:0.1; chow:0 is exact)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="the models' dtype (default: float32)")
    p.add_argument("--gguf-blocks", action="store_true",
                   help="the target keeps its GGUF's Q4_K/Q6_K blocks, rebuilt exactly (same output; plain decoding ~2x faster)")
    p.add_argument("--numerics", choices=("float32", "q8"), default="float32",
                   help="the target's numbers: float32 (the model a GGUF stands for) or q8 (llama.cpp's: the GGUF's own "
                        "quantized blocks (Q4_K/Q5_K/Q6_K, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0) times 8-bit activations, memory-mapped; "
                        "speculation exact w.r.t. it)")
    p.add_argument("--system", default=None, help="a system prompt (with --chat, and in `verispec chat`)")
    _add_run_options(p)


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=flag(lambda text: options.positive_int("--threads", text)), default=None,
                   help="CPU threads for PyTorch and verispec's kernels (default: PyTorch's choice)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines or statistics on stderr: only the text")


def _generation_options(args, chat: bool) -> dict:
    """The keyword arguments of `verispec.generate` the flags ask for, checked now (before any model loads)."""
    from verispec.sampling import SamplingParams, default_coupled

    if args.system is not None and not chat:
        raise VerispecError("--system is a system prompt for the chat template: add --chat, or drop --system")
    if args.draft is None and args.draft_dtype is not None:
        raise VerispecError("--draft-dtype applies to a draft model: give one with --draft, or drop --draft-dtype")
    if args.draft is None and args.draft_vocab != "auto":
        raise VerispecError("--draft-vocab applies to a draft model: give one with --draft, or drop --draft-vocab")
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                              coupled=(default_coupled(args.seed, args.temperature, args.typical_acceptance, args.cascade)
                                       if args.coupled is None else args.coupled), blockwise=not args.token_verification,
                              typical_acceptance=args.typical_acceptance, cascade=args.cascade)
    return dict(drafter=args.drafter, draft_len=args.draft_len, temperature=sampling.temperature, top_k=sampling.top_k,
                top_p=sampling.top_p, seed=sampling.seed, coupled=sampling.coupled, blockwise=sampling.blockwise,
                typical_acceptance=sampling.typical_acceptance, cascade=sampling.cascade, max_new_tokens=args.max_new_tokens)


def _load_models(args):
    """(target, draft model or None), as the flags name them."""
    target = verispec.load(args.target, dtype=args.dtype, gguf_blocks=True if args.gguf_blocks else None,
                           numerics=args.numerics)
    draft = verispec.api.load_draft(args.draft, target, args.draft_dtype, vocab=args.draft_vocab, dtype=args.dtype) if args.draft else None
    return target, draft


def _read_prompt(prompt: str) -> str:
    """The prompt as given, or all of stdin for "-"."""
    return sys.stdin.read() if prompt == "-" else prompt


def peak_memory_bytes() -> int:
    """The most memory this process has held: resident set size on the CPU, plus what CUDA allocated."""
    import resource

    import torch

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, kilobytes on Linux
    return rss + (torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0)


def _report(stats, quiet: bool) -> None:
    if stats is not None and not quiet:
        print(f"[verispec] {stats.summary()}, peak memory {peak_memory_bytes() / 1e9:.2f} GB", file=sys.stderr)


def cmd_pull(args) -> int:
    for name in args.names:
        path = zoo.pull(name)
        print(f"{name}: {path}")
    return 0


def cmd_list(args) -> int:
    rows = [("NAME", "SIZE", "CACHED", "DESCRIPTION")]
    for name, entry in zoo.ZOO.items():
        on_disk = zoo.disk_bytes(name)
        cached = f"yes, {on_disk / 1e6:,.0f} MB" if zoo.is_pulled(name) else (f"partly, {on_disk / 1e6:,.0f} MB" if on_disk else "no")
        rows.append((name, f"{entry.size / 1e6:,.0f} MB", cached, entry.description))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3])
    return 0


def cmd_rm(args) -> int:
    for name in args.names:
        freed = zoo.remove(name)
        print(f"removed {name} ({freed / 1e6:,.0f} MB)")
    return 0


def cmd_generate(args) -> int:
    settings = _generation_options(args, chat=args.chat)
    stop = [unescape(s) for s in args.stop] if args.stop else None
    prompt = _read_prompt(args.prompt)
    target, draft = _load_models(args)
    settings.update(draft=draft, chat=args.chat, system=args.system, stop=stop)
    if args.json:
        result = verispec.generate(target, prompt, **settings)
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                          "stats": result.stats.to_dict()}))
        return 0
    stats = None
    for chunk in verispec.stream(target, prompt, **settings):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        stats = chunk.stats
    print()
    _report(stats, args.quiet)
    return 0


def cmd_chat(args) -> int:
    """A conversation on the chat template: each turn sees the whole history. /exit or end of input leaves,
    /clear forgets the conversation."""
    from verispec.text import encode_chat

    settings = _generation_options(args, chat=True)
    target, draft = _load_models(args)
    settings.update(draft=draft)
    if target.tokenizer is None or not target.tokenizer.chat_template:
        raise VerispecError(f"{target.name} has no chat template: use `verispec generate` instead")
    opening = [{"role": "system", "content": args.system}] if args.system is not None else []
    messages = list(opening)
    if not args.quiet:
        print(f"[verispec] chatting with {target.name}: /exit or Ctrl-D to leave, /clear to start over", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        text = line.strip()
        if text in ("/exit", "/quit"):
            return 0
        if text == "/clear":
            messages = list(opening)
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": line})
        reply, stats = [], None
        try:
            for chunk in verispec.stream(target, encode_chat(target.tokenizer, messages), **settings):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                reply.append(chunk.text)
                stats = chunk.stats
        except VerispecError as exc:  # e.g. the conversation outgrew the context: this turn is dropped
            messages.pop()
            print(f"verispec: error: {exc}", file=sys.stderr)
            continue
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
        _report(stats, args.quiet)


def cmd_bench(args) -> int:
    from verispec.bench import run_bench
    from verispec.race import run_race

    if args.method:  # drafters side by side
        run_race(args)
    else:
        run_bench(args)
    return 0


def cmd_demo(args) -> int:
    from verispec.demo import run_demo

    run_demo(args)
    return 0


def cmd_certify(args) -> int:
    from verispec.certify import LOSSLESS_MODES, certify, save

    certificate = certify(args.target, draft=args.draft, drafter=args.drafter, draft_lens=tuple(args.draft_len or [4]),
                          modes=tuple(args.mode or LOSSLESS_MODES), prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                          samples=args.samples, temperature=args.temperature, top_k=args.top_k,
                          p_threshold=args.p_threshold, seed=args.seed)
    print(certificate.report())
    if args.out:
        save(certificate, args.out)
        print(f"[verispec] report saved to {args.out}", file=sys.stderr)
    return 0 if certificate.passed else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verispec", description="Lossless speculative decoding: faster generation, the same output.")
    parser.add_argument("--version", action="version", version=f"verispec {verispec.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pull", help="download, verify and convert zoo models")
    p.add_argument("names", nargs="+", choices=list(zoo.ZOO), metavar="NAME", help=f"zoo names: {', '.join(zoo.ZOO)}")
    p.set_defaults(run=cmd_pull)

    p = sub.add_parser("list", help="the zoo's models: size, and whether they are in the cache")
    p.set_defaults(run=cmd_list)

    p = sub.add_parser("rm", help="delete zoo models from the cache")
    p.add_argument("names", nargs="+", choices=list(zoo.ZOO), metavar="NAME", help=f"zoo names: {', '.join(zoo.ZOO)}")
    p.set_defaults(run=cmd_rm)

    p = sub.add_parser("generate", help="generate text from a prompt")
    p.add_argument("prompt", help="the prompt; - reads it from stdin")
    _add_generation_options(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--stop", action="append", help=r"stop sequence (repeatable; escapes such as \n are understood)")
    p.add_argument("--json", action="store_true", help='print {"text", "token_ids", "finish_reason", "stats"}')
    p.set_defaults(run=cmd_generate)

    p = sub.add_parser("chat", help="talk with a model on its chat template (history kept; /exit or Ctrl-D ends)")
    _add_generation_options(p)
    p.set_defaults(run=cmd_chat)

    p = sub.add_parser("bench", help="speedup over plain decoding and Hugging Face, per category")
    from verispec.bench import add_bench_arguments

    add_bench_arguments(p)
    _add_run_options(p)
    p.set_defaults(run=cmd_bench)

    p = sub.add_parser("demo", help="plain vs speculative on the default pair: same text, faster")
    p.add_argument("--target", default=zoo.DEFAULT_TARGET)
    p.add_argument("--draft", default=zoo.DEFAULT_DRAFT)
    p.add_argument("--draft-dtype", default="int4", choices=WEIGHT_DTYPES, help="the draft's matrices (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=flag(options.max_new_tokens), default=96)
    p.add_argument("--prompt", default=None)
    _add_run_options(p)
    p.set_defaults(run=cmd_demo)

    p = sub.add_parser("train", help="train a draft head for a target (verispec train eagle3 --help, verispec train medusa --help, "
                                     "verispec train mtp --help)")
    heads = p.add_subparsers(dest="head", required=True)
    p = heads.add_parser("eagle3", help="an EAGLE-3 head: reads three of the target's hidden states, drafts chains (and token-tree alternates)")
    from verispec.heads.train import add_train_arguments, run_train

    add_train_arguments(p)
    _add_run_options(p)
    p.set_defaults(run=run_train)
    p = heads.add_parser("medusa", help="Medusa-1 heads: read the target's last hidden state, guess the next K tokens at once")
    from verispec.heads.train_medusa import add_medusa_arguments, run_train_medusa

    add_medusa_arguments(p)
    _add_run_options(p)
    p.set_defaults(run=run_train_medusa)
    p = heads.add_parser("mtp", help="a DeepSeek-V3-style MTP module: reads the target's last hidden state and the next "
                                     "token, one decoder block, drafts chains (and token-tree alternates)")
    from verispec.heads.train_mtp import add_mtp_arguments, run_train_mtp

    add_mtp_arguments(p)
    _add_run_options(p)
    p.set_defaults(run=run_train_mtp)

    p = sub.add_parser("export", help="write a trained head for vLLM (speculators) or SGLang (specforge)")
    from verispec.heads.formats import add_export_arguments, run_export

    add_export_arguments(p)
    p.set_defaults(run=run_export)

    p = sub.add_parser("certify", help="check that speculation gives the target's own output: greedy identity and "
                                       "a chi-square test of sampling, per lossless mode; exit 1 if any check fails")
    p.add_argument("target", help="zoo name, local directory, .gguf file or hub id")
    p.add_argument("--draft", default=None, help="draft model (any tokenizer: another vocabulary drafts through text)")
    p.add_argument("--drafter", default="auto", choices=DRAFTER_NAMES, help="as for generate")
    p.add_argument("--draft-len", type=flag(DraftLen.parse), action="append",
                   help="draft length to certify, repeatable: an int, 'auto' or 'tree' (default: 4)")
    p.add_argument("--mode", action="append", choices=["speculative_sampling", "block", "coupled", "typical", "cascade"],
                   help="sampling rule to test, repeatable (default: the three lossless ones; typical and cascade are lossy "
                        "and should fail)")
    p.add_argument("--prompts", type=int, default=4, help="bundled prompts for greedy identity (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--samples", type=int, default=2000, help="seeded samples per sampling mode (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=4, help="keeps the enumerated support small (default: %(default)s)")
    p.add_argument("--p-threshold", type=float, default=1e-3, help="a mode passes when its p-value exceeds this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="save the report as JSON here")
    _add_run_options(p)
    p.set_defaults(run=cmd_certify)

    sub.add_parser("serve", help="OpenAI-compatible server (verispec serve --help)", add_help=False)
    return parser


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record comes (tests and tools replace it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


# Progress lines of the library's own loggers (e.g. an int4 self copy being made) go to stderr.
_LOG_HANDLER = _StderrHandler()
_LOG_HANDLER.setFormatter(logging.Formatter("verispec: %(message)s"))


def _set_up(args) -> None:
    """What every command shares: threads, and progress lines unless --quiet."""
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)  # the C kernels run on torch.get_num_threads() threads too
    logger = logging.getLogger("verispec")
    if _LOG_HANDLER not in logger.handlers:
        logger.addHandler(_LOG_HANDLER)
    logger.setLevel(logging.WARNING if args.quiet else logging.INFO)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        from verispec import server

        server.main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    try:
        if "threads" in args:
            _set_up(args)
        return args.run(args)
    except VerispecError as exc:
        print(f"verispec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
