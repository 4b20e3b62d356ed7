"""Suffix decoding: the index (matches, frequencies, eviction bound, tenants), exactness under greedy
decoding and sampling, and reuse of an earlier request's output."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import verispec
from verispec.drafters.suffix import NGRAM_SIZES, SuffixDrafter, SuffixIndex
from verispec.engine import DecodeBatch, Request
from verispec.policy import FixedDraftLen, make_policy
from verispec.sampling import SamplingParams


def draft_of(drafter: SuffixDrafter, sequence: list[int], k: int = 8) -> list[int]:
    drafter.add([sequence])
    draft = drafter.propose([sequence], k, [SamplingParams()], [torch.Generator()])
    drafter.select([])  # the row leaves (and is added to the index)
    return draft.tokens[0, : int(draft.num_drafted[0])].tolist()


def test_drafts_the_most_frequent_continuation_of_the_longest_match():
    index = SuffixIndex()
    for _ in range(3):
        index.add([7, 8, 9, 10, 11, 12])
    index.add([7, 8, 9, 20, 21, 22])
    drafter = SuffixDrafter(index, max_spec_factor=2.0)
    # "8 9" matched in 4 places: 3 continue 10 11 12, 1 continues 20 ...: the frequent one wins.
    assert draft_of(drafter, [1, 8, 9], k=3) == [10, 11, 12]
    # A longer match decides: "2 20" ... only the one sequence matches "9 20", it continues 21 22.
    assert draft_of(drafter, [5, 9, 20], k=3) == [21, 22]


def test_clear_forgets_every_earlier_output():
    index = SuffixIndex()
    index.add([7, 8, 9, 10, 11, 12])
    drafter = SuffixDrafter(index, max_spec_factor=2.0)
    assert draft_of(drafter, [1, 8, 9], k=3) == [10, 11, 12]
    index.clear()
    assert index.num_tokens == 0 and index.num_postings == 0
    assert draft_of(drafter, [1, 8, 9], k=3) == []
    index.add([7, 8, 9, 30, 31])  # and it takes new outputs afterwards
    assert draft_of(drafter, [1, 8, 9], k=2) == [30, 31]


def test_draft_length_follows_match_length_and_frequency():
    index = SuffixIndex()
    index.add(list(range(10, 40)))
    drafter = SuffixDrafter(index, max_spec_factor=1.0)
    assert len(draft_of(drafter, [1, 2, 12], k=16)) == 1  # a 1-token match drafts 1 token
    assert len(draft_of(drafter, [1, 11, 12, 13, 14], k=16)) == 4
    # min_token_prob: 10 places continue ten different ways; the path probability 1/10 is below 0.2.
    index = SuffixIndex()
    for t in range(10):
        index.add([5, 6, 50 + t])
    assert draft_of(SuffixDrafter(index, min_token_prob=0.2), [5, 6]) == []
    assert len(draft_of(SuffixDrafter(index, min_token_prob=0.05), [5, 6])) == 1


def test_confidence_grows_with_the_evidence_and_alternates_are_second_choices():
    index = SuffixIndex()
    for _ in range(9):
        index.add([1, 2, 3, 4])
    index.add([1, 2, 3, 5])
    drafter = SuffixDrafter(index, vocab_size=16, max_spec_factor=4.0)
    drafter.add([[1, 2, 3]])
    everywhere = lambda confidence, num_drafted: torch.ones_like(confidence, dtype=torch.bool)  # noqa: E731
    draft = drafter.propose([[1, 2, 3]], 4, [SamplingParams(temperature=1.0)], [torch.Generator()], branch=everywhere)
    assert draft.tokens[0, 0] == 4 and draft.confidence[0, 0] == pytest.approx(9 / 11)
    assert draft.alternates[0, 0] == 5 and draft.alternate_confidence[0, 0] == pytest.approx(1 / 11)
    assert draft.alternate_probs[0, 0, 5] == 1.0 and draft.alternate_probs[0, 0].sum() == 1.0  # a point mass
    assert draft.probs is None  # deterministic: the verifiers take it as a point mass


def test_eviction_keeps_the_index_within_its_budget():
    index = SuffixIndex(max_tokens=1000)
    rng = np.random.default_rng(0)
    first = rng.integers(0, 50, 300).tolist()
    index.add(first)
    for _ in range(40):
        index.add(rng.integers(0, 50, 300).tolist())
        assert index.num_tokens <= 1000
        # each token holds at most one posting per n-gram size: memory stays within the budget too
        assert index.num_postings <= 6 * index.num_tokens
    assert index.num_tokens == sum(len(s) for c in index.corpora.values() for s in c.sequences.values())
    # a sequence of L tokens holds L - n postings for each indexed n-gram size n
    assert index.num_postings == sum(6 * len(s) - sum(NGRAM_SIZES) for c in index.corpora.values() for s in c.sequences.values())
    # The first sequence is gone: its text no longer drafts anything it alone held.
    probe = first[100:120]
    held = [seq for c in index.corpora.values() for seq in c.sequences.values()]
    assert all(first is not seq for seq in held)
    found = index.find(probe, None, 64)
    assert all(length < 20 for _, _, length in found)
    # Everything evicted: no postings left behind.
    tiny = SuffixIndex(max_tokens=10)
    tiny.add(list(range(10)))
    tiny.add(list(range(20, 30)))
    assert tiny.num_tokens == 10 and len(tiny.corpora[None].sequences) == 1
    assert tiny.num_postings == 9 + 8 + 7 + 6 + 4 + 2


def test_tenants_do_not_see_each_other():
    index = SuffixIndex()
    index.add([1, 2, 3, 4, 5], tenant="a")
    assert draft_of(SuffixDrafter(index, tenant="a", max_spec_factor=4), [1, 2]) == [3, 4, 5]
    assert draft_of(SuffixDrafter(index, tenant="b", max_spec_factor=4), [1, 2]) == []


@pytest.mark.parametrize("draft_len", [3, "auto", "tree"])
def test_greedy_output_is_the_targets(tiny_pair, draft_len):
    target, _ = tiny_pair
    index = SuffixIndex()
    prompts = [[1, 5, 6, 7, 5, 6, 7, 5], [1, 9, 10, 11, 12], [1, 5, 6, 7, 5, 6, 7, 5]]
    for prompt in prompts:  # the third repeats the first: it drafts from the first's output
        plain = verispec.generate(target, prompt, drafter="none", max_new_tokens=40).token_ids
        drafter = SuffixDrafter(index, target.vocab_size)
        batch = DecodeBatch(target, drafter, make_policy(draft_len))
        batch.add([Request(prompt, max_new_tokens=40, id=0)])
        out = []
        while len(batch):
            for event in batch.step():
                out += event.tokens
        assert out == plain
    assert index.num_tokens > 0


def test_generate_api_shares_the_index_across_calls(tiny_pair):
    """drafter="suffix" through the API: a second identical call drafts from the first's output and gets
    many tokens per target pass; both equal plain decoding."""
    target, _ = tiny_pair
    prompt = [1, 40, 41, 42]
    plain = verispec.generate(target, prompt, drafter="none", max_new_tokens=48).token_ids
    verispec.api.suffix_index(target).__init__()  # start from an empty index for this target
    first = verispec.generate(target, prompt, drafter="suffix", draft_len=8, max_new_tokens=48)
    second = verispec.generate(target, prompt, drafter="suffix", draft_len=8, max_new_tokens=48)
    assert first.token_ids == plain and second.token_ids == plain
    assert second.stats.mean_accepted_tokens > 4 > first.stats.mean_accepted_tokens
    assert second.stats.mean_accepted_tokens > 2 * first.stats.mean_accepted_tokens


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, seed=11), SamplingParams(temperature=1.2, top_k=12, top_p=0.9, seed=5),
                                    SamplingParams(temperature=0.9, seed=3, coupled=True),
                                    SamplingParams(temperature=1.0, seed=7, blockwise=False)], ids=str)
def test_sampling_follows_the_target(params):
    """2000 seeded rows drafting from an index that holds the target's likely continuations: the first
    two tokens follow the target's exact joint distribution, with a tree of alternates where the rule takes one."""
    from conftest import tiny_llama
    from test_sampling_exactness import P_THRESHOLD, first_two_tokens_pvalues, repeating_prompt, sample_with

    target = tiny_llama(seed=0)
    prompt = repeating_prompt(target)
    index = SuffixIndex()
    for seed in range(20):  # earlier sampled outputs, so drafts have competing continuations
        index.add(prompt[-8:] + verispec.generate(target, prompt, temperature=1.0, seed=seed, drafter="none",
                                                  max_new_tokens=4).token_ids)
    drafter = SuffixDrafter(index, target.vocab_size, max_spec_factor=4.0)
    outputs = sample_with(target, drafter, FixedDraftLen(3), prompt, params)
    assert min(first_two_tokens_pvalues(target, prompt, params, outputs)) > P_THRESHOLD


