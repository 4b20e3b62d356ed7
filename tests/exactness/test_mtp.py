"""DeepSeek-V3-style MTP modules: the module, its training (training-time test), files, `verispec.load`
dispatch, the CLI, and its drafter's exactness (greedy identity, chain and alternates; chi-square of sampled
output with a negative control).

Tiny random-weight targets for the contracts (the helpers are test_medusa's, test_heads' and
test_sampling_exactness'); `smollm2-135m` (slow) for a real training run and greedy identity.
"""

from __future__ import annotations

import json

import pytest
import torch

import verispec
from conftest import greedy_with_head_equals_plain, scheduler_gives_plain_tokens, tiny_llama, tiny_qwen2
from test_heads import CharTokenizer
from test_medusa import PROMPT, PROMPTS, SMOL_PROMPTS, features, sampled_shard
from verispec.drafters.mtp import MTPDrafter
from verispec.errors import VerispecError
from verispec.heads.mtp import MTPConfig, MTPHead, load_head, save_head
from verispec.heads.train import TrainConfig, ttt_loss
from verispec.heads.train_mtp import new_mtp_head
from verispec.models.native import NativeCausalLM

LAYERS = 4
DRAFT_VOCAB = 64  # of the tiny models' 96 tokens: the module cannot propose the rest


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    """(HF model, native model over the same weights)."""
    hf = {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param](seed=0, layers=LAYERS)
    return hf, NativeCausalLM.from_hf(hf)


@pytest.fixture(scope="module")
def tiny_hf():
    return tiny_llama(seed=0, layers=LAYERS)


@pytest.fixture(scope="module")
def tiny_target(tiny_hf):
    return NativeCausalLM.from_hf(tiny_hf)


def random_module(target, seed: int = 0, draft_vocab: int | None = DRAFT_VOCAB) -> MTPHead:
    """A module with random weights over a random draft vocabulary (None: the whole vocabulary), bound."""
    torch.manual_seed(seed)
    head = MTPHead(MTPConfig.for_target(target, draft_vocab or target.vocab_size))
    if draft_vocab is not None:
        head.set_draft_vocab(torch.arange(target.vocab_size)[torch.randperm(target.vocab_size)[:draft_vocab]])
    return head.bind_to(target)


def test_module_shapes_names_and_bindings(tiny_target):
    head = random_module(tiny_target)
    h = tiny_target.hidden_size
    assert head.eh_proj.weight.shape == (h, 2 * h)
    assert head.self_attn.q_proj.weight.shape == (4 * 16, h) and head.self_attn.k_proj.weight.shape == (2 * 16, h)
    assert head.config.taps == (LAYERS,)  # the target's final normed state
    # DeepSeek's names; neither the target's embedding nor its output rows are the module's to save or train
    assert set(head.state_dict()) == {
        "enorm.weight", "hnorm.weight", "eh_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"), *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        "shared_head.norm.weight", "d2t", "t2d"}
    assert not any(p is head.shared_head.head.weight for p in head.parameters())
    # the output rows are the target's LM head rows for the draft vocabulary, in draft-id order
    assert torch.equal(head.shared_head.head.weight, tiny_target.lm_head[head.draft_token_ids].float())
    assert head.embed.data_ptr() == tiny_target.embed.data_ptr()  # shared, not copied
    logits = head.unroll(torch.randn(2, 7, h), torch.randint(0, 96, (2, 10)), steps=3)
    assert [tuple(x.shape) for x in logits] == [(2, 7, DRAFT_VOCAB)] * 3
    unbound = MTPHead(head.config)
    with pytest.raises(VerispecError, match="bind"):
        unbound.logits(torch.randn(1, h))
    with pytest.raises(VerispecError, match="bind"):
        unbound.unroll(torch.randn(1, 4, h), torch.randint(0, 96, (1, 6)), steps=2)


