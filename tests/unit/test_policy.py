"""The adaptive draft length against a simulated engine whose costs and acceptance we set.

The simulation draws each drafted token's acceptance independently with probability `alpha` and
charges `target(rows)` seconds per target step and `draft` seconds per drafted token; the policy only
sees what a real engine would report. Its choices are compared with the k that maximises the true
rate E(k) / (k * draft + target(k + 1)).
"""

from __future__ import annotations

import gc
import random
from collections import Counter

import pytest
import torch

import verispec
from conftest import perturbed_copy, tiny_llama
from verispec.costs import BOOK, CostBook
from verispec.drafters import ModelDrafter
from verispec.engine import DecodeBatch, Request
from verispec.errors import VerispecError
from verispec.policy import AdaptiveDraftLen, Calibration, CostCurve, FixedDraftLen, make_policy, start_pays
from verispec.stats import StepRecord


def true_rate(k: int, alpha: float, draft: float, target) -> float:
    expected = sum(alpha ** i for i in range(k + 1))
    return expected / (k * draft + target(k + 1))


def simulate(policy, alpha: float, draft: float, target, steps: int = 400, batch_size: int = 1, seed: int = 0,
             noise: float = 0.05) -> Counter:
    rng = random.Random(seed)
    chosen = Counter()
    for _ in range(steps):
        k = policy.choose(batch_size)
        chosen[k] += 1
        accepted = []
        for _ in range(batch_size):
            n = 0
            while n < k and rng.random() < alpha:
                n += 1
            accepted.append(n)
        jitter = lambda: 1 + rng.uniform(-noise, noise)
        policy.observe(StepRecord(batch_size, k, k + 1, torch.full((batch_size,), k), torch.tensor(accepted),
                                  k * draft * jitter(), target(batch_size * (k + 1)) * jitter()))
    return chosen


def cpu_like(rows: int) -> float:
    """A memory-bound target: flat up to ~8 rows, then compute starts to show."""
    return 0.3 * (1 + 0.02 * rows + max(0, rows - 8) * 0.08)


@pytest.mark.parametrize("alpha,draft", [(0.85, 0.06), (0.6, 0.06), (0.9, 0.02)])
def test_settles_near_the_best_draft_length(alpha, draft):
    policy = AdaptiveDraftLen()
    chosen = simulate(policy, alpha, draft, cpu_like)
    best = max(range(9), key=lambda k: true_rate(k, alpha, draft, cpu_like))
    settled, _ = chosen.most_common(1)[0]
    # Within one of the optimum, and at a rate within 5% of the best achievable.
    assert abs(settled - best) <= 1
    assert true_rate(settled, alpha, draft, cpu_like) >= 0.95 * true_rate(best, alpha, draft, cpu_like)


def test_stops_speculating_when_drafting_does_not_pay():
    policy = AdaptiveDraftLen()
    chosen = simulate(policy, alpha=0.3, draft=0.3, target=cpu_like)  # a draft as slow as the target, rarely right
    assert chosen[0] / sum(chosen.values()) > 0.85
    assert chosen[1] > 0  # but it keeps probing, so it would notice if that changed


def test_recovers_when_acceptance_changes():
    """A prompt whose second half is easy (e.g. code that repeats the prompt) should win back long drafts."""
    policy = AdaptiveDraftLen()
    simulate(policy, alpha=0.2, draft=0.06, target=cpu_like, steps=200)
    assert policy.choose(1) <= 1
    later = simulate(policy, alpha=0.9, draft=0.06, target=cpu_like, steps=200, seed=1)
    assert later.most_common(1)[0][0] >= 4


def test_one_slow_step_does_not_move_the_choice():
    curve = CostCurve()
    for _ in range(5):
        curve.observe(5, 0.3)
    curve.observe(5, 3.0)  # a neighbour took the core for one step
    assert curve(5) == pytest.approx(0.3)


def test_cost_curve_prices_unmeasured_sizes_from_measured_ones():
    curve = CostCurve()
    assert curve(3) is None
    curve.observe(2, 1.0)
    assert curve(9) == 1.0  # one point: flat
    curve.observe(6, 2.0)
    assert curve(1) == 1.0  # below: the smallest measured size's cost
    assert curve(4) == pytest.approx(1.5)  # between: on the line
    assert curve(10) == pytest.approx(3.0)  # beyond: the last slope, 0.25 s per row
    curve.observe(8, 1.5)  # a cheaper larger size caps the smaller one (never cheaper with more rows)
    assert curve(6) == 1.5


