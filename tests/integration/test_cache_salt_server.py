"""The prefix cache keeps tenants apart, through the real HTTP server (smollm2-135m, two API keys).

A hit shortens the time to first token, so a cache shared by every tenant would let one learn whether
another sent a prompt. Each API key salts its requests' hash chains (`cache_salt_of`), and a request may
salt them further with vLLM's `cache_salt`: a tenant hits its own prompt, never another's, and every
answer is the same hit or miss.
"""

from __future__ import annotations

import httpx
import pytest

from verispec import zoo
from verispec.server import ServerProcess

MODEL = "smollm2-135m"
KEY_A, KEY_B = "salt-tenant-a", "salt-tenant-b"
HITS = f'verispec:prefix_cache_hits_total{{model_name="{MODEL}"}}'
MESSAGES = [{"role": "system", "content": "You answer from these notes only.\n" + "\n".join(
                f"Note {i}: the box in room {i} holds {i * 3 % 17 + 2} apples." for i in range(40))},
            {"role": "user", "content": "How many apples are in room 5?"}]


@pytest.fixture(scope="module")
def url():
    zoo.pull(MODEL)
    process = ServerProcess(["--target", MODEL, "--drafter", "ngram", "--api-key", KEY_A, "--api-key", KEY_B],
                            threads=1).start()
    try:
        process.wait_ready(timeout=300)
        yield process.url
    finally:
        process.stop()


def hits(url: str) -> float:
    lines = httpx.get(url + "/metrics", timeout=30).text.splitlines()
    return next((float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(HITS + " ")), 0.0)


def ask(url: str, key: str, **extra) -> tuple[str, float]:
    """(answer, prompt tokens found in the prefix cache) of a greedy chat completion of MESSAGES."""
    before = hits(url)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, **extra}
    response = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"], hits(url) - before


def test_a_tenant_hits_its_own_prompt_and_never_anothers(url):
    first, found = ask(url, KEY_A)
    assert found == 0
    again, found_again = ask(url, KEY_A)
    assert found_again >= 256  # the prompt is ~700 tokens: its chunks up to the last turn start
    other, found_other = ask(url, KEY_B)
    assert found_other == 0  # B's chain is rooted apart: no timing tells it what A sent
    assert ask(url, KEY_B) == (other, found_again)  # B now hits its own
    assert first == again == other


def test_cache_salt_splits_a_tenants_requests_further(url):
    plain, _ = ask(url, KEY_A)  # stored unsalted under A (if not already)
    salted, found = ask(url, KEY_A, cache_salt="project-1")
    assert found == 0
    salted_again, found_again = ask(url, KEY_A, cache_salt="project-1")
    assert found_again > 0
    assert ask(url, KEY_B, cache_salt="project-1")[1] == 0  # the same salt under another key is another chain
    assert plain == salted == salted_again


@pytest.mark.parametrize("salt", ["", 5, "x" * 2000])
def test_a_bad_cache_salt_is_a_400(url, salt):
    body = {"model": MODEL, "messages": MESSAGES[1:], "max_tokens": 2, "cache_salt": salt}
    response = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "cache_salt" and len(error["message"]) < 300