def test_full_vocabulary_module_borrows_the_target_lm_head(tiny_target):
    """draft_vocab=None: DeepSeek's shared head, the target's own LM head tensor (not a copy), every token."""
    head = new_mtp_head(tiny_target, [], None)
    assert head.config.draft_vocab_size == tiny_target.vocab_size and bool(head.t2d.all())
    assert torch.equal(head.draft_token_ids, torch.arange(tiny_target.vocab_size))
    assert head.shared_head.head.weight.data_ptr() == tiny_target.lm_head.data_ptr()
    assert torch.equal(head.shared_head.norm.weight, tiny_target.final_norm)  # starts as the target's final norm


def test_unroll_is_what_the_drafter_computes(tiny_target):
    """Training-time test and drafting agree: step i of `unroll` at position t is the drafter's i-th chained
    pass after reading the target's final states up to t (ground-truth tokens fed in both)."""
    head = random_module(tiny_target)
    tokens = torch.tensor([PROMPT])
    _, states = tiny_target.forward(tokens, tiny_target.new_cache(1), taps=(LAYERS,))
    steps, width = 3, len(PROMPT) - 3
    with torch.no_grad():
        unrolled = head.unroll(states[:, :width], tokens, steps)
    for n in (1, 6, width):  # the drafter has read the states of positions 0..n-1
        drafter = MTPDrafter(head, tiny_target, weights=None)
        drafter.add([PROMPT[: n + 1]])
        drafter.observe_taps([states[0, :n]])
        with torch.no_grad():
            hidden, _ = drafter._catch_up([PROMPT[: n + 1]])
            for i in range(steps):
                torch.testing.assert_close(head.logits(hidden), unrolled[i][:, n - 1], rtol=1e-4, atol=1e-4)
                if n + 1 + i < len(PROMPT):
                    next_token = torch.tensor([[PROMPT[n + 1 + i]]])
                    hidden = drafter._layer(next_token, hidden[:, None], torch.ones(1, 1, dtype=torch.bool))[:, 0]


def test_training_reduces_the_loss(pair):
    _, target = pair
    shard = sampled_shard(target)
    head = random_module(target)
    rows = list(range(6))
    with torch.no_grad():
        before, _, _ = ttt_loss(head, shard, rows, 3, 0.8)
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(40):
        loss, _, _ = ttt_loss(head, shard, rows, 3, 0.8)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        after, accuracy, losses = ttt_loss(head, shard, rows, 3, 0.8)
    assert float(after) < 0.7 * float(before)
    assert accuracy[0] > 0.2 and len(losses) == 3
    assert torch.equal(head.shared_head.head.weight, target.lm_head[head.draft_token_ids].float())  # never trained


def test_save_load_round_trip_and_dispatch(tiny_target, tmp_path):
    head = random_module(tiny_target, seed=3)
    head.config.extra["note"] = "kept"
    save_head(head, tmp_path / "mtp")
    config = json.loads((tmp_path / "mtp" / "config.json").read_text())
    assert config["architectures"] == ["VerispecMTPHead"] and config["model_type"] == "verispec_mtp"
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["verispec"]["target_num_layers"] == LAYERS
    loaded = load_head(tmp_path / "mtp", tiny_target)
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    assert loaded.config == head.config
    assert torch.equal(loaded.shared_head.head.weight, head.shared_head.head.weight)  # bound again from the target
    by_load = verispec.load(str(tmp_path / "mtp"))  # load(DIR) knows an MTP module; unbound until it drafts
    assert isinstance(by_load, MTPHead) and not by_load.bound
    assert isinstance(verispec.load_head(str(tmp_path / "mtp")), MTPHead)
    plain = verispec.generate(tiny_target, PROMPT, drafter="none", max_new_tokens=8).token_ids
    for draft in (by_load, str(tmp_path / "mtp")):
        got = verispec.generate(tiny_target, PROMPT, draft=draft, max_new_tokens=8)
        assert got.token_ids == plain and got.stats.drafter == "LookupFirstDrafter"  # "auto": the module with suffix lookup
    assert verispec.generate(tiny_target, PROMPT, head=str(tmp_path / "mtp"), drafter="mtp", max_new_tokens=8).token_ids == plain
    with pytest.raises(VerispecError, match="no MTP module"):
        load_head(tmp_path)