class AcceptsEverything:
    """A broken verifier (the negative control): every drafted token is kept."""

    lossless, takes_alternates = True, False

    def verify(self, draft, target_logits, sampling, generators, positions=None):
        from verispec.sampling import sample, warp_rows
        from verispec.drafters.base import Verdict

        p = warp_rows(target_logits, sampling)
        num = draft.num_drafted.clone()
        return Verdict(num, torch.stack([torch.tensor(sample(p[b, int(num[b])], generators[b])) for b in range(len(sampling))]))


def test_negative_control_a_lossy_verifier_is_caught(monkeypatch):
    from conftest import tiny_llama
    from test_sampling_exactness import first_two_tokens_pvalues, repeating_prompt, sample_with

    import verispec.engine

    target = tiny_llama(seed=0)
    prompt = repeating_prompt(target)
    params = SamplingParams(temperature=1.0, seed=1)
    index = SuffixIndex()
    index.add(prompt[-8:] + [20, 21, 22])  # a continuation the target finds unlikely
    monkeypatch.setattr(verispec.engine, "verifier_for", lambda sampling: AcceptsEverything())
    outputs = sample_with(target, SuffixDrafter(index, target.vocab_size, max_spec_factor=4.0), FixedDraftLen(3), prompt, params)
    assert min(first_two_tokens_pvalues(target, prompt, params, outputs)) < 1e-6


