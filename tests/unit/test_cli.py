"""The `verispec` command behaves as users of llama.cpp and mlx-lm expect.

Argument handling runs against stand-ins for the model (fast); the tests marked slow run smollm2-135m.
"""

from __future__ import annotations

import io
import json

import pytest
import torch

import verispec
from verispec import api, zoo
from verispec.cli import main, unescape
from verispec.stats import SpecStats


class FakeTokenizer:
    chat_template = "{{ messages }}"

    def __init__(self):
        self.conversations = []  # what the chat template was applied to, turn by turn

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        self.conversations.append([dict(m) for m in messages])
        return list(range(1, 2 + len(messages)))


class FakeModel:
    name = "fake"

    def __init__(self):
        self.tokenizer = FakeTokenizer()


@pytest.fixture
def fake(monkeypatch):
    """verispec.load and verispec.stream replaced: records every call; each stream says "reply N"."""
    calls = {"load": [], "stream": []}
    model = FakeModel()

    def load(name, **kwargs):
        calls["load"].append(name)
        return model

    def stream(target, prompt, **kwargs):
        calls["stream"].append((prompt, kwargs))
        stats = SpecStats(emitted_tokens=2, prompt_tokens=3, prefill_seconds=0.5, total_seconds=1.5)
        yield api.StreamChunk(f"reply {len(calls['stream'])}", [7, 8], [False, False], "stop", stats)

    monkeypatch.setattr(verispec, "load", load)
    monkeypatch.setattr(verispec, "stream", stream)
    calls["model"] = model
    return calls


def test_version(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0 and capsys.readouterr().out.strip() == f"verispec {verispec.__version__}"


@pytest.mark.parametrize("flags, message", [
    (["--draft-len", "0"], "draft_len must be an integer >= 1"),
    (["--draft-len", "deep"], "draft_len"),
    (["--drafter", "lookahead"], "invalid choice: 'lookahead'"),
    (["--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1"),
    (["--threads", "none"], "--threads must be an integer >= 1"),
    (["--draft-dtype", "int3"], "invalid choice: 'int3'"),
    (["--draft-vocab", "0"], "draft_vocab must be 'auto', 'all' or an integer >= 1"),
])
def test_bad_flags_fail_as_usage_errors_before_loading(fake, capsys, flags, message):
    with pytest.raises(SystemExit) as exit:
        main(["generate", "hi", *flags])
    assert exit.value.code == 2 and message in capsys.readouterr().err
    assert fake["load"] == []


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "temperature must be a number >= 0"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--top-k", "-2"], "top_k"),
    (["--coupled", "--typical-acceptance", "0.1", "--temperature", "1"], "choose one"),
    (["--system", "be brief"], "add --chat"),
    (["--draft-vocab", "all"], "--draft-vocab applies to a draft model"),
])
def test_bad_values_fail_before_loading(fake, capsys, flags, message):
    assert main(["generate", "hi", *flags]) == 2
    assert message in capsys.readouterr().err and fake["load"] == []


def test_stop_sequences_take_escapes(fake):
    assert unescape(r"a\nb\t\\n\x41\q") == "a\nb\t\\nA\\q"
    assert main(["generate", "hi", "--stop", r"\n\n", "--stop", "END", "-q"]) == 0
    prompt, options = fake["stream"][0]
    assert options["stop"] == ["\n\n", "END"]


def test_prompt_dash_reads_stdin(fake, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("def fib(n):\n"))
    assert main(["generate", "-", "-q"]) == 0
    assert fake["stream"][0][0] == "def fib(n):\n"


def test_system_prompt_goes_with_chat(fake):
    assert main(["generate", "hi", "--chat", "--system", "be brief", "-q"]) == 0
    _, options = fake["stream"][0]
    assert options["chat"] and options["system"] == "be brief"


def test_options_reach_generate_parsed(fake):
    from verispec.options import DraftLen

    assert main(["generate", "hi", "--draft-len", "3", "--temperature", "0.7", "--seed", "5", "-q"]) == 0
    _, options = fake["stream"][0]
    assert options["draft_len"] == DraftLen(3) and options["temperature"] == 0.7 and options["seed"] == 5


