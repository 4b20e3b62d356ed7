"""Suffix decoding (Oliaro et al. 2024, SuffixDecoding; Arctic Inference): drafts from every text seen.

A drafter with no model. It looks up the longest suffix of the current text in two corpora: the
request's own prompt and output so far, and the outputs of earlier requests (a `SuffixIndex` shared
by every drafter of a process or server, bounded in tokens, oldest sequences evicted first, one
partition per tenant). Among the places where that suffix occurred, it follows the most frequent
continuation token by token (frequency = how many of those places continue that way), as the paper
walks its suffix tree from the matched node. Like the paper, a draft goes at most
`max_spec_factor * match_length` tokens (a long match predicts further), and stops where the path's
empirical probability count(path) / count(matched) falls below `min_token_prob`.

Each token carries its frequency as the draft's confidence, count(token) / (count(parent) + 1): a
continuation seen once says 0.5, one seen 99 times out of 99 says 0.99. The adaptive policy learns
how that predicts acceptance and stops each row where another token stops paying, as for a draft
model. Where the step asks for alternates (token trees), the second most frequent continuation at a
chain position is that position's alternate.

Why an n-gram hash index rather than a pointer-linked suffix tree: in Python a tree node costs
hundreds of bytes and a tree over N tokens to depth D has up to N * D of them. Here each token adds
one small posting (an int) under the hash of each n-gram that ends before it, for a few n up to
`NGRAM_SIZES[-1]`; the exact match length is then measured by comparing tokens backwards from each
posting (which also discards any hash collision), so matches longer than the largest n are found
as a suffix tree would find them. Postings are appended in sequence order, so evicting the oldest
sequence removes a prefix of each list it touched. What a tree would store as node counts is counted
at lookup time over the most recent `max_occurrences` places.

The draft is deterministic given the text so far and the index (no q): the verifiers treat it as a
point mass, so output is exact under greedy decoding and under every lossless sampling rule.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import Counter, deque
from typing import TYPE_CHECKING, Hashable

import torch

from verispec.drafters.base import BranchRule, Draft, Drafter, StopRule, Verdict
from verispec.errors import VerispecError
from verispec.sampling import SamplingParams

if TYPE_CHECKING:
    from verispec.drafters.datastore import Datastore
    from verispec.grammar import Constraint

NGRAM_SIZES = (1, 2, 3, 4, 6, 8)  # n-grams indexed per token: a lookup tries the largest first
_STRIDE = 1 << 32  # a posting is sequence_id * _STRIDE + the index just past the n-gram
MAX_MATCH = 32  # match lengths are measured up to this many tokens (as a suffix tree's bounded depth)
# A request's own match (or earlier outputs') shorter than this asks the datastore, if any, for a longer one.
DATASTORE_BELOW = 4


class _Corpus:
    """Token sequences and, for each n-gram that is followed by a token, the places it occurred."""

    def __init__(self):
        self.sequences: dict[int, list[int]] = {}
        self.postings: dict[int, list[int]] = {}  # hash of an n-gram -> postings, in the order added
        self.indexed: dict[int, int] = {}  # sequence id -> how far its n-grams are indexed
        self.num_tokens = 0

    def extend(self, seq_id: int, tokens: list[int]) -> None:
        """Append tokens to sequence `seq_id` (new or growing) and index the n-grams they complete."""
        sequence = self.sequences.setdefault(seq_id, [])
        sequence.extend(tokens)
        self.num_tokens += len(tokens)
        base = seq_id * _STRIDE
        upto = self.indexed.get(seq_id, 1)
        for end in range(upto, len(sequence)):  # an n-gram ending at `end` is followed by sequence[end]
            for n in NGRAM_SIZES:
                if n > end:
                    break
                self.postings.setdefault(hash(tuple(sequence[end - n : end])), []).append(base + end)
        self.indexed[seq_id] = max(upto, len(sequence))

    def remove(self, seq_id: int) -> None:
        """Forget a sequence that is the oldest of this corpus (its postings lead every list it is in)."""
        sequence = self.sequences.pop(seq_id)
        self.indexed.pop(seq_id, None)
        self.num_tokens -= len(sequence)
        bound = (seq_id + 1) * _STRIDE
        for end in range(1, len(sequence)):
            for n in NGRAM_SIZES:
                if n > end:
                    break
                key = hash(tuple(sequence[end - n : end]))
                postings = self.postings.get(key)
                if postings is None:
                    continue  # the key was cleared at an earlier repeat of this n-gram
                cut = bisect.bisect_left(postings, bound)
                if cut == len(postings):
                    del self.postings[key]
                elif cut:
                    del postings[:cut]

    def find(self, context: list[int], max_occurrences: int, exclude_end: int | None = None) -> list[tuple[list[int], int, int]]:
        """Up to `max_occurrences` places where the longest indexed suffix of `context` occurred, most
        recent first: (the sequence, the index just past the match, the match length measured backwards)."""
        for n in reversed(NGRAM_SIZES):
            if n > len(context):
                continue
            postings = self.postings.get(hash(tuple(context[-n:])))
            if not postings:
                continue
            found = []
            for posting in reversed(postings[-max_occurrences:]):
                sequence = self.sequences[posting // _STRIDE]
                end = posting % _STRIDE
                length = _match_length(sequence, end, context)
                if length >= n:  # shorter only on a hash collision
                    found.append((sequence, end, length))
            if found:
                return found
        return []


def _match_length(sequence: list[int], end: int, context: list[int]) -> int:
    """How many tokens before sequence[end] equal the last ones of context (at most MAX_MATCH)."""
    length, limit = 0, min(end, len(context), MAX_MATCH)
    while length < limit and sequence[end - 1 - length] == context[-1 - length]:
        length += 1
    return length


class SuffixIndex:
    """Earlier requests' outputs, for `SuffixDrafter`s to draft from: one corpus per tenant, so a tenant's
    outputs only ever draft for that tenant (a privacy boundary: a server keys tenants by API key and
    `user`). All corpora share one budget of `max_tokens` (the oldest sequences, of any tenant, are evicted
    first), and each tenant has its own of `max_tokens_per_tenant` (its own oldest go first), so one busy
    tenant cannot evict everyone else's history. Thread-safe: a server's worker adds finished requests while
    other drafters read."""

    def __init__(self, max_tokens: int = 1 << 18, max_sequences: int = 10_000, max_tokens_per_tenant: int | None = None):
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise VerispecError(f"a suffix index needs max_tokens >= 1, got {max_tokens!r}")
        if max_tokens_per_tenant is not None and (not isinstance(max_tokens_per_tenant, int) or max_tokens_per_tenant < 2):
            raise VerispecError(f"a suffix index needs max_tokens_per_tenant >= 2 (or None), got {max_tokens_per_tenant!r}")
        self.max_tokens = max_tokens
        self.max_tokens_per_tenant = min(max_tokens, max_tokens_per_tenant or max_tokens)
        self.max_sequences = max_sequences  # as Arctic's max_cached_requests
        self.corpora: dict[Hashable, _Corpus] = {}
        # (tenant, sequence id), oldest first; entries a tenant's own budget evicted earlier are skipped
        self.order: deque[tuple[Hashable, int]] = deque()
        self.num_tokens = 0
        self.num_sequences = 0
        self._next_id = 0
        self._lock = threading.Lock()

    def add(self, tokens: list[int], tenant: Hashable = None) -> None:
        """Remember a finished sequence (an output, with the prompt tokens that lead into it) for `tenant`."""
        tokens = list(tokens[-self.max_tokens_per_tenant :])
        if len(tokens) < 2:
            return
        with self._lock:
            corpus = self.corpora.setdefault(tenant, _Corpus())
            corpus.extend(self._next_id, tokens)
            self.order.append((tenant, self._next_id))
            self._next_id += 1
            self.num_tokens += len(tokens)
            self.num_sequences += 1
            while corpus.num_tokens > self.max_tokens_per_tenant:
                self._evict(tenant, next(iter(corpus.sequences)))  # ids grow: the first is the tenant's oldest
            while self.num_tokens > self.max_tokens or self.num_sequences > self.max_sequences:
                self._evict(*self.order.popleft())

    def limit_tenants(self, max_tokens_per_tenant: int) -> None:
        """Hold at most this many tokens per tenant from now on (a server's bound on each tenant's history)."""
        if not isinstance(max_tokens_per_tenant, int) or max_tokens_per_tenant < 2:
            raise VerispecError(f"a suffix index needs max_tokens_per_tenant >= 2, got {max_tokens_per_tenant!r}")
        with self._lock:
            self.max_tokens_per_tenant = min(self.max_tokens, max_tokens_per_tenant)
            for tenant, corpus in list(self.corpora.items()):
                while tenant in self.corpora and corpus.num_tokens > self.max_tokens_per_tenant:
                    self._evict(tenant, next(iter(corpus.sequences)))

    def tenant_tokens(self, tenant: Hashable) -> int:
        """Tokens held for `tenant`."""
        with self._lock:
            corpus = self.corpora.get(tenant)
            return 0 if corpus is None else corpus.num_tokens

    def _evict(self, tenant: Hashable, seq_id: int) -> None:
        """Forget a sequence, the oldest of its tenant's corpus (a stale entry of `order`: already gone)."""
        corpus = self.corpora.get(tenant)
        if corpus is None or seq_id not in corpus.sequences:
            return
        self.num_tokens -= len(corpus.sequences[seq_id])
        self.num_sequences -= 1
        corpus.remove(seq_id)
        if not corpus.sequences:
            del self.corpora[tenant]

    def clear(self) -> None:
        """Forget every earlier output (a benchmark that repeats a prompt must not draft its answer from the last run)."""
        with self._lock:
            self.corpora.clear()
            self.order.clear()
            self.num_tokens = self.num_sequences = 0

    def find(self, context: list[int], tenant: Hashable, max_occurrences: int) -> list[tuple[list[int], int, int]]:
        with self._lock:
            corpus = self.corpora.get(tenant)
            return corpus.find(context, max_occurrences) if corpus is not None else []

    @property
    def num_postings(self) -> int:
        return sum(len(p) for c in self.corpora.values() for p in c.postings.values())