@pytest.mark.slow
def test_smollm_greedy_identity_and_reuse():
    target = verispec.load("smollm2-135m")
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    plain = verispec.generate(target, prompt, drafter="none", max_new_tokens=64)
    runs = [verispec.generate(target, prompt, drafter="suffix", max_new_tokens=64) for _ in range(2)]
    assert all(r.token_ids == plain.token_ids for r in runs)
    assert runs[1].stats.mean_accepted_tokens > 3


@pytest.fixture(scope="module")
def native_tiny():
    """(a tiny Llama on the native backend, which verifies token trees; the transformers model it wraps)."""
    from conftest import tiny_llama
    from verispec.models.native import NativeCausalLM

    hf = tiny_llama(seed=0)
    return NativeCausalLM.from_hf(hf), hf


def _misleading_index(target, prompt: list[int], wrong_at: int, copies: int = 2) -> SuffixIndex:
    """The target's greedy continuation once, and twice more often a copy with one token changed at
    `wrong_at`: the chain follows the frequent wrong token there and the alternate is the right one."""
    right = verispec.generate(target, prompt, drafter="none", max_new_tokens=12).token_ids
    wrong = list(right)
    wrong[wrong_at] = (wrong[wrong_at] + 1) % target.vocab_size
    index = SuffixIndex()
    index.add(prompt[-8:] + right)
    for _ in range(copies):
        index.add(prompt[-8:] + wrong)
    return index


