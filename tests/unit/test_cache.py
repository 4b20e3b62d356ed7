"""Slot bookkeeping and rollback: after truncate, a model must compute exactly what a fresh cache gives."""

from __future__ import annotations

import torch

from verispec.cache import SlotCache
from conftest import tiny_gpt2, tiny_llama


def test_positions_count_visible_slots_only():
    slots = SlotCache(2)
    mask, pos = slots.extend(torch.tensor([[False, True, True], [True, True, True]]))
    assert pos.tolist() == [[0, 0, 1], [0, 1, 2]]
    assert mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    slots.truncate(torch.tensor([2, 3]))  # row 0 forgets its last slot: a hole
    assert slots.length == 3 and slots.num_tokens().tolist() == [1, 3]
    mask, pos = slots.extend(torch.ones(2, 2, dtype=torch.bool))
    assert pos.tolist() == [[1, 2], [3, 4]]
    assert mask.tolist() == [[0, 1, 0, 1, 1], [1, 1, 1, 1, 1]]


def test_truncate_shrinks_to_the_longest_row():
    slots = SlotCache(2)
    slots.extend(torch.ones(2, 5, dtype=torch.bool))
    slots.truncate(torch.tensor([2, 3]))
    assert slots.length == 3
    assert slots.visible.tolist() == [[True, True, False], [True, True, True]]


def test_grows_past_initial_capacity():
    slots = SlotCache(1)
    for _ in range(50):
        slots.extend(torch.ones(1, 3, dtype=torch.bool))
    assert slots.length == 150 and int(slots.num_tokens()) == 150


def test_select_and_concat():
    a, b = SlotCache(2), SlotCache(1)
    a.extend(torch.tensor([[True, True], [False, True]]))
    b.extend(torch.ones(1, 3, dtype=torch.bool))
    a.select(torch.tensor([1]))
    a.concat(b)
    assert a.length == 3 and a.batch_size == 2
    assert a.visible.tolist() == [[False, True, False], [True, True, True]]


def _logits_after(model, prefix, tail):
    cache = model.new_cache(1)
    model.forward(torch.tensor([prefix]), cache)
    return model.forward(torch.tensor([tail]), cache)


def test_rollback_then_forward_equals_fresh_cache():
    for model in (tiny_llama(), tiny_gpt2()):
        prefix, rejected, accepted_next = [1, 5, 6, 7], [9, 9, 9], [11, 12]
        cache = model.new_cache(1)
        model.forward(torch.tensor([prefix]), cache)
        start = cache.slots.length
        model.forward(torch.tensor([rejected]), cache)
        cache.truncate(torch.tensor([start + 1]))  # keep the first of the three
        after_rollback = model.forward(torch.tensor([accepted_next]), cache)
        fresh = _logits_after(model, prefix + rejected[:1], accepted_next)
        torch.testing.assert_close(after_rollback, fresh, rtol=1e-5, atol=1e-5)


def test_holes_do_not_change_a_row():
    """Row 0 rolls back while row 1 keeps its slots: row 0 must continue exactly as a fresh sequence."""
    model = tiny_llama()
    cache = model.new_cache(2)
    model.forward(torch.tensor([[1, 5, 6], [1, 7, 8]]), cache)
    start = cache.slots.length
    model.forward(torch.tensor([[20, 21, 22], [23, 24, 25]]), cache)
    cache.truncate(start + torch.tensor([0, 3]))  # row 0 rejects everything: three holes
    logits = model.forward(torch.tensor([[30], [31]]), cache)
    torch.testing.assert_close(logits[0:1], _logits_after(model, [1, 5, 6], [30]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[1:2], _logits_after(model, [1, 7, 8, 23, 24, 25], [31]), rtol=1e-5, atol=1e-5)


def test_concat_admits_a_prefilled_row():
    model = tiny_llama()
    running = model.new_cache(1)
    model.forward(torch.tensor([[1, 5, 6, 7, 8]]), running)
    joining = model.new_cache(1)
    model.forward(torch.tensor([[1, 9]]), joining)
    running.concat(joining)
    logits = model.forward(torch.tensor([[10], [11]]), running)
    torch.testing.assert_close(logits[1:2], _logits_after(model, [1, 9], [11]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[0:1], _logits_after(model, [1, 5, 6, 7, 8], [10]), rtol=1e-5, atol=1e-5)
