"""The OpenAI-compatible server: a real server process on smollm2-135m, spoken to with the `openai` client and raw httpx.

The server drafts with the model itself (self-speculation: nearly every draft token is accepted, so
the batched draft/verify path does real work) and is checked against plain single-request decoding
in this process. The worker's fault handling is tested in-process on tiny random models.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
import torch

import verispec
from verispec import zoo
from verispec.api import make_drafter
from verispec.engine import DecodeBatch, TokenEvent
from verispec.text import encode_chat
from verispec.errors import VerispecError
from verispec.server import Job, JobFailed, Scheduler, ServerProcess, build_app
from verispec.server.process import ServerStartError

from conftest import job, perturbed_copy, tiny_llama

API_KEY = "test-key"
MODEL = "smollm2-135m"
MAX_BATCH = 8
MAX_QUEUE = 24  # the disconnect load test's 32 clients fill the batch and the queue exactly
LOAD_TOKENS = 10  # max_tokens for the load test's requests
# Distinct prompts for the load test, one per concurrent client.
LOAD_PROMPTS = [f"Question {i}: what is {i} plus {i + 3}? Answer:" for i in range(8)] + [
    f"The {word} is a kind of" for word in ("falcon", "violin", "glacier", "tulip", "comet", "otter", "sonnet", "canyon")
]
PROMPT = "The three primary colors are"
CHAT = "Name two planets."


@dataclass
class Server:
    process: ServerProcess
    plain: dict  # (prompt, max_tokens, chat) -> text from plain single-request decoding in this process

    @property
    def url(self) -> str:
        return self.process.url

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120, **kwargs)

    def post(self, path: str, body=None, key: str | None = API_KEY, timeout=120) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        return parse_prometheus(httpx.get(self.url + "/metrics", timeout=30).text)

    def rss_kb(self) -> int:
        with open(f"/proc/{self.process.proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

    def wait_idle(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.metrics()
            if m["verispec_batch_size"] == 0 and m["verispec_queue_depth"] == 0:
                return
            time.sleep(0.2)
        raise AssertionError(f"the server still has work in flight after {timeout}s: {self.metrics()['verispec_batch_size']} rows")


def parse_prometheus(text: str) -> dict[str, float]:
    """'name{labels} value' lines -> {'name{labels}': value}; fails on any line that is not valid."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            assert line == "" or line.startswith(("# HELP ", "# TYPE ")), line
            continue
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    return samples


@pytest.fixture(scope="module")
def server():
    zoo.pull("smollm2-135m")
    # The model drafts for itself from a bf16 copy of its matrices. One thread each for the server
    # and this process: the machine has two cores.
    process = ServerProcess(["--target", "smollm2-135m", "--draft", "smollm2-135m", "--draft-dtype", "bf16", "--draft-len", "4",
                             "--api-key", API_KEY, "--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE)], threads=1).start()
    try:
        # While the server loads: the reference outputs, plain decoding one request at a time.
        torch.set_num_threads(1)
        model = verispec.load("smollm2-135m")
        plain = {(p, LOAD_TOKENS, False): verispec.generate(model, p, drafter="none", max_new_tokens=LOAD_TOKENS).text
                 for p in LOAD_PROMPTS}
        plain[(PROMPT, 24, False)] = verispec.generate(model, PROMPT, drafter="none", max_new_tokens=24).text
        plain[(CHAT, 24, True)] = verispec.generate(model, CHAT, drafter="none", max_new_tokens=24, chat=True).text
        try:
            process.wait_ready(timeout=180)
        except ServerStartError as exc:
            pytest.fail(str(exc))
        yield Server(process, plain)
    finally:
        process.stop()


# ---------------------------------------------------------------------------------------------------
# Correctness through the official client


def test_models_and_health(server):
    assert [m.id for m in server.client().models.list().data] == ["smollm2-135m"]
    health = httpx.get(server.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["model"] == "smollm2-135m"


def test_model_card_version_tokenize_and_detokenize(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    card = server.client().models.retrieve(MODEL)
    assert card.id == MODEL and card.max_model_len == 8192
    with pytest.raises(openai.NotFoundError):
        server.client().models.retrieve("gpt-4")
    assert httpx.get(server.url + "/version", timeout=10).json()["version"] == verispec.__version__
    tokenizer = verispec.load(MODEL).tokenizer
    tokens = server.post("/tokenize", {"prompt": PROMPT}).json()
    assert tokens["tokens"] == tokenizer(PROMPT)["input_ids"] and tokens["count"] == len(tokens["tokens"])
    chat = server.post("/tokenize", {"messages": [{"role": "user", "content": CHAT}]}).json()
    assert chat["tokens"] == encode_chat(tokenizer, [{"role": "user", "content": CHAT}])
    assert server.post("/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"] == PROMPT
    assert server.post("/detokenize", {"tokens": [-1]}).status_code == 400
    assert server.post("/tokenize", {"prompt": 5}).status_code == 400
    assert server.post("/tokenize", {"prompt": PROMPT}, key="wrong").status_code == 401
    assert httpx.post(server.url + "/tokenize", content=b"{oops", headers=headers, timeout=10).status_code == 400


def test_greedy_completion_matches_plain_decoding(server):
    result = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert result.choices[0].text == server.plain[(PROMPT, 24, False)]
    assert result.choices[0].finish_reason in ("length", "stop")
    usage = result.usage
    assert usage.prompt_tokens == len(verispec.load("smollm2-135m").tokenizer(PROMPT)["input_ids"])
    assert 0 < usage.completion_tokens <= 24 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    spec = usage.model_extra["speculative"]
    assert set(spec) == {"drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_tokens", "target_passes"}
    assert spec["accepted_tokens"] > 0 and spec["mean_accepted_tokens"] > 1.5  # the model drafting for itself
    assert spec["target_passes"] < usage.completion_tokens


def test_greedy_chat_matches_plain_decoding(server):
    client = server.client()
    messages = [{"role": "user", "content": CHAT}]
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert result.choices[0].message.content == server.plain[(CHAT, 24, True)]
    assert result.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == result.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == result.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [result.choices[0].finish_reason]


def test_streamed_completion_equals_non_streamed(server):
    client = server.client()
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == server.plain[(PROMPT, 24, False)]
    assert chunks[-1].usage.model_extra["speculative"]["target_passes"] > 0


def test_per_request_speculation_settings(server):
    """speculate=false decodes plainly, draft_len overrides k; greedy text is the same either way."""
    expected = server.plain[(PROMPT, 24, False)]
    plain = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "speculate": False}).json()
    assert plain["choices"][0]["text"] == expected
    assert plain["usage"]["speculative"]["drafted_tokens"] == 0
    assert plain["usage"]["speculative"]["target_passes"] == plain["usage"]["completion_tokens"]
    short = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "draft_len": 1}).json()
    assert short["choices"][0]["text"] == expected
    spec = short["usage"]["speculative"]
    assert spec["drafted_tokens"] <= spec["target_passes"]  # at most one draft token per pass
    tree = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "draft_len": "tree"}).json()
    assert tree["choices"][0]["text"] == expected


