"""llama.cpp's numerics on a GGUF file's 32-weight blocks (`numerics="q8"` with Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
matrices, and verispec's own 3-bit Q3_0 draft blocks): activations rounded per 32 as llama.cpp's x86
quantize_row_q8_0 / _q8_1, integer dot products against the blocks. The references are plain numpy transcriptions of ggml's formulas (block layouts,
quantize_row_q8_1, vec_dot_*_q8_*), the float part in the kernel's documented order (csrc/quant32_q8.c), so
the kernels must match them bit for bit on either ISA."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize

import verispec
from verispec.models import kernels
from verispec.models.kernels import config as kernel_config
from verispec.models.kernels.matrices import Q3_0

from conftest import EOS, VOCAB
from test_gguf_q8 import assert_rows_independent

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernels unavailable here")

BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q3_0": 14}
KIND = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q3_0": Q3_0}
TYPES = list(BYTES)
ISAS = [512, 256] if kernels.isa() == 512 else [256]
f32 = np.float32


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    """Each test once per ISA this CPU runs (the AVX-512 kernels need VNNI: else AVX2 runs under both)."""
    monkeypatch.setattr(kernel_config, "_current", dataclasses.replace(kernel_config.current(), isa=request.param))
    return request.param


def with_min(kind: str) -> bool:
    return kind in ("Q4_1", "Q5_1")


def random_blocks(kind: str, n: int, k: int, rng: np.random.Generator, scale: float = 0.02) -> np.ndarray:
    """Random well-formed blocks of an [n, k] matrix: random codes (Q8_0's -128 included), finite half-float d (and m)."""
    count = n * k // 32
    raw = rng.integers(0, 256, size=(count, BYTES[kind]), dtype=np.uint8)
    heads = 2 if with_min(kind) else 1
    raw[:, :2 * heads] = (rng.standard_normal((count, heads)) * scale).astype(np.float16).view(np.uint8).reshape(count, -1)
    return raw.reshape(n, -1)


# ---- the references: ggml's formulas in numpy -------------------------------------------------------

def q8_1_reference(x: np.ndarray):
    """llama.cpp's x86 quantize_row_q8_1 on rows x [M, K] -> (q [M, K / 32, 32], d [M, K / 32], s [M, K / 32]):
    max the largest |x| of the block, d = max / 127, id = 127 / max (0 for an all-zero block), q = x * id
    rounded to nearest even; d and s = d * sum(q) kept as half floats (Q8_0 is the same without s)."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32).astype(f32)
    peak = np.abs(blocks).max(axis=2)
    d = (peak / f32(127)).astype(f32)
    inverse = np.where(peak != 0, f32(127) / np.where(peak != 0, peak, f32(1)), f32(0)).astype(f32)
    q = np.rint((blocks * inverse[..., None]).astype(f32)).astype(np.int64)
    s = (d * q.sum(axis=2).astype(f32)).astype(f32)
    return q, d.astype(np.float16).astype(f32), s.astype(np.float16).astype(f32)


def weights(kind: str, blocks: np.ndarray):
    """Blocks [B, bytes] -> (d [B], m [B] or None, w [B, 32]): the integer weights of ggml's vec_dot (the _0
    types' signed codes, Q4_0 q - 8, Q5_0 q - 16, Q8_0's int8; the _1 types' unsigned codes) in weight order:
    weight j < 16 from qs[j]'s low nibble, j + 16 from its high one, Q5's bit j of qh as 16."""
    d = blocks[:, 0:2].copy().view(np.float16)[:, 0].astype(f32)
    m = blocks[:, 2:4].copy().view(np.float16)[:, 0].astype(f32) if with_min(kind) else None
    at = 4 if with_min(kind) else 2
    if kind == "Q8_0":
        return d, m, blocks[:, 2:].copy().view(np.int8).astype(np.int64)
    if kind == "Q3_0":  # weight j: bits 2 (j % 4) of byte 2 + j / 4, bit j % 8 of byte 10 + j / 8 as 4; less 4
        j = np.arange(32)
        low = (blocks[:, 2 + j // 4].astype(np.int64) >> (2 * (j % 4))) & 3
        high = (blocks[:, 10 + j // 8].astype(np.int64) >> (j % 8)) & 1
        return d, m, (low | high << 2) - 4
    five = kind in ("Q5_0", "Q5_1")
    qs = blocks[:, at + (4 if five else 0):].astype(np.int64)
    codes = np.concatenate((qs & 15, qs >> 4), axis=1)
    if five:
        qh = blocks[:, at:at + 4].copy().view(np.uint32)[:, 0].astype(np.int64)
        codes |= ((qh[:, None] >> np.arange(32)) & 1) << 4
    return d, m, codes - {"Q4_0": 8, "Q5_0": 16}.get(kind, 0)


def dense(kind: str, raw: np.ndarray) -> np.ndarray:
    """The float32 weights of blocks raw [N, bytes]: gguf-py's dequantize for ggml's types, (code - 4) * d for
    verispec's Q3_0 (no ggml type)."""
    if kind != "Q3_0":
        return dequantize(raw, getattr(GGMLQuantizationType, kind)).astype(f32)
    d, _, w = weights(kind, raw.reshape(-1, BYTES[kind]))
    return (w.astype(f32) * d[:, None]).astype(f32).reshape(raw.shape[0], -1)


def dot_reference(kind: str, raw: np.ndarray, x: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """y [M, N] for blocks raw [N, bytes] and activations x [M, K], in the kernel's float order: per block the
    exact integer sum, then acc += (d * dy) * float(sumi) (+ m * sy for the _1 types) over the blocks in order,
    y = acc + bias, float32 rounding after every operation."""
    q, dy, sy = q8_1_reference(x)
    n, rows = raw.shape[0], x.shape[0]
    out = np.empty((rows, n), dtype=f32)
    for c in range(n):
        d, m, w = weights(kind, raw[c].reshape(-1, BYTES[kind]))
        for r in range(rows):
            sums = (w * q[r]).sum(axis=1)  # exact
            acc = f32(0)
            for b in range(len(d)):
                t = f32(f32(d[b] * dy[r, b]) * f32(sums[b]))
                if m is not None:
                    t = f32(t + f32(m[b] * sy[r, b]))
                acc = f32(acc + t)
            out[r, c] = f32(acc + f32(0 if bias is None else bias[c]))
    return out


def hard_rows(k: int, rng: np.random.Generator) -> np.ndarray:
    """Activations with the rounding's corner cases: an all-zero block, a negative peak, ties to even."""
    x = rng.standard_normal((7, k)).astype(f32)
    x[0, :32] = 0.0
    x[1, 7] = -np.abs(x[1]).max() * 3
    x[2, :32] = f32(1e-3)
    x[3, :32] = np.arange(32) - 15.5  # peak 127 below: id = 1, every code a tie
    x[3, 31] = 127.0
    x[4, 32:64] = -x[4, 32:64] * 1e2
    return x


# ---- kernels against the references ----------------------------------------------------------------

@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("n, k", [(5, 32), (3, 576), (21, 256)])
def test_products_are_ggml_formulas_bit_for_bit(kind, n, k, isa):
    rng = np.random.default_rng(n * k + KIND[kind])
    raw = random_blocks(kind, n, k, rng)
    matrix = kernels.GGUFMatrix(torch.from_numpy(raw), KIND[kind])
    assert tuple(matrix.shape) == (n, k)
    x = hard_rows(k, rng)
    bias = rng.standard_normal(n).astype(f32)
    got = kernels.rowwise_linear(torch.from_numpy(x), matrix, torch.from_numpy(bias))
    want = dot_reference(kind, raw, x, bias)
    assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32))
    # and, on the plain random rows, close to the float product of the dequantized weights: only the activations'
    # rounding differs
    product = x[5:].astype(np.float64) @ dense(kind, raw).astype(np.float64).T + bias
    assert np.abs(got.numpy()[5:] - product).max() < 0.02 * np.abs(product).max()


