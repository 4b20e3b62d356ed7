"""The speculative decoding loop: draft -> verify -> accept -> roll back, for a batch of sequences.

Each step the drafter proposes up to k tokens per row, the target scores [last token, draft] in one
forward pass, the verifier accepts a prefix and adds one token of the target's own, and every cache
forgets what was rejected. A draft may add alternates (second guesses beside its positions); the pass
then carries a token tree, and the target's cache keeps only the accepted path. With no
drafter this is plain autoregressive decoding, the baseline.
Sequences may join and leave between steps (continuous batching); each keeps its own sampling
settings, random stream, accepted length and rollback, so it decodes exactly as it would alone.
The engine works on token ids only: it knows nothing about text, except through `stop_checker`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Hashable, Iterator

import torch

from verispec import options
from verispec.costs import BOOK
from verispec.drafters.base import Draft, Drafter, Verdict
from verispec.errors import VerispecError
from verispec.grammar import Constraint, Grammar, mask_logits
from verispec.models.base import CausalLM
from verispec.models.kernels.threads import torch_on_one_thread
from verispec.options import DraftLen
from verispec.policy import RETREAT_STEPS, START_AFTER, DraftPolicy, make_policy, retreat_pays, start_after, start_pays
from verispec.prefill import PromptReader, check_read, joined, read_once
from verispec.prefix_cache import PrefixCache
from verispec.sampling import SamplingParams, TokenLogprob, make_generator, process_logits, token_logprobs
from verispec.stats import AlternateOutcome, SpecStats, StepRecord
from verispec.verifiers import verifier_for
from verispec.verifiers.base import Verifier

# generated token ids so far -> how many to keep if a stop sequence has ended, else None
StopChecker = Callable[[list[int]], "int | None"]


@dataclass
class Request:
    """One sequence to generate."""

    prompt: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 128
    stop_checker: StopChecker | None = None
    id: Hashable = None  # echoed in every TokenEvent
    stats: SpecStats | None = None  # also count this request's steps here (per-request figures)
    # None: no log-probabilities; n >= 0: each emitted token's (TokenEvent.logprobs), with the n most likely beside it.
    logprobs: int | None = None
    # False: log-softmax of the target's raw logits (vLLM's default, "raw_logprobs"); True: of its logits after
    # logit_bias, min_tokens and the penalties (`process_logits`), still before temperature, min_p, top-k and top-p.
    processed_logprobs: bool = False
    # A grammar the output must follow (structured output, `grammar.Grammar`): at every position, draft positions
    # included, the tokens it forbids get probability zero, so the output is plain constrained decoding's.
    grammar: "Grammar | None" = None
    # Whose request this is (a server keys it by API key and `user`): drafters that keep earlier outputs
    # (`Drafter.reads_tenants`) draft a row from its own tenant's only.
    tenant: Hashable = None
    # Keys the prefix cache apart (vLLM's `cache_salt`): a request reuses cached prompt keys and values only
    # from requests of the same salt, so another tenant cannot time whether this prompt was seen.
    cache_salt: str = ""


@dataclass
class TokenEvent:
    """The tokens one sequence gained in one step."""

    request_id: Hashable
    tokens: list[int]
    from_draft: list[bool]  # per token: accepted from the draft (True) or the target's own (False)
    finish_reason: str | None = None  # "stop" (EOS or stop sequence), "length", or None while running
    logprobs: list[TokenLogprob] | None = None  # per token, when the request asked for them


def check_request(target: CausalLM, request: Request) -> None:
    """Raise VerispecError if the request cannot run on this target."""
    options.max_new_tokens(request.max_new_tokens)
    if len(request.prompt) == 0:
        raise VerispecError("the prompt is empty: give at least one token")
    if len(request.prompt) >= target.max_context:
        raise VerispecError(
            f"the prompt has {len(request.prompt)} tokens but {target.name} has a context window of "
            f"{target.max_context}: shorten the prompt"
        )
    bad = [t for t in request.prompt if not 0 <= t < target.vocab_size]
    if bad:
        raise VerispecError(f"the prompt has token ids outside the vocabulary [0, {target.vocab_size}): {bad[:5]}")
    bad = [t for t, _ in request.sampling.logit_bias if t >= target.vocab_size]
    if bad:
        raise VerispecError(f"logit_bias names token ids outside the vocabulary [0, {target.vocab_size}): {bad[:5]}")
    if request.sampling.min_tokens > request.max_new_tokens:
        raise VerispecError(f"min_tokens ({request.sampling.min_tokens}) is more than max_new_tokens ({request.max_new_tokens}): "
                            "lower min_tokens or raise max_new_tokens")
    if request.grammar is not None and request.sampling.min_tokens:
        raise VerispecError("min_tokens cannot be combined with a grammar (response_format): the grammar decides where "
                            "the output ends; drop min_tokens")
    if request.logprobs is not None and (not isinstance(request.logprobs, int) or isinstance(request.logprobs, bool)
                                         or not 0 <= request.logprobs <= target.vocab_size):
        raise VerispecError(f"logprobs must be None or an integer in [0, {target.vocab_size}] (how many most likely "
                            f"tokens to list beside each one), got {request.logprobs!r}")


@dataclass
class _LateStart:
    """A draft model held back until a call's answer runs long (`DecodeBatch._start_late`), with what prices its
    prefill: the prompt tokens and the target's seconds to read them (reused: read from a prefix cache)."""

    drafter: Drafter
    after: int  # answer tokens to wait for
    tokens: int
    target_seconds: float
    reused: bool