def test_sampling_with_seed_and_n(server):
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 7, "n": 2}
    first, second = (server.post("/v1/completions", body).json() for _ in range(2))
    texts = [c["text"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1]
    assert texts == [c["text"] for c in second["choices"]]  # seeded: reproducible
    assert 0 < first["usage"]["completion_tokens"] <= 2 * 12
    # Choice i uses seed + i: choice 1 is what a lone request with seed 8 gives.
    alone = server.post("/v1/completions", {**body, "n": 1, "seed": 8}).json()
    assert alone["choices"][0]["text"] == texts[1]


def test_coupled_sampling_is_the_same_with_or_without_speculation(server):
    """"coupled": true: a seeded sampled request gets the tokens plain sampling gets with that seed."""
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.8, "top_p": 0.95, "seed": 3, "coupled": True}
    plain = server.post("/v1/completions", {**body, "speculate": False}).json()
    spec = server.post("/v1/completions", body).json()
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    assert spec["usage"]["speculative"]["drafted_tokens"] > 0 and plain["usage"]["speculative"]["drafted_tokens"] == 0


def test_sampled_requests_may_ask_for_token_by_token_verification(server):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.8, "seed": 3}
    for blockwise in (True, False):
        response = server.post("/v1/completions", {**body, "blockwise": blockwise})
        assert response.status_code == 200
        assert response.json()["usage"]["speculative"]["drafted_tokens"] > 0


# ---------------------------------------------------------------------------------------------------
# Every sampling option, exact under speculation: the server (drafting for itself) against plain decoding

SERVER_OPTIONS = {
    "presence": dict(presence_penalty=1.2),
    "frequency": dict(frequency_penalty=0.9),
    "repetition": dict(repetition_penalty=1.5),
    "min_p": dict(min_p=0.3),
    "all": dict(presence_penalty=0.6, frequency_penalty=0.3, repetition_penalty=1.2, min_p=0.05, min_tokens=8),
}


@pytest.fixture(scope="module")
def model():
    return verispec.load("smollm2-135m")


def with_bias(model, options: dict) -> dict:
    """The options as the API takes them, and as the body does (logit_bias keys are strings in JSON)."""
    body = dict(options)
    if "logit_bias" in options:
        body["logit_bias"] = {str(k): v for k, v in options["logit_bias"].items()}
    return body


@pytest.mark.parametrize("name", sorted(SERVER_OPTIONS) + ["logit_bias", "min_tokens"])
def test_greedy_output_with_each_option_is_plain_decodings(server, model, name):
    if name == "logit_bias":  # ban the plain answer's third token, favour a word
        third = verispec.generate(model, PROMPT, drafter="none", max_new_tokens=3).token_ids[2]
        options = dict(logit_bias={third: -100, model.tokenizer(" blue")["input_ids"][0]: 4.0})
    elif name == "min_tokens":  # EOS made likely everywhere, and held off for 10 tokens
        options = dict(min_tokens=10, logit_bias={min(model.eos_token_ids): 12.0})
    else:
        options = SERVER_OPTIONS[name]
    plain = verispec.generate(model, PROMPT, drafter="none", max_new_tokens=24, **options)
    assert plain.text != server.plain[(PROMPT, 24, False)] or name == "min_p"  # the option changes the answer
    response = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, **with_bias(model, options)})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == plain.text
    assert response.json()["usage"]["speculative"]["accepted_tokens"] > 0  # it did speculate


def test_greedy_chat_with_penalties_is_plain_decodings(server, model):
    options = SERVER_OPTIONS["all"]
    plain = verispec.generate(model, CHAT, drafter="none", max_new_tokens=24, chat=True, **options)
    result = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": CHAT}], max_tokens=24, temperature=0,
        presence_penalty=options["presence_penalty"], frequency_penalty=options["frequency_penalty"],
        extra_body={k: options[k] for k in ("repetition_penalty", "min_p", "min_tokens")})
    assert result.choices[0].message.content == plain.text


def test_completion_logprobs_equal_plain_decodings(server, model):
    options = SERVER_OPTIONS["all"]
    plain = verispec.generate(model, PROMPT, drafter="none", max_new_tokens=16, logprobs=3, **options)
    for mode, processed in (("raw", False), ("processed", True)):
        expected = plain if not processed else verispec.generate(model, PROMPT, drafter="none", max_new_tokens=16, logprobs=3,
                                                                 processed_logprobs=True, **options)
        result = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=3,
                                                    presence_penalty=options["presence_penalty"],
                                                    frequency_penalty=options["frequency_penalty"],
                                                    extra_body={"logprobs_mode": mode, **{k: options[k] for k in ("repetition_penalty", "min_p", "min_tokens")}})
        logprobs = result.choices[0].logprobs
        assert logprobs.tokens == [model.tokenizer.decode([t]) for t in expected.token_ids]
        assert len(logprobs.token_logprobs) == len(expected.token_ids)
        # the verify pass is row-exact on the native kernels: the same logits, so within float noise of plain's
        assert max(abs(a - b.logprob) for a, b in zip(logprobs.token_logprobs, expected.logprobs)) < 1e-5
        for got, want in zip(logprobs.top_logprobs, expected.logprobs):
            listed = {model.tokenizer.decode([t]): v for t, v in want.top}
            assert set(got) == set(listed) | {model.tokenizer.decode([want.token])}
            assert all(abs(got[k] - v) < 1e-5 for k, v in listed.items())
        assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    streamed = list(server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=3,
                                                       presence_penalty=options["presence_penalty"], stream=True,
                                                       frequency_penalty=options["frequency_penalty"],
                                                       extra_body={k: options[k] for k in ("repetition_penalty", "min_p", "min_tokens")}))
    token_logprobs = [v for c in streamed if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert len(token_logprobs) == len(plain.token_ids)
    assert max(abs(a - b.logprob) for a, b in zip(token_logprobs, plain.logprobs)) < 1e-5


def test_chat_logprobs_equal_plain_decodings(server, model):
    plain = verispec.generate(model, CHAT, drafter="none", max_new_tokens=16, chat=True, logprobs=2)
    result = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CHAT}], max_tokens=16,
                                                     temperature=0, logprobs=True, top_logprobs=2)
    content = result.choices[0].logprobs.content
    assert [c.token for c in content] == [model.tokenizer.decode([t]) for t in plain.token_ids]
    assert max(abs(c.logprob - p.logprob) for c, p in zip(content, plain.logprobs)) < 1e-5
    assert all(c.bytes == list(c.token.encode()) and len(c.top_logprobs) == 2 for c in content)
    assert [[t.token for t in c.top_logprobs] for c in content] == [[model.tokenizer.decode([i]) for i, _ in p.top] for p in plain.logprobs]
    plain_chat = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CHAT}], max_tokens=16,
                                                         temperature=0)
    assert plain_chat.choices[0].logprobs is None


