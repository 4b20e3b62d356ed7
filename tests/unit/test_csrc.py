"""The C kernels' source tree (verispec/csrc): it builds warning-free, a compiler error names the real
file and line, and the weight formats Python uses are the C header's."""

from __future__ import annotations

import re
import shutil

import pytest

from verispec.models.kernels import abi, build

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")


@needs_compiler
def test_the_tree_builds_without_a_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "FLAGS", (*build.FLAGS, "-Werror"))
    library = build.build(tmp_path)
    assert library.exists() and library.parent == tmp_path
    assert build.build(tmp_path) == library  # the same sources and flags: built once


@needs_compiler
def test_a_compile_error_names_the_real_file_and_line(tmp_path, monkeypatch):
    tree = tmp_path / "csrc"
    shutil.copytree(build.CSRC, tree)
    source = (tree / "pool.c").read_text().splitlines()
    line = next(i for i, text in enumerate(source) if text.startswith("void parallel_for(")) + 1
    source.insert(line, "    this is not C;")
    (tree / "pool.c").write_text("\n".join(source) + "\n")
    monkeypatch.setattr(build, "CSRC", tree)
    monkeypatch.setattr(build, "UNITS", {"pool.c": ((),)})
    with pytest.raises(build.BuildError) as failure:
        build.build(tmp_path / "out")
    assert re.search(re.escape(str(tree / "pool.c")) + rf":{line + 1}:\d+: error", str(failure.value))
    assert (tree / "pool.c").exists()  # the file the message names is still there to read


def test_python_reads_the_formats_from_the_c_header():
    header = (build.CSRC / "formats.h").read_text()
    for fmt in abi.Format:
        assert re.search(rf"\bVS_{fmt.name}\s*=\s*{fmt.value}\s*,", header)
    assert {"F32", "BF16", "INT8", "INT4", "Q4K", "Q6K", "PANELS"} <= set(abi.Format.__members__)
    assert abi.BUFFERS == ("normed", "delta", "q", "k", "v", "attended", "gate", "up")


def test_builds_of_other_sources_are_kept_a_while_then_evicted(tmp_path):
    """Two checkouts of different versions share the cache: each keeps the other's recent build instead of
    rebuilding on every start, and the oldest builds go."""
    import os
    import time

    from verispec.models.kernels import build

    now = time.time()
    builds = [tmp_path / f"kernels_{i:016x}.so" for i in range(6)]
    for age, path in enumerate(builds):
        path.write_bytes(b"")
        os.utime(path, (now - 100 * age, now - 100 * age))  # builds[0] used last
    current = builds[5]  # the oldest, but the one this process uses
    build.evict_other_builds(tmp_path, current)
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == sorted(p.name for p in [current, *builds[: build.KEPT_BUILDS - 1]])
