"""The contract between a drafter, the verifier and the engine.

A drafter proposes up to k tokens per sequence (`Draft`); the verifier answers with a `Verdict`;
the drafter then rolls its own state back with `commit`. A draft is a chain, optionally with
alternates: more candidates that the target checks in the same pass (a token tree), tried where the
chain's own token is rejected. In the simple form an alternate is a leaf beside a chain position (a
greedy draft's second choice; a sampled draft's draw from its q with the chain's token taken out,
carrying that distribution for the verifier). With `alternate_parents` alternates form any tree that
hangs from the chain: several siblings at a position, and alternates that follow other alternates (an
EAGLE-2 dynamic tree). The engine owns the sequences and the target's cache; each drafter owns
whatever it keeps (its cache, its n-gram index), or borrows the target's cache while it drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

import torch

from verispec.sampling import SamplingParams, coupled_choice, greedy_choice, sample, warp_rows

if TYPE_CHECKING:
    from verispec.models.base import CausalLM, ModelCache


@dataclass
class TreePass:
    """A draft with alternates as one verify pass over W = 1 + k + m columns: [last token, chain, alternates]."""

    extra: torch.Tensor  # [batch, m] long: the alternates' tokens, appended after the chain (0 in padding columns)
    mask: torch.Tensor  # [batch, W, W] bool: mask[b, t, j] when column j is t or one of its ancestors (`CausalLM.forward`'s tree)
    parent: torch.Tensor  # [batch, W] long: the column each column follows (-1 for column 0 and for padding)
    source: torch.Tensor  # [batch, W] long: which alternate (index into Draft.alternates[b]) a column holds; -1: chain, padding

    @cached_property
    def _lists(self) -> tuple[list[dict[int, list[int]]], list[list[int]], list[list[int]]]:
        """Per row: {column: its alternate columns in order}, the parent list, the token list (the verifiers walk
        rows one by one, and Python lists serve them faster than tensor indexing)."""
        parents, sources = self.parent.tolist(), self.source.tolist()
        tokens = [[0] * (len(p) - len(e)) + e for p, e in zip(parents, self.extra.tolist())]
        children = []
        for row_parents, row_sources in zip(parents, sources):
            hanging: dict[int, list[int]] = {}
            for column, (up, alternate) in enumerate(zip(row_parents, row_sources)):
                if alternate >= 0:
                    hanging.setdefault(up, []).append(column)
            children.append(hanging)
        return children, parents, tokens

    def children(self, row: int, column: int) -> list[int]:
        """The alternate columns that follow `column` in `row`, in the draft's order (its preference)."""
        return self._lists[0][row].get(column, [])

    def token(self, row: int, column: int) -> int:
        """The token an alternate column holds."""
        return self._lists[2][row][column]

    def path(self, row: int, column: int) -> list[int]:
        """The columns from column 1 down to `column` (its ancestors after the last token, then itself)."""
        parents, columns = self._lists[1][row], []
        while column > 0:
            columns.append(column)
            column = parents[column]
        return columns[::-1]