def test_module_of_another_target_is_refused(tiny_target):
    other = NativeCausalLM.from_hf(tiny_qwen2(seed=0, layers=LAYERS + 1))
    with pytest.raises(VerispecError, match="own target"):
        verispec.generate(other, [1, 2, 3], draft=random_module(tiny_target), max_new_tokens=2)
    with pytest.raises(VerispecError, match="drafter='mtp'"):
        verispec.generate(tiny_target, [1, 2, 3], draft=random_module(tiny_target), drafter="eagle3", max_new_tokens=2)
    with pytest.raises(VerispecError, match="trained head"):
        verispec.generate(tiny_target, [1, 2, 3], drafter="mtp", max_new_tokens=2)


# --- drafting -------------------------------------------------------------------------------------------

def fitted_module(target) -> MTPHead:
    """A module fitted to the target's greedy continuations of PROMPTS, so decoding them gets its tokens
    accepted (a random target has nothing to learn in general; a drafter that misaligned the target's
    states would get few accepted even here)."""
    rows = [(p + verispec.generate(target, p, drafter="none", max_new_tokens=40).token_ids + [0] * 48)[:48] for p in PROMPTS]
    shard = features(target, rows)
    head = random_module(target)
    seen = torch.cat([shard["tokens"].flatten(), shard["top_ids"][..., 0].flatten()]).long().unique()
    rest = torch.tensor([i for i in range(target.vocab_size) if i not in set(seen.tolist())])
    head.set_draft_vocab(torch.cat([seen, rest])[:DRAFT_VOCAB])
    head.bind_to(target)  # the output rows of the new vocabulary
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(80):
        loss, _, _ = ttt_loss(head, shard, list(range(len(rows))), 3, 0.8)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval()


@pytest.fixture(scope="module")
def trained_module(pair):
    return fitted_module(pair[1])


@pytest.fixture(scope="module")
def llama_module(tiny_target):
    return fitted_module(tiny_target)


@pytest.mark.parametrize("draft_len", [1, 3, 6, "auto", "tree"])
def test_greedy_mtp_equals_plain(pair, trained_module, draft_len):
    _, target = pair
    plain = [verispec.generate(target, p, drafter="none", max_new_tokens=40).token_ids for p in PROMPTS]
    for prompt, expected in zip(PROMPTS, plain):
        got = verispec.generate(target, prompt, draft=trained_module, drafter="mtp", draft_len=draft_len, max_new_tokens=40)
        assert got.token_ids == expected, f"prompt {prompt}"
        assert got.stats.drafter == "MTPDrafter"
        auto = verispec.generate(target, prompt, draft=trained_module, draft_len=draft_len, max_new_tokens=40)
        assert auto.token_ids == expected and auto.stats.drafter == "LookupFirstDrafter"  # "auto": head+suffix
    batch = verispec.generate(target, PROMPTS, draft=trained_module, drafter="mtp", draft_len=draft_len, max_new_tokens=40)
    assert [r.token_ids for r in batch] == plain  # rows of different lengths, leaving at different steps
    if draft_len not in ("auto", "tree"):  # "auto" rightly drafts little here: the tiny target is as cheap as the module
        assert batch[0].stats.accepted_tokens > 40  # not vacuous: the module's tokens were accepted


def test_greedy_mtp_on_the_transformers_backend(pair, trained_module):
    hf, _ = pair
    plain = [verispec.generate(hf, p, drafter="none", max_new_tokens=30).token_ids for p in PROMPTS]
    batch = verispec.generate(hf, PROMPTS, draft=trained_module, draft_len=3, max_new_tokens=30)
    assert [r.token_ids for r in batch] == plain
    assert batch[0].stats.accepted_tokens > 30


