"""Retrieval drafting from a datastore (REST): the suffix array, the walk, the cache file, and greedy output equal to
plain decoding's with drafts that come from the datastore."""

from __future__ import annotations

import random

import numpy as np
import pytest

import verispec
from conftest import tiny_llama
from verispec.api import _DATASTORES, suffix_index
from verispec.drafters.datastore import DEPTH, PAD, Datastore, suffix_array
from verispec.models.native import NativeCausalLM


def test_the_suffix_array_orders_suffixes_by_their_first_tokens_then_text_order():
    rng = random.Random(0)
    tokens = np.array([rng.choice([1, 2, 3]) for _ in range(400)] + [5, 6] * 40, dtype=np.int32)  # long repeats too
    padded = list(tokens) + [PAD] * DEPTH
    expected = sorted(range(len(tokens)), key=lambda i: (padded[i : i + DEPTH], i))
    assert suffix_array(tokens).tolist() == expected


def test_a_walk_follows_the_most_frequent_continuation_of_the_longest_match():
    separator = 99
    store = Datastore.build([[1, 2, 3, 4, 5, 10], [9, 2, 3, 4, 6, 11], [7, 2, 3, 4, 6, 11], [8, 3, 4, 5, 12]], separator)
    # [2, 3, 4] is the longest suffix that occurs (3 places): 6 follows twice, 5 once
    chain, confidence, match = store.walk([0, 2, 3, 4], 3)
    assert match == 3 and chain == [6, 11, separator]
    assert confidence == pytest.approx([2 / 4, 2 / 3, 2 / 3])
    # [3, 4] alone: 4 places, 5 and 6 twice each; a share below min_token_prob stops the walk
    chain, _, match = store.walk([0, 3, 4], 2, min_token_prob=0.6)
    assert match == 2 and chain == []
    assert store.walk([42, 43], 4) == ([], [], 0)  # nothing matches
    assert store.walk([0, 2, 3, 4], 3, min_match=4) == ([], [], 0)  # nor at least 4 tokens
    assert store.walk([1, 2], 5, max_spec_factor=1.0)[0] == [3, 4]  # a 2-token match drafts at most 2


def test_a_datastore_file_reads_back_the_same(tmp_path):
    store = Datastore.build([[5, 6, 7, 5, 6, 8], [6, 7, 9]], separator=0)
    store.save(tmp_path / "d.npz")
    again = Datastore.load(tmp_path / "d.npz")
    assert np.array_equal(again.tokens, store.tokens) and np.array_equal(again.order, store.order)
    assert again.walk([5, 6], 3) == store.walk([5, 6], 3)


@pytest.fixture
def target_with_store():
    target = NativeCausalLM.from_hf(tiny_llama(seed=3))
    rng = random.Random(1)
    prompts = [[1] + [rng.randrange(4, 96) for _ in range(12)] for _ in range(4)]
    yield target, prompts
    _DATASTORES.pop(target, None)


def test_greedy_rest_equals_plain_with_drafts_from_the_datastore(target_with_store):
    """The datastore holds these prompts' plain continuations, so its drafts are taken; a datastore of other text
    (the negative control) drafts little that is taken. Output is plain decoding's either way."""
    target, prompts = target_with_store
    plain = [verispec.generate(target, p, drafter="none", max_new_tokens=30).token_ids for p in prompts]
    rng = random.Random(7)
    for documents, well in (([p + out for p, out in zip(prompts, plain)], True),
                            ([[rng.randrange(4, 96) for _ in range(60)] for _ in range(8)], False)):
        _DATASTORES[target] = Datastore.build(documents, separator=2)
        suffix_index(target).clear()
        accepted = 0
        for prompt, expected in zip(prompts, plain):
            got = verispec.generate(target, prompt, drafter="rest", draft_len=4, max_new_tokens=30)
            assert got.token_ids == expected
            accepted += got.stats.accepted_tokens
            suffix_index(target).clear()  # the answer must come from the datastore, not from the last call's output
        assert accepted > 60 if well else accepted < 20, accepted
