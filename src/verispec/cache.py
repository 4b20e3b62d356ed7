"""Which cache slots each sequence of a batch can see: the bookkeeping behind rollback.

A batch shares one slot axis: every forward pass appends T slots to every row. A row that
accepted fewer draft tokens than its batch mates leaves *holes*: slots that stay in memory but are
masked out of attention for ever. A token's position id is the number of visible slots before it,
so holes never shift positions and a row decodes exactly as it would alone.

`SlotCache` keeps only this bookkeeping; the key/value tensors live in the model backend's store.
It knows nothing about models or drafts.
"""

from __future__ import annotations

import torch


class SlotCache:
    """Visibility mask [batch, capacity] over a shared slot axis of length `length`."""

    def __init__(self, batch_size: int, device: torch.device | str = "cpu"):
        self.length = 0
        self._visible = torch.zeros(batch_size, 64, dtype=torch.bool, device=device)

    @property
    def batch_size(self) -> int:
        return self._visible.shape[0]

    @property
    def device(self) -> torch.device:
        return self._visible.device

    @property
    def visible(self) -> torch.Tensor:
        """[batch, length] bool: which slots each row attends to."""
        return self._visible[:, : self.length]

    def num_tokens(self) -> torch.Tensor:
        """[batch] long: tokens each row holds; also the position id of its next token."""
        return self.visible.sum(1)

    def _reserve(self, needed: int) -> None:
        if needed > self._visible.shape[1]:
            grown = torch.zeros(self.batch_size, max(needed, 2 * self._visible.shape[1]), dtype=torch.bool, device=self.device)
            grown[:, : self.length] = self.visible
            self._visible = grown

    def extend(self, visible_new: torch.Tensor, tree: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Append T slots. visible_new: [batch, T] bool (False for left padding). tree: [batch, T, T] bool
        when the new tokens form a token tree (tree[b, t, j]: token j is t or one of its ancestors), so a
        token's position counts only its own path.

        Returns (attention_mask [batch, length + T] long, position_ids [batch, T] long) for the forward pass.
        """
        width = visible_new.shape[1]
        start = self.num_tokens()
        needed = self.length + width
        self._reserve(needed)
        self._visible[:, self.length : needed] = visible_new
        self.length = needed
        if tree is None:
            position_ids = start[:, None] + visible_new.long().cumsum(1) - 1
        else:
            position_ids = start[:, None] + (tree & visible_new[:, None, :]).long().sum(2) - 1
        return self.visible.long(), position_ids.clamp(min=0)

    def retain(self, start: int, keep: torch.Tensor) -> None:
        """Roll back a tree pass: of the slots start .. start + T - 1, row b keeps those with keep[b] [batch, T]
        bool (its accepted path); the others become holes, and the axis shrinks past the last kept slot."""
        width = keep.shape[1]
        self._visible[:, start : start + width] &= keep.to(self.device)
        used = keep.any(0).nonzero()
        new_length = start + (int(used.max()) + 1 if used.numel() else 0)
        if new_length < self.length:
            self._visible[:, new_length : self.length] = False
            self.length = new_length

    def truncate(self, ends: torch.Tensor) -> None:
        """Roll back: row b forgets every slot at index >= ends[b]. ends: [batch] long.

        The shared axis shrinks to max(ends); shorter rows keep holes up to there.
        """
        ends = ends.to(self.device)
        slot = torch.arange(self.length, device=self.device)
        self._visible[:, : self.length] &= slot[None, :] < ends[:, None]
        new_length = int(ends.max()) if ends.numel() else 0
        if new_length < self.length:
            self._visible[:, new_length : self.length] = False
            self.length = new_length

    def select(self, index: torch.Tensor) -> None:
        """Keep rows `index` [n] long, in that order."""
        self._visible = self._visible[index.to(self.device)]

    def concat(self, other: "SlotCache") -> None:
        """Append other's rows; both slot axes grow to the longer one (new slots invisible)."""
        length = max(self.length, other.length)
        self._reserve(length)
        mine = self._visible[:, : max(length, 1)]
        theirs = torch.zeros(other.batch_size, mine.shape[1], dtype=torch.bool, device=self.device)
        theirs[:, : other.length] = other.visible
        self._visible = torch.cat([mine, theirs], 0)
        self.length = length
