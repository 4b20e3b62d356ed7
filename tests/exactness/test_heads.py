"""Trained draft heads: the target's hidden-state taps, the EAGLE-3 head, its training and its drafter.

Tiny random-weight models for the contracts; `smollm2-135m` (slow) for a real training run and greedy
identity of the eagle3 drafter.
"""

from __future__ import annotations

import pytest
import torch

from conftest import greedy_with_head_equals_plain, on_path, tiny_llama, tiny_qwen2
from verispec.models import kernels
from verispec.models.native import NativeCausalLM

TAPS = (2, 4, 5)  # EAGLE-3's (2, N/2, N-3) for 8 layers
PROMPT = [1, 5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    """(HF model, native model over the same weights), 8 layers so taps are distinct."""
    hf = {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param](seed=0, layers=8)
    return hf, NativeCausalLM.from_hf(hf)


@pytest.mark.parametrize("path", ["fused", "loop", "torch"])
def test_taps_leave_logits_bitwise_equal(pair, path, monkeypatch):
    _, model = pair
    model = on_path(model, "torch" if path == "torch" else "kernels", monkeypatch)
    if path == "loop":
        monkeypatch.setattr(model, "fused_layers", False)
    tokens = torch.tensor([PROMPT])
    for chunks in ([tokens[:, :16], tokens[:, 16:17], tokens[:, 17:]], [tokens]):  # small passes; one big pass
        plain_cache, tapped_cache = model.new_cache(1), model.new_cache(1)
        for chunk in chunks:
            plain = model.forward(chunk, plain_cache)
            logits, hidden = model.forward(chunk, tapped_cache, taps=TAPS)
            assert torch.equal(plain, logits)
            assert hidden.shape == (1, chunk.shape[1], len(TAPS) * model.hidden_size)
        # the rest of the decode sees the same cache
        assert torch.equal(model.forward(tokens[:, :2], plain_cache), model.forward(tokens[:, :2], tapped_cache))


@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_taps_are_the_inputs_of_those_layers(pair, path, monkeypatch):
    hf, model = pair
    model = on_path(model, path, monkeypatch)
    tokens = torch.tensor([PROMPT])
    reference = hf.model(input_ids=tokens, output_hidden_states=True).hidden_states  # [i]: input of layer i
    expected = torch.cat([reference[i] for i in TAPS], -1)
    for chunks in ([tokens[:, :4], tokens[:, 4:12], tokens[:, 12:]], [tokens]):
        cache = model.new_cache(1)
        hidden = torch.cat([model.forward(chunk, cache, taps=TAPS)[1] for chunk in chunks], 1)
        torch.testing.assert_close(hidden, expected, rtol=1e-4, atol=1e-4)
    # last_only still taps every position (a prefill feeds the head the whole prompt)
    logits, hidden = model.forward(tokens, model.new_cache(1), last_only=True, taps=TAPS)
    assert logits.shape[1] == 1
    torch.testing.assert_close(hidden, expected, rtol=1e-4, atol=1e-4)
    _, hf_hidden = hf.forward(tokens, hf.new_cache(1), taps=TAPS)
    torch.testing.assert_close(hf_hidden, expected)


def test_bad_taps_raise(pair):
    hf, model = pair
    for backend in (hf, model):
        with pytest.raises(ValueError, match="taps"):
            backend.forward(torch.tensor([[1, 2]]), backend.new_cache(1), taps=(9,))  # 8: the final normed state


# --- the head -----------------------------------------------------------------------------------------

import json  # noqa: E402

import verispec  # noqa: E402
from verispec.drafters.base import Drafter  # noqa: E402
from verispec.drafters.eagle3 import Eagle3Drafter  # noqa: E402
from verispec.errors import VerispecError  # noqa: E402
from verispec.heads.data import features_of  # noqa: E402
from verispec.heads.eagle3 import Eagle3Config, Eagle3Head, load_head, save_head  # noqa: E402
from verispec.heads.train import TrainConfig, choose_draft_vocab, soft_targets, ttt_loss  # noqa: E402

DRAFT_VOCAB = 64  # of the tiny models' 96 tokens: the head cannot propose the rest


@pytest.fixture(scope="module")
def tiny_hf():
    return tiny_llama(seed=0, layers=8)


@pytest.fixture(scope="module")
def tiny_target(tiny_hf):
    return NativeCausalLM.from_hf(tiny_hf)


def random_head(target, seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(target, DRAFT_VOCAB, TAPS))
    head.set_draft_vocab(torch.arange(target.vocab_size)[torch.randperm(target.vocab_size)[:DRAFT_VOCAB]])
    return head.bind(target.embed)


def tiny_shard(target, sequences: int = 6, length: int = 40, seed: int = 0) -> dict:
    """Features of the target's own sampled text (so there is something to learn)."""
    prompts = [[1, 5 + i] for i in range(sequences)]
    results = verispec.generate(target, prompts, drafter="none", temperature=0.7, seed=seed, max_new_tokens=length)
    rows = [(p + r.token_ids + [0] * length)[:length] for p, r in zip(prompts, results)]
    return features_of(target, torch.tensor(rows), TAPS, top_k=16)


def test_head_shapes_and_names(tiny_target):
    head = random_head(tiny_target)
    h = tiny_target.hidden_size
    assert head.fc.weight.shape == (h, 3 * h)
    attn = head.midlayer.self_attn
    assert attn.q_proj.weight.shape == (4 * 16, 2 * h) and attn.k_proj.weight.shape == (2 * 16, 2 * h)
    assert head.lm_head.weight.shape == (DRAFT_VOCAB, h)
    assert head.d2t.shape == (DRAFT_VOCAB,) and int(head.t2d.sum()) == DRAFT_VOCAB
    # draft id i is target id i + d2t[i], and t2d marks exactly those ids
    assert torch.equal(torch.nonzero(head.t2d).squeeze(1), head.draft_token_ids)
    names = set(head.state_dict())
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= names and not any("embed" in n for n in names)
    logits = head.unroll(torch.randn(2, 7, 3 * h), torch.randint(0, 96, (2, 10)), steps=3)
    assert [tuple(x.shape) for x in logits] == [(2, 7, DRAFT_VOCAB)] * 3


def test_unroll_is_what_the_drafter_computes(tiny_target):
    """Training-time test and drafting agree: step i of `unroll` at position t is the drafter's i-th
    chained pass after reading the target's taps up to t (ground-truth tokens fed in both)."""
    head = random_head(tiny_target)
    tokens = torch.tensor([PROMPT])
    _, taps = tiny_target.forward(tokens, tiny_target.new_cache(1), taps=TAPS)
    steps, width = 3, len(PROMPT) - 3
    with torch.no_grad():
        unrolled = head.unroll(taps[:, :width], tokens, steps)
    for n in (1, 6, width):  # the drafter has read taps of positions 0..n-1
        drafter = Eagle3Drafter(head, tiny_target, weights=None)
        drafter.add([PROMPT[: n + 1]])
        drafter.observe_taps([taps[0, :n]])
        with torch.no_grad():
            hidden, known = drafter._catch_up([PROMPT[: n + 1]])
            for i in range(steps):
                torch.testing.assert_close(head.logits(hidden), unrolled[i][:, n - 1], rtol=1e-4, atol=1e-4)
                if n + 1 + i < len(PROMPT):
                    next_token = torch.tensor([[PROMPT[n + 1 + i]]])
                    hidden = drafter._layer(next_token, hidden[:, None], torch.ones(1, 1, dtype=torch.bool))[:, 0]


@pytest.mark.parametrize("weights", ["int8", "int4", "bfloat16", "q4_0", "q8_0"])
def test_rounded_head_drafts_near_the_float_head_and_leaves_it_alone(tiny_target, weights):
    """A drafter's head rounded for the CPU kernels scores tokens close to the float head (rounding
    only moves proposals, never the output), and the caller's head keeps its float32 weights."""
    head = random_head(tiny_target)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    tokens = torch.tensor([PROMPT])
    _, taps = tiny_target.forward(tokens, tiny_target.new_cache(1), taps=TAPS)
    logits = {}
    for name, w in (("float", None), ("rounded", weights)):
        drafter = Eagle3Drafter(head, tiny_target, weights=w)
        drafter.add([PROMPT])
        drafter.observe_taps([taps[0, :-1]])
        with torch.no_grad():
            hidden, _ = drafter._catch_up([PROMPT])
            logits[name] = drafter.head.logits(hidden)
    assert not torch.equal(logits["float"], logits["rounded"])  # it did round
    cosine = torch.nn.functional.cosine_similarity(logits["float"], logits["rounded"], dim=-1)
    assert float(cosine.min()) > (0.98 if weights in ("int4", "q4_0") else 0.995)
    assert all(torch.equal(v, head.state_dict()[k]) for k, v in before.items())


def test_soft_targets_renormalize_over_the_draft_vocab(tiny_target):
    head = random_head(tiny_target)
    inside, outside = head.draft_token_ids[:2], torch.nonzero(~head.t2d).squeeze(1)[:1]
    ids = torch.cat([outside, inside])[None]  # the argmax is outside the draft vocabulary
    p, mask = soft_targets(ids, torch.log(torch.tensor([[0.5, 0.3, 0.2]])), head)
    assert not bool(mask[0])
    assert torch.allclose(p[0, :2], torch.tensor([0.6, 0.4])) and float(p.sum()) == pytest.approx(1.0)


def test_training_reduces_the_loss(tiny_target):
    shard = tiny_shard(tiny_target)
    head = random_head(tiny_target)
    with torch.no_grad():
        before, _, _ = ttt_loss(head, shard, list(range(6)), 3, 0.8)
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(40):
        loss, _, _ = ttt_loss(head, shard, [0, 1, 2, 3, 4, 5], 3, 0.8)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        after, accuracy, _ = ttt_loss(head, shard, list(range(6)), 3, 0.8)
    assert float(after) < 0.7 * float(before)
    assert accuracy[0] > 0.2


def test_draft_vocab_keeps_the_frequent_tokens(tmp_path):
    from safetensors.torch import save_file

    tokens = torch.tensor([[5, 5, 5, 7, 7, 9]], dtype=torch.int32)
    top_ids = torch.tensor([[[5], [5], [7], [11], [11], [11]]], dtype=torch.int32)
    save_file({"tokens": tokens, "top_ids": top_ids}, str(tmp_path / "s.safetensors"))
    assert choose_draft_vocab([tmp_path / "s.safetensors"], 20, 3).tolist() == [5, 7, 11]
    assert choose_draft_vocab([tmp_path / "s.safetensors"], 20, 3, always=(2,)).tolist() == [2, 5, 7]  # ties: lower id


def test_save_load_round_trip(tiny_target, tmp_path):
    head = random_head(tiny_target, seed=3)
    head.config.extra["note"] = "kept"
    save_head(head, tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["verispec"]["taps"] == list(TAPS) and config["hidden_size"] == tiny_target.hidden_size
    loaded = load_head(tmp_path / "head", tiny_target)
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    assert loaded.config == head.config
    assert isinstance(verispec.load(str(tmp_path / "head")), Eagle3Head)  # load(DIR) knows a head
    plain = verispec.generate(tiny_target, PROMPT, drafter="none", max_new_tokens=8).token_ids
    by_path = verispec.generate(tiny_target, PROMPT, head=str(tmp_path / "head"), drafter="eagle3", max_new_tokens=8)
    assert by_path.token_ids == plain and by_path.stats.drafter == "Eagle3Drafter"
    with pytest.raises(VerispecError, match="not a draft head"):
        load_head(tmp_path)


def test_head_of_another_target_is_refused(tiny_target):
    other = NativeCausalLM.from_hf(tiny_qwen2(seed=0, layers=8))
    head = random_head(tiny_target)
    head.config.vocab_size = 50
    with pytest.raises(VerispecError, match="own target"):
        verispec.generate(other, [1, 2, 3], draft=head, max_new_tokens=2)
    with pytest.raises(VerispecError, match="drafter='eagle3'"):
        verispec.generate(other, [1, 2, 3], draft=random_head(tiny_target), drafter="model", max_new_tokens=2)
    with pytest.raises(VerispecError, match="trained head"):
        verispec.generate(other, [1, 2, 3], drafter="eagle3", max_new_tokens=2)


# --- drafting -------------------------------------------------------------------------------------------

PROMPTS = [[1, 5, 6, 7, 8, 9, 5, 6, 7], [1, 20, 21], [4], [1, 30, 31, 32, 30, 31, 32, 30, 31, 40, 41, 42]]


@pytest.fixture(scope="module")
def trained_head(tiny_target):
    """A head fitted to the target's greedy continuations of PROMPTS, so that decoding them gets its tokens
    accepted: a random-weight target has nothing a head could learn in general (held-out agreement stays
    near chance), but a head whose drafts the engine misaligned would get few accepted even here."""
    rows = [(p + verispec.generate(tiny_target, p, drafter="none", max_new_tokens=40).token_ids + [0] * 48)[:48]
            for p in PROMPTS]
    shard = features_of(tiny_target, torch.tensor(rows), TAPS, top_k=16)
    head = random_head(tiny_target)
    seen = torch.cat([shard["tokens"].flatten(), shard["top_ids"][..., 0].flatten()]).long().unique()
    rest = torch.tensor([i for i in range(tiny_target.vocab_size) if i not in set(seen.tolist())])
    head.set_draft_vocab(torch.cat([seen, rest])[:DRAFT_VOCAB])
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    with kernels.torch_on_one_thread():  # the same float sums, so the same head, whatever thread count earlier tests left
        for _ in range(80):
            loss, _, _ = ttt_loss(head, shard, list(range(len(rows))), 3, 0.8)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return head.eval()


@pytest.mark.parametrize("draft_len", [1, 3, 6, "auto"])
def test_greedy_eagle3_equals_plain(tiny_target, trained_head, draft_len):
    plain = [verispec.generate(tiny_target, p, drafter="none", max_new_tokens=40).token_ids for p in PROMPTS]
    for prompt, expected in zip(PROMPTS, plain):
        got = verispec.generate(tiny_target, prompt, draft=trained_head, drafter="eagle3", draft_len=draft_len,
                                max_new_tokens=40)
        assert got.token_ids == expected, f"prompt {prompt}"
        assert got.stats.drafter == "Eagle3Drafter"
        auto = verispec.generate(tiny_target, prompt, draft=trained_head, draft_len=draft_len, max_new_tokens=40)
        assert auto.token_ids == expected and auto.stats.drafter == "LookupFirstDrafter"  # "auto": head+suffix
    batch = verispec.generate(tiny_target, PROMPTS, draft=trained_head, drafter="eagle3", draft_len=draft_len,
                              max_new_tokens=40)
    assert [r.token_ids for r in batch] == plain  # rows of different lengths, leaving at different steps
    if draft_len != "auto":  # "auto" rightly drafts little here: the tiny target costs no more than the head
        assert batch[0].stats.accepted_tokens > 60  # not vacuous: the head's tokens were accepted


def test_greedy_eagle3_on_the_transformers_backend(tiny_hf, trained_head):
    """The HF backend returns taps too (its hidden_states), so a head drafts for it alike."""
    plain = [verispec.generate(tiny_hf, p, drafter="none", max_new_tokens=30).token_ids for p in PROMPTS]
    batch = verispec.generate(tiny_hf, PROMPTS, draft=trained_head, draft_len=3, max_new_tokens=30)
    assert [r.token_ids for r in batch] == plain
    assert batch[0].stats.accepted_tokens > 30


def test_greedy_eagle3_with_a_random_head_is_still_exact(tiny_target):
    head = random_head(tiny_target, seed=5)
    for prompt in PROMPTS:
        expected = verispec.generate(tiny_target, prompt, drafter="none", max_new_tokens=30).token_ids
        assert verispec.generate(tiny_target, prompt, draft=head, draft_len=4, max_new_tokens=30).token_ids == expected


@pytest.mark.parametrize("params", [dict(temperature=0.8, seed=11), dict(temperature=1.2, top_k=12, top_p=0.9, seed=5)],
                         ids=str)
def test_sampled_eagle3_follows_the_target(tiny_hf, tiny_target, trained_head, params):
    """Over 2000 seeded rows, the first two tokens follow the target's joint distribution (chi-square),
    although the head can only propose 64 of the 96 tokens."""
    from test_sampling_exactness import P_THRESHOLD, first_two_tokens_pvalues, repeating_prompt
    from verispec.sampling import SamplingParams

    prompt = repeating_prompt(tiny_target)
    results = verispec.generate(tiny_target, [prompt] * 2000, draft=trained_head, draft_len=3, max_new_tokens=3, **params)
    assert results[0].stats.accepted_tokens > 10
    first, joint = first_two_tokens_pvalues(tiny_hf, prompt, SamplingParams(**params), [r.token_ids for r in results])
    assert first > P_THRESHOLD and joint > P_THRESHOLD


@pytest.mark.parametrize("draft_len", [3, "auto"])
def test_greedy_head_with_suffix_lookup_equals_plain(tiny_target, trained_head, draft_len):
    """drafter="head+suffix": suffix lookup where its draft is expected to do as well as the head, else the head.
    With the trained head, and with a random one (whose drafts soon look worse than lookup's), both kinds of
    step occur over these prompts (some repeat themselves), and the output is plain decoding's."""
    verispec.api.suffix_index(tiny_target).clear()
    plain = [verispec.generate(tiny_target, p, drafter="none", max_new_tokens=40).token_ids for p in PROMPTS]
    figures = {"lookup_steps": 0, "model_steps": 0}
    for prompt, expected, head in zip(PROMPTS * 2, plain * 2, [trained_head] * 4 + [random_head(tiny_target)] * 4):
        got = verispec.generate(tiny_target, prompt, draft=head, drafter="head+suffix", draft_len=draft_len,
                                max_new_tokens=40)
        assert got.token_ids == expected, f"prompt {prompt}"
        for name in figures:
            figures[name] += got.stats.drafter_figures[name]
    batch = verispec.generate(tiny_target, PROMPTS, draft=trained_head, drafter="head+suffix", draft_len=draft_len,
                              max_new_tokens=40)
    assert [r.token_ids for r in batch] == plain
    assert figures["lookup_steps"] > 0 and figures["model_steps"] > 0, figures


def test_sampled_head_with_suffix_lookup_follows_the_target(tiny_hf, tiny_target):
    """Steps of both kinds (a deterministic lookup draft, the head's q) in one batch's run: still the target's
    joint distribution of the first two tokens (chi-square over 2000 seeded rows)."""
    from test_sampling_exactness import P_THRESHOLD, first_two_tokens_pvalues, repeating_prompt
    from verispec.sampling import SamplingParams

    params = dict(temperature=0.8, seed=3)
    once = repeating_prompt(tiny_target)  # opening, continuation, opening
    prompt = once[:-3] * 3 + once[-3:]  # lookup is sure of the first tokens; rows that then differ leave it to the head
    verispec.api.suffix_index(tiny_target).clear()
    results = verispec.generate(tiny_target, [prompt] * 2000, draft=random_head(tiny_target), drafter="head+suffix",
                                draft_len=3, max_new_tokens=4, **params)
    figures = results[0].stats.drafter_figures
    assert figures["lookup_steps"] > 0 and figures["model_steps"] > 0, figures
    first, joint = first_two_tokens_pvalues(tiny_hf, prompt, SamplingParams(**params), [r.token_ids for r in results])
    assert first > P_THRESHOLD and joint > P_THRESHOLD


def test_head_with_suffix_lookup_needs_a_head(tiny_target):
    with pytest.raises(VerispecError, match="trained head"):
        verispec.generate(tiny_target, [1, 2, 3], drafter="head+suffix", max_new_tokens=2)


class TapRecorder(Drafter):
    """A model drafter that also asks for the target's taps and keeps what the engine hands it."""

    def __init__(self, inner):
        self.inner, self.target_taps, self.observed = inner, TAPS, []
        self.prefill_model = inner.prefill_model
        self.add, self.propose, self.commit, self.select = inner.add, inner.propose, inner.commit, inner.select

    def observe_taps(self, hidden):
        self.observed.append([None if h is None else h.clone() for h in hidden])


@pytest.mark.parametrize("window", [3, 8, None])
def test_a_heads_window_keeps_greedy_output_exact(tiny_target, trained_head, window):
    """A catch-up reads at most `window` positions (a long prompt, or a long stretch without drafting), from a
    fresh start of the row; output stays the target's, and the head still gets tokens accepted."""
    from test_trees import _Always, _decode

    plain = [verispec.generate(tiny_target, p, drafter="none", max_new_tokens=40).token_ids for p in PROMPTS]
    got, stats = _decode(tiny_target, Eagle3Drafter(trained_head, tiny_target, window=window), PROMPTS, _Always(3), 40)
    assert got == plain
    assert stats.accepted_tokens > 40  # a window of 3 sees little, but the taps carry the context


def test_a_heads_window_restarts_only_the_rows_past_it(tiny_target, trained_head):
    """A prompt hands the head the taps of its last `window` positions only (`prompt_taps`); a stretch of more
    than `window` positions without drafting restarts that row's head cache from the last `window` of them."""
    drafter = Eagle3Drafter(trained_head, tiny_target, window=4)
    assert drafter.prompt_taps == 4
    rows = [[1] + list(range(5, 15)), [1, 20, 21]]  # 10 and 2 positions to read
    drafter.add(rows)
    _, hidden = tiny_target.forward(torch.tensor([rows[0][:-1]]), tiny_target.new_cache(1), taps=TAPS)
    _, short = tiny_target.forward(torch.tensor([rows[1][:-1]]), tiny_target.new_cache(1), taps=TAPS)
    drafter.observe_taps([hidden[0, -4:], short[0]])
    drafter.catch_up(rows)
    assert drafter.slots.num_tokens().tolist() == [4, 2] and drafter.skipped == [6, 0]
    # what the windowed row holds is what a head given only those 4 positions computes
    alone = Eagle3Drafter(trained_head, tiny_target, window=None)
    alone.add([rows[0][6:]])
    alone.observe_taps([hidden[0, 6:]])
    alone.catch_up([rows[0][6:]])
    torch.testing.assert_close(drafter._caught[0][0], alone._caught[0][0], rtol=1e-5, atol=1e-5)
    # six more positions on row 0 while nothing drafted: past the window, so the row starts afresh from the last 4
    longer = rows[0] + list(range(30, 36))
    _, more = tiny_target.forward(torch.tensor([longer[:-1]]), tiny_target.new_cache(1), taps=TAPS)
    drafter.observe_taps([more[0, 10:], None])
    drafter.catch_up([longer, rows[1]])
    assert drafter.slots.num_tokens().tolist() == [4, 2] and drafter.skipped == [12, 0]
    with pytest.raises(RuntimeError, match="skipped"):  # the bookkeeping still checks the target's count
        drafter.observe_taps([more[0, :1], None])
        drafter.catch_up([longer, rows[1]])


def test_a_heads_prefill_taps_only_the_prompts_window(tiny_target, trained_head):
    """The engine's prefill collects the taps of the last `prompt_taps` prompt tokens only (the passes before run
    without them), the head reads exactly those, and greedy output is plain decoding's."""
    from verispec.prefill import read_once

    prompt = [1] + list(range(5, 40))
    readers = read_once(tiny_target, [prompt[:-1]], taps=TAPS, tap_last=8)
    full = read_once(tiny_target, [prompt[:-1]], taps=TAPS)
    tail = torch.cat(readers[0].hidden)
    assert tail.shape[0] == 8 and torch.equal(tail, torch.cat(full[0].hidden)[-8:])
    long_prompt = [1] + [5 + (7 * i) % 80 for i in range(100)]  # past the default window of 64
    for prompts in ([long_prompt], [long_prompt, prompt]):
        plain = [verispec.generate(tiny_target, p, drafter="none", max_new_tokens=20).token_ids for p in prompts]
        got = verispec.generate(tiny_target, prompts, draft=trained_head, drafter="eagle3", draft_len=3, max_new_tokens=20)
        assert [r.token_ids for r in got] == plain


def test_engine_hands_over_the_taps_of_every_kept_token(tiny_hf, tiny_target):
    """Prefill, chain and tree passes alike: the drafter receives, in order, the taps of exactly the tokens
    the target's cache keeps, i.e. of the final sequence but its last token (and of any tokens the last
    step produced past the end of the output)."""
    from conftest import perturbed_copy
    from test_trees import _decode, _PricedLikeAPair
    from verispec.drafters import ModelDrafter

    draft = NativeCausalLM.from_hf(perturbed_copy(tiny_hf, scale=0.1))
    alternates = 0
    for prompt in PROMPTS:
        recorder = TapRecorder(ModelDrafter(draft, tiny_target.vocab_size))
        (generated,), stats = _decode(tiny_target, recorder, [prompt], _PricedLikeAPair(alternates=True), 40)
        alternates += stats.alternates_accepted
        sequence = prompt + generated
        got = torch.cat([h[0] for h in recorder.observed if h[0] is not None and h[0].numel()])
        _, expected = tiny_target.forward(torch.tensor([sequence[:-1]]), tiny_target.new_cache(1), taps=TAPS)
        # the last step may keep tokens past max_new_tokens or EOS, which the output then cuts
        assert len(sequence) - 1 <= len(got) <= len(sequence) + 10
        torch.testing.assert_close(got[: len(sequence) - 1], expected[0], rtol=1e-4, atol=1e-4)
    assert alternates > 0  # tree passes were among them, and some kept an alternate


# --- smollm2-135m (slow) --------------------------------------------------------------------------------

SMOL_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\n\n\ndef list_python_files(directory):\n",
    "The three primary colors are",
]


@pytest.fixture(scope="module")
def smol_head(tmp_path_factory):
    """A head for smollm2-135m trained for a few steps on ~2k tokens of installed Python sources."""
    from verispec import zoo
    from verispec.heads.train import train_eagle3

    torch.set_num_threads(1)
    zoo.pull("smollm2-135m")
    target = verispec.load("smollm2-135m")
    out = tmp_path_factory.mktemp("smol-head")
    config = TrainConfig(steps=12, ttt_steps=3, checkpoint_every=6, lr=1e-3, warmup=2, eval_sequences=4)
    head = train_eagle3(target, out, max_tokens=2048, draft_vocab=2048, config=config, seq_len=64,
                        features=out / "features", progress=False)
    return target, head, out


@pytest.mark.slow
def test_smollm_training_lowers_the_loss_and_resumes(smol_head):
    from verispec.heads.train import train_eagle3

    target, head, out = smol_head
    log = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3  # it learns
    held_out = log[-1]["held_out"]
    assert len(held_out["accuracy"]) == 3 and held_out["sequences"] == 4
    saved = load_head(out, target)
    assert saved.config.extra["steps"] == 12 and saved.config.target == "smollm2-135m"
    # a second run with more steps resumes from the checkpoint instead of starting again
    config = TrainConfig(steps=14, ttt_steps=3, checkpoint_every=6, lr=1e-3, warmup=2, eval_sequences=4)
    train_eagle3(target, out, max_tokens=2048, draft_vocab=2048, config=config, seq_len=64,
                 features=out / "features", progress=False)
    records = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    curve = [(r["step"], r["tokens"]) for r in records if "held_out" in r]
    assert curve[:2] == [(6, 6 * 2 * 61), (12, 12 * 2 * 61)]  # held-out agreement at each checkpoint, by tokens seen
    assert steps[12:] == [13, 14]


@pytest.mark.slow
@pytest.mark.parametrize("draft_len", [3, "auto"])
def test_smollm_greedy_eagle3_equals_plain(smol_head, draft_len):
    target, _, out = smol_head
    # "auto": the head with suffix lookup beside it
    greedy_with_head_equals_plain(target, out, SMOL_PROMPTS, draft_len, "LookupFirstDrafter", SMOL_PROMPTS)


@pytest.mark.slow
def test_cli_trains_a_head(tmp_path, smol_head):
    from verispec.cli import main

    _, _, out = smol_head
    code = main(["train", "eagle3", "--target", "smollm2-135m", "--out", str(tmp_path / "h"), "--max-tokens", "2048",
                 "--seq-len", "64", "--draft-vocab", "1024", "--steps", "2", "--ttt-steps", "2",
                 "--features", str(tmp_path / "f")])
    assert code == 0 and isinstance(verispec.load(str(tmp_path / "h")), Eagle3Head)
    assert main(["train", "eagle3", "--target", "smollm2-135m", "--out", str(tmp_path / "h"), "--steps", "0"]) == 2


class CharTokenizer:
    """Characters as token ids (mod the vocabulary): enough text handling for feature extraction."""

    chat_template = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % self.vocab_size for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(map(chr, ids))


def test_resumed_extraction_reuses_self_distilled_answers(tiny_target, tmp_path, monkeypatch):
    """A resumed extraction takes the target's answers from answers.jsonl instead of decoding them again,
    and makes the same shards."""
    from verispec.heads import data

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "def f{i}(x):"}}\n' for i in range(6)))
    spec = data.FeatureSpec(target="tiny", taps=TAPS, seq_len=16, shard_sequences=2, sources=(str(prompts),),
                            self_distill=True, max_new_tokens=8)
    monkeypatch.setattr(tiny_target, "tokenizer", CharTokenizer(tiny_target.vocab_size), raising=False)
    first = data.extract(tiny_target, tmp_path / "a", spec, 64, progress=False)
    decoded = []
    real = data._greedy_answers
    monkeypatch.setattr(data, "_greedy_answers", lambda *a: decoded.append(a) or real(*a))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / data.ANSWERS).write_text((tmp_path / "a" / data.ANSWERS).read_text())
    again = data.extract(tiny_target, tmp_path / "b", spec, 64, progress=False)
    assert decoded == []
    for x, y in zip(first, again):
        assert torch.equal(data.load_shard(x)["tokens"], data.load_shard(y)["tokens"])


