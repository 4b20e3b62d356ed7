"""Self-speculation on one cache: the target's own cheaper copy drafts against the target's keys and values.

A lower-precision copy of the target (`NativeCausalLM.lower_precision_copy`: its matrices in int4, say)
has the target's layer shapes, so it can attend to the target's cache instead of keeping one of its
own. That removes what a separate draft model pays besides its steps: no prompt prefill (the target's
prefill already holds the prompt), no catch-up after a step (the verify pass has just written the
accepted tokens), and no second cache. It also drafts from the target's exact history rather than its
own approximation of it, which it agrees with more often.

It drafts like `ModelDrafter` (the same token choice, confidence, stop rule and alternates), appending
its tokens to the target's cache, and rolls the cache back to where it found it before handing the
draft over. The target's verify pass then writes those slots again, each layer's keys and values
before that layer reads them, so the target never sees a number the draft computed: its logits, and
the output, are exactly those of plain decoding.
"""

from __future__ import annotations

import torch

from verispec.drafters.base import BranchRule, Draft, StopRule, Verdict, empty_draft
from verispec.drafters.model import ModelDrafter
from verispec.models.base import CausalLM, ModelCache
from verispec.sampling import SamplingParams


class SharedCacheDrafter(ModelDrafter):
    prefill_model = None  # no prompt prefill of its own: nothing for the engine to price at the start
    shares_cache = True

    def __init__(self, model: CausalLM, target: CausalLM, min_confidence: float = 0.0):
        if not target.same_layer_shapes(model):
            raise ValueError(f"{model.name!r} cannot draft on the cache of {target.name!r}: "
                             "it needs a native-backend copy of the target (the same layers, heads and head size)")
        super().__init__(model, target.vocab_size, min_confidence)
        # Rows a draft pass may carry on the model's exact small-pass kernels; a bigger pass would
        # widen every matrix to float32 for one draft token.
        self.max_rows = model.max_exact_rows

    def share_cache(self, cache: ModelCache) -> None:
        """The engine's target cache, which this drafter reads and, while drafting, extends."""
        self.cache = cache

    def add(self, prompts: list[list[int]]) -> None:
        """Nothing to prefill: the target's prefill of the prompts is in the shared cache."""
        self.prompt_lens += [len(p) for p in prompts]

    @torch.inference_mode()
    def propose(self, sequences: list[list[int]], draft_len: int, sampling: list[SamplingParams], generators: list[torch.Generator],
                stop: StopRule | None = None, branch: BranchRule | None = None, constraints=None) -> Draft:
        batch = len(sequences)
        if self.cache is None or draft_len == 0 or (self.max_rows is not None and batch > self.max_rows):
            return empty_draft(batch)
        start = self.cache.slots.length
        try:
            # The cache holds every token but each row's last, so the draft's first pass is that token.
            return super().propose(sequences, draft_len, sampling, generators, stop, branch, constraints)
        finally:
            self.cache.truncate(torch.full((batch,), start, dtype=torch.long))
            self._round = None

    def commit(self, verdict: Verdict) -> None:
        """Nothing to roll back: `propose` left the cache as it found it, and the engine rolls back the rest."""

    def select(self, rows: list[int]) -> None:
        """The engine selects the rows of the shared cache; the rows' prompt lengths follow."""
        self.prompt_lens = [self.prompt_lens[b] for b in rows]
