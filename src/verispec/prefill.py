"""Prompt prefill for a batch of new rows: prompts of similar length share a forward pass.

One pass over prompts of 50 and 200 tokens would spend three quarters of its rows on padding, so
prompts are grouped by length, each group prefilled in one pass, and the groups' caches joined
back in the callers' order. The target and a draft model prefill the same way.
"""

from __future__ import annotations

import torch

from verispec.models.base import CausalLM, ModelCache


def left_pad(rows: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """rows of different lengths -> (tokens [batch, width] long, visible [batch, width] bool), right-aligned."""
    width = max((len(r) for r in rows), default=0)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    visible = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, r in enumerate(rows):
        if r:
            tokens[b, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            visible[b, width - len(r) :] = True
    return tokens, visible


def prefill_groups(lengths: list[int], max_padding: float = 0.25) -> list[list[int]]:
    """Indices of `lengths` grouped for prefill so that padding fills at most `max_padding` of a group's
    slots (group rows x its longest length). Longest first; a group holds lengths next to each other."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups:
            group = groups[-1]
            slots = (len(group) + 1) * lengths[group[0]]
            tokens = sum(lengths[j] for j in group) + lengths[i]
            if slots - tokens <= max_padding * slots:
                group.append(i)
                continue
        groups.append([i])
    return groups


@torch.inference_mode()
def prefill(model: CausalLM, contexts: list[list[int]], taps: tuple[int, ...] | None = None):
    """A new cache of len(contexts) rows, row b holding contexts[b] (logits are not needed: the last
    prompt token opens the first decode step).

    taps (see `CausalLM.forward`): return (cache, hidden) instead, hidden[b] [len(contexts[b]), n * H] the
    tapped hidden states of context b's tokens, for a drafter that reads them (`drafters.eagle3`)."""
    groups = prefill_groups([len(c) for c in contexts])
    cache = None
    hidden: dict[int, torch.Tensor] = {}
    for group in groups:
        part = model.new_cache(len(group))
        tokens, visible = left_pad([contexts[i] for i in group])
        if tokens.shape[1] and taps is not None:
            _, tapped = model.forward(tokens, part, visible, last_only=True, taps=taps)
            for row, i in enumerate(group):
                hidden[i] = tapped[row, visible[row].to(tapped.device)]
        elif tokens.shape[1]:
            model.forward(tokens, part, visible, last_only=True)
        if cache is None:
            cache = part
        else:
            cache.concat(part)
    if cache is None:
        cache = model.new_cache(0)
    grouped = [i for group in groups for i in group]  # context at each row of the cache
    if grouped != sorted(grouped):
        cache.select(sorted(range(len(grouped)), key=grouped.__getitem__))  # back to the callers' order
    if taps is None:
        return cache
    return cache, [hidden.get(i) if i in hidden else torch.zeros(0, 0) for i in range(len(contexts))]
