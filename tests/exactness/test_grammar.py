"""Grammar-constrained decoding (structured output) stays exact under speculation. Tiny random models, offline.

The claim: every position of a verify pass is masked to what the grammar allows after the row's tokens plus
the draft tokens before that position, so greedy output is token for token plain constrained decoding's
(itself checked against a from-the-definition loop: a full forward, a fresh matcher, argmax) with every
drafter, and sampled output follows the masked distribution (chi-square, with a negative control that masks
every position as if no draft token preceded it).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import EOS, VOCAB, perturbed_copy, tiny_llama, tiny_qwen2, toy_grammar, toy_ids
from test_sampling_exactness import P_THRESHOLD, chi2_pvalue
from verispec.drafters import ModelDrafter, NgramDrafter, NoDrafter, SharedCacheDrafter, SuffixDrafter, SuffixIndex
from verispec.drafters.eagle3 import Eagle3Drafter
from verispec.drafters.hybrid import HybridDrafter
from verispec.drafters.lookup_first import LookupFirstDrafter
from verispec.heads.eagle3 import Eagle3Config, Eagle3Head
from verispec.engine import DecodeBatch, Request
from verispec.grammar import Constraint
from verispec.models.native import NativeCausalLM
from verispec.policy import FixedDraftLen
from verispec.sampling import SamplingParams

# A JSON-like object: keys of 1-4 letters, numbers of 1-3 digits, up to 5 entries. Random models have many
# tokens to choose from at most positions and a forced one at some (quotes, colons, brackets).
PATTERN = r'\{"[abcxyz]{1,4}": [0-9]{1,3}(, "[abcxyz]{1,4}": [0-9]{1,3}){0,4}\}'
PROMPTS = [[1, 5, 6, 7, 5, 6], [1, 20, 21], [4, 4, 4, 9]]
MAX_NEW = 40


@pytest.fixture(scope="module")
def grammar():
    return toy_grammar("regex", PATTERN)


def decode(target, drafter, requests, draft_len: int) -> tuple[dict[int, list[int]], "DecodeBatch"]:
    batch = DecodeBatch(target, drafter, FixedDraftLen(draft_len))
    batch.add(requests)
    out = {r.id: [] for r in requests}
    while len(batch):
        for event in batch.step():
            out[event.request_id] += event.tokens
    return out, batch


def requests(grammar, params=SamplingParams(), prompts=PROMPTS):
    return [Request(prompt=p, sampling=params, max_new_tokens=MAX_NEW, id=i, grammar=grammar) for i, p in enumerate(prompts)]


def reference_greedy(target, grammar, prompt: list[int]) -> list[int]:
    """Plain constrained greedy decoding from the definition: the whole sequence forward, a fresh matcher fed
    the generated tokens, the argmax of the allowed tokens; stop at EOS, at a complete grammar, or at MAX_NEW."""
    sequence = list(prompt)
    while len(sequence) - len(prompt) < MAX_NEW:
        with torch.no_grad():
            logits = target.model(torch.tensor([sequence])).logits[0, -1]
        constraint = grammar.constraint()
        constraint.matcher.consume_tokens(sequence[len(prompt):])
        allowed = constraint.allowed([[]])[0]
        token = int(torch.where(allowed, logits, float("-inf")).argmax())
        sequence.append(token)
        constraint.advance([token])
        if token == EOS or constraint.finished:
            break
    return sequence[len(prompt):]


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(seed=0)
    return target, perturbed_copy(target, scale=0.3)


def test_plain_constrained_decoding_is_the_definition(pair, grammar):
    target, _ = pair
    plain, _ = decode(target, NoDrafter(), requests(grammar), 0)
    for i, prompt in enumerate(PROMPTS):
        assert plain[i] == reference_greedy(target, grammar, prompt)
        text = "".join(__import__("conftest").TOY_PIECES[t].decode() for t in plain[i])
        assert __import__("re").fullmatch(PATTERN, text), text  # complete: the grammar ended the row
    free, _ = decode(target, NoDrafter(), [Request(prompt=p, max_new_tokens=MAX_NEW, id=i) for i, p in enumerate(PROMPTS)], 0)
    assert free != plain  # the grammar changed the output, or this test proves nothing


DRAFTERS = {
    "model": lambda target, draft: ModelDrafter(draft, target.vocab_size),
    "ngram": lambda target, draft: NgramDrafter(),
    "suffix": lambda target, draft: SuffixDrafter(SuffixIndex(), target.vocab_size),
    "hybrid": lambda target, draft: HybridDrafter(ModelDrafter(draft, target.vocab_size)),
    "head+suffix": lambda target, draft: LookupFirstDrafter(Eagle3Drafter(random_head(target), target),
                                                            SuffixDrafter(SuffixIndex(), target.vocab_size)),
}


def random_head(target) -> Eagle3Head:
    """An untrained EAGLE-3 head over the target's taps at layers 0, 1, 2: its drafts are noise, which the grammar
    must still leave exact."""
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(target, target.vocab_size, (0, 1, 2)))
    head.set_draft_vocab(torch.arange(target.vocab_size))
    return head


@pytest.mark.parametrize("name", sorted(DRAFTERS))
@pytest.mark.parametrize("draft_len", [1, 3, 6])
def test_greedy_output_is_plain_constrained_decodings(pair, grammar, name, draft_len):
    target, draft = pair
    plain, _ = decode(target, NoDrafter(), requests(grammar), 0)
    spec, batch = decode(target, DRAFTERS[name](target, draft), requests(grammar), draft_len)
    assert spec == plain
    if name == "model":
        assert 0 < batch.stats.accepted_tokens < batch.stats.drafted_tokens  # drafts both kept and rejected


@pytest.fixture(scope="module")
def native_pair():
    hf = tiny_qwen2(seed=0)
    return NativeCausalLM.from_hf(hf), NativeCausalLM.from_hf(perturbed_copy(hf, scale=0.1))


@pytest.mark.parametrize("name", ["self", "tree"])
def test_greedy_self_speculation_and_token_trees_are_plain_constrained_decoding(native_pair, grammar, name):
    """The draft on the target's own cache; and alternates beside chain positions, each masked after its own path."""
    from test_trees import _Always

    target, draft = native_pair
    plain, _ = decode(target, NoDrafter(), requests(grammar), 0)
    if name == "self":
        spec, batch = decode(target, SharedCacheDrafter(draft, target), requests(grammar), 4)
    else:
        batch = DecodeBatch(target, ModelDrafter(draft, target.vocab_size), _Always(3))
        batch.add(requests(grammar))
        spec = {i: [] for i in range(len(PROMPTS))}
        while len(batch):
            for event in batch.step():
                spec[event.request_id] += event.tokens
    assert spec == plain
    assert batch.stats.accepted_tokens > 0


