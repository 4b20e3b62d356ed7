"""An EAGLE-3 head as the drafter (Li et al. 2025): it reads the target's hidden states and drafts a chain.

The head needs, for each position t the target's cache holds, the target's tapped hidden states h_t and
the token after it, x_{t+1}. The engine hands it the taps of every token its cache keeps, from the
prompt's prefill and from each verify pass (`observe_taps`, no extra target pass); they wait here until
the token after them is known, which it is by the next `propose`. A round that drafts then:
1. catches up: one head pass over the new positions (target taps beside the next tokens), appended to
   the head's own key/value cache; its output at the last position predicts the first draft token.
   Rounds that draft nothing (the policy found drafting does not pay) leave the taps waiting, so a head
   that does not pay costs nothing per step, and a later catch-up reads them in one wider pass (timed
   apart by the engine, `Drafter.catches_up`: it pays for the rounds that skipped, not for this draft;
   after a drafting round, reading that round's kept tokens is part of drafting, and priced so);
2. drafts: each further token feeds the head its own output hidden state beside the token it chose,
   one position to the right (as training-time test trained it). Where the step asks for a token tree,
   it grows an EAGLE-2 dynamic tree around that chain instead (`drafters.dynamic_tree`): each depth is
   one head pass over the chain's node and the best other candidates, each attending to its own path;
3. forgets the drafted positions in its cache: they were built from its own hidden states, and the next
   round rebuilds the accepted ones from the target's.

Greedy rows propose the argmax over the draft vocabulary; sampled rows draw from q, the head's warped
distribution spread over the target vocabulary (zero outside the draft vocabulary), and report it, so
speculative sampling stays exact. The output is the target's either way: the head only proposes.
"""

from __future__ import annotations

import weakref

import torch

from verispec.cache import SlotCache
from verispec.drafters.base import BranchRule, Draft, Drafter, StopRule, Verdict, VocabDraft, empty_draft
from verispec.drafters.dynamic_tree import DynamicTree
from verispec.heads.eagle3 import ChainedHead, Eagle3Head
from verispec.models import kernels
from verispec.prefill import left_pad
from verispec.sampling import SamplingParams


# The most positions one catch-up reads (a prompt, or the tokens decoded while the head was off). The head's
# own attention helps it most over the last few dozen positions; the target's taps carry the rest of the
# context. Reading a 1000-token prompt in full cost the 1.5B's head ~0.6 s on this CPU, more than a short
# answer's whole gain.
CONTEXT_WINDOW = 64


