"""Quantized matrices kept on disk (`models.stored`), the int4 self-draft copy and a draft's 32-weight blocks: a new
process reads the very codes and scales it would have made, changed weights get a copy of their own, and a damaged
or foreign file is made again."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import verispec
from conftest import tiny_llama, tiny_qwen2
from test_greedy_equivalence import PROMPTS, plain
from verispec.models import kernels, stored
from verispec.models.native import NativeCausalLM


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty cache root, and every model big enough to store its copy."""
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    monkeypatch.setattr(stored, "STORE_MIN_WEIGHTS", 0)
    return tmp_path


def stored_files(home):
    return sorted((home / "copies").glob("*.safetensors")) if (home / "copies").exists() else []


def same_matrices(a, b) -> bool:
    return all(torch.equal(x.values, y.values) and torch.equal(x.scale, y.scale) for x, y in zip(a.matrices(), b.matrices(), strict=True))


def test_a_stored_copy_is_read_back_instead_of_made(home, monkeypatch):
    hf = tiny_qwen2(seed=3)
    source = NativeCausalLM.from_hf(hf)
    made = stored.int4_copy(source)
    assert stored_files(home) == [stored.path_for(source, stored.fingerprint(source))]
    target = NativeCausalLM.from_hf(hf)  # as in a new process: the same weights, no copy in memory

    def no_quantizing(*args, **kwargs):
        raise AssertionError("the stored copy should have been read, not made")

    monkeypatch.setattr(kernels.Int4Matrix, "quantize", no_quantizing)
    read = stored.int4_copy(target)
    assert same_matrices(read, made) and read.weight_dtype == torch.quint4x2 and read.name == made.name
    for prompt in PROMPTS:  # the same drafts as the copy it was stored from, and plain decoding's tokens
        got = verispec.generate(target, prompt, drafter="self", draft=read, draft_len=3, max_new_tokens=30)
        want = verispec.generate(target, prompt, drafter="self", draft=made, draft_len=3, max_new_tokens=30)
        assert got.token_ids == want.token_ids == plain(target, prompt, 30)
        assert (got.stats.drafted_tokens, got.stats.accepted_tokens) == (want.stats.drafted_tokens, want.stats.accepted_tokens)


def test_self_drafter_stores_the_copy_it_makes(home):
    target = NativeCausalLM.from_hf(tiny_llama(seed=4))
    result = verispec.generate(target, PROMPTS[0], drafter="self", max_new_tokens=20)
    assert result.token_ids == plain(target, PROMPTS[0], 20)
    assert len(stored_files(home)) == 1


def test_changed_weights_get_a_copy_of_their_own(home):
    hf = tiny_llama(seed=5)
    before = stored.fingerprint(NativeCausalLM.from_hf(hf))
    with torch.no_grad():  # one weight, off the fingerprint's strided sample
        hf.model.model.layers[1].mlp.down_proj.weight[0, 1] += 1e-3
    after = stored.fingerprint(NativeCausalLM.from_hf(hf))
    assert before != after
    assert stored.fingerprint(NativeCausalLM.from_hf(hf)) == after  # and the same weights, the same name


def test_a_damaged_file_is_made_again(home, caplog):
    hf = tiny_qwen2(seed=6)
    made = stored.int4_copy(NativeCausalLM.from_hf(hf))
    [path] = stored_files(home)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="verispec.models.stored"):
        again = stored.int4_copy(NativeCausalLM.from_hf(hf))
    assert "making it again" in caplog.text
    assert same_matrices(again, made)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="verispec.models.stored"):
        stored.int4_copy(NativeCausalLM.from_hf(hf))  # rewritten whole: read without complaint
    assert caplog.text == ""


