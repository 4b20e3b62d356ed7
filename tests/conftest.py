"""Shared test fixtures: tiny random-weight models built from configs (several architectures, one shared vocabulary).

The suite is split by kind: `unit/` (contracts, options, policy, CLI, errors; offline and fast),
`exactness/` (token-for-token and statistical equality with plain decoding, on tiny models and the C kernels;
offline), `integration/` (real models from the zoo, a real server process and real clients). Every test under
`integration/`, and any elsewhere that needs a real model, is marked `slow`: `pytest -m "not slow"` runs offline.
"""

from __future__ import annotations

import copy
import queue

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from verispec.models.hf import HFCausalLM

# Tiny models are dominated by per-op overhead, which extra threads only add to.
torch.set_num_threads(1)

VOCAB = 96
EOS = 3


def tiny_llama(seed: int = 0, layers: int = 2) -> HFCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, eos_token_id=EOS, bos_token_id=1, pad_token_id=0)
    return HFCausalLM(LlamaForCausalLM(config), name=f"tiny-llama-{seed}")


def tiny_qwen2(seed: int = 0, layers: int = 2) -> HFCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, eos_token_id=EOS, tie_word_embeddings=True)
    return HFCausalLM(Qwen2ForCausalLM(config), name=f"tiny-qwen2-{seed}")


def tiny_gpt2(seed: int = 0, layers: int = 2) -> HFCausalLM:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4, n_positions=512,
                        initializer_range=0.2, eos_token_id=EOS, bos_token_id=1)
    return HFCausalLM(GPT2LMHeadModel(config), name=f"tiny-gpt2-{seed}")


def perturbed_copy(model: HFCausalLM, scale: float, seed: int = 123) -> HFCausalLM:
    """A draft that agrees with the target often but not always: the target's weights plus noise."""
    torch.manual_seed(seed)
    clone = copy.deepcopy(model.model)
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(torch.randn_like(p) * scale * p.std().clamp(min=1e-3))
    return HFCausalLM(clone, name=model.name + "-draft")


def on_path(model, path: str, monkeypatch):
    """A native model on its exact C kernels ("kernels"; skips where they cannot run) or on the plain
    PyTorch path it falls back to ("torch")."""
    if path == "kernels":
        if not model._kernels:
            pytest.skip("exact kernels unavailable here")
    else:
        monkeypatch.setattr(model, "_kernels", False)
    return model


def prefilled(model, tokens: list[int]):
    """A fresh one-row cache holding `tokens`."""
    cache = model.new_cache(1)
    model.forward(torch.tensor([tokens]), cache)
    return cache


def greedy_with_head_equals_plain(target, head, prompts: list, draft_len, drafter: str, batch_prompts: list) -> int:
    """A saved head (a directory `verispec.load` reads) drafting for `target`: greedy output token for token plain
    decoding's, 40 tokens per prompt alone and 24 for `batch_prompts` as one batch, drafted by `drafter` (the
    name in the stats). Returns the tokens of the drafts accepted alone."""
    import verispec

    head = verispec.load(str(head))
    accepted = 0
    for prompt in prompts:
        expected = verispec.generate(target, prompt, drafter="none", max_new_tokens=40).token_ids
        got = verispec.generate(target, prompt, draft=head, draft_len=draft_len, max_new_tokens=40)
        assert got.token_ids == expected, prompt
        assert got.stats.drafter == drafter
        accepted += got.stats.accepted_tokens
    batch = verispec.generate(target, batch_prompts, draft=head, draft_len=draft_len, max_new_tokens=24)
    assert [r.token_ids for r in batch] == [verispec.generate(target, p, drafter="none", max_new_tokens=24).token_ids
                                            for p in batch_prompts]
    return accepted


def pytest_collection_modifyitems(config, items):
    """Everything under integration/ needs a real model from the zoo: slow."""
    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.slow)


# --- jobs for the server's scheduler, run in-process (integration and exactness tests share them) ---


class Collector:
    """Stands in for an HTTP request: gathers one job's events."""

    def __init__(self):
        self.items: queue.Queue = queue.Queue()

    def result(self, timeout: float = 60.0):
        """The job's tokens once it finishes, or its JobFailed."""
        from verispec.server.scheduler import JobFailed

        tokens = []
        while True:
            item = self.items.get(timeout=timeout)
            if isinstance(item, JobFailed):
                return item
            tokens.extend(item.tokens)
            if item.finish_reason is not None:
                return tokens


