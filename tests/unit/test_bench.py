"""`verispec bench`: its bundled prompt sets, and end to end on the real smollm2-135m (target) with an
int8 copy of itself as the draft: the reports it writes carry what bench/README.md's tables are made from."""

from __future__ import annotations

import argparse
import json

import pytest

import verispec

from verispec.bench import BUNDLED_PROMPTS, _paired_runs, add_bench_arguments, cpu_label, read_prompts, run_bench
from verispec.cli import main
from verispec.errors import VerispecError


def test_bundled_prompt_sets_load_in_the_forms_bench_reads():
    """The prompts shipped in the package parse: 10 HumanEval completions, 2 chat questions per Spec-Bench category."""
    humaneval = read_prompts("humaneval", per_category=100)
    assert len(humaneval) == 10 and {p.category for p in humaneval} == {"humaneval"}
    assert all(not p.chat and p.text.lstrip().startswith(("def ", "from ", "import ")) for p in humaneval)
    assert humaneval[0].id == "HumanEval/0"
    spec_bench = read_prompts("spec_bench", per_category=100)
    categories = {p.category for p in spec_bench}
    assert len(categories) == 13 and {"coding", "rag", "summarization", "math_reasoning"} <= categories
    assert len(spec_bench) == 26 and all(p.chat and p.text for p in spec_bench)
    assert len(read_prompts("spec_bench", per_category=1)) == 13
    assert set(BUNDLED_PROMPTS) == {"humaneval", "spec_bench", "code_edit"}
    edits = read_prompts("code_edit", per_category=100)
    sources = {p.text for p in humaneval}
    # every edit request carries one bundled HumanEval prompt unchanged, inside a code block
    assert len(edits) == 10 and all(p.chat and p.category == "code_edit" for p in edits)
    assert all(any(f"```python\n{source}```" in p.text for source in sources) for p in edits)


def test_bench_reads_the_bundled_humaneval_set_by_default():
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    assert parser.parse_args([]).prompts == "humaneval"


def test_bench_prompt_file_mistakes_are_verispec_errors(tmp_path, capsys):
    missing = tmp_path / "nowhere.jsonl"
    with pytest.raises(VerispecError, match="no prompt file.*humaneval, spec_bench, code_edit"):
        read_prompts(str(missing), per_category=1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "def f():"}\nnot json\n')
    with pytest.raises(VerispecError, match="line 2: not JSON"):
        read_prompts(str(bad), per_category=1)
    bad.write_text('{"question": "no turns, no prompt"}\n')
    with pytest.raises(VerispecError, match="neither 'turns'"):
        read_prompts(str(bad), per_category=1)
    # The CLI reports it in one line, before loading any model, instead of a traceback.
    assert main(["bench", str(missing), "--target", "no-such-model"]) == 2
    assert "verispec: error: no prompt file" in capsys.readouterr().err


def run_small_bench(out, name: str, *options: str) -> None:
    """`verispec bench` on the bundled HumanEval prompts with smollm2-135m drafting for itself (int8), no HF peers."""
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    run_bench(parser.parse_args(["humaneval", "--target", "smollm2-135m", "--draft", "smollm2-135m", "--draft-dtype", "int8",
                                 "--no-hf", *options, "--out", str(out), "--name", name]))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("reports")
    run_small_bench(out, "t", "--per-category", "2", "--max-new-tokens", "12", "--rounds", "2", "--sweep", "2,3",
                    "--sweep-prompts", "1", "--widths", "1,2,4")
    return out


@pytest.mark.slow
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


@pytest.mark.slow
def test_bench_labels_a_lossy_run(tmp_path):
    """A run with typical acceptance (lossy) says so in its report."""
    run_small_bench(tmp_path, "lossy", "--per-category", "1", "--max-new-tokens", "8", "--sweep", "", "--widths", "1,2",
                    "--temperature", "0.8", "--typical-acceptance", "0.05")
    assert json.loads((tmp_path / "lossy.json").read_text())["settings"]["typical_acceptance"] == 0.05
    assert "LOSSY typical acceptance, eps 0.05" in (tmp_path / "lossy.md").read_text()


