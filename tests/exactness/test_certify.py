"""`verispec certify`: passes for the lossless modes, fails with a clear report on a broken verifier."""

from __future__ import annotations

import json

import pytest
import torch

import verispec.engine
from conftest import perturbed_copy, tiny_llama
from verispec.certify import certify, chi_square
from verispec.cli import main
from verispec.drafters.base import Verdict
from verispec.sampling import sample, warp_rows
from verispec.verifiers import verifier_for


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(seed=0)
    return target, perturbed_copy(target, scale=0.3)


def test_chi_square_figures():
    expected = {(0,): 0.5, (1,): 0.5}
    assert chi_square({(0,): 500, (1,): 500}, expected, 1000)[2] == pytest.approx(1.0)
    statistic, dof, p = chi_square({(0,): 600, (1,): 400}, expected, 1000)
    assert statistic == pytest.approx(40.0) and dof == 1 and p < 1e-9
    assert chi_square({(2,): 1, (0,): 999}, expected, 1000)[2] == 0.0  # a draw the target never makes


@pytest.mark.parametrize("drafter", ["model", "ngram", "suffix"])
def test_lossless_modes_pass(pair, drafter):
    target, draft = pair
    certificate = certify(target, draft=draft if drafter == "model" else None, drafter=drafter, draft_lens=(3,),
                          prompts=2, max_new_tokens=16, samples=1500)
    assert certificate.passed, certificate.report()
    assert [c.passed for c in certificate.checks] == [True] * 4
    sampled = [c.figures for c in certificate.checks[1:]]
    assert all(f["accepted_tokens"] > 0 and f["drafted_tokens"] > f["accepted_tokens"] for f in sampled)


class AcceptsEveryDraftToken:
    """The broken verifier: every drafted token is kept, whatever the target thinks of it."""

    lossless, takes_alternates = True, False

    def verify(self, draft, target_logits, sampling, generators, positions=None):
        p = warp_rows(target_logits, sampling)
        kept = draft.num_drafted.clone()
        return Verdict(kept, torch.tensor([sample(p[b, int(kept[b])], generators[b]) for b in range(len(sampling))]))


def test_broken_verifier_fails_with_a_clear_report(pair, monkeypatch, tmp_path, capsys):
    target, draft = pair
    monkeypatch.setattr(verispec.engine, "verifier_for",
                        lambda sampling: AcceptsEveryDraftToken() if not all(s.greedy for s in sampling) else verifier_for(sampling))
    certificate = certify(target, draft=draft, drafter="model", draft_lens=(3,), prompts=2, max_new_tokens=16,
                          samples=1500, modes=("block",))
    greedy, block = certificate.checks
    assert greedy.passed and not block.passed and not certificate.passed
    assert block.figures["p_value"] < 1e-6
    report = certificate.report()
    assert "FAIL  sampling, block" in report and "NOT CERTIFIED" in report and "times where" in report
    # The same through the command line: exit status 1, the report printed and saved.
    monkeypatch.setattr("verispec.load", lambda model, *a, **k: {"t": target, "d": draft}.get(model, model))
    out = tmp_path / "report.json"
    status = main(["certify", "t", "--draft", "d", "--drafter", "model", "--draft-len", "3", "--mode", "block",
                   "--prompts", "1", "--max-new-tokens", "8", "--samples", "1000", "--out", str(out)])
    assert status == 1
    assert "NOT CERTIFIED" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["passed"] is False and saved["checks"][1]["figures"]["mode"] == "block"


def test_lossy_mode_is_reported_as_failing(pair):
    """Typical acceptance keeps draft tokens the target would not sample as often: certify shows it."""
    target, draft = pair
    certificate = certify(target, draft=draft, drafter="model", draft_lens=(3,), prompts=1, max_new_tokens=8,
                          samples=2000, modes=("typical",))
    assert not certificate.checks[1].passed and "LOSSY" in certificate.checks[1].name


@pytest.mark.slow
def test_smollm_certifies():
    certificate = certify("smollm2-135m", drafter="ngram", draft_lens=(4,), prompts=3, max_new_tokens=32, samples=2000)
    assert certificate.passed, certificate.report()
