"""EAGLE-2's dynamic draft tree (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic
Draft Trees"), grown by a drafter that scores its candidates (a trained head).

Instead of a chain, the draft grows a tree: each depth expands the most promising nodes, every expanded
node offers its top-k tokens, and the grown tree is cut back to the nodes worth verifying. EAGLE-2
ranks a node by its value, the product of the draft's probabilities along its path: for a calibrated
draft, the chance that the whole path is the target's. Here each factor is the *measured* chance that
a token of that draft probability is accepted (`BranchRule.chance`), and the cut keeps nodes by
decreasing value while each pays for the row it adds to the verify pass (`BranchRule.pick`), as the
chain's own tokens are priced. On a CPU a wider pass is not free, so the budget comes from measured
costs rather than a constant.

The tree keeps the draft's chain as its spine: at each depth the token a chain would have drafted
(argmax for a greedy row, a draw from q for a sampled one, q kept so the chain rule stays exact),
judged by the step's stop rule as a chain's tokens are; a row's tree grows while its chain does. The
other nodes are a node's further candidates, tried by `verifiers.tree` in turn where the chain's token
(or an earlier candidate) is rejected, by recursive rejection:
- a greedy row's are the draft's top-k at the node (q' one-hot on each: kept exactly when it is the
  target's argmax);
- a sampled row's are drawn from the draft's q at the node without replacement, each carrying the q'
  it was drawn from (q without the tokens drawn before it there), as SpecInfer and Recursive
  Speculative Decoding do: deterministic top-k tokens would be exact too, but where q is close to p
  the residual after a rejection has little mass on q's favourites, so they would seldom be taken.
Knows nothing about heads or caches: the drafter expands the nodes it is told to and hands back their
logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.drafters.base import BranchRule, Draft, StopRule, VocabDraft
from verispec.sampling import SamplingParams, sample, warp

ROOT = -1  # a node whose parent is the last token


@dataclass
class _Node:
    token: int  # target vocabulary id
    parent: int  # index of its parent in the row's node list, or ROOT
    depth: int  # its draft position (0: the first token after the last one)
    confidence: float  # the draft's probability of it at its parent
    worth: float  # the chance its whole path is the target's (the chain's tokens and its own)
    chain: bool
    drawn_from: torch.Tensor | None = None  # [draft vocab] a sampled candidate's q' (None: deterministic)


@dataclass
class Expansion:
    """The nodes the drafter must run its next pass over (F per row, the same F for every row)."""

    tokens: torch.Tensor  # [batch, F] long: target ids (0 in padding slots)
    from_slot: torch.Tensor  # [batch, F] long: the slot of the previous expansion holding each node's parent
    # (0 for the first: the root's children all read the root's state)
    valid: torch.Tensor  # [batch, F] bool: False for padding slots (their outputs are never read)


class DynamicTree:
    """One step's tree for a batch: `grow` once per depth with the logits of the last expansion, then `draft`."""

    def __init__(self, sequences: list[list[int]], draft_len: int, vocab_size: int, draft_ids: torch.Tensor,
                 sampling: list[SamplingParams], generators: list[torch.Generator], stop: StopRule | None,
                 branch: BranchRule, top_k: int = 4, beam: int = 4):
        """top_k: candidates each expanded node offers; beam: nodes expanded per depth (the chain's and the
        beam - 1 best others)."""
        self.batch, self.draft_len = len(sequences), draft_len
        self.vocab_size, self.draft_ids = vocab_size, draft_ids
        self.all_greedy = all(s.greedy for s in sampling)
        self.sampling, self.generators = sampling, generators
        self.stop, self.branch = stop, branch
        self.top_k, self.beam = top_k, beam
        self.chain = VocabDraft(sequences, draft_len, vocab_size, draft_ids, sampling, generators, None)
        self.nodes: list[list[_Node]] = [[] for _ in sequences]
        self.frontier: list[list[int]] = [[ROOT] for _ in sequences]  # per row: the nodes of the last expansion
        self.going = torch.ones(self.batch, dtype=torch.bool)
        self.num_drafted = torch.zeros(self.batch, dtype=torch.long)

    def grow(self, depth: int, logits: torch.Tensor, known: torch.Tensor | None = None) -> Expansion | None:
        """Add the depth-`depth` nodes from the logits [batch, F, V] (over the draft vocabulary) of the last
        expansion's nodes (for depth 0: the root's, F = 1). known [batch] bool: rows that may draft at all.
        Returns the nodes to expand for the next depth, or None when the tree is grown."""
        if known is not None:
            self.going &= known
        confidence = self.chain.choose(depth, logits[:, 0])  # the chain's node always sits in slot 0
        if self.stop is not None:
            self.going &= self.stop(depth, confidence)
        chain_tokens = self.chain.tokens[:, depth].tolist()
        chance_chain = self.branch.chance(confidence, True).tolist()
        expand_tokens, expand_from = [], []
        for b in range(self.batch):
            if not self.going[b]:  # a row's tree grows while its chain does
                self.frontier[b] = []
                expand_tokens.append([]), expand_from.append([])
                continue
            nodes = self.nodes[b]
            parent_worth = [1.0 if n == ROOT else nodes[n].worth for n in self.frontier[b]]
            self.num_drafted[b] += 1
            nodes.append(_Node(chain_tokens[b], self.frontier[b][0], depth, float(confidence[b]),
                               parent_worth[0] * chance_chain[b], True))
            chain_node = len(nodes) - 1
            offered = [(slot, candidate) for slot in range(len(self.frontier[b]))  # slot 0: not the chain's own token
                       for candidate in self._candidates(b, logits[b, slot], chain_tokens[b] if slot == 0 else None)]
            chances = self.branch.chance(torch.tensor([c[1] for _, c in offered]), False).tolist() if offered else []
            candidates = []
            for (slot, (token, prob, drawn_from)), chance in zip(offered, chances):
                nodes.append(_Node(token, self.frontier[b][slot], depth, prob, parent_worth[slot] * chance, False, drawn_from))
                candidates.append((len(nodes) - 1, slot))
            best = sorted(candidates, key=lambda c: -nodes[c[0]].worth)[: self.beam - 1]
            self.frontier[b] = [chain_node] + [n for n, _ in best]
            expand_tokens.append([nodes[n].token for n in self.frontier[b]])
            expand_from.append([0] + [slot for _, slot in best])
        if depth + 1 >= self.draft_len or not bool(self.going.any()):
            return None
        width = max(len(t) for t in expand_tokens)
        tokens = torch.zeros(self.batch, width, dtype=torch.long)
        from_slot = torch.zeros(self.batch, width, dtype=torch.long)
        valid = torch.zeros(self.batch, width, dtype=torch.bool)
        for b, (row_tokens, row_from) in enumerate(zip(expand_tokens, expand_from)):
            tokens[b, : len(row_tokens)] = torch.tensor(row_tokens, dtype=torch.long)
            from_slot[b, : len(row_from)] = torch.tensor(row_from, dtype=torch.long)
            valid[b, : len(row_tokens)] = True
        return Expansion(tokens, from_slot, valid)

    def _candidates(self, row: int, logits: torch.Tensor, taken: int | None) -> list[tuple[int, float, torch.Tensor | None]]:
        """A node's candidates besides `taken` (the chain's token there, a target id), from its logits [draft
        vocab]: (target id, the draft's probability of it, the q' it was drawn from or None)."""
        if self.sampling[row].greedy:
            top = logits.softmax(-1).topk(min(self.top_k + 1, logits.shape[-1]))
            picks = [(int(self.draft_ids[i]), float(v), None) for i, v in zip(top.indices, top.values)]
            return [c for c in picks if c[0] != taken][: self.top_k]
        q = warp(logits, self.sampling[row])  # as the chain's tokens are drawn: over the draft vocabulary
        rest = q.clone()
        if taken is not None:
            rest[self.draft_ids == taken] = 0.0
        picks = []
        for _ in range(self.top_k):
            mass = float(rest.sum())
            if mass <= 0:
                break
            drawn_from = rest / mass
            index = sample(drawn_from, self.generators[row])
            picks.append((int(self.draft_ids[index]), float(q[index]), drawn_from))
            rest = rest.clone()
            rest[index] = 0.0
        return picks

    def draft(self) -> Draft:
        """The chain, with the other nodes worth their rows as alternates hanging from it (`Draft.alternate_parents`)."""
        chain = self.chain.draft(self.num_drafted)
        others = [[i for i, n in enumerate(nodes) if not n.chain and n.worth > 0] for nodes in self.nodes]
        n = max((len(o) for o in others), default=0)
        if n == 0:
            return chain
        worth = torch.zeros(self.batch, n)
        for b, row in enumerate(others):
            worth[b, : len(row)] = torch.tensor([self.nodes[b][i].worth for i in row])
        chosen = self.branch.pick(worth, 1 + int(self.num_drafted.max()))
        rows = []
        for b, row in enumerate(others):
            nodes, kept, column = self.nodes[b], [], {}  # column: node index -> its place among the row's alternates
            for j, i in enumerate(row):  # node order is depth order: a parent is decided before its children
                parent = nodes[i].parent
                if chosen[b, j] and (parent == ROOT or nodes[parent].chain or parent in column):
                    column[i] = len(kept)
                    kept.append(i)
            rows.append((kept, column))
        m = max(len(kept) for kept, _ in rows)
        if m == 0:
            return chain
        alternates = torch.full((self.batch, m), -1, dtype=torch.long)
        parents = torch.zeros(self.batch, m, dtype=torch.long)
        confidence = torch.zeros(self.batch, m)
        for b, (kept, column) in enumerate(rows):
            nodes = self.nodes[b]
            for j, i in enumerate(kept):
                node = nodes[i]
                alternates[b, j], confidence[b, j] = node.token, node.confidence
                # beside chain position d: after the chain's node at depth d - 1 (the root for d = 0)
                parents[b, j] = node.depth if node.parent == ROOT or nodes[node.parent].chain else -column[node.parent] - 1
        probs = None
        if not self.all_greedy:  # q' of each: what a sampled candidate was drawn from, one-hot on a greedy row's
            probs = torch.zeros(self.batch, m, self.vocab_size)
            for b, (kept, _) in enumerate(rows):
                for j, i in enumerate(kept):
                    node = self.nodes[b][i]
                    if node.drawn_from is None:
                        probs[b, j, node.token] = 1.0
                    else:
                        probs[b, j, self.draft_ids] = node.drawn_from
        chain.alternates, chain.alternate_confidence = alternates, confidence
        chain.alternate_probs, chain.alternate_parents = probs, parents
        return chain
