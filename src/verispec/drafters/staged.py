"""Staged drafting (Spector & Ré 2023, "Accelerating LLM Inference with Staged Speculative Decoding"): the
draft model is itself sped up by a cheaper drafter.

A draft model drafts k tokens one forward pass per token (`ModelDrafter`). Here it speculates too: a
stage-2 proposer with no model (suffix or n-gram lookup, `lookahead`) proposes a chain after the tokens
drafted so far, the draft model scores that chain in one pass of several rows, and keeps the prefix it
agrees with plus one token of its own, the way the engine's target treats a draft:

    pass r:  [pending, c_1 .. c_m] -> the draft model's q_0 .. q_m       (pending: its tokens not yet in its cache)
    d_j = choose(q_j): argmax (greedy row), coupled_choice (coupled row), a draw from q_j (sampled row)
    c_{j+1} is accepted while d_j == c_{j+1}; the first d_j that differs (or d_m) ends the pass

A deterministic proposal c is judged by drawing d ~ q and comparing: that accepts c with probability q(c)
and otherwise yields a draw from q with c taken out, renormalised: speculative sampling against a point
mass (Leviathan et al. 2023), exactly. So every token the draft model hands on is distributed as its own
autoregressive draw (a greedy row gets its argmax, a coupled row the very token its noise picks), and
q_j, the distribution it came from, is the draft model's own at that position, computed from exactly the
draft tokens before it: what the outer verifier needs. The outer verification is unchanged, so the
output is exactly the target's; stage 2 only changes how many draft-model passes k tokens cost.

Stage 2's depth is decided from measured costs by the engine's own adaptive policy, one level down
(`policy.AdaptiveDraftLen`): the draft model plays the target (its pass cost per row count, a plain
1-row pass included), the lookup plays the drafter (its seconds per proposal token, its confidence
calibrated against what the draft model accepts). A wide draft pass is not free on a CPU, so where the
proposals are rarely accepted the policy stops proposing, and this drafter is the draft model alone.

The draft model's cache is the inner drafter's (`ModelDrafter`: its own; `SharedCacheDrafter`: the
target's, left as found after each draft). Rows of a batch accept different prefixes; each pass appends
the same slots to every row and a row keeps what it accepted (holes elsewhere, `SlotCache`). On
`commit`, each row keeps its tail and the draft tokens the target accepted that sit in the cache.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from verispec.drafters.base import BranchRule, Draft, Drafter, StopRule, Verdict, empty_draft
from verispec.drafters.model import ModelDrafter
from verispec.grammar import Constraint, mask_logits
from verispec.models.base import CausalLM
from verispec.policy import AdaptiveDraftLen, DraftPolicy
from verispec.prefill import left_pad
from verispec.sampling import SamplingParams, coupled_choice, greedy_choice, process_logits, sample, warp
from verispec.stats import StepRecord


class Lookahead(Protocol):
    """A stage-2 proposer: a drafter with no model (`SuffixDrafter`, `NgramDrafter`) that can also draft after
    speculative tokens without learning them."""

    def add(self, prompts: list[list[int]], **kwargs) -> None: ...

    def propose(self, sequences: list[list[int]], draft_len: int, sampling: list[SamplingParams],
                generators: list[torch.Generator], stop: StopRule | None = None, branch: BranchRule | None = None) -> Draft: ...

    def lookahead(self, contexts: list[list[int]], draft_len: int, sampling: list[SamplingParams],
                  stop: StopRule | None = None) -> Draft: ...

    def figures(self) -> dict:
        """Stage 2's work: draft-model passes, the draft tokens they gave, and the proposals they accepted."""
        return {"draft_passes": self.passes, "draft_tokens": self.tokens_drafted, "proposals_accepted": self.proposals_accepted}

    def commit(self, verdict: Verdict) -> None: ...

    def select(self, rows: list[int]) -> None: ...


# Most tokens stage 2 proposes per draft-model pass (the inner policy's ceiling).
MAX_STAGE2_DEPTH = 8


