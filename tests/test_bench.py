"""`verispec bench` end to end on the real smollm2-135m (target) with an int8 copy of itself as the draft:
the reports it writes carry what the README's tables are made from."""

from __future__ import annotations

import argparse
import json

import pytest

from verispec.bench import _paired_runs, add_bench_arguments, run_bench

HUMANEVAL = "../shared/data/humaneval_dev.jsonl"


def run_small_bench(out, name: str, *options: str) -> None:
    """`verispec bench` on the HumanEval prompts with smollm2-135m drafting for itself (int8), no HF peers."""
    from pathlib import Path

    prompts = Path(__file__).resolve().parents[1] / HUMANEVAL
    if not prompts.exists():
        pytest.skip(f"{HUMANEVAL} is not beside the repository")
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    run_bench(parser.parse_args([str(prompts), "--target", "smollm2-135m", "--draft", "smollm2-135m", "--draft-dtype", "int8",
                                 "--no-hf", *options, "--out", str(out), "--name", name]))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("reports")
    run_small_bench(out, "t", "--per-category", "2", "--max-new-tokens", "12", "--rounds", "2", "--sweep", "2,3",
                    "--sweep-prompts", "1", "--widths", "1,2,4")
    return out


def test_bench_writes_reports_with_identical_outputs(report):
    data = json.loads((report / "t.json").read_text())
    assert len(data["prompts"]) == 2
    assert all(p["identical"] for p in data["prompts"])  # greedy: speculative output is the plain output
    assert set(data["verify_cost"]["ratio"]) == {"1", "2", "4"}
    assert data["verify_cost"]["ratio"]["1"] == 1.0
    # The sweep is timed against plain runs of its own, and priced by the formula beside it.
    assert set(data["sweep"]["measured"]) == {"2", "3"} and all(v > 0 for v in data["sweep"]["measured"].values())
    assert set(data["sweep"]["predicted"]) >= {"2", "3"}
    markdown = (report / "t.md").read_text()
    assert "| humaneval | 2 |" in markdown and "2/2" in markdown
    assert "medians of 2 runs in alternating order" in markdown
    assert (report / "t.png").stat().st_size > 10_000


def test_bench_labels_a_lossy_run(tmp_path):
    """A run with typical acceptance (lossy) says so in its report."""
    run_small_bench(tmp_path, "lossy", "--per-category", "1", "--max-new-tokens", "8", "--sweep", "", "--widths", "1,2",
                    "--temperature", "0.8", "--typical-acceptance", "0.05")
    assert json.loads((tmp_path / "lossy.json").read_text())["settings"]["typical_acceptance"] == 0.05
    assert "LOSSY typical acceptance, eps 0.05" in (tmp_path / "lossy.md").read_text()


def test_paired_runs_alternate_the_order_and_take_medians():
    """Rounds run plain first, then speculative first, and so on; each side's time is its median."""
    import time
    from types import SimpleNamespace

    calls, naps = [], {"plain": [0.03, 0.01, 0.02], "spec": [0.0, 0.02, 0.01]}

    def run(name):
        def go():
            calls.append(name)
            time.sleep(naps[name][sum(c == name for c in calls) - 1])
            return SimpleNamespace(name=name, stats=SimpleNamespace(prefill_seconds=len(calls)))
        return go

    base, spec, plain_s, spec_s, prefill = _paired_runs(run("plain"), run("spec"), 3)
    assert calls == ["plain", "spec", "spec", "plain", "plain", "spec"]
    assert base.name == "plain" and spec.name == "spec"
    assert 0.02 <= plain_s < 0.03 and 0.01 <= spec_s < 0.02  # the middle of three sleeps each
    assert prefill == 4  # the median of the plain runs' prefill times (calls 1, 4 and 5)