def test_a_forbidden_draft_token_is_rejected_even_where_the_target_likes_it(pair, grammar):
    """The draft proposes the target's own unconstrained greedy tokens: plain decoding would accept them all,
    the grammar forbids most, and the output is still the constrained one."""
    target, _ = pair

    class Unconstrained(NoDrafter):
        def propose(self, sequences, draft_len, sampling, generators, stop=None, branch=None):
            from verispec.drafters.base import Draft

            tokens = []
            for sequence in sequences:
                s = list(sequence)
                for _ in range(draft_len):
                    with torch.no_grad():
                        s.append(int(target.model(torch.tensor([s])).logits[0, -1].argmax()))
                tokens.append(s[len(sequence):])
            return Draft(torch.tensor(tokens), torch.full((len(sequences),), draft_len))

    plain, _ = decode(target, NoDrafter(), requests(grammar), 0)
    spec, batch = decode(target, Unconstrained(), requests(grammar), 3)
    assert spec == plain and batch.stats.accepted_tokens < batch.stats.drafted_tokens


def test_a_draft_that_runs_past_the_grammars_end_stops_where_plain_decoding_does(pair, grammar):
    """An oracle drafts plain decoding's own continuation and the EOS after it: the whole of it is accepted in
    one pass, and the row still ends at the token that completed the grammar, as plain decoding's does."""
    target, _ = pair
    plain, _ = decode(target, NoDrafter(), requests(grammar), 0)

    class Oracle(NoDrafter):
        def propose(self, sequences, draft_len, sampling, generators, stop=None, branch=None):
            from verispec.drafters.base import Draft

            rows = []
            for sequence in sequences:
                i = next(i for i, p in enumerate(PROMPTS) if sequence[: len(p)] == p)
                rows.append((plain[i] + [EOS] * draft_len)[len(sequence) - len(PROMPTS[i]):][:draft_len])
            return Draft(torch.tensor(rows), torch.full((len(sequences),), draft_len))

    spec, batch = decode(target, Oracle(), requests(grammar), 6)
    assert spec == plain and all(EOS not in tokens for tokens in spec.values())
    assert batch.stats.accepted_tokens > 0


