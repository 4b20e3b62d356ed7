"""A DeepSeek-V3-style MTP module as the drafter (`heads.mtp`): the target's final hidden state beside the
next token, one decoder block, a chain.

The engine hands the drafter the target's final hidden state (after its final norm: tap index = the
target's layer count, `target_taps`) of every token its cache keeps, from the prompt's prefill and each
verify pass, with no extra target pass. The chain is the EAGLE-3 drafter's, over the module instead of
EAGLE-3's layer (both are `heads.eagle3.ChainedHead`s):
1. catches up: one module pass over the new positions (h_t beside x_{t+1}) into the module's own
   key/value cache; its output at the last position predicts the first draft token;
2. drafts: each further token feeds the module its own output state beside the token it chose, one
   position to the right (as training-time test trained it); where the step asks for token-tree
   alternates, a position's alternate is the module's second choice (a sampled row's: a draw from q
   without the chain's token), through the shared `VocabDraft`;
3. forgets the drafted positions in its cache: the next round rebuilds the accepted ones from the target's.

On a CPU with verispec's kernels the module drafts with int8 matrices by default, its bound output rows
included (a copy, `rounded_copy`; the caller's module keeps its float32 weights). Greedy rows propose the
argmax over the draft vocabulary; sampled rows draw from q and report it, so the output is the target's
either way.
"""

from __future__ import annotations

from verispec.drafters.eagle3 import Eagle3Drafter
from verispec.heads.mtp import MTPHead, check_target


class MTPDrafter(Eagle3Drafter):
    """Drafts with a trained MTP module; `target_taps` (the target's final normed state) makes the engine hand
    it the target's hidden states."""

    def __init__(self, head: MTPHead, target, min_confidence: float = 0.0, weights: str | None = "auto"):
        """weights: the module's matrices while drafting: "q4_0", "q8_0", "int8", "int4", "bfloat16", None (as
        given) or "auto" (q4_0 on a CPU with the kernels, else as given), as for `Eagle3Drafter`."""
        check_target(head, target)
        super().__init__(head, target, min_confidence=min_confidence, weights=weights)
