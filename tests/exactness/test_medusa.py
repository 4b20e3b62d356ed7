"""Medusa-1 heads: the target's final-hidden-state tap, the heads, their training, files and drafter.

Tiny random-weight targets (llama and qwen2) for the contracts; `smollm2-135m` (slow) for a real training
run and greedy identity.
"""

from __future__ import annotations

import pytest
import torch

from conftest import on_path, tiny_llama, tiny_qwen2
from verispec.models.native import NativeCausalLM

LAYERS = 4
FINAL = LAYERS  # tap index of the final normed hidden state
PROMPT = [1, 5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    """(HF model, native model over the same weights)."""
    hf = {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param](seed=0, layers=LAYERS)
    return hf, NativeCausalLM.from_hf(hf)


# --- the final tap --------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["fused", "loop", "torch"])
@pytest.mark.parametrize("taps", [(FINAL,), (1, FINAL), (FINAL, 2)], ids=str)
def test_final_tap_leaves_logits_bitwise_equal(pair, path, taps, monkeypatch):
    _, model = pair
    model = on_path(model, "torch" if path == "torch" else "kernels", monkeypatch)
    if path == "loop":
        monkeypatch.setattr(model, "fused_layers", False)
    tokens = torch.tensor([PROMPT])
    for last_only in (False, True):
        for chunks in ([tokens[:, :16], tokens[:, 16:17], tokens[:, 17:]], [tokens]):
            plain_cache, tapped_cache = model.new_cache(1), model.new_cache(1)
            for chunk in chunks:
                plain = model.forward(chunk, plain_cache, last_only=last_only)
                logits, hidden = model.forward(chunk, tapped_cache, last_only=last_only, taps=taps)
                assert torch.equal(plain, logits)
                assert hidden.shape == (1, chunk.shape[1], len(taps) * model.hidden_size)
            assert torch.equal(model.forward(tokens[:, :2], plain_cache), model.forward(tokens[:, :2], tapped_cache))


@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_final_tap_is_what_the_lm_head_reads(pair, path, monkeypatch):
    hf, model = pair
    model = on_path(model, path, monkeypatch)
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        reference = hf.model(input_ids=tokens, output_hidden_states=True).hidden_states
    assert len(reference) == LAYERS + 1
    head = hf.model.get_output_embeddings().weight.detach()
    for last_only in (False, True):
        logits, hidden = model.forward(tokens, model.new_cache(1), last_only=last_only, taps=(FINAL,))
        torch.testing.assert_close(hidden, reference[FINAL], rtol=1e-4, atol=1e-4)
        # the LM head of the tap's last row is the pass's logits
        torch.testing.assert_close(hidden[:, -1:] @ head.T, logits[:, -1:], rtol=1e-4, atol=1e-4)
    _, hf_hidden = hf.forward(tokens, hf.new_cache(1), taps=(FINAL,))
    torch.testing.assert_close(hf_hidden, reference[FINAL])
