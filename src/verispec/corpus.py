"""Text that ships with this machine: the installed packages' Python sources.

The machine has no internet beyond PyPI, so what a head trains on (`heads.data`) and what a datastore drafts from
(`drafters.datastore`) by default is the source code of the installed packages: code and docstrings together,
plentiful, and overlapping none of the benchmark prompts. Knows nothing about models or tokens.
"""

from __future__ import annotations

import site
import sysconfig
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