def test_echo_puts_the_prompt_before_the_completion(server):
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "echo": True}
    assert server.post("/v1/completions", body).json()["choices"][0]["text"] == PROMPT + server.plain[(PROMPT, 24, False)]
    streamed = "".join(c.choices[0].text for c in server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, echo=True, stream=True))
    assert streamed == PROMPT + server.plain[(PROMPT, 24, False)]


def test_a_seeded_request_gives_the_same_text_every_time(server):
    """By default (no "coupled" field): twice with speculation, once without, once beside batch mates."""
    body = {"prompt": "Once upon a time", "max_tokens": 20, "temperature": 1.0, "seed": 123, "presence_penalty": 0.4}
    first = server.post("/v1/completions", body).json()
    assert first["usage"]["speculative"]["drafted_tokens"] > 0
    again = server.post("/v1/completions", body).json()
    plain = server.post("/v1/completions", {**body, "speculate": False}).json()
    with httpx.Client(timeout=120) as client:  # with other requests decoding beside it
        headers = {"Authorization": f"Bearer {API_KEY}"}
        mates = [client.build_request("POST", server.url + "/v1/completions", json={"prompt": p, "max_tokens": 20,
                                                                                     "temperature": 0.7}, headers=headers)
                 for p in LOAD_PROMPTS[:3]]
        results = {}

        def send(key, request):
            results[key] = client.send(request).json()

        threads = [threading.Thread(target=send, args=(i, r)) for i, r in enumerate(mates)]
        threads.append(threading.Thread(target=send, args=("seeded", client.build_request(
            "POST", server.url + "/v1/completions", json={**body, "draft_len": 2}, headers=headers))))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    texts = {r["choices"][0]["text"] for r in (first, again, plain, results["seeded"])}
    assert len(texts) == 1, texts


def test_stop_sequence(server):
    full = server.plain[(PROMPT, 24, False)]
    stop = full.strip().split()[2]  # a word the model will produce
    result = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert result.choices[0].finish_reason == "stop"
    assert result.choices[0].text == full[: full.index(stop)]
    streamed = "".join(c.choices[0].text for c in server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True))
    assert streamed == result.choices[0].text


# ---------------------------------------------------------------------------------------------------
# Load, disconnects, memory


def test_concurrent_streams_are_not_mixed_and_memory_is_stable(server):
    """16 concurrent streaming clients, 10 rounds: every response equals its prompt's single-request output."""
    client = server.client()
    rss = []
    for _ in range(10):
        results: dict[str, str] = {}
        errors: list[BaseException] = []

        def run(prompt: str) -> None:
            try:
                stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=LOAD_TOKENS, temperature=0, stream=True)
                results[prompt] = "".join(c.choices[0].text for c in stream if c.choices)
            except BaseException as exc:  # reported below, with the prompt
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(p,)) for p in LOAD_PROMPTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        for prompt in LOAD_PROMPTS:
            assert results[prompt] == server.plain[(prompt, LOAD_TOKENS, False)], prompt
        server.wait_idle()
        time.sleep(0.5)  # the worker hands freed heap pages back as it goes idle, just after the batch empties
        rss.append(server.rss_kb())
    # The first rounds warm up allocators and the native KV store, whose capacity doubles as the batch fills.
    # The worker hands freed heap pages back to the system as it goes idle (`scheduler.release_free_memory`),
    # so an idle reading is the live memory: flat to 1 MB over rounds 3-10 here, where without the trim glibc's
    # arenas moved it by ~150 MB from round to round in no order (a failed CI run: 1382-1531 MB). A leak is a
    # trend: the median of rounds 7-10 is held to that of rounds 3-6, 32 MB apart at most, where a leak of
    # 0.5 MB per request would put 32 MB between them.
    early, late = statistics.median(rss[2:6]), statistics.median(rss[6:10])
    assert late - early < 32 * 1024, f"server RSS grew across rounds: {[r // 1024 for r in rss]} MB"
    metrics = server.metrics()
    assert metrics["verispec_time_to_first_token_seconds_count{endpoint=\"/v1/completions\"}"] >= 10 * len(LOAD_PROMPTS)


def test_disconnect_mid_stream_frees_the_slot(server):
    server.wait_idle()
    body = {"prompt": "Once upon a time, in a land far away,", "max_tokens": 4000, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60) as response:
        assert response.status_code == 200
        # Hold on to the line iterator: dropping it makes httpx close the connection, i.e. disconnect early.
        lines = response.iter_lines()
        while not (line := next(lines)).startswith("data: ") or not json.loads(line[6:])["choices"][0]["text"]:
            pass
        assert server.metrics()["verispec_batch_size"] == 1  # still decoding
    server.wait_idle(timeout=10)  # 4000 tokens would take minutes: the row was removed
    assert server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}).status_code == 200


def test_disconnect_while_waiting_for_a_non_streamed_answer(server):
    server.wait_idle()
    with pytest.raises(httpx.ReadTimeout):
        server.post("/v1/completions", {"prompt": "Once upon a time, in a land far away,", "max_tokens": 4000, "temperature": 0},
                    timeout=httpx.Timeout(30, read=2))
    server.wait_idle(timeout=10)


def test_a_full_queue_answers_503_and_the_server_keeps_serving(server):
    """max_batch rows decoding and max_queue requests waiting: one more gets an OpenAI-style 503 at once."""
    server.wait_idle()
    body = {"prompt": "Once upon a time, in a land far away,", "max_tokens": 4000, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with contextlib.ExitStack() as streams:
        for _ in range(MAX_BATCH + MAX_QUEUE):
            response = streams.enter_context(httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=60))
            assert response.status_code == 200
        # Rows are taken between steps, a few prompts read per step: on a slow CPU filling the batch takes a while.
        full = {"verispec_batch_size": MAX_BATCH, "verispec_queue_depth": MAX_QUEUE}
        deadline = time.monotonic() + 90
        while {k: server.metrics()[k] for k in full} != full and time.monotonic() < deadline:
            time.sleep(0.1)
        metrics = server.metrics()
        seen = {k: v for k, v in metrics.items() if k.startswith(("verispec_batch", "verispec_queue", "verispec_worker", "verispec_step"))}
        assert {k: metrics[k] for k in full} == full, f"{seen}\nserver log:\n{server.process.log_text()[-3000:]}"
        started = time.monotonic()
        refused = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
        assert time.monotonic() - started < 5  # answered at once, not after waiting
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "server_error" and error["code"] == "server_busy"
        assert "busy" in error["message"] and "retry" in error["message"].lower()
        with pytest.raises(openai.InternalServerError):  # the official client sees it as a 503 (and would retry)
            server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CHAT}], max_tokens=4, stream=True)
        assert server.metrics()["verispec_queue_rejected_total"] >= 2
    # The clients left: their rows and queue places are freed, and the server serves again.
    server.wait_idle(timeout=30)
    good = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0})
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == server.plain[(PROMPT, 24, False)]