@pytest.mark.parametrize("k", [2, 5])
def test_greedy_eagle3_tree_with_alternates_equals_plain(tiny_target, trained_head, k):
    """The head grows an EAGLE-2 dynamic tree, every node of it verified: output still the target's, and
    alternates were taken."""
    from test_trees import _Always, _decode

    plain = [_decode(tiny_target, Eagle3Drafter(trained_head, tiny_target), [p], _Always(0))[0][0] for p in PROMPTS]
    got, stats = _decode(tiny_target, Eagle3Drafter(trained_head, tiny_target), PROMPTS, _Always(k))
    assert got == plain
    assert stats.alternates_drafted > 0 and stats.alternates_accepted > 0


def test_eagle3_tree_takes_paths_below_alternates(tiny_target, trained_head):
    """Not only leaves: some steps accept an alternate and then one hanging below it (two or more tokens from
    alternates in one step, which siblings at one place cannot give), and the output stays the target's."""
    from test_trees import _Always
    from verispec.engine import DecodeBatch, Request

    deepest = 0
    for prompt in PROMPTS:
        expected = verispec.generate(tiny_target, prompt, drafter="none", max_new_tokens=30).token_ids
        batch = DecodeBatch(tiny_target, Eagle3Drafter(trained_head, tiny_target, top_k=6, beam=6), _Always(5))
        batch.add([Request(prompt=prompt, max_new_tokens=30)])
        got = []
        while len(batch):
            got += [t for event in batch.step() for t in event.tokens]
            if batch.last_step.alternates is not None:
                deepest = max(deepest, int(batch.last_step.alternates.taken.max()))
        assert got == expected
    assert deepest >= 2


