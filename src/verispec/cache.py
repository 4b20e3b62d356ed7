"""Which cache slots each sequence of a batch can see, and rollback of rejected slots.

A batch shares one slot axis: every forward pass appends T slots to every row. A row that
accepted fewer draft tokens than its batch mates leaves *holes*: slots that stay in memory but are
masked out of attention for ever. A token's position id is the number of visible slots before it,
so holes never shift positions and a row decodes exactly as it would alone.

`SlotCache` keeps only this bookkeeping; the tensors live in the model backend's own store
(`backend_trim` is called with the new shared length). It knows nothing about models or drafts.
"""

from __future__ import annotations

from typing import Callable

import torch


class SlotCache:
    """Visibility mask [batch, capacity] over a shared slot axis of length `length`."""

    def __init__(
        self,
        batch_size: int,
        device: torch.device | str = "cpu",
        backend_trim: Callable[[int], None] | None = None,
        backend_select: Callable[[torch.Tensor], None] | None = None,
    ):
        self.length = 0
        self._visible = torch.zeros(batch_size, 64, dtype=torch.bool, device=device)
        self._backend_trim = backend_trim
        self._backend_select = backend_select

    @property
    def batch_size(self) -> int:
        return self._visible.shape[0]

    @property
    def visible(self) -> torch.Tensor:
        """[batch, length] bool: which slots each row attends to."""
        return self._visible[:, : self.length]

    def num_tokens(self) -> torch.Tensor:
        """[batch] long: tokens each row holds; also the position id of its next token."""
        return self.visible.sum(1)

    def extend(self, visible_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append T slots. visible_new: [batch, T] bool (False for left padding).

        Returns (attention_mask [batch, length + T] long, position_ids [batch, T] long) for the forward pass.
        """
        batch, width = visible_new.shape
        start = self.num_tokens()
        needed = self.length + width
        if needed > self._visible.shape[1]:
            grown = torch.zeros(batch, max(needed, 2 * self._visible.shape[1]), dtype=torch.bool, device=self._visible.device)
            grown[:, : self.length] = self.visible
            self._visible = grown
        self._visible[:, self.length : needed] = visible_new
        self.length = needed
        position_ids = start[:, None] + visible_new.long().cumsum(1) - 1
        return self.visible.long(), position_ids.clamp(min=0)

    def truncate(self, ends: torch.Tensor) -> None:
        """Roll back: row b forgets every slot at index >= ends[b]. ends: [batch] long.

        The shared axis shrinks to max(ends); shorter rows keep holes up to there.
        """
        ends = ends.to(self._visible.device)
        slot = torch.arange(self.length, device=self._visible.device)
        self._visible[:, : self.length] &= slot[None, :] < ends[:, None]
        new_length = int(ends.max()) if ends.numel() else 0
        if new_length < self.length:
            self._visible[:, new_length : self.length] = False
            self.length = new_length
            if self._backend_trim is not None:
                self._backend_trim(new_length)

    def select(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (the others left the batch)."""
        index = torch.tensor(rows, dtype=torch.long, device=self._visible.device)
        self._visible = self._visible[index]
        if self._backend_select is not None:
            self._backend_select(index)
