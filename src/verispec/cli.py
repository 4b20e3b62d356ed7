"""The `verispec` command: pull, generate, bench, demo, certify, serve. A thin layer over the Python API."""

from __future__ import annotations

import argparse
import json
import sys

from verispec.errors import VerispecError

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"


def draft_len_arg(value: str) -> int | str:
    """--draft-len as typed (for `verispec generate`, `bench` and `serve`): an int, "auto" or "tree"."""
    from verispec.policy import ADAPTIVE_SETTINGS

    if value in ADAPTIVE_SETTINGS:
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, {' or '.join(map(repr, ADAPTIVE_SETTINGS))}, got {value!r}") from None


def _add_generation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help="zoo name, local directory, .gguf file or hub id (default: %(default)s)")
    p.add_argument("--draft", default=None, help="draft model (same tokenizer as the target); omit to draft with the target's own int4 copy where it can have one (see --drafter), else n-gram")
    p.add_argument("--drafter", default="auto", help="auto (the draft model when one is given; else self for a native float32 target on verispec's CPU kernels and at least 32 new tokens or a copy made before; else ngram) | model | self (the target's own int4 copy, drafting on its cache) | hybrid (prompt lookup, else the draft model) | ngram | suffix (suffix decoding: the prompt and earlier outputs of this process) | none (plain decoding)")
    p.add_argument("--draft-len", type=draft_len_arg, default=None,
                   help="draft tokens per step, 'auto' (the default: adaptive), or 'tree' (auto plus token-tree alternates)")
    p.add_argument("--draft-dtype", default="fp32", help="the draft's matrices on the native backend: fp32, bf16, int8 or int4 (cheaper drafts; output unchanged)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--coupled", action="store_true",
                   help="sample by the Gumbel-max coupling: a seed gives the same text with or without a draft")
    p.add_argument("--token-verification", action="store_true",
                   help="verify sampled drafts token by token instead of as blocks (the default; both exact)")
    p.add_argument("--typical-acceptance", type=float, default=0.0, metavar="EPS",
                   help="LOSSY, sampling only: keep draft tokens the target finds typical (Medusa's rule, e.g. 0.09) "
                        "instead of exact speculative sampling")
    p.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16")
    p.add_argument("--gguf-blocks", action="store_true",
                   help="the target keeps its GGUF's Q4_K/Q6_K blocks, rebuilt exactly (same output; plain decoding ~2x faster)")


def cmd_pull(args) -> int:
    from verispec import zoo

    for name in args.names:
        path = zoo.pull(name)
        print(f"{name}: {path}")
    return 0


def cmd_generate(args) -> int:
    import verispec

    target = verispec.load(args.target, dtype=args.dtype, gguf_blocks=True if args.gguf_blocks else None)
    draft = verispec.load(args.draft, dtype=args.dtype, weight_dtype=args.draft_dtype) if args.draft else None
    options = dict(draft=draft, drafter=args.drafter, draft_len=args.draft_len, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, coupled=args.coupled,
                   blockwise=not args.token_verification, typical_acceptance=args.typical_acceptance,
                   max_new_tokens=args.max_new_tokens,
                   chat=args.chat, stop=args.stop or None)
    if args.json:
        result = verispec.generate(target, args.prompt, **options)
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                          "stats": result.stats.to_dict()}))
        return 0
    stats = None
    for chunk in verispec.stream(target, args.prompt, **options):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        stats = chunk.stats
    print()
    if stats is not None:
        print(f"[verispec] {stats.summary()}", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from verispec.bench import run_bench

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
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pull", help="download, verify and convert zoo models")
    p.add_argument("names", nargs="+", help="zoo names: smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b")
    p.set_defaults(run=cmd_pull)

    p = sub.add_parser("generate", help="generate text from a prompt")
    p.add_argument("prompt")
    _add_generation_options(p)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--stop", action="append", help="stop sequence (repeatable)")
    p.add_argument("--json", action="store_true", help='print {"text", "token_ids", "finish_reason", "stats"}')
    p.set_defaults(run=cmd_generate)

    p = sub.add_parser("bench", help="speedup over plain decoding and Hugging Face, per category")
    from verispec.bench import add_bench_arguments

    add_bench_arguments(p)
    p.set_defaults(run=cmd_bench)

    p = sub.add_parser("demo", help="plain vs speculative on the default pair: same text, faster")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--draft-dtype", default="int4", help="the draft's matrices: fp32, bf16, int8 or int4 (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--prompt", default=None)
    p.set_defaults(run=cmd_demo)

    p = sub.add_parser("certify", help="check that speculation gives the target's own output: greedy identity and "
                                       "a chi-square test of sampling, per lossless mode; exit 1 if any check fails")
    p.add_argument("target", help="zoo name, local directory, .gguf file or hub id")
    p.add_argument("--draft", default=None, help="draft model (same tokenizer as the target)")
    p.add_argument("--drafter", default="auto", help="as for generate: auto | model | self | hybrid | ngram | suffix")
    p.add_argument("--draft-len", type=draft_len_arg, action="append",
                   help="draft length to certify, repeatable: an int, 'auto' or 'tree' (default: 4)")
    p.add_argument("--mode", action="append", choices=["speculative_sampling", "block", "coupled", "typical"],
                   help="sampling rule to test, repeatable (default: the three lossless ones; typical is lossy and should fail)")
    p.add_argument("--prompts", type=int, default=4, help="bundled prompts for greedy identity (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--samples", type=int, default=2000, help="seeded samples per sampling mode (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=4, help="keeps the enumerated support small (default: %(default)s)")
    p.add_argument("--p-threshold", type=float, default=1e-3, help="a mode passes when its p-value exceeds this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="save the report as JSON here")
    p.set_defaults(run=cmd_certify)

    sub.add_parser("serve", help="OpenAI-compatible server (verispec serve --help)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        from verispec import server

        server.main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except VerispecError as exc:
        print(f"verispec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