class StagedDrafter(Drafter):
    reads_grammars = True

    def __init__(self, model: ModelDrafter, proposer: Lookahead, policy: DraftPolicy | None = None):
        """model: the draft model's drafter; proposer: stage 2; policy: how deep stage 2 proposes each pass
        (default: adaptive, up to MAX_STAGE2_DEPTH, from the draft model's measured pass costs and what it
        accepts; a `FixedDraftLen` always proposes that many)."""
        self.model = model  # the draft model and its cache (its own, or the target's: `shares_cache`)
        self.proposer = proposer
        self.shares_cache = model.shares_cache
        self.reads_tenants = proposer.reads_tenants
        self.reads_prompt_readers = model.reads_prompt_readers
        self.policy = policy if policy is not None else AdaptiveDraftLen(max_draft_len=MAX_STAGE2_DEPTH)
        # Draft-model passes may not exceed the rows its exact small-pass kernels take (a wider pass would
        # run the big-pass path, built for prompts, for a few draft tokens).
        self.max_rows = model.model.max_exact_rows
        self._ends: list[list[int]] | None = None  # per row: cache end after its tail, then after each draft token fed
        self._start: int | None = None  # a shared cache: its length when the draft began
        # What stage 2 did, for reports: draft-model passes, draft tokens they gave, and proposals accepted.
        self.passes = self.tokens_drafted = self.proposals_accepted = 0

    @property
    def prefill_model(self) -> CausalLM | None:
        return self.model.prefill_model

    def share_cache(self, cache) -> None:
        self.model.share_cache(cache)

    def add(self, prompts: list[list[int]], tenants=None, readers=None) -> None:
        self.model.add(prompts, **({} if readers is None else {"readers": readers}))
        self.proposer.add(prompts, **({} if tenants is None else {"tenants": tenants}))

    @torch.inference_mode()
    def propose(self, sequences: list[list[int]], draft_len: int, sampling: list[SamplingParams],
                generators: list[torch.Generator], stop: StopRule | None = None, branch: BranchRule | None = None,
                constraints: "list[Constraint | None] | None" = None) -> Draft:
        """Up to draft_len tokens per row, each chosen from the draft model's q as `ModelDrafter` chooses it
        (branch is ignored: no alternates). Returns the Draft with q (sampled rows) and confidences."""
        batch = len(sequences)
        self._ends = None
        self.proposer.propose(sequences, 0, sampling, generators)  # stage 2 takes in the accepted text
        cache = self.model.cache
        if draft_len == 0 or cache is None or (self.max_rows is not None and batch > self.max_rows):
            return empty_draft(batch)
        self._start = cache.slots.length
        try:
            return self._draft(sequences, draft_len, sampling, generators, stop, constraints)
        finally:
            if self.shares_cache:  # the target's cache, as found: the verify pass writes these slots itself
                cache.truncate(torch.full((batch,), self._start, dtype=torch.long))
                self._ends = None

    def _draft(self, sequences, draft_len, sampling, generators, stop, constraints) -> Draft:
        model, cache = self.model.model, self.model.cache
        batch = len(sequences)
        all_greedy = all(s.greedy for s in sampling)
        vocab = self.model.vocab_size
        tokens = torch.zeros(batch, draft_len, dtype=torch.long)
        probs = None if all_greedy else torch.zeros(batch, draft_len, vocab)
        confidence = torch.zeros(batch, draft_len)
        drafted = [[] for _ in range(batch)]  # per row: draft tokens so far
        seen = cache.slots.num_tokens().tolist()
        pending = [list(seq[n:]) for seq, n in zip(sequences, seen)]  # per row: tokens to feed before the proposal
        ends = [[] for _ in range(batch)]
        going = torch.ones(batch, dtype=torch.bool)  # the stop rule's verdict so far
        num_drafted = torch.zeros(batch, dtype=torch.long)
        judged = 0  # positions the stop rule has judged (for every row at once, in order)
        while True:
            live = [b for b in range(batch) if bool(going[b]) and len(drafted[b]) < draft_len]
            if not live:
                break
            # 1. Stage 2 proposes after each live row's drafted tokens, as deep as the inner policy says pays;
            # a row's last position is its own token, and a pass stays within the exact rows.
            widest = max(len(pending[b]) for b in live)
            room = (self.max_rows // batch - widest) if self.max_rows is not None else MAX_STAGE2_DEPTH
            depth = max(0, min(self.policy.choose(len(live)), room,
                               max(draft_len - 1 - len(drafted[b]) for b in live)))
            t0 = time.perf_counter()
            proposal = self.proposer.lookahead([sequences[b] + drafted[b] for b in live], depth,
                                               [sampling[b] for b in live], self.policy.stop_rule(len(live)) if depth else None)
            chains = [[] for _ in range(batch)]
            for i, b in enumerate(live):
                chains[b] = proposal.tokens[i, : min(int(proposal.num_drafted[i]), draft_len - 1 - len(drafted[b]))].tolist()
            # 2. One pass of the draft model over [pending, chain] per live row (others ride along as padding).
            rows = [pending[b] + chains[b] if b in live else [] for b in range(batch)]
            pass_tokens, visible = left_pad(rows)
            start = cache.slots.length
            t1 = time.perf_counter()
            # With no proposal anywhere this is a plain draft step: only the last column is scored (the LM head is
            # the biggest matrix), as `ModelDrafter` scores its catch-up pass.
            logits = model.forward(pass_tokens, cache, visible, last_only=not any(chains))
            width = pass_tokens.shape[1]
            offset = width - logits.shape[1]  # columns the pass did not score
            # 3. Each live row keeps the chain's prefix its own choices agree with, and one token of its own.
            keep = [ends[b][-1] if ends[b] else start for b in range(batch)]  # rows not live keep what they had
            accepted = torch.zeros(len(live), dtype=torch.long)
            for i, b in enumerate(live):
                chain = chains[b]
                first = width - len(chain) - 1  # the column scoring the token after the pending ones
                row_logits = self._processed(logits[b, first - offset :], sequences[b], drafted[b], chain, sampling[b],
                                             self.model.prompt_lens[b], constraints[b] if constraints else None)
                ends[b].append(start + first + 1)  # the tail (first pass) or the token that opened this pass is in
                for j in range(len(chain) + 1):
                    position = len(drafted[b])
                    proposed = chain[j] if j < len(chain) else None
                    token, q, conf = self._choose(row_logits[j], sampling[b], generators[b], len(sequences[b]) + position, proposed)
                    tokens[b, position], confidence[b, position] = token, conf
                    if probs is not None:  # a greedy row of a sampled batch: q one-hot on its argmax, as ModelDrafter's
                        probs[b, position] = q if q is not None else torch.nn.functional.one_hot(torch.tensor(token), vocab)
                    drafted[b].append(token)
                    if j == len(chain) or token != chain[j]:
                        break
                    ends[b].append(start + first + 2 + j)  # chain token j is the draft's own: it stays in the cache
                    accepted[i] += 1
                keep[b] = ends[b][-1]
                pending[b] = [drafted[b][-1]]
            cache.truncate(torch.tensor(keep, dtype=torch.long))
            t2 = time.perf_counter()
            self._observe(live, depth, chains, accepted, proposal.confidence, t1 - t0, t2 - t1, widest)
            # 4. The outer stop rule judges, in order, every position all drafting rows have reached.
            while judged < draft_len:
                waiting = [b for b in range(batch) if bool(going[b]) and len(drafted[b]) <= judged]
                if waiting:
                    break
                reached = torch.tensor([len(d) > judged for d in drafted])
                going &= reached
                if stop is not None:
                    going &= stop(judged, confidence[:, judged])
                if self.model.min_confidence:
                    going &= confidence[:, judged] >= self.model.min_confidence
                num_drafted += going.long()
                judged += 1
        # Each row's cache end after its tail and after each draft token fed (the last drafted one is not).
        self._ends = ends
        return Draft(tokens=tokens, num_drafted=num_drafted, probs=probs, confidence=confidence)

    def _processed(self, logits: torch.Tensor, sequence: list[int], drafted: list[int], chain: list[int],
                   sampling: SamplingParams, prompt_len: int, constraint: Constraint | None) -> torch.Tensor:
        """One row's draft logits [m + 1, vocab] over its pass's positions, in the target's vocabulary, with the
        row's penalties, logit_bias and min_tokens (`sampling.process_logits`) and grammar mask applied at
        each position with the history before it (as `ModelDrafter._process`; acceptance only)."""
        logits = self.model._logits_to_target_vocab(logits.float().cpu())
        if not sampling.processes_logits and constraint is None:
            return logits
        paths = [chain[:j] for j in range(len(chain) + 1)]
        if sampling.processes_logits:
            logits = process_logits(logits, sampling, sequence + drafted, prompt_len, paths, self.model.model.eos_token_ids)
        if constraint is not None:
            logits = mask_logits(logits.clone(), constraint.allowed([drafted + path for path in paths]))
        return logits

    @staticmethod
    def _choose(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator, position: int,
                proposed: int | None) -> tuple[int, torch.Tensor | None, float]:
        """(token, q [vocab] or None for a greedy row, confidence) at one position, as `ModelDrafter` chooses:
        the argmax; a coupled draw keyed by (seed, position); else a draw from q. The stage-2 proposal there
        (None past the chain) is deliberately not consulted: the draw alone decides, and the proposal counts
        as accepted where it equals the draw, which is speculative sampling against its point mass. Confidence
        is q's top probability, never q of the drawn token (see `ModelDrafter`)."""
        if sampling.greedy:
            token, confidence = greedy_choice(logits)
            return int(token), None, float(confidence)
        q = warp(logits[None], sampling)[0]
        token = coupled_choice(q, sampling.seed, position) if sampling.coupled else sample(q, generator)
        return token, q, float(q.max())

    def _observe(self, live: list[int], depth: int, chains: list[list[int]], accepted: torch.Tensor,
                 confidence: torch.Tensor | None, lookup_seconds: float, pass_seconds: float, widest: int) -> None:
        """The inner policy learns from one draft-model pass as the engine's policy learns from a target pass:
        proposals drafted and accepted per live row, the lookup's seconds, the pass's seconds over its rows
        (the pending tokens beyond the first are extra rows: a first pass also catches the model up)."""
        proposed = torch.tensor([len(chains[b]) for b in live])
        width = 1 + int(proposed.max()) if len(live) else 1
        self.policy.observe(StepRecord(
            len(live), depth, width, proposed, accepted, draft_seconds=lookup_seconds, target_seconds=pass_seconds,
            confidence=None if confidence is None or width == 1 else confidence[:, : width - 1], extra_rows=widest - 1))
        self.passes += 1
        self.tokens_drafted += int(accepted.sum()) + len(live)
        self.proposals_accepted += int(accepted.sum())

    def commit(self, verdict: Verdict) -> None:
        self.proposer.commit(verdict)
        if self._ends is None:  # nothing drafted, or a shared cache already as found
            return
        ends = [row[min(int(n), len(row) - 1)] for row, n in zip(self._ends, verdict.num_accepted)]
        self.model.cache.truncate(torch.tensor(ends, dtype=torch.long))
        self._ends = None

    def select(self, rows: list[int]) -> None:
        self.model.select(rows)
        self.proposer.select(rows)
