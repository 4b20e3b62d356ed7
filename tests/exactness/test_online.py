"""Online adaptation of Medusa heads (`heads.online`): the output stays the target's while the heads change
between steps (greedy token for token, sampled by chi-square with a negative control), the replay buffer
stays bounded, learning from a repeated workload changes the weights and raises acceptance, and the
worker thread ends cleanly.

Tiny random-weight targets; the heads start cold (`medusa_head_from_target`) or fitted (`test_medusa`).
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

import verispec
from conftest import tiny_llama
from test_medusa import HEADS, PROMPTS, ReportsAnotherQ, SAMPLED, fitted_heads
from verispec.api import DRAFTERS
from verispec.drafters.medusa import MedusaDrafter
from verispec.errors import VerispecError
from verispec.heads.online import OnlineConfig, OnlineMedusa, ReplayBuffer
from verispec.heads.train_medusa import medusa_head_from_target
from verispec.models.native import NativeCausalLM

# a step per 2 served tokens, no rest: the heads change as often as the tiny workload allows
EAGER = OnlineConfig(window=8, batch_windows=4, tokens_per_step=2, max_busy=1.0, lr=1e-2)
WORKER = "verispec-online-medusa"


@pytest.fixture(scope="module")
def tiny_hf():
    return tiny_llama(seed=0, layers=4)


@pytest.fixture(scope="module")
def tiny_target(tiny_hf):
    return NativeCausalLM.from_hf(tiny_hf)


def cold_heads(target):
    return medusa_head_from_target(target, torch.arange(target.vocab_size), HEADS, 1)


class LearnsEveryStep(MedusaDrafter):
    """Forces an update between every two steps: after each verdict, one optimizer step and a swap."""

    def commit(self, verdict):
        super().commit(verdict)
        if self.heads.step() is not None:
            self.heads.publish()


class MisreportsWhileLearning(LearnsEveryStep, ReportsAnotherQ):
    """The negative control: learning every step, and reporting a q its tokens were not drawn from."""


@pytest.fixture
def drafter_class():
    """Swap the drafter `generate` builds for draft=OnlineMedusa (restored after the test)."""
    original = DRAFTERS["medusa"]

    def use(cls):
        DRAFTERS["medusa"] = lambda target, draft, confidence: cls(draft, target)

    yield use
    DRAFTERS["medusa"] = original


def plain(target, prompts, n):
    return [verispec.generate(target, p, drafter="none", max_new_tokens=n).token_ids for p in prompts]


def warmed(target, head, options=EAGER) -> OnlineMedusa:
    """An OnlineMedusa whose buffer already holds windows of greedy traffic (not yet trained on)."""
    online = OnlineMedusa(head, options)
    verispec.generate(target, PROMPTS, draft=online, draft_len=3, max_new_tokens=40)
    assert len(online.buffer) > 0
    return online


def test_greedy_output_is_plain_while_the_heads_change_every_step(tiny_target, drafter_class):
    drafter_class(LearnsEveryStep)
    expected = plain(tiny_target, PROMPTS, 40)
    online = warmed(tiny_target, cold_heads(tiny_target))
    for draft_len in (1, 3, "auto", "tree"):
        before = online.version
        batch = verispec.generate(tiny_target, PROMPTS, draft=online, draft_len=draft_len, max_new_tokens=40)
        assert [r.token_ids for r in batch] == expected, draft_len
        assert online.version >= before + 10  # swapped between the call's steps
        for prompt, tokens in zip(PROMPTS, expected):
            assert verispec.generate(tiny_target, prompt, draft=online, draft_len=draft_len, max_new_tokens=40).token_ids == tokens


def test_greedy_output_is_plain_with_the_worker_thread(tiny_target):
    expected = plain(tiny_target, PROMPTS, 40)
    with OnlineMedusa(fitted_heads(tiny_target), EAGER) as online:
        for _ in range(6):
            batch = verispec.generate(tiny_target, PROMPTS, draft=online, draft_len=3, max_new_tokens=40)
            assert [r.token_ids for r in batch] == expected
            assert batch[0].stats.drafter == "MedusaDrafter"
    assert online.error is None and online.version > 0
    assert online.steps <= online.served_tokens / EAGER.tokens_per_step  # the token budget holds


@pytest.mark.parametrize("params", SAMPLED[:1], ids=str)
def test_sampled_output_follows_the_target_while_learning(tiny_hf, tiny_target, drafter_class, params):
    """2000 seeded rows with the heads updated between every step: the first two tokens follow the
    target's joint distribution (chi-square), as with fixed heads."""
    from test_sampling_exactness import P_THRESHOLD, first_two_tokens_pvalues, repeating_prompt
    from verispec.sampling import SamplingParams

    online = warmed(tiny_target, fitted_heads(tiny_target))
    drafter_class(LearnsEveryStep)
    prompt = repeating_prompt(tiny_target)
    before = online.version
    results = verispec.generate(tiny_target, [prompt] * 2000, draft=online, draft_len=3, max_new_tokens=3, **params)
    assert online.version >= before + 2  # the heads changed between the call's steps
    assert results[0].stats.accepted_tokens > 30  # both the accept and the resample paths ran
    first, joint = first_two_tokens_pvalues(tiny_hf, prompt, SamplingParams(**params), [r.token_ids for r in results])
    assert first > P_THRESHOLD and joint > P_THRESHOLD


