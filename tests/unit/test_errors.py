"""Every input a user can get wrong raises VerispecError with a message that says what to do."""

from __future__ import annotations

import pytest

import verispec
from verispec import VerispecError
from conftest import VOCAB, tiny_gpt2, tiny_llama


@pytest.fixture(scope="module")
def target():
    return tiny_llama()


def expect_error(match: str, **kwargs):
    with pytest.raises(VerispecError, match=match):
        verispec.generate(**kwargs)


def test_unknown_model_name():
    with pytest.raises(VerispecError, match="smollm2-135m"):  # the message lists what exists
        verispec.load("no-such-model")


def test_draft_with_a_different_vocabulary(target):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from verispec.models.hf import HFCausalLM

    torch.manual_seed(0)
    other = HFCausalLM(LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB + 7, hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)))
    expect_error("same vocabulary|share one vocabulary", target=target, prompt=[1, 2], draft=other, drafter="model")


@pytest.mark.slow
def test_draft_with_a_different_tokenizer():
    import copy

    from verispec import zoo
    from verispec.models.hf import HFCausalLM

    zoo.pull("smollm2-135m")
    smollm = verispec.load("smollm2-135m")

    tok = copy.deepcopy(smollm.tokenizer)
    tok.add_tokens(["<an-extra-token>"])
    other = HFCausalLM(smollm.hf_model, tok, name="other-tokenizer")
    with pytest.raises(VerispecError, match="different tokenizers"):
        verispec.generate(smollm, "hi", draft=other, drafter="hybrid", max_new_tokens=2)
    # drafter="model" (and "auto") draft through text across tokenizers instead
    result = verispec.generate(smollm, "hi", draft=other, drafter="model", max_new_tokens=2)
    assert result.stats.drafter == "CrossTokenizerDrafter"


def _narrow_llama(hidden: int, intermediate: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))


@pytest.mark.parametrize("weight_dtype, hidden, intermediate, message", [
    ("int4", 32, 64, "divisible by 64.*int8"),  # int4 groups of 64
    ("q4_0", 48, 80, "blocks of 32"),           # ggml's blocks of 32
    ("q3_0", 64, 80, "blocks of 32"),           # the 3-bit gate and up blocks too (their rows are `hidden` wide)
])
def test_rounded_draft_needs_widths_in_whole_groups(weight_dtype, hidden, intermediate, message):
    with pytest.raises(VerispecError, match=message):
        verispec.load(_narrow_llama(hidden, intermediate), weight_dtype=weight_dtype)


def test_unknown_weight_dtype_lists_the_formats():
    with pytest.raises(VerispecError, match="int4"):
        verispec.load(_narrow_llama(32, 64), weight_dtype="int3")


def test_prompt_longer_than_context(target):
    expect_error("context window", target=target, prompt=[1] * 600)


@pytest.mark.parametrize("draft_len", [0, -1, 2.5, "four"])
def test_bad_draft_len(target, draft_len):
    expect_error("draft_len", target=target, prompt=[1, 2], draft_len=draft_len)


@pytest.mark.parametrize("temperature", [-0.1, "hot"])
def test_bad_temperature(target, temperature):
    expect_error("temperature", target=target, prompt=[1, 2], temperature=temperature)


@pytest.mark.parametrize("top_p", [0.0, 1.5, -1])
def test_bad_top_p(target, top_p):
    expect_error("top_p", target=target, prompt=[1, 2], top_p=top_p)


def test_bad_top_k(target):
    expect_error("top_k", target=target, prompt=[1, 2], top_k=-3)


@pytest.mark.parametrize("prompt", ["", [], [[1, 2], []], None])
def test_empty_prompt(target, prompt):
    expect_error("empty|no tokens|non-empty", target=target, prompt=prompt)


def test_batch_with_a_bad_element(target):
    expect_error("prompt 1 of the batch", target=target, prompt=[[1, 2], 3.5])


def test_token_ids_outside_vocabulary(target):
    expect_error("outside the vocabulary", target=target, prompt=[1, VOCAB + 5])


def test_text_prompt_without_tokenizer(target):
    expect_error("no tokenizer", target=target, prompt="hello")


def test_model_drafter_without_draft(target):
    expect_error("needs a draft model", target=target, prompt=[1, 2], drafter="model")


def test_unknown_drafter(target):
    expect_error("unknown drafter", target=target, prompt=[1, 2], drafter="medusa-9000")


@pytest.mark.parametrize("max_new_tokens", [0, -5, 1.5, None, "many"])
def test_bad_max_new_tokens(target, max_new_tokens):
    expect_error("max_new_tokens", target=target, prompt=[1, 2], max_new_tokens=max_new_tokens)


def test_a_device_this_build_cannot_use():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(VerispecError, match="needs CUDA.*device='cpu'"):
        verispec.load("smollm2-135m", device="cuda")
    with pytest.raises(VerispecError, match="unknown device"):
        verispec.load("smollm2-135m", device="gpu-please")


def test_system_prompt_needs_chat(target):
    expect_error("chat=True", target=target, prompt=[1, 2], system="be brief")


def test_bad_stop(target):
    expect_error("stop", target=target, prompt=[1, 2], stop=[""])


def test_errors_are_value_errors():
    assert issubclass(VerispecError, ValueError)


def test_cli_reports_errors_cleanly(capsys):
    from verispec.cli import main

    assert main(["generate", "hi", "--target", "no-such-model"]) == 2
    assert "verispec: error:" in capsys.readouterr().err
