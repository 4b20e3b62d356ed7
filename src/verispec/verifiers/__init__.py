"""Acceptance rules, one per file. `verifier_for` picks the lossless rule for the sampling settings."""

from verispec.sampling import SamplingParams
from verispec.verifiers.base import Verifier
from verispec.verifiers.greedy import GreedyVerifier
from verispec.verifiers.speculative_sampling import SpeculativeSamplingVerifier


def verifier_for(sampling: SamplingParams) -> Verifier:
    """Greedy settings verify by argmax equality; anything else by speculative sampling."""
    return GreedyVerifier() if sampling.greedy else SpeculativeSamplingVerifier()


__all__ = ["Verifier", "GreedyVerifier", "SpeculativeSamplingVerifier", "verifier_for"]