@pytest.mark.parametrize("draft_vocab", [DRAFT_VOCAB, None], ids=["draft-vocab", "full-vocab"])
def test_greedy_mtp_with_a_random_module_is_still_exact(tiny_target, draft_vocab):
    head = random_module(tiny_target, seed=5, draft_vocab=draft_vocab)
    for prompt in PROMPTS:
        expected = verispec.generate(tiny_target, prompt, drafter="none", max_new_tokens=30).token_ids
        assert verispec.generate(tiny_target, prompt, draft=head, draft_len=4, max_new_tokens=30).token_ids == expected


@pytest.mark.parametrize("k", [2, 5])
def test_greedy_mtp_alternates_stay_exact(tiny_target, llama_module, k):
    """Every chain position carries the module's second choice: the output is still plain decoding's, and
    alternates were taken where the chain broke off."""
    from test_trees import _Always, _decode

    plain = [_decode(tiny_target, MTPDrafter(llama_module, tiny_target), [p], _Always(0), 40)[0][0] for p in PROMPTS]
    got, stats = _decode(tiny_target, MTPDrafter(llama_module, tiny_target), PROMPTS, _Always(k), 40)
    assert got == plain
    assert stats.alternates_drafted > 0 and stats.alternates_accepted > 0


@pytest.mark.parametrize("weights", ["int8", "int4", "q4_0"])
def test_rounded_module_drafts_near_the_float_module_and_leaves_it_alone(tiny_target, weights):
    """A drafter's copy rounded for the CPU kernels (its output rows too) scores tokens close to the float
    module, the caller's module keeps its float32 weights, and the output is still plain decoding's."""
    from verispec.models import kernels

    if not kernels.available():
        pytest.skip("verispec's C kernels are unavailable here")
    head = random_module(tiny_target)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    _, states = tiny_target.forward(torch.tensor([PROMPT]), tiny_target.new_cache(1), taps=(LAYERS,))
    logits = {}
    for name, w in (("float", None), ("rounded", weights)):
        drafter = MTPDrafter(head, tiny_target, weights=w)
        drafter.add([PROMPT])
        drafter.observe_taps([states[0, :-1]])
        with torch.no_grad():
            hidden, _ = drafter._catch_up([PROMPT])
            logits[name] = drafter.head.logits(hidden)
    assert drafter.head is not head and drafter.head.rounded == weights
    assert type(drafter.head.shared_head.head).__name__ == "KernelLinear"
    assert not torch.equal(logits["float"], logits["rounded"])  # it did round
    cosine = torch.nn.functional.cosine_similarity(logits["float"], logits["rounded"], dim=-1)
    assert float(cosine.min()) > (0.98 if weights in ("int4", "q4_0") else 0.995)
    assert all(torch.equal(v, head.state_dict()[k]) for k, v in before.items()) and head.rounded is None
    assert MTPDrafter(head, tiny_target, weights=weights).head is drafter.head  # rounded once per module and format


def test_server_scheduler_drafts_with_an_mtp_module(tiny_target, llama_module):
    """The server's scheduler hands the module the target's final hidden states too (`scheduler_gives_plain_tokens`)."""
    scheduler_gives_plain_tokens(tiny_target, llama_module, "mtp", PROMPTS)


SAMPLED = dict(temperature=0.8, seed=11, coupled=False)


def test_sampled_mtp_follows_the_target(tiny_hf, tiny_target, llama_module):
    """Over 2000 seeded rows, the first two tokens follow the target's joint distribution (chi-square),
    although the module can only propose 64 of the 96 tokens."""
    from test_sampling_exactness import P_THRESHOLD, first_two_tokens_pvalues, repeating_prompt
    from verispec.sampling import SamplingParams

    prompt = repeating_prompt(tiny_target)
    results = verispec.generate(tiny_target, [prompt] * 2000, draft=llama_module, draft_len=3, max_new_tokens=3, **SAMPLED)
    assert results[0].stats.accepted_tokens > 30  # both the accept and the resample paths ran
    first, joint = first_two_tokens_pvalues(tiny_hf, prompt, SamplingParams(**SAMPLED), [r.token_ids for r in results])
    assert first > P_THRESHOLD and joint > P_THRESHOLD