def test_sampled_requests_may_opt_into_typical_acceptance(server):
    """The lossy rule is per request: asked for, it runs (and keeps more draft tokens than none at all)."""
    server.wait_idle(timeout=60)
    before = server.metrics().get("verispec_lossy_sequences_total", 0)
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.8, "seed": 3, "typical_acceptance": 0.09}
    response = server.post("/v1/completions", body)
    assert response.status_code == 200
    assert response.json()["usage"]["speculative"]["drafted_tokens"] > 0
    assert server.metrics()["verispec_lossy_sequences_total"] == before + 1  # operators can see it was asked for


def test_a_request_that_can_never_fit_gets_a_400_not_a_503():
    from fastapi.testclient import TestClient

    app = build_app("smollm2-135m", drafter="ngram", max_batch=1, max_queue=1)
    with TestClient(app) as client:
        response = client.post("/v1/completions", json={"prompt": PROMPT, "n": 3, "max_tokens": 2})
        assert response.status_code == 400 and response.json()["error"]["param"] == "n", response.text
        assert "at most 2" in response.json()["error"]["message"]
        assert client.post("/v1/completions", json={"prompt": PROMPT, "n": 2, "max_tokens": 2}).status_code == 200


def test_served_model_name_max_model_len_and_chat_template(tmp_path):
    from fastapi.testclient import TestClient

    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}<<assistant>>")
    app = build_app("smollm2-135m", drafter="ngram", model_name="tiny", max_model_len=64, chat_template=str(template))
    with TestClient(app) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny"]
        assert client.get("/v1/models/tiny").json()["max_model_len"] == 64
        ok = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        assert ok.status_code == 200, ok.text
        too_long = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 60})
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
        ids = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
        tokenizer = verispec.load("smollm2-135m").tokenizer
        assert tokenizer.decode(ids) == "<<user>> hi\n<<assistant>>"
        assert "<<assistant>>" not in (tokenizer.chat_template or "")  # the shared model's own template is untouched
    with pytest.raises(VerispecError, match="chat-template"):
        build_app("smollm2-135m", drafter="ngram", chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(VerispecError, match="max_model_len"):
        build_app("smollm2-135m", drafter="ngram", max_model_len=1)


def test_server_options_are_checked_before_loading():
    with pytest.raises(VerispecError, match="max_queue"):
        build_app("smollm2-135m", max_queue=-1)
    with pytest.raises(VerispecError, match="draft_dtype"):
        build_app("smollm2-135m", draft="smollm2-135m", draft_dtype="fp16")
    with pytest.raises(VerispecError, match="--draft"):
        build_app("smollm2-135m", drafter="ngram", draft_dtype="bf16")
    with pytest.raises(VerispecError, match="draft_vocab must be"):
        build_app("smollm2-135m", draft="smollm2-135m", draft_vocab=-3)
    with pytest.raises(VerispecError, match="--draft-vocab"):
        build_app("smollm2-135m", drafter="ngram", draft_vocab=4096)
    for bad in (0, -1.0, "0.5", True):
        with pytest.raises(VerispecError, match="prefill_seconds must be"):
            build_app("smollm2-135m", prefill_seconds=bad)


def test_serve_flags_reach_build_app(monkeypatch):
    """`verispec serve --prefill-seconds`: a number of seconds, or 0 for the token budget alone (None)."""
    from verispec.server import app

    seen = []
    monkeypatch.setattr(app, "serve", lambda target, **options: seen.append(options))
    app.main(["--target", "smollm2-135m", "--prefill-seconds", "0.1"])
    app.main(["--target", "smollm2-135m", "--prefill-seconds", "0"])
    app.main(["--target", "smollm2-135m"])
    assert [options["prefill_seconds"] for options in seen] == [0.1, None, 0.25]


# ---------------------------------------------------------------------------------------------------
# Bad input: an OpenAI-style 4xx each, and the server keeps serving

LONG_PROMPT = [1] * 8200  # past smollm2's 8192-token context

BAD_REQUESTS = [
    # (path, body or raw bytes, key, status, param)
    ("/v1/completions", b"{not json", API_KEY, 400, None),
    ("/v1/completions", [1, 2], API_KEY, 400, None),
    ("/v1/completions", {"prompt": PROMPT, "model": "gpt-4"}, API_KEY, 404, "model"),
    ("/v1/completions", {"max_tokens": 4}, API_KEY, 400, "prompt"),
    ("/v1/completions", {"prompt": 42}, API_KEY, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], "x", 3]}, API_KEY, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, API_KEY, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, API_KEY, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, API_KEY, 400, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, API_KEY, 400, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": -3}, API_KEY, 400, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": "ten"}, API_KEY, 400, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": True}, API_KEY, 400, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 9000}, API_KEY, 400, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": -0.1}, API_KEY, 400, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": 2.5}, API_KEY, 400, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}, API_KEY, 400, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, API_KEY, 400, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 1.5}, API_KEY, 400, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "top_k": -1}, API_KEY, 400, "top_k"),
    ("/v1/completions", {"prompt": PROMPT, "seed": "abc"}, API_KEY, 400, "seed"),
    ("/v1/completions", {"prompt": PROMPT, "n": 0}, API_KEY, 400, "n"),
    ("/v1/completions", {"prompt": PROMPT, "n": 17}, API_KEY, 400, "n"),
    ("/v1/completions", {"prompt": PROMPT, "stop": ["a", "b", "c", "d", "e"]}, API_KEY, 400, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "stop": [""]}, API_KEY, 400, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, API_KEY, 400, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": True}, API_KEY, 400, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs_mode": "cooked"}, API_KEY, 400, "logprobs_mode"),
    ("/v1/completions", {"prompt": PROMPT, "presence_penalty": 2.5}, API_KEY, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": PROMPT, "frequency_penalty": "1"}, API_KEY, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"1": 500}}, API_KEY, 400, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"one": 5}}, API_KEY, 400, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"\u00b2": 5}}, API_KEY, 400, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"99999999": 5}}, API_KEY, 400, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": [[1, 5]]}, API_KEY, 400, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "best_of": 2}, API_KEY, 400, "best_of"),
    ("/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 1}, API_KEY, 400, "echo"),
    ("/v1/completions", {"prompt": PROMPT, "echo": "yes"}, API_KEY, 400, "echo"),
    ("/v1/completions", {"prompt": PROMPT, "suffix": "end"}, API_KEY, 400, "suffix"),
    ("/v1/completions", {"prompt": PROMPT, "repetition_penalty": 0}, API_KEY, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": PROMPT, "min_tokens": 30, "max_tokens": 4}, API_KEY, 400, "min_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "min_tokens": -1}, API_KEY, 400, "min_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "draft_len": 0}, API_KEY, 400, "draft_len"),
    ("/v1/completions", {"prompt": PROMPT, "draft_len": "deep"}, API_KEY, 400, "draft_len"),
    ("/v1/completions", {"prompt": PROMPT, "coupled": "yes"}, API_KEY, 400, "coupled"),
    ("/v1/completions", {"prompt": PROMPT, "blockwise": 1}, API_KEY, 400, "blockwise"),
    ("/v1/completions", {"prompt": PROMPT, "typical_acceptance": 1.0}, API_KEY, 400, "typical_acceptance"),
    ("/v1/completions", {"prompt": PROMPT, "typical_acceptance": "high"}, API_KEY, 400, "typical_acceptance"),
    ("/v1/completions", {"prompt": PROMPT, "typical_acceptance": 0.1, "coupled": True}, API_KEY, 400, "typical_acceptance"),
    ("/v1/completions", {"prompt": PROMPT, "draft_len": 3, "speculate": False}, API_KEY, 400, "draft_len"),
    ("/v1/completions", {"prompt": PROMPT, "speculate": "yes"}, API_KEY, 400, "speculate"),
    ("/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True}}, API_KEY, 400, "stream_options"),
    ("/v1/chat/completions", {"max_tokens": 4}, API_KEY, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, API_KEY, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, API_KEY, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     API_KEY, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, API_KEY, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],  # smollm2's template has no tools
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, API_KEY, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, API_KEY, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}, API_KEY, 400,
     "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema",
     "json_schema": {"name": "x", "schema": {"type": "frob"}}}}, API_KEY, 400, "response_format"),
    ("/v1/completions", {"prompt": PROMPT, "response_format": {"type": "regex", "pattern": "(a"}}, API_KEY, 400, "response_format"),
    ("/v1/completions", {"prompt": PROMPT, "response_format": {"type": "json_object"}, "min_tokens": 2}, API_KEY, 400, "min_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "tool"}]}, API_KEY, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 2}, API_KEY, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, API_KEY, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 50},
     API_KEY, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10000}, API_KEY, 400, "max_tokens"),
    ("/v1/completions", '{"prompt": "\\ud800 lone surrogate"}'.encode(), API_KEY, 400, None),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x\\udfff"}]}'.encode(), API_KEY, 400, None),
    ("/v1/completions", b"[" * 1000 + b"]" * 1000, API_KEY, 400, None),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ' + b"7" * 5000 + b"}", API_KEY, 400, None),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 10**40}, API_KEY, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x" * 5_000_000}, API_KEY, 413, None),
    ("/v1/completions", {"prompt": "many words " * 300_000}, API_KEY, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "many words " * 300_000}]}, API_KEY, 400, "messages"),
    ("/v1/completions", {"prompt": PROMPT, "min_p": 1.1}, API_KEY, 400, "min_p"),
    ("/v1/completions", {"prompt": PROMPT}, None, 401, None),
    ("/v1/completions", {"prompt": PROMPT}, "wrong-key", 401, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "wrong-key", 401, None),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server):
    for path, body, key, status, param in BAD_REQUESTS:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if isinstance(body, bytes):
            response = httpx.post(server.url + path, content=body, headers={**headers, "Content-Type": "application/json"}, timeout=30)
        else:
            response = httpx.post(server.url + path, json=body, headers=headers, timeout=30)
        case = f"{path} {str(body)[:80]} -> {response.status_code} {response.text[:200]}"
        assert response.status_code == status, case
        assert len(response.content) < 1000, case  # the input is not echoed back whole
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], case
        assert error["type"] == "invalid_request_error", case
        if param is not None:
            assert error["param"] == param, case
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(server.url + "/v1/no-such-thing", timeout=10).status_code == 404
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    # Missing model is fine; so is a list holding one prompt, and token ids.
    good = server.post("/v1/completions", {"prompt": [PROMPT], "max_tokens": 24, "temperature": 0})
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == server.plain[(PROMPT, 24, False)]
    ids = verispec.load("smollm2-135m").tokenizer(PROMPT)["input_ids"]
    assert server.post("/v1/completions", {"prompt": ids, "max_tokens": 24, "temperature": 0}).json()["choices"][0]["text"] == \
        server.plain[(PROMPT, 24, False)]


