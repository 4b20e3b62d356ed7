"""The adaptive draft length in a server's batches: what pays at batch 1 must not be assumed at batch 16.

A simulated engine with costs shaped like SmolLM2-135M drafting with its int4 copy on 2 CPU cores (measured
by `bench/serve_bench.py`): a target pass of r token rows takes 24 ms + 2 ms per row, a draft pass over b rows
6 ms + 2.5 ms per row. At batch 1 drafting pays well; at batch 16 a draft pass costs nearly a plain step,
so it cannot pay even when every drafted token is accepted. Each drafted token carries the draft's confidence
and is accepted with that probability; the policy sees only what a real engine reports.
"""

from __future__ import annotations

import random

import pytest
import torch

from verispec.policy import AdaptiveDraftLen, Calibration, ConfidenceStop, RatesByBatch
from verispec.stats import StepRecord


def target_seconds(rows: int) -> float:
    return 0.024 + 0.002 * rows


def draft_seconds(batch_size: int) -> float:
    return 0.006 + 0.0025 * batch_size


def batch_steps(policy, batch_size: int, steps: int, seed: int = 0) -> list[int]:
    """Run `steps` steps at `batch_size`; the k the policy chose each step. Every row's text alternates between
    easy stretches (confidence 0.9-1.0) and hard ones (0.05-0.5), as in test_policy's `confident_steps`; the
    draft runs over every row while any row goes on, as `ModelDrafter.propose` does."""
    rng = random.Random(seed)
    easy = [True] * batch_size
    history = []
    for _ in range(steps):
        k = policy.choose(batch_size)
        history.append(k)
        stop = policy.stop_rule(batch_size) if k else None
        confidence = torch.zeros(batch_size, k)
        for b in range(batch_size):
            for i in range(k):
                confidence[b, i] = rng.uniform(0.9, 1.0) if easy[b] else rng.uniform(0.05, 0.5)
                easy[b] = easy[b] != (rng.random() < 0.2)
        going = torch.ones(batch_size, dtype=torch.bool)
        drafted = torch.zeros(batch_size, dtype=torch.long)
        passes = 0
        for i in range(k):
            passes += 1
            if stop is not None:
                going &= stop(i, confidence[:, i])
            drafted += going.long()
            if not going.any():
                break
        accepted = torch.tensor([next((n for n in range(int(drafted[b])) if rng.random() >= confidence[b, n]),
                                      int(drafted[b])) for b in range(batch_size)])
        width = 1 + int(drafted.max())
        policy.observe(StepRecord(batch_size, k, width, drafted, accepted, passes * draft_seconds(batch_size),
                                  target_seconds(batch_size * width),
                                  confidence[:, : width - 1] if width > 1 else None))
    return history


def test_batch_one_evidence_does_not_keep_batch_sixteen_drafting():
    """After a stretch at batch 1, where drafting pays, a batch of 16 arrives: drafting there cannot pay, and the
    policy must see so within a few steps (one rate shared by every batch size kept it drafting for dozens)."""
    policy = AdaptiveDraftLen()
    batch_steps(policy, 1, 300)
    at_16 = batch_steps(policy, 16, 100, seed=1)
    assert sum(k > 0 for k in at_16) <= 5


def test_no_probes_where_even_a_full_acceptance_would_not_pay():
    """At batch 16 every probe is a draft pass lost (~50% of a plain step here): once its cost is measured, the
    policy probes far more rarely than every `probe_every` steps."""
    policy = AdaptiveDraftLen()
    batch_steps(policy, 1, 300)
    batch_steps(policy, 16, 50, seed=1)
    assert not policy.could_pay(16) and policy.could_pay(1)
    later = batch_steps(policy, 16, 200, seed=2)
    assert sum(k > 0 for k in later) <= 2


def test_batch_one_drafts_again_at_once_after_a_stretch_at_sixteen():
    """Batch 16's evidence must not drag batch 1 down either: back to one request, drafting resumes right away."""
    policy = AdaptiveDraftLen()
    batch_steps(policy, 1, 300)
    batch_steps(policy, 16, 200, seed=1)
    again = batch_steps(policy, 1, 20, seed=2)
    assert all(k > 0 for k in again)


def test_an_unmeasured_batch_size_leans_on_its_neighbours_edge():
    """Batch 4 never drafted: it is priced from the edge over plain decoding measured at 1 and 8, on the line
    between them; its own steps take over as they come."""
    rates = RatesByBatch()
    plain = lambda b: {1: 0.025, 4: 0.030, 8: 0.040}.get(b, 0.05)  # noqa: E731  (a plain step's seconds)
    for _ in range(10):
        rates.observe(1, 1.4, 0.025)  # 56 tokens/s per sequence: 1.4x plain's 40
        rates.observe(8, 0.6, 0.025)  # 24 tokens/s: 0.96x plain's 25
    assert rates.rate(4, plain) == pytest.approx((1.4 + (0.96 - 1.4) * 3 / 7) / 0.030)
    assert rates.rate(16, plain) == pytest.approx(0.96 / 0.05)  # beyond the largest: its edge
    for _ in range(10):
        rates.observe(4, 1.0, 0.05)
    assert rates.rate(4, plain) == pytest.approx(20.0)


def test_a_draft_position_is_paid_for_by_the_whole_batch():
    """Every row rides the widest row's pass: one sure row among three unsure ones does not widen the pass for
    all four, while a position the batch pays for is used by every row still drafting. At batch 1 the rule
    is the row's own."""
    sure, unsure = 0.995, 0.05  # a(conf) from the prior: ~0.997 and ~0.22
    stop = ConfidenceStop(Calibration(), [0.5, 0.5])
    assert stop(0, torch.tensor([sure, unsure, unsure, unsure])).tolist() == [False] * 4
    stop = ConfidenceStop(Calibration(), [0.5, 0.5])
    assert stop(0, torch.tensor([sure, sure, unsure, unsure])).tolist() == [True] * 4
    assert stop(1, torch.tensor([unsure, unsure, unsure, unsure])).tolist() == [False] * 4
    for confidence, expected in ((sure, True), (unsure, False)):
        assert ConfidenceStop(Calibration(), [0.5])(0, torch.tensor([confidence])).tolist() == [expected]
