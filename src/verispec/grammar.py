"""Grammar constraints (structured output): which tokens a grammar allows at each position, through `llguidance`.

Constrained decoding of the plain target masks its processed logits to the tokens the grammar allows
after the tokens so far, then picks or samples. Under speculation the verify pass scores several
positions at once, so each one is masked as plain decoding would mask it there: the matcher is walked
along the draft tokens before that position (`Constraint.allowed`), and then rolled back, since the
matcher follows only what the row has accepted (`Constraint.advance`). A draft token the grammar forbids
then has target probability zero and every exact rule rejects it. Positions after a forbidden draft token
cannot be reached and are left unmasked (never all -inf, which would give NaNs).

`Grammar` is a compiled grammar for one model's tokenizer, checked when it is made (a bad schema or
regex is a `VerispecError` before any decoding); each row gets its own `Constraint` from it.
A drafter without a model cuts its lookup draft at the first token the grammar forbids
(`Constraint.valid_prefix`), which only looks. `response_format` reads OpenAI's shapes. Knows nothing about models beyond their tokenizer and vocabulary.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from verispec.errors import VerispecError

# Most characters of a grammar or schema quoted back in an error.
SHOWN_CHARS = 200

_TOKENIZERS: dict[tuple, tuple] = {}  # (id(tokenizer), vocab, eos) -> (tokenizer, LLTokenizer): kept with the tokenizer
_TOKENIZERS_LOCK = threading.Lock()


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:  # a declared dependency; only a broken install lacks it
        raise VerispecError("structured output needs the llguidance package: pip install llguidance") from exc
    return llguidance


def ll_tokenizer(tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
    """llguidance's view of a Hugging Face fast tokenizer, over the model's whole logits width (ids past the
    tokenizer's are never allowed), with every stop token of the model as EOS. Built once per tokenizer
    (about 2 s for a 150k vocabulary) and kept."""
    eos = tuple(sorted(eos_token_ids))
    key = (id(tokenizer), vocab_size, eos)
    with _TOKENIZERS_LOCK:
        if key not in _TOKENIZERS:
            if tokenizer is None:
                raise VerispecError("structured output needs the model's tokenizer: load the model with one")
            from llguidance.hf import from_tokenizer

            try:
                built = from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos) or None)
            except Exception as exc:  # llguidance reads only fast (Rust) tokenizers; its errors have no common type
                raise VerispecError(f"structured output needs a fast (Rust) Hugging Face tokenizer: {str(exc)[:SHOWN_CHARS]}") from exc
            _TOKENIZERS[key] = (tokenizer, built)
        return _TOKENIZERS[key][1]


class Grammar:
    """A grammar compiled for one tokenizer. Checked now; `constraint()` gives each row its own matcher."""

    def __init__(self, tokenizer, grammar: str, vocab_size: int, eos_token_ids: Iterable[int], description: str = "grammar"):
        """tokenizer: an `llguidance.LLTokenizer` (`ll_tokenizer`), or anything `ll_tokenizer` takes alongside
        vocab_size and eos_token_ids. grammar: llguidance's grammar text (`LLMatcher.grammar_from_*`)."""
        llg = _llguidance()
        if not isinstance(tokenizer, llg.LLTokenizer):
            tokenizer = ll_tokenizer(tokenizer, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.description = description
        self._matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise VerispecError(f"the {description} cannot be used: {self._matcher.get_error()[:SHOWN_CHARS]}")

    def constraint(self) -> "Constraint":
        return Constraint(self._matcher.deep_copy(), self.vocab_size, self.eos_token_ids)


class Constraint:
    """One row's grammar state: the matcher has consumed exactly the row's accepted tokens."""

    def __init__(self, matcher, vocab_size: int, eos_token_ids: frozenset[int]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.broken = False  # a token the grammar forbids was accepted (see `advance`)

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing but EOS (or cannot go on): the row can stop."""
        return self.broken or self.matcher.is_stopped()

    def allowed(self, paths: Sequence[Sequence[int]]) -> list[torch.Tensor | None]:
        """Per position of a verify pass, the tokens the grammar allows after the row's tokens plus paths[c] (the
        draft tokens before position c): bool [vocab], or None where the path holds a token the grammar forbids
        or an EOS (the position cannot be reached, so any finite logits will do). The matcher ends as it began.

        Paths of a chain share prefixes ([], [d0], [d0, d1], ...): each step consumes one token and computes
        one mask; an alternate's path rolls back to where it branches."""
        consumed: list[int] = []  # tokens the matcher holds beyond the accepted ones
        masks: list[torch.Tensor | None] = []
        previous: list[int] = []
        try:
            for path in paths:
                path = list(path)
                common = 0
                while common < min(len(consumed), len(path)) and consumed[common] == path[common]:
                    common += 1
                if len(consumed) > common:
                    self.matcher.rollback(len(consumed) - common)
                    del consumed[common:]
                rest = path[common:]
                if masks and not rest and len(path) == len(previous):  # a padding position repeats the path before it
                    masks.append(masks[-1])
                    continue
                previous = path
                if any(t in self.eos_token_ids for t in rest):
                    masks.append(None)
                    continue
                taken = self.matcher.try_consume_tokens(rest) if rest else 0  # never enters the error state
                consumed += rest[:taken]
                masks.append(self._mask() if taken == len(rest) else None)
        finally:
            if consumed:
                self.matcher.rollback(len(consumed))
        return masks

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` (a draft after the row's accepted tokens) the grammar allows, an
        EOS counted where the grammar may end there. Only looks (llguidance's `validate_tokens`): the matcher
        is left as it was. A lookup drafter cuts its draft here, so no verify row scores a token the target's
        mask would reject anyway."""
        if not len(tokens) or self.finished:
            return 0
        return int(self.matcher.validate_tokens([int(t) for t in tokens]))

    def _mask(self) -> torch.Tensor:
        # numpy, not torch: these run once per verify position, and on a busy CPU torch's threaded reductions
        # over 150k entries cost milliseconds where numpy's single thread takes microseconds
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        mask = np.zeros(self.vocab_size, dtype=bool)
        width = min(len(bits), self.vocab_size)
        mask[:width] = bits[:width]
        if not mask.any():  # a matcher that can go no further (an internal limit): let the row end
            mask[sorted(t for t in self.eos_token_ids if t < self.vocab_size)] = True
        return torch.from_numpy(mask)

    def advance(self, tokens: Sequence[int]) -> int:
        """The row emitted these tokens: consume them, and return how many to keep. Tokens after the one that
        completes the grammar are dropped, so a row ends there whether or not its draft also carried the EOS that
        must follow (plain decoding stops at the same token). An EOS ends the row and is not consumed. The masks
        allow only tokens the matcher takes, so a refusal means llguidance disagreed with its own mask: the row
        then ends (`finished`) rather than failing the batch it decodes in."""
        for i, token in enumerate(tokens):
            if token in self.eos_token_ids:
                return i + 1
            if self.matcher.try_consume_tokens([token]) != 1:
                self.broken = True
                return i + 1
            if self.matcher.is_stopped():
                return i + 1
        return len(tokens)

def mask_logits(logits: torch.Tensor, allowed: list[torch.Tensor | None]) -> torch.Tensor:
    """logits [w, V] (float32, changed in place and returned): -inf where position c's mask forbids a token."""
    for c, mask in enumerate(allowed):
        if mask is None:
            continue
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits[c].is_contiguous():
            row, keep = logits[c].numpy(), mask.numpy()  # single-threaded numpy, see Constraint._mask
            allowed_ids = np.flatnonzero(keep)
            if len(allowed_ids) < len(row) // 8:  # a structural position: few tokens allowed, no vocabulary-wide temporary
                kept = row[allowed_ids]
                row.fill(-np.inf)
                row[allowed_ids] = kept
            else:
                np.putmask(row, ~keep, -np.inf)
        else:
            logits[c].masked_fill_(~mask.to(logits.device), float("-inf"))
    return logits


# --- response formats --------------------------------------------------------------------------------

RESPONSE_FORMATS = ("text", "json_object", "json_schema", "regex", "lark")


def response_format_grammar(response_format: Any, tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> Grammar | None:
    """OpenAI's response_format -> a Grammar, or None for plain text. Shapes: {"type": "text"},
    {"type": "json_object"} (any JSON object), {"type": "json_schema", "json_schema": {"name", "schema",
    "strict", "description"}} (JSON following the schema; strict or not, it is enforced), and verispec's own
    {"type": "regex", "pattern": ...} and {"type": "lark", "grammar": ...} (llguidance's Lark dialect).
    Raises VerispecError with what to fix."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise VerispecError('response_format must be an object with a "type": one of ' + ", ".join(RESPONSE_FORMATS))
    kind = response_format["type"]
    llg = _llguidance()
    make = lambda grammar, description: Grammar(tokenizer, grammar, vocab_size, eos_token_ids, description)  # noqa: E731
    if kind == "text":
        return None
    if kind == "json_object":
        return make(llg.LLMatcher.grammar_from_json_schema({"type": "object"}), "json_object response format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise VerispecError('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}')
        schema = spec.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise VerispecError(f"response_format json_schema.schema must be a JSON schema object, got {type(schema).__name__}")
        return make(json_schema_grammar(schema), "JSON schema of response_format")
    if kind == "regex":
        pattern = response_format.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise VerispecError('response_format regex needs "pattern": a regular expression (Rust regex syntax)')
        return make(llg.LLMatcher.grammar_from_regex(pattern), "regex of response_format")
    if kind == "lark":
        lark = response_format.get("grammar")
        if not isinstance(lark, str) or not lark:
            raise VerispecError('response_format lark needs "grammar": a Lark grammar with a start rule')
        return make(llg.LLMatcher.grammar_from_lark(lark), "Lark grammar of response_format")
    raise VerispecError(f"unknown response_format type {kind[:40]!r}: use one of {', '.join(RESPONSE_FORMATS)}")


def json_schema_grammar(schema: dict | bool) -> str:
    """A JSON schema -> llguidance grammar text; an unparseable schema is a VerispecError (an invalid one is
    refused when the Grammar compiles it)."""
    try:
        return _llguidance().LLMatcher.grammar_from_json_schema(schema if not isinstance(schema, bool) else json.dumps(schema))
    except (ValueError, TypeError) as exc:
        raise VerispecError(f"the JSON schema cannot be read: {str(exc)[:SHOWN_CHARS]}") from exc