def malformed_bodies() -> list[bytes]:
    """100+ bodies a careless or hostile client might send: wrong types and values in every field, broken JSON."""
    good = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    odd_values = [None, -1, 0, 1.5, 10**30, -(10**30), "x", "", "\ud800", [], [None], {}, {"a": {"b": [1]}}, True,
                  float("nan"), float("inf"), "x" * 5000, [[[[[]]]]], [-1, 2**40]]
    bodies = []
    for name in ("prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "stream", "stream_options",
                 "draft_len", "speculate", "coupled", "typical_acceptance", "logit_bias", "model", "echo", "logprobs",
                 "top_logprobs", "presence_penalty", "repetition_penalty", "min_p", "min_tokens", "logprobs_mode",
                 "response_format", "tools", "tool_choice", "parallel_tool_calls"):
        for value in odd_values[:: 1 if name in ("prompt", "stop", "max_tokens") else 3]:
            bodies.append(json.dumps({**good, name: value}).encode())
    text = json.dumps(good).encode()
    bodies += [text[:cut] for cut in range(0, len(text), 4)]  # truncated JSON
    bodies += [b"", b"null", b"0", b'"a string"', b"\xff\xfe{}", b'{"prompt": "a"' + b', "x": 1' * 2000, b"{" * 5000,
               b'{"prompt": [' + b"1," * 100000 + b"1]}", b"[" * 100000]
    return bodies


def server_errors(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items() if k.startswith("verispec_requests_total") and 'status="500"' in k)


def test_fuzzed_bodies_never_get_a_5xx_and_the_server_keeps_serving(server):
    before = server_errors(server.metrics())
    bodies = malformed_bodies()
    assert len(bodies) >= 100
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    with httpx.Client(timeout=120) as client:
        for path in ("/v1/completions", "/v1/chat/completions"):
            for body in bodies:
                response = client.post(server.url + path, content=body, headers=headers)
                assert response.status_code < 500, f"{path} {body[:100]!r} -> {response.status_code} {response.text[:300]}"
                if response.status_code >= 400:
                    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
                    assert len(response.content) < 1000, body[:100]
    server.wait_idle(timeout=60)
    good = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0})
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == server.plain[(PROMPT, 24, False)]
    assert server_errors(server.metrics()) == before


def test_unknown_fields_are_ignored_and_named_in_a_header(server):
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "metadata": {"run": "7"}, "store": False,
            "chat_template_kwargs": {"enable_thinking": False}}
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == server.plain[(PROMPT, 24, False)]
    assert set(response.headers["x-verispec-ignored-fields"].split(",")) == {"metadata", "store", "chat_template_kwargs"}
    chat = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CHAT}], max_tokens=24,
                                                   temperature=0, metadata={"a": "b"}, store=False)
    assert chat.choices[0].message.content == server.plain[(CHAT, 24, True)]


