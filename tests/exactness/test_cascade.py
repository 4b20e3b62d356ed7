"""Speculative cascades (Narasimhan et al. 2025) are a lossy opt-in: the deferral rule must do what it says,
the rule's exact end must be exact (greedy identity, the target's distribution), a lossy setting must
visibly not sample the target (the chi-square test has the power to see it), bad settings must be refused
everywhere, and the LOSSY flag must reach the stats, the CLI's line, the server's usage and /metrics."""

from __future__ import annotations

import pytest
import torch

import verispec
from conftest import perturbed_copy, tiny_llama
from test_sampling_exactness import P_THRESHOLD, first_two_tokens_pvalues, repeating_prompt
from verispec.drafters.base import Draft
from verispec.sampling import Cascade, SamplingParams
from verispec.verifiers import BlockVerifier, CascadeVerifier, GreedyVerifier, SpeculativeSamplingVerifier, verifier_for
from verispec.verifiers.cascade import trusts_draft


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(seed=0)
    return target, perturbed_copy(target, scale=0.3)


# --- the rule ---------------------------------------------------------------------------------------

def test_deferral_rules_read_the_top_probabilities():
    max_q, max_p = torch.tensor([0.95, 0.6, 0.6, 1.0]), torch.tensor([0.5, 0.55, 0.9, 1.0])
    assert trusts_draft(Cascade("chow", 0.1), max_q, max_p).tolist() == [True, False, False, True]
    assert trusts_draft(Cascade("diff", 0.0), max_q, max_p).tolist() == [True, True, False, False]
    assert trusts_draft(Cascade("diff", 0.35), max_q, max_p).tolist() == [True, True, True, True]
    # The exact ends trust nothing, a sure draft included; alpha 1 trusts everything.
    assert not trusts_draft(Cascade("chow", 0.0), max_q, max_p).any()
    assert not trusts_draft(Cascade("diff", -1.0), max_q, max_p).any()
    assert trusts_draft(Cascade("chow", 1.0), max_q, max_p).all()


def test_greedy_rows_keep_trusted_tokens_and_check_the_rest():
    """Target argmax 3, 1, 4, 2 over the pass; the draft proposes 0 (not the argmax; draft sure, 0.95), 1
    (the argmax; unsure, 0.4), 2 (not; unsure, 0.6). chow:0.1 keeps the first two (trusted, then the
    target's own), refuses the third and answers with the target's argmax 4; chow:0 refuses at once."""
    logits = torch.full((1, 4, 6), -5.0)
    for position, token in enumerate([3, 1, 4, 2]):
        logits[0, position, token] = 5.0
    draft = Draft(tokens=torch.tensor([[0, 1, 2]]), num_drafted=torch.tensor([3]), confidence=torch.tensor([[0.95, 0.4, 0.6]]))
    for alpha, kept, next_token in [(0.1, 2, 4), (0.0, 0, 3), (1.0, 3, 2)]:
        sampling = [SamplingParams(cascade=Cascade("chow", alpha))]
        verifier = verifier_for(sampling)
        assert isinstance(verifier, CascadeVerifier) and not verifier.lossless
        verdict = verifier.verify(draft, logits, sampling, [torch.Generator()])
        assert (verdict.num_accepted.tolist(), verdict.next_tokens.tolist()) == ([kept], [next_token]), alpha
    # A greedy draft that reports no confidence (n-gram) is no model to trust: greedy verification.
    blind = Draft(tokens=draft.tokens, num_drafted=draft.num_drafted)
    sampling = [SamplingParams(cascade="chow:1")]
    assert verifier_for(sampling).verify(blind, logits, sampling, [torch.Generator()]).num_accepted.tolist() == [0]
    # Nor is a token the target rules out (a grammar's mask, a logit_bias ban): -inf stays -inf.
    banned = logits.clone()
    banned[0, 1, 1], banned[0, 1, 5] = float("-inf"), 6.0
    assert verifier_for(sampling).verify(draft, banned, sampling, [torch.Generator()]).num_accepted.tolist() == [1]