def test_estimates_carry_over_to_a_new_batch_size():
    """Costs are learned per token row, so batch 4 is priced from batch 1's steps instead of re-explored."""
    policy = AdaptiveDraftLen()
    simulate(policy, alpha=0.8, draft=0.05, target=cpu_like, steps=100)
    rates = policy.predicted_rates(2)
    assert set(rates) >= {0, 1, 2, 3}
    # Wider passes at batch 2 cost what batch 1 measured for the same number of rows.
    assert policy.target_cost(2 * 4) == pytest.approx(cpu_like(8), rel=0.1)


def test_fixed_and_validation():
    assert isinstance(make_policy(3), FixedDraftLen) and make_policy(3).choose(7) == 3
    assert isinstance(make_policy("auto"), AdaptiveDraftLen)
    for bad in (0, -1, 2.5, "four", True):
        with pytest.raises(VerispecError, match="draft_len"):
            make_policy(bad)


def test_engine_keeps_verify_passes_within_the_targets_exact_rows():
    """With a target that is row-exact up to 8 rows, a batch of 3 never verifies more than 2 drafts."""
    target = tiny_llama(seed=0)
    draft = perturbed_copy(target, scale=0.05)

    target.max_exact_rows = 8
    try:
        batch = DecodeBatch(target, ModelDrafter(draft, target.vocab_size), FixedDraftLen(6))
        batch.add([Request(prompt=[1, 2, 3 + i], max_new_tokens=20, id=i) for i in range(3)])
        assert batch.next_draft_len() == 8 // 3 - 1
        batch.remove(0)
        batch.remove(1)
        assert batch.next_draft_len() == 6  # one row: 7 rows fit
    finally:
        del target.max_exact_rows


def test_rows_without_a_draft_count_against_acceptance():
    """An n-gram drafter that finds nothing for half the rows: those rows still ride the wider pass
    and gain nothing, so E(k) must not count only the rows that drafted."""
    policy = AdaptiveDraftLen()
    for _ in range(50):
        policy.observe(StepRecord(4, 1, 2, torch.tensor([1, 1, 0, 0]), torch.tensor([1, 0, 0, 0]), 0.001, 0.1))
    assert policy.acceptance()[0] == pytest.approx(0.25, abs=0.03)
    # A position never reached is priced like the last one measured, not like the optimistic prior.
    assert policy.acceptance()[1] == pytest.approx(0.25, abs=0.03)


def test_calibration_learns_acceptance_by_confidence():
    calibration = Calibration()
    rng = random.Random(0)
    for _ in range(300):  # a draft that is right 99% of the time when sure and 40% when torn
        confidence = torch.tensor([[0.97, 0.45]])
        accepted = int(rng.random() < 0.99)
        accepted += accepted and rng.random() < 0.4
        calibration.observe(confidence, torch.tensor([2]), torch.tensor([accepted]))
    sure, torn = calibration(torch.tensor([0.97, 0.45])).tolist()
    assert sure == pytest.approx(0.99, abs=0.02)
    assert torn == pytest.approx(0.4, abs=0.1)
    assert calibration(torch.tensor([0.05])).item() == pytest.approx(0.05 ** 0.5)  # never seen: the prior, sqrt(c)