_ids = iter(range(10**9))


def job(prompt: list[int], max_new_tokens: int = 12, draft=4) -> tuple["Job", Collector]:
    """A scheduler job for `prompt` (greedy) and the Collector that gathers its events."""
    from verispec.engine import Request
    from verispec.sampling import SamplingParams
    from verispec.server.scheduler import Job

    collector = Collector()
    request = Request(prompt=prompt, sampling=SamplingParams(), max_new_tokens=max_new_tokens, id=next(_ids))
    return Job(request, draft, collector.items.put), collector


def scheduler_gives_plain_tokens(target, draft, drafter: str, prompts: list[list[int]]) -> None:
    """The server's scheduler drafting with `draft` as `drafter` (prompts read in chunks between decoding steps,
    rows joining a running batch, settings fixed, "auto" and none side by side): every job gets plain decoding's
    tokens. A head that reads the target's hidden states must get them along this path too."""
    import verispec
    from verispec.api import make_drafter
    from verispec.server.scheduler import Scheduler

    cases = [(prompts[0], 30, 3), (prompts[1], 12, "auto"), (prompts[3], 25, 2), (prompts[2], 9, None)]
    expected = [verispec.generate(target, p, drafter="none", max_new_tokens=n).token_ids for p, n, _ in cases]
    scheduler = Scheduler(target, lambda speculate: make_drafter(target, draft, drafter if speculate else "none"),
                          max_batch=3, prefill_tokens=4)
    scheduler.start()
    try:
        jobs = [job(prompt, max_new_tokens=n, draft=setting) for prompt, n, setting in cases]
        scheduler.submit([j for j, _ in jobs])
        assert [collector.result() for _, collector in jobs] == expected
    finally:
        scheduler.stop()


ARCHITECTURES = {"llama": tiny_llama, "qwen2": tiny_qwen2, "gpt2": tiny_gpt2}


@pytest.fixture(scope="session", params=sorted(ARCHITECTURES))
def tiny_pair(request):
    """(target, draft) of one architecture sharing a vocabulary."""
    target = ARCHITECTURES[request.param](seed=0)
    return target, perturbed_copy(target, scale=0.05)


# --- a toy tokenizer for grammars (llguidance) over the tiny models' vocabulary ---

TOY_PIECES = [b"<pad>", b"<s>", b"<unk>", b"</s>"] + [c.encode() for c in 'abc{}[]":, 0123456789xyz'] + [b"ab", b"ba", b'{"', b'":']
TOY_PIECES += [c.encode() for c in "defghijklmnopqrstuvw<>_/\n-."]  # enough to spell a tool call
TOY_PIECES += [b"q%d" % i for i in range(VOCAB - len(TOY_PIECES))]  # filler tokens no grammar here allows


class _ToyTokenizer:
    """What llguidance's TokenizerWrapper reads: each token's bytes, EOS, the special ids, and an encoder."""

    eos_token_id = EOS
    bos_token_id = 1
    tokens = TOY_PIECES
    special_token_ids = [0, 1, 2, EOS]

    def __call__(self, text):
        data = text.encode() if isinstance(text, str) else text
        return [TOY_PIECES.index(bytes([b])) for b in data if bytes([b]) in TOY_PIECES]


def toy_grammar(kind: str, text):
    """A verispec Grammar over the toy vocabulary: kind "regex", "lark" or "json_schema"."""
    from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

    from verispec.grammar import Grammar

    tokenizer = LLTokenizer(TokenizerWrapper(_ToyTokenizer()), n_vocab=VOCAB)
    compiled = {"regex": LLMatcher.grammar_from_regex, "lark": LLMatcher.grammar_from_lark,
                "json_schema": LLMatcher.grammar_from_json_schema}[kind](text)
    return Grammar(tokenizer, compiled, VOCAB, {EOS})


def toy_ids(text: str) -> list[int]:
    """Text -> toy token ids, one per character."""
    return [TOY_PIECES.index(c.encode()) for c in text]