def test_sampled_rows_never_emit_what_the_target_rules_out():
    """Trusting the draft everywhere (chow:1), a drafted token outside the target's top-k is still refused and
    replaced from the target's residual, which lies inside its support."""
    logits, draft = random_sampled_draft(batch=200, k=3, vocab=12, seed=2)
    sampling = [SamplingParams(temperature=1.0, top_k=3, cascade="chow:1")] * 200
    verdict = verifier_for(sampling).verify(draft, logits, sampling, [torch.Generator().manual_seed(b) for b in range(200)])
    support = logits.topk(3, -1).indices  # [batch, k + 1, 3]
    for b in range(200):
        emitted = verdict.emitted(draft, b)
        assert all(token in support[b, i].tolist() for i, token in enumerate(emitted)), b
    assert 0 < int(verdict.num_accepted.sum()) < 3 * 200


def random_sampled_draft(batch: int, k: int, vocab: int, seed: int = 0):
    torch.manual_seed(seed)
    logits = torch.randn(batch, k + 1, vocab) * 2
    q = torch.softmax(torch.randn(batch, k, vocab) * 2, -1)
    tokens = torch.stack([torch.multinomial(q[b], 1).squeeze(1) for b in range(batch)])
    return logits, Draft(tokens=tokens, num_drafted=torch.full((batch,), k), probs=q, confidence=q.max(-1).values)


@pytest.mark.parametrize("exact_end", ["chow:0", "diff:-1"])
def test_exact_end_is_speculative_sampling_draw_for_draw(exact_end):
    """Never trusting the draft, the cascade is token-by-token speculative sampling: the same verdicts from
    the same random streams, over many random drafts."""
    logits, draft = random_sampled_draft(batch=64, k=4, vocab=12)
    cascade = [SamplingParams(temperature=0.9, cascade=exact_end)] * 64
    plain = [SamplingParams(temperature=0.9, blockwise=False)] * 64
    ours = verifier_for(cascade).verify(draft, logits, cascade, [torch.Generator().manual_seed(b) for b in range(64)])
    theirs = SpeculativeSamplingVerifier().verify(draft, logits, plain, [torch.Generator().manual_seed(b) for b in range(64)])
    assert torch.equal(ours.num_accepted, theirs.num_accepted) and torch.equal(ours.next_tokens, theirs.next_tokens)
    assert 0 < int(ours.num_accepted.sum()) < 4 * 64  # some drafts kept, some refused: the comparison has teeth
    assert not cascade[0].lossy


def test_trusting_everything_keeps_every_sampled_draft_token():
    logits, draft = random_sampled_draft(batch=16, k=4, vocab=12)
    sampling = [SamplingParams(temperature=0.9, cascade="chow:1")] * 16
    verdict = verifier_for(sampling).verify(draft, logits, sampling, [torch.Generator().manual_seed(b) for b in range(16)])
    assert verdict.num_accepted.tolist() == [4] * 16 and sampling[0].lossy


def test_batch_mates_keep_their_own_rule():
    """A cascade row between a sampled row and a greedy row that did not ask: each of those gets exactly
    what its own rule gives it alone (same random stream)."""
    logits, draft = random_sampled_draft(batch=3, k=4, vocab=40, seed=1)
    draft.tokens[2] = logits[2, :4].argmax(-1)
    draft.tokens[2, 2] = (draft.tokens[2, 2] + 1) % 40  # the greedy row's chain breaks at position 2
    sampling = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, cascade="diff:0.1"), SamplingParams()]
    verdict = verifier_for(sampling).verify(draft, logits, sampling, [torch.Generator().manual_seed(b) for b in range(3)])
    alone = BlockVerifier().verify(draft.rows(torch.tensor([0])), logits[:1], sampling[:1], [torch.Generator().manual_seed(0)])
    assert verdict.num_accepted[0] == alone.num_accepted[0] and verdict.next_tokens[0] == alone.next_tokens[0]
    greedy = GreedyVerifier().verify(draft.rows(torch.tensor([2])), logits[2:], sampling[2:], [torch.Generator()])
    assert verdict.num_accepted[2] == greedy.num_accepted[0] == 2 and verdict.next_tokens[2] == greedy.next_tokens[0]
    assert verifier_for(sampling[:1]).lossless and verifier_for(sampling[2:]).lossless


