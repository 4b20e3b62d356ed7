"""Function prompts cut from installed sources (`corpus.function_prompts`, the `site-packages-prompts` training
source): HumanEval-shaped, the function's body left for the target to write."""

from __future__ import annotations

import pytest

from verispec import corpus
from verispec.errors import VerispecError
from verispec.heads import data

GOOD = '''import os
from typing import List
x = 1


def mean_of(values: List[float]) -> float:
    """Return the arithmetic mean of the values, or 0.0 when there are none at all."""
    if not values:
        return 0.0
    total = sum(values)
    return total / len(values)


def _private(a):
    """A private helper that is long enough to count as documented, but private."""
    a += 1
    a += 2
    return a


def short(a):
    """Too short."""
    a += 1
    a += 2
    return a


def trivial(a):
    """A documented function whose body is a single statement after its docstring."""
    return a
'''


@pytest.fixture
def sources(tmp_path, monkeypatch):
    (tmp_path / "good.py").write_text(GOOD)
    (tmp_path / "broken.py").write_text("def f(:\n")
    monkeypatch.setattr(corpus, "site_packages_files", lambda: sorted(tmp_path.glob("*.py")))
    return tmp_path


def test_a_prompt_is_imports_signature_and_docstring_without_the_body(sources):
    (prompt,) = corpus.function_prompts(10)
    assert prompt.startswith("import os\nfrom typing import List\n\n\n")
    assert "x = 1" not in prompt  # imports only, not the module's other statements
    assert prompt.endswith('    """Return the arithmetic mean of the values, or 0.0 when there are none at all."""\n')
    assert "total" not in prompt  # the body is what the target writes


def test_private_short_and_trivial_functions_are_left_out_and_the_limit_holds(sources):
    assert len(corpus.function_prompts(10)) == 1
    assert corpus.function_prompts(0) == []


def test_the_training_source_reads_them_as_code_prompts(sources):
    assert list(data.documents(("site-packages-prompts:5",))) == [(corpus.function_prompts(5)[0], data.CODE_PROMPT)]
    with pytest.raises(VerispecError, match="site-packages-prompts:N"):
        list(data.documents(("site-packages-prompts:many",)))
