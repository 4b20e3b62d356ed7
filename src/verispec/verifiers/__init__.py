"""Acceptance rules, one per file. `verifier_for` picks the lossless rule for the sampling settings."""

from verispec.sampling import SamplingParams
from verispec.verifiers.base import Verifier
from verispec.verifiers.block import BlockVerifier
from verispec.verifiers.coupled import CoupledVerifier
from verispec.verifiers.greedy import GreedyVerifier
from verispec.verifiers.speculative_sampling import SpeculativeSamplingVerifier


def verifier_for(sampling: list[SamplingParams]) -> Verifier:
    """All-greedy rows verify by argmax equality; rows that asked for coupling by the coupled rule;
    otherwise speculative sampling, by blocks unless a row asked for the token-by-token rule (both are
    greedy on greedy rows)."""
    if all(s.greedy for s in sampling):
        return GreedyVerifier()
    if any(s.coupled for s in sampling):
        return CoupledVerifier()
    if all(s.blockwise or s.greedy for s in sampling):
        return BlockVerifier()
    return SpeculativeSamplingVerifier()


__all__ = ["Verifier", "GreedyVerifier", "SpeculativeSamplingVerifier", "BlockVerifier", "CoupledVerifier", "verifier_for"]