def confident_steps(policy, draft: float, target, steps: int = 3000, seed: int = 0, chosen: Counter | None = None,
                    history: list | None = None, catch_up: float = 0.0) -> float:
    """Tokens per second over a simulated run where each drafted token carries the draft's confidence
    and is accepted with exactly that probability. Text alternates between easy stretches (confidence
    0.9-1.0) and hard ones (0.05-0.5), switching after a token with probability 0.2, as code alternates
    between boilerplate and new names. The policy sees each confidence before keeping the token.
    catch_up: seconds a step that drafts pays per token decoded since the last one that did (a head
    reading the target's states it skipped: `Drafter.catch_up`)."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    easy = True
    skipped = 0
    for _ in range(steps):
        k = policy.choose(1)
        if chosen is not None:
            chosen[k] += 1
        if history is not None:
            history.append(k)
        caught_up = catch_up * skipped if k else 0.0
        skipped = 0 if k else skipped + 1
        stop = policy.stop_rule(1) if k else None
        confidence = []
        for _ in range(k):
            confidence.append(rng.uniform(0.9, 1.0) if easy else rng.uniform(0.05, 0.5))
            easy = easy != (rng.random() < 0.2)
        drafted = 0
        for i, c in enumerate(confidence):
            if stop is not None and not bool(stop(i, torch.tensor([c]))[0]):
                break
            drafted += 1
        accepted = 0
        while accepted < drafted and rng.random() < confidence[accepted]:
            accepted += 1
        forwards = drafted if drafted == k else drafted + 1  # a stop still paid for the token it judged
        draft_seconds, target_seconds = forwards * draft + caught_up, target(drafted + 1)
        policy.observe(StepRecord(1, k, drafted + 1, torch.tensor([drafted]), torch.tensor([accepted]), draft_seconds,
                                  target_seconds, torch.tensor([confidence[:drafted]]) if drafted else None,
                                  catch_up_seconds=caught_up))
        tokens += accepted + 1
        seconds += draft_seconds + target_seconds
    return tokens / seconds


def test_confidence_stops_beat_every_fixed_draft_length():
    """When the draft knows which of its tokens are shaky, stopping there beats any fixed k."""
    fixed = max(confident_steps(FixedDraftLen(k), 0.03, cpu_like) for k in range(1, 11))
    adaptive = confident_steps(AdaptiveDraftLen(), 0.03, cpu_like)
    assert adaptive > 1.1 * fixed


def test_confident_drafts_stop_when_drafting_does_not_pay():
    """A draft as slow as the target: every stop comes too late to help, so the policy stops drafting
    (and still probes now and then)."""
    chosen = Counter()
    confident_steps(AdaptiveDraftLen(), 0.3, cpu_like, steps=400, chosen=chosen)
    assert chosen[0] / sum(chosen.values()) > 0.85
    assert sum(n for k, n in chosen.items() if k > 0) > 10


def test_confident_drafts_come_back_soon_after_a_slow_stretch():
    """A stretch where drafting does not pay (here the draft is slowed, as on a machine busy with other
    work) switches speculation off; once drafting pays again, the probes must bring it back within a
    few dozen steps, not after the stale slow stretch has been outvoted step by step."""
    policy = AdaptiveDraftLen()
    chosen = Counter()
    confident_steps(policy, 0.3, cpu_like, steps=300, chosen=chosen)
    assert chosen[0] / sum(chosen.values()) > 0.8
    history = []
    confident_steps(policy, 0.03, cpu_like, steps=200, seed=1, history=history)
    first_on = next(i for i, k in enumerate(history) if k > 0)
    assert first_on <= policy.probe_every
    assert sum(k > 0 for k in history[60:]) / len(history[60:]) > 0.9


def first_steps(policy, accepted_per_step: list[int], draft: float = 0.03, target=cpu_like) -> list[int]:
    """The draft lengths chosen over a request's first steps when each drafting step gets the given number of its
    tokens accepted (the draft sure of every token and drafting up to 3); then nothing more."""
    history = []
    for step in range(len(accepted_per_step) + 12):
        k = policy.choose(1)
        history.append(k)
        stop = policy.stop_rule(1) if k else None
        drafted = 0
        while drafted < k and (stop is None or bool(stop(drafted, torch.tensor([0.95]))[0])) and drafted < 3:
            drafted += 1
        accepted = min(drafted, accepted_per_step[step] if step < len(accepted_per_step) else 0) if k else 0
        policy.observe(StepRecord(1, k, drafted + 1, torch.tensor([drafted]), torch.tensor([accepted]), drafted * draft,
                                  target(drafted + 1), torch.tensor([[0.95] * drafted]) if drafted else None))
    return history


def test_a_drafter_whose_opening_drafts_fail_keeps_drafting_long_enough_to_show_it_pays():
    """A head right on ~30% of first tokens fails its first two drafts about half the time (Spec-Bench humanities:
    its first four). Stopping there was tried (2026-11-26): its probes every 16 steps then never had a token taken,
    and the prompt ran at 0.92x of what 8 opening steps of evidence gave (1.3 tokens/pass). So the opening steps
    draft whatever the first few show (but the one plain step that measures what drafting must beat)."""
    for opening in ([0], [0, 0], [0, 0, 0, 0], [0, 1, 0, 0]):
        history = first_steps(AdaptiveDraftLen(), opening + [1, 2, 0, 1] * 3)
        assert sum(k == 0 for k in history[:12]) == 1, opening


def test_a_heads_catch_up_does_not_keep_it_off_after_a_slow_stretch():
    """A head reads the target's states of every token decoded while it was off when it drafts again (here ~7%
    of a step per token skipped, a slow head's). Priced as the probe's own drafting, it makes each probe look
    as slow as the plain stretch before it was long, and drafting stays off (this fails with the catch-up
    counted in); timed apart, the probes bring it back."""
    policy = AdaptiveDraftLen()
    confident_steps(policy, 0.3, cpu_like, steps=300, catch_up=0.02)
    history = []
    confident_steps(policy, 0.03, cpu_like, steps=200, seed=1, history=history, catch_up=0.02)
    assert sum(k > 0 for k in history[60:]) / len(history[60:]) > 0.9


def test_a_draft_starts_only_when_its_prefill_can_pay():
    # A quarter of 64 tokens, 16 plain steps of 0.1 s at 2x, saves 0.8 s: a 0.5 s prefill pays, a 1 s one does not.
    assert start_pays(0.5, 0.1, 64)
    assert not start_pays(1.0, 0.1, 64)
    assert start_pays(1.0, 0.1, 64, speedup=3.0)  # saves 1.07 s
    assert start_pays(2.0, 0.1, 64, share=1.0)  # the whole budget: saves 3.2 s
    assert not start_pays(0.1, 0.1, 64, speedup=1.0)  # a draft that speeds nothing up saves nothing
    assert start_pays(None, 0.1, 64) and start_pays(4.0, None, 64)  # unmeasured: start, and measure


def test_cost_book_prices_a_draft_prefill_relative_to_the_targets():
    book, target, draft = CostBook(), tiny_llama(seed=0), tiny_llama(seed=1)
    assert book.relative_prefill(target, draft, 100) is None and book.step_seconds(target) is None
    book.record_relative_prefill(target, draft, 100, 0.2)
    book.record_relative_prefill(target, draft, 120, 0.3)
    book.record_relative_prefill(target, draft, 1000, 0.4)  # long prompts: relatively dearer drafts
    assert book.relative_prefill(target, draft, 110) == pytest.approx(0.25)  # the median of the nearby lengths
    assert book.relative_prefill(target, draft, 800) == pytest.approx(0.4)
    assert book.relative_prefill(target, draft, 5000) == pytest.approx(0.4)  # the nearest length's
    assert book.relative_prefill(draft, target, 100) is None  # per (target, draft) pair
    for seconds in (0.2, 0.1, 0.3):
        book.record_step(target, seconds)
    assert book.step_seconds(target) == pytest.approx(0.2)
    del draft
    gc.collect()
    assert len(book._relative[target]) == 0  # keyed weakly: a dropped model leaves
    del target
    gc.collect()
    assert len(book._relative) == 0 and len(book._step) == 0


def test_auto_gives_way_to_prompt_lookup_where_the_draft_prefill_would_not_pay(monkeypatch):
    """The costs decide the drafter; the tokens are plain greedy decoding's either way."""
    target = tiny_llama(seed=0)
    draft = perturbed_copy(target, scale=0.05)
    prompt = [1, 5, 9, 5, 9, 5, 9, 7, 2, 5, 9] * 3
    monkeypatch.setattr(verispec.engine, "START_AFTER", 0)  # the draft starts with the call (the late start: below)
    plain = verispec.generate(target, prompt, drafter="none", max_new_tokens=24)
    assert BOOK.step_seconds(target) is not None  # plain steps of one row are measured
    first = verispec.generate(target, prompt, draft=draft, max_new_tokens=24)
    assert first.stats.drafter.startswith("ModelDrafter")  # (then perhaps prompt lookup: `DecodeBatch._judge_start`)
    assert BOOK.relative_prefill(target, draft, len(prompt) - 1) > 0  # the draft's prefill, measured

    # A draft prefill priced at a million times the target's cannot pay; one priced at nothing can.
    monkeypatch.setattr(BOOK, "relative_prefill", lambda target, draft, tokens: 1e6)
    slow = verispec.generate(target, prompt, draft=draft, max_new_tokens=24)
    assert slow.stats.drafter == "NgramDrafter" and slow.token_ids == plain.token_ids
    assert slow.stats.drafted_tokens > 0  # prompt lookup still drafts
    # An explicit drafter or a fixed draft length keeps the draft model.
    assert verispec.generate(target, prompt, draft=draft, drafter="model", max_new_tokens=24).stats.drafter == "ModelDrafter"
    assert verispec.generate(target, prompt, draft=draft, draft_len=3, max_new_tokens=24).stats.drafter == "ModelDrafter"
    monkeypatch.setattr(BOOK, "relative_prefill", lambda target, draft, tokens: 0.0)
    fast = verispec.generate(target, prompt, draft=draft, max_new_tokens=24)
    assert fast.stats.drafter.startswith("ModelDrafter") and fast.token_ids == plain.token_ids


