"""Options are parsed in one place (`verispec.options`), and models and drafters declare what they can do."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import verispec
from verispec import VerispecError, options
from verispec.options import DraftLen


@pytest.mark.parametrize("given, setting", [(3, 3), ("auto", "auto"), ("tree", "tree"), (None, "auto"), (DraftLen(5), 5)])
def test_draft_len_parses_what_users_give(given, setting):
    assert DraftLen.parse(given) == DraftLen(setting)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "four", "", "4", True, [4]])
def test_draft_len_refuses_the_rest(bad):
    with pytest.raises(VerispecError, match="draft_len must be an integer >= 1, 'auto' or 'tree'"):
        DraftLen.parse(bad)


def test_draft_len_bound_and_meaning():
    assert DraftLen.parse(16, most=16).fixed == 16
    with pytest.raises(VerispecError, match="1-16"):
        DraftLen.parse(17, most=16)
    assert DraftLen.parse("tree").adaptive and DraftLen.parse("tree").alternates and DraftLen.parse("tree").fixed is None
    assert not DraftLen.parse(4).adaptive and str(DraftLen.parse(4)) == "4"
    assert len({DraftLen.parse(4), DraftLen.parse(DraftLen(4)), DraftLen(4)}) == 1  # a server lane's key


def test_make_policy_follows_the_parse():
    from verispec.policy import AdaptiveDraftLen, FixedDraftLen, make_policy

    assert make_policy(DraftLen.parse(7)).choose(1) == 7 and isinstance(make_policy(7), FixedDraftLen)
    tree = make_policy("tree")
    assert isinstance(tree, AdaptiveDraftLen) and tree.alternates and not make_policy("auto").alternates


@pytest.mark.parametrize("bad", [None, 0, 1.5, "many", "5", True])
def test_max_new_tokens(bad):
    assert options.max_new_tokens(5) == 5
    with pytest.raises(VerispecError, match="max_new_tokens must be an integer >= 1"):
        options.max_new_tokens(bad)


def test_a_flag_reports_the_parse_error_as_a_usage_error():
    parser = argparse.ArgumentParser()
    parser.add_argument("--draft-len", type=options.flag(DraftLen.parse))
    assert parser.parse_args(["--draft-len", "3"]).draft_len == DraftLen(3)
    assert parser.parse_args(["--draft-len", "tree"]).draft_len == DraftLen("tree")
    with pytest.raises(argparse.ArgumentTypeError, match="got 'x'"):
        options.flag(DraftLen.parse)("x")
    with pytest.raises(argparse.ArgumentTypeError, match="got -2"):
        options.flag(DraftLen.parse)("-2")


def test_drafter_names_are_the_drafters_the_api_builds():
    from verispec.api import DRAFTERS

    assert set(options.DRAFTER_NAMES) == {"auto", *DRAFTERS}
    with pytest.raises(VerispecError, match="unknown drafter 'lookahead'.*ngram"):
        options.drafter_name("lookahead")


def test_capabilities_have_defaults_and_backends_declare_theirs():
    from conftest import tiny_llama
    from verispec.drafters import HybridDrafter, ModelDrafter, NgramDrafter, NoDrafter, SharedCacheDrafter
    from verispec.models.base import CausalLM
    from verispec.models.native import NativeCausalLM

    hf = tiny_llama()
    assert isinstance(hf, CausalLM)
    assert (hf.supports_trees, hf.max_exact_rows, hf.makes_lower_precision_copies) == (False, None, False)
    assert not hf.same_layer_shapes(hf)
    native = NativeCausalLM.from_hf(hf)
    assert native.supports_trees and native.makes_lower_precision_copies and native.same_layer_shapes(native)
    for drafter in (NgramDrafter(), NoDrafter()):
        assert drafter.prefill_model is None and not drafter.shares_cache
    model = ModelDrafter(hf, hf.vocab_size)
    assert model.prefill_model is hf and HybridDrafter(model).prefill_model is hf and not model.shares_cache
    shared = SharedCacheDrafter(native, native)
    assert shared.shares_cache and shared.prefill_model is None


def test_no_capability_probes_in_the_engine_api_or_drafters():
    """Capabilities are read as declared attributes, never probed for by name."""
    root = Path(verispec.__file__).parent
    sources = [root / "engine.py", root / "api.py", *sorted((root / "drafters").glob("*.py"))]
    probes = [f"{path.name}:{number}" for path in sources for number, line in enumerate(path.read_text().splitlines(), 1)
              if "getattr(" in line or "hasattr(" in line]
    assert probes == []