def test_sampled_eagle3_tree_follows_the_target(tiny_hf, tiny_target, trained_head):
    """A sampled row's tree nodes are drawn from q without replacement at each node: the first two tokens of
    2000 seeded rows (batches of 4, trees two deep, every node verified) follow the target's distribution
    (chi-square)."""
    from dataclasses import replace

    from test_sampling_exactness import P_THRESHOLD, first_two_tokens_pvalues, repeating_prompt
    from test_trees import _Always
    from verispec.engine import DecodeBatch, Request
    from verispec.sampling import SamplingParams

    params = SamplingParams(temperature=0.8, seed=11)
    prompt = repeating_prompt(tiny_target)
    out, taken = {}, 0
    for first_row in range(0, 2000, 4):
        batch = DecodeBatch(tiny_target, Eagle3Drafter(trained_head, tiny_target), _Always(3))
        batch.add([Request(prompt=prompt, sampling=replace(params, seed=params.seed + b), max_new_tokens=3, id=b)
                   for b in range(first_row, first_row + 4)])
        while len(batch):
            for event in batch.step():
                out.setdefault(event.request_id, []).extend(event.tokens)
        taken += batch.stats.alternates_accepted
    first, joint = first_two_tokens_pvalues(tiny_hf, prompt, params, [out[b] for b in range(2000)])
    assert first > P_THRESHOLD and joint > P_THRESHOLD
    assert taken > 50