def test_a_started_draft_that_loses_to_plain_steps_gives_way_mid_call(monkeypatch):
    """After `RETREAT_STEPS` steps, a call whose draft model gave fewer tokens per second than plain steps do drafts
    by prompt lookup for the rest; one that did better keeps it. The tokens are plain decoding's either way."""
    from verispec.policy import RETREAT_STEPS, retreat_pays

    assert retreat_pays(10, 1.0, 0.05) and not retreat_pays(30, 1.0, 0.05)  # 10 tok/s against 20 plain; 30 against 20
    assert not retreat_pays(10, 1.0, None)  # plain steps unmeasured: keep the draft
    target = tiny_llama(seed=0)
    draft = perturbed_copy(target, scale=0.05)
    prompt = [1, 5, 9, 5, 9, 5, 9, 7, 2, 5, 9] * 3
    plain = verispec.generate(target, prompt, drafter="none", max_new_tokens=80)
    monkeypatch.setattr(verispec.engine, "START_AFTER", 0)  # the draft starts with the call (the late start: below)
    monkeypatch.setattr(BOOK, "relative_prefill", lambda target, draft, tokens: 0.0)  # the draft starts
    monkeypatch.setattr(BOOK, "step_seconds", lambda target: 1e-9)  # plain steps beat anything
    lost = verispec.generate(target, prompt, draft=draft, max_new_tokens=80)
    assert lost.stats.target_passes > RETREAT_STEPS
    assert lost.stats.drafter == "ModelDrafter, then NgramDrafter" and lost.token_ids == plain.token_ids
    monkeypatch.setattr(BOOK, "step_seconds", lambda target: 1e9)  # plain steps lose to anything
    kept = verispec.generate(target, prompt, draft=draft, max_new_tokens=80)
    assert kept.stats.drafter == "ModelDrafter" and kept.token_ids == plain.token_ids
    # a batch of two rows, or a fixed draft length, is not judged
    monkeypatch.setattr(BOOK, "step_seconds", lambda target: 1e-9)
    stats = verispec.generate(target, [prompt, prompt[1:]], draft=draft, max_new_tokens=80)
    assert [r.stats.drafter for r in stats] == ["ModelDrafter", "ModelDrafter"] and stats[0].token_ids == plain.token_ids
    assert verispec.generate(target, prompt, draft=draft, draft_len=3, max_new_tokens=80).stats.drafter == "ModelDrafter"