def test_a_file_that_does_not_fit_the_model_is_made_again(home, caplog):
    small, other = NativeCausalLM.from_hf(tiny_llama(seed=7)), NativeCausalLM.from_hf(tiny_llama(seed=7, layers=3))
    stored.int4_copy(other)
    [foreign] = stored_files(home)
    path = stored.path_for(small, stored.fingerprint(small))
    foreign.rename(path)  # another model's matrices under this model's name
    with caplog.at_level(logging.WARNING, logger="verispec.models.stored"):
        copy = stored.int4_copy(small)
    assert "matrix 14 does not fit" in caplog.text  # the 3-layer model's third layer where this one has its head
    assert same_matrices(copy, small.lower_precision_copy(torch.quint4x2))


def test_small_models_and_the_off_switch_store_nothing(home, monkeypatch):
    monkeypatch.setattr(stored, "STORE_MIN_WEIGHTS", 200_000_000)
    stored.int4_copy(NativeCausalLM.from_hf(tiny_llama(seed=8)))
    assert stored_files(home) == []
    monkeypatch.setattr(stored, "STORE_MIN_WEIGHTS", 0)
    monkeypatch.setattr(kernels.config, "_current", dataclasses.replace(kernels.config.current(), store_copies=False))
    stored.int4_copy(NativeCausalLM.from_hf(tiny_llama(seed=8)))
    assert stored_files(home) == []