def test_a_third_of_32_streams_disconnect_and_every_other_finishes_correctly(server):
    """32 streaming clients at once (the batch and the queue full); 11 of them leave at random moments,
    some before their first token. Every other stream is complete and equals plain decoding."""
    import random

    server.wait_idle()
    rng = random.Random(7)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    stayers = [LOAD_PROMPTS[i % len(LOAD_PROMPTS)] for i in range(21)]
    results: dict[int, str] = {}
    errors: list[str] = []

    def stay(i: int, prompt: str) -> None:
        try:
            body = {"prompt": prompt, "max_tokens": LOAD_TOKENS, "temperature": 0, "stream": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=300) as response:
                assert response.status_code == 200, response.read()
                text, done = "", False
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        assert "error" not in chunk, chunk
                        text += "".join(c["text"] for c in chunk["choices"])
                assert done
                results[i] = text
        except BaseException as exc:  # reported below
            errors.append(f"{prompt!r}: {exc!r}")

    def leave(after_lines: int) -> None:
        body = {"prompt": "Once upon a time, in a land far away,", "max_tokens": 300, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=300) as response:
                lines = response.iter_lines()
                for _ in range(after_lines):
                    next(lines)
        except BaseException as exc:
            errors.append(f"leaver: {exc!r}")

    threads = [threading.Thread(target=stay, args=(i, p)) for i, p in enumerate(stayers)]
    threads += [threading.Thread(target=leave, args=(rng.choice([0, 1, 2, 5, 9, 20]),)) for _ in range(11)]
    rng.shuffle(threads)
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    for i, prompt in enumerate(stayers):
        assert results[i] == server.plain[(prompt, LOAD_TOKENS, False)], prompt
    server.wait_idle(timeout=60)
    metrics = server.metrics()
    assert metrics["verispec_step_failures_total"] == 0
    assert not any(k.startswith("verispec_sequence_failures_total") and 'status="500"' in k for k in metrics), metrics
    assert metrics['verispec_requests_total{endpoint="/v1/completions",status="499"}'] >= 1


def test_metrics_count_requests_and_speculation(server):
    before = server.metrics()
    assert server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}).status_code == 200
    assert server.post("/v1/completions", {"prompt": PROMPT, "top_p": 7}).status_code == 400
    after = server.metrics()
    ok, bad = 'verispec_requests_total{endpoint="/v1/completions",status="200"}', 'verispec_requests_total{endpoint="/v1/completions",status="400"}'
    assert after[ok] == before.get(ok, 0) + 1 and after[bad] == before.get(bad, 0) + 1
    for counter in ("verispec_generation_tokens_total", "verispec_prompt_tokens_total", "verispec_target_passes_total",
                    "verispec_drafted_tokens_total", "verispec_accepted_tokens_total"):
        assert after[counter] > before.get(counter, 0), counter
    assert 0 < after['verispec_acceptance_by_position{position="1"}'] <= 1
    assert after["verispec_mean_accepted_tokens"] > 1
    latency = 'verispec_request_latency_seconds_count{endpoint="/v1/completions"}'
    assert after[latency] == before.get(latency, 0) + 1
    assert after['verispec_request_latency_seconds_bucket{endpoint="/v1/completions",le="+Inf"}'] == after[latency]
    assert {"verispec_batch_size", "verispec_queue_depth", "verispec_step_failures_total"} <= set(after)
    # vLLM's names and meanings, with the model's name as a label.
    label = f'model_name="{MODEL}"'
    drafts, accepted = f"verispec:spec_decode_num_drafts_total{{{label}}}", f"verispec:spec_decode_num_accepted_tokens_total{{{label}}}"
    assert after[drafts] > before.get(drafts, 0) and after[accepted] == after["verispec_accepted_tokens_total"]
    assert after[f"verispec:spec_decode_num_draft_tokens_total{{{label}}}"] == after["verispec_drafted_tokens_total"]
    assert after[f'verispec:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="0"}}'] == \
        after['verispec_draft_position_accepted_total{position="1"}']
    assert after[f"verispec:e2e_request_latency_seconds_count{{{label}}}"] >= 1
    assert after[f"verispec:inter_token_latency_seconds_count{{{label}}}"] >= 1
    assert after[f'verispec:request_success_total{{finished_reason="length",{label}}}'] >= 1
    assert after[f"verispec:num_requests_running{{{label}}}"] == 0


def test_no_step_failed_and_the_log_is_clean(server):
    """Runs after the others: no request above was failed by an engine fault the tests did not see."""
    assert server.metrics()["verispec_step_failures_total"] == 0
    log = server.process.log_text()
    assert "Traceback" not in log, log[-4000:]


# ---------------------------------------------------------------------------------------------------
# The worker on its own (in-process, tiny random models): faults stay contained.


@pytest.fixture
def tiny_scheduler():
    torch.set_num_threads(1)
    target = tiny_llama(seed=0)
    draft = perturbed_copy(target, scale=0.05)
    scheduler = Scheduler(target, lambda speculate: make_drafter(target, draft, "model" if speculate else "none"), max_batch=4)
    scheduler.start()
    yield target, scheduler
    scheduler.stop()


def plain_tokens(target, prompt, max_new_tokens=12):
    return verispec.generate(target, prompt, drafter="none", max_new_tokens=max_new_tokens).token_ids


def test_worker_survives_a_failing_step(tiny_scheduler, monkeypatch):
    target, scheduler = tiny_scheduler
    real_step, calls = DecodeBatch.step, []

    def failing_once(self):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        return real_step(self)

    monkeypatch.setattr(DecodeBatch, "step", failing_once)
    victims = [job([5, 6, 7]), job([8, 9])]
    scheduler.submit([j for j, _ in victims])
    for _, collector in victims:
        failure = collector.result()
        assert isinstance(failure, JobFailed) and failure.status == 500
    survivor, collector = job([5, 6, 7])
    scheduler.submit([survivor])
    assert collector.result() == plain_tokens(target, [5, 6, 7])
    assert scheduler.step_failures == 1 and scheduler.thread.is_alive()


def test_rows_joining_a_batch_count_as_running(tiny_scheduler, monkeypatch):
    """A job whose prompt is read holds its row while it joins its lane: /metrics' batch size and queue depth
    must not lose it meanwhile (they once showed 1 of 8 rows for as long as the others took to join)."""
    target, scheduler = tiny_scheduler  # max_batch 4
    real_add, joining, seen = DecodeBatch.add, threading.Event(), []

    def slow_add(self, requests, *args, **kwargs):
        joining.set()
        seen.append((scheduler.running, scheduler.queue_depth))
        time.sleep(0.3)
        seen.append((scheduler.running, scheduler.queue_depth))
        return real_add(self, requests, *args, **kwargs)

    monkeypatch.setattr(DecodeBatch, "add", slow_add)
    prompts = [[5 + i, 6, 7] for i in range(6)]
    jobs = [job(prompt) for prompt in prompts]  # four rows, two waiting
    scheduler.submit([j for j, _ in jobs])
    for prompt, (_, collector) in zip(prompts, jobs):
        assert collector.result() == plain_tokens(target, prompt)
    assert joining.is_set()
    assert seen[:2] == [(4, 2), (4, 2)], seen  # the first four join together while the other two wait


def test_a_bad_request_fails_alone(tiny_scheduler):
    target, scheduler = tiny_scheduler
    (bad, bad_result), (good, good_result) = job([5, 10**6]), job([11, 12, 13])
    scheduler.submit([bad, good])
    failure = bad_result.result()
    assert isinstance(failure, JobFailed) and failure.status == 400 and "vocabulary" in failure.message
    assert good_result.result() == plain_tokens(target, [11, 12, 13])