def test_expected_tokens_per_pass_from_per_step_agreement():
    from verispec.heads.train import expected_tokens_per_pass

    assert expected_tokens_per_pass([]) == 1.0
    assert expected_tokens_per_pass([1.0, 1.0, 1.0]) == 4.0
    assert expected_tokens_per_pass([0.5, 0.5]) == 1.75
    assert expected_tokens_per_pass([0.8, 0.5, 0.0, 1.0], k=2) == pytest.approx(1 + 0.8 + 0.4)


def test_adaptive_policy_prices_the_heads_tree_and_stays_exact(tiny_target, trained_head):
    """With draft_len="tree" the policy prices each node of the head's tree by its measured chance and the
    row it adds (costs fed in, rows cheap as on a target whose pass is memory-bound): nodes are verified, some
    taken, and the output is the target's. At a pair's row price (0.02 of a step) the policy verifies so few of
    the tiny head's nodes that on some CPUs, whose float sums train a slightly other head, none was taken."""
    from test_trees import _decode, _PricedLikeAPair

    class CheapRows(_PricedLikeAPair):
        ROW = 0.0005

    plain = [verispec.generate(tiny_target, p, drafter="none", max_new_tokens=40).token_ids for p in PROMPTS]
    got, stats = _decode(tiny_target, Eagle3Drafter(trained_head, tiny_target), PROMPTS, CheapRows(alternates=True), 40)
    assert got == plain
    assert stats.alternates_drafted > 0 and stats.alternates_accepted > 0
