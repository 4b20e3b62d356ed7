"""Sampling settings and the pure functions that turn logits into the distribution a token is drawn from.

Two stages, in vLLM's order. `process_logits` applies what depends on the sequence so far: logit_bias,
min_tokens, then the repetition, frequency and presence penalties. `warp` then applies temperature,
min_p, top-k and top-p. Plain decoding and every verification rule see the same processed logits and
call `warp` with the same settings, so speculative sampling compares against exactly the distribution
plain decoding would sample from. For that, the logits at draft position j are processed with the
history plain decoding would have had there: prompt + generated + the draft's first j tokens
(`process_logits`' `paths`). Knows nothing about models or caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from verispec.errors import VerispecError


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: int | None = None
    # Gumbel-max coupling (see `coupled_choice`): each sampled token is a function of (seed, position, p)
    # alone, so a seeded request gets the same tokens from any drafter, draft length or batch, plain
    # decoding included. Exact like speculative sampling, with somewhat fewer draft tokens accepted.
    coupled: bool = False
    # Speculative sampling judges each draft as a block (`BlockVerifier`, Sun et al. 2025): exact, and
    # never fewer tokens accepted in expectation than token by token; False keeps the token-by-token rule.
    blockwise: bool = True
    # Typical acceptance (`TypicalVerifier`, Medusa): keep a draft token while the target gives it more than
    # min(eps, sqrt(eps) * exp(-entropy)). LOSSY: the text is typical of the target, not a sample of its
    # distribution. 0 (the default) keeps sampling exact; Medusa's suggested eps is 0.09.
    typical_acceptance: float = 0.0
    # A speculative cascade (`CascadeVerifier`, Narasimhan et al. 2025): where the deferral rule trusts the
    # draft, its token stands without the target's check. LOSSY, greedy rows included. Given as a `Cascade`,
    # {"rule": "chow"|"diff", "alpha": number} or "rule:alpha"; None (the default) keeps decoding exact.
    cascade: "Cascade | Mapping | str | None" = None
    # OpenAI's penalties, over the tokens generated so far: logit -= frequency_penalty * count + presence_penalty * (count > 0).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # HF/vLLM's, over prompt and generated tokens: a seen token's logit is divided by it if positive, multiplied if not. 1: off.
    repetition_penalty: float = 1.0
    # After temperature, drop tokens less likely than min_p times the most likely one (vLLM, HF). 0: off.
    min_p: float = 0.0
    # Token id -> a number added to its logit, as OpenAI's logit_bias (-100 bans a token, 100 all but forces it).
    # Given as a dict or pairs; kept as sorted (id, bias) pairs, so the settings stay hashable.
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    # The stop tokens (EOS) are impossible until this many tokens have been generated (stop strings still stop).
    min_tokens: int = 0

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise VerispecError(f"temperature must be a number >= 0 (0 means greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise VerispecError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise VerispecError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise VerispecError(f"seed must be an integer or None, got {self.seed!r}")
        if not isinstance(self.coupled, bool):
            raise VerispecError(f"coupled must be true or false, got {self.coupled!r}")
        if not isinstance(self.blockwise, bool):
            raise VerispecError(f"blockwise must be true or false, got {self.blockwise!r}")
        if (not isinstance(self.typical_acceptance, (int, float)) or isinstance(self.typical_acceptance, bool)
                or not 0.0 <= self.typical_acceptance < 1.0):
            raise VerispecError(f"typical_acceptance must be in [0, 1) (0 keeps sampling exact; e.g. 0.09), got {self.typical_acceptance!r}")
        if self.typical_acceptance and self.coupled:
            raise VerispecError("typical_acceptance is lossy and coupled=True promises plain sampling's tokens: choose one")
        object.__setattr__(self, "cascade", Cascade.parse(self.cascade))
        if self.cascade is not None and self.coupled:
            raise VerispecError("cascade is lossy and coupled=True promises plain sampling's tokens: choose one")
        if self.cascade is not None and self.typical_acceptance:
            raise VerispecError("cascade and typical_acceptance are two lossy rules for the same tokens: choose one")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise VerispecError(f"{name} must be a number in [-2, 2] (0 turns it off), got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise VerispecError(f"repetition_penalty must be in (0, 10] (1 turns it off; e.g. 1.1), got {self.repetition_penalty!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise VerispecError(f"min_p must be in [0, 1] (0 turns it off; e.g. 0.05), got {self.min_p!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise VerispecError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))

    @property
    def uses_history(self) -> bool:
        """Whether the logits at a position depend on the tokens before it (penalties, min_tokens)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or self.min_tokens > 0)

    @property
    def processes_logits(self) -> bool:
        """Whether `process_logits` changes anything for these settings."""
        return self.uses_history or bool(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def lossy(self) -> bool:
        """Whether this row's draft tokens are judged by a lossy rule it asked for: typical acceptance on a
        sampled row, or a speculative cascade that can trust the draft (any row)."""
        return (self.typical_acceptance > 0 and not self.greedy) or (self.cascade is not None and not self.cascade.exact)


CASCADE_RULES = ("chow", "diff")


@dataclass(frozen=True)
class Cascade:
    """A speculative cascade's deferral rule (Narasimhan et al., "Faster Cascades via Speculative Decoding",
    ICLR 2025): at each draft position it decides whether the draft model is good enough there, from the
    draft's top probability max q and (for "diff") the target's max p.

    chow: trust the draft where max q > 1 - alpha (Chow's rule), alpha in [0, 1].
    diff: trust the draft where max q > max p - alpha (the paper's Diff rule), alpha in [-1, 1].

    Larger alpha trusts the draft more (alpha = 1 always: the draft's own text). The other end never
    trusts it (chow 0, diff -1: `exact`), and the cascade is then exact speculative decoding. Checked
    here; `verifiers.cascade` applies it."""

    rule: str = "chow"
    alpha: float = 0.1

    def __post_init__(self):
        if self.rule not in CASCADE_RULES:
            raise VerispecError(f"cascade rule must be one of {', '.join(CASCADE_RULES)}, got {self.rule!r}")
        low = 0.0 if self.rule == "chow" else -1.0
        if not _is_number(self.alpha) or not low <= self.alpha <= 1.0:
            raise VerispecError(f"cascade alpha for the {self.rule} rule must be a number in [{low:g}, 1] "
                                f"({low:g} keeps decoding exact, larger trusts the draft more; e.g. 0.1), got {self.alpha!r}")

    @classmethod
    def parse(cls, value) -> "Cascade | None":
        """A Cascade from what a user gave: None, a Cascade, {"rule": ..., "alpha": ...} (rule defaults to
        "chow") or the text "rule:alpha" (e.g. "chow:0.1"). Raises VerispecError otherwise."""
        if value is None or isinstance(value, Cascade):
            return value
        if isinstance(value, Mapping):
            unknown = set(value) - {"rule", "alpha"}
            if unknown or "alpha" not in value:
                raise VerispecError(f'cascade must be {{"rule": "chow"|"diff", "alpha": number}}, got {value!r:.80}')
            return cls(value.get("rule", "chow"), value["alpha"])
        if isinstance(value, str):
            rule, _, alpha = value.partition(":")
            try:
                number = float(alpha)
            except ValueError:
                pass
            else:
                return cls(rule.strip(), number)
        raise VerispecError(f'cascade must be "rule:alpha" (e.g. "chow:0.1"), {{"rule": ..., "alpha": ...}} or None, got {value!r:.80}')

    @property
    def exact(self) -> bool:
        """Whether this setting never trusts the draft (so decoding stays exact)."""
        return self.alpha == (0.0 if self.rule == "chow" else -1.0)

    def __str__(self) -> str:
        return f"{self.rule}:{self.alpha:g}"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """logit_bias as a dict {token id: bias} or (id, bias) pairs -> sorted pairs; raises VerispecError."""
    items = bias.items() if isinstance(bias, Mapping) else bias
    try:
        pairs = [(token, value) for token, value in items]
    except (TypeError, ValueError):
        raise VerispecError(f"logit_bias must map token ids to numbers, e.g. {{50256: -100}}, got {bias!r:.80}") from None
    for token, value in pairs:
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise VerispecError(f"logit_bias keys must be token ids (integers >= 0), got {token!r:.40}")
        if not _is_number(value) or not -100.0 <= value <= 100.0:
            raise VerispecError(f"logit_bias values must be numbers in [-100, 100], got {value!r:.40} for token {token}")
    if len({token for token, _ in pairs}) != len(pairs):
        raise VerispecError("logit_bias names a token id twice: give each token one bias")
    return tuple(sorted((token, float(value)) for token, value in pairs))


def default_coupled(seed: int | None, temperature: float, typical_acceptance: float = 0.0,
                    cascade: Cascade | None = None) -> bool:
    """What `coupled` defaults to in the API and the server: on for a seeded sampled request (its text is
    then a function of the seed, whatever the draft lengths, timing or batch mates), except for rows that
    asked for a lossy rule (typical acceptance, a cascade). The price: a coupled draft token is accepted with chance at
    least (1 - TV) / (1 + TV) where speculative sampling accepts with 1 - TV (TV the total variation
    distance between draft and target), so unseeded requests keep the faster rules."""
    return seed is not None and temperature > 0 and not typical_acceptance and cascade is None


def process_logits(logits: torch.Tensor, params: SamplingParams, sequence: Sequence[int], prompt_len: int,
                   paths: Sequence[Sequence[int]] | None = None, stop_token_ids: Iterable[int] = ()) -> torch.Tensor:
    """The logits plain decoding samples from, before `warp`: logit_bias, the min_tokens ban on stop tokens,
    then the repetition, frequency and presence penalties (vLLM's order).

    logits [w, V]: w positions scored in one pass; position c continues sequence + paths[c] (sequence =
    prompt (its first prompt_len tokens) + generated; paths[c] the draft tokens before position c, so
    the verify pass of a chain has paths [], [d0], [d0, d1], ...). paths None: every position continues
    `sequence` itself. -> [w, V] float32, a new tensor; row c is exactly what one plain step after
    sequence + paths[c] computes from the same logits (the same elementwise operations).
    """
    out = logits.to(torch.float32, copy=True)
    width, vocab = out.shape
    paths = [()] * width if paths is None else paths
    if params.logit_bias:
        ids = torch.tensor([token for token, _ in params.logit_bias], device=out.device)
        out[:, ids] += torch.tensor([bias for _, bias in params.logit_bias], device=out.device)
    if params.min_tokens:
        generated = len(sequence) - prompt_len
        early = [c for c in range(width) if generated + len(paths[c]) < params.min_tokens]
        stops = sorted(t for t in stop_token_ids if t < vocab)
        if early and stops:
            out[torch.tensor(early, device=out.device)[:, None], torch.tensor(stops, device=out.device)[None, :]] = float("-inf")
    if params.repetition_penalty == 1 and params.frequency_penalty == 0 and params.presence_penalty == 0:
        return out
    # Only tokens of the history or a path can be penalized: work on those T columns, not the vocabulary.
    device = out.device
    history = torch.tensor(list(sequence), dtype=torch.long, device=device)
    path_tokens = torch.tensor([t for path in paths for t in path], dtype=torch.long, device=device)
    touched = torch.unique(torch.cat([history, path_tokens]))  # [T] sorted
    where = lambda tokens: torch.searchsorted(touched, tokens)  # noqa: E731  token ids -> their columns among T
    # Each position's history: the row's own counts, plus its path of draft tokens.
    on_path = torch.zeros(width, len(touched), device=device)
    rows = torch.tensor([c for c, path in enumerate(paths) for _ in path], dtype=torch.long, device=device)
    on_path.index_put_((rows, where(path_tokens)), torch.ones(len(rows), device=device), accumulate=True)
    logits_t = out[:, touched]  # [w, T]
    if params.repetition_penalty != 1:
        in_sequence = torch.zeros(len(touched), dtype=torch.bool, device=device)
        in_sequence[where(history)] = True
        seen = in_sequence[None, :] | (on_path > 0)
        penalized = torch.where(logits_t > 0, logits_t / params.repetition_penalty, logits_t * params.repetition_penalty)
        logits_t = torch.where(seen, penalized, logits_t)
    if params.frequency_penalty != 0 or params.presence_penalty != 0:
        counts = torch.bincount(where(history[prompt_len:]), minlength=len(touched)).float()[None, :] + on_path
        logits_t = logits_t - (params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float())
    out[:, touched] = logits_t
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1): each row's first maximum (a NaN counting as the maximum, as PyTorch's). A float32
    CPU tensor goes through numpy, whose vectorized scan of a row of Qwen's 152k logits takes ~0.02 ms where
    PyTorch 2.13's CPU argmax takes ~0.4 (an Intel Xeon), and a decode step takes one per row the target
    scores and per token a draft model drafts."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return logits.argmax(-1)
    return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(-1)))


