"""The options a user sets, each read and checked in one place.

The Python API, the CLI, the server and `verispec bench` all parse `draft_len`, `max_new_tokens` and
drafter names through here, so an option means the same everywhere and a bad value fails the same way
(a `VerispecError` that says what to give instead), before any model is loaded. Sampling values are
checked where they live, by `SamplingParams`. Knows nothing about models, drafters or decoding: only
names and numbers.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Callable, TypeVar

from verispec.errors import VerispecError

T = TypeVar("T")

# The drafter names `verispec.generate(drafter=...)` takes: "auto" picks one of the others (see
# `api.resolve_drafter`), each other name is a row of `api.DRAFTERS`.
DRAFTER_NAMES = ("auto", "model", "cross_tokenizer", "self", "hybrid", "staged", "ngram", "suffix", "rest", "eagle3", "medusa",
                 "mtp", "head+suffix", "none")

# A draft model's matrices on the native backend (`verispec.load(weight_dtype=...)`).
WEIGHT_DTYPES = ("fp32", "bf16", "int8", "int4", "q4_0", "q3_0")


@dataclass(frozen=True)
class DraftLen:
    """How many tokens to draft each step: a fixed `k` >= 1, "auto" (adaptive: chosen each step from
    measured acceptance and costs) or "tree" (adaptive, plus token-tree alternates where they pay).
    Build it with `DraftLen.parse`; `policy.make_policy` turns it into the policy that decides."""

    setting: int | str

    ADAPTIVE = ("auto", "tree")

    @classmethod
    def parse(cls, value: "DraftLen | int | str | None", most: int | None = None) -> "DraftLen":
        """A DraftLen from what a user gave: an int >= 1 (at most `most`, when given), "auto", "tree", None
        (= "auto") or a DraftLen. Raises VerispecError otherwise."""
        if isinstance(value, DraftLen):
            value = value.setting
        if value is None:
            return cls("auto")
        if value in cls.ADAPTIVE:
            return cls(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (most is not None and value > most):
            bound = ">= 1" if most is None else f"1-{most}"
            raise VerispecError(f"draft_len must be an integer {bound}, 'auto' or 'tree', got {value!r}")
        return cls(value)

    @property
    def adaptive(self) -> bool:
        return self.setting in self.ADAPTIVE

    @property
    def alternates(self) -> bool:
        """Whether the policy places token-tree alternates ("tree")."""
        return self.setting == "tree"

    @property
    def fixed(self) -> int | None:
        """k for a fixed draft length, None for an adaptive one."""
        return None if self.adaptive else self.setting

    def __str__(self) -> str:
        return str(self.setting)


def positive_int(name: str, value) -> int:
    """`value` if it is an int >= 1 (not a bool), else a VerispecError naming the option `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise VerispecError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def max_new_tokens(value) -> int:
    """The most tokens to generate per prompt: an int >= 1."""
    return positive_int("max_new_tokens", value)


def draft_vocab(value) -> int | str | None:
    """How many token ids a draft model's LM head scores (`api.load_draft`): "auto", "all" (or None: the whole
    head) or an int >= 1 (the first that many, the special tokens and the text's own)."""
    if value is None or value == "all":
        return None
    if value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise VerispecError(f"draft_vocab must be 'auto', 'all' or an integer >= 1, got {value!r}")
    return value


def drafter_name(value) -> str:
    """One of `DRAFTER_NAMES`."""
    if value not in DRAFTER_NAMES:
        raise VerispecError(f"unknown drafter {value!r}: use one of {', '.join(DRAFTER_NAMES)}")
    return value


def flag(parse: Callable[[object], T]) -> Callable[[str], T]:
    """An argparse `type=` that parses a flag's text with `parse`, the text of an integer as that integer:
    parse's VerispecError becomes argparse's usage error (exit status 2, the message as written), so a bad
    flag fails before anything loads."""
    def parse_flag(text: str) -> T:
        try:
            return parse(int(text) if re.fullmatch(r"\s*[-+]?\d+\s*", text) else text)
        except VerispecError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse_flag.__name__ = parse.__name__
    return parse_flag