def test_lanes_and_cancellation(tiny_scheduler):
    """A cancelled row leaves its batch at once and its slot is reused; requests with different draft
    settings (lanes) decode side by side, each exactly as plain decoding would."""
    target, scheduler = tiny_scheduler  # max_batch 4
    long_job, long_result = job([20, 21], max_new_tokens=400)
    scheduler.submit([long_job])
    first = long_result.items.get(timeout=30)
    assert isinstance(first, TokenEvent) and first.finish_reason is None  # it is in a batch, decoding
    prompts = [[5, 6, 7], [30, 31], [40, 41, 42, 43], [50]]
    jobs = [job(p, draft=d) for p, d in zip(prompts, [4, None, 1, "auto"])]
    scheduler.submit([j for j, _ in jobs])  # five rows for four slots: one waits for the cancelled row's slot
    scheduler.cancel([long_job.id])
    for prompt, (_, collector) in zip(prompts, jobs):
        assert collector.result() == plain_tokens(target, prompt)
    deadline = time.monotonic() + 10
    while scheduler.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scheduler.running == 0
    while not long_result.items.empty():  # the cancelled job never finished
        item = long_result.items.get()
        assert isinstance(item, TokenEvent) and item.finish_reason is None


@pytest.mark.parametrize("draft", [4, None])
def test_cancelling_one_row_leaves_its_batch_mates_decoding(draft):
    """A row cancelled mid-flight (its client left) leaves a batch of several on a native target, whose
    caches are inference tensors: its batch mates finish exactly as plain decoding, nothing fails."""
    from verispec.models.native import NativeCausalLM

    target = NativeCausalLM.from_hf(tiny_llama(seed=0))
    prompts = [[5, 6, 7, 5, 6], [30, 31], [40, 41, 42, 43], [50, 51]]
    # The references first: a native model runs one pass at a time, and the worker's thread will use it.
    plain = [plain_tokens(target, prompt, max_new_tokens=60) for prompt in prompts]
    scheduler = Scheduler(target, lambda speculate: make_drafter(target, None, "ngram" if speculate else "none"), max_batch=4)
    scheduler.start()
    try:
        jobs = [job(p, max_new_tokens=60, draft=draft) for p in prompts]
        scheduler.submit([j for j, _ in jobs])
        leaving = jobs[1][1].items.get(timeout=30)
        assert isinstance(leaving, TokenEvent) and leaving.finish_reason is None  # it is in the batch, decoding
        scheduler.cancel([jobs[1][0].id])
        for i, (prompt, (_, collector)) in enumerate(zip(prompts, jobs)):
            if i != 1:
                assert collector.result() == plain[i], prompt
        assert scheduler.step_failures == 0 and scheduler.thread.is_alive()
    finally:
        scheduler.stop()


def test_the_worker_hands_freed_memory_back_once_each_time_it_goes_idle(monkeypatch):
    """The worker trims the C heap when its last row leaves, once per idle spell: not while it decodes (a trim
    takes milliseconds) nor again while it waits, and the jobs still get plain decoding's tokens."""
    from verispec.server import scheduler as scheduling

    calls = []
    monkeypatch.setattr(scheduling, "release_free_memory", lambda: calls.append(scheduler.running))
    target = tiny_llama(seed=0)
    prompts = [[5, 6, 7, 5, 6], [30, 31]]
    plain = [plain_tokens(target, prompt, max_new_tokens=20) for prompt in prompts]
    scheduler = Scheduler(target, lambda speculate: make_drafter(target, None, "ngram" if speculate else "none"), max_batch=4)
    scheduler.start()
    try:
        assert calls == []  # idle from the start, with nothing freed
        for burst in range(2):
            jobs = [job(p, max_new_tokens=20) for p in prompts]
            scheduler.submit([j for j, _ in jobs])
            assert [collector.result() for _, collector in jobs] == plain
            deadline = time.monotonic() + 10
            while len(calls) < burst + 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)  # a worker that trimmed on every wake-up would have done it again by now
            assert calls == [0] * (burst + 1)
    finally:
        scheduler.stop()
    assert scheduling._malloc_trim() is not None or not sys.platform.startswith("linux")  # glibc has it


def test_a_reading_draft_head_in_a_lane_whose_rows_come_and_go():
    """A draft whose head scores 40 ids and its texts' own (`with_output_ids(..., reads=True)`) in a server lane:
    rows join a running batch (their texts' tokens join the set), one is cancelled (its leave), and every other
    row is plain decoding's; the draft still gets tokens accepted."""
    from verispec.models.native import NativeCausalLM

    target = NativeCausalLM.from_hf(tiny_llama(seed=0))
    draft = NativeCausalLM.from_hf(perturbed_copy(tiny_llama(seed=0), scale=0.05)).with_output_ids(torch.arange(40), reads=True)
    prompts = [[5, 6, 70, 5, 6], [80, 81, 90], [40, 41, 42, 93], [50, 95, 51], [60, 88, 61, 62]]
    plain = [plain_tokens(target, prompt, max_new_tokens=40) for prompt in prompts]
    stats = []
    scheduler = Scheduler(target, lambda speculate: make_drafter(target, draft, "model" if speculate else "none"), max_batch=4)
    scheduler.start()
    try:
        first = [job(p, max_new_tokens=40, draft=3) for p in prompts[:2]]
        scheduler.submit([j for j, _ in first])
        assert isinstance(first[1][1].items.get(timeout=30), TokenEvent)  # decoding: the next rows join a running batch
        rest = [job(p, max_new_tokens=40, draft=3) for p in prompts[2:]]
        scheduler.submit([j for j, _ in rest])
        scheduler.cancel([first[1][0].id])
        for i, (_, collector) in enumerate(first + rest):
            if i != 1:
                assert collector.result() == plain[i], prompts[i]
        assert scheduler.step_failures == 0 and scheduler.stats.accepted_tokens > 0
    finally:
        scheduler.stop()


