"""CPU kernels for small passes (a few tokens per row): fast at small batch, exact row by row.

Decoding and verifying push a handful of activation rows (1 to ~16) through every weight matrix,
so the cost is reading the weights from memory, not arithmetic. PyTorch's CPU GEMMs (MKL, oneDNN)
are tuned for big batches: on a 2-core AVX-512 VM a 5-row product costs 2-3x a 1-row product
although both read the same bytes. Worse for speculative decoding, they take different code paths
for different row counts, so a row of an 8-row product need not equal the same row computed alone.

These kernels fix both in the decode regime:
- `rowwise_linear`: y = x W^T (+ b), the weight read once per tile of up to 6 rows, every output
  element accumulated by the same fused multiply-adds in the same order whatever the row count;
- `slot_attention`: attention of the new tokens over the visible slots of a slot cache (keys kept
  d-major so one vector op scores 16 slots); invisible slots are skipped, not masked, so holes,
  padding and batch mates cannot change a row's numbers;
- `rms_norm`, `rope_`, `silu_mul_`, `cache_write`: the glue between them, so a small pass costs a
  dozen calls per layer instead of ~40 PyTorch ops.
Every row's output is thus bitwise independent of how many rows share the pass: a width-k verify
pass sees exactly the numbers of k single-token steps. Activations and accumulation are float32;
`rowwise_linear` also takes bfloat16 weights (half the bytes), weight-only int8 (`Int8Matrix`, a
quarter) and grouped int4 (`Int4Matrix`, about a seventh), all for draft models. int4 matrices
multiply activations rounded to int8 per group of 64 (integer dot products: AVX-512 VNNI's vpdpbusd,
or AVX2's vpmaddubsw): unpacking 4-bit weights to float left that kernel compute-bound (a 4-bit Qwen
0.5B draft step took 32 ms on two AVX2 cores; 19.6 ms with int8 activations, ~20 GB/s). The rounding
reads only the row's own values, so rows stay independent there too (`KernelConfig.int8_activations`
off keeps the float path).

A model converted from a GGUF file (the zoo's) holds float32 weights that gguf's dequantizer made
from Q4_K / Q6_K blocks. `Q4KMatrix` / `Q6KMatrix` (`ExactBlocks`) keep those blocks (0.75 and 1.25
bytes per weight with their float32 scales) and rebuild each weight with the dequantizer's own
multiply and subtract, unfused, before the float32 arithmetic of the float32 matrix: the products
are bitwise the float32 matrix's, checked weight by weight when a matrix is built. For one or two
rows the weights are rebuilt in registers; for more, a tile's rows are widened one k block at a time
into an L1 scratch that the float32 tiles then read. Qwen2.5-Coder 1.5B reads 1.4 GB per step
instead of 7.1; the step becomes bound by the rebuilding arithmetic (~3 cycles per 8 weights).

`GGUFMatrix` is the other way to run a GGUF file: its Q4_K / Q5_K / Q6_K or Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0
blocks as the file stores them (read from the mapped file, `models.gguf_q8`), regrouped at load 16 output
columns at a time so one vector lane serves one column (csrc/kquant_q8_pack.c, quant32_q8_pack.c), with
llama.cpp's numerics instead of the float32 model's: each activation row rounded to 8 bits per block as
ggml rounds it for the matrix's type (Q8_K per 256, Q8_0 / Q8_1 per 32), integer dot products against the
blocks' codes (AVX-512 VNNI, or AVX2 byte products), the blocks' scales applied in float32 (csrc/
kquant_q8.c, quant32_q8.c). Rows stay independent (threads split output columns; each output's sums run in one
fixed order), so a target in this mode (`numerics="q8"`) is speculated on exactly.

Prefill is the other regime: hundreds of rows, compute-bound. `blocked_linear` is a classic blocked
GEMM for it (packed panels, 6x16 register tiles, AVX2+FMA), used where PyTorch's GEMM is slow: on
2 AVX2 Zen 3 cores ~130-145 GFLOPS where MKL's path gave 75-120. Its rows are independent too,
though its sums run in another order than `rowwise_linear`'s on row-major matrices.

`PanelMatrix` stores a float32 matrix in that GEMM's own panels (16 rows, k-major), once, at load.
Small passes then read the matrix as one stream, and a 7-16-row pass re-reads each 16 KB k block
from L1 rather than the row-major tiles' 2-4 rows from memory: on 2 AVX2 Zen 3 cores a Qwen 1.5B
pass of 8 rows cost 1.27-1.41x one row against 1.60x, 12 rows 1.37-1.56x against 2.0x, and one row
~5% less. Each output is the GEMM's chain of sums, so a small pass gives a row bitwise what a
prefill gives it.

The C source (`verispec/csrc/`) is written once against per-ISA vector mappings and compiled in
AVX-512 and AVX2+FMA variants, picked per call by what the CPU supports (and `KernelConfig.isa`).
It is compiled once per source hash with the system C compiler into the verispec cache and called
through ctypes. It runs on `threads()` threads (PyTorch's count; see `threads` for a decode step's
scope) of its own small pool, in which the caller never waits for a thread that has not started: on a
machine shared with busy processes, OpenMP's barriers (with libgomp's default busy-waiting) made a
pass 8x slower with 2 threads than with 1; this pool degrades to about 1-thread speed instead. Without a
compiler or a suitable CPU, `available()` is False and callers stay with PyTorch.
This package knows nothing about models: it does arithmetic on the buffers it is handed.

Modules: `config` (the switches, `KernelConfig`), `build` (compile and cache the library), `abi`
(formats and structs shared with the C headers, function signatures), `runtime` (the loaded library
and the ISA in use), `threads` (the pool's thread count), `matrices` (weight formats), `ops` (the operations).
"""

from verispec.models.kernels.abi import SLOT_BLOCK, Format
from verispec.models.kernels.config import KernelConfig
from verispec.models.kernels.matrices import (ExactBlocks, GGUFMatrix, Int4Matrix, Int8Matrix, PanelMatrix, Q4KMatrix, Q6KMatrix,
                                              QuantizedMatrix)
from verispec.models.kernels.ops import (MAX_ROWS, Q8_MAX_ROWS, LayerStack, Linear, LinearGroup, _int4_code, blocked_linear,
                                         blocked_preferred, blocked_takes, cache_write, panels_preferred, rms_norm, rope_,
                                         rowwise_linear, silu_mul_, slot_attention)
from verispec.models.kernels.runtime import amx, available, isa, lanes, runtime, vnni
from verispec.models.kernels.threads import threads, torch_on_one_thread, torch_threads

__all__ = [
    "SLOT_BLOCK", "MAX_ROWS", "Q8_MAX_ROWS", "Format", "KernelConfig", "QuantizedMatrix", "Int8Matrix", "Int4Matrix", "ExactBlocks",
    "Q4KMatrix", "Q6KMatrix", "GGUFMatrix", "PanelMatrix", "Linear", "LinearGroup", "LayerStack", "rowwise_linear", "blocked_linear",
    "blocked_preferred", "blocked_takes", "panels_preferred", "rms_norm", "rope_", "silu_mul_", "cache_write",
    "slot_attention", "available", "amx", "isa", "lanes", "vnni", "runtime", "threads", "torch_on_one_thread", "torch_threads",
]
