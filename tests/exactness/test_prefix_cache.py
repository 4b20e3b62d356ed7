"""Prefill in aligned chunks and the prefix cache: a hit, a pause between chunks or a batch mate changes no bit.

Tiny native models with small chunks (`native.PREFILL_CHUNK` patched to 16), so every claim is checked
offline on the same code paths a real model takes; `integration/test_prefix_cache_server.py` repeats the
important ones on real models through the server, with the negative controls that show what would differ.
"""

from __future__ import annotations

import queue

import pytest
import torch

import verispec
import verispec.models.native as native
from conftest import job, tiny_llama, tiny_qwen2
from verispec.api import make_drafter
from verispec.models.native import NativeCausalLM
import verispec.prefill as prefill_module
from verispec.prefill import Chunking, PromptReader, prefill
from verispec.prefix_cache import PrefixCache
from verispec.server.scheduler import Scheduler

CHUNK = 16


@pytest.fixture(params=["llama", "qwen2"])
def model(request, monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.setattr(native, "PREFILL_CHUNK", CHUNK)
    hf = {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param](seed=0)
    model = NativeCausalLM.from_hf(hf)
    assert model.prefill_chunk == CHUNK and model.shares_prefixes
    return model


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(4, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def kv(reader: PromptReader) -> tuple[torch.Tensor, torch.Tensor]:
    """Every key and value the reader's cache holds, [layers, kv_heads, n, head_dim] each."""
    return reader.cache.store.gather(0, torch.arange(reader.read))


@torch.inference_mode()
def next_logits(model, reader: PromptReader, token: int = 7) -> torch.Tensor:
    """The logits of one decode step after the prompt (the step is rolled back after)."""
    logits = model.forward(torch.tensor([[token]]), reader.cache)
    reader.cache.truncate(torch.tensor([reader.read]))
    return logits


def read(model, prompt, cache=None, budget=float("inf"), salt: str = "") -> PromptReader:
    reader = PromptReader(model, prompt, cache, salt=salt)
    while not reader.done:
        reader.advance(budget)
    return reader


def test_a_hit_gives_bitwise_the_keys_values_and_logits_of_a_fresh_read(model):
    prompt = tokens(75)
    fresh = read(model, prompt)
    cache = PrefixCache.for_model(model, 1 << 30)
    read(model, prompt[:40], cache)  # stores the two whole chunks [0, 16), [16, 32) only
    assert len(cache) == 2
    hit = read(model, prompt, cache)
    assert hit.reused == 32 and cache.hits == 32 and cache.queries == 40 + 75
    for mine, theirs in zip(kv(hit), kv(fresh)):
        assert torch.equal(mine, theirs)
    assert torch.equal(next_logits(model, hit), next_logits(model, fresh))
    # the whole prompt's chunks are stored now, and a third read takes them all (not the partial tail)
    again = read(model, prompt, cache)
    assert again.reused == 64 and torch.equal(next_logits(model, again), next_logits(model, fresh))


def test_a_prompt_read_a_chunk_at_a_time_is_the_prompt_read_at_once(model):
    prompt = tokens(75, seed=1)
    whole = read(model, prompt)
    passes = 0
    piecewise = PromptReader(model, prompt)
    while not piecewise.done:
        before = piecewise.read
        assert piecewise.advance(1) == min(CHUNK, 75 - before)  # one chunk, whatever the budget
        passes += 1
    assert passes == 5 and piecewise.read == 75
    assert torch.equal(next_logits(model, piecewise), next_logits(model, whole))
    # a budget short of a chunk reads nothing unless the reader must move on
    reader = PromptReader(model, prompt)
    assert reader.advance(CHUNK - 1, at_least_one=False) == 0
    assert reader.advance(CHUNK - 1) == CHUNK and reader.advance(2 * CHUNK + 3) == 2 * CHUNK


def test_a_rows_keys_and_values_do_not_depend_on_its_batch_mates(model):
    prompts = [tokens(70, seed=2), tokens(20, seed=3), tokens(45, seed=4)]
    together = prefill(model, prompts)
    for b, prompt in enumerate(prompts):
        alone = read(model, prompt)
        slots = together.slots.visible[b].nonzero().squeeze(1)
        for mine, theirs in zip(together.store.gather(b, slots), kv(alone)):
            assert torch.equal(mine, theirs)


def test_blocks_are_keyed_by_their_whole_prefix_and_counted_in_bytes(model):
    cache = PrefixCache.for_model(model, 1 << 30)
    a = tokens(48, seed=5)
    read(model, a, cache)
    block_bytes = 2 * len(model.layers) * model.num_kv_heads * CHUNK * model.head_dim * 4
    assert len(cache) == 3 and cache.bytes == 3 * block_bytes
    # the same second chunk after another first chunk is another block: not a hit past the first chunk
    b = tokens(16, seed=6) + a[16:]
    assert read(model, b, cache).reused == 0
    c = a[:16] + tokens(32, seed=7)
    assert read(model, c, cache).reused == 16


def test_least_recently_used_blocks_leave_first_and_deeper_ones_before_their_prefix(model):
    block_bytes = 2 * len(model.layers) * model.num_kv_heads * CHUNK * model.head_dim * 4
    cache = PrefixCache.for_model(model, 4 * block_bytes)
    a, b = tokens(48, seed=8), tokens(48, seed=9)
    read(model, a, cache)  # 3 blocks
    read(model, b, cache)  # 3 more: 2 must go, a's deepest first
    assert cache.bytes <= 4 * block_bytes and len(cache) == 4 and cache.evicted == 2
    assert read(model, a + [5], cache).reused == 16  # a's first chunk is left
    fresh = read(model, a + [5])
    assert torch.equal(next_logits(model, read(model, a + [5], cache)), next_logits(model, fresh))
    # a block larger than the whole budget is never stored
    tiny = PrefixCache.for_model(model, block_bytes - 1)
    read(model, a, tiny)
    assert len(tiny) == 0 and tiny.bytes == 0
    assert PrefixCache.for_model(model, 0) is None


def test_a_granular_model_reuses_a_prefix_to_the_token(model, monkeypatch):
    """Where every row gets the same numbers at any split (`prefill_chunk` None, as numerics="q8"), a hit ends
    where the tokens part, inside a block. Prompts here stay within the exact small passes."""
    if not model._kernels:
        pytest.skip("exact kernels unavailable here")
    monkeypatch.setattr(NativeCausalLM, "prefill_chunk", property(lambda self: None))
    cache = PrefixCache.for_model(model, 1 << 30)
    assert cache.granular and cache.block_tokens == 16
    prompt = tokens(30, seed=10)
    read(model, prompt[:23], cache)  # one whole block and a 7-token tail
    other = prompt[:21] + [9, 9, 9, 9, 9, 9, 9, 9, 9]
    hit = read(model, other, cache)
    assert hit.reused == 21
    fresh = read(model, other)
    for mine, theirs in zip(kv(hit), kv(fresh)):
        assert torch.equal(mine, theirs)
    assert torch.equal(next_logits(model, hit), next_logits(model, fresh))


def scheduler_for(model, cache=None, prefill_tokens=CHUNK) -> Scheduler:
    return Scheduler(model, lambda speculate: make_drafter(model, None, "ngram" if speculate else "none"), max_batch=4,
                     prefill_tokens=prefill_tokens, prefix_cache=cache)


def test_the_server_reuses_a_conversations_prefix_and_answers_the_same(model):
    first = tokens(40, seed=11)
    plain = verispec.generate(model, first, drafter="none", max_new_tokens=20).token_ids
    second = first + plain + tokens(25, seed=12)
    plain2 = verispec.generate(model, second, drafter="none", max_new_tokens=20).token_ids
    cache = PrefixCache.for_model(model, 1 << 30)
    scheduler = scheduler_for(model, cache)
    scheduler.start()
    try:
        for prompt, expected in ((first, plain), (second, plain2)):
            j, collector = job(prompt, max_new_tokens=20)
            scheduler.submit([j])
            assert collector.result() == expected
    finally:
        scheduler.stop()
    assert cache.hits == 32 and cache.queries == len(first) - 1 + len(second) - 1


def test_a_long_prompt_is_read_between_the_steps_of_running_streams(model):
    """A stream keeps receiving tokens while a long prompt is read a chunk per step, and both answer as alone."""
    model.eos_token_ids = frozenset()
    runner_prompt, long_prompt = tokens(10, seed=13), tokens(300, seed=14)
    expected = verispec.generate(model, long_prompt, drafter="none", max_new_tokens=8).token_ids
    expected_runner = verispec.generate(model, runner_prompt, drafter="none", max_new_tokens=120).token_ids
    scheduler = scheduler_for(model)
    scheduler.start()
    try:
        runner, runner_events = job(runner_prompt, max_new_tokens=120, draft=None)
        scheduler.submit([runner])
        got = list(runner_events.items.get(timeout=30).tokens)
        long_job, long_events = job(long_prompt, max_new_tokens=8, draft=None)
        scheduler.submit([long_job])
        during = 0  # the runner's deliveries before the long prompt's first token
        while long_events.items.empty():
            try:
                got += runner_events.items.get(timeout=0.01).tokens
                during += 1
            except queue.Empty:
                pass
        assert during >= 299 // CHUNK - 2  # about one step per chunk read (299 tokens: 19 chunks)
        assert long_events.result() == expected
        got += runner_events.result()
    finally:
        scheduler.stop()
    assert got == expected_runner


def test_a_granular_model_keeps_what_its_rows_decoded(model, monkeypatch):
    """Where a decode step writes the very keys and values a prompt read computes (row-exact numbers), a
    finished row's answer is stored too: the next turn reuses the whole first turn, and answers as plain."""
    if not model._kernels:
        pytest.skip("exact kernels unavailable here")
    monkeypatch.setattr(NativeCausalLM, "prefill_chunk", property(lambda self: None))
    model.eos_token_ids = frozenset()
    first = tokens(9, seed=15)
    answer = verispec.generate(model, first, drafter="none", max_new_tokens=12).token_ids
    second = first + answer + tokens(6, seed=16)  # 27 tokens: every pass within the exact small passes
    expected = verispec.generate(model, second, drafter="none", max_new_tokens=5).token_ids
    cache = PrefixCache.for_model(model, 1 << 30)
    scheduler = scheduler_for(model, cache)
    scheduler.start()
    try:
        for prompt, n, want in ((first, 12, answer), (second, 5, expected)):
            j, collector = job(prompt, max_new_tokens=n)  # drafted by prompt lookup: verify passes write the cache
            scheduler.submit([j])
            assert collector.result() == want
    finally:
        scheduler.stop()
    # the first turn's prompt and all of its answer but the last token (never fed back) were found
    assert cache.hits == len(first) + len(answer) - 1


def test_equal_prompts_are_read_once_and_their_rows_copied(model):
    """n rows of one prompt (a request's n, a statistical test's seeded samples) are read once: the batch's
    rows are bitwise the rows of prompts read one by one, and in the callers' order."""
    from verispec.prefill import joined, read_once

    a, b = tokens(2 * CHUNK + 5, seed=1), tokens(7, seed=2)
    readers = read_once(model, [a, b, a, a, b])
    assert readers[0] is readers[2] is readers[3] and readers[1] is readers[4] and readers[0] is not readers[1]
    shared = joined(model, readers)
    alone = joined(model, [read_once(model, [c])[0] for c in (a, b, a, a, b)])
    assert shared.batch_size == 5
    for row in range(5):
        length = len((a, b, a, a, b)[row])
        slots = torch.arange(length)
        for mine, theirs in zip(shared.store.gather(row, slots), alone.store.gather(row, slots)):
            assert torch.equal(mine, theirs)


TURN = 3  # the tiny models' "turn start" token (never among `tokens`, which draws from 4..95)


def turn(text: list[int]) -> list[int]:
    return [TURN] + text


@pytest.fixture
def chat_model(model, monkeypatch):
    """The tiny model with 64-token chunks that also end after TURN (no two shorter than 8 in a row)."""
    monkeypatch.setattr(native, "PREFILL_CHUNK", 64)
    monkeypatch.setattr(prefill_module, "MIN_TURN_CHUNK", 8)
    assert model.turn_start_ids == frozenset()  # no tokenizer, no chat template: no turn starts of its own
    model.turn_start_ids = {TURN}
    assert Chunking.of(model) == Chunking(64, frozenset({TURN}), 8)  # a 2-token chunk may follow an 8-token one
    return model


def test_chunk_ends_depend_on_the_tokens_before_them_only():
    """Every prefix of a prompt is cut as the prompt is, so a conversation's next turn, read fresh, runs the
    passes its previous turn ran; the cap counts from the last end, and no two chunks shorter than min_len
    follow each other."""
    chunking = Chunking(cap=10, cut_after=frozenset({0}), min_len=3)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        prompt = torch.randint(0, 4, (int(torch.randint(0, 60, (1,), generator=g)),), generator=g).tolist()
        ends = chunking.ends(prompt)
        for n in range(len(prompt) + 1):
            assert chunking.ends(prompt[:n]) == [e for e in ends if e <= n]
        lengths = [end - begin for begin, end in zip([0] + ends, ends)]
        for end, length, before in zip(ends, lengths, [0] + lengths):
            assert length == 10 or (prompt[end - 1] == 0 and length < 10 and (length >= 3 or before >= 3))
    assert Chunking(4).ends(list(range(9))) == [4, 8]
    # many tiny turns: a chunk of min_len, then one of a single token, and again
    assert Chunking(64, frozenset({0}), 8).ends([0] * 20) == [8, 9, 17, 18]


def test_turn_two_finds_turn_one_up_to_its_last_turn_start_bitwise(chat_model):
    """Turn 1's prompt ends with a turn start and two tokens (as "<|im_start|>assistant" does): turn 2 finds
    every chunk up to that turn start, far past turn 1's last whole 64-token chunk, and its keys, values
    and logits are bitwise a fresh read's."""
    model = chat_model
    first = turn(tokens(90, seed=20)) + turn(tokens(30, seed=21)) + turn([40, 41])  # 125 tokens
    second = first + tokens(12, seed=22) + turn(tokens(20, seed=23)) + turn([40, 41])
    assert Chunking.of(model).ends(first) == [64, 92, 123]  # the cap, then two turn starts
    cache = PrefixCache.for_model(model, 1 << 30)
    read(model, first, cache)
    assert len(cache) == 3
    fresh = read(model, second)
    hit = read(model, second, cache)
    assert hit.reused == 123 > len(first) // 64 * 64  # all but "assistant" ([40, 41]); fixed chunks gave 64
    for mine, theirs in zip(kv(hit), kv(fresh)):
        assert torch.equal(mine, theirs)
    assert torch.equal(next_logits(model, hit), next_logits(model, fresh))
    # read in several sittings between decode steps, the same chunks and the same bits
    piecewise = read(model, second, budget=1)
    assert torch.equal(next_logits(model, piecewise), next_logits(model, fresh))


def test_a_salt_keeps_requests_apart(chat_model):
    """Blocks stored under one salt are found under that salt only (a tenant's cache_salt)."""
    model = chat_model
    prompt = turn(tokens(70, seed=24)) + turn([40, 41])
    cache = PrefixCache.for_model(model, 1 << 30)
    read(model, prompt, cache, salt="tenant-a")
    assert read(model, prompt, cache, salt="tenant-b").reused == 0
    assert read(model, prompt, cache).reused == 0
    again = read(model, prompt, cache, salt="tenant-a")
    assert again.reused == 72 and torch.equal(next_logits(model, again), next_logits(model, read(model, prompt)))