@dataclass
class Draft:
    tokens: torch.Tensor  # [batch, k] long; entries at or past num_drafted[b] are padding
    num_drafted: torch.Tensor  # [batch] long, 0..k
    probs: torch.Tensor | None = None  # [batch, k, vocab] float32: q each token was drawn from; None = deterministic draft
    # [batch, k] float32: the draft's own probability of each token it proposed (its top probability when
    # greedy); None for drafters that cannot judge their tokens. The policy learns how it predicts acceptance.
    confidence: torch.Tensor | None = None
    # [batch, m] long: more candidates verified in the same pass (-1: none), only by targets that take token trees.
    # Without alternate_parents, m = k and alternates[:, i] is a leaf beside chain position i (a sibling of tokens[:, i]).
    alternates: torch.Tensor | None = None
    alternate_confidence: torch.Tensor | None = None  # [batch, m] float32: the draft's probability of each
    # [batch, m, vocab] float32: q' each alternate was drawn from (q with the tokens tried before it at its place
    # taken out; one-hot on a deterministic candidate); None for an all-greedy draft, which needs no distributions.
    alternate_probs: torch.Tensor | None = None
    # [batch, m] long: where each alternate hangs. p >= 0: beside chain position p (after the last token for 0,
    # after chain token p - 1 otherwise; p = num_drafted hangs after the whole chain); p < 0: after alternate
    # -p - 1, which must come earlier in the row. Siblings are tried in their order here. None: the leaf form above.
    alternate_parents: torch.Tensor | None = None

    @property
    def draft_len(self) -> int:
        return self.tokens.shape[1]

    @property
    def has_alternates(self) -> bool:
        return self.alternates is not None and bool((self.alternates >= 0).any())

    def narrow(self, width: int) -> "Draft":
        """The first `width` chain positions (every row's real proposals, when width >= max(num_drafted)).
        Alternates hanging past them are dropped, with whatever hangs from them."""
        if width == self.draft_len:
            return self
        cut = lambda t: None if t is None else t[:, :width]  # noqa: E731
        if self.alternate_parents is None:
            return Draft(self.tokens[:, :width], self.num_drafted.clamp(max=width), cut(self.probs), cut(self.confidence),
                         cut(self.alternates), cut(self.alternate_confidence), cut(self.alternate_probs))
        alternates = self.alternates.clone()
        for b, j in (self.alternate_parents > width).nonzero().tolist():
            alternates[b, j] = -1
        return replace(self, tokens=self.tokens[:, :width], num_drafted=self.num_drafted.clamp(max=width),
                       probs=cut(self.probs), confidence=cut(self.confidence), alternates=_drop_orphans(alternates, self.alternate_parents))

    def rows(self, index: torch.Tensor) -> "Draft":
        """The draft of these rows only (index [n] long), in that order."""
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return Draft(self.tokens[index], self.num_drafted[index], pick(self.probs), pick(self.confidence),
                     pick(self.alternates), pick(self.alternate_confidence), pick(self.alternate_probs),
                     pick(self.alternate_parents))

    def first_alternates(self, count: int) -> "Draft":
        """Only the first `count` alternates of each row (and what they leave whole: a child always comes after
        its parent, so the kept ones hang from the chain or from kept ones)."""
        if self.alternate_parents is None:
            present = self.alternates >= 0
            keep = present & (present.long().cumsum(1) <= count)
            return replace(self, alternates=torch.where(keep, self.alternates, -1))
        cut = lambda t: None if t is None else t[:, :count]  # noqa: E731
        return replace(self, alternates=cut(self.alternates), alternate_confidence=cut(self.alternate_confidence),
                       alternate_probs=cut(self.alternate_probs), alternate_parents=cut(self.alternate_parents))

    @cached_property
    def tree(self) -> TreePass:
        """The verify pass for a draft with alternates (see `TreePass`). In the leaf form a row's alternates
        are packed left in position order; spare columns are padding leaves after the last token."""
        batch, k = self.tokens.shape
        if self.alternate_parents is None:  # leaf form: alternate i hangs beside position i
            present = self.alternates >= 0
            order = torch.argsort((~present).long(), dim=1, stable=True)  # positions holding alternates first
            m = int(present.sum(1).max())
            order = order[:, :m]
            sources = torch.where(present.gather(1, order), order, -1)
            hangs = order  # beside position i: after node i
        else:
            m = self.alternates.shape[1]
            sources = torch.where(self.alternates >= 0, torch.arange(m)[None, :], -1)
            hangs = self.alternate_parents
        width = 1 + k + m
        present = sources >= 0
        extra = torch.where(present, self.alternates.gather(1, sources.clamp(min=0)), 0)
        # the column each alternate follows: p >= 0 beside chain position p (column p), p < 0 after alternate -p - 1
        up = torch.where(hangs >= 0, hangs, 1 + k + (-hangs - 1))
        parent = torch.full((batch, width), -1, dtype=torch.long)
        parent[:, 1 : 1 + k] = torch.arange(k)
        parent[:, 1 + k :] = torch.where(present, up, -1)
        source = torch.full((batch, width), -1, dtype=torch.long)
        source[:, 1 + k :] = sources
        mask = torch.tril(torch.ones(width, width, dtype=torch.bool)).repeat(batch, 1, 1)
        mask[:, 1 + k :, :] = False
        mask[:, 1 + k :, 0] = True  # a padding column follows the last token alone
        mask[:, torch.arange(1 + k, width), torch.arange(1 + k, width)] = True
        rows = torch.arange(batch)
        for j in range(m):  # in order: an alternate's parent column is complete before it
            column = 1 + k + j
            inherited = mask[rows, up[:, j].clamp(min=0), :column]
            mask[:, column, :column] = torch.where(present[:, j, None], inherited, mask[:, column, :column])
        return TreePass(extra, mask, parent, source)