def test_logprobs_with_a_grammar_equal_plain_decodings_and_leave_out_forbidden_tokens(pair, grammar):
    target, draft = pair
    outputs = {}
    for name, drafter, k in (("plain", NoDrafter(), 0), ("spec", ModelDrafter(draft, target.vocab_size), 3)):
        batch = DecodeBatch(target, drafter, FixedDraftLen(k))
        batch.add([Request(prompt=p, max_new_tokens=MAX_NEW, id=i, grammar=grammar, logprobs=5, processed_logprobs=True)
                   for i, p in enumerate(PROMPTS)])
        outputs[name] = {i: [] for i in range(len(PROMPTS))}
        while len(batch):
            for event in batch.step():
                outputs[name][event.request_id] += event.logprobs
    for i in range(len(PROMPTS)):
        plain, spec = outputs["plain"][i], outputs["spec"][i]
        assert [t.token for t in spec] == [t.token for t in plain]
        np.testing.assert_allclose([t.logprob for t in spec], [t.logprob for t in plain], atol=1e-5)
        assert [[tok for tok, _ in t.top] for t in spec] == [[tok for tok, _ in t.top] for t in plain]
        assert all(np.isfinite(v) for t in spec for _, v in t.top)
    assert any(len(t.top) < 5 for t in outputs["spec"][0])  # positions where the grammar allowed fewer than 5 tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_model_drafter_drafts_only_what_the_grammar_allows(pair, grammar, temperature):
    """The draft is masked like the target (acceptance only); without the constraints it proposes forbidden tokens."""
    target, draft = pair
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(len(PROMPTS))]

    def forbidden(constraints):
        drafter = ModelDrafter(draft, target.vocab_size)
        drafter.add(PROMPTS)
        generators = [torch.Generator().manual_seed(i) for i in range(len(PROMPTS))]
        proposal = drafter.propose([list(p) for p in PROMPTS], 6, params, generators, constraints=constraints)
        count = 0
        for b in range(len(PROMPTS)):
            chain = proposal.tokens[b, : int(proposal.num_drafted[b])].tolist()
            masks = grammar.constraint().allowed([chain[:j] for j in range(len(chain))])
            count += sum(mask is None or not bool(mask[token]) for mask, token in zip(masks, chain))
        return count

    assert forbidden([grammar.constraint() for _ in PROMPTS]) == 0
    assert forbidden(None) > 0


# --- the sampled distribution ------------------------------------------------------------------------

# The second token depends on the first: after "a" only "b" or "c", after "b" only "a" or "c", ...
PAIRS = r"a[bc]|b[ac]|c[ab]|ab|ba"


