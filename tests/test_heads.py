"""Trained draft heads: the target's hidden-state taps, the EAGLE-3 head, its training and its drafter.

Tiny random-weight models for the contracts; `smollm2-135m` (slow) for a real training run and greedy
identity of the eagle3 drafter.
"""

from __future__ import annotations

import pytest
import torch

from conftest import on_path, tiny_llama, tiny_qwen2
from verispec.models.native import NativeCausalLM

TAPS = (2, 4, 5)  # EAGLE-3's (2, N/2, N-3) for 8 layers
PROMPT = [1, 5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    """(HF model, native model over the same weights), 8 layers so taps are distinct."""
    hf = {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param](seed=0, layers=8)
    return hf, NativeCausalLM.from_hf(hf)


@pytest.mark.parametrize("path", ["fused", "loop", "torch"])
def test_taps_leave_logits_bitwise_equal(pair, path, monkeypatch):
    _, model = pair
    model = on_path(model, "torch" if path == "torch" else "kernels", monkeypatch)
    if path == "loop":
        monkeypatch.setattr(model, "fused_layers", False)
    tokens = torch.tensor([PROMPT])
    for chunks in ([tokens[:, :16], tokens[:, 16:17], tokens[:, 17:]], [tokens]):  # small passes; one big pass
        plain_cache, tapped_cache = model.new_cache(1), model.new_cache(1)
        for chunk in chunks:
            plain = model.forward(chunk, plain_cache)
            logits, hidden = model.forward(chunk, tapped_cache, taps=TAPS)
            assert torch.equal(plain, logits)
            assert hidden.shape == (1, chunk.shape[1], len(TAPS) * model.hidden_size)
        # the rest of the decode sees the same cache
        assert torch.equal(model.forward(tokens[:, :2], plain_cache), model.forward(tokens[:, :2], tapped_cache))


@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_taps_are_the_inputs_of_those_layers(pair, path, monkeypatch):
    hf, model = pair
    model = on_path(model, path, monkeypatch)
    tokens = torch.tensor([PROMPT])
    reference = hf.model(input_ids=tokens, output_hidden_states=True).hidden_states  # [i]: input of layer i
    expected = torch.cat([reference[i] for i in TAPS], -1)
    for chunks in ([tokens[:, :4], tokens[:, 4:12], tokens[:, 12:]], [tokens]):
        cache = model.new_cache(1)
        hidden = torch.cat([model.forward(chunk, cache, taps=TAPS)[1] for chunk in chunks], 1)
        torch.testing.assert_close(hidden, expected, rtol=1e-4, atol=1e-4)
    # last_only still taps every position (a prefill feeds the head the whole prompt)
    logits, hidden = model.forward(tokens, model.new_cache(1), last_only=True, taps=TAPS)
    assert logits.shape[1] == 1
    torch.testing.assert_close(hidden, expected, rtol=1e-4, atol=1e-4)
    _, hf_hidden = hf.forward(tokens, hf.new_cache(1), taps=TAPS)
    torch.testing.assert_close(hf_hidden, expected)


def test_bad_taps_raise(pair):
    hf, model = pair
    for backend in (hf, model):
        with pytest.raises(ValueError, match="taps"):
            backend.forward(torch.tensor([[1, 2]]), backend.new_cache(1), taps=(8,))
