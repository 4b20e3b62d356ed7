"""llama.cpp's numerics on a GGUF file's own blocks (`numerics="q8"`): activations rounded as ggml's Q8_K,
integer dot products against Q4_K / Q6_K blocks. The references below are plain numpy transcriptions of
ggml's formulas (quantize_row_q8_K_ref, the k-quant block layouts), with the float part in the kernel's
documented order (csrc/kquant_q8.c), so the kernels must match them bit for bit on either ISA."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize

import verispec
from verispec.errors import VerispecError
from verispec.models import gguf_q8, kernels
from verispec.models.kernels import config as kernel_config

from conftest import EOS, VOCAB

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernels unavailable here")

BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
KIND = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
ISAS = [512, 256] if kernels.isa() == 512 else [256]


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    """Each test once per ISA this CPU runs (the AVX-512 kernels need VNNI: else AVX2 runs under both)."""
    monkeypatch.setattr(kernel_config, "_current", dataclasses.replace(kernel_config.current(), isa=request.param))
    return request.param


def random_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random well-formed blocks of an [n, k] matrix: random codes, finite half-precision scales."""
    raw = rng.integers(0, 256, size=(n * k // 256, BYTES[kind]), dtype=np.uint8)
    two = kind in ("Q4_K", "Q5_K")  # d and dmin first; Q6_K's d is last
    scales = (rng.standard_normal((raw.shape[0], 2 if two else 1)) * 0.02).astype(np.float16)
    where = slice(0, 4) if two else slice(208, 210)
    raw[:, where] = scales.view(np.uint8).reshape(raw.shape[0], -1)
    return raw.reshape(n, -1)


# ---- the references: ggml's formulas in numpy -------------------------------------------------------

def q8k_reference(x: np.ndarray):
    """ggml's quantize_row_q8_K_ref on rows x [M, K] float32 -> (q [M, K] int8, d [M, K/256] float32, bsums [M, K/16])."""
    m, k = x.shape
    blocks = x.reshape(m, k // 256, 256).astype(np.float32)
    first = np.abs(blocks).argmax(axis=2)  # the first of the largest magnitudes, as the strict > of the C loop
    peak = np.take_along_axis(blocks, first[..., None], axis=2)[..., 0]
    zero = peak == 0
    iscale = np.float32(-127.0) / np.where(zero, np.float32(1), peak)
    q = np.minimum(np.rint(iscale[..., None] * blocks), 127).astype(np.int64)  # float32 product, ties to even
    q[zero] = 0
    d = np.where(zero, np.float32(0), np.float32(1.0) / iscale).astype(np.float32)
    bsums = q.reshape(m, k // 16, 16).sum(axis=2)
    return q.reshape(m, k).astype(np.int8), d, bsums


def q4k_codes(block: np.ndarray):
    """A Q4_K block -> (d, dmin, scales [8], mins [8], codes [256] in weight order)."""
    d, dmin = block[0:4].view(np.float16).astype(np.float32)
    p = block[4:16].astype(np.int64)
    sc = np.concatenate((p[0:4] & 63, (p[8:12] & 15) | ((p[0:4] >> 6) << 4)))
    mn = np.concatenate((p[4:8] & 63, (p[8:12] >> 4) | ((p[4:8] >> 6) << 4)))
    qs = block[16:].astype(np.int64).reshape(4, 32)
    codes = np.concatenate((qs & 15, qs >> 4), axis=1).reshape(256)
    return d, dmin, sc, mn, codes


def q5k_codes(block: np.ndarray):
    """A Q5_K block -> (d, dmin, scales [8], mins [8], codes 0..31 [256] in weight order): ggml's
    dequantize_row_q5_K, weight 64 g + i (i < 32) low nibble of qs[32 g + i] plus bit 2 g of qh[i] as 16,
    weight 64 g + 32 + i the high nibble plus bit 2 g + 1."""
    d, dmin, sc, mn, low = q4k_codes(np.concatenate((block[:16], block[48:176])))
    qh = block[16:48].astype(np.int64)
    fifth = np.concatenate([np.concatenate(((qh >> (2 * g)) & 1, (qh >> (2 * g + 1)) & 1)) for g in range(4)])
    return d, dmin, sc, mn, low | (fifth << 4)


def q6k_codes(block: np.ndarray):
    """A Q6_K block -> (d, scales [16], unsigned codes q + 32 [256] in weight order)."""
    ql, qh = block[0:128].astype(np.int64).reshape(2, 64), block[128:192].astype(np.int64).reshape(2, 32)
    sc = block[192:208].view(np.int8).astype(np.int64)
    d = block[208:210].view(np.float16).astype(np.float32)[0]
    low = np.concatenate((ql & 15, ql >> 4), axis=1)  # [2, 128]: weights i < 64 low nibbles, the rest high
    top = np.concatenate([(qh >> (2 * t)) & 3 for t in range(4)], axis=1)  # weight 32 t + i: bits 2t of qh[i]
    return d, sc, (low | (top << 4)).reshape(256)


def dot_reference(kind: str, raw: np.ndarray, x: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """y [M, N] for blocks raw [N, bytes] and activations x [M, K], in the kernel's float order: per block
    the exact integer sums, then acc += (dy * d) * float(sumi) (and Q4_K's accm += (dy * dmin) * float(summ))
    over the blocks in order, y = (acc - accm) + bias, float32 rounding after every operation."""
    q, dq, bsums = q8k_reference(x)
    n, m, k = raw.shape[0], x.shape[0], x.shape[1]
    nb, size = k // 256, BYTES[kind]
    f32 = np.float32
    out = np.empty((m, n), dtype=np.float32)
    for c in range(n):
        blocks = raw[c].reshape(nb, size)
        for r in range(m):
            acc, accm = f32(0), f32(0)
            for b in range(nb):
                q8 = q[r, b * 256:(b + 1) * 256].astype(np.int64)
                bs = bsums[r, b * 16:(b + 1) * 16]
                dy = dq[r, b]
                if kind in ("Q4_K", "Q5_K"):
                    d, dmin, sc, mn, codes = (q4k_codes if kind == "Q4_K" else q5k_codes)(blocks[b])
                    sumi = int((sc[np.arange(256) // 32] * codes * q8).sum())
                    summ = int((mn * bs.reshape(8, 2).sum(axis=1)).sum())
                    accm = f32(accm + f32(f32(dy * dmin) * f32(summ)))
                else:
                    d, sc, codes = q6k_codes(blocks[b])
                    sumi = int((sc[np.arange(256) // 16] * (codes - 32) * q8).sum())
                assert abs(sumi) < 2 ** 31
                acc = f32(acc + f32(f32(dy * d) * f32(sumi)))
            out[r, c] = f32(f32(acc - accm) + f32(0 if bias is None else bias[c]))
    return out


# ---- kernels against the references ----------------------------------------------------------------

@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("n, k", [(5, 256), (3, 768), (21, 512)])
def test_products_are_ggml_formulas_bit_for_bit(kind, n, k, isa):
    rng = np.random.default_rng(n * k + KIND[kind])
    raw = random_blocks(kind, n, k, rng)
    matrix = kernels.GGUFMatrix(torch.from_numpy(raw), KIND[kind])
    assert tuple(matrix.shape) == (n, k)
    x = rng.standard_normal((6, k)).astype(np.float32)
    x[0, :256] = 0.0  # an all-zero block: d = 0, codes 0
    x[1, 7] = -x[1].__abs__().max() * 2  # the block's peak is negative: iscale > 0
    x[2, :256] = np.float32(1e-3)  # all |x| tied: the first is the peak
    x[3, :256] = np.arange(256) % 120 - 59.5  # iscale = 1 exactly: every code a tie, rounded to even
    x[3, 0] = -127.0
    bias = rng.standard_normal(n).astype(np.float32)
    got = kernels.rowwise_linear(torch.from_numpy(x), matrix, torch.from_numpy(bias))
    want = dot_reference(kind, raw, x, bias)
    assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32))
    # and close to the float product of the dequantized weights: only the activations' rounding differs
    dense = x.astype(np.float64) @ dequantize(raw, getattr(GGMLQuantizationType, kind)).astype(np.float64).T + bias
    assert np.abs(got.numpy() - dense).max() < 0.02 * np.abs(dense).max()


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_each_row_is_the_same_at_every_width_and_thread_count(kind, isa):
    rng = np.random.default_rng(5)
    raw = random_blocks(kind, 37, 512, rng)  # 37 columns: threads split them unevenly
    matrix = kernels.GGUFMatrix(torch.from_numpy(raw), KIND[kind])
    assert_rows_independent(matrix, torch.from_numpy(rng.standard_normal((16, 512)).astype(np.float32)))


def assert_rows_independent(matrix, x: torch.Tensor) -> None:
    """Every row of x [16, K] @ matrix gives the same bits alone or among others, at every width and on 1 or 2 threads."""
    whole = kernels.rowwise_linear(x, matrix)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in range(1, 17):
                for first in (0, 16 - rows):
                    part = kernels.rowwise_linear(x[first:first + rows].contiguous(), matrix)
                    assert torch.equal(part, whole[first:first + rows])
    finally:
        torch.set_num_threads(threads)


def test_a_group_mixing_q4k_and_q6k_is_one_call_with_each_matrix_own_numbers(isa):
    rng = np.random.default_rng(9)
    q4 = kernels.GGUFMatrix(torch.from_numpy(random_blocks("Q4_K", 12, 512, rng)), 12)
    q6 = kernels.GGUFMatrix(torch.from_numpy(random_blocks("Q6_K", 8, 512, rng)), 14)
    linears = [kernels.Linear(q4), kernels.Linear(q6), kernels.Linear(q4, torch.randn(12))]
    group = kernels.LinearGroup(linears)
    assert len(group._calls) == 1
    x = torch.randn(3, 512)
    outs = group(x, tuple(torch.empty(3, lin.n) for lin in linears))
    for out, lin in zip(outs, linears):
        assert torch.equal(out, lin(x, torch.empty(3, lin.n)))


# ---- a whole model from a GGUF file -------------------------------------------------------------------

def tiny_gguf(tmp_path, layers: int = 2, head_kind: str = "Q6_K", embed_kind: str = "Q4_K", low: str = "Q4_K"):
    """A tiny Qwen2 GGUF file (Q4_K_M's mix: q, k, o, gate, up Q4_K; v, down, head Q6_K; float32 norms and q/k/v
    biases; low="Q5_K": Q5_K_M's mix, Q5_K where Q4_K_M has Q4_K) and a transformers model holding its
    dequantized weights (the float32 model the file stands for)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hidden, inter, heads, kv_heads = 256, 512, 4, 2
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                         rms_norm_eps=1e-6, eos_token_id=EOS, tie_word_embeddings=head_kind is None)
    model = Qwen2ForCausalLM(config).eval()
    rng = np.random.default_rng(11)
    path = tmp_path / "tiny-q8.gguf"
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_eos_token_id(EOS)
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(VOCAB)])  # an array to skip over

    def blocks(name, kind, weight):
        n, k = weight.shape
        raw = random_blocks(kind, n, k, rng)
        two = kind in ("Q4_K", "Q5_K")  # Q5_K's codes reach 31: half the scale keeps its weights Q4_K's size
        raw.reshape(-1, BYTES[kind])[:, slice(0, 4) if two else slice(208, 210)] = (
            (rng.standard_normal((raw.size // BYTES[kind], 2 if two else 1)) * (0.002 if kind == "Q5_K" else 0.004))
            .astype(np.float16).view(np.uint8).reshape(raw.size // BYTES[kind], -1))
        weight.copy_(torch.from_numpy(dequantize(raw, getattr(GGMLQuantizationType, kind)).reshape(n, k)))
        writer.add_tensor(name, raw, raw_dtype=getattr(GGMLQuantizationType, kind))

    def floats(name, tensor):
        writer.add_tensor(name, tensor.detach().float().numpy())

    kinds = {"q_proj": ("self_attn", "attn_q", low), "k_proj": ("self_attn", "attn_k", low),
             "v_proj": ("self_attn", "attn_v", "Q6_K"), "o_proj": ("self_attn", "attn_output", low),
             "gate_proj": ("mlp", "ffn_gate", low), "up_proj": ("mlp", "ffn_up", low),
             "down_proj": ("mlp", "ffn_down", "Q6_K")}
    with torch.no_grad():
        blocks("token_embd.weight", embed_kind, model.model.embed_tokens.weight)
        for i, layer in enumerate(model.model.layers):
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
            floats(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
            floats(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight)
            for part, (module, name, kind) in kinds.items():
                linear = getattr(getattr(layer, module), part)
                blocks(f"blk.{i}.{name}.weight", kind, linear.weight)
                if linear.bias is not None:
                    linear.bias.normal_(0, 0.1)
                    floats(f"blk.{i}.{name}.bias", linear.bias)
        floats("output_norm.weight", model.model.norm.weight)
        if head_kind is not None:
            blocks("output.weight", head_kind, model.lm_head.weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, path


@pytest.mark.parametrize("low", ["Q4_K", "Q5_K"])
def test_a_gguf_loads_as_its_own_blocks_and_computes_what_the_file_holds(tmp_path, low):
    hf, path = tiny_gguf(tmp_path, low=low)
    model = verispec.load(str(path), numerics="q8")
    assert model.numerics == "q8" and model.eos_token_ids == {EOS}
    assert isinstance(model.embed, kernels.GGUFMatrix) and model.lm_head.kind == 14
    assert [model.layers[0].q.kind, model.layers[0].v.kind, model.layers[0].down.kind] == [KIND[low], 14, 14]
    assert model._layer_stack() is not None  # q (Q4_K) and v (Q6_K) still one product: one C call a pass
    # the file's bytes, not a copy: the matrices point into the mapped file
    mapped = gguf_q8.read(path)[1]["blk.1.ffn_up.weight"].raw
    assert np.array_equal(model.layers[1].up.blocks.numpy(), mapped)
    assert model.layers[1].up.blocks.numpy().base is not None  # a view (of the mapped file), not a copy
    # the float32 model the file stands for, up to the rounding of the activations to 8 bits
    prompt = torch.tensor([[5, 17, 33, 2, 64, 9, 41, 12]])
    q8 = model.forward(prompt, model.new_cache(1))
    with torch.no_grad():
        dense = hf(prompt).logits
    # A wiring check (the bits are the product tests'): the rounding of x to 8 bits costs a random Q5_K product
    # ~1% of its norm, a Q4_K product ~0.6% (measured against the quantized x's float64 product: 1e-7), over two layers
    assert torch.corrcoef(torch.stack((q8.flatten(), dense.flatten())))[0, 1] > 0.998
    assert (q8 - dense).abs().max() < (0.05 if low == "Q4_K" else 0.08) * dense.abs().max()


@pytest.mark.parametrize("low", ["Q4_K", "Q5_K"])
def test_a_verify_pass_gives_bitwise_the_logits_of_single_token_steps(tmp_path, low):
    _, path = tiny_gguf(tmp_path, low=low)
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
    # two sequences in one pass: each row's logits are its own
    both = model.new_cache(2)
    model.forward(torch.tensor([prompt, prompt]), both, last_only=True)
    pair = model.forward(torch.tensor([tokens[:8], tokens[8:]]), both)
    alone = model.new_cache(1)
    model.forward(torch.tensor([prompt]), alone, last_only=True)
    assert torch.equal(pair[0], model.forward(torch.tensor([tokens[:8]]), alone)[0])


def test_prefill_of_any_length_is_the_chunks_of_small_passes(tmp_path):
    _, path = tiny_gguf(tmp_path, layers=1)
    model = verispec.load(str(path), numerics="q8")
    length = 2 * kernels.Q8_MAX_ROWS + 44  # passes of Q8_MAX_ROWS, Q8_MAX_ROWS, 44 rows (AMX tiles where the CPU has them)
    prompt = torch.tensor([[(7 * i) % VOCAB for i in range(length)]])
    whole = model.forward(prompt, model.new_cache(1))
    for rows in (32, 7):  # the same prompt in narrower passes (7: below the AMX tiles' 16)
        cache = model.new_cache(1)
        parts = torch.cat([model.forward(prompt[:, i:i + rows], cache) for i in range(0, length, rows)], dim=1)
        assert torch.equal(whole, parts)
    assert torch.equal(model.forward(prompt, model.new_cache(1), last_only=True), whole[:, -1:])


def test_a_prompts_read_stores_the_keys_and_values_a_forward_pass_stores(tmp_path):
    """`extend` (a prompt's read: the last layer stops at its keys and values, no LM head) leaves bitwise the cache
    a forward pass leaves, over several chunks, for a batch, and for a head that scores its text's words (which
    learns the prompt's as it reads them): the steps after it give the same logits."""
    from verispec.api import load_draft

    _, path = tiny_gguf(tmp_path, head_kind=None)
    target = verispec.load(str(path), numerics="q8")
    reading = load_draft(str(path), target, vocab=40)
    length = kernels.Q8_MAX_ROWS + 37  # two chunks
    prompts = torch.tensor([[(7 * i + 3) % VOCAB for i in range(length)], [(5 * i + 90) % VOCAB for i in range(length)]])
    for model in (target, reading):
        read, passed = model.new_cache(2), model.new_cache(2)
        model.extend(prompts, read)
        model.forward(prompts, passed, last_only=True)
        assert read.slots.length == passed.slots.length == length
        assert torch.equal(read.store.keys, passed.store.keys) and torch.equal(read.store.values, passed.store.values)
        step = torch.tensor([[64, 70], [91, 2]])
        assert torch.equal(model.forward(step, read), model.forward(step, passed))
    with pytest.raises(ValueError, match="taps"):
        target.forward(prompts, target.new_cache(2), last_only=True, taps=(1,), outputs=False)


def test_a_prompts_taps_are_computed_for_the_kept_tail_only_with_the_same_numbers(tmp_path, monkeypatch):
    """Any split of a q8 prefill gives the same numbers, so a reader that keeps the last taps only runs the tokens
    before them untapped (a tapped pass is dearer): the same keys, values and taps as tapping every token."""
    from verispec.prefill import read_once

    _, path = tiny_gguf(tmp_path, layers=2)
    model = verispec.load(str(path), numerics="q8")
    assert model.prefill_chunk is None
    prompt = [(7 * i) % VOCAB for i in range(75)]
    tapped_rows = []
    forward = type(model).forward

    def counting(self, tokens, *args, taps=None, **kwargs):
        tapped_rows.append(tokens.shape[1] if taps is not None else 0)
        return forward(self, tokens, *args, taps=taps, **kwargs)

    full = read_once(model, [prompt], taps=(0, 1, 2))[0]
    monkeypatch.setattr(type(model), "forward", counting)
    tail = read_once(model, [prompt], taps=(0, 1, 2), tap_last=9)[0]
    monkeypatch.undo()
    assert sum(tapped_rows) == 9  # the 66 tokens before ran without taps
    assert torch.equal(torch.cat(tail.hidden), torch.cat(full.hidden)[-9:])
    follow = torch.tensor([[3, 4]])
    assert torch.equal(model.forward(follow, tail.cache), model.forward(follow, full.cache))


@pytest.mark.parametrize("drafter", ["ngram", "self"])
def test_greedy_speculative_decoding_equals_plain_greedy_decoding(tmp_path, drafter):
    _, path = tiny_gguf(tmp_path, head_kind=None)  # tied: the Q4_K embedding is the head too
    model = verispec.load(str(path), numerics="q8")
    assert model.lm_head is model.embed
    prompt = [5, 17, 33, 2, 64, 9, 41, 12, 5, 17, 33, 2, 64]
    plain = verispec.generate(model, prompt, drafter="none", max_new_tokens=40)
    speculative = verispec.generate(model, prompt, drafter=drafter, draft_len=4, max_new_tokens=40)
    assert speculative.token_ids == plain.token_ids
    assert speculative.stats.target_passes < 40 or drafter == "self"


def test_auto_drafts_a_q8_target_by_prompt_lookup_not_an_int4_copy(tmp_path):
    """A q8 target's int4 copy reads nearly a step's bytes per drafted token (it raced below plain), so "auto"
    gives such a target prompt lookup, for one call and for a server alike; the output is plain decoding's."""
    from verispec.api import resolve_drafter, self_draft_possible

    _, path = tiny_gguf(tmp_path, head_kind=None)
    model = verispec.load(str(path), numerics="q8")
    assert not self_draft_possible(model)
    assert resolve_drafter(model, None, "auto", 1000) == "ngram" and resolve_drafter(model, None, "auto", None) == "ngram"
    prompt = [5, 17, 33, 2, 64, 9, 41, 12, 5, 17, 33, 2, 64]
    auto = verispec.generate(model, prompt, max_new_tokens=40)
    assert auto.stats.drafter == "NgramDrafter"
    assert auto.token_ids == verispec.generate(model, prompt, drafter="none", max_new_tokens=40).token_ids


def test_auto_with_a_q4_0_draft_model_drafts_staged_on_a_q8_target(tmp_path, monkeypatch):
    """Target and draft both in llama.cpp's numerics (a q8 target, a draft in ggml's Q4_0 blocks): "auto" gives
    staged drafting, which raced ahead of the draft model alone there; an int4 draft keeps "model". The output is
    plain decoding's."""
    from conftest import tiny_qwen2
    from verispec.api import resolve_drafter
    from verispec.models.native import NativeCausalLM

    _, path = tiny_gguf(tmp_path, head_kind=None)
    target = verispec.load(str(path), numerics="q8")
    small = tiny_qwen2(seed=1)
    q4_0 = NativeCausalLM.from_hf(small, weight_dtype="q4_0")
    assert resolve_drafter(target, q4_0, "auto") == "staged"
    assert resolve_drafter(target, NativeCausalLM.from_hf(small, weight_dtype=torch.quint4x2), "auto") == "model"
    prompt = [5, 17, 33, 2, 64, 9, 41, 12, 5, 17, 33, 2, 64]
    monkeypatch.setattr(verispec.engine, "START_AFTER", 0)  # the draft starts with the call, not after 32 tokens
    auto = verispec.generate(target, prompt, draft=q4_0, max_new_tokens=40)
    assert auto.stats.drafter.startswith("StagedDrafter")  # (then perhaps prompt lookup: `DecodeBatch._judge_start`)
    assert auto.token_ids == verispec.generate(target, prompt, drafter="none", max_new_tokens=40).token_ids


def test_a_draft_named_beside_a_q8_target_loads_in_ggml_style_blocks(tmp_path, monkeypatch):
    """A draft given by name or path takes the target's kind of numbers unless told otherwise: Q4_0 blocks (3-bit
    ones for the MLP's gate and up) beside a q8 target (so "auto" drafts staged, as with a draft loaded that way),
    float32 beside a float32 one; an explicit weight_dtype wins, and one given for an already loaded draft is
    refused rather than ignored."""
    from verispec.api import load_draft, resolve_drafter
    from verispec.models.kernels.matrices import Q3_0

    _, path = tiny_gguf(tmp_path, head_kind=None)
    target = verispec.load(str(path), numerics="q8")
    draft = load_draft(str(path), target)
    assert draft.numerics == "q8" and draft is verispec.load(str(path), weight_dtype="q3_0")
    assert draft.layers[0].gate.kind == Q3_0 and draft.layers[0].down.kind == 2
    assert load_draft(str(path), target, "q4_0") is verispec.load(str(path), weight_dtype="q4_0")
    assert resolve_drafter(target, draft, "auto") == "staged"
    assert load_draft(str(path), target, "int4").numerics == "float32"
    assert load_draft(str(path), verispec.load(str(path))).numerics == "float32"
    assert load_draft(draft, target) is draft
    with pytest.raises(VerispecError, match="weight_dtype"):
        load_draft(draft, target, "int4")
    prompt = [5, 17, 33, 2, 64, 9, 41, 12, 5, 17, 33, 2, 64]
    monkeypatch.setattr(verispec.engine, "START_AFTER", 0)  # the draft starts with the call, not after 32 tokens
    auto = verispec.generate(target, prompt, draft=str(path), max_new_tokens=40)
    assert auto.stats.drafter.startswith("StagedDrafter")  # (then perhaps prompt lookup: `DecodeBatch._judge_start`)
    assert auto.token_ids == verispec.generate(target, prompt, drafter="none", max_new_tokens=40).token_ids


def test_a_named_draft_beside_a_q8_target_scores_a_smaller_head_that_reads_its_text(tmp_path):
    """`load_draft`'s vocab: the head scores the first N ids, the specials and the text's own tokens (one copy per
    draft and size, kept, so costs measured on it carry over); "auto" leaves a vocabulary under twice
    DRAFT_HEAD_TOKENS whole (this tiny one); output stays the target's."""
    from verispec.api import DRAFT_HEAD_TOKENS, load_draft

    _, path = tiny_gguf(tmp_path, head_kind=None)
    target = verispec.load(str(path), numerics="q8")
    whole = load_draft(str(path), target)
    assert whole.output_ids is None and whole.vocab_size < 2 * DRAFT_HEAD_TOKENS
    small = load_draft(str(path), target, vocab=40)
    assert small is load_draft(str(path), target, vocab=40) and small.name.endswith("-vocab40+read")
    assert load_draft(str(path), target, vocab=None) is whole
    with pytest.raises(VerispecError, match="vocab"):
        load_draft(str(path), target, vocab=0)
    prompt = [5, 17, 33, 2, 64, 9, 41, 12, 5, 17, 33, 2, 64, 90, 71, 5, 17]
    plain = verispec.generate(target, prompt, drafter="none", max_new_tokens=40).token_ids
    for drafter in ("staged", "model"):
        assert verispec.generate(target, prompt, draft=small, drafter=drafter, max_new_tokens=40).token_ids == plain


def test_files_it_cannot_run_this_way_are_refused_clearly(tmp_path):
    with pytest.raises(VerispecError, match="zoo name .* or a .gguf file"):
        verispec.load(str(tmp_path), numerics="q8")
    with pytest.raises(VerispecError, match="numerics must be"):
        verispec.load("x.gguf", numerics="q4")
    writer = GGUFWriter(str(tmp_path / "q2_k.gguf"), "qwen2")
    writer.add_block_count(0)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(512)
    writer.add_head_count(4)
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, 256), np.float32))
    writer.add_tensor("output.weight", np.zeros((VOCAB, 84), np.uint8), raw_dtype=GGMLQuantizationType.Q2_K)
    for call in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        call()
    with pytest.raises(VerispecError, match="output.weight is Q2_K"):
        gguf_q8.load(tmp_path / "q2_k.gguf")
    metadata, tensors = gguf_q8.read(tmp_path / "q2_k.gguf")
    del metadata["qwen2.attention.head_count"]
    with pytest.raises(VerispecError, match="no qwen2.attention.head_count"):
        gguf_q8._config(metadata, VOCAB)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_embedding_rows_are_ggml_dequantize_bit_for_bit(kind):
    """GGUFMatrix.rows (the C lookup) gives bitwise gguf-py's dequantize of those rows (ggml's formulas),
    subnormal and negative half-float scales included; ids out of range raise."""
    rng = np.random.default_rng(KIND[kind])
    raw = random_blocks(kind, 9, 512, rng)
    size = BYTES[kind]
    scale_at = (208,) if kind == "Q6_K" else (0, 2)
    raw[3].reshape(2, size)[0, scale_at[0]:scale_at[0] + 2] = np.frombuffer(np.float16(3e-6).tobytes(), np.uint8)  # subnormal
    raw[4].reshape(2, size)[1, scale_at[-1]:scale_at[-1] + 2] = np.frombuffer(np.float16(-0.75).tobytes(), np.uint8)
    matrix = kernels.GGUFMatrix(torch.from_numpy(raw), KIND[kind])
    ids = torch.tensor([[3, 0, 8], [4, 4, 1]])
    got = matrix.rows(ids)
    want = dequantize(raw[ids.reshape(-1).numpy()], getattr(GGMLQuantizationType, kind)).reshape(2, 3, 512)
    assert got.shape == (2, 3, 512)
    assert np.array_equal(got.numpy().view(np.int32), want.astype(np.float32).view(np.int32))
    with pytest.raises(IndexError):
        matrix.rows(torch.tensor([9]))
