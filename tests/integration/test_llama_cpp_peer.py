"""llama.cpp as a real peer: its own binary, built from the llama-cpp-python sdist by
bench/peers/build_llama_cpp.sh, run on the zoo's GGUF file beside verispec's numerics="q8" mode.
Skipped (with the reason) where the binary has not been built."""

from __future__ import annotations

import pytest
import torch

import verispec
from verispec import zoo
from verispec.errors import VerispecError
from verispec.peers import LlamaCpp
from verispec.text import encode_prompt

Q8_MODEL = "qwen2.5-coder-1.5b"  # Q4_K_M with Q4_K and Q6_K matrices only, which numerics="q8" runs
PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "import json\n\n\ndef load_config(path):\n"]


@pytest.fixture(scope="module")
def peer():
    try:
        return LlamaCpp()
    except VerispecError as e:
        pytest.skip(str(e))


def test_missing_binary_says_how_to_build_it(tmp_path):
    with pytest.raises(VerispecError, match="build_llama_cpp.sh"):
        LlamaCpp(tmp_path)


def _agreeing(peer, target, name: str) -> list[int]:
    """For each prompt, how many leading greedy tokens of llama.cpp's completion equal verispec's."""
    agreeing = []
    for prompt in PROMPTS:
        ids = encode_prompt(target.tokenizer, prompt, chat=False)
        ours = verispec.generate(target, ids, drafter="none", max_new_tokens=24).token_ids
        run = peer.complete(zoo.gguf_path(name), prompt, max_new_tokens=24, threads=2)
        assert run.prompt_tokens == len(ids)
        assert 0 < run.new_tokens <= 25 and run.seconds > 0
        theirs = target.tokenizer.encode(run.text, add_special_tokens=False)
        agreeing.append(next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours))))
    return agreeing


def test_llama_cpp_reads_the_same_prompt_and_agrees_with_float32(peer):
    """smollm2-135m: llama.cpp runs the zoo's GGUF (Q4_1/Q8_0 blocks, 8-bit activations), verispec the float32
    model it stands for; the numbers differ by the activations' rounding, the greedy text starts the same."""
    torch.set_num_threads(2)
    agreeing = _agreeing(peer, verispec.load("smollm2-135m"), "smollm2-135m")
    assert max(agreeing) >= 8, agreeing


@pytest.mark.skipif(not zoo.is_pulled(Q8_MODEL), reason=f"{Q8_MODEL} is not in the zoo cache (verispec pull {Q8_MODEL})")
def test_llama_cpp_reads_the_same_prompt_and_agrees_with_q8(peer):
    """Both read the prompt as the same tokens, and llama.cpp's greedy text starts as verispec's q8 greedy
    text: the same file and the same integer dot products (only float sums differ), so a split can come
    only where two tokens are nearly tied."""
    torch.set_num_threads(2)
    agreeing = _agreeing(peer, verispec.load(Q8_MODEL, numerics="q8"), Q8_MODEL)
    assert max(agreeing) >= 16, agreeing


def test_llama_cpp_agrees_with_q8_on_a_file_of_32_weight_blocks(peer):
    """smollm2-135m's Q4_1 / Q8_0 blocks in q8 mode (activations rounded as llama.cpp's Q8_1 / Q8_0): the greedy
    text starts as llama.cpp's. (Measured over 5 prompts and 64 tokens it splits from llama.cpp's exactly where
    the float32 model's does: at near ties, which the attention's and the caches' other float arithmetic decide.)"""
    torch.set_num_threads(2)
    agreeing = _agreeing(peer, verispec.load("smollm2-135m", numerics="q8"), "smollm2-135m")
    assert max(agreeing) >= 8, agreeing


def test_llama_cpp_speculative_runs_and_reports_its_acceptance(peer):
    """llama.cpp's own speculation (llama-speculative-simple), the file drafting for itself: every draft is
    accepted, and the timings are read."""
    gguf = zoo.gguf_path("smollm2-135m")
    run = peer.speculative(gguf, gguf, PROMPTS[0], max_new_tokens=24, threads=2)
    assert run.prompt_tokens > 0 and run.new_tokens >= 24 and run.seconds > 0
    assert run.drafted > 0 and run.accepted == run.drafted


def test_the_race_runs_llama_cpp_plain_and_speculative_beside_verispec(peer, tmp_path):
    """`verispec bench --method ... --peer llama.cpp --peer-draft DRAFT`: llama.cpp's plain and speculative decoding of
    the same file and prompts, in the same run, as columns of the report."""
    import json

    from verispec.cli import main

    assert main(["bench", "humaneval", "--target", "smollm2-135m", "--numerics", "q8", "--method", "ngram",
                 "--per-category", "1", "--max-new-tokens", "12", "--peer", "llama.cpp", "--peer-draft", "smollm2-135m",
                 "--out", str(tmp_path), "--name", "race"]) == 0
    data = json.loads((tmp_path / "race.json").read_text())
    row = data["rows"][0]["methods"]
    assert row["llama.cpp"]["tokens"] > 0 and row["llama.cpp speculative"]["tokens"] > 0
    assert row["llama.cpp speculative"]["accepted"] == row["llama.cpp speculative"]["drafted"] > 0  # it drafts for itself
    assert set(data["summary"]["table"]["all"]) == {"plain", "ngram", "llama.cpp", "llama.cpp speculative"}
    assert "| llama.cpp speculative |" in (tmp_path / "race.md").read_text()