# --- end to end: exact at the exact end, visibly lossy elsewhere --------------------------------------

@pytest.mark.parametrize("exact_end", ["chow:0", "diff:-1"])
def test_greedy_exact_end_is_plain_decoding(pair, exact_end):
    target, draft = pair
    prompts = [[1, 5, 6, 7], [1, 2, 3], [4, 4, 8, 9, 2]]
    plain = verispec.generate(target, prompts, drafter="none", max_new_tokens=24)
    cascade = verispec.generate(target, prompts, draft=draft, draft_len=4, cascade=exact_end, max_new_tokens=24)
    assert [r.token_ids for r in cascade] == [r.token_ids for r in plain]
    assert cascade[0].stats.drafted_tokens > 0 and not cascade[0].stats.lossy


def test_greedy_lossy_setting_leaves_plain_decoding_and_says_so(pair):
    target, draft = pair
    prompts = [[1, 5, 6, 7], [1, 2, 3], [4, 4, 8, 9, 2]]
    plain = verispec.generate(target, prompts, drafter="none", max_new_tokens=24)
    exact = verispec.generate(target, prompts, draft=draft, draft_len=4, max_new_tokens=24)
    cascade = verispec.generate(target, prompts, draft=draft, draft_len=4, cascade="chow:1", max_new_tokens=24)
    assert [r.token_ids for r in cascade] != [r.token_ids for r in plain]
    assert cascade[0].stats.mean_accepted_tokens > exact[0].stats.mean_accepted_tokens
    assert cascade[0].stats.lossy and "LOSSY" in cascade[0].stats.summary() and not exact[0].stats.lossy
    assert cascade[0].stats.to_dict()["lossy"] is True


SAMPLED = SamplingParams(temperature=0.8, seed=11)


def sampled_runs(pair, cascade: str, rows: int = 2000):
    target, draft = pair
    prompt = repeating_prompt(target)
    results = verispec.generate(target, [prompt] * rows, draft=draft, draft_len=4, temperature=SAMPLED.temperature,
                                seed=SAMPLED.seed, cascade=cascade, max_new_tokens=2)
    return prompt, results


def test_sampled_exact_end_follows_the_target(pair):
    """chow:0 through the whole engine: 2000 seeded rows' first two tokens follow p(t1) p(t2 | t1)."""
    prompt, results = sampled_runs(pair, "chow:0")
    assert results[0].stats.drafted_tokens > results[0].stats.accepted_tokens > 0
    first, second = first_two_tokens_pvalues(pair[0], prompt, SAMPLED, [r.token_ids for r in results])
    assert min(first, second) > P_THRESHOLD, (first, second)


def test_sampled_lossy_setting_is_caught(pair):
    """The negative control: diff:0 keeps the draft's token wherever the draft is the surer model, which
    moves the first two tokens far enough from the target's distribution for the same test to fail."""
    prompt, results = sampled_runs(pair, "diff:0")
    first, second = first_two_tokens_pvalues(pair[0], prompt, SAMPLED, [r.token_ids for r in results])
    assert min(first, second) < P_THRESHOLD, (first, second)
    assert results[0].stats.lossy


# --- the option, everywhere it is given -------------------------------------------------------------

def test_the_option_has_three_spellings():
    assert Cascade.parse("chow:0.1") == Cascade.parse({"rule": "chow", "alpha": 0.1}) == Cascade("chow", 0.1)
    assert Cascade.parse({"alpha": 0.2}) == Cascade("chow", 0.2) and Cascade.parse(" diff : -0.5") == Cascade("diff", -0.5)
    assert SamplingParams(cascade="diff:0").cascade == Cascade("diff", 0.0) and SamplingParams().cascade is None
    assert str(Cascade("diff", 0.05)) == "diff:0.05"
    hash(SamplingParams(cascade={"rule": "chow", "alpha": 0.1}))  # settings stay hashable


@pytest.mark.parametrize("bad", ["chow:1.5", "chow:-0.1", "diff:-2", "max:0.1", "chow", "0.1", 0.1, True, [0.1],
                                 {"rule": "chow"}, {"rule": "diff", "alpha": "0"}, {"alpha": True},
                                 {"rule": "chow", "alpha": 0.1, "beta": 1}, "chow:nan"])