# Logits this far below the row's maximum add exp(-80) ~ 2e-35 each to a sum that is at least 1: nothing at
# float32 precision. Clamping there first keeps exp off the -inf entries a restricted draft head leaves (most of
# a 152k row), on which PyTorch's CPU exp is ~10x slower than on finite numbers.
_NEGLIGIBLE = -80.0


def greedy_choice(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax [..], its softmax probability [..]) over the last dimension: a greedy draft token and the
    confidence the stop rules read. The probability is exp(max - logsumexp) as 1 / sum(exp(x - max)), which
    costs ~0.1 ms on a 152k row where PyTorch's max-with-indices and logsumexp took ~1 ms."""
    peak = logits.amax(-1, keepdim=True)
    return argmax(logits), (logits - peak).clamp_(min=_NEGLIGIBLE).exp_().sum(-1).reciprocal_()


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, min_p, top-k and top-p (vLLM's order), over the last dimension.

    logits: [..., V] (any float dtype; already through `process_logits`) -> probs: [..., V] float32, rows
    sum to 1. Greedy settings give a one-hot of the argmax, so the same code path verifies greedy drafts.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.min_p > 0:
        # p(x) < min_p * max p  <=>  logit(x) < max logit + log(min_p): no softmax needed
        cut = logits.max(-1, keepdim=True).values + torch.log(torch.tensor(params.min_p))
        logits = logits.masked_fill(logits < cut, float("-inf"))
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        return _nucleus(logits, params.top_p)
    return logits.softmax(-1)


# Where `_nucleus` first looks for a row's nucleus on a CPU: the tokens of at least this probability (at most 1 / this
# many); a row whose mass there falls short of top_p looks again 100-fold lower.
_NUCLEUS_FLOOR = 1e-4


def _nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """softmax(logits [..., V]) kept to each row's nucleus and renormalized: the smallest set of most likely
    tokens whose mass reaches top_p (Holtzman et al. 2020), the token that crosses it kept (so one always is).

    The nucleus is a prefix of the tokens sorted by probability, so it lies within any set {p >= t} whose mass
    reaches top_p. On a CPU each row sorts only such a set (numpy's vectorized sort), not its whole vocabulary,
    and exponentiates only the nucleus: PyTorch sorts a 152k-token row in ~15 ms there, more than a decode
    step's other work together. The order of equal logits is the sort's (deterministic: the same logits give
    the same nucleus)."""
    probs = logits.softmax(-1)
    if logits.device.type != "cpu":
        order = torch.sort(logits, dim=-1, descending=True).indices
        chosen = probs.gather(-1, order)
        drop = torch.zeros_like(chosen, dtype=torch.bool).scatter(-1, order, chosen.cumsum(-1) - chosen >= top_p)
        return logits.masked_fill(drop, float("-inf")).softmax(-1)
    width = logits.shape[-1]
    z_rows = logits.detach().reshape(-1, width).numpy()
    p_rows = probs.detach().reshape(-1, width).numpy()
    out = np.zeros(p_rows.shape, dtype=np.float32)
    for row, (z, p) in enumerate(zip(z_rows, p_rows)):
        floor, possible = _NUCLEUS_FLOOR, np.count_nonzero(p)
        while True:
            ids = np.flatnonzero(p >= floor) if floor > 0 else np.arange(width)
            order = ids[np.argsort(-z[ids])]
            mass = np.cumsum(p[order], dtype=np.float64)
            # done once the set holds top_p, or every token of nonzero probability (a float32 row can sum below it)
            if floor == 0 or (len(mass) and mass[-1] >= top_p) or len(ids) >= possible:
                break
            floor = floor / 100 if floor > 1e-30 else 0.0
        kept = order[mass - p[order] < top_p]
        out[row, kept] = torch.from_numpy(z[kept]).softmax(-1).numpy()
    return torch.from_numpy(out).view(logits.shape)


def warp_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Like `warp`, with settings per row: logits [batch, ..., V], params [batch] -> probs [batch, ..., V]."""
    if all(p == params[0] for p in params):
        return warp(logits, params[0])
    return torch.stack([warp(logits[b], p) for b, p in enumerate(params)])


@dataclass
class TokenLogprob:
    """One emitted token's log-probability under the target, and the most likely tokens at its position."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """log-softmax of logits [n, V] at tokens [n], with each position's `top` most likely tokens (those of
    probability zero left out: a grammar's processed logits may allow fewer than `top`, and -inf is not JSON)."""
    logprobs = torch.log_softmax(logits.float(), -1)
    chosen = logprobs.gather(1, torch.tensor(list(tokens), device=logprobs.device)[:, None]).squeeze(1).tolist()
    best = logprobs.topk(top, -1) if top else None
    return [TokenLogprob(token, value, [(t, v) for t, v in zip(best.indices[i].tolist(), best.values[i].tolist()) if v > float("-inf")]
                         if best is not None else [])
            for i, (token, value) in enumerate(zip(tokens, chosen))]


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    """A random stream for one sequence: seeded from params.seed, else from fresh entropy."""
    g = torch.Generator(device=device)
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed)
    return g


def make_generators(params: SamplingParams, batch_size: int, device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One random stream per sequence: row b uses seed + b, so a row's samples do not depend on its batch mates."""
    generators = []
    for row in range(batch_size):
        g = torch.Generator(device=device)
        if params.seed is None:
            g.seed()
        else:
            g.manual_seed(params.seed + row)
        generators.append(g)
    return generators


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """Draw one token id from probs [V] (sums to 1, or any non-negative weights).

    Inverse-CDF sampling with one uniform draw: a float64 running sum and a binary search. Exact up
    to float64 rounding, and ~100x faster than `torch.multinomial` over a 150k-token vocabulary on a
    CPU (which matters: a sampled draft draws k tokens per step). A token of probability zero is never
    drawn: the search returns the first index whose running sum exceeds the draw.
    """
    cdf = probs.to(torch.float64).cumsum(-1)
    u = torch.rand((1,), generator=generator, dtype=torch.float64, device=probs.device) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp(max=probs.shape[-1] - 1))



# --- Gumbel-max coupling -------------------------------------------------------------------------

_M32 = 0xFFFFFFFF
# Tokens below this probability race as one aggregate "tail" entry (exactly: see `coupled_choice`), so
# a 152k-token vocabulary costs a few hundred noise values per position instead of 152k.
COUPLING_HEAD_MIN = 1e-6


def _fmix32(x):
    """murmur3's 32-bit finalizer, on a Python int or an int64 tensor holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def _position_key(seed: int, position: int) -> int:
    return _fmix32(_fmix32(_fmix32(seed & _M32) ^ ((seed >> 32) & _M32)) ^ (position & _M32))


def coupling_noise(seed: int, position: int, tokens: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise [n] float64 for token ids `tokens` [n] at one position: a function of (seed, position,
    token id) only, so two distributions that rank the same tokens see the same noise for them."""
    h = _fmix32(_fmix32((tokens.to(torch.int64) ^ _position_key(seed, position)) & _M32) ^ 0x5BD1E995)
    u = (h.to(torch.float64) + 0.5) / 4294967296.0  # in (0, 1)
    return -torch.log(u)


def coupled_choice(probs: torch.Tensor, seed: int, position: int) -> int:
    """A draw from probs [V] by the Gumbel-max trick in exponential form: argmax_x probs[x] / E[x] with
    E[x] ~ Exp(1) iid is token x with probability probs[x] (the exponential race; Gumbel 1954).

    The noise depends on (seed, position, token) only. A draft that draws its token at a position from
    q with the same noise agrees with the target's draw there as often as the noise lets both pick the
    same token (at least (1 - TV) / (1 + TV): Daliri et al. 2024, "Coupling without communication and
    drafter-invariant speculative decoding"), and the target's token is the one plain sampling with this
    seed picks, whatever was drafted. A token of probability zero is never drawn.

    Tokens below COUPLING_HEAD_MIN race as one entry of their total mass T: the fastest of them arrives
    at min E[x] / p[x], which is Exp(1) / T, and which of them it is follows p restricted to them, apart
    from when it arrives; so the aggregate gets noise of its own and, if it wins, a second draw picks the
    token. The result is still exactly distributed as probs.
    """
    # numpy's (the vocabulary-wide steps; PyTorch's CPU nonzero and masked_fill cost ~1 ms a 152k row)
    p = probs.detach().to(torch.float64).cpu().numpy()
    in_head = p >= COUPLING_HEAD_MIN
    head = np.flatnonzero(in_head)
    rest = np.where(in_head, 0.0, p)  # the tail's probabilities (0 in the head)
    tail = float(rest.sum())
    vocab = p.shape[-1]
    scores = torch.from_numpy(p[head]) / coupling_noise(seed, position, torch.from_numpy(head))
    best = int(scores.argmax()) if len(head) else -1
    if tail > 0:
        tail_score = tail / float(coupling_noise(seed, position, torch.tensor([vocab]))[0])
        if best < 0 or tail_score > float(scores[best]):
            cdf = torch.from_numpy(rest.cumsum(0))
            u = torch.exp(-coupling_noise(seed, position, torch.tensor([vocab + 1])))  # back to a uniform in (0, 1)
            return int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=vocab - 1))
    return int(head[best])
