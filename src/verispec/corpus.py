"""Text that ships with this machine: the installed packages' Python sources.

The machine has no internet beyond PyPI, so what a head trains on (`heads.data`) and what a datastore drafts from
(`drafters.datastore`) by default is the source code of the installed packages: code and docstrings together,
plentiful, and overlapping none of the benchmark prompts. `function_prompts` cuts HumanEval-shaped prompts from
the same files (a module's imports, a function's signature and docstring) for a target to answer: a head
learns what the target writes from those answers, where the source files teach it what people wrote.
Knows nothing about models or tokens.
"""

from __future__ import annotations

import ast
import site
import sysconfig
import zlib
from pathlib import Path


def site_packages_files() -> list[Path]:
    """Python source files of the installed packages, in a fixed order (tests and vendored copies left out)."""
    roots = {Path(p) for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]] if Path(p).is_dir()}
    files = []
    for root in sorted(roots):
        for path in sorted(root.rglob("*.py")):
            parts = set(path.relative_to(root).parts)
            if parts & {"tests", "test", "_vendor", "vendored", "__pycache__"} or path.name.startswith("test_"):
                continue
            files.append(path)
    return files


def function_prompts(limit: int, per_file: int = 2) -> list[str]:
    """Up to `limit` prompts shaped like HumanEval's: a module's import lines, then one of its public top-level
    functions cut after its docstring. Files are taken in an order fixed by a hash of their paths (so the prompts
    spread over the installed packages rather than exhausting the first), at most `per_file` functions each;
    functions whose docstring is short or long, whose body is trivial or long, are left out."""
    files = sorted(site_packages_files(), key=lambda p: zlib.crc32(str(p).encode()))
    prompts: list[str] = []
    for path in files:
        if len(prompts) >= limit:
            break
        try:
            source = path.read_text()
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError, RecursionError):
            continue
        lines = source.splitlines()
        imports = [ast.get_source_segment(source, node) for node in tree.body
                   if isinstance(node, (ast.Import, ast.ImportFrom)) and node.end_lineno == node.lineno][:8]
        taken = 0
        for node in tree.body:
            if taken >= per_file or len(prompts) >= limit:
                break
            cut = _prompt_end(node)
            if cut is None:
                continue
            head = "\n".join(lines[node.lineno - 1:cut])
            prompts.append(("\n".join(i for i in imports if i) + "\n\n\n" if imports else "") + head + "\n")
            taken += 1
    return prompts


def _prompt_end(node: ast.stmt) -> int | None:
    """The last line of a function's prompt (its docstring's), or None for one that makes a poor prompt."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_") or node.decorator_list:
        return None
    doc = ast.get_docstring(node)
    if not doc or not 40 <= len(doc) <= 800 or len(node.body) < 3 or node.end_lineno - node.lineno > 60:
        return None
    return node.body[0].end_lineno