def test_sampled_mtp_tree_follows_the_target(tiny_hf, tiny_target, llama_module):
    """A sampled row's alternate is drawn from q without the chain's token: the first two tokens of 2000
    seeded rows (batches of 4, alternates everywhere) follow the target's distribution (chi-square)."""
    from dataclasses import replace

    from test_sampling_exactness import P_THRESHOLD, first_two_tokens_pvalues, repeating_prompt
    from test_trees import _Always
    from verispec.engine import DecodeBatch, Request
    from verispec.sampling import SamplingParams

    params = SamplingParams(**SAMPLED)
    prompt = repeating_prompt(tiny_target)
    out, taken = {}, 0
    for first_row in range(0, 2000, 4):
        batch = DecodeBatch(tiny_target, MTPDrafter(llama_module, tiny_target), _Always(3))
        batch.add([Request(prompt=prompt, sampling=replace(params, seed=params.seed + b), max_new_tokens=2, id=b)
                   for b in range(first_row, first_row + 4)])
        while len(batch):
            for event in batch.step():
                out.setdefault(event.request_id, []).extend(event.tokens)
        taken += batch.stats.alternates_accepted
    first, joint = first_two_tokens_pvalues(tiny_hf, prompt, params, [out[b] for b in range(2000)])
    assert first > P_THRESHOLD and joint > P_THRESHOLD
    assert taken > 50


class ReportsAnotherQ(MTPDrafter):
    """A classic bug: tokens drawn from one distribution, another reported (q sharpened, as if the
    temperature were applied twice), so min(1, p / q) and the residual max(0, p - q) use the wrong q."""

    def propose(self, *args, **kwargs):
        draft = super().propose(*args, **kwargs)
        if draft.probs is not None:
            sharpened = draft.probs ** 4
            draft.probs = sharpened / sharpened.sum(-1, keepdim=True).clamp(min=1e-30)
        return draft


def test_negative_control_misreported_q_is_caught(tiny_hf, tiny_target, llama_module, monkeypatch):
    from test_sampling_exactness import first_two_tokens_pvalues, repeating_prompt
    from verispec.api import DRAFTERS
    from verispec.sampling import SamplingParams

    prompt = repeating_prompt(tiny_target)
    monkeypatch.setitem(DRAFTERS, "mtp", lambda target, draft, confidence: ReportsAnotherQ(draft, target))
    results = verispec.generate(tiny_target, [prompt] * 2000, draft=llama_module, draft_len=3, max_new_tokens=3, **SAMPLED)
    first, joint = first_two_tokens_pvalues(tiny_hf, prompt, SamplingParams(**SAMPLED), [r.token_ids for r in results])
    assert min(first, joint) < 1e-10, (first, joint)


# --- training end to end: the API and `verispec train mtp` on a tiny target ------------------------------

@pytest.fixture
def tiny_with_text(tiny_target, tmp_path, monkeypatch):
    """The tiny target with a character tokenizer, loadable as "tiny", and a text file to train on."""
    real_load = verispec.load
    monkeypatch.setattr(tiny_target, "tokenizer", CharTokenizer(tiny_target.vocab_size), raising=False)
    monkeypatch.setattr(verispec, "load", lambda name, *a, **k: tiny_target if name == "tiny" else real_load(name, *a, **k))
    text = tmp_path / "text.txt"
    text.write_text("def add(a, b):\n    return a + b\n\n" * 200)
    return tiny_target, text


