"""Acceptance rules, one per file. `verifier_for` picks the rule for the sampling settings: a lossless one
unless a row opted into a lossy one (typical acceptance, a speculative cascade)."""

from verispec.sampling import SamplingParams
from verispec.verifiers.base import Verifier
from verispec.verifiers.block import BlockVerifier
from verispec.verifiers.cascade import CascadeVerifier
from verispec.verifiers.coupled import CoupledVerifier
from verispec.verifiers.greedy import GreedyVerifier
from verispec.verifiers.speculative_sampling import SpeculativeSamplingVerifier
from verispec.verifiers.typical import TypicalVerifier


def verifier_for(sampling: list[SamplingParams]) -> Verifier:
    """All-greedy rows verify by argmax equality; rows that asked for coupling by the coupled rule;
    otherwise speculative sampling, by blocks unless a row asked for the token-by-token rule (both are
    greedy on greedy rows). Sampled rows that opted into typical acceptance (lossy) get it, and their
    batch mates the exact rule they would get without them. Rows that asked for a speculative cascade
    (lossy, greedy ones too) get it, and their batch mates the rule they would get without them."""
    if any(s.cascade is not None for s in sampling):
        others = [s for s in sampling if s.cascade is None]
        return CascadeVerifier(verifier_for(others) if others else None)
    if all(s.greedy for s in sampling):
        return GreedyVerifier()
    others = [s for s in sampling if not s.lossy]
    if len(others) < len(sampling):
        return TypicalVerifier(verifier_for(others) if others else None)
    if any(s.coupled for s in sampling):
        return CoupledVerifier()
    if all(s.blockwise or s.greedy for s in sampling):
        return BlockVerifier()
    return SpeculativeSamplingVerifier()


__all__ = ["Verifier", "GreedyVerifier", "SpeculativeSamplingVerifier", "BlockVerifier", "CoupledVerifier", "TypicalVerifier", "CascadeVerifier",
           "verifier_for"]