def test_alternates_are_taken_and_greedy_stays_exact(native_tiny):
    from test_trees import _Always, _decode

    target, _ = native_tiny
    prompt = [1, 5, 6, 7, 8]
    plain = verispec.generate(target, prompt, drafter="none", max_new_tokens=30).token_ids
    for wrong_at in (0, 2):
        drafter = SuffixDrafter(_misleading_index(target, prompt, wrong_at), target.vocab_size, max_spec_factor=4.0)
        got, stats = _decode(target, drafter, [prompt], _Always(6), max_new_tokens=30)
        assert got[0] == plain
        assert stats.alternates_drafted > 0 and stats.alternates_accepted > 0


def _tree_situation(vocab: int = 16, rows: int = 10000):
    """One suffix draft, repeated over `rows` rows: chain [4, 6] with alternates 5 beside position 0 and
    8 beside position 1 (counts 4:2 and 3:1), and random target logits over its tree pass [last, 4, 6, 5, 8]."""
    index = SuffixIndex()
    for tokens, copies in (([9, 1, 2, 3, 4, 6], 3), ([9, 1, 2, 3, 5, 7], 2), ([9, 1, 2, 3, 4, 8], 1)):
        for _ in range(copies):
            index.add(tokens)
    drafter = SuffixDrafter(index, vocab, max_spec_factor=4.0)
    drafter.add([[1, 2, 3]] * rows)
    everywhere = lambda confidence, num_drafted: torch.ones_like(confidence, dtype=torch.bool)  # noqa: E731
    params = SamplingParams(temperature=1.0)
    draft = drafter.propose([[1, 2, 3]] * rows, 2, [params] * rows, [torch.Generator()] * rows, branch=everywhere)
    assert draft.tokens[0].tolist() == [4, 6] and draft.alternates[0].tolist() == [5, 8]
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(4)) * 1.5
    logits[0, [4, 5]] += 2.0  # both first candidates likely enough to be seen often
    return draft, logits, params


@pytest.mark.parametrize("rule", ["speculative_sampling", "block"])
def test_deterministic_alternates_are_exact(rule):
    """The tree a suffix draft makes (chain and alternates all point masses, q' one-hot on each alternate),
    judged by each lossless rule: the first token follows p, and the token after it follows p in the
    column of whichever path it took; a q' that lies about the alternate (the negative control) is caught."""
    from test_sampling_exactness import P_THRESHOLD, chi2_pvalue
    from verispec.sampling import make_generators, warp
    from verispec.verifiers import BlockVerifier, SpeculativeSamplingVerifier

    verifier = {"speculative_sampling": SpeculativeSamplingVerifier, "block": BlockVerifier}[rule]()
    draft, logits, params = _tree_situation()
    rows = draft.tokens.shape[0]
    p = warp(logits, params).double().numpy()

    def emitted(draft):
        gens = make_generators(SamplingParams(temperature=1.0, seed=1), rows)
        verdict = verifier.verify(draft, logits.expand(rows, -1, -1), [params] * rows, gens)
        return [verdict.emitted(draft, b) for b in range(rows)], verdict

    out, verdict = emitted(draft)
    assert 0 < int(verdict.alternate.sum()) < rows  # alternates were taken, and not always
    first = np.array([e[0] for e in out])
    assert chi2_pvalue(first, p[0]) > P_THRESHOLD
    after_chain = np.array([e[1] for e in out if e[0] == 4])  # chain token accepted: column 1
    after_alternate = np.array([e[1] for e in out if e[0] == 5])  # the alternate beside 0 taken: its column, 3
    assert len(after_chain) > 800 and len(after_alternate) > 800
    assert chi2_pvalue(after_chain, p[1]) > P_THRESHOLD and chi2_pvalue(after_alternate, p[3]) > P_THRESHOLD
    # Negative control: a q' claiming the alternate was unlikely makes min(1, R(y) / q'(y)) = 1: always taken.
    lying = draft.alternate_probs.clone()
    lying[..., :] = torch.where(lying > 0, 1e-6, (1 - 1e-6) / (lying.shape[-1] - 1))
    biased, _ = emitted(replace(draft, alternate_probs=lying))
    assert chi2_pvalue(np.array([e[0] for e in biased]), p[0]) < 1e-6


