"""How many tokens to draft next step: fixed, or chosen from measured costs and acceptance.

The adaptive policy maximises predicted tokens per second (Leviathan et al. 2023, Sec. 3.4, with the
verify pass's real cost instead of "free"):

    rate(k) = E(k) / (k * t_draft(b) + t_target(b * (k + 1))),   E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j

where a_j is the measured probability that draft position j is accepted given j - 1 was, t_draft(b)
the measured seconds per drafted token at batch size b, and t_target(r) the measured seconds of a
target step (forward pass plus verification) over r token rows. On a CPU a wider pass is *not*
free; on any device its cost depends on the rows it carries (batch x width) far more than on how they
split, so one cost curve over rows serves every batch size: a batch size seen for the first time is
priced from the others instead of explored from scratch. k = 0 is plain decoding: when no k beats
it, the engine does not speculate, and it probes now and then so the estimates can recover.

A drafter that reports its own probability for each token gets more: the chance that a token is
accepted depends far more on how sure the draft was of it than on its position (on code with the
Qwen pair: ~99% above 0.9, ~45% between 0.4 and 0.5), so k becomes a ceiling and each row stops
where the next token stops paying. Token i joins a row's draft while

    S_i >= R * (t_draft + dt_target)

where S_i = prod_{j<=i} a(conf_j) is the chance that all of the row's tokens up to i are accepted,
a(.) the acceptance observed at that confidence, dt_target what one more row adds to the target's
pass there, and R the rate the engine already gets (the better of what speculative steps have
delivered and a plain step): a step should take on a token when the tokens it is expected to add
are worth at least what its seconds would earn at that rate, which is the rule that maximises a
long-run rate of reward over cost. In a batch every row rides the widest row's pass, so a position is
taken when the batch's sum of S_i pays for it (`ConfidenceStop.position_pays`). Whether to draft at all is
then decided from the rate drafting has delivered at this batch size (`RatesByBatch`: an unmeasured size
leans on its neighbours) against a plain step's there; and where even a draft accepted in full could not beat
a plain step, probing nearly stops (`AdaptiveDraftLen.could_pay`).

The same rule places alternates (a second candidate beside chain position i, a leaf of a token tree)
once the chain is drafted: one is worth v_i = S_{i-1} * b(conf2_i) tokens, where b(.) is the observed
chance that an alternate of that draft probability is taken once the chain has reached position i (taking it adds one token: the alternate, then the target's token after it, where
the chain would have given the target's correction alone). It costs no draft pass, only its row in
the pass, priced where it lands: after the chain and the better alternates, where on a CPU every row
costs more than the last. Alternates go in by decreasing v while v >= R * dt_target(width).
Knows nothing about models or tokens: only numbers the engine reports.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict, deque
from typing import Protocol

import torch

from verispec.drafters.base import BranchRule, StopRule
from verispec.options import DraftLen
from verispec.stats import StepRecord


class DraftPolicy(Protocol):
    def choose(self, batch_size: int) -> int:
        """Draft length for the next step (0 = plain decoding)."""
        ...

    def stop_rule(self, batch_size: int) -> StopRule | None:
        """How far each row's draft may go within the chosen length this step (None: all the way)."""
        ...

    def branch_rule(self, stop: StopRule) -> BranchRule | None:
        """Where this step's draft (judged by `stop`) may add alternates; None: nowhere."""
        ...

    def observe(self, step: StepRecord) -> None:
        """Learn from one step of the whole batch (see `StepRecord`)."""
        ...

    def fresh(self) -> "DraftPolicy":
        """The same settings with nothing learned (for another drafter, whose costs and acceptance differ)."""
        ...

    @property
    def opening(self) -> bool:
        """Whether the policy is still exploring (its first steps draft whatever they show), so that what these
        steps deliver says little about the steps after them."""
        ...