def test_only_a_drafter_that_reports_confidence_has_an_opening():
    """The opening (drafting whatever the first steps show) belongs to the confidence rule; without confidence the
    lengths follow predicted rates at once, and a judgment waiting for an opening would wait for ever."""
    from verispec.policy import OPENING_STEPS

    def step(confidence: bool) -> StepRecord:
        return StepRecord(1, 4, 5, torch.tensor([4]), torch.tensor([2]), draft_seconds=0.01, target_seconds=0.04,
                          confidence=torch.full((1, 4), 0.9) if confidence else None)

    blind, sure = AdaptiveDraftLen(), AdaptiveDraftLen()
    assert not blind.opening and not sure.opening  # nothing drafted yet
    for n in range(3 * OPENING_STEPS):
        blind.observe(step(confidence=False))
        sure.observe(step(confidence=True))
        assert not blind.opening
        if n + 1 < OPENING_STEPS:  # (a decayed count of drafting steps: a little past OPENING_STEPS steps)
            assert sure.opening
    assert not sure.opening


def test_a_started_draft_is_judged_on_the_steps_after_the_policys_opening(monkeypatch):
    """The policy's opening steps draft whatever they show (`AdaptiveDraftLen.opening`): a price paid either way and
    no forecast of the steps after it, so the judgment counts `RETREAT_STEPS` steps from the opening's end, and a call
    still in its opening keeps its draft model even where plain steps beat anything."""
    from verispec import engine
    from verispec.policy import RETREAT_STEPS

    target = tiny_llama(seed=0)
    draft = perturbed_copy(target, scale=0.05)
    prompt = [1, 5, 9, 5, 9, 5, 9, 7, 2, 5, 9] * 3
    plain = verispec.generate(target, prompt, drafter="none", max_new_tokens=120, min_tokens=120)
    monkeypatch.setattr(engine, "START_AFTER", 0)
    monkeypatch.setattr(BOOK, "relative_prefill", lambda target, draft, tokens: 0.0)  # the draft starts
    monkeypatch.setattr(BOOK, "step_seconds", lambda target: 1e-9)  # plain steps beat anything
    monkeypatch.setattr(AdaptiveDraftLen, "opening", property(lambda self: True))
    kept = verispec.generate(target, prompt, draft=draft, max_new_tokens=120, min_tokens=120)
    assert kept.stats.drafter == "ModelDrafter" and kept.token_ids == plain.token_ids

    opening = 5  # steps (the policy's count of draft lengths chosen), then the judged ones
    asked: list[int] = []  # the policy's step count each time its opening is asked about; the judgment asks last
    monkeypatch.setattr(AdaptiveDraftLen, "opening", property(lambda self: asked.append(self.steps) or self.steps <= opening))
    judged_at = []
    real = engine.retreat_pays
    monkeypatch.setattr(engine, "retreat_pays", lambda *args: judged_at.append(asked[-1]) or real(*args))
    lost = verispec.generate(target, prompt, draft=draft, max_new_tokens=120, min_tokens=120)
    assert judged_at == [opening + RETREAT_STEPS]
    assert lost.stats.drafter == "ModelDrafter, then NgramDrafter" and lost.token_ids == plain.token_ids


