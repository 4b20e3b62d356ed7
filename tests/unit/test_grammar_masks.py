"""The grammar layer alone (`verispec.grammar`), offline: a toy tokenizer over the tiny models' vocabulary.

What the engine relies on: the mask at each verify position is the one a fresh matcher gives after the same
tokens; positions behind a forbidden token or an EOS are left unmasked; the matcher ends where it began; and
bad response formats are a VerispecError that says what to fix.
"""

from __future__ import annotations

import pytest
import torch
from llguidance import LLTokenizer, TokenizerWrapper

from conftest import EOS, TOY_PIECES, VOCAB, _ToyTokenizer, toy_grammar, toy_ids
from verispec.errors import VerispecError
from verispec.grammar import mask_logits, response_format_grammar

GRAMMAR = ("regex", "(ab|ba)+c")
TOY_AB, TOY_BA = TOY_PIECES.index(b"ab"), TOY_PIECES.index(b"ba")  # two-character tokens


def fresh_mask(grammar, tokens: list[int]) -> torch.Tensor:
    """The reference: a new matcher fed these tokens, then asked once."""
    constraint = grammar.constraint()
    assert constraint.matcher.consume_tokens(tokens)
    return constraint.allowed([[]])[0]


def test_each_path_gets_the_mask_a_fresh_matcher_gives():
    grammar = toy_grammar(*GRAMMAR)
    constraint = grammar.constraint()
    constraint.advance(toy_ids("ab"))
    chain = toy_ids("baab")
    paths = [chain[:j] for j in range(len(chain) + 1)] + [toy_ids("c"), toy_ids("bac")]  # a chain, then alternates beside positions 0 and 2
    before = constraint.allowed([[]])[0]
    masks = constraint.allowed(paths)
    for path, mask in zip(paths, masks):
        expected = fresh_mask(grammar, toy_ids("ab") + path)
        assert mask is not None and torch.equal(mask, expected), path
    assert torch.equal(constraint.allowed([[]])[0], before)  # the matcher is back at the accepted tokens
    allowed = {i for i in range(VOCAB) if masks[0][i]}
    assert allowed == set(toy_ids("abc")) | {TOY_AB, TOY_BA}  # "ab" + a, b, ab, ba or c
    assert masks[-2].nonzero().squeeze(1).tolist() == [EOS]  # after "abc": complete, only EOS


def test_positions_behind_a_forbidden_token_or_eos_are_left_unmasked():
    grammar = toy_grammar(*GRAMMAR)
    constraint = grammar.constraint()
    chain = toy_ids("ac") + toy_ids("b")  # "a" then "c": forbidden (a must be followed by b)
    masks = constraint.allowed([chain[:j] for j in range(4)])
    assert masks[0] is not None and masks[1] is not None and masks[2] is None and masks[3] is None
    eos_chain = toy_ids("abc") + [EOS, toy_ids("a")[0]]
    masks = constraint.allowed([eos_chain[:j] for j in range(6)])
    assert [m is None for m in masks] == [False, False, False, False, True, True]
    assert not constraint.matcher.is_error()
    assert torch.equal(constraint.allowed([[]])[0], fresh_mask(grammar, []))


def test_advance_follows_accepted_tokens_and_ends_the_row_at_a_forbidden_one():
    grammar = toy_grammar(*GRAMMAR)
    constraint = grammar.constraint()
    constraint.advance(toy_ids("ab"))
    assert not constraint.finished
    assert constraint.advance(toy_ids("aa") + toy_ids("b")) == 2  # the second "a" is forbidden: the row ends there,
    assert constraint.finished and constraint.broken                # and the batch goes on
    done = grammar.constraint()
    assert done.advance(toy_ids("ba") + [TOY_AB] + toy_ids("c") + [EOS]) == 4  # complete at "c": the EOS after it is dropped
    assert done.finished and not done.broken
    open_ended = toy_grammar("regex", "[0-9]+").constraint()
    assert open_ended.advance(toy_ids("12") + [EOS, EOS]) == 3  # an EOS where the grammar may end is kept, and ends the row


def test_mask_logits_sets_forbidden_tokens_to_minus_infinity_only():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    keep[[4, 7]] = True
    out = mask_logits(logits.clone(), [keep, None, ~keep])
    assert torch.isinf(out[0]).sum() == VOCAB - 2 and torch.equal(out[0][keep], logits[0][keep])
    assert torch.equal(out[1], logits[1])
    assert torch.equal(out[2][~keep], logits[2][~keep]) and torch.isinf(out[2][keep]).all()


def test_a_json_schema_is_enforced_token_by_token():
    grammar = toy_grammar("json_schema", {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                                          "additionalProperties": False})
    constraint = grammar.constraint()
    constraint.advance(toy_ids('{"x":'))
    allowed = {TOY_PIECES[i] for i in constraint.allowed([[]])[0].nonzero().squeeze(1).tolist()}
    assert b"a" not in allowed and b'"' not in allowed and set(b"0123456789") <= {a[0] for a in allowed if len(a) == 1}
    constraint.advance(toy_ids("12}"))
    assert constraint.finished


@pytest.fixture(scope="module")
def tokenizer():
    return LLTokenizer(TokenizerWrapper(_ToyTokenizer()), n_vocab=VOCAB)


def parse(response_format, tokenizer):
    return response_format_grammar(response_format, tokenizer, VOCAB, {EOS})


def test_response_formats_of_each_kind(tokenizer):
    assert parse(None, tokenizer) is None and parse({"type": "text"}, tokenizer) is None
    for response_format in ({"type": "json_object"},
                            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array"}, "strict": True}},
                            {"type": "regex", "pattern": "[0-9]+"}, {"type": "lark", "grammar": 'start: "a" "b"'}):
        grammar = parse(response_format, tokenizer)
        assert not grammar.constraint().matcher.is_error(), response_format


@pytest.mark.parametrize("response_format, message", [
    ("json", "must be an object"),
    ({"type": "xml"}, "unknown response_format type"),
    ({"type": "json_schema"}, "needs \"json_schema\""),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}}, "must be a JSON schema object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}, "cannot be used"),
    ({"type": "regex", "pattern": "(ab"}, "regex of response_format cannot be used"),
    ({"type": "regex"}, "needs \"pattern\""),
    ({"type": "lark", "grammar": "start: undefined_rule"}, "Lark grammar of response_format cannot be used"),
], ids=str)
def test_bad_response_formats_say_what_to_fix(tokenizer, response_format, message):
    with pytest.raises(VerispecError, match=message):
        parse(response_format, tokenizer)