@pytest.mark.slow
def test_bench_races_drafters_side_by_side(tmp_path, capsys):
    """`verispec bench --method ...`: plain decoding and each drafter in one run, every text checked against
    plain decoding's, a report per method and category."""
    from verispec.cli import main

    assert main(["bench", "humaneval", "--target", "smollm2-135m", "--method", "suffix", "--method", "ngram",
                 "--method", "auto:smollm2-135m", "--per-category", "2", "--rows", "odd", "--max-new-tokens", "12",
                 "--rounds", "2", "--out", str(tmp_path), "--name", "race"]) == 0
    data = json.loads((tmp_path / "race.json").read_text())
    assert [r["id"] for r in data["rows"]] == ["HumanEval/2", "HumanEval/6"]  # the odd rows of the bundled set
    table = data["summary"]["table"]["all"]
    assert set(table) == {"plain", "suffix", "ngram", "auto smollm2-135m q3_0"}
    assert table["suffix"]["identical"] == "2/2" and table["ngram"]["identical"] == "2/2"
    assert table["auto smollm2-135m q3_0"]["identical"] == "2/2"
    # each row names the drafter that ran: auto's is the draft model's (or prompt lookup's, where its start would not pay)
    assert {r["methods"]["auto smollm2-135m q3_0"]["drafter"] for r in data["rows"]} <= {
        "ModelDrafter", "NgramDrafter", "ModelDrafter, then NgramDrafter"}
    assert {r["methods"]["suffix"]["drafter"] for r in data["rows"]} == {"SuffixDrafter"}
    assert table["plain"]["vs_plain"] == 1.0 and table["suffix"]["tokens_per_pass"] >= 1.0
    assert "| suffix |" in (tmp_path / "race.md").read_text()
    assert main(["bench", "humaneval", "--target", "smollm2-135m", "--method", "nonsense", "--out", str(tmp_path)]) == 2
    assert "unknown --method 'nonsense'" in capsys.readouterr().err


def test_race_methods_name_the_drafts_head():
    """A draft model's race method takes the token ids its head scores as a third field (`api.load_draft`'s vocab)
    and names it; bad ones fail before any run."""
    from verispec.errors import VerispecError
    from verispec.race import methods_of

    target = verispec.load("smollm2-135m")
    names = [m.name for m in methods_of(target, ["model:smollm2-135m:q4_0:4096", "staged:smollm2-135m:q4_0:all",
                                                 "auto:smollm2-135m"])]
    assert names[0] == "plain" and names[1].startswith("model smollm2-135m q4_0 head 40") and names[1].endswith("+read")
    assert names[2:] == ["staged smollm2-135m q4_0", "auto smollm2-135m q3_0"]  # whole heads: all, and auto beside float32
    with pytest.raises(VerispecError, match="draft_vocab"):
        methods_of(target, ["model:smollm2-135m:q4_0:lots"])


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


def test_a_report_names_a_cpu_whose_model_name_hides_its_generation_by_family_and_model():
    """A cloud VM reports "AMD EPYC" for Zen 3, 4 and 5 alike: the CPUID family and model tell them apart. A name
    that carries its own model number is left as it is; only the first processor's block is read."""
    epyc = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n\n" \
           "processor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n"
    assert cpu_label(epyc, "x86_64") == "AMD EPYC (family 25, model 17)"
    xeon = "processor\t: 0\ncpu family\t: 6\nmodel\t\t: 207\nmodel name\t: INTEL(R) XEON(R) PLATINUM 8581C CPU @ 2.10GHz\n"
    assert cpu_label(xeon, "x86_64") == "INTEL(R) XEON(R) PLATINUM 8581C CPU @ 2.10GHz"
    assert cpu_label("", "aarch64") == "aarch64"


def test_step_profile_accounts_for_every_step_and_pass(tmp_path):
    """bench/step_profile.py on smollm2-135m with a Q4_0 copy of itself: one target pass per step, the steps'
    tokens cover the output, and the seconds split into drafting, verifying and the rest."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("step_profile", Path(__file__).parents[2] / "bench" / "step_profile.py")
    step_profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step_profile)
    out = tmp_path / "profile"
    assert step_profile.main(["humaneval", "--target", "smollm2-135m", "--numerics", "float32", "--method", "auto:smollm2-135m",
                              "--per-category", "2", "--rows", "odd", "--max-new-tokens", "12", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    totals, widths = report["totals"], report["by_verify_width"]
    assert [r["id"] for r in report["rows"]] == ["HumanEval/2", "HumanEval/6"]
    assert totals["tokens"] == sum(r["tokens"] for r in report["rows"]) <= 24
    assert totals["steps"] == sum(w["steps"] for w in widths.values()) == sum(r["steps"] for r in report["rows"])
    assert sum(w["tokens"] for w in widths.values()) >= totals["tokens"]  # a last step's tokens past the limit are cut
    # every step verifies in one target pass of its width (the prompts' prefills are wider than any step)
    assert {int(w): v["steps"] for w, v in widths.items()} == {int(w): v["passes"] for w, v in report["passes"]["target"].items()}
    for r in report["rows"]:
        assert r["seconds"] == pytest.approx(r["draft_seconds"] + r["verify_seconds"] + r["other_seconds"])
        assert r["other_seconds"] >= r["prefill_seconds"] * 0.5