@pytest.mark.parametrize("kind", TYPES)
def test_each_row_is_the_same_at_every_width_and_thread_count(kind, isa):
    rng = np.random.default_rng(5)
    raw = random_blocks(kind, 37, 192, rng)  # 37 columns: threads split them unevenly; K not a multiple of 256
    matrix = kernels.GGUFMatrix(torch.from_numpy(raw), KIND[kind])
    assert_rows_independent(matrix, torch.from_numpy(rng.standard_normal((16, 192)).astype(f32)))


def test_a_group_mixing_k_quants_and_32_weight_types_is_one_call_with_each_matrix_own_numbers(isa):
    """A Q4_K_M file's Q5_0 / Q8_0 matrices beside its Q4_K ones: x is rounded both ways once, each matrix
    takes its own rounding."""
    from test_gguf_q8 import random_blocks as kquant_blocks

    rng = np.random.default_rng(9)
    q4k = kernels.GGUFMatrix(torch.from_numpy(kquant_blocks("Q4_K", 12, 512, rng)), 12)
    q5_0 = kernels.GGUFMatrix(torch.from_numpy(random_blocks("Q5_0", 8, 512, rng)), 6)
    q8_0 = kernels.GGUFMatrix(torch.from_numpy(random_blocks("Q8_0", 20, 512, rng)), 8)
    linears = [kernels.Linear(q4k), kernels.Linear(q5_0), kernels.Linear(q8_0, torch.randn(20))]
    group = kernels.LinearGroup(linears)
    assert len(group._calls) == 1
    x = torch.randn(3, 512)
    outs = group(x, tuple(torch.empty(3, lin.n) for lin in linears))
    for out, lin in zip(outs, linears):
        assert torch.equal(out, lin(x, torch.empty(3, lin.n)))
    want = dot_reference("Q8_0", q8_0.blocks.numpy(), x.numpy(), linears[2].bias.numpy())
    assert np.array_equal(outs[2].numpy().view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("kind", TYPES)
def test_embedding_rows_are_ggml_dequantize_bit_for_bit(kind):
    rng = np.random.default_rng(KIND[kind])
    raw = random_blocks(kind, 9, 96, rng)
    raw[3, 0:2] = np.frombuffer(np.float16(3e-6).tobytes(), np.uint8)  # a subnormal scale
    matrix = kernels.GGUFMatrix(torch.from_numpy(raw), KIND[kind])
    ids = torch.tensor([[3, 0, 8], [4, 4, 1]])
    got = matrix.rows(ids)
    want = dense(kind, raw[ids.reshape(-1).numpy()]).reshape(2, 3, 96)
    assert np.array_equal(got.numpy().view(np.int32), want.astype(f32).view(np.int32))
    with pytest.raises(IndexError):
        matrix.rows(torch.tensor([9]))


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0"])
def test_quantize_writes_the_bytes_gguf_py_writes(kind):
    """`GGUFMatrix.quantize` (a draft's matrices rounded for the q8 kernels) is ggml's reference recipe: the
    bytes of gguf-py's quantize, ties (first of equal magnitudes, Q4_0's sign kept), an all-zero block and a
    block of one sign included."""
    from gguf.quants import quantize

    torch.manual_seed(KIND[kind])
    w = torch.randn(7, 160) * 0.03
    w[0, :32] = 0                                      # all zero: d = 0
    w[1, 3], w[1, 9] = 0.5, -0.5                       # a tie of magnitudes: the first decides Q4_0's sign
    w[2, 32:64] = torch.linspace(0.01, 0.4, 32)        # one sign
    w[3, 64:96] = torch.linspace(-1, 1, 32)            # codes at both ends
    ours = kernels.GGUFMatrix.quantize(w, KIND[kind])
    want = quantize(w.numpy(), getattr(GGMLQuantizationType, kind)).reshape(7, -1)
    assert np.array_equal(ours.blocks.numpy(), want)
    dense = ours.dequantize()
    step = 1 / 8 if kind == "Q4_0" else 1 / 127
    assert float((dense - w).abs().max()) <= float(w.abs().max()) * step * 1.01
    with pytest.raises(ValueError, match="32"):
        kernels.GGUFMatrix.quantize(torch.randn(2, 48), KIND[kind])


@pytest.mark.parametrize("kind", ["Q3_0", "Q4_0"])
def test_draft_blocks_take_the_nearest_codes_under_the_scale_that_errs_least(kind):
    """`GGUFMatrix.quantize(w, Q3_0)` and `quantize(w, 2, search=True)` (a draft's Q4_0 blocks): each weight gets
    the nearest code under its block's scale, and the scale (a half float) leaves no more squared error than
    ggml's rule (peak / lowest code) would in any block, and less over Gaussian weights (the search must find
    better scales); an all-zero block stays zero."""
    low, high, size = {"Q3_0": (-4, 3, 14), "Q4_0": (-8, 7, 18)}[kind]
    torch.manual_seed(3)
    w = torch.randn(6, 96) * 0.03
    w[0, :32] = 0                       # all zero: d = 0
    w[1, 40] = 0.5                      # a lone outlier
    w[2, 64:96] = torch.linspace(-1, 1, 32)
    ours = kernels.GGUFMatrix.quantize(w, Q3_0) if kind == "Q3_0" else kernels.GGUFMatrix.quantize(w, 2, search=True)
    assert ours.blocks.shape == (6, 3 * size) and tuple(ours.shape) == (6, 96)
    d, _, codes = weights(kind, ours.blocks.numpy().reshape(-1, size))
    x = w.reshape(-1, 32).numpy()
    inverse = np.where(d != 0, f32(1) / np.where(d != 0, d, f32(1)), f32(0)).astype(f32)
    assert np.array_equal(codes, np.clip(np.rint((x * inverse[:, None]).astype(f32)), low, high))
    err = (((codes * d[:, None]).astype(f32) - x) ** 2).sum(1)
    peak = np.take_along_axis(x, np.abs(x).argmax(1)[:, None], 1)[:, 0]
    d0 = (peak / f32(low)).astype(np.float16).astype(f32)
    inverse0 = np.where(d0 != 0, f32(1) / np.where(d0 != 0, d0, f32(1)), f32(0)).astype(f32)
    err0 = (((np.clip(np.rint(x * inverse0[:, None]), low, high) * d0[:, None]).astype(f32) - x) ** 2).sum(1)
    assert np.all(err <= err0 * (1 + 1e-6))
    assert err[6:].sum() < 0.95 * err0[6:].sum()  # rows 2.. are Gaussian but for one block
    assert d[0] == 0 and not ours.dequantize()[0, :32].any()
    assert np.array_equal(ours.dequantize().numpy(), dense(kind, ours.blocks.numpy()))
    with pytest.raises(ValueError, match="32"):
        kernels.GGUFMatrix.quantize(torch.randn(2, 48), Q3_0)


# ---- a whole model from a GGUF file of 32-weight blocks -----------------------------------------------

MIX = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_0", "ffn_gate": "Q4_1",
       "ffn_up": "Q4_1", "ffn_down": "Q5_1"}