def test_seeded_sampling_is_coupled_unless_told_otherwise(fake):
    """As in the API and the server: a seed reproduces its text by default; --no-coupled keeps speculative sampling."""
    for flags, coupled in ((["--seed", "5", "--temperature", "0.7"], True), (["--seed", "5", "--temperature", "0.7", "--no-coupled"], False),
                           (["--temperature", "0.7"], False), (["--seed", "5"], False), (["--coupled", "--temperature", "0.7"], True)):
        assert main(["generate", "hi", *flags, "-q"]) == 0
        assert fake["stream"][-1][1]["coupled"] is coupled, flags


def test_threads(fake):
    before = torch.get_num_threads()
    try:
        assert main(["generate", "hi", "--threads", "1", "-q"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_summary_splits_prompt_eval_and_eval_and_quiet_drops_it(fake, capsys):
    assert main(["generate", "hi"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "reply 1\n"
    assert "prompt eval 3 tokens in 0.50s (6.00 tok/s)" in captured.err
    assert "eval 2 tokens in 1.00s (2.00 tok/s)" in captured.err and "peak memory" in captured.err
    assert main(["generate", "hi", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_chat_keeps_the_history_and_ends_at_exit(fake, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n\nhow are you?\n/exit\nnever read\n"))
    assert main(["chat", "--system", "be brief", "-q"]) == 0
    conversations = fake["model"].tokenizer.conversations
    assert conversations == [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
         {"role": "assistant", "content": "reply 1"}, {"role": "user", "content": "how are you?"}],
    ]
    assert "reply 1" in capsys.readouterr().out


def test_chat_ends_at_end_of_input_and_clear_forgets(fake, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("one\n/clear\ntwo\n"))
    assert main(["chat", "-q"]) == 0
    assert fake["model"].tokenizer.conversations[-1] == [{"role": "user", "content": "two"}]


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    return tmp_path


def test_list_shows_every_zoo_model_and_what_is_cached(cache_home, capsys):
    entry = zoo.ZOO["smollm2-135m"]
    converted = cache_home / entry.name / "hf"
    converted.mkdir(parents=True)
    (converted / zoo.MARKER).write_text(json.dumps({"name": entry.name, "sha256": entry.sha256}))
    (converted / "model.safetensors").write_bytes(b"\0" * 3_000_000)
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["NAME", "SIZE", "CACHED"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == set(zoo.ZOO)
    assert "yes, 3 MB" in rows["smollm2-135m"] and "98 MB" in rows["smollm2-135m"]
    assert "  no  " in rows["qwen2.5-coder-1.5b"]


def test_rm_deletes_a_cached_model(cache_home, capsys):
    (cache_home / "smollm2-135m" / "hf").mkdir(parents=True)
    (cache_home / "smollm2-135m" / "smollm2-135m.gguf").write_bytes(b"\0" * 2_000_000)
    assert main(["rm", "smollm2-135m"]) == 0
    assert "removed smollm2-135m (2 MB)" in capsys.readouterr().out
    assert not (cache_home / "smollm2-135m").exists()
    assert main(["rm", "smollm2-135m"]) == 2
    assert "not in the cache" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["rm", "no-such-model"])


@pytest.mark.slow
def test_generate_on_a_real_model(capsys):
    assert main(["generate", "The capital of France is", "--target", "smollm2-135m", "--drafter", "ngram",
                 "--max-new-tokens", "6", "--stop", r"\n\n"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "prompt eval" in captured.err and "peak memory" in captured.err


@pytest.mark.slow
def test_a_progress_line_when_the_self_copy_is_made(capsys, monkeypatch):
    import weakref

    monkeypatch.setattr(api, "_SELF_DRAFTS", weakref.WeakKeyDictionary())  # the copy is made in this call
    assert main(["generate", "def add(a, b):", "--target", "smollm2-135m", "--drafter", "self", "--max-new-tokens", "4"]) == 0
    assert "verispec: making an int4 copy of smollm2-135m" in capsys.readouterr().err
    monkeypatch.setattr(api, "_SELF_DRAFTS", weakref.WeakKeyDictionary())
    assert main(["generate", "def add(a, b):", "--target", "smollm2-135m", "--drafter", "self", "--max-new-tokens", "4", "-q"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_chat_on_a_real_model(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Say hi.\nAnd again.\n"))
    assert main(["chat", "--target", "smollm2-135m", "--max-new-tokens", "5", "--system", "You are terse."]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("> ") == 3  # two turns answered, then end of input at the third prompt
    assert captured.err.count("prompt eval") == 2
