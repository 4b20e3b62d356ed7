"""A head's draft vocabulary: the subset of the target's vocabulary its output layer scores.

Draft id i is target id i + d2t[i]; t2d[v] says whether target id v has a draft id (EAGLE-3's buffers,
whose names and meaning SpecForge and vLLM share). A smaller output layer costs less to train and to draft
with, and a head never proposes a token outside it. The module knows nothing about what the head computes.
"""

from __future__ import annotations

import torch


class DraftVocab:
    """Mixin for an nn.Module head with `d2t` [V] long and `t2d` [vocab] bool buffers and a
    `config.draft_vocab_size`."""

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Draft id i scores target token token_ids[i] (sorted, distinct): fills d2t (offsets) and t2d."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).sort().values
        if len(token_ids) != self.config.draft_vocab_size or len(token_ids.unique()) != len(token_ids):
            raise ValueError(f"need {self.config.draft_vocab_size} distinct token ids, got {len(token_ids)}")
        self.d2t.copy_(token_ids - torch.arange(len(token_ids)))
        self.t2d.zero_()
        self.t2d[token_ids] = True

    @property
    def draft_token_ids(self) -> torch.Tensor:
        """[V] long: the target id of each draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t
