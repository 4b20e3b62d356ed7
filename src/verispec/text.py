"""Text around the engine: prompts to token ids, stop sequences, and incremental detokenization.

The engine works on token ids; everything that needs a tokenizer lives here.
"""

from __future__ import annotations

from typing import Sequence

from verispec.errors import VerispecError


def encode_prompt(tokenizer, prompt: str, *, chat: bool, system: str | None = None) -> list[int]:
    """Text -> token ids; with chat=True the text is one user turn in the model's chat template, after
    a system turn when `system` is given."""
    if tokenizer is None:
        raise VerispecError("this model has no tokenizer: pass token ids instead of text, or load it with a tokenizer")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise VerispecError("this tokenizer has no chat template: call with chat=False and format the prompt yourself")
        turns = [{"role": "system", "content": system}] if system is not None else []
        return encode_chat(tokenizer, turns + [{"role": "user", "content": prompt}])
    return list(tokenizer(prompt)["input_ids"])


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """OpenAI-style messages -> token ids through the tokenizer's chat template, ready for the assistant turn;
    tools (OpenAI's tool objects), if given, are rendered by the template too."""
    extra = {"tools": tools} if tools else {}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def turn_start_ids(tokenizer) -> frozenset[int]:
    """The token that opens every turn of the tokenizer's chat template (ChatML's `<|im_start|>`, Llama 3's
    `<|start_header_id|>`, Gemma's `<start_of_turn>`), as a one-id set: the first token an assistant turn
    adds to a rendered one-message conversation, when that is one of the tokenizer's added (control)
    tokens. Empty without a template, or where the template renders a conversation other than turn by turn.
    Prefill chunks end after it (`prefill.Chunking`), so a conversation's next turn finds its history."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return frozenset()
    turns = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}]
    try:
        one, two = ([int(i) for i in _ids(tokenizer.apply_chat_template(turns[:n], tokenize=True))] for n in (1, 2))
    except Exception:  # a template that wants other messages (tools, a system turn): no turn starts then
        return frozenset()
    if len(two) <= len(one) or two[: len(one)] != one:
        return frozenset()
    first = two[len(one)]
    return frozenset({first}) if first in set(tokenizer.get_added_vocab().values()) else frozenset()


def _ids(encoded):
    return encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded


def normalize_stop(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    stop = list(stop)
    if not all(isinstance(s, str) and s for s in stop):
        raise VerispecError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return stop


def find_stop(text: str, stop: list[str]) -> int | None:
    """Index where the earliest stop sequence starts in text, or None."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits) if hits else None


class StopSequences:
    """Callable for the engine: how many generated tokens to keep once a stop sequence appears in the text."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop

    def __call__(self, generated: list[int]) -> int | None:
        if find_stop(self.decode(generated), self.stop) is None:
            return None
        # Keep tokens up to and including the one that completes the stop sequence.
        for n in range(1, len(generated) + 1):
            if find_stop(self.decode(generated[:n]), self.stop) is not None:
                return n
        return len(generated)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


def final_text(tokenizer, generated: list[int], stop: list[str]) -> str:
    """The visible text of a finished sequence: special tokens dropped, cut before any stop sequence."""
    text = tokenizer.decode(generated, skip_special_tokens=True)
    cut = find_stop(text, stop)
    return text if cut is None else text[:cut]


class IncrementalText:
    """Turns a growing token list into text deltas safe to show: never half a UTF-8 character, never
    the start of what may become a stop sequence."""

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = stop or []
        self.tokens: list[int] = []
        self.sent = 0  # characters already handed out

    def push(self, new_tokens: list[int], finished: bool) -> str:
        self.tokens.extend(new_tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = find_stop(text, self.stop)
        if cut is not None:
            text, finished = text[:cut], True
        if not finished:
            if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
                text = text.rstrip("\ufffd")
            # Hold back a tail that could be the beginning of a stop sequence.
            for s in self.stop:
                for n in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:n]):
                        text = text[:-n]
                        break
        delta = text[self.sent :] if len(text) > self.sent else ""
        self.sent = max(self.sent, len(text))
        return delta