def test_train_mtp_writes_a_module_checkpoints_and_held_out_agreement(tiny_with_text, tmp_path):
    from verispec.heads.train_mtp import train_mtp

    target, text = tiny_with_text
    out = tmp_path / "mtp"
    config = TrainConfig(steps=6, ttt_steps=3, checkpoint_every=3, lr=3e-3, warmup=1, eval_sequences=2, precision="float32")
    head = train_mtp(target, out, data=(str(text),), max_tokens=1024, draft_vocab=32, config=config, seq_len=32,
                     features=tmp_path / "f", progress=False)
    records = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 7))
    curve = [r for r in records if "held_out" in r]
    assert [r["step"] for r in curve] == [3, 6] and len(curve[-1]["held_out"]["accuracy"]) == 3
    saved = load_head(out, target)
    assert saved.config.extra["steps"] == 6 and saved.config.extra["held_out"] == curve[-1]["held_out"]
    assert saved.config.draft_vocab_size == 32 and (out / "checkpoint.pt").is_file()
    assert all(torch.equal(v, saved.state_dict()[k]) for k, v in head.state_dict().items())
    plain = verispec.generate(target, PROMPT, drafter="none", max_new_tokens=12).token_ids
    assert verispec.generate(target, PROMPT, draft=str(out), max_new_tokens=12).token_ids == plain


def test_cli_trains_an_mtp_module(tiny_with_text, tmp_path):
    from verispec.cli import main

    target, text = tiny_with_text
    out = tmp_path / "h"
    args = ["train", "mtp", "--target", "tiny", "--out", str(out), "--data", str(text), "--max-tokens", "1024",
            "--seq-len", "32", "--draft-vocab", "32", "--steps", "2", "--ttt-steps", "2", "--features", str(tmp_path / "f")]
    assert main(args) == 0
    head = verispec.load(str(out))
    assert isinstance(head, MTPHead) and head.config.draft_vocab_size == 32 and head.config.extra["steps"] == 2
    assert main(args[:-2] + ["--steps", "4", "--features", str(tmp_path / "f")]) == 0  # resumes: 2 more steps
    steps = [r["step"] for r in map(json.loads, (out / "train.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == [1, 2, 3, 4]
    assert main(["train", "mtp", "--target", "tiny", "--out", str(tmp_path / "x"), "--full-vocab", "--data", str(text),
                 "--max-tokens", "1024", "--seq-len", "32", "--steps", "1", "--features", str(tmp_path / "f")]) == 0
    assert verispec.load(str(tmp_path / "x")).config.draft_vocab_size == target.vocab_size
    assert main(["train", "mtp", "--target", "tiny", "--out", str(out), "--ttt-steps", "0"]) == 2


# --- smollm2-135m (slow) --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_module(tmp_path_factory):
    """An MTP module for smollm2-135m trained for a few steps on ~4k tokens of installed Python sources."""
    from verispec import zoo
    from verispec.heads.train_mtp import train_mtp

    torch.set_num_threads(1)
    zoo.pull("smollm2-135m")
    target = verispec.load("smollm2-135m")
    out = tmp_path_factory.mktemp("smol-mtp")
    config = TrainConfig(steps=20, ttt_steps=3, checkpoint_every=10, lr=1e-3, warmup=2, eval_sequences=4)
    head = train_mtp(target, out, max_tokens=4096, draft_vocab=2048, config=config, seq_len=64, intermediate_size=512,
                     features=out / "features", progress=False)
    return target, head, out


@pytest.mark.slow
def test_smollm_mtp_training_lowers_the_loss(smol_module):
    target, _, out = smol_module
    log = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) == 20 and sum(losses[-4:]) / 4 < sum(losses[:4]) / 4  # it learns
    held_out = log[-1]["held_out"]
    assert len(held_out["accuracy"]) == 3 and held_out["sequences"] == 4
    saved = load_head(out, target)
    assert saved.config.extra["steps"] == 20 and saved.config.target == "smollm2-135m"


@pytest.mark.slow
@pytest.mark.parametrize("draft_len", [3, "tree"])
def test_smollm_greedy_mtp_equals_plain(smol_module, draft_len):
    target, _, out = smol_module
    # "auto": the module with suffix lookup beside it
    greedy_with_head_equals_plain(target, out, SMOL_PROMPTS, draft_len, "LookupFirstDrafter", SMOL_PROMPTS)
