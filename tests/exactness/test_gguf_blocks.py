"""Exact GGUF k-quant blocks: the weights the kernels rebuild are gguf's own dequantization, bit for bit,
and every product equals the float32 matrix's. The reference is the `gguf` package's dequantizer,
an implementation independent of ours."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize
from transformers import Qwen2Config, Qwen2ForCausalLM

import verispec
from verispec import api
from verispec.models import gguf_blocks, kernels
from verispec.models.hf import HFCausalLM
from verispec.models.native import NativeCausalLM

from conftest import EOS, VOCAB

pytestmark = pytest.mark.skipif(not kernels.available(), reason="exact kernels unavailable here")

BYTES = {"Q4_K": 144, "Q6_K": 210}


def random_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random but well-formed blocks of an [n, k] matrix: random codes, finite half-precision scales."""
    raw = rng.integers(0, 256, size=(n * k // 256, BYTES[kind]), dtype=np.uint8)
    scales = (rng.standard_normal((raw.shape[0], 2 if kind == "Q4_K" else 1)) * 0.02).astype(np.float16)
    where = slice(0, 4) if kind == "Q4_K" else slice(208, 210)
    raw[:, where] = scales.view(np.uint8).reshape(raw.shape[0], -1)
    return raw


def reference(kind: str, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    """gguf's own float32 dequantization: what a converted model holds."""
    dense = dequantize(raw.reshape(n, -1), getattr(GGMLQuantizationType, kind)).reshape(n, k)
    return torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32))


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("n, k", [(12, 256), (9, 768)])  # 9 rows: a tile of 4 twice and an edge row
def test_blocks_rebuild_the_reference_weights_and_products(kind, n, k):
    rng = np.random.default_rng(n * k)
    raw = random_blocks(kind, n, k, rng)
    dense = reference(kind, raw, n, k)
    matrix = gguf_blocks.exact_matrix(kind, raw, dense)
    assert matrix is not None
    assert torch.equal(matrix.dequantize().view(torch.int32), dense.view(torch.int32))
    x = torch.randn(kernels.MAX_ROWS, k, generator=torch.Generator().manual_seed(n * k))
    whole = kernels.rowwise_linear(x, matrix)
    # bitwise the float32 kernel's numbers, at every width (registers for 1-2 rows, a scratch beyond)
    for rows in range(1, kernels.MAX_ROWS + 1):
        assert torch.equal(kernels.rowwise_linear(x[:rows], matrix), kernels.rowwise_linear(x[:rows], dense))
        assert torch.equal(kernels.rowwise_linear(x[:rows], matrix), whole[:rows])
    # within float32 summation's error bound, k rounding steps of at most 2^-24 of the sum of |x w|
    bound = k * 2.0 ** -24 * (x.double().abs() @ dense.double().abs().T)
    assert ((whole.double() - x.double() @ dense.double().T).abs() <= bound).all()


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_blocks_that_do_not_rebuild_the_matrix_are_refused(kind):
    rng = np.random.default_rng(7)
    raw = random_blocks(kind, 8, 256, rng)
    dense = reference(kind, raw, 8, 256)
    dense[5, 100] = torch.nextafter(dense[5, 100], torch.tensor(float("inf")))  # one ulp, one weight
    assert gguf_blocks.exact_matrix(kind, raw, dense) is None
    assert gguf_blocks.exact_matrix(kind, raw, dense[:, :128].contiguous()) is None  # not whole blocks


def test_a_group_of_mixed_formats_gives_each_product_its_own_call_would():
    rng = np.random.default_rng(3)
    q4 = gguf_blocks.exact_matrix("Q4_K", raw := random_blocks("Q4_K", 16, 512, rng), reference("Q4_K", raw, 16, 512))
    q6 = gguf_blocks.exact_matrix("Q6_K", raw := random_blocks("Q6_K", 8, 512, rng), reference("Q6_K", raw, 8, 512))
    plain = torch.randn(12, 512)
    linears = [kernels.Linear(w) for w in (q4, q6, plain)]
    group = kernels.LinearGroup(linears)
    for rows in (1, 2, 5):
        x = torch.randn(rows, 512)
        outs = group(x, tuple(torch.empty(rows, lin.n) for lin in linears))
        for out, lin in zip(outs, linears):
            assert torch.equal(out, lin(x, torch.empty(rows, lin.n)))


def tiny_gguf_qwen2(tmp_path, layers: int = 2):
    """A tiny Qwen2 whose matrices are the dequantized blocks of a GGUF file written next to it
    (llama.cpp's tensor names; q, k, o, gate, up as Q4_K, v, down and the head as Q6_K, like Q4_K_M)."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, eos_token_id=EOS, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).eval()
    rng = np.random.default_rng(11)
    writer = GGUFWriter(str(tmp_path / "tiny.gguf"), "qwen2")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(VOCAB)])  # metadata to skip over
    kinds = {"q_proj": ("self_attn", "attn_q", "Q4_K"), "k_proj": ("self_attn", "attn_k", "Q4_K"),
             "v_proj": ("self_attn", "attn_v", "Q6_K"), "o_proj": ("self_attn", "attn_output", "Q4_K"),
             "gate_proj": ("mlp", "ffn_gate", "Q4_K"), "up_proj": ("mlp", "ffn_up", "Q4_K"),
             "down_proj": ("mlp", "ffn_down", "Q6_K")}
    matrices = [(f"blk.{i}.{name}.weight", kind, getattr(getattr(layer, module), part))
                for i, layer in enumerate(model.model.layers) for part, (module, name, kind) in kinds.items()]
    matrices.append(("output.weight", "Q6_K", model.lm_head))
    with torch.no_grad():
        for name, kind, linear in matrices:
            n, k = linear.weight.shape
            raw = random_blocks(kind, n, k, rng)
            linear.weight.copy_(reference(kind, raw, n, k))
            writer.add_tensor(name, raw.reshape(n, -1), raw_dtype=getattr(GGMLQuantizationType, kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return HFCausalLM(model, name="tiny-gguf-qwen2"), tmp_path / "tiny.gguf"


def test_a_model_on_its_gguf_blocks_decodes_exactly_as_on_float32(tmp_path):
    hf, path = tiny_gguf_qwen2(tmp_path)
    blocks = gguf_blocks.tensor_blocks(path)
    assert len(blocks) == 2 * 7 + 1 and blocks["blk.0.attn_v.weight"][0] == "Q6_K"

    dense = NativeCausalLM.from_hf(hf, panels=False)  # row-major float32: the products the blocks rebuild
    packed = NativeCausalLM.from_hf(hf)
    assert packed.use_gguf_blocks(path) == (15, 15)
    assert isinstance(packed.layers[0].q, kernels.Q4KMatrix) and isinstance(packed.lm_head, kernels.Q6KMatrix)

    prompt = [5, 17, 33, 2, 64, 9, 41, 12]
    packed_cache, dense_cache = packed.new_cache(1), dense.new_cache(1)
    # a prefill, then steps of widths 1, 2 and 6: every logit bitwise equal
    for width in (len(prompt), 1, 2, 6):
        tokens = torch.tensor([prompt[:width]])
        assert torch.equal(packed.forward(tokens, packed_cache), dense.forward(tokens, dense_cache))

    plain = verispec.generate(dense, prompt, drafter="none", max_new_tokens=24)
    greedy = verispec.generate(packed, prompt, drafter="none", max_new_tokens=24)
    speculative = verispec.generate(packed, prompt, draft=NativeCausalLM.from_hf(hf, weight_dtype=torch.bfloat16),
                                    drafter="model", max_new_tokens=24)
    assert greedy.token_ids == plain.token_ids == speculative.token_ids


def test_load_uses_the_source_gguf_unless_told_not_to(tmp_path):
    hf, path = tiny_gguf_qwen2(tmp_path, layers=1)
    hf.source_gguf = path
    assert isinstance(api._wrap(hf, "auto", None, gguf_blocks=True).lm_head, kernels.Q6KMatrix)
    assert not isinstance(api._wrap(hf, "auto", None, gguf_blocks=False).lm_head, kernels.ExactBlocks)
    # a draft's own weight format wins: no blocks under an int8 copy
    assert isinstance(api._wrap(hf, "auto", torch.int8, gguf_blocks=True).lm_head, kernels.Int8Matrix)