def test_bad_settings_are_refused(bad):
    with pytest.raises(verispec.VerispecError, match="cascade"):
        SamplingParams(cascade=bad)


def test_refused_with_coupling_or_typical_acceptance_and_not_coupled_by_default(pair):
    with pytest.raises(verispec.VerispecError, match="coupled"):
        SamplingParams(temperature=1.0, coupled=True, cascade="chow:0.1")
    with pytest.raises(verispec.VerispecError, match="typical_acceptance"):
        SamplingParams(temperature=1.0, typical_acceptance=0.09, cascade="chow:0.1")
    with pytest.raises(verispec.VerispecError, match="cascade"):
        verispec.generate(pair[0], [1, 2], drafter="none", cascade="chow:7", max_new_tokens=1)
    # A seeded sampled call couples by default; with a cascade it must not (that would be refused).
    result = verispec.generate(pair[0], [1, 2], draft=pair[1], draft_len=2, temperature=1.0, seed=3, cascade="chow:0.2",
                               max_new_tokens=4)
    assert result.token_ids and result.stats.lossy


def test_cli_flag(capsys):
    from verispec.cli import _generation_options, build_parser

    args = build_parser().parse_args(["generate", "hi", "--cascade", "diff:0.1", "--temperature", "0.7"])
    assert _generation_options(args, chat=False)["cascade"] == Cascade("diff", 0.1)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--cascade", "max:0.1"])
    assert "cascade rule must be one of chow, diff" in capsys.readouterr().err
    coupled = build_parser().parse_args(["generate", "hi", "--cascade", "chow:0.1", "--coupled", "--temperature", "1"])
    with pytest.raises(verispec.VerispecError, match="choose one"):
        _generation_options(coupled, chat=False)
    certify = build_parser().parse_args(["certify", "t", "--mode", "cascade"])
    assert certify.mode == ["cascade"]


def test_certify_reports_the_cascade_as_lossy(pair):
    """Over the whole vocabulary (top_k 0): with certify's default top_k 4 this pair's draft tokens inside the
    target's support are all ones the exact rule keeps too, so there is nothing for the cascade to change."""
    from verispec.certify import certify

    target, draft = pair
    certificate = certify(target, draft=draft, drafter="model", draft_lens=(3,), prompts=1, max_new_tokens=8,
                          samples=2000, modes=("cascade",), top_k=0)
    greedy, sampled = certificate.checks
    assert greedy.passed  # certify's greedy check decodes without the option
    assert not sampled.passed and "LOSSY" in sampled.name and sampled.figures["lossy"]


def test_server_takes_it_per_request_and_flags_it():
    from fastapi.testclient import TestClient

    from verispec.server import build_app

    app = build_app("smollm2-135m", drafter="ngram", max_batch=2)
    with TestClient(app) as client:
        def lossy_sequences() -> float:
            line = next(l for l in client.get("/metrics").text.splitlines() if l.startswith("verispec_lossy_sequences_total"))
            return float(line.rsplit(" ", 1)[1])

        before = lossy_sequences()
        body = {"prompt": "def add(a, b):", "max_tokens": 6, "temperature": 0}
        plain = client.post("/v1/completions", json=body)
        assert plain.status_code == 200 and "lossy" not in plain.json()["usage"]["speculative"]
        asked = client.post("/v1/completions", json={**body, "cascade": {"rule": "chow", "alpha": 0.2}})
        assert asked.status_code == 200, asked.text
        assert asked.json()["usage"]["speculative"]["lossy"] is True
        assert lossy_sequences() == before + 1
        for bad in ({"rule": "chow", "alpha": 2}, "chow:0.1:0", {"rule": "best", "alpha": 0.1}, 0.3):
            refused = client.post("/v1/completions", json={**body, "cascade": bad})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "cascade", refused.text
        both = client.post("/v1/completions", json={**body, "temperature": 1, "seed": 1, "coupled": True, "cascade": "chow:0.1"})
        assert both.status_code == 400 and "ask for one" in both.json()["error"]["message"]