def test_admission_bounds_the_stall(monkeypatch):
    """While rows decode, a few new prompts are read a bounded number of tokens per step, and a burst that
    outnumbers the running rows at once."""
    torch.set_num_threads(1)
    target = tiny_llama(seed=0)
    target.eos_token_ids = frozenset()  # the long rows must still be decoding when the newcomers arrive
    admitted: list[int] = []
    real_add = DecodeBatch.add

    def add(self, requests, readers=None, draft_readers=None):
        if threading.current_thread() is scheduler.thread:  # not the reference decoding in this thread
            admitted.append(len(requests))
        return real_add(self, requests, readers, draft_readers)

    monkeypatch.setattr(DecodeBatch, "add", add)
    scheduler = Scheduler(target, lambda speculate: make_drafter(target, None, "none"), max_batch=8, prefill_tokens=4)
    scheduler.start()
    try:
        runners = [job([20 + i, 21], max_new_tokens=400, draft=None) for i in range(4)]
        scheduler.submit([j for j, _ in runners])
        for _, collector in runners:
            assert isinstance(collector.items.get(timeout=30), TokenEvent)
        # 4 rows decoding, 2 new 4-token prompts: budget 4 tokens a step, so one prompt per admission.
        newcomers = [job([5, 6, 7, 8]), job([9, 10, 11, 12])]
        scheduler.submit([j for j, _ in newcomers])
        for (_, collector), (j, _) in zip(newcomers, newcomers):
            assert collector.result() == plain_tokens(target, j.request.prompt)
        assert admitted == [4, 1, 1]
        # With no row decoding, nobody waits for the prefill: a burst is read at once.
        scheduler.cancel([j.id for j, _ in runners])
        burst = [job([30 + i, 31, 32, 33]) for i in range(4)]
        deadline = time.monotonic() + 10
        while scheduler.running and time.monotonic() < deadline:
            time.sleep(0.05)
        scheduler.submit([j for j, _ in burst])
        for j, collector in burst:
            assert collector.result() == plain_tokens(target, j.request.prompt)
        assert admitted == [4, 1, 1, 4]
    finally:
        scheduler.stop()


def test_a_long_prompt_is_read_by_the_draft_model_between_steps_too(monkeypatch):
    """While rows decode, a long prompt is read by the draft model, as by the target, at most the step's budget at
    a time (a draft with llama.cpp's numerics reads any number of tokens per pass), and the drafter joins those
    reads instead of reading the whole prompt in one stall; every row is plain decoding's."""
    from verispec.drafters import ModelDrafter
    from verispec.models import kernels
    from verispec.models.native import NativeCausalLM

    if not kernels.available():
        pytest.skip("a Q4_0 draft runs on verispec's q8 kernels, unavailable here")
    torch.set_num_threads(1)
    target = NativeCausalLM.from_hf(tiny_llama(seed=0))
    target.eos_token_ids = frozenset()  # the runners must still be decoding when the newcomer arrives
    draft = NativeCausalLM.from_hf(perturbed_copy(tiny_llama(seed=0), scale=0.05), weight_dtype="q4_0")
    newcomer_prompt = [(7 * i + 3) % 90 + 1 for i in range(60)]
    plain = plain_tokens(target, newcomer_prompt, max_new_tokens=8)
    widths, joined = [], []
    real_forward, real_add = draft.forward, ModelDrafter.add
    monkeypatch.setattr(draft, "forward", lambda tokens, *args, **kwargs: widths.append(tokens.shape[1]) or real_forward(tokens, *args, **kwargs))

    def add(self, prompts, readers=None):
        joined.append(readers is not None)
        return real_add(self, prompts, readers)

    monkeypatch.setattr(ModelDrafter, "add", add)
    scheduler = Scheduler(target, lambda speculate: make_drafter(target, draft, "model" if speculate else "none"),
                          max_batch=4, prefill_tokens=4)
    scheduler.start()
    try:
        runners = [job([20 + i, 21], max_new_tokens=400) for i in range(2)]
        scheduler.submit([j for j, _ in runners])
        for _, collector in runners:
            assert isinstance(collector.items.get(timeout=30), TokenEvent)
        widths.clear()
        newcomer, collector = job(newcomer_prompt, max_new_tokens=8)
        scheduler.submit([newcomer])
        assert collector.result() == plain
        assert joined and all(joined)  # every prompt reached the drafter read
        assert max(widths) <= 8, widths  # budget-sized reads and draft steps; never the 59-token prompt at once
        scheduler.cancel([j.id for j, _ in runners])
    finally:
        scheduler.stop()


@pytest.mark.parametrize("prefill_seconds", [0.05, None])
def test_a_long_prompt_is_read_within_the_steps_seconds_budget(monkeypatch, prefill_seconds):
    """The budget between two steps is also one of seconds, turned into tokens at the rate the model has read prompts:
    on a slow target (here ~10 ms a token row, read in any split) a 59-token prompt is read ~5 tokens at a time for 0.05 s, not all
    within the token budget (10000) at once; without a seconds budget (None) it is. Rows are plain decoding's."""
    from verispec.models import kernels
    from verispec.models.native import NativeCausalLM

    if not kernels.available():
        pytest.skip("a model read in any split (llama.cpp's numerics) runs on verispec's q8 kernels, unavailable here")
    torch.set_num_threads(1)
    target = NativeCausalLM.from_hf(tiny_llama(seed=0), weight_dtype="q4_0")  # no fixed chunks: any split is exact
    target.eos_token_ids = frozenset()  # the runners must still be decoding when the newcomer arrives
    newcomer_prompt = [(7 * i + 3) % 90 + 1 for i in range(60)]
    plain = plain_tokens(target, newcomer_prompt, max_new_tokens=8)
    widths = []
    real_forward = target.forward

    def slow_forward(tokens, *args, **kwargs):
        if threading.current_thread() is scheduler.thread:
            widths.append(tokens.shape[1])
            time.sleep(0.01 * tokens.shape[1])
        return real_forward(tokens, *args, **kwargs)

    monkeypatch.setattr(target, "forward", slow_forward)
    scheduler = Scheduler(target, lambda speculate: make_drafter(target, None, "none"), max_batch=4, prefill_tokens=10_000,
                          prefill_seconds=prefill_seconds)
    scheduler.start()
    try:
        runners = [job([20 + i, 21, 22], max_new_tokens=400, draft=None) for i in range(2)]
        scheduler.submit([j for j, _ in runners])
        for _, collector in runners:
            assert isinstance(collector.items.get(timeout=30), TokenEvent)
        widths.clear()
        newcomer, collector = job(newcomer_prompt, max_new_tokens=8, draft=None)
        scheduler.submit([newcomer])
        assert collector.result() == plain
        if prefill_seconds is None:
            assert max(widths) == 59, widths
        else:
            assert widths.count(1) > 3 and max(widths) <= 12, widths  # ~5 tokens a read, decoding steps between
        scheduler.cancel([j.id for j, _ in runners])
    finally:
        scheduler.stop()


def test_a_server_without_a_draft_model_self_speculates():
    """`verispec serve` with no draft option: "auto" makes the target's int4 copy at start, and answers through
    HTTP are plain decoding's, from fewer target passes than tokens."""
    zoo.pull("smollm2-135m")
    process = ServerProcess(["--target", "smollm2-135m"], threads=1).start()
    try:
        torch.set_num_threads(1)
        model = verispec.load("smollm2-135m")
        plain = verispec.generate(model, CHAT, drafter="none", max_new_tokens=40, chat=True).text
        try:
            process.wait_ready(timeout=180)
        except ServerStartError as exc:
            pytest.fail(str(exc))
        assert "drafter: self" in process.log_text()
        client = openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        result = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CHAT}], max_tokens=40,
                                                temperature=0)
        assert result.choices[0].message.content == plain
        spec = result.usage.model_extra["speculative"]
        assert spec["accepted_tokens"] > 0 and spec["target_passes"] < result.usage.completion_tokens
    finally:
        process.stop()