def test_an_unwritable_cache_still_gives_the_copy(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("VERISPEC_HOME", str(blocker))
    monkeypatch.setattr(stored, "STORE_MIN_WEIGHTS", 0)
    target = NativeCausalLM.from_hf(tiny_llama(seed=9))
    with caplog.at_level(logging.WARNING, logger="verispec.models.stored"):
        copy = stored.int4_copy(target)
    assert "could not store" in caplog.text
    assert same_matrices(copy, target.lower_precision_copy(torch.quint4x2))


def test_auto_drafts_short_calls_with_a_stored_copy(home, monkeypatch):
    """A short call would not pay for making the copy, but reading a stored one costs little: "self"."""
    from verispec.api import SELF_COPY_MIN_TOKENS, resolve_drafter

    hf = tiny_llama(seed=10)
    first = NativeCausalLM.from_hf(hf)
    assert resolve_drafter(first, None, "auto", 4) == "ngram"
    verispec.generate(first, PROMPTS[0], max_new_tokens=SELF_COPY_MIN_TOKENS)  # makes and stores it
    later = NativeCausalLM.from_hf(hf)  # another process, as it were
    result = verispec.generate(later, PROMPTS[1], max_new_tokens=4)
    assert result.stats.drafter == "SharedCacheDrafter" and result.token_ids == plain(later, PROMPTS[1], 4)

    def no_fingerprint(model):
        raise AssertionError("no copy under this name is stored: nothing to fingerprint")

    monkeypatch.setattr(stored, "fingerprint", no_fingerprint)
    other = NativeCausalLM.from_hf(tiny_qwen2(seed=10))
    assert resolve_drafter(other, None, "auto", 4) == "ngram"


def test_storing_a_copy_replaces_older_copies_under_the_same_name(home):
    hf = tiny_llama(seed=11)
    first = NativeCausalLM.from_hf(hf)
    stored.int4_copy(first)
    [old] = stored_files(home)
    neighbour = NativeCausalLM.from_hf(tiny_llama(seed=11))
    neighbour.name = f"{first.name}-int4"  # a name that starts like this one's copies: left alone
    stored.int4_copy(neighbour)
    with torch.no_grad():
        hf.model.model.layers[0].self_attn.q_proj.weight.mul_(1.5)  # re-trained, say
    edited = NativeCausalLM.from_hf(hf)
    stored.int4_copy(edited)
    assert stored_files(home) == sorted([stored.path_for(edited, stored.fingerprint(edited)),
                                         stored.path_for(neighbour, stored.fingerprint(neighbour))])
    assert not old.exists()


def test_half_written_files_of_dead_writers_are_cleared(home):
    import os
    import time

    target = NativeCausalLM.from_hf(tiny_llama(seed=12))
    path = stored.path_for(target, stored.fingerprint(target))
    path.parent.mkdir(parents=True)
    stale, fresh = path.with_name(f".{path.name}.1.partial"), path.with_name(f".{path.name}.2.partial")
    for left in (stale, fresh):
        left.write_bytes(b"half a copy")
    hour_ago = time.time() - 3700
    os.utime(stale, (hour_ago, hour_ago))
    stored.int4_copy(target)
    assert not stale.exists() and fresh.exists()  # another process may still be writing that one
    assert stored_files(home) == [path]


def same_blocks(a, b) -> bool:
    return all(x.kind == y.kind and torch.equal(x.blocks, y.blocks) for x, y in zip(a.matrices(), b.matrices(), strict=True))


@pytest.mark.parametrize("weight_dtype", ["q4_0", "q3_0"])
def test_a_drafts_blocks_are_stored_and_read_back_instead_of_made(home, monkeypatch, weight_dtype):
    """A draft loaded with 32-weight blocks (the default beside a q8 target) rounds its matrices once: a new
    process reads the very blocks back, and drafts with them as the made ones do."""
    if not kernels.available():
        pytest.skip("Q4_0 and Q3_0 blocks run on verispec's q8 kernels, unavailable here")
    target = NativeCausalLM.from_hf(tiny_qwen2(seed=13))
    hf = tiny_qwen2(seed=13)
    made = NativeCausalLM.from_hf(hf, weight_dtype=weight_dtype)
    [path] = stored_files(home)
    assert path.name.startswith(f"{hf.name}-{weight_dtype}-")

    def no_rounding(*args, **kwargs):
        raise AssertionError("the stored blocks should have been read, not made")

    rounding = kernels.GGUFMatrix.quantize
    monkeypatch.setattr(kernels.GGUFMatrix, "quantize", no_rounding)
    read = NativeCausalLM.from_hf(hf, weight_dtype=weight_dtype)  # as in a new process
    assert same_blocks(read, made) and read.name == made.name and read.numerics == "q8"
    for prompt in PROMPTS[:2]:
        expected = plain(target, prompt, 16)
        assert verispec.generate(target, prompt, draft=read, draft_len=4, max_new_tokens=16).token_ids == expected
    monkeypatch.setattr(kernels.GGUFMatrix, "quantize", rounding)
    other = "q3_0" if weight_dtype == "q4_0" else "q4_0"
    NativeCausalLM.from_hf(hf, weight_dtype=other)  # the other kind: a copy of its own beside this one
    assert len(stored_files(home)) == 2


def test_damaged_or_foreign_blocks_are_made_again(home, caplog):
    if not kernels.available():
        pytest.skip("Q4_0 and Q3_0 blocks run on verispec's q8 kernels, unavailable here")
    hf = tiny_qwen2(seed=14)
    made = NativeCausalLM.from_hf(hf, weight_dtype="q3_0")
    [path] = stored_files(home)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="verispec.models.stored"):
        again = NativeCausalLM.from_hf(hf, weight_dtype="q3_0")
    assert "making it again" in caplog.text and same_blocks(again, made)
    caplog.clear()
    NativeCausalLM.from_hf(tiny_qwen2(seed=14, layers=3), weight_dtype="q3_0")  # same name: its copy replaces this one's
    [foreign] = stored_files(home)
    float_model = NativeCausalLM.from_hf(hf, panels=False)  # the matrices the blocks are rounded from, row-major as then
    foreign.rename(stored.path_for(float_model, stored.fingerprint(float_model, "q3_0", tuple(m.kind for m in made.matrices())), "q3_0"))
    with caplog.at_level(logging.WARNING, logger="verispec.models.stored"):
        again = NativeCausalLM.from_hf(hf, weight_dtype="q3_0")
    assert "does not fit" in caplog.text and same_blocks(again, made)