def _within(constraint: "Constraint", chain: list[int], probs: list[float], alternates: list[int],
            alternate_probs: list[float]) -> tuple[list[int], list[float], list[int], list[float]]:
    """A row's walk cut to its grammar: the chain up to its first forbidden token, and an alternate at
    position i kept only where the grammar allows it after chain[:i]."""
    keep = constraint.valid_prefix(chain)
    alternates = [a if a < 0 or constraint.valid_prefix(chain[:i] + [a]) == i + 1 else -1
                  for i, a in enumerate(alternates[:keep])]
    return chain[:keep], probs[:keep], alternates, [p if a >= 0 else 0.0 for p, a in zip(alternate_probs[:keep], alternates)]


class SuffixDrafter(Drafter):
    reads_tenants = True
    reads_grammars = True  # a row's chain ends, and its alternates go, where its grammar forbids the token
    """Drafts the most frequent continuation of the longest matching suffix (see the module docstring).

    index: earlier requests' outputs (None: this drafter's own, not shared). datastore: a static corpus (REST,
    `drafters.datastore`) that drafts where the row's own text and the index match fewer than DATASTORE_BELOW
    tokens and it matches further. tenant: the partition of
    the index a row reads and adds to, unless `add` names each row's own (`reads_tenants`: a server's rows
    of several tenants share one batch, and each row drafts from its tenant's outputs only). vocab_size: the target's, for the one-hot distribution
    a sampled row's alternate carries. Finished rows' outputs are added to the index when they leave
    the batch (`select`), with the last `lead_in` prompt tokens, so a later identical request can
    draft its first tokens from them.
    """

    def __init__(self, index: SuffixIndex | None = None, vocab_size: int | None = None, tenant: Hashable = None,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1, max_occurrences: int = 64,
                 lead_in: int = NGRAM_SIZES[-1], datastore: "Datastore | None" = None):
        if max_spec_factor <= 0 or not 0.0 <= min_token_prob < 1.0:
            raise VerispecError(f"suffix drafting needs max_spec_factor > 0 and min_token_prob in [0, 1), got "
                                f"{max_spec_factor!r}, {min_token_prob!r}")
        self.index = index if index is not None else SuffixIndex()
        self.vocab_size = vocab_size
        self.tenant = tenant
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.max_occurrences = max_occurrences
        self.lead_in = lead_in
        self.datastore = datastore  # a static corpus (REST) for where the request and earlier outputs match little
        self.rows: list[_Corpus] = []  # per row: its own prompt and output so far
        self.prompt_lengths: list[int] = []
        self.sequences: list[list[int]] = []  # per row: the sequence last seen (the engine's own list)
        self.tenants: list[Hashable] = []  # per row: its partition of the index

    def add(self, prompts: list[list[int]], tenants: list[Hashable] | None = None) -> None:
        for b, prompt in enumerate(prompts):
            self.tenants.append(self.tenant if tenants is None else tenants[b])
            self.rows.append(_Corpus())
            self.prompt_lengths.append(len(prompt))
            self.sequences.append(list(prompt))

    def propose(self, sequences: list[list[int]], draft_len: int, sampling: list[SamplingParams], generators: list[torch.Generator],
                stop: StopRule | None = None, branch: BranchRule | None = None,
                constraints: "list[Constraint | None] | None" = None) -> Draft:
        for row, (own, sequence) in enumerate(zip(self.rows, sequences)):
            self.sequences[row] = sequence  # a reference: the row's final text is read when it leaves
            own.extend(0, sequence[len(own.sequences.get(0, ())) :])
        return self.lookahead(sequences, draft_len, sampling, stop, branch, constraints)

    def lookahead(self, contexts: list[list[int]], draft_len: int, sampling: list[SamplingParams],
                  stop: StopRule | None = None, branch: BranchRule | None = None,
                  constraints: "list[Constraint | None] | None" = None) -> Draft:
        """The draft that would follow each row's context without learning from it: a context may end in
        speculative tokens (another drafter's, `StagedDrafter`), which must not enter the row's corpus, as
        it holds accepted text only. `propose` is this after taking in the rows' sequences. constraints: per
        row, its grammar at the end of its context (None: none): the chain ends before the first token it
        forbids, and an alternate it forbids is dropped."""
        batch = len(contexts)
        tokens = torch.zeros(batch, draft_len, dtype=torch.long)
        confidence = torch.zeros(batch, draft_len)
        second = torch.full((batch, draft_len), -1, dtype=torch.long)
        second_confidence = torch.zeros(batch, draft_len)
        limits = torch.zeros(batch, dtype=torch.long)
        for row, (own, sequence) in enumerate(zip(self.rows, contexts)):
            if draft_len == 0:
                continue
            chain, probs, alternates, alternate_probs = self._walk(own, sequence, draft_len, self.tenants[row])
            constraint = constraints[row] if constraints else None
            if constraint is not None:
                chain, probs, alternates, alternate_probs = _within(constraint, chain, probs, alternates, alternate_probs)
            limits[row] = len(chain)
            tokens[row, : len(chain)] = torch.tensor(chain, dtype=torch.long)
            confidence[row, : len(chain)] = torch.tensor(probs)
            second[row, : len(chain)] = torch.tensor(alternates, dtype=torch.long)
            second_confidence[row, : len(chain)] = torch.tensor(alternate_probs)
        # The policy's stop rule sees every position in order; a row goes on while it has tokens and the rule agrees.
        num_drafted = torch.zeros(batch, dtype=torch.long)
        going = limits > 0
        for i in range(int(limits.max()) if batch and draft_len else 0):
            going &= limits > i
            if stop is not None:
                going &= stop(i, confidence[:, i])
            if not going.any():
                break
            num_drafted += going.long()
        alternates = alternate_probs = None
        if branch is not None and bool((num_drafted > 0).any()):
            drafted = torch.arange(draft_len)[None, :] < num_drafted[:, None]
            wanted = drafted & (second >= 0) & branch(second_confidence, num_drafted)
            alternates = torch.where(wanted, second, -1)
            if not all(s.greedy for s in sampling):  # a deterministic alternate: q' one-hot on it (`verifiers.tree`)
                if self.vocab_size is None:
                    raise ValueError("sampled alternates need the drafter's vocab_size")
                alternate_probs = torch.nn.functional.one_hot(alternates.clamp(min=0), self.vocab_size).float()
                alternate_probs *= (alternates >= 0)[..., None]
        return Draft(tokens=tokens, num_drafted=num_drafted, probs=None, confidence=confidence,
                     alternates=alternates, alternate_confidence=second_confidence if alternates is not None else None,
                     alternate_probs=alternate_probs)

    def _walk(self, own: _Corpus, sequence: list[int], draft_len: int,
              tenant: Hashable) -> tuple[list[int], list[float], list[int], list[float]]:
        """The draft for one row: (chain tokens, their confidence, the second choice at each, -1 if none, its confidence)."""
        found = own.find(sequence, self.max_occurrences) + self.index.find(sequence, tenant, self.max_occurrences)
        # The deepest match, as the paper's walk to the matched node: places matching at least that far count.
        match = max((length for _, _, length in found), default=0)
        if self.datastore is not None and match < DATASTORE_BELOW:  # a longer match in the datastore drafts instead
            chain, probs, _ = self.datastore.walk(sequence, draft_len, min_match=match + 1,
                                                  min_token_prob=self.min_token_prob, max_spec_factor=self.max_spec_factor)
            if chain:
                return chain, probs, [-1] * len(chain), [0.0] * len(chain)
        if not found:
            return [], [], [], []
        places = [(seq, end) for seq, end, length in found if length >= match]
        depth = min(draft_len, math.ceil(self.max_spec_factor * match))
        chain, probs, alternates, alternate_probs = [], [], [], []
        total = len(places)
        for i in range(depth):
            counts = Counter(seq[end + i] for seq, end in places if end + i < len(seq))
            if not counts:
                break
            (token, count), *rest = counts.most_common(2)  # ties: the most recent place first (Counter keeps order)
            if count / total < self.min_token_prob:  # the path's empirical probability, count(path) / count(match)
                break
            chain.append(token)
            probs.append(count / (len(places) + 1))
            alternates.append(rest[0][0] if rest else -1)
            alternate_probs.append(rest[0][1] / (len(places) + 1) if rest else 0.0)
            places = [(seq, end) for seq, end in places if end + i < len(seq) and seq[end + i] == token]
        return chain, probs, alternates, alternate_probs

    def commit(self, verdict: Verdict) -> None:
        pass  # both corpora hold accepted text only: a row's is refreshed from its sequence at propose

    def select(self, rows: list[int]) -> None:
        """Rows not kept have finished (or were cancelled): their outputs join the shared index."""
        kept = set(rows)
        for row in range(len(self.rows)):
            if row not in kept:
                start = max(0, self.prompt_lengths[row] - self.lead_in)
                if len(self.sequences[row]) > self.prompt_lengths[row]:
                    self.index.add(self.sequences[row][start:], self.tenants[row])
        self.rows = [self.rows[r] for r in rows]
        self.tenants = [self.tenants[r] for r in rows]
        self.prompt_lengths = [self.prompt_lengths[r] for r in rows]
        self.sequences = [self.sequences[r] for r in rows]