def test_a_call_of_one_row_starts_its_draft_model_once_the_answer_runs_long(monkeypatch):
    """`auto` drafts by prompt lookup for the first few tokens of a one-row call (`policy.start_after`), so an answer
    that ends sooner never pays the draft's prefill; past them the draft model reads the prompt and drafts (and may still
    give way, judged from then on). The tokens are plain decoding's in every case."""
    from verispec.policy import RETREAT_STEPS

    target = tiny_llama(seed=0)
    draft = perturbed_copy(target, scale=0.05)
    prompt = [1, 5, 9, 5, 9, 5, 9, 7, 2, 5, 9] * 3
    plain = verispec.generate(target, prompt, drafter="none", max_new_tokens=120, min_tokens=120)  # no early EOS
    monkeypatch.setattr(verispec.engine, "start_after", lambda startup, step, answers, most: 16)  # the wait (arithmetic: below)
    monkeypatch.setattr(BOOK, "relative_prefill", lambda target, draft, tokens: 0.0)  # a start pays
    monkeypatch.setattr(BOOK, "step_seconds", lambda target: 1e9)  # and the draft is kept once started

    short = verispec.generate(target, prompt, draft=draft, max_new_tokens=16)
    assert short.stats.drafter == "NgramDrafter" and short.token_ids == plain.token_ids[:16]
    long = verispec.generate(target, prompt, draft=draft, max_new_tokens=120, min_tokens=120)
    assert long.stats.drafter == "NgramDrafter, then ModelDrafter" and long.token_ids == plain.token_ids
    for result in (short, long):  # the draft's late prefill counts as prefill, within the call's time
        assert 0 < result.stats.prefill_seconds < result.stats.total_seconds

    # Priced over the tokens the row may still make: a prefill that pays over 120 tokens may not over the rest.
    monkeypatch.setattr(BOOK, "step_seconds", lambda target: 0.1)
    monkeypatch.setattr(BOOK, "relative_prefill", lambda target, draft, tokens: 1.0)
    import verispec.engine as engine

    seconds = []
    real = engine.start_pays
    monkeypatch.setattr(engine, "start_pays", lambda startup, step, new_tokens: seconds.append(new_tokens) or real(0.0, step, new_tokens))
    verispec.generate(target, prompt, draft=draft, max_new_tokens=120, min_tokens=120)
    assert seconds == [120, 120 - 16]  # at the call's start, and at the late start (16 tokens in)
    monkeypatch.setattr(engine, "start_pays", lambda startup, step, new_tokens: new_tokens == 120)
    declined = verispec.generate(target, prompt, draft=draft, max_new_tokens=120, min_tokens=120)
    assert declined.stats.drafter == "NgramDrafter" and declined.token_ids == plain.token_ids

    # Started late, the draft is judged from then on: it gives way where plain steps beat it.
    monkeypatch.setattr(engine, "start_pays", real)
    monkeypatch.setattr(BOOK, "relative_prefill", lambda target, draft, tokens: 0.0)
    monkeypatch.setattr(BOOK, "step_seconds", lambda target: 1e-9)
    lost = verispec.generate(target, prompt, draft=draft, max_new_tokens=120, min_tokens=120)
    assert lost.stats.drafter == "NgramDrafter, then ModelDrafter, then NgramDrafter" and lost.token_ids == plain.token_ids
    assert lost.stats.target_passes > RETREAT_STEPS


