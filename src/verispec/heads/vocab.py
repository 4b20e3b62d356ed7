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


def soft_targets(top_ids: torch.Tensor, top_logprobs: torch.Tensor, head: DraftVocab) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distribution over the draft vocabulary [.., V] (its top-k log-probabilities
    [.., K], renormalized over those in the vocabulary) and a mask [..] of positions whose target argmax
    is in the draft vocabulary."""
    ids = top_ids.long()
    in_vocab = head.t2d[ids]
    draft_ids = (head.t2d.long().cumsum(0) - 1)[ids].clamp(min=0)
    logprobs = top_logprobs.float().masked_fill(~in_vocab, float("-inf"))
    weights = torch.softmax(logprobs, -1).nan_to_num(0.0)
    p = torch.zeros(*ids.shape[:-1], head.config.draft_vocab_size)
    p.scatter_add_(-1, draft_ids, weights)
    return p, in_vocab[..., 0]
