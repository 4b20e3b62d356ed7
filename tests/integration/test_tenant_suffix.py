"""Suffix drafting keeps tenants apart, through the real HTTP server (smollm2-135m, `--drafter suffix`, two API keys).

A tenant's earlier output is proposed to its own repeated request (more draft tokens, more accepted), and never to
another tenant's: the other tenant's request drafts exactly what it drafts on a server that has seen nothing (the
same speculative figures as a first request). Tenants are API keys, and within a key OpenAI's `user` field.
"""

from __future__ import annotations

import httpx
import pytest

from verispec import zoo
from verispec.server import ServerProcess
from verispec.server.process import ServerStartError

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
PROMPT = "Write a Python function that checks whether a number is prime.\n\ndef is_prime(n):"


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    zoo.pull("smollm2-135m")
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# tenant B\n{KEY_B}\n")
    process = ServerProcess(["--target", "smollm2-135m", "--drafter", "suffix", "--draft-len", "6", "--api-key", KEY_A,
                             "--api-key-file", str(keys)], threads=1).start()
    try:
        try:
            process.wait_ready(timeout=180)
        except ServerStartError as exc:
            pytest.fail(str(exc))
        yield process.url
    finally:
        process.stop()


def complete(url: str, key: str, user: str | None = None) -> tuple[str, dict]:
    """(text, usage.speculative) of a greedy completion of PROMPT."""
    body = {"model": "smollm2-135m", "prompt": PROMPT, "max_tokens": 48, "temperature": 0, **({"user": user} if user else {})}
    response = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=300)
    assert response.status_code == 200, response.text
    answer = response.json()
    return answer["choices"][0]["text"], answer["usage"]["speculative"]


def test_a_tenants_output_drafts_its_own_repeat_and_never_another_tenants(url):
    first_text, first = complete(url, KEY_A)
    again_text, again = complete(url, KEY_A)
    other_text, other = complete(url, KEY_B)
    assert again_text == first_text == other_text  # greedy: what is drafted never changes the text
    # A's repeat drafts its earlier answer: more tokens drafted and accepted, fewer passes.
    assert again["accepted_tokens"] >= first["accepted_tokens"] + 10
    assert again["target_passes"] < first["target_passes"]
    # B has no history: it drafts exactly what a first request drafts (A's answer is not proposed to it).
    assert other == first


def test_users_under_one_key_are_tenants_too(url):
    _, first = complete(url, KEY_B, user="alice")
    _, again = complete(url, KEY_B, user="alice")
    _, other = complete(url, KEY_B, user="bob")
    assert again["accepted_tokens"] >= first["accepted_tokens"] + 10
    assert other == first


def test_wrong_key_is_refused(url):
    response = httpx.post(url + "/v1/completions", json={"model": "smollm2-135m", "prompt": "x", "max_tokens": 1},
                          headers={"Authorization": "Bearer not-a-key"}, timeout=60)
    assert response.status_code == 401