def tiny_legacy_gguf(tmp_path, layers: int = 2, tied: bool = False):
    """A tiny Qwen2 GGUF file of every 32-weight type (hidden 192 and intermediate 320: no k-quant could hold
    these rows), and a transformers model holding its dequantized weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hidden, inter, heads, kv_heads = 192, 320, 4, 2
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                         rms_norm_eps=1e-6, eos_token_id=EOS, tie_word_embeddings=tied)
    model = Qwen2ForCausalLM(config).eval()
    rng = np.random.default_rng(11)
    path = tmp_path / "tiny-legacy.gguf"
    writer = GGUFWriter(str(path), "qwen2")
    for add, value in ((writer.add_block_count, layers), (writer.add_context_length, 512), (writer.add_embedding_length, hidden),
                       (writer.add_feed_forward_length, inter), (writer.add_head_count, heads),
                       (writer.add_head_count_kv, kv_heads), (writer.add_rope_freq_base, 10000.0),
                       (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_eos_token_id, EOS)):
        add(value)
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(VOCAB)])

    def blocks(name, kind, weight):
        n, k = weight.shape
        raw = random_blocks(kind, n, k, rng, scale=0.3 / {"Q8_0": 127, "Q5_0": 16, "Q5_1": 31}.get(kind, 8) / np.sqrt(k))
        if with_min(kind):  # m about -d * (codes' middle): weights centred on 0
            d = raw.reshape(-1, BYTES[kind])[:, 0:2].copy().view(np.float16).astype(f32)
            middle = 15.5 if kind == "Q5_1" else 7.5
            raw.reshape(-1, BYTES[kind])[:, 2:4] = (-d * middle).astype(np.float16).view(np.uint8)
        weight.copy_(torch.from_numpy(dequantize(raw, getattr(GGMLQuantizationType, kind)).reshape(n, k)))
        writer.add_tensor(name, raw, raw_dtype=getattr(GGMLQuantizationType, kind))

    parts = {"attn_q": ("self_attn", "q_proj"), "attn_k": ("self_attn", "k_proj"), "attn_v": ("self_attn", "v_proj"),
             "attn_output": ("self_attn", "o_proj"), "ffn_gate": ("mlp", "gate_proj"), "ffn_up": ("mlp", "up_proj"),
             "ffn_down": ("mlp", "down_proj")}
    with torch.no_grad():
        blocks("token_embd.weight", "Q8_0", model.model.embed_tokens.weight)
        for i, layer in enumerate(model.model.layers):
            for norm, key in ((layer.input_layernorm, "attn_norm"), (layer.post_attention_layernorm, "ffn_norm")):
                norm.weight.uniform_(0.5, 1.5)
                writer.add_tensor(f"blk.{i}.{key}.weight", norm.weight.detach().float().numpy())
            for key, (module, part) in parts.items():
                linear = getattr(getattr(layer, module), part)
                blocks(f"blk.{i}.{key}.weight", MIX[key], linear.weight)
                if linear.bias is not None:
                    linear.bias.normal_(0, 0.1)
                    writer.add_tensor(f"blk.{i}.{key}.bias", linear.bias.detach().float().numpy())
        writer.add_tensor("output_norm.weight", model.model.norm.weight.detach().float().numpy())
        if not tied:
            blocks("output.weight", "Q8_0", model.lm_head.weight)
    for call in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        call()
    return model, path


def test_a_gguf_of_32_weight_blocks_loads_and_computes_what_the_file_holds(tmp_path):
    hf, path = tiny_legacy_gguf(tmp_path)
    model = verispec.load(str(path), numerics="q8")
    assert [getattr(model.layers[0], f).kind for f in ("q", "k", "v", "o", "gate", "up", "down")] == \
        [KIND[MIX[key]] for key in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    assert model.lm_head.kind == 8 and isinstance(model.embed, kernels.GGUFMatrix)
    prompt = torch.tensor([[5, 17, 33, 2, 64, 9, 41, 12]])
    q8 = model.forward(prompt, model.new_cache(1))
    with torch.no_grad():
        dense = hf(prompt).logits
    # a wiring check (the bits are the product tests'): only the activations' rounding to 8 bits differs
    assert torch.corrcoef(torch.stack((q8.flatten(), dense.flatten())))[0, 1] > 0.998


def test_a_verify_pass_gives_bitwise_the_logits_of_single_token_steps(tmp_path):
    _, path = tiny_legacy_gguf(tmp_path)
    model = verispec.load(str(path), numerics="q8")
    prompt = [5, 17, 33, 2, 64, 9, 41, 12, 7, 7, 30]
    tokens = [40, 41, 42, 3, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61]
    steps = model.new_cache(1)
    model.forward(torch.tensor([prompt]), steps, last_only=True)
    single = torch.cat([model.forward(torch.tensor([[t]]), steps) for t in tokens], dim=1)
    for width in (2, 5, 8, 16):
        cache = model.new_cache(1)
        model.forward(torch.tensor([prompt]), cache, last_only=True)
        wide = torch.cat([model.forward(torch.tensor([tokens[i:i + width]]), cache)
                          for i in range(0, len(tokens), width)], dim=1)
        assert torch.equal(wide, single)


@pytest.mark.parametrize("drafter", ["ngram", "self"])
def test_greedy_speculative_decoding_equals_plain_greedy_decoding(tmp_path, drafter):
    _, path = tiny_legacy_gguf(tmp_path, tied=True)  # tied: the Q8_0 embedding is the head too
    model = verispec.load(str(path), numerics="q8")
    assert model.lm_head is model.embed
    prompt = [5, 17, 33, 2, 64, 9, 41, 12, 5, 17, 33, 2, 64]
    plain = verispec.generate(model, prompt, drafter="none", max_new_tokens=40)
    speculative = verispec.generate(model, prompt, drafter=drafter, draft_len=4, max_new_tokens=40)
    assert speculative.token_ids == plain.token_ids