class FixedDraftLen:
    opening = False  # it drafts the same length on every step

    def __init__(self, draft_len: int):
        self.draft_len = draft_len

    def fresh(self) -> "FixedDraftLen":
        return FixedDraftLen(self.draft_len)

    def choose(self, batch_size: int) -> int:
        return self.draft_len

    def stop_rule(self, batch_size: int) -> None:
        return None

    def branch_rule(self, stop: StopRule) -> None:
        return None

    def observe(self, step: StepRecord) -> None:
        pass


class Calibration:
    """a(conf): how often a drafted token is accepted, as a function of the draft's probability for it.

    Counts per confidence bin (finer near 1, where most tokens fall and where 0.95 against 0.99 decides
    how deep a draft goes), decayed so a change of text or temperature shows within a few hundred
    tokens, and shrunk toward a(conf) = sqrt(conf): a greedy draft is right more often than its top
    probability says (measured with the Qwen pair on code and chat: 0.99 at 0.9-1.0, 0.93 at 0.8-0.9,
    ~0.6 at 0.4-0.7), and a prior of a(conf) = conf stops a request's first drafts too early.
    """

    EDGES = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99])

    def __init__(self, decay: float = 0.99, prior_weight: float = 2.0, prior_power: float = 0.5):
        self.decay = decay
        self.prior_weight = prior_weight
        lower = torch.cat([torch.zeros(1), self.EDGES])
        upper = torch.cat([self.EDGES, torch.ones(1)])
        self.prior = ((lower + upper) / 2) ** prior_power
        self.accepted = torch.zeros(len(self.prior))
        self.reached = torch.zeros(len(self.prior))
        self.seen = False

    def __call__(self, confidence: torch.Tensor) -> torch.Tensor:
        rates = (self.accepted + self.prior_weight * self.prior) / (self.reached + self.prior_weight)
        return rates[torch.bucketize(confidence.float().contiguous(), self.EDGES, right=True)]

    def observe(self, confidence: torch.Tensor, num_drafted: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """confidence [batch, k]; a token counts if it was drafted and everything before it was accepted."""
        positions = torch.arange(confidence.shape[1])
        reached = (positions < num_drafted[:, None]) & (positions <= num_accepted[:, None])
        accepted = positions < num_accepted[:, None]  # accepted tokens were drafted, so all reached
        self.count(confidence, reached, accepted)

    def count(self, confidence: torch.Tensor, reached: torch.Tensor, accepted: torch.Tensor) -> None:
        """One step's outcomes: confidence, reached, accepted [batch, k] (accepted implies reached)."""
        bins = torch.bucketize(confidence.float().contiguous(), self.EDGES, right=True)
        self.reached *= self.decay
        self.accepted *= self.decay
        self.reached.index_add_(0, bins[reached], torch.ones(int(reached.sum())))
        self.accepted.index_add_(0, bins[accepted], torch.ones(int(accepted.sum())))
        self.seen = self.seen or bool(reached.any())


class RealizedRate:
    """Tokens per second over recent steps: decayed sums of tokens and of seconds (~50 steps of memory)."""

    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self.tokens = self.seconds = self.steps = 0.0

    def observe(self, tokens: float, seconds: float) -> None:
        self.tokens = self.tokens * self.decay + tokens
        self.seconds = self.seconds * self.decay + seconds
        self.steps = self.steps * self.decay + 1

    def fade(self, factor: float) -> None:
        """Age the evidence without new steps (the rate stays, its weight against the next steps shrinks)."""
        self.tokens *= factor
        self.seconds *= factor

    @property
    def rate(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


class RatesByBatch:
    """What drafting steps delivered at each batch size: a `RealizedRate` each (tokens per second per sequence).

    Speculation's edge over plain decoding shrinks as a batch fills the pass (SmolLM2-135M with its int4 copy
    on 2 cores: 1.4x at batch 1, below 1x at 4 and 16), so one rate shared by every batch size carries batch
    1's evidence into batch 16 for dozens of steps. A batch size is judged by its own steps; one with fewer
    than `min_steps` of them leans, in proportion, on its neighbours' *edge* (delivered rate times a plain step's
    seconds there), on the line between the nearest measured sizes below and above it, else the nearest one,
    as `CostCurve` prices token rows.
    """

    def __init__(self, decay: float = 0.98, min_steps: float = 4.0):
        self.decay = decay
        self.min_steps = min_steps
        self.by_size: dict[int, RealizedRate] = {}

    def observe(self, batch_size: int, tokens: float, seconds: float) -> None:
        self.by_size.setdefault(batch_size, RealizedRate(self.decay)).observe(tokens, seconds)

    def fade(self, batch_size: int, factor: float) -> None:
        """Age one batch size's evidence (see `RealizedRate.fade`)."""
        if batch_size in self.by_size:
            self.by_size[batch_size].fade(factor)

    @property
    def steps(self) -> float:
        """Drafting steps seen, over every batch size (decayed)."""
        return sum(r.steps for r in self.by_size.values())

    def rate(self, batch_size: int, plain_seconds) -> float | None:
        """Tokens per second per sequence drafting is expected to deliver at `batch_size`; plain_seconds(b): a plain
        step's seconds at batch size b (what an edge is measured against). None: nothing measured anywhere."""
        own = self.by_size.get(batch_size)
        weight = 0.0 if own is None or own.rate is None else min(1.0, own.steps / self.min_steps)
        if weight >= 1.0:
            return own.rate
        edge = self._neighbours_edge(batch_size, plain_seconds) if plain_seconds(batch_size) else None
        if edge is None:
            return own.rate if weight else None
        borrowed = edge / plain_seconds(batch_size)
        return weight * own.rate + (1 - weight) * borrowed if weight else borrowed

    def _neighbours_edge(self, batch_size: int, plain_seconds) -> float | None:
        """Delivered rate / plain rate at `batch_size`, from the sizes measured over at least `min_steps` steps."""
        edges = sorted((b, r.rate * plain_seconds(b)) for b, r in self.by_size.items()
                       if b != batch_size and r.rate is not None and r.steps >= self.min_steps and plain_seconds(b))
        if not edges:
            return None
        below = [(b, e) for b, e in edges if b < batch_size]
        above = [(b, e) for b, e in edges if b > batch_size]
        if below and above:
            (b0, e0), (b1, e1) = below[-1], above[0]
            return e0 + (e1 - e0) * (batch_size - b0) / (b1 - b0)
        return (below[-1] if below else above[0])[1]


class ConfidenceStop:
    """One step's stop rule: keep a row drafting while S_i >= thresholds[i] (see the module docstring)."""

    def __init__(self, calibration: Calibration, thresholds: list[float], alternates: Calibration | None = None,
                 row_prices: list[float] | None = None):
        self.calibration = calibration
        self.thresholds = thresholds
        self.alternates = alternates
        self.row_prices = row_prices  # [w]: tokens a row must be expected to add to a pass already w rows wide
        self.survival: torch.Tensor | None = None
        self.going: torch.Tensor | None = None  # [batch] bool: rows this rule has not stopped yet
        self.reach: list[torch.Tensor] = []  # [i]: S_{i-1} per row, the chance the chain reaches position i

    def __call__(self, position: int, confidence: torch.Tensor) -> torch.Tensor:
        accept = self.calibration(confidence)
        self.reach.append(torch.ones_like(accept) if self.survival is None else self.survival)
        self.survival = accept if self.survival is None else self.survival * accept
        if self.going is None:
            self.going = torch.ones(len(accept), dtype=torch.bool)
        self.going = self.going & self.position_pays(position)
        return self.going

    def position_pays(self, position: int) -> torch.Tensor:
        """[batch] bool: rows whose token at `position` is worth its seconds. The pass is as wide as the longest
        draft, and a draft pass runs over every row, so a position is paid for by the whole batch: it pays when
        the tokens the rows still drafting expect from it, sum of S_i, are worth what its seconds earn at the
        batch's rate, batch * R * (t_draft + dt_target); then every such row may use it, at no further cost. (One
        row deciding for itself would widen every row's pass for its own S_i alone.) At batch size 1 this is
        S_i >= threshold."""
        expected = float(self.survival[self.going].sum())
        pays = expected >= len(self.survival) * self.thresholds[position]
        return self.going.clone() if pays else torch.zeros(len(self.survival), dtype=torch.bool)

    def branch(self, confidence: torch.Tensor, num_drafted: torch.Tensor) -> torch.Tensor:
        """The `BranchRule`: alternates by decreasing worth, while each pays for the row it adds."""
        batch, k = confidence.shape
        judged = min(k, len(self.reach))
        if not judged or not int(num_drafted.max()):
            return torch.zeros(batch, k, dtype=torch.bool)
        worth = torch.zeros(batch, k)
        worth[:, :judged] = torch.stack(self.reach[:judged], 1) * self.alternates(confidence[:, :judged])
        worth[torch.arange(k)[None, :] >= num_drafted[:, None]] = 0.0
        return self.pick(worth, 1 + int(num_drafted.max()))

    def chance(self, confidence: torch.Tensor, chain: bool) -> torch.Tensor:
        """The chance a drafted token of each draft probability is the target's where its place is reached: as
        measured for chain tokens (chain=True) or for alternates."""
        return self.calibration(confidence) if chain else self.alternates(confidence)

    def pick(self, worth: torch.Tensor, width: int) -> torch.Tensor:
        """Which candidates join a pass `width` rows wide, given the tokens each is expected to add, worth
        [batch, n]: by decreasing worth while each pays for the row it adds ([batch, n] bool). Every row is
        priced as if it set the pass width alone (exact at batch size 1)."""
        chosen = torch.zeros(worth.shape, dtype=torch.bool)
        for b in range(worth.shape[0]):
            at = width
            values, order = worth[b].sort(descending=True, stable=True)
            for value, index in zip(values.tolist(), order.tolist()):
                if at >= len(self.row_prices) or value <= 0 or value < self.row_prices[at]:
                    break
                chosen[b, index] = True
                at += 1
        return chosen


class ConfidenceBranch:
    """One step's `BranchRule`, priced by the step's `ConfidenceStop`: leaves beside the chain (`__call__`), or
    the nodes of a drafter's own tree (`chance`, `pick`)."""

    def __init__(self, stop: ConfidenceStop):
        self.stop = stop

    def __call__(self, confidence: torch.Tensor, num_drafted: torch.Tensor) -> torch.Tensor:
        return self.stop.branch(confidence, num_drafted)

    def chance(self, confidence: torch.Tensor, chain: bool) -> torch.Tensor:
        return self.stop.chance(confidence, chain)

    def pick(self, worth: torch.Tensor, width: int) -> torch.Tensor:
        return self.stop.pick(worth, width)


class CostCurve:
    """Seconds of a pass as a non-decreasing function of its size, from recent measurements.

    Each size keeps the median of its last `window` measurements, so one step slowed by a noisy
    neighbour does not move the estimate. A size costs no more than the cheapest larger one (a pass
    never gets cheaper by adding rows; this also discounts a small size whose median is inflated).
    An unmeasured size is priced on the line between its measured neighbours, below the smallest at
    the smallest's cost, and beyond the largest by extending the slope of the last two (flat with one).
    """

    def __init__(self, window: int = 9):
        self.samples: dict[int, deque] = defaultdict(lambda: deque(maxlen=window))
        self._curve: tuple[list[int], list[float]] | None = None  # (sizes, costs) until the next change

    def observe(self, size: int, seconds: float) -> None:
        self.samples[size].append(seconds)
        self._curve = None

    def forget(self, size: int) -> None:
        """Drop a size's measurements (it is measured afresh)."""
        self.samples.pop(size, None)
        self._curve = None

    def count(self, size: int) -> int:
        return len(self.samples.get(size, ()))

    def _points(self) -> tuple[list[int], list[float]]:
        """The measured sizes, ascending, and their costs: computed once per change, as a step asks for a
        price many times (every draft length it weighs) between two measurements."""
        if self._curve is None:
            points = sorted((s, statistics.median(v)) for s, v in self.samples.items() if v)
            cost, cheapest = [], float("inf")
            for _, m in reversed(points):  # a pass never gets cheaper by adding rows: the running minimum from above
                cheapest = min(cheapest, m)
                cost.append(cheapest)
            cost.reverse()
            self._curve = ([s for s, _ in points], cost)
        return self._curve

    def __call__(self, size: int) -> float | None:
        sizes, cost = self._points()
        if not sizes:
            return None
        if size <= sizes[0]:
            return cost[0]
        for i in range(1, len(sizes)):
            if size <= sizes[i]:  # between two measured sizes: on the line joining them
                return cost[i - 1] + (cost[i] - cost[i - 1]) * (size - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
        slope = (cost[-1] - cost[-2]) / (sizes[-1] - sizes[-2]) if len(sizes) > 1 else 0.0
        return cost[-1] + slope * (size - sizes[-1])


# Drafting is ruled out at a batch size only when even a draft accepted in full would fall this far short of a plain
# step there (measured costs are noisy), and is then probed this many times less often.
PAYABLE_MARGIN = 0.9
UNPAYABLE_PROBE_SPACING = 8


class AdaptiveDraftLen:
    """Chooses k from running estimates of acceptance and costs; see the module docstring."""

    def __init__(self, max_draft_len: int = 10, decay: float = 0.95, probe_every: int = 16, prior_acceptance: float = 0.7,
                 prior_weight: float = 2.0, first_draft_len: int = 4, idle_fade: float = 0.9, alternates: bool = False):
        self._settings = dict(max_draft_len=max_draft_len, decay=decay, probe_every=probe_every, prior_acceptance=prior_acceptance,
                              prior_weight=prior_weight, first_draft_len=first_draft_len, idle_fade=idle_fade, alternates=alternates)
        self.max_draft_len = max_draft_len
        self.decay = decay  # per step, on the acceptance counts: ~20 steps of memory
        self.probe_every = probe_every
        self.first_draft_len = min(first_draft_len, max_draft_len)
        # Conditional acceptance per draft position as decayed counts, shrunk toward a prior worth
        # `prior_weight` observations: prior_acceptance at position 1, the estimate of position j - 1 at j
        # (so deep positions a short k never reaches are not assumed better than the ones it does).
        self.prior = (prior_acceptance, prior_weight)
        self.accepted = torch.zeros(max_draft_len)
        self.reached = torch.zeros(max_draft_len)
        self.target_cost = CostCurve()  # token rows in the pass -> seconds of the target step
        self.draft_cost = CostCurve()  # batch size -> seconds per drafted token
        self.calibration = Calibration()  # confidence -> acceptance, for drafters that report confidence
        # an alternate's confidence -> the chance it is the target's token once its position is reached;
        # a draft's second probability is about what it says (prior b(conf) = conf)
        self.alternate_calibration = Calibration(prior_power=1.0)
        self.speculative = RatesByBatch()  # tokens per second per sequence that drafting steps delivered, per batch size
        # While speculation is off, what it delivered ages with every plain step, so the probes' fresh
        # evidence decides within a few probes (a slow stretch, e.g. a busy machine, is not held for ever).
        self.idle_fade = idle_fade
        # Token-tree alternates (draft_len="tree"): off by default, as on a CPU they did not pay (see README).
        self.alternates = alternates
        self.idle = False  # the last step was plain
        self.steps = 0
        self.last_rates: dict[int, float] = {}

    def fresh(self) -> "AdaptiveDraftLen":
        return AdaptiveDraftLen(**self._settings)

    def acceptance(self) -> torch.Tensor:
        """[max_draft_len] a_j: P(position j accepted | position j - 1 accepted)."""
        prior, weight = self.prior
        out = []
        for accepted, reached in zip(self.accepted.tolist(), self.reached.tolist()):
            prior = (accepted + weight * prior) / (reached + weight)
            out.append(prior)
        return torch.tensor(out)

    def expected_tokens_all(self) -> list[float]:
        """[E(0), ..., E(max_draft_len)], E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j."""
        expected, survive = [1.0], 1.0
        for a in self.acceptance().tolist():
            survive *= a
            expected.append(expected[-1] + survive)
        return expected

    def expected_tokens(self, k: int) -> float:
        return self.expected_tokens_all()[k]

    def predicted_rates(self, batch_size: int) -> dict[int, float]:
        """k -> predicted tokens per second per sequence, for every k we can price."""
        draft = self.draft_cost(batch_size) or 0.0
        expected = self.expected_tokens_all()
        rates = {}
        for k in range(self.max_draft_len + 1):
            target = self.target_cost(batch_size * (k + 1))
            if target is not None:
                rates[k] = expected[k] / (k * draft + target)
        return rates

    def choose(self, batch_size: int) -> int:
        self.steps += 1
        if self.draft_cost(batch_size) is None:
            return self.first_draft_len  # a guess from the prior, which also measures what drafting costs
        if self.calibration.seen:
            return self._choose_with_confidence(batch_size)
        if self.target_cost.count(batch_size) == 0:
            return 0  # and plain decoding at this batch size: what every k must beat
        self.last_rates = self.predicted_rates(batch_size)
        best = max(self.last_rates, key=self.last_rates.get)
        if self.steps % self.probe_every == 0:
            # Re-measure a neighbour of the best k (when not speculating, k = 1), so stale or unlucky
            # estimates can recover; the cost is at most one step at a near-optimal length.
            return min(best + 1, self.max_draft_len) if best == 0 or (self.steps // self.probe_every) % 2 else best - 1
        return best

    def _choose_with_confidence(self, batch_size: int) -> int:
        # The stop rule sets each row's length; what is left to decide is whether to draft at all,
        # from what speculative steps have actually delivered against a plain step's measured rate.
        # (Predicted rates would not do: a draft that stops before its shaky tokens makes the deep
        # positions it does reach look better than an unconditional k would fare.)
        # A few unlucky first steps are not evidence: stop drafting only on ~OPENING_STEPS steps' worth of it.
        if self.opening:
            return self.max_draft_len
        if self.target_cost.count(batch_size) == 0:
            return 0  # a plain step, measured once it is needed (until then the narrowest pass measured prices it)
        if not self.could_pay(batch_size):  # probing would only cost; rarely, in case the draft's cost has changed
            return self.max_draft_len if self.steps % (self.probe_every * UNPAYABLE_PROBE_SPACING) == 0 else 0
        delivered = self.speculative.rate(batch_size, self.target_cost)
        if delivered is None or delivered >= 1.0 / self.target_cost(batch_size):
            return self.max_draft_len
        return self.max_draft_len if self.steps % self.probe_every == 0 else 0  # now and then, check again

    @property
    def opening(self) -> bool:
        """The first ~OPENING_STEPS drafting steps of a drafter that reports its confidence: they draft up to
        max_draft_len whatever they show, with acceptance and costs still at their priors, so they may deliver far
        less than the steps after them. A drafter without confidence has no opening: its draft lengths follow the
        predicted rates from its second step on."""
        return self.speculative.steps < OPENING_STEPS and self.calibration.seen

    def could_pay(self, batch_size: int) -> bool:
        """Whether drafting could beat a plain step at this batch size even with every drafted token accepted,
        (k + 1) / (k * t_draft(b) + t_target(b * (k + 1))) for the best k, within PAYABLE_MARGIN. Where it could not
        (a draft pass nearly as dear as a plain step, and a wider pass dearer still: batch 16 on a CPU), a probe
        is a step lost. True while either cost is unmeasured."""
        draft, plain = self.draft_cost(batch_size), self.target_cost(batch_size)
        if draft is None or plain is None:
            return True
        best = max((k + 1) / (k * draft + self.target_cost(batch_size * (k + 1))) for k in range(1, self.max_draft_len + 1))
        return best * plain >= PAYABLE_MARGIN

    def stop_rule(self, batch_size: int) -> ConfidenceStop | None:
        if not self.calibration.seen:
            return None
        # R: the rate a token must beat, the better of what speculation delivers and a plain step.
        rate = max(self.speculative.rate(batch_size, self.target_cost) or 0.0, 1.0 / self.target_cost(batch_size))
        draft = self.draft_cost(batch_size) or 0.0
        # extra[w]: what one more row adds to a pass w rows wide, as the slope over two rows there
        # (single-row differences between noisy medians would be noise). Chain token i joins a pass of
        # i + 1 rows; alternates sit past the chain, up to twice as wide.
        cost = [self.target_cost(batch_size * width) for width in range(1, 2 * self.max_draft_len + 4)]
        extra = [float("inf")] + [max(0.0, (cost[w + 1] - cost[w - 1]) / 2) for w in range(1, 2 * self.max_draft_len + 2)]
        return ConfidenceStop(self.calibration, [rate * (draft + extra[i + 1]) for i in range(self.max_draft_len)],
                              self.alternate_calibration, [rate * e for e in extra])

    def branch_rule(self, stop: StopRule) -> BranchRule | None:
        return ConfidenceBranch(stop) if self.alternates and isinstance(stop, ConfidenceStop) else None

    def observe(self, step: StepRecord) -> None:
        batch_size, draft_len, width = step.batch_size, step.draft_len, step.width
        num_drafted, num_accepted, target_seconds = step.num_drafted, step.num_accepted, step.target_seconds
        # What drafting these tokens cost. A head's catch-up over the tokens decoded while it was off is left out:
        # counted here it would make every probe after a plain stretch look as dear as the stretch was long,
        # and a drafter switched off would stay off (it is ~1% of a plain step per token skipped, on a CPU).
        draft_seconds = step.draft_seconds - step.catch_up_seconds
        self.target_cost.observe(batch_size * (width + step.extra_rows), target_seconds)
        gained = num_accepted + 1
        if step.alternates is not None:  # how often an alternate of each draft probability is taken where reached
            outcome = step.alternates
            self.alternate_calibration.count(outcome.confidence, outcome.reached, outcome.accepted)
            gained = gained + outcome.taken
        if draft_len > 0:  # including a draft stopped before its first token: that cost a draft pass
            self.speculative.observe(batch_size, float(gained.float().mean()), draft_seconds + target_seconds)
            # Draft passes run: one per token kept, plus the one that judged the token a stop refused
            # (none past k). Counted even when every row stopped at its first token: otherwise a draft
            # cost measured on a slow stretch would make the stop refuse every token, and never be re-measured.
            if self.idle:  # a probe after plain steps: what drafting cost before then is stale
                self.draft_cost.forget(batch_size)
            self.draft_cost.observe(batch_size, draft_seconds / min(width, draft_len))
        else:
            self.speculative.fade(batch_size, self.idle_fade)
        self.idle = draft_len == 0
        if width <= 1:
            return  # nothing was drafted (k = 0, or every row stopped at once): no acceptance to learn
        if step.confidence is not None:
            self.calibration.observe(step.confidence[:, : width - 1], num_drafted, num_accepted)
        positions = torch.arange(1, width)
        # Position j counts for every row whose earlier positions were all accepted, drafted or not: a
        # row with no proposal there (an n-gram miss, an early stop) still rode the wider pass and
        # gained nothing from it, which is what E(k) must price.
        reached = num_accepted[:, None] >= positions - 1
        accepted = num_accepted[:, None] >= positions
        self.reached *= self.decay
        self.accepted *= self.decay
        self.reached[: width - 1] += reached.sum(0).float()
        self.accepted[: width - 1] += accepted.sum(0).float()


# Drafting steps the adaptive policy takes before what they delivered may turn drafting off (a decayed count).
OPENING_STEPS = 8

# What a draft model is assumed to make decoding at best when pricing its start: about what the Qwen pair
# delivers on code here, so a start is refused only where even a draft that good could not pay.
START_SPEEDUP = 2.0

# The most answer tokens a call of one row drafts by prompt lookup before its draft model starts (`start_after`).
# Measured (bench/README.md, 2026-11-27): a fixed wait of 32 protected Spec-Bench's 14-24-token answers (0.83-0.91x
# plain -> 1.00-1.07x) but cost HumanEval's code 10-20%, and a ski rental without history (a wait worth the prefill
# on every call) ~one prefill per call on code; hence a wait fitted to the answers the process sees.
START_AFTER = 32

# A call that started a draft model judges it once, after this many steps of one row past the policy's opening:
# where the tokens those steps gave per second fell short of plain steps (`costs.BOOK`), it drafts by prompt
# lookup for the rest.
RETREAT_STEPS = 16


def retreat_pays(tokens: int, seconds: float, step_seconds: float | None) -> bool:
    """Whether a call whose draft model gave `tokens` in `seconds` of steps (drafting and verifying) would
    have done better with plain steps of `step_seconds`, and so better still with prompt lookup, which
    drafts for nothing. Unmeasured plain steps (None) keep the draft model."""
    return step_seconds is not None and seconds > 0 and tokens / seconds < 1.0 / step_seconds


# The share of a call's new-token budget within which a draft's start must pay for itself. The budget is
# a ceiling, and the calls whose long prompts make a draft's prefill dear are the ones that answer briefly:
# Spec-Bench's RAG, extraction and QA prompts ended after 14-39 of 96 tokens, and there the 0.5B draft's
# prefill (a third of the 1.5B target's) made the Q4_0 pair 0.81-0.92x of plain where prompt lookup
# gave 1.0-1.05x (AMD Zen 5 and Intel Xeon, 2026-11-26).
START_SHARE = 0.25


def start_pays(startup_seconds: float | None, step_seconds: float | None, new_tokens: int,
               speedup: float = START_SPEEDUP, share: float = START_SHARE) -> bool:
    """Whether a drafter that must first spend `startup_seconds` (a draft model's prompt prefill) can win
    them back: decoding `share` of `new_tokens` at `speedup` saves share * new_tokens * step_seconds *
    (1 - 1 / speedup) against plain steps of `step_seconds`. new_tokens is the most the call may generate,
    so the saving is priced on a share of it. Unmeasured costs (None) start it, which measures them."""
    if startup_seconds is None or step_seconds is None:
        return True
    return startup_seconds <= share * new_tokens * step_seconds * max(0.0, 1.0 - 1.0 / speedup)


def start_after(startup_seconds: float | None, step_seconds: float | None, answers: list[int], most: int = START_AFTER,
                speedup: float = START_SPEEDUP) -> int:
    """How many answer tokens a call of one row drafts by prompt lookup before its draft model reads the prompt: the
    wait that would have paid best over the `answers` (token counts) this process has seen lately, an empirical ski
    rental. Waiting w tokens forgoes what the draft would have saved on them, ~step_seconds * (1 - 1 / speedup) a
    token, on every answer (min(L, w) tokens of one of L), and saves the draft's prefill (`startup_seconds`) on the
    answers that end within the wait. A workload of long answers (code) starts at once; one whose prompts are long
    and answers short (extraction, RAG, classification) waits out the answers it usually gets. No history,
    unmeasured costs (None) or `most` 0: at once, which measures them."""
    if startup_seconds is None or step_seconds is None or most <= 0 or not answers:
        return 0
    saved = step_seconds * max(0.0, 1.0 - 1.0 / speedup)  # per token, by a draft `speedup` times faster than plain
    best, best_gain = 0, 0.0
    for wait in range(1, most + 1):
        gain = sum((startup_seconds if length <= wait else 0.0) - saved * min(length, wait) for length in answers)
        if gain > best_gain:
            best, best_gain = wait, gain
    return best


def make_policy(draft_len: DraftLen | int | str | None) -> DraftPolicy:
    """A fresh policy for a draft length (anything `DraftLen.parse` takes): a fixed k, or the adaptive
    policy ("auto"), which with "tree" also places alternates (token-tree leaves) where they pay, on
    targets that verify trees."""
    draft_len = DraftLen.parse(draft_len)
    if draft_len.adaptive:
        return AdaptiveDraftLen(alternates=draft_len.alternates)
    return FixedDraftLen(draft_len.fixed)
