"""Sampling settings and the pure functions that turn logits into the distribution a token is drawn from.

Plain sampling and every verification rule call `warp` with the same settings, so speculative
sampling compares against exactly the distribution plain decoding would sample from. Knows nothing
about models, caches or drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def lossy(self) -> bool:
        """Whether this row's draft tokens are judged by a lossy rule (typical acceptance on a sampled row)."""
        return self.typical_acceptance > 0 and not self.greedy


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, over the last dimension.

    logits: [..., V] (any float dtype) -> probs: [..., V] float32, rows sum to 1.
    Greedy settings give a one-hot of the argmax, so the same code path verifies greedy drafts.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p (Holtzman et al. 2020);
        # the token that crosses the threshold is kept, so at least one token always survives.
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def warp_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Like `warp`, with settings per row: logits [batch, ..., V], params [batch] -> probs [batch, ..., V]."""
    if all(p == params[0] for p in params):
        return warp(logits, params[0])
    return torch.stack([warp(logits[b], p) for b, p in enumerate(params)])


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
    p = probs.to(torch.float64)
    in_head = p >= COUPLING_HEAD_MIN
    head = in_head.nonzero().squeeze(1)
    rest = p.masked_fill(in_head, 0.0)  # the tail's probabilities (0 in the head)
    tail = float(rest.sum())
    vocab = p.shape[-1]
    scores = p[head] / coupling_noise(seed, position, head)
    best = int(scores.argmax()) if len(head) else -1
    if tail > 0:
        tail_score = tail / float(coupling_noise(seed, position, torch.tensor([vocab]))[0])
        if best < 0 or tail_score > float(scores[best]):
            cdf = rest.cumsum(0)
            u = torch.exp(-coupling_noise(seed, position, torch.tensor([vocab + 1])))  # back to a uniform in (0, 1)
            return int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=vocab - 1))
    return int(head[best])