def masked_joint(target, grammar, prompt: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """p(t1) and p(t1) p(t2 | t1) of plain constrained sampling at temperature 1, from the definitions."""
    def dist(generated):
        with torch.no_grad():
            logits = target.model(torch.tensor([prompt + generated])).logits[0, -1].double()
        constraint = grammar.constraint()
        constraint.matcher.consume_tokens(generated)
        allowed = constraint.allowed([[]])[0]
        p = torch.where(allowed, logits, float("-inf")).softmax(-1).numpy()
        return p

    p1 = dist([])
    vocab = len(p1)
    joint = np.zeros((vocab, vocab))
    for t in np.nonzero(p1)[0]:
        constraint = grammar.constraint()
        constraint.advance([int(t)])
        if t == EOS or constraint.finished:  # the row ends at t1: count it in the t2 = EOS cell
            joint[t, EOS] = p1[t]
        else:
            joint[t] = p1[t] * dist([int(t)])
    return p1, joint.ravel()


class MaskedDraft(NoDrafter):
    """Draws each draft token from the draft model's distribution masked by the grammar, and reports it as q
    (what a grammar-aware drafter does): draft tokens are then mostly allowed and often accepted, so t2 is
    mostly judged in the pass that judged t1. Any q keeps the rules exact."""

    def __init__(self, model, grammar, prompt_len: int):
        self.model, self.grammar, self.prompt_len = model, grammar, prompt_len

    def propose(self, sequences, draft_len, sampling, generators, stop=None, branch=None):
        from verispec.drafters.base import Draft
        from verispec.sampling import sample

        tokens = torch.zeros(len(sequences), draft_len, dtype=torch.long)
        probs = torch.zeros(len(sequences), draft_len, self.model.vocab_size)
        for b, sequence in enumerate(sequences):
            constraint = self.grammar.constraint()
            constraint.matcher.try_consume_tokens(sequence[self.prompt_len:])
            for i in range(draft_len):
                with torch.no_grad():
                    logits = self.model.model(torch.tensor([sequence + tokens[b, :i].tolist()])).logits[0, -1]
                allowed = constraint.allowed([tokens[b, :i].tolist()])[0]
                probs[b, i] = torch.where(allowed if allowed is not None else True, logits, float("-inf")).softmax(-1)
                tokens[b, i] = sample(probs[b, i], generators[b])
        return Draft(tokens, torch.full((len(sequences),), draft_len), probs)


def sample_first_two(target, draft, grammar, params, prompt, rows=2000):
    batch = DecodeBatch(target, MaskedDraft(draft, grammar, len(prompt)), FixedDraftLen(2))
    batch.add([Request(prompt, SamplingParams(**{**params.__dict__, "seed": 100 + i}), max_new_tokens=2, id=i, grammar=grammar)
               for i in range(rows)])
    outputs = [[] for _ in range(rows)]
    while len(batch):
        for event in batch.step():
            outputs[event.request_id] += event.tokens
    return outputs, batch.stats


def pvalues(p1, joint, outputs):
    vocab = len(p1)
    first = np.array([o[0] for o in outputs])
    cells = np.array([o[0] * vocab + (o[1] if len(o) > 1 else EOS) for o in outputs])
    return chi2_pvalue(first, p1), chi2_pvalue(cells, joint)


@pytest.mark.parametrize("rule", ["block", "token", "coupled"])
def test_sampling_follows_plain_constrained_decodings_distribution(monkeypatch, rule):
    """2000 seeded rows: t1 and (t1, t2) follow the masked distribution. The draft is nearly the target, so t2
    is mostly judged in the pass that judged t1, where only the mask after the draft's t1 is right. Masking
    every position as at the row's accepted tokens (the negative control) samples forbidden pairs."""
    target = tiny_llama(seed=1)
    draft = perturbed_copy(target, scale=0.02)
    grammar = toy_grammar("regex", PAIRS)
    params = SamplingParams(temperature=1.0, blockwise=rule == "block", coupled=rule == "coupled")
    prompt = [1, 5, 6]
    p1, joint = masked_joint(target, grammar, prompt)
    outputs, stats = sample_first_two(target, draft, grammar, params, prompt)
    assert stats.accepted_tokens > 0.3 * stats.drafted_tokens
    first, both = pvalues(p1, joint, outputs)
    assert first > P_THRESHOLD and both > P_THRESHOLD

    forgetful = Constraint.allowed
    monkeypatch.setattr(Constraint, "allowed", lambda self, paths: forgetful(self, [[]] * len(paths)))
    monkeypatch.setattr(Constraint, "advance", lambda self, tokens: self.matcher.try_consume_tokens(tokens))
    wrong, _ = sample_first_two(target, draft, grammar, params, prompt)
    vocab = len(p1)
    impossible = sum(joint[o[0] * vocab + (o[1] if len(o) > 1 else EOS)] == 0 for o in wrong)
    assert impossible > 100  # pairs plain constrained decoding never produces


# Prompts full of JSON-like text the grammar forbids ('[', "q", 4-digit numbers, letters outside [abcxyz]): a lookup
# drafter copying what followed a matching n-gram in them would propose forbidden tokens.
LOOKUP_PROMPTS = [toy_ids('{"ab": [1, 2], "q": 1234, "ab": 12}{"ab": 7}'), toy_ids('{"x": "y", "x": 99999, "x": 1}'),
                  toy_ids('{"abc": 1, "abc": 2, "d": 3, "abc": 4}')]


def lookup_drafts(target, grammar, drafter, reads_grammars: bool):
    """Greedy decode of LOOKUP_PROMPTS with `drafter` (given the rows' grammars or not); returns (output, the number
    of drafted tokens, how many of them their row's grammar forbade), each draft checked by a fresh matcher."""
    drafts = []
    propose = drafter.propose

    def recording(sequences, draft_len, sampling, generators, stop=None, branch=None, **grammars):
        draft = propose(sequences, draft_len, sampling, generators, stop, branch, **grammars)
        drafts.extend((list(s), draft.tokens[b, : int(draft.num_drafted[b])].tolist()) for b, s in enumerate(sequences))
        return draft

    drafter.propose = recording
    drafter.reads_grammars = reads_grammars
    out, _ = decode(target, drafter, requests(grammar, prompts=LOOKUP_PROMPTS), 6)
    drafted = forbidden = 0
    for sequence, chain in drafts:
        prompt = next(p for p in LOOKUP_PROMPTS if sequence[: len(p)] == p)
        constraint = grammar.constraint()
        constraint.matcher.consume_tokens(sequence[len(prompt):])
        masks = constraint.allowed([chain[:j] for j in range(len(chain))])
        drafted += len(chain)
        forbidden += sum(mask is None or not bool(mask[token]) for mask, token in zip(masks, chain))
    return out, drafted, forbidden


@pytest.mark.parametrize("name", ["ngram", "suffix"])
def test_a_lookup_draft_stops_before_the_first_token_the_grammar_forbids(pair, grammar, name):
    """The n-gram and suffix drafts end where the row's grammar forbids a token (`Constraint.valid_prefix`, which
    leaves the matcher as it was): no verify row scores a token the mask would reject, and the output is plain
    constrained decoding's. Given no grammars (the negative control), the same drafters propose forbidden tokens."""
    target, draft = pair
    plain, _ = decode(target, NoDrafter(), requests(grammar, prompts=LOOKUP_PROMPTS), 0)
    out, drafted, forbidden = lookup_drafts(target, grammar, DRAFTERS[name](target, draft), reads_grammars=True)
    assert out == plain and drafted > 0 and forbidden == 0
    blind, _, forbidden_blind = lookup_drafts(target, grammar, DRAFTERS[name](target, draft), reads_grammars=False)
    assert blind == plain and forbidden_blind > 0


def test_valid_prefix_only_looks(grammar):
    constraint = grammar.constraint()
    constraint.advance(toy_ids('{"ab": 1'))
    before = constraint.allowed([[]])[0]
    assert constraint.valid_prefix(toy_ids('2, "x": 3}')) == 10
    assert constraint.valid_prefix(toy_ids('2[')) == 1 and constraint.valid_prefix(toy_ids('q')) == 0
    assert constraint.valid_prefix(toy_ids('}') + [EOS, EOS]) == 2  # the grammar may end there; nothing after
    assert torch.equal(constraint.allowed([[]])[0], before)


def test_a_suffix_drafts_alternates_are_dropped_where_the_grammar_forbids_them(grammar):
    """With token trees (a branch rule that wants every second choice), each alternate the suffix draft keeps is
    one its grammar allows after the chain before it; without the grammar some are forbidden ('[' beside '1')."""
    prompt = toy_ids('{"ab": 12, "ab": 13, "ab": [3], "ab": 14}')
    context = prompt + toy_ids(', "ab": ')  # drafts "14}" with the second choices "[" and "3"
    everywhere = lambda confidence, num_drafted: torch.ones_like(confidence, dtype=torch.bool)  # noqa: E731

    def forbidden_alternates(with_grammar: bool) -> tuple[int, int]:
        drafter = SuffixDrafter(SuffixIndex(), VOCAB)
        drafter.add([prompt])
        constraint = grammar.constraint()
        constraint.advance(toy_ids('{"ab": 1, "ab": '))  # the row's grammar where the draft starts
        draft = drafter.propose([context], 6, [SamplingParams()], [torch.Generator()], branch=everywhere,
                                **({"constraints": [constraint]} if with_grammar else {}))
        chain = draft.tokens[0, : int(draft.num_drafted[0])].tolist()
        alternates = [int(a) for a in draft.alternates[0, : len(chain)]] if draft.alternates is not None else []
        masks = constraint.allowed([chain[:j] for j in range(len(alternates))])
        kept = [(mask, a) for mask, a in zip(masks, alternates) if a >= 0]
        return len(kept), sum(mask is None or not bool(mask[a]) for mask, a in kept)

    assert forbidden_alternates(with_grammar=False)[1] > 0
    kept, forbidden = forbidden_alternates(with_grammar=True)
    assert kept > 0 and forbidden == 0