class Eagle3Drafter(Drafter):
    """Drafts with a trained EAGLE-3 head; `target_taps` (set per head) makes the engine hand it the target's taps.
    The chain reads the head only through `ChainedHead`'s steps: `MTPDrafter` is this drafter over an MTP module."""

    def __init__(self, head: Eagle3Head, target, min_confidence: float = 0.0, weights: str | None = "auto",
                 top_k: int = 4, beam: int = 4, window: int | None = CONTEXT_WINDOW):
        """weights: how the head's matrices are stored while drafting: "q4_0", "q8_0" (ggml's blocks, multiplied
        by the q8 kernels), "int8", "int4" or "bfloat16" (a copy of the head rounded for verispec's CPU kernels),
        None (the head as given), or "auto" (q4_0 on a CPU with the kernels, else as given: about a seventh
        of float32's bytes, and the q8 kernels multiply those blocks about twice as fast as int4's or int8's
        at the one to eight rows a draft step has, for the same proposals within the noise). A head
        already rounded (`Eagle3Head.quantize`) drafts as it is. top_k, beam: the dynamic tree's shape where
        the step asks for a tree: candidates per expanded node, and nodes expanded per depth (how many of
        them are verified is priced by the step's branch rule). window: the most positions a catch-up reads
        (`CONTEXT_WINDOW`); None reads every one."""
        if window is not None and window < 1:
            raise ValueError(f"window must be at least 1 position (or None), got {window}")
        if head.config.vocab_size != target.vocab_size:
            raise ValueError(f"the head scores a {head.config.vocab_size}-token vocabulary, the target has {target.vocab_size}")
        if weights == "auto":
            weights = "q4_0" if kernels.available() and head.d2t.device.type == "cpu" else None
        if not head.bound:
            head.bind_to(target)
        if weights is not None and head.rounded is None:
            head = rounded_copy(head, weights)
        self.head = head.eval()
        self.target_taps = tuple(head.config.taps)  # the engine's verify passes return these for `observe_taps`
        self.vocab_size = target.vocab_size
        self.min_confidence = min_confidence
        self.top_k, self.beam = top_k, beam
        self.window = window
        config = head.config
        self.slots = SlotCache(0)
        self.keys = torch.zeros(0, config.num_key_value_heads, 0, config.head_dim)
        self.values = torch.zeros_like(self.keys)
        self.pending: list[list[torch.Tensor]] = []  # per row: target taps [n, len(taps) * H] not yet read
        self.skipped: list[int] = []  # per row: the target's positions the head never read (`window`)
        self._caught: tuple[torch.Tensor, torch.Tensor] | None = None  # `catch_up`'s result, for this step's `propose`

    @property
    def prompt_taps(self) -> int | None:
        """A prompt's first catch-up reads no more than its last `window` positions."""
        return self.window

    def add(self, prompts: list[list[int]]) -> None:
        """New rows: an empty head cache each; their prompt taps arrive through `observe_taps`, those of the last
        `prompt_taps` positions only (the ones before are never read: `window`)."""
        config = self.head.config
        new = SlotCache(len(prompts))
        self.slots.concat(new)
        empty = torch.zeros(len(prompts), config.num_key_value_heads, self.keys.shape[2], config.head_dim)
        self.keys, self.values = torch.cat([self.keys, empty]), torch.cat([self.values, empty.clone()])
        self.pending.extend([] for _ in prompts)
        self.skipped.extend(0 if self.window is None else max(0, len(p) - 1 - self.window) for p in prompts)

    def observe_taps(self, hidden: list[torch.Tensor | None]) -> None:
        """Per row of the batch, the target's taps [n, len(taps) * H] of the n tokens its cache just kept
        (None or empty: none)."""
        for row, taps in zip(self.pending, hidden):
            if taps is not None and taps.numel():
                row.append(taps.float().cpu())

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.keys = torch.cat([self.keys, k], 2)
        self.values = torch.cat([self.values, v], 2)

    def _layer(self, tokens: torch.Tensor, hidden: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """One head pass over new positions: tokens [B, T], hidden [B, T, H], visible [B, T] -> outputs [B, T, H]."""
        start = self.slots.length
        _, positions = self.slots.extend(visible)
        q, k, v, residual = self.head.qkv(tokens, hidden, positions)
        self._append(k, v)
        width = tokens.shape[1]
        slot = torch.arange(start + width)
        own = start + torch.arange(width)
        allowed = (self.slots.visible[:, None, :] & (slot <= own[:, None])) | (slot == own[:, None])
        return self.head.finish(residual, self.head.attend(q, self.keys, self.values, allowed))

    def _catch_up(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Read every pending tap (beside the token that follows it), or where more than `window` are pending,
        only the last `window` of them, in a cache the row starts afresh. Returns (the head's output [B, H] at
        each row's last position, [B] bool: rows that have any position at all)."""
        batch = len(sequences)
        seen = self.slots.num_tokens().tolist()
        rows_tokens, rows_taps, restart = [], [], []
        for b in range(batch):
            taps = torch.cat(self.pending[b]) if self.pending[b] else torch.zeros(0, self.head.in_features)
            start = self.skipped[b] + seen[b]  # the target position of the row's first pending tap
            if start + len(taps) != len(sequences[b]) - 1:
                raise RuntimeError(f"row {b}: the head holds {seen[b]} positions, skipped {self.skipped[b]} and has "
                                   f"{len(taps)} new taps, but the target's cache holds {len(sequences[b]) - 1}")
            if self.window is not None and len(taps) > self.window:
                # a long prompt, or a long stretch without drafting: the positions that decide the next tokens are
                # the recent ones (the target's taps already carry the whole context), so read those alone, from
                # a fresh start so the row's positions stay contiguous (RoPE sees true distances)
                skip = len(taps) - self.window
                restart.append(b)
                self.skipped[b], start, taps = start + skip, start + skip, taps[skip:]
            rows_taps.append(taps)
            rows_tokens.append(sequences[b][start + 1 : start + 1 + len(taps)])
            self.pending[b] = []
        if restart:
            ends = torch.full((batch,), self.slots.length, dtype=torch.long)
            ends[restart] = 0
            self._truncate(ends)
        tokens, visible = left_pad(rows_tokens)
        width = tokens.shape[1]
        taps = torch.zeros(batch, width, self.head.in_features)
        for b, row in enumerate(rows_taps):
            if len(row):
                taps[b, width - len(row) :] = row
        known = self.slots.num_tokens() + visible.sum(1) > 0
        if width == 0:
            return torch.zeros(batch, self.head.config.hidden_size), known
        out = self._layer(tokens, self.head.project(taps), visible)
        return out[:, -1], known

    catches_up = True

    @torch.inference_mode()
    def catch_up(self, sequences: list[list[int]]) -> None:
        self._caught = self._catch_up(sequences)

    @torch.inference_mode()
    def propose(self, sequences: list[list[int]], draft_len: int, sampling: list[SamplingParams], generators: list[torch.Generator],
                stop: StopRule | None = None, branch: BranchRule | None = None) -> Draft:
        batch = len(sequences)
        caught, self._caught = self._caught, None  # read this step's or never: what follows a skipped step is newer
        if draft_len == 0:  # the taps wait: read in one wider pass when drafting resumes, or never if it does not
            return empty_draft(batch)
        # PyTorch's ops on one thread: a few width-1 passes are too small for a second one to pay, and on a
        # machine shared with busy processes an OpenMP region waits for a thread that is not running (the
        # 1.5B's head drafted 4 tokens in ~7 ms on one thread and in 12-150 ms on two, other processes busy).
        # The kernels keep the step's threads: their pool never waits for a late thread, and the head's int4
        # products are most of a draft (4 tokens: ~6 ms on two threads against ~8 ms on one, quiet).
        with kernels.torch_on_one_thread():
            hidden, known = caught if caught is not None else self._catch_up(sequences)
            if not bool(known.any()):
                return empty_draft(batch)
            if branch is not None:
                return self._grow_tree(sequences, draft_len, sampling, generators, stop, branch, hidden, known)
            return self._chain(sequences, draft_len, sampling, generators, stop, hidden, known)

    def _chain(self, sequences, draft_len, sampling, generators, stop, hidden: torch.Tensor, known: torch.Tensor) -> Draft:
        """A chain from the head's output at each row's last position (hidden [B, H])."""
        batch = len(sequences)
        kept = self.slots.length
        built = VocabDraft(sequences, draft_len, self.vocab_size, self.head.draft_token_ids, sampling, generators, None)
        num_drafted = torch.zeros(batch, dtype=torch.long)
        going = known.clone()  # a row with no position yet (a one-token prompt) drafts nothing this round
        try:
            for i in range(draft_len):
                confidence = built.choose(i, self.head.logits(hidden))  # logits [B, V] over the draft vocabulary
                if stop is not None:
                    going &= stop(i, confidence)
                if self.min_confidence:
                    going &= confidence >= self.min_confidence
                num_drafted += going.long()
                if not going.any() or i + 1 == draft_len:
                    break
                hidden = self._layer(built.tokens[:, i : i + 1], hidden[:, None], torch.ones(batch, 1, dtype=torch.bool))[:, 0]
        finally:
            self._truncate(kept)  # drafted positions hold the head's own states: the target's replace them
        return built.draft(num_drafted)

    def _grow_tree(self, sequences, draft_len, sampling, generators, stop, branch, hidden: torch.Tensor,
                   known: torch.Tensor) -> Draft:
        """An EAGLE-2 dynamic tree from the head's output at each row's last position (hidden [B, H]). The tree's
        nodes attend to the head's cache and to their own path, kept apart from the cache (`_tree_layer`)."""
        tree = DynamicTree(sequences, draft_len, self.vocab_size, self.head.draft_token_ids, sampling, generators,
                           stop, branch, self.top_k, self.beam)
        if self.min_confidence:
            tree.stop = _with_floor(stop, self.min_confidence)
        positions = self.slots.num_tokens()  # the first draft token's position in each row
        keys, values, paths = [], [], None
        expansion = tree.grow(0, self.head.logits(hidden)[:, None], known)
        outputs = hidden[:, None]
        depth = 0
        while expansion is not None:
            parents = outputs.gather(1, expansion.from_slot[..., None].expand(-1, -1, outputs.shape[-1]))
            # each node sees the head's cache, its ancestors among the tree's earlier nodes, and itself
            width = expansion.tokens.shape[1]
            own = torch.eye(width, dtype=torch.bool).expand(len(sequences), -1, -1)
            paths = own if paths is None else torch.cat([paths.gather(1, expansion.from_slot[..., None].expand(-1, -1, paths.shape[2])), own], 2)
            outputs = self._tree_layer(expansion.tokens, parents, positions + depth, keys, values, paths)
            depth += 1
            expansion = tree.grow(depth, self.head.logits(outputs), None)
        return tree.draft()

    def _tree_layer(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, keys: list, values: list,
                    paths: torch.Tensor) -> torch.Tensor:
        """One head pass over a depth of tree nodes: tokens [B, F], their parents' outputs hidden [B, F, H], at
        positions [B]; keys, values: the tree's earlier depths (appended to here); paths [B, F, earlier + F]
        bool: which tree nodes each one sees. -> outputs [B, F, H]."""
        width = tokens.shape[1]
        q, k, v, residual = self.head.qkv(tokens, hidden, positions[:, None].expand(-1, width))
        keys.append(k)
        values.append(v)
        allowed = torch.cat([self.slots.visible[:, None, :].expand(-1, width, -1), paths], 2)
        attended = self.head.attend(q, torch.cat([self.keys, *keys], 2), torch.cat([self.values, *values], 2), allowed)
        return self.head.finish(residual, attended)

    def _truncate(self, ends: "torch.Tensor | int") -> None:
        """Row b forgets its positions from slot ends[b] on (an int: every row's)."""
        if isinstance(ends, int):
            ends = torch.full((self.slots.batch_size,), ends, dtype=torch.long)
        self.slots.truncate(ends)
        self.keys, self.values = self.keys[:, :, : self.slots.length], self.values[:, :, : self.slots.length]

    def commit(self, verdict: Verdict) -> None:
        """Nothing to roll back: `propose` kept only positions read from the target's own taps."""

    def select(self, rows: list[int]) -> None:
        index = torch.tensor(rows, dtype=torch.long)
        self.slots.select(index)
        self.keys, self.values = self.keys[index], self.values[index]
        self.pending = [self.pending[b] for b in rows]
        self.skipped = [self.skipped[b] for b in rows]


def rounded_copy(head: ChainedHead, weights: str) -> ChainedHead:
    """A copy of a chained head (EAGLE-3's, or an MTP module) with its matrices rounded to `weights`
    (its `quantize`), bound to what `head` is bound to (an MTP module's shared output layer, bound before
    rounding, is rounded too); the caller's head is left as it was. Made once per head and format (a
    drafter is built per generate call; rounding 50M weights each time would cost more than the call's
    drafting), and made again if the head's weights or bindings changed since (e.g. trained further)."""
    version = (tuple(t._version for t in head.state_dict().values()), tuple(id(t) for t in head.bound))
    cached = _ROUNDED.get(head, {}).get(weights)
    if cached is not None and cached[0] == version:
        return cached[1]
    copy = type(head)(head.config)
    copy.load_state_dict(head.state_dict())
    if head.bound:
        copy.bind(*head.bound)
    copy.quantize(weights)
    _ROUNDED.setdefault(head, {})[weights] = (version, copy)
    return copy


_ROUNDED: "weakref.WeakKeyDictionary[ChainedHead, dict]" = weakref.WeakKeyDictionary()


def _with_floor(stop: StopRule | None, floor: float) -> StopRule:
    """`stop`, also refusing tokens the draft gives less than `floor`."""
    def rule(position: int, confidence: torch.Tensor) -> torch.Tensor:
        keep = confidence >= floor
        return keep if stop is None else keep & stop(position, confidence)
    return rule