def _drop_orphans(alternates: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """alternates [batch, m] with -1 also wherever an alternate hangs from a dropped one (parents as in `Draft`)."""
    for b, j in (parents < 0).nonzero().tolist():
        if alternates[b, -int(parents[b, j]) - 1] < 0:
            alternates[b, j] = -1
    return alternates


@dataclass
class Verdict:
    num_accepted: torch.Tensor  # [batch] long: accepted draft tokens, a prefix of each row's draft
    next_tokens: torch.Tensor  # [batch] long: the target's own token after the accepted prefix
    # (recovered from the residual after a rejection, or the bonus token when every drafted token was accepted)
    # Per row, the alternates accepted after the chain's prefix, as columns of the tree pass (`Draft.tree`), in
    # order down the tree ([] where the row took none); next_tokens then follows the last of them. None: no
    # alternates were drafted.
    branch: list[list[int]] | None = None

    @property
    def alternate(self) -> torch.Tensor | None:
        """[batch] bool: rows that took an alternate (None: no alternates were drafted)."""
        return None if self.branch is None else torch.tensor([bool(path) for path in self.branch])

    def took_alternate(self, row: int) -> bool:
        return self.branch is not None and bool(self.branch[row])

    def emitted(self, draft: Draft, row: int) -> list[int]:
        """The tokens row `row` gains this step: its accepted draft prefix (and alternates), then the target's token."""
        accepted = int(self.num_accepted[row])
        tokens = draft.tokens[row, :accepted].tolist()
        if self.took_alternate(row):
            tokens += [draft.tree.token(row, column) for column in self.branch[row]]
        return tokens + [int(self.next_tokens[row])]

    def tokens_from_draft(self) -> torch.Tensor:
        """[batch] long: emitted tokens that came from the draft (the chain prefix plus alternates)."""
        if self.branch is None:
            return self.num_accepted
        return self.num_accepted + torch.tensor([len(path) for path in self.branch])

    def kept_columns(self, draft: Draft, width: int) -> torch.Tensor:
        """[batch, width] bool over the verify pass: the last token, the accepted chain, the alternates taken."""
        keep = torch.arange(width)[None, :] <= self.num_accepted[:, None]
        for b, path in enumerate(self.branch or []):
            keep[b, path] = True
        return keep


class StopRule(Protocol):
    """Decides, token by token, how far each row's draft goes (the draft length is only a ceiling)."""

    def __call__(self, position: int, confidence: torch.Tensor) -> torch.Tensor:
        """[batch] bool: rows whose draft should include its token at `position` (0-based), given the
        draft's probability for that token. Called for positions 0, 1, ... in order, once each per step."""
        ...


class BranchRule(Protocol):
    """Decides where a draft adds alternates beside its chain (see `Draft.alternates`)."""

    def __call__(self, confidence: torch.Tensor, num_drafted: torch.Tensor) -> torch.Tensor:
        """Leaves: [batch, k] bool: where to add an alternate, given the draft's probability for its candidate at
        each position [batch, k] and the chain each row drafted [batch]. Called once the chain is drafted
        (and judged position by position by the same step's stop rule)."""
        ...

    def chance(self, confidence: torch.Tensor, chain: bool) -> torch.Tensor:
        """For a drafter that grows its own tree: the chance [same shape] that a token of this draft probability
        is the target's token where its place is reached, for the chain's tokens (chain=True) or others."""
        ...

    def pick(self, worth: torch.Tensor, width: int) -> torch.Tensor:
        """For a drafter that grows its own tree: which of its candidate nodes [batch, n] to verify, given the
        tokens each is expected to add (worth: the chance its whole path is taken), in a pass already `width`
        rows wide: [batch, n] bool, by decreasing worth while each pays for the row it adds."""
        ...


class Drafter(Protocol):
    """Proposes tokens; learns the outcome. Chosen once, when the engine is built.

    Drafters subclass it, so they inherit the capability defaults below and set the ones they have.
    """

    # --- capabilities -------------------------------------------------------------------------------
    # The model `add` prefills the prompts on, if the drafter keeps one of its own: a start-up cost the
    # engine may price before choosing this drafter (see `DecodeBatch`). None: no such cost.
    prefill_model: "CausalLM | None" = None
    # Drafts on the target's own cache: the engine hands it every cache it makes (`share_cache`), and
    # `propose` must leave that cache as it found it (`SharedCacheDrafter`).
    shares_cache: bool = False

    # Reads the target's hidden states at the inputs of these layers (a trained head, `Eagle3Drafter`; index
    # = the target's layer count: its final hidden state after the final norm, `MedusaDrafter`): the
    # engine's prefill and verify passes also return them, and it hands over those of every token the
    # target's cache keeps (`observe_taps`), with no extra target pass. None: it reads none.
    target_taps: "tuple[int, ...] | None" = None
    # Of a prompt, reads the taps of at most this many last tokens (a head that reads a window of positions,
    # `Eagle3Drafter.window`): the prefill taps only those, and `observe_taps` gets only those for the prompt.
    # None: every prompt token's.
    prompt_taps: "int | None" = None

    # Reads, when drafting resumes, what it skipped while steps did not draft (a trained head: the target's
    # hidden states of the tokens decoded meanwhile, or of new rows' prompts): in the first drafting step after
    # those the engine calls `catch_up` before `propose`, and times it apart, as a cost of the steps that did not
    # draft (or of the prompt) rather than of this draft's tokens. A step after a drafting step reads only what
    # that step kept, inside `propose`: a cost of drafting, priced as one.
    catches_up: bool = False

    # Masks its draft by the rows' grammars (structured output): the engine passes `propose` each row's
    # `grammar.Constraint` (None for a row without one) as `constraints`. Acceptance only: any draft is exact.
    reads_grammars: bool = False

    # Keeps state per tenant (earlier requests' outputs, `SuffixDrafter`): the engine passes `add` each new
    # row's `Request.tenant` as `tenants`, so a row drafts only from its own tenant's history.
    reads_tenants: bool = False

    # `add` takes `readers`: the new rows' prompts (all but the last token) already read on `prefill_model`
    # (`prefill.PromptReader`s, done), e.g. a few chunks at a time between the server's steps, so a long
    # prompt's draft prefill does not stall the rows decoding meanwhile. Without them it reads the prompts itself.
    reads_prompt_readers: bool = False

    def share_cache(self, cache: "ModelCache") -> None:
        """Draft on this target cache from now on (called only when `shares_cache`)."""
        raise NotImplementedError(f"{type(self).__name__} does not draft on the target's cache")

    def observe_taps(self, hidden: "list[torch.Tensor | None]") -> None:
        """Per row, the target's tapped hidden states [n, len(target_taps) * hidden] of the n tokens its cache
        just kept, in order (None: none). Called only when `target_taps` is set."""
        raise NotImplementedError(f"{type(self).__name__} reads no hidden states of the target")

    def figures(self) -> dict:
        """What it did, in its own terms, for reports (`SpecStats.drafter_figures`); {} for most drafters."""
        return {}

    def catch_up(self, sequences: list[list[int]]) -> None:
        """Read what was skipped, for the `propose` that follows in this step (called only when `catches_up`)."""
        raise NotImplementedError(f"{type(self).__name__} has nothing to catch up on")

    def add(self, prompts: list[list[int]]) -> None:
        """New sequences join the batch, after the current rows."""
        ...

    def propose(self, sequences: list[list[int]], draft_len: int, sampling: list[SamplingParams], generators: list[torch.Generator],
                stop: StopRule | None = None, branch: BranchRule | None = None) -> Draft:
        """Up to draft_len tokens to follow each sequence (prompt plus tokens so far); sampling and
        generators are per row, so a sampled draft draws from the same warped distribution as its row.
        A drafter that scores its own tokens stops a row where `stop` says so, and adds alternates where
        `branch` says so (given only when every row's verifier takes them); others ignore both."""
        ...

    def commit(self, verdict: Verdict) -> None:
        """Forget state built on rejected draft tokens."""
        ...

    def select(self, rows: list[int]) -> None:
        """Keep only these rows of the batch (the others finished)."""
        ...


def empty_draft(batch_size: int, device: torch.device | str = "cpu") -> Draft:
    return Draft(
        tokens=torch.zeros(batch_size, 0, dtype=torch.long, device=device),
        num_drafted=torch.zeros(batch_size, dtype=torch.long, device=device),
    )


def draw_alternates(i, logits, q, tokens, greedy, generators, second_choice, alternate_confidence, alternate_probs):
    """Each row's candidate alternate at position i of a sampled batch, with the distribution q' it comes
    from: a greedy row's second choice (q' one-hot on it), a sampled row's draw from q without the chain's
    token (none where q had all its mass there)."""
    for b in range(tokens.shape[0]):
        if greedy[b]:
            top = logits[b].softmax(-1).topk(2)
            second_choice[b, i], alternate_confidence[b, i] = top.indices[1], top.values[1]
            alternate_probs[b, i, top.indices[1]] = 1.0
            continue
        rest = q[b].clone()
        rest[tokens[b, i]] = 0.0
        mass = float(rest.sum())
        if mass <= 0:
            second_choice[b, i] = tokens[b, i]  # no alternate: the chain's token was q's only one
            continue
        alternate = sample(rest, generators[b])
        second_choice[b, i], alternate_confidence[b, i] = alternate, q[b, alternate]
        alternate_probs[b, i] = rest / mass


class VocabDraft:
    """A draft built position by position from a head's logits over its draft vocabulary (`draft_ids` [V]:
    the target id of each draft id), as the trained-head drafters build one. Greedy rows take the argmax
    (and, where `branch` is given, the second choice as the position's alternate); sampled rows draw from
    q, the warped logits spread over the target vocabulary (zero outside the draft vocabulary), and keep
    q for the verifier, with alternates drawn from q without the chain's token (`draw_alternates`)."""

    def __init__(self, sequences: list[list[int]], width: int, vocab_size: int, draft_ids: torch.Tensor,
                 sampling: list[SamplingParams], generators: list[torch.Generator], branch: BranchRule | None):
        batch = len(sequences)
        self.sequences, self.vocab_size, self.draft_ids = sequences, vocab_size, draft_ids
        self.sampling, self.generators, self.branch = sampling, generators, branch
        self.greedy = torch.tensor([s.greedy for s in sampling])
        self.all_greedy = bool(self.greedy.all())
        self.tokens = torch.zeros(batch, width, dtype=torch.long)
        self.probs = None if self.all_greedy else torch.zeros(batch, width, vocab_size)
        self.confidence = torch.zeros(batch, width)
        self.second = torch.full((batch, width), -1, dtype=torch.long) if branch is not None else None
        self.second_confidence = torch.zeros(batch, width) if branch is not None else None
        self.second_probs = torch.zeros(batch, width, vocab_size) if branch is not None and not self.all_greedy else None

    def choose(self, i: int, logits: torch.Tensor) -> torch.Tensor:
        """Each row's token at position i from logits [B, V] over the draft vocabulary; returns the
        confidence [B] of those tokens (the stop rule's input)."""
        batch, draft_ids = logits.shape[0], self.draft_ids
        if self.all_greedy:
            if self.branch is None:
                chosen, self.confidence[:, i] = greedy_choice(logits)
                self.tokens[:, i] = draft_ids[chosen]
            else:  # the head's second choice is the position's alternate (none in a one-token vocabulary)
                top = logits.softmax(-1).topk(min(2, logits.shape[-1]), -1)
                self.tokens[:, i], self.confidence[:, i] = draft_ids[top.indices[:, 0]], top.values[:, 0]
                if top.indices.shape[1] > 1:
                    self.second[:, i], self.second_confidence[:, i] = draft_ids[top.indices[:, 1]], top.values[:, 1]
            return self.confidence[:, i]
        full = logits.new_full((batch, self.vocab_size), float("-inf"))
        full[:, draft_ids] = logits
        q = warp_rows(full, self.sampling)  # a greedy row's q is one-hot on its argmax
        self.probs[:, i] = q
        self.tokens[:, i] = torch.tensor([
            coupled_choice(q[b], self.sampling[b].seed, len(self.sequences[b]) + i) if self.sampling[b].coupled
            else sample(q[b], self.generators[b]) for b in range(batch)])
        self.confidence[:, i] = q.max(-1).values  # never q(drawn token): see ModelDrafter
        if self.greedy.any():
            self.confidence[self.greedy, i] = logits[self.greedy].softmax(-1).max(-1).values
        if self.branch is not None:
            draw_alternates(i, full, q, self.tokens, self.greedy, self.generators, self.second, self.second_confidence,
                            self.second_probs)
        return self.confidence[:, i]

    def draft(self, num_drafted: torch.Tensor) -> Draft:
        """The Draft of the chosen positions, rows keeping their first num_drafted [B] tokens; alternates
        where the branch rule wants them."""
        alternates = None
        if self.branch is not None:
            drafted = torch.arange(self.tokens.shape[1])[None, :] < num_drafted[:, None]
            wanted = (drafted & (self.second >= 0) & (self.second != self.tokens)
                      & self.branch(self.second_confidence, num_drafted))
            alternates = torch.where(wanted, self.second, -1)
        return Draft(tokens=self.tokens, num_drafted=num_drafted, probs=self.probs, confidence=self.confidence,
                     alternates=alternates, alternate_confidence=self.second_confidence, alternate_probs=self.second_probs)