@dataclass
class _Row:
    request: Request
    sequence: list[int]  # prompt + generated
    limit: int  # most new tokens this row may produce
    generator: torch.Generator
    sampling: SamplingParams  # the request's, with a seed drawn for a coupled request that had none
    constraint: Constraint | None = None  # the row's grammar state, at its accepted tokens

    @property
    def generated(self) -> list[int]:
        return self.sequence[len(self.request.prompt) :]

    @property
    def remaining(self) -> int:
        return self.limit - len(self.generated)


class DecodeBatch:
    """Sequences decoded together, step by step. Rows join with `add` and leave when finished or `remove`d.

    The target cache holds every token of a row but the last one, which opens the next step.
    """

    def __init__(self, target: CausalLM, drafter: Drafter, policy: DraftPolicy, stats: SpecStats | None = None,
                 fallback: Drafter | None = None, prefix_cache: PrefixCache | None = None):
        self.target = target
        # A granular one (row-exact numbers: a decode step writes the keys and values a prompt read would) also
        # keeps what finished rows decoded, so a conversation's next turn reuses the answer too.
        self.prefix_cache = prefix_cache
        self.drafter = drafter
        # Decided at the first `add`: `drafter` if its prompt prefill can pay for itself, else this one. A call of
        # one row may draft with the fallback first and start the drafter once its answer has run a few tokens
        # (`policy.start_after`, `_start_late`); where the drafter started, the fallback stays in reserve for one
        # judgment of it (`_judge_start`).
        self.fallback = fallback
        self._late: _LateStart | None = None
        self.reserve: Drafter | None = None
        # since the drafter started: tokens its steps gave, and those steps' seconds and count
        self._trial_tokens, self._trial_seconds, self._trial_steps = 0, 0.0, 0
        self.policy = policy  # how many tokens to draft each step (`policy.make_policy`)
        self.last_step: StepRecord | None = None  # what the latest step did
        # The drafter has state to read that did not come from drafting (new rows' prompts, the tokens of steps
        # that did not draft): its next drafting step catches up first, timed apart (`Drafter.catches_up`).
        self._behind = True
        self.stats = stats if stats is not None else SpecStats()
        self.rows: list[_Row] = []
        self._new_cache()

    def _new_cache(self) -> None:
        """An empty target cache, handed to a drafter that drafts on it (`Drafter.shares_cache`)."""
        self.cache = self.target.new_cache(0)
        if self.drafter.shares_cache:
            self.drafter.share_cache(self.cache)

    def __len__(self) -> int:
        return len(self.rows)

    def check(self, request: Request) -> None:
        """Raise VerispecError if the request cannot run on this target."""
        check_request(self.target, request)

    @torch.inference_mode()
    def add(self, requests: list[Request], readers: list[PromptReader] | None = None,
            draft_readers: list[PromptReader] | None = None) -> None:
        """Admit requests: prefill their prompts (all but the last token) and join the batch.

        readers: the requests' prompts already read (`prefill.PromptReader`, done), e.g. a few chunks at a
        time between steps by the server, perhaps from a prefix cache; else they are read now. draft_readers:
        the same on the drafter's `prefill_model`, for a drafter that takes them (`Drafter.reads_prompt_readers`);
        else the drafter reads them itself."""
        self._behind = True
        for request in requests:
            self.check(request)
        taps = self.drafter.target_taps  # a drafter that reads the target's hidden states
        if readers is None:
            readers = read_once(self.target, [r.prompt[:-1] for r in requests], taps=taps, tap_last=self.drafter.prompt_taps)
        check_read(self.target, readers, [r.prompt[:-1] for r in requests])
        started = time.perf_counter()
        prefilled = joined(self.target, readers, with_hidden=taps is not None)
        if taps is not None:
            prefilled, hidden = prefilled
        self.cache.concat(prefilled)
        # the target's prefill: the readers' passes (perhaps spread over earlier steps) and joining the batch
        reading = sum(reader.seconds for reader in {id(reader): reader for reader in readers}.values())  # each read once
        target_seconds = reading + time.perf_counter() - started
        tokens = sum(len(r.prompt) - 1 for r in requests)  # what both prefills process
        if self.fallback is not None:
            chosen, startup = self._start_or_fall_back(requests, tokens, target_seconds)
            starts = chosen is self.drafter and chosen.prefill_model is not None  # a draft model that would start
            one_row = len(requests) == 1 and not self.rows
            if starts and one_row:
                wait = start_after(startup, BOOK.step_seconds(self.target), BOOK.answers(self.target), START_AFTER)
                if wait > 0:
                    self._late = _LateStart(chosen, wait, tokens, target_seconds, any(reader.reused for reader in readers))
                    chosen = self.fallback
            self.reserve = self.fallback if starts and one_row else None
            if self.reserve is not None and self.reserve is not chosen:  # it holds the row, should the call retreat
                self.reserve.add([list(r.prompt) for r in requests])
            self.drafter, self.fallback = chosen, None
        self.stats.drafter = type(self.drafter).__name__
        drafting = time.perf_counter()
        draft_model = self.drafter.prefill_model
        read = draft_readers is not None and self.drafter.reads_prompt_readers and all(r.model is draft_model for r in draft_readers)
        self.drafter.add([list(r.prompt) for r in requests], **self._tenants(self.drafter, requests),
                         **({"readers": draft_readers} if read else {}))
        if taps is not None:
            self.drafter.observe_taps([None] * len(self.rows) + hidden)
        if read:  # the draft's prefill, read between steps: its time is the readers'
            self.stats.prefill_seconds += sum(reader.seconds for reader in draft_readers)
        elif draft_model is not None:
            self._record_draft_prefill(draft_model, tokens, time.perf_counter() - drafting, target_seconds,
                                       any(reader.reused for reader in readers))
        for r in requests:
            limit = min(r.max_new_tokens, self.target.max_context - len(r.prompt))
            generator, sampling = make_generator(r.sampling), r.sampling
            if sampling.coupled and sampling.seed is None:  # the coupled rule keys its noise by a seed
                sampling = replace(sampling, seed=int(torch.randint(2**62, (1,), generator=generator)))
            constraint = r.grammar.constraint() if r.grammar is not None else None
            self.rows.append(_Row(request=r, sequence=list(r.prompt), limit=limit, generator=generator, sampling=sampling,
                                  constraint=constraint))
        self.stats.prefill_seconds += reading + time.perf_counter() - started
        self.stats.prompt_tokens += sum(len(r.prompt) for r in requests)

    @staticmethod
    def _tenants(drafter: Drafter, requests: list[Request]) -> dict:
        return {"tenants": [r.tenant for r in requests]} if drafter.reads_tenants else {}

    def _start_or_fall_back(self, requests: list[Request], tokens: int,
                            target_seconds: float) -> tuple[Drafter, float | None]:
        """The drafter if its prompt prefill is expected to pay for itself over the requests' tokens
        (`policy.start_pays`), priced as the target's prefill of these prompts (`tokens` in all), just
        measured, times what the draft's prefill has cost relative to the target's on earlier calls; else
        the fallback. And that price in seconds (None: not measured yet, or no draft model)."""
        draft_model = self.drafter.prefill_model
        if draft_model is None:
            return self.drafter, None
        startup = self._draft_prefill_price(draft_model, tokens, target_seconds)
        new_tokens = max(r.max_new_tokens for r in requests)
        pays = start_pays(startup, BOOK.step_seconds(self.target), new_tokens)
        return self.drafter if pays else self.fallback, startup

    def _draft_prefill_price(self, draft_model: CausalLM, tokens: int, target_seconds: float) -> float | None:
        """The seconds a draft model's prefill of `tokens` prompt tokens is expected to take: the target's
        `target_seconds` for them times what the draft's prefill has cost relative to the target's on earlier
        calls (None: not measured yet)."""
        ratio = BOOK.relative_prefill(self.target, draft_model, tokens)
        return None if ratio is None else ratio * target_seconds

    def _record_draft_prefill(self, draft_model: CausalLM, tokens: int, seconds: float, target_seconds: float,
                              reused: bool) -> None:
        """The draft/target prefill ratio into the cost book, where the target read the prompt itself (a prefix
        cache's reuse would make the ratio say nothing of a fresh read)."""
        if target_seconds > 0 and not reused:
            BOOK.record_relative_prefill(self.target, draft_model, tokens, seconds / target_seconds)

    @torch.inference_mode()
    def remove(self, request_id: Hashable) -> None:
        """Drop a request mid-flight (e.g. its client went away). Under inference mode like `add` and
        `step`: the kept rows are moved within caches made there, which only inference mode may write."""
        self._keep([b for b, row in enumerate(self.rows) if row.request.id != request_id])

    def _keep(self, keep: list[int]) -> None:
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[b] for b in keep]
        if self.rows:
            self.cache.select(keep)
        else:
            self._new_cache()  # an emptied batch starts afresh: no stale slots
        self.drafter.select(keep)

    def next_draft_len(self) -> int:
        # Draft no more than any row can still use, and keep every verified position inside the context.
        most_needed = max(row.remaining for row in self.rows) - 1
        context_room = min(self.target.max_context - len(row.sequence) for row in self.rows)
        limits = [self.policy.choose(len(self.rows)), most_needed, context_room]
        # A target whose passes are row-exact only up to some number of token rows (the native CPU
        # kernels) must verify within that many, or a verify pass could round differently from the
        # plain steps it stands for. Plain decoding of a batch already past the limit is not capped.
        exact_rows = self.target.max_exact_rows
        if exact_rows and len(self.rows) <= exact_rows:
            limits.append(exact_rows // len(self.rows) - 1)
        return max(0, min(limits))

    @torch.inference_mode()
    def step(self) -> list[TokenEvent]:
        """One draft -> verify -> accept -> rollback round for every row. Finished rows leave the batch."""
        if not self.rows:
            return []
        with torch_on_one_thread():  # the logits' small PyTorch ops stay off the kernels' cores: see kernels.threads
            return self._step()

    def _step(self) -> list[TokenEvent]:
        k = self.next_draft_len()
        sampling = [row.sampling for row in self.rows]
        generators = [row.generator for row in self.rows]
        verifier = verifier_for(sampling)
        t0 = time.perf_counter()
        # 0. The drafter proposes up to k tokens per row (perhaps a token tree), having first read what it
        # skipped while earlier steps did not draft.
        if k and self.drafter.catches_up and self._behind:
            self.drafter.catch_up([row.sequence for row in self.rows])
        self._behind = k == 0
        caught_up = time.perf_counter()
        draft = self._propose(k, sampling, generators, verifier)
        t1 = time.perf_counter()
        # 1. One target pass scores the last token and every drafted one (a token tree with alternates).
        start = self.cache.slots.length
        logits, hidden = self._score(draft)
        # 1b. What plain decoding would sample from at each position: penalties, logit_bias and min_tokens
        # read the history up to that position, the draft tokens before it included.
        processed = self._process(logits, draft)
        t2 = time.perf_counter()
        # 2. Accept a prefix (and perhaps the alternate where it broke off), add the target's own token.
        verdict = verifier.verify(draft, processed, sampling, generators, [len(row.sequence) for row in self.rows])
        # 3. Roll back: the target keeps the last token and the accepted path; the drafter its own state.
        kept = self._roll_back(start, draft, verdict, logits.shape[1])
        if hidden is not None:  # a drafter that reads the target's hidden states gets those of the kept tokens, in order
            self.drafter.observe_taps([hidden[b, kept[b].to(hidden.device)] for b in range(len(self.rows))])
        self.drafter.commit(verdict)
        t3 = time.perf_counter()
        # 4. Hand out the new tokens; cut at max_new_tokens, EOS and stop sequences.
        taken = verdict.tokens_from_draft()
        events = []
        for b, row in enumerate(self.rows):
            emitted = verdict.emitted(draft, b)
            logprobs = self._logprobs(row, logits[b], processed[b], draft, verdict, b, emitted)
            events.append(self._emit(row, emitted, int(taken[b]), logprobs))
        # 5. Whoever learns from the step (the policy, the stats, the server) sees one record of it.
        trees = draft.has_alternates
        self._observe(StepRecord(
            len(self.rows), k, 1 + draft.draft_len, draft.num_drafted, verdict.num_accepted,
            draft_seconds=t1 - t0, target_seconds=t3 - t1, verify_seconds=t3 - t2, catch_up_seconds=caught_up - t0,
            confidence=draft.confidence,
            extra_rows=draft.tree.extra.shape[1] if trees else 0,
            alternates=AlternateOutcome.of(draft, verdict) if trees else None,
            emitted=torch.tensor([len(event.tokens) for event in events]), lossy=torch.tensor([s.lossy for s in sampling])))
        for b, event in enumerate(events):
            if event.finish_reason is not None:
                BOOK.record_answer(self.target, len(self.rows[b].generated))  # what the workload asks for
                if self.prefix_cache is not None and self.prefix_cache.granular:
                    self._store_decoded(b)
        self._keep([b for b, event in enumerate(events) if event.finish_reason is None])
        if self._late is not None:  # after the finished rows left: a row that ended needs no draft
            self._start_late()
        return events

    def _store_decoded(self, b: int) -> None:
        """Row b's tokens and the keys and values its cache holds for them (prompt and answer) into the
        granular prefix cache. Its visible slots hold its tokens in order (holes are other passes' columns)."""
        slots = self.cache.slots.visible[b].nonzero().squeeze(1)
        held = min(len(slots), len(self.rows[b].sequence))  # a cut at a stop may leave more slots than tokens
        self.prefix_cache.insert(self.rows[b].sequence[:held], self.cache, row=b, slots=slots[:held],
                                 salt=self.rows[b].request.cache_salt)

    def _propose(self, k: int, sampling: list[SamplingParams], generators: list[torch.Generator],
                 verifier: Verifier) -> Draft:
        """The drafter's proposal for every row, narrowed to the longest chain any row drafted, with
        alternates only where the target verifies trees and the rule judges them (not coupled or lossy rows),
        and only as many as the target's exact rows allow."""
        stop = self.policy.stop_rule(len(self.rows)) if k else None
        trees = stop is not None and self.target.supports_trees and verifier.takes_alternates
        branch = self.policy.branch_rule(stop) if trees else None
        grammars = ({"constraints": [row.constraint for row in self.rows]}
                    if self.drafter.reads_grammars and any(row.constraint is not None for row in self.rows) else {})
        draft = self.drafter.propose([row.sequence for row in self.rows], k, sampling, generators, stop, branch, **grammars)
        draft = draft.narrow(int(draft.num_drafted.max()) if k else 0)  # rows that stopped early need no verify slots
        return self._fit_alternates(draft) if draft.has_alternates else draft

    def _score(self, draft: Draft) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's logits [batch, 1 + k (+ alternates), vocab] over [last token, chain, alternates],
        appended to its cache; and, for a drafter that reads them (`Drafter.target_taps`), the hidden states
        at those layers' inputs [batch, same width, taps x hidden], else None."""
        last = torch.tensor([[row.sequence[-1]] for row in self.rows], dtype=torch.long)
        tapping = {} if self.drafter.target_taps is None else {"taps": self.drafter.target_taps}
        if draft.has_alternates:
            tree = draft.tree
            out = self.target.forward(torch.cat([last, draft.tokens, tree.extra], 1), self.cache, tree=tree.mask, **tapping)
        else:
            out = self.target.forward(torch.cat([last, draft.tokens], 1), self.cache, **tapping)
        return out if tapping else (out, None)

    def _roll_back(self, start: int, draft: Draft, verdict: Verdict, width: int) -> torch.Tensor:
        """The target's cache forgets what the pass that began at slot `start` (`width` columns) wrote and was
        not accepted. Returns which columns each row kept: [batch, width] bool."""
        if verdict.alternate is not None and bool(verdict.alternate.any()):
            kept = verdict.kept_columns(draft, width)
            self.cache.retain(start, kept)
            return kept
        self.cache.truncate(start + 1 + verdict.num_accepted)
        return torch.arange(width)[None, :] <= verdict.num_accepted[:, None]  # the chain's kept prefix

    def _observe(self, step: StepRecord) -> None:
        """The policy learns from the step, the stats count it, and the server can read it (`last_step`)."""
        if step.width == 1 and step.batch_size == 1:
            BOOK.record_step(self.target, step.target_seconds)  # a plain step, the price of what a drafter saves
        self.policy.observe(step)
        for stats, rows in self._stat_sinks():
            stats.observe(step.rows(rows))
        self.last_step = step
        if self.reserve is not None and self._late is None:
            self._judge_start(step)

    def _start_late(self) -> None:
        """Once the one row of a call that drafts by prompt lookup has the answer tokens its wait was set to
        (`policy.start_after`): the draft model reads the prompt, if its prefill still pays over the tokens the row
        may yet make (`policy.start_pays`), and drafts from the next step; the answer so far it reads in its first
        draft pass (a tail, as after any step). An answer that ends sooner never pays the draft's prefill. The
        output is the same either way."""
        row = self.rows[0] if len(self.rows) == 1 else None
        if row is not None and len(row.generated) < self._late.after:
            return
        late, self._late = self._late, None
        startup = self._draft_prefill_price(late.drafter.prefill_model, late.tokens, late.target_seconds)
        if row is None or not start_pays(startup, BOOK.step_seconds(self.target), row.remaining):
            self.reserve = None
            return
        started = time.perf_counter()
        late.drafter.add([list(row.request.prompt)], **self._tenants(late.drafter, [row.request]))
        seconds = time.perf_counter() - started
        self._record_draft_prefill(late.drafter.prefill_model, late.tokens, seconds, late.target_seconds, late.reused)
        self.stats.prefill_seconds += seconds
        self.stats.drafter = f"{self.stats.drafter}, then {type(late.drafter).__name__}"
        self.drafter, self.policy, self._behind = late.drafter, self.policy.fresh(), True

    def _judge_start(self, step: StepRecord) -> None:
        """Once, after `RETREAT_STEPS` steps of the one row a call started a draft model for, counted past the
        policy's opening (`DraftPolicy.opening`: steps that draft whatever they show): if those steps gave fewer
        tokens per second than plain steps do, the rest of the call drafts with the fallback (prompt lookup)
        and a fresh policy. The draft's prefill is spent either way; what this saves is its later steps where
        the text is not one it predicts (chat prose, translation). The output is the same either way."""
        if len(self.rows) != 1:  # one row's steps are what a plain step is priced against
            self.reserve = None
            return
        if self.policy.opening:  # a price paid either way, and no forecast of the steps after it
            return
        self._trial_tokens += int(step.emitted.sum())
        self._trial_seconds += step.draft_seconds + step.target_seconds
        self._trial_steps += 1
        if self._trial_steps < RETREAT_STEPS:
            return
        reserve, self.reserve = self.reserve, None
        # the reserve holds the row already
        if retreat_pays(self._trial_tokens, self._trial_seconds, BOOK.step_seconds(self.target)):
            self.stats.drafter = f"{self.stats.drafter}, then {type(reserve).__name__}"
            self.drafter, self.policy, self._behind = reserve, self.policy.fresh(), False

    def _process(self, logits: torch.Tensor, draft: Draft) -> torch.Tensor:
        """`sampling.process_logits` for every row whose settings need it, then its grammar's mask: logits [batch,
        width, vocab] over [last token, chain, alternates] -> the same shape, each position processed (and masked)
        with the history plain decoding would have there. Exactness does not depend on the draft's q, which is only
        a proposal (every rule is exact for any q); a model drafter processes its own logits too, to be accepted
        more often."""
        rows = [b for b, row in enumerate(self.rows) if row.sampling.processes_logits or row.constraint is not None]
        if not rows:
            return logits
        out = logits.to(torch.float32, copy=True)
        width = logits.shape[1]
        for b in rows:
            row = self.rows[b]
            paths = self._draft_paths(draft, b, width)
            if row.sampling.processes_logits:
                out[b] = process_logits(logits[b], row.sampling, row.sequence, len(row.request.prompt), paths,
                                        self.target.eos_token_ids)
            if row.constraint is not None:
                mask_logits(out[b], row.constraint.allowed(paths))
        return out

    @staticmethod
    def _draft_paths(draft: Draft, row: int, width: int) -> list[list[int]]:
        """The draft tokens before each of the pass's `width` positions for `row`, that position's own token
        included: [] for the last token's, d[:j] for chain position j, the chain up to where an alternate hangs
        then the alternates down to it (itself included) for an alternate's column. Positions past the row's
        draft are padding (never read); they get the whole chain."""
        chain = draft.tokens[row, : int(draft.num_drafted[row])].tolist()
        paths = [chain[:j] for j in range(draft.draft_len + 1)]
        if draft.has_alternates:
            tree = draft.tree
            k = draft.draft_len
            paths += [chain] * (width - len(paths))
            for column in (tree.source[row] >= 0).nonzero().squeeze(1).tolist():
                down = tree.path(row, column)  # chain columns 1..i, then alternate columns
                hang = sum(1 for c in down if c <= k)
                paths[column] = chain[:hang] + [tree.token(row, c) for c in down[hang:]]
        return paths[:width]

    @staticmethod
    def _logprobs(row: _Row, raw: torch.Tensor, processed: torch.Tensor, draft: Draft, verdict: Verdict, b: int,
                  emitted: list[int]) -> list[TokenLogprob] | None:
        """The target's log-probabilities of row b's emitted tokens, each from the pass position that scored it
        (raw [width, vocab] or processed, as the request asked): the same logits a plain step would have had."""
        if row.request.logprobs is None:
            return None
        accepted = int(verdict.num_accepted[b])
        columns = list(range(accepted + 1))
        if verdict.took_alternate(b):  # each alternate taken scores the token after it in its own column
            columns += verdict.branch[b]
        logits = (processed if row.request.processed_logprobs else raw)[columns]
        return token_logprobs(logits, emitted, row.request.logprobs)

    def _fit_alternates(self, draft: Draft) -> Draft:
        """Keep a tree pass within the rows the target computes exactly (see next_draft_len): each row keeps its
        first alternates (the leaf form's shallowest positions, a tree's best as its drafter ordered them):
        the deeper or worse ones are the least likely to be reached."""
        exact_rows = self.target.max_exact_rows
        if not exact_rows:
            return draft
        room = exact_rows // len(self.rows) - 1 - draft.draft_len  # alternate columns a pass may still carry
        if room <= 0:
            return replace(draft, alternates=None, alternate_confidence=None, alternate_probs=None, alternate_parents=None)
        return draft.first_alternates(room)

    def _stat_sinks(self) -> Iterator[tuple[SpecStats, torch.Tensor]]:
        """The batch's stats over all rows, then each request's own stats over its row."""
        yield self.stats, torch.arange(len(self.rows))
        for b, row in enumerate(self.rows):
            if row.request.stats is not None and row.request.stats is not self.stats:
                yield row.request.stats, torch.tensor([b])

    def _emit(self, row: _Row, new_tokens: list[int], num_accepted: int, logprobs: list[TokenLogprob] | None = None) -> TokenEvent:
        from_draft = [True] * num_accepted + [False]
        finish_reason = None
        if len(new_tokens) >= row.remaining:
            new_tokens, finish_reason = new_tokens[: row.remaining], "length"
        for i, token in enumerate(new_tokens):
            if token in self.target.eos_token_ids:
                new_tokens, finish_reason = new_tokens[: i + 1], "stop"
                break
        if row.constraint is not None:
            new_tokens = new_tokens[: row.constraint.advance(new_tokens)]
            if row.constraint.finished:  # the grammar is complete: only EOS could follow, so stop here
                finish_reason = "stop"
        before = len(row.generated)
        row.sequence.extend(new_tokens)
        if row.request.stop_checker is not None:
            keep = row.request.stop_checker(row.generated)
            if keep is not None:
                del row.sequence[len(row.request.prompt) + max(keep, before) :]
                new_tokens, finish_reason = row.generated[before:], "stop"
        return TokenEvent(row.request.id, new_tokens, from_draft[: len(new_tokens)], finish_reason,
                          None if logprobs is None else logprobs[: len(new_tokens)])


class SpeculativeEngine:
    """Generates a fixed set of requests with a target model and a fresh drafter per call.

    With a `fallback`, a drafter that has a start-up cost (a draft model prefilling the prompts) runs
    only when the measured costs say it wins that back over the call's tokens (`policy.start_pays`);
    otherwise the call drafts with the fallback (prompt lookup). The output is the same either way.
    """

    def __init__(self, target: CausalLM, make_drafter: Callable[[], Drafter], draft_len: DraftLen | int | str = 4,
                 fallback: Callable[[], Drafter] | None = None):
        self.draft_len = DraftLen.parse(draft_len)  # checked now, not at the first call
        self.target, self.make_drafter, self.fallback = target, make_drafter, fallback

    def stream(self, requests: list[Request], stats: SpecStats | None = None) -> Iterator[TokenEvent]:
        """Yield TokenEvents until every request has finished."""
        if not requests:
            raise VerispecError("no prompts given: pass at least one prompt")
        started = time.perf_counter()
        batch = DecodeBatch(self.target, self.make_drafter(), make_policy(self.draft_len), stats,
                            fallback=self.fallback() if self.fallback is not None else None)
        try:
            batch.add(requests)
            while len(batch):
                yield from batch.step()
        finally:
            batch.stats.total_seconds += time.perf_counter() - started
            batch.stats.drafter_figures = batch.drafter.figures()