def test_negative_control_misreported_q_while_learning_is_caught(tiny_hf, tiny_target, drafter_class):
    from test_sampling_exactness import first_two_tokens_pvalues, repeating_prompt
    from verispec.sampling import SamplingParams

    params = SAMPLED[0]
    online = warmed(tiny_target, fitted_heads(tiny_target))
    drafter_class(MisreportsWhileLearning)
    prompt = repeating_prompt(tiny_target)
    results = verispec.generate(tiny_target, [prompt] * 2000, draft=online, draft_len=3, max_new_tokens=3, **params)
    first, joint = first_two_tokens_pvalues(tiny_hf, prompt, SamplingParams(**params), [r.token_ids for r in results])
    assert min(first, joint) < 1e-10, (first, joint)


def test_replay_buffer_keeps_the_newest_windows_within_its_bound(tiny_target):
    buffer = ReplayBuffer(capacity_tokens=50, window=8)  # 6 windows
    for i in range(20):
        buffer.add(torch.full((8, 4), float(i)), torch.full((8,), i))
    assert len(buffer) == 6 and buffer.tokens == 48 and buffer.added == 20
    batch = buffer.sample(100, random.Random(0))
    assert sorted(int(t) for t in batch["tokens"][:, 0]) == list(range(14, 20))  # the oldest left first
    assert batch["taps"].shape == (6, 8, 4) and batch["top_ids"].shape == (6, 8, 1)
    # served traffic: far more than the bound passes through, the buffer never holds more
    options = OnlineConfig(window=8, buffer_tokens=40, tokens_per_step=1e9)
    online = OnlineMedusa(cold_heads(tiny_target), options)
    for _ in range(3):
        verispec.generate(tiny_target, PROMPTS, draft=online, draft_len=3, max_new_tokens=40)
        assert online.buffer.tokens <= options.buffer_tokens
    assert online.buffer.added * options.window > 3 * options.buffer_tokens and online.steps == 0


def test_learning_from_a_repeated_workload_raises_acceptance(tiny_target):
    """Cold heads (head 0 guesses x_{t+1} again) accept almost nothing; after a few rounds of the same
    prompts, trained between rounds on what they served, they accept most of the target's tokens."""
    head = cold_heads(tiny_target)
    online = OnlineMedusa(head, OnlineConfig(window=8, batch_windows=4, tokens_per_step=2, lr=1e-2))
    expected = plain(tiny_target, PROMPTS, 40)
    per_pass = []
    for _ in range(6):
        batch = verispec.generate(tiny_target, PROMPTS, draft=online, draft_len=3, max_new_tokens=40)
        assert [r.token_ids for r in batch] == expected
        per_pass.append(batch[0].stats.accepted_tokens / batch[0].stats.sequence_steps)
        assert online.train_due() > 0
    assert per_pass[0] < 0.2 and per_pass[-1] > 0.6 and per_pass[-1] > 4 * per_pass[0], per_pass
    with online.reading() as live:
        assert not torch.equal(live.medusa_head[0][0].linear.weight, head.medusa_head[0][0].linear.weight)
        assert torch.equal(live.medusa_head[0][1].weight, head.medusa_head[0][1].weight)  # LM heads stay frozen
    assert torch.count_nonzero(head.medusa_head[0][0].linear.weight) == 0  # the caller's heads are not changed


def test_worker_thread_ends_cleanly(tiny_target):
    online = OnlineMedusa(cold_heads(tiny_target), EAGER).start()
    verispec.generate(tiny_target, PROMPTS, draft=online, draft_len=3, max_new_tokens=40)
    assert any(t.name == WORKER for t in threading.enumerate())
    online.close()
    assert not any(t.name == WORKER for t in threading.enumerate())
    online.close()  # twice is harmless
    with pytest.raises(VerispecError, match="closed"):
        online.start()
    running = OnlineMedusa(cold_heads(tiny_target), EAGER).start()
    with pytest.raises(VerispecError, match="worker"):
        running.train_due()
    running.close()
    # the drafter keeps serving the last weights after close, exactly
    assert verispec.generate(tiny_target, PROMPTS[0], draft=online, draft_len=3, max_new_tokens=20).token_ids == \
        plain(tiny_target, PROMPTS[:1], 20)[0]


def test_bad_online_settings_are_refused(tiny_target):
    with pytest.raises(VerispecError, match="window"):
        OnlineMedusa(cold_heads(tiny_target), OnlineConfig(window=HEADS))
    with pytest.raises(VerispecError, match="max_busy"):
        OnlineMedusa(cold_heads(tiny_target), OnlineConfig(max_busy=0))


# --- smollm2-135m behind the real server (slow) ---------------------------------------------------------

@pytest.mark.slow
def test_server_online_cold_start_serves_plain_text_and_stops_its_worker():
    """`verispec serve --online` without a head: cold-start heads learn from the requests, every greedy
    answer is plain decoding's, and the worker ends with the app."""
    from fastapi.testclient import TestClient

    from verispec.server.app import build_app

    prompts = ["def add(a, b):\n", "The capital of France is", "for i in range(10):\n"]
    expected = [verispec.generate("smollm2-135m", p, drafter="none", max_new_tokens=24).text for p in prompts]
    app = build_app("smollm2-135m", online=OnlineConfig(window=8, tokens_per_step=2, max_busy=1.0, batch_windows=2))
    with TestClient(app) as client:
        for _ in range(2):
            for prompt, text in zip(prompts, expected):
                body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
                response = client.post("/v1/completions", json=body)
                assert response.status_code == 200 and response.json()["choices"][0]["text"] == text
        assert any(t.name == WORKER for t in threading.enumerate())
    online = app.state.online
    assert online.served_tokens > 100 and online.steps > 0 and online.error is None
    assert not any(t.name == WORKER for t in threading.enumerate())
    with pytest.raises(VerispecError, match="Medusa"):
        build_app("smollm2-135m", drafter="ngram", online=OnlineConfig())