def test_the_wait_before_a_draft_starts_is_fitted_to_the_answers_seen():
    """An empirical ski rental: the wait that would have paid best over the latest answers, where waiting w tokens
    forgoes half a plain step a token (a draft at START_SPEEDUP 2) and saves the prefill on answers that end within
    it; at most `most` tokens; no history or unmeasured costs start at once."""
    from verispec.policy import start_after

    # a 0.3 s prefill, 0.06 s steps: a token waited forgoes 0.03 s
    assert start_after(0.3, 0.06, [128] * 10, 32) == 0  # long answers: waiting only forgoes savings
    assert start_after(0.3, 0.06, [5] * 10, 32) == 5  # answers of 5: wait them out (saves 0.3 - 0.15 each)
    assert start_after(0.3, 0.06, [12] * 10, 32) == 0  # of 12: waiting forgoes 0.36 > 0.3, start at once
    assert start_after(1.2, 0.06, [14] * 8 + [128] * 2, 32) == 14  # a dear prefill, mostly short answers
    assert start_after(1.2, 0.06, [14] * 2 + [128] * 8, 32) == 0  # ... mostly long ones
    assert start_after(3.0, 0.06, [60] * 10, 32) == 0  # answers past the most it may wait: no gain in waiting
    assert start_after(0.3, 0.06, [5] * 10, 4) == 0 and start_after(0.3, 0.06, [5] * 10, 0) == 0  # capped
    assert start_after(0.3, 0.06, [], 32) == 0  # no history
    assert start_after(None, 0.06, [5], 32) == 0 and start_after(0.3, None, [5], 32) == 0  # unmeasured: start, and measure
    assert start_after(0.3, 0.06, [9] * 10, 32, speedup=4.0) == 0  # a better draft forgoes more a token: 0.045 s


def test_the_book_keeps_the_latest_answer_lengths_per_target():
    book, target, other = CostBook(answers=3), tiny_llama(seed=0), tiny_llama(seed=1)
    for tokens in (5, 9, 12, 40):
        book.record_answer(target, tokens)
    assert book.answers(target) == [9, 12, 40] and book.answers(other) == []
    BOOK._answers.pop(target, None)
    verispec.generate(target, [1, 5, 9, 5, 9], drafter="none", max_new_tokens=7, min_tokens=7)
    assert BOOK.answers(target) == [7]  # every finished row is counted
