"""Acceptance rules, one per file. `verifier_for` picks the lossless rule for the sampling settings."""

from verispec.sampling import SamplingParams
from verispec.verifiers.base import Verifier
from verispec.verifiers.greedy import GreedyVerifier
from verispec.verifiers.speculative_sampling import SpeculativeSamplingVerifier


def verifier_for(sampling: list[SamplingParams]) -> Verifier:
    """All-greedy rows verify by argmax equality; otherwise speculative sampling (which is greedy on greedy rows)."""
    return GreedyVerifier() if all(s.greedy for s in sampling) else SpeculativeSamplingVerifier()


__all__ = ["Verifier", "GreedyVerifier", "SpeculativeSamplingVerifier", "verifier_for"]