@pytest.mark.slow
def test_server_lanes_share_one_index_and_add_finished_outputs():
    """A server with drafter="suffix": the first request's output joins the index when it finishes, and the
    same request again drafts from it (many tokens per pass), with the same text as plain decoding."""
    from fastapi.testclient import TestClient

    from verispec.server import build_app

    target = verispec.load("smollm2-135m")
    index = verispec.api.suffix_index(target)
    index.__init__()
    prompt = "def is_palindrome(text: str) -> bool:\n    \"\"\"Return whether text reads the same backwards.\"\"\"\n"
    plain = verispec.generate(target, prompt, drafter="none", max_new_tokens=40).text
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0}
    with TestClient(build_app("smollm2-135m", drafter="suffix", draft_len=8, max_batch=2)) as client:
        first = client.post("/v1/completions", json=body).json()
        assert index.num_tokens > 0
        second = client.post("/v1/completions", json=body).json()
    assert first["choices"][0]["text"] == second["choices"][0]["text"] == plain
    passes = [r["usage"]["speculative"]["mean_accepted_tokens"] for r in (first, second)]
    assert passes[1] > 4 and passes[1] > 2 * passes[0]


def test_each_tenant_has_its_own_budget_and_never_sees_another_tenants_outputs():
    index = SuffixIndex(max_tokens=1000, max_tokens_per_tenant=100)
    index.add(list(range(10, 60)), tenant="a")
    index.add(list(range(100, 150)), tenant="b")
    index.add(list(range(200, 260)), tenant="a")  # a holds 110 > 100: its own oldest goes, b's stays
    assert index.tenant_tokens("a") == 60 and index.tenant_tokens("b") == 50 and index.num_tokens == 110
    assert draft_of(SuffixDrafter(index, tenant="a"), [1, 10, 11], k=2) == []
    assert draft_of(SuffixDrafter(index, tenant="a"), [1, 200, 201], k=2) == [202, 203]
    assert draft_of(SuffixDrafter(index, tenant="b"), [1, 200, 201], k=2) == []  # a's text, asked for by b
    assert draft_of(SuffixDrafter(index, tenant="b"), [1, 100, 101], k=2) == [102, 103]
    index.limit_tenants(55)  # a server's bound, applied to what is held already
    assert index.tenant_tokens("a") == 0 and index.tenant_tokens("b") == 50 and index.num_sequences == 1


def test_rows_of_one_batch_draft_from_their_own_tenants():
    """A server batches several tenants' rows in one drafter: each row names its tenant at `add`."""
    index = SuffixIndex()
    index.add([5, 6, 7, 8, 9], tenant="a")
    index.add([5, 6, 70, 80, 90], tenant="b")
    drafter = SuffixDrafter(index)
    drafter.add([[1, 5, 6], [2, 5, 6], [3, 5, 6]], tenants=["a", "b", "c"])
    draft = drafter.propose([[1, 5, 6], [2, 5, 6], [3, 5, 6]], 3, [SamplingParams()] * 3, [torch.Generator()] * 3)
    assert [draft.tokens[b, : int(draft.num_drafted[b])].tolist() for b in range(3)] == [[7, 8], [70, 80], []]
    drafter.propose([[1, 5, 6, 7], [2, 5, 6, 70], [3, 5, 6, 9]], 0, [SamplingParams()] * 3, [torch.Generator()] * 3)
    drafter.select([])  # the rows leave: each output, with its prompt, joins its own tenant's partition
    assert [index.tenant_tokens(t) for t in "abc"] == [5 + 4, 5 + 4, 4]
