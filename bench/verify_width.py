"""What a target forward of width w costs relative to width 1: the c(w) behind speculative speedup.

Speculative decoding pays off only if verifying k+1 tokens in one pass costs about one decode step.
This script measures, for each backend over the same weights (transformers `HFCausalLM`;
`NativeCausalLM` with its row-exact small-batch kernels; the same with bfloat16 matrices, a draft
option), the median seconds of a forward of width w on a warm cache of ~200 tokens, the ratio
cost(w)/cost(1), and the tokens/s of plain decoding. `--compare-threads` times thread counts
instead, `--kernels` the candidate small-M linear kernels on the model's shapes.

Timings on a shared machine are noisy: every measurement interleaves backends, widths and thread
counts round-robin and reports medians, so ratios within one run are fair even when absolute
numbers drift. `--threads 1 --cpu-clock` counts CPU time instead of wall time: immune to other
processes taking the core (not to their memory traffic).

    python bench/verify_width.py --model qwen2.5-coder-1.5b [--backend hf,native,native-bf16]
                                 [--widths 1,2,4,5,6,8,16] [--repeats 5] [--threads 2]
    python bench/verify_width.py --model qwen2.5-coder-1.5b --compare-threads 1,2 --widths 1,5
    python bench/verify_width.py --model qwen2.5-coder-1.5b --kernels [--rows 1,2,4,5,6,8,9,16]

The measuring functions (`measure_width_costs`, `measure_thread_counts`,
`plain_decode_tokens_per_second`, `measure_linear_kernels`) are importable for the benchmark
harness. This file knows nothing about drafters or acceptance rates: it measures the target alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

# libgomp's default busy-waiting makes PyTorch's own kernels (the HF baseline) collapse, 8x slower,
# when another process holds one of the 2 cores; passive waiting keeps the baseline honest. Only
# effective if torch is not imported yet; set OMP_WAIT_POLICY yourself to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import verispec  # noqa: E402
from verispec.costs import (  # noqa: E402  the shared measurements; re-exported for callers of this script
    CODE, context_tokens, measure_width_costs, measure_width_costs_interleaved,
)


def plain_decode_tokens_per_second(model, new_tokens: int = 32, context: int = 200) -> float:
    """Tokens/s of plain greedy decoding (the engine with drafter='none'), prefill excluded."""
    result = verispec.generate(model, context_tokens(model, context), drafter="none", max_new_tokens=new_tokens)
    stats = result.stats
    return len(result.token_ids) / max(stats.total_seconds - stats.prefill_seconds, 1e-9)


@torch.inference_mode()
def measure_thread_counts(model, thread_counts: list[int], widths: list[int], repeats: int = 5,
                          context: int = 200) -> dict[tuple[int, int], float]:
    """Median seconds of a width-w forward at each `torch.set_num_threads` count, switched pass by pass
    (so both counts meet the same machine load). Returns {(threads, width): seconds}."""
    saved = torch.get_num_threads()
    ids = context_tokens(model, context + max(widths))
    cache = model.new_cache(1)
    model.forward(torch.tensor([ids[:context]]), cache, last_only=True)
    tail = torch.tensor([ids[context:]])
    times: dict[tuple[int, int], list[float]] = {(n, w): [] for n in thread_counts for w in widths}
    try:
        for repeat in range(repeats + 1):
            for w in widths:
                for n in thread_counts:
                    torch.set_num_threads(n)
                    started = time.perf_counter()
                    model.forward(tail[:, :w], cache)
                    if repeat:
                        times[(n, w)].append(time.perf_counter() - started)
                    cache.truncate(torch.tensor([context]))
    finally:
        torch.set_num_threads(saved)
    return {key: statistics.median(t) for key, t in times.items()}


# --- candidate small-M linear kernels ------------------------------------------------------------

def qwen_shapes(config) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of every distinct linear layer of a Llama/Qwen2 config."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    inter, vocab = config.intermediate_size, config.vocab_size
    return {f"q/o {hidden}->{heads * head_dim}": (heads * head_dim, hidden), f"k/v {hidden}->{kv}": (kv, hidden),
            f"gate/up {hidden}->{inter}": (inter, hidden), f"down {inter}->{hidden}": (hidden, inter),
            f"lm_head {hidden}->{vocab}": (vocab, hidden)}


def _candidates(weight: torch.Tensor, rows: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """name -> f(x [rows, in]) -> [rows, out], each over `weight` [out, in] (prepacked where the kernel wants it)."""
    import numpy as np

    from verispec.models import kernels

    found: dict[str, Callable] = {"aten F.linear (MKL)": lambda x: torch.nn.functional.linear(x, weight)}
    try:
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, weight.shape[1]), weight, None, "none", [], "")
        found["oneDNN plain weight"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        found["oneDNN packed weight"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        pass
    try:
        mkl_packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        found["MKL packed (cblas_sgemm_compute)"] = lambda x: torch.ops.mkl._mkl_linear(x, mkl_packed, weight, None, rows)
    except (RuntimeError, AttributeError):
        pass
    weight_np = weight.numpy()  # zero copy: the same memory
    found["numpy/OpenBLAS x@W.T"] = lambda x: torch.from_numpy(np.matmul(x.numpy(), weight_np.T))
    if kernels.available():
        found[f"verispec rowwise (AVX-{kernels.isa()})"] = lambda x: kernels.rowwise_linear(x, weight)
    # Not a candidate for the target (bf16 weights change its logits), but half the bytes: a draft option.
    weight_bf16 = weight.bfloat16()
    found["bf16 weights, oneDNN (inexact)"] = lambda x: torch.nn.functional.linear(x.bfloat16(), weight_bf16).float()
    return found


def _inductor_linear(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """torch.compile(mode default, freezing on) of one Linear: inductor prepacks the frozen weight."""
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    inductor_config.max_autotune = False
    module = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    module.weight = torch.nn.Parameter(weight, requires_grad=False)
    module.eval()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)  # one graph per M
    return torch.compile(module, dynamic=False)


@torch.inference_mode()
def measure_linear_kernels(shapes: dict[str, tuple[int, int]], rows: list[int], repeats: int = 15,
                           inductor: bool = True, evict_bytes: int = 256 << 20,
                           clock: Callable[[], float] = time.perf_counter) -> list[dict]:
    """Median ms of each candidate kernel per (shape, rows), and whether its rows are independent.

    Before every timed call a `evict_bytes` buffer is read, so the weight comes from DRAM as in a
    real forward pass (a 1.5B model is 60x the last-level cache), not from L3. "row_exact" compares
    each row of an M-row product bitwise with the same row computed alone (M=1). With
    clock=time.thread_time (1 thread) numpy is left out: OpenBLAS runs on threads of its own.
    Returns one dict per (shape, rows, kernel).
    """
    results = []
    torch.manual_seed(0)
    sweep = torch.ones(evict_bytes // 4)
    for shape_name, (out_features, in_features) in shapes.items():
        weight = torch.randn(out_features, in_features) * 0.02
        compiled = _inductor_linear(weight) if inductor else None
        for m in rows:
            x = torch.randn(m, in_features)
            candidates = _candidates(weight, m)
            if clock is not time.perf_counter:
                candidates = {name: f for name, f in candidates.items() if not name.startswith("numpy")}
            if compiled is not None:
                try:
                    compiled(x)
                    candidates["inductor freezing"] = compiled
                except Exception as exc:  # noqa: BLE001 - a missing compiler must not stop the table
                    print(f"  inductor unavailable: {exc.__class__.__name__}: {str(exc)[:120]}", file=sys.stderr)
                    compiled = None
            times = {name: [] for name in candidates}
            for f in candidates.values():
                f(x)
            time.sleep(0.3)
            # OpenBLAS's own threads busy-wait for a while after each call and would slow whatever
            # runs next: numpy gets its repeats after all the others, then a pause to go idle.
            interleaved = [name for name in candidates if not name.startswith("numpy")]
            for name in [*(n for _ in range(repeats) for n in interleaved),
                         *(n for n in candidates if n not in interleaved for _ in range(repeats))]:
                sweep.sum()
                started = clock()
                candidates[name](x)
                times[name].append(clock() - started)
            time.sleep(0.3)
            for name, f in candidates.items():
                together = f(x)
                alone = torch.cat([f(x[i : i + 1].clone()) for i in range(m)])  # what a width-1 step runs
                results.append({"shape": shape_name, "rows": m, "kernel": name,
                                "ms": 1e3 * statistics.median(times[name]),
                                "row_exact": bool(torch.equal(together, alone)),
                                "row_max_diff": float((together - alone).abs().max())})
            print("  ".join(f"{r['kernel']}={r['ms']:.2f}" for r in results[-len(candidates):]), f"<- {shape_name} M={m}",
                  file=sys.stderr, flush=True)
    return results


def print_kernel_table(results: list[dict]) -> None:
    kernels_seen = list(dict.fromkeys(r["kernel"] for r in results))
    for shape in dict.fromkeys(r["shape"] for r in results):
        print(f"\n{shape}: median ms per product (* = rows bitwise equal to computing each alone)")
        print(f"{'kernel':34s}" + "".join(f"{'M=' + str(m):>10s}" for m in dict.fromkeys(r["rows"] for r in results)))
        for kernel in kernels_seen:
            cells = [r for r in results if r["shape"] == shape and r["kernel"] == kernel]
            print(f"{kernel:34s}" + "".join(f"{c['ms']:9.2f}{'*' if c['row_exact'] else ' '}" for c in cells))


# --- command line -------------------------------------------------------------------------------

BACKENDS = ("hf", "native", "native-bf16")


def _load_backends(name: str, backends: list[str]) -> dict:
    """backend name -> model, all over one loaded copy of the float32 weights (bf16 adds its own copy)."""
    import verispec
    from verispec.models.native import NativeCausalLM

    hf = verispec.load(name, backend="hf")
    build = {
        "hf": lambda: hf,
        "native": lambda: NativeCausalLM.from_hf(hf),  # the same weight tensors, no copy
        # bfloat16 matrices: not the target's exact function, measured as a draft option
        "native-bf16": lambda: NativeCausalLM.from_hf(hf, weight_dtype=torch.bfloat16),
    }
    return {backend: build[backend]() for backend in backends}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="zoo name, directory or hub id")
    parser.add_argument("--backend", default="both",
                        help=f"comma-separated, from {', '.join(BACKENDS)}; 'both' = hf,native")
    parser.add_argument("--widths", default="1,2,4,5,6,8,16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=200, help="tokens in the warm cache")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens of plain decoding to time (0: skip)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--cpu-clock", action="store_true",
                        help="time with this thread's CPU time (needs --threads 1): immune to other processes")
    parser.add_argument("--compare-threads", default=None, metavar="N,M",
                        help="instead: time each backend at these thread counts, switched pass by pass")
    parser.add_argument("--kernels", action="store_true", help="time candidate linear kernels instead")
    parser.add_argument("--rows", default="1,2,4,5,6,8,9,16", help="rows (M) for --kernels")
    parser.add_argument("--no-inductor", action="store_true", help="skip the torch.compile candidate in --kernels")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_clock and torch.get_num_threads() != 1:
        parser.error("--cpu-clock counts one thread's CPU time: use it with --threads 1")
    clock = time.thread_time if args.cpu_clock else time.perf_counter
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"load average {os.getloadavg()[0]:.2f}")

    if args.kernels:
        from transformers import AutoConfig

        from verispec import zoo

        path, _ = zoo.resolve(args.model)
        shapes = qwen_shapes(AutoConfig.from_pretrained(path))
        rows = [int(m) for m in args.rows.split(",")]
        print_kernel_table(measure_linear_kernels(shapes, rows, repeats=max(args.repeats, 9), inductor=not args.no_inductor,
                                                  clock=clock))
        return

    widths = sorted({int(w) for w in args.widths.split(",")} | {1})
    names = ["hf", "native"] if args.backend == "both" else args.backend.split(",")
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        parser.error(f"unknown backend {unknown[0]!r}: use {', '.join(BACKENDS)} or both")
    backends = _load_backends(args.model, names)
    if args.compare_threads:
        counts = [int(n) for n in args.compare_threads.split(",")]
        print(f"\n{args.model}: median seconds of a width-w forward by thread count ({args.repeats} repeats, interleaved)")
        print(f"{'backend':>12s}{'w':>4s}" + "".join(f"{str(n) + ' thr':>10s}" for n in counts))
        for name, model in backends.items():
            costs = measure_thread_counts(model, counts, widths, args.repeats, args.context)
            for w in widths:
                print(f"{name:>12s}{w:4d}" + "".join(f"{costs[(n, w)]:10.3f}" for n in counts))
        return
    costs = dict(zip(backends, measure_width_costs_interleaved(list(backends.values()), widths, args.repeats,
                                                                args.context, clock)))
    print(f"\n{args.model}: median {'CPU ' if args.cpu_clock else ''}seconds of a width-w forward on a "
          f"{args.context}-token cache (ratio = cost(w) / cost(1)), {args.repeats} repeats")
    print(f"{'w':>4s}" + "".join(f"{name + ' s':>16s}{name + ' ratio':>20s}" for name in costs))
    for w in widths:
        print(f"{w:4d}" + "".join(f"{c[w]:16.3f}{c[w] / c[1]:20.2f}" for c in costs.values()))
    if args.decode_tokens:
        print(f"\nplain greedy decoding, {args.decode_tokens} tokens after a {args.context}-token prompt:")
        for name, model in backends.items():
            print(f"  {name:8s} {plain_decode_tokens_per_second(model, args.decode_tokens, args.context):6.2f} tokens/s")


if __name__ == "__main__":
    main()
