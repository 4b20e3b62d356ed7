"""What the `numerics="q8"` kernels (csrc/kquant_q8.c) cost: nanoseconds per 256-weight block by pass width.

Kernel mode (default): one thread, random Q4_K and Q6_K matrices, each (matrix, width) timed
best-of-`--repeats` back-to-back calls (the least disturbed run on a shared machine; the matrix warm in
L2/L3 as a layer's is not), cases interleaved round-robin over `--rounds`. The fixed cost of a call
(Python, ctypes, the Q8_K rounding of x) is in the numbers: the `16x256` line shows it alone.
A block is one 256-weight block of one output column; a pass of width w does w rows against each block,
so ns/block is the whole pass's time over the matrix's block count. Cycles are given at `--ghz`.
`--isa 256` forces the AVX2 kernels.

Model mode (`--model NAME`): median seconds of one forward of width w (1..8) on a warm ~200-token cache
with `--threads` threads, widths interleaved pass by pass (fair ratios under load).

    PYTHONPATH=src python bench/q8_kernel.py [--isa 512|256] [--widths 1,2,4,8,16] [--repeats 31]
    PYTHONPATH=src python bench/q8_kernel.py --model qwen2.5-coder-1.5b --threads 2 [--widths 1,2,3,4,5,6,7,8]
    PYTHONPATH=src python bench/q8_kernel.py --model qwen2.5-coder-1.5b --threads 1 --cpu-clock
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np
import torch

from verispec.models import kernels
from verispec.models.kernels import config as kernel_config

KINDS = {"Q4_K": (12, 144), "Q6_K": (14, 210)}


def random_matrix(kind: str, n: int, k: int, rng: np.random.Generator) -> kernels.GGUFMatrix:
    """An [n, k] matrix of random codes with small finite half-precision scales."""
    code, size = KINDS[kind]
    raw = rng.integers(0, 256, size=(n * k // 256, size), dtype=np.uint8)
    scales = (rng.standard_normal((raw.shape[0], 2 if kind == "Q4_K" else 1)) * 0.02).astype(np.float16)
    raw[:, slice(0, 4) if kind == "Q4_K" else slice(208, 210)] = scales.view(np.uint8).reshape(raw.shape[0], -1)
    return kernels.GGUFMatrix(torch.from_numpy(raw.reshape(n, -1)), code)


def kernel_costs(shapes: list[tuple[int, int]], widths: list[int], repeats: int, rounds: int = 3) -> dict:
    """{(kind, n, k, width): best ns per block} of one-thread passes."""
    rng = np.random.default_rng(0)
    cases = []
    for kind in KINDS:
        for n, k in shapes:
            linear = kernels.Linear(random_matrix(kind, n, k, rng))
            for w in widths:
                x = torch.randn(w, k)
                cases.append(((kind, n, k, w), linear, x, torch.empty(w, n)))
    best = {key: float("inf") for key, *_ in cases}
    torch.set_num_threads(1)
    for _ in range(rounds):
        for key, linear, x, out in cases:
            for _ in range(repeats + 1):  # the first call warms the caches
                started = time.perf_counter_ns()
                linear(x, out)
                best[key] = min(best[key], time.perf_counter_ns() - started)
    return {key: ns / (key[1] * key[2] // 256) for key, ns in best.items()}


def model_costs(name: str, widths: list[int], repeats: int, threads: int, cpu_clock: bool = False) -> dict[int, float]:
    import verispec
    from verispec.costs import measure_width_costs

    torch.set_num_threads(threads)
    model = verispec.load(name, numerics="q8")
    with torch.inference_mode():
        return measure_width_costs(model, widths, repeats=repeats, clock=time.thread_time if cpu_clock else time.perf_counter)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", type=int, default=0, help="512 or 256 (default: the widest this CPU runs)")
    parser.add_argument("--widths", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--shapes", default="16x256,512x1536,1536x8960",
                        help="NxK matrices (16x256: one group, the call's fixed cost; 512x1536: 0.4-0.6 MB, in L2; "
                             "1536x8960: the 1.5B's down projection, 7.7-11 MB, in L3)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ghz", type=float, default=2.6, help="clock for the cycles column (the TSC's here)")
    parser.add_argument("--model", help="time whole forward passes of this zoo model instead")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu-clock", action="store_true",
                        help="with --threads 1: count this thread's CPU time (immune to other processes taking the core)")
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    if args.isa:
        kernel_config._current = dataclasses.replace(kernel_config.current(), isa=args.isa)
    isa = kernels.isa()
    if args.model:
        if args.cpu_clock and args.threads != 1:
            parser.error("--cpu-clock measures one thread: use --threads 1")
        costs = model_costs(args.model, widths, args.repeats, args.threads, args.cpu_clock)
        clock = "CPU" if args.cpu_clock else "wall"
        print(f"{args.model} numerics=q8 isa={isa} threads={args.threads}: median ms ({clock} time) per forward")
        for w in widths:
            print(f"  width {w:2d}: {costs[w] * 1e3:7.2f} ms  ({costs[w] / costs[widths[0]]:.2f}x width {widths[0]})")
        return
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    costs = kernel_costs(shapes, widths, args.repeats, args.rounds)
    print(f"isa={isa} vnni={kernels.vnni()} one thread, best of {args.repeats}: ns per block (cycles at {args.ghz} GHz)")
    for kind in KINDS:
        for n, k in shapes:
            row = "  ".join(f"w{w}: {costs[kind, n, k, w]:5.2f} ({costs[kind, n, k, w] * args.ghz:5.1f})" for w in widths)
            ratio = costs[kind, n, k, widths[-1]] / costs[kind, n, k, widths[0]]
            print(f"{kind} {n}x{k}  {row}   w{widths[-1]}/w{widths[0]} = {ratio:.2f}")


if __name__ == "__main__":
    main()
