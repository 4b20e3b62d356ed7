"""Medusa-1 heads: the target's final-hidden-state tap, the heads, their training, files and drafter.

Tiny random-weight targets (llama and qwen2) for the contracts; `smollm2-135m` (slow) for a real training
run and greedy identity.
"""

from __future__ import annotations

import pytest
import torch

from conftest import greedy_with_head_equals_plain, scheduler_gives_plain_tokens, on_path, tiny_llama, tiny_qwen2
from verispec.models.native import NativeCausalLM

LAYERS = 4
FINAL = LAYERS  # tap index of the final normed hidden state
PROMPT = [1, 5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    """(HF model, native model over the same weights)."""
    hf = {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param](seed=0, layers=LAYERS)
    return hf, NativeCausalLM.from_hf(hf)


# --- the final tap --------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["fused", "loop", "torch"])
@pytest.mark.parametrize("taps", [(FINAL,), (1, FINAL), (FINAL, 2)], ids=str)
def test_final_tap_leaves_logits_bitwise_equal(pair, path, taps, monkeypatch):
    _, model = pair
    model = on_path(model, "torch" if path == "torch" else "kernels", monkeypatch)
    if path == "loop":
        monkeypatch.setattr(model, "fused_layers", False)
    tokens = torch.tensor([PROMPT])
    for last_only in (False, True):
        for chunks in ([tokens[:, :16], tokens[:, 16:17], tokens[:, 17:]], [tokens]):
            plain_cache, tapped_cache = model.new_cache(1), model.new_cache(1)
            for chunk in chunks:
                plain = model.forward(chunk, plain_cache, last_only=last_only)
                logits, hidden = model.forward(chunk, tapped_cache, last_only=last_only, taps=taps)
                assert torch.equal(plain, logits)
                assert hidden.shape == (1, chunk.shape[1], len(taps) * model.hidden_size)
            assert torch.equal(model.forward(tokens[:, :2], plain_cache), model.forward(tokens[:, :2], tapped_cache))


@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_final_tap_is_what_the_lm_head_reads(pair, path, monkeypatch):
    hf, model = pair
    model = on_path(model, path, monkeypatch)
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        reference = hf.model(input_ids=tokens, output_hidden_states=True).hidden_states
    assert len(reference) == LAYERS + 1
    head = hf.model.get_output_embeddings().weight.detach()
    for last_only in (False, True):
        logits, hidden = model.forward(tokens, model.new_cache(1), last_only=last_only, taps=(FINAL,))
        torch.testing.assert_close(hidden, reference[FINAL], rtol=1e-4, atol=1e-4)
        # the LM head of the tap's last row is the pass's logits
        torch.testing.assert_close(hidden[:, -1:] @ head.T, logits[:, -1:], rtol=1e-4, atol=1e-4)
    _, hf_hidden = hf.forward(tokens, hf.new_cache(1), taps=(FINAL,))
    torch.testing.assert_close(hf_hidden, reference[FINAL])


# --- the heads ------------------------------------------------------------------------------------------

import json  # noqa: E402
import sysconfig  # noqa: E402
from pathlib import Path  # noqa: E402

import verispec  # noqa: E402
from verispec.drafters.medusa import MedusaDrafter  # noqa: E402
from verispec.errors import VerispecError  # noqa: E402
from verispec.heads.data import features_of  # noqa: E402
from verispec.heads.medusa import MedusaConfig, MedusaHead, load_head, save_head  # noqa: E402
from verispec.heads.train import TrainConfig  # noqa: E402
from verispec.heads.train_medusa import medusa_loss, new_medusa_head  # noqa: E402

DRAFT_VOCAB = 64  # of the tiny models' 96 tokens: the heads cannot propose the rest
HEADS = 3


@pytest.fixture(scope="module")
def tiny_hf():
    return tiny_llama(seed=0, layers=LAYERS)


@pytest.fixture(scope="module")
def tiny_target(tiny_hf):
    return NativeCausalLM.from_hf(tiny_hf)


def random_heads(target, seed: int = 0, draft_vocab: int = DRAFT_VOCAB, layers: int = 1) -> MedusaHead:
    torch.manual_seed(seed)
    head = MedusaHead(MedusaConfig.for_target(target, draft_vocab, HEADS, layers))
    head.set_draft_vocab(torch.arange(target.vocab_size)[torch.randperm(target.vocab_size)[:draft_vocab]])
    with torch.no_grad():
        for block in head.modules():
            if isinstance(block, torch.nn.Linear) and block.weight.shape[0] == block.weight.shape[1]:
                block.weight.normal_(0, 0.05)  # not the identity, so the blocks are exercised
    return head


def features(target, rows: list[list[int]]) -> dict:
    return features_of(target, torch.tensor(rows), (int(target.config.num_hidden_layers),), top_k=16)


def sampled_shard(target, sequences: int = 6, length: int = 40, seed: int = 0) -> dict:
    """Features of the target's own sampled text (so there is something to learn)."""
    prompts = [[1, 5 + i] for i in range(sequences)]
    results = verispec.generate(target, prompts, drafter="none", temperature=0.7, seed=seed, max_new_tokens=length)
    return features(target, [(p + r.token_ids + [0] * length)[:length] for p, r in zip(prompts, results)])


def test_heads_shapes_and_names(tiny_target):
    head = random_heads(tiny_target, layers=2)
    h = tiny_target.hidden_size
    blocks = {f"medusa_head.{i}.{j}.linear.{w}" for i in range(HEADS) for j in range(2) for w in ("weight", "bias")}
    assert set(head.state_dict()) == blocks | {f"medusa_head.{i}.2.weight" for i in range(HEADS)} | {"d2t", "t2d"}
    assert head.medusa_head[1][2].weight.shape == (DRAFT_VOCAB, h) and head.medusa_head[1][2].bias is None
    assert head(torch.randn(2, 5, h)).shape == (2, 5, HEADS, DRAFT_VOCAB)
    assert head(torch.randn(2, h), heads=2).shape == (2, 2, DRAFT_VOCAB)
    assert torch.equal(torch.nonzero(head.t2d).squeeze(1), head.draft_token_ids)
    # a fresh block is the identity (Medusa's zero-initialized weight) up to SiLU of its bias
    fresh = MedusaHead(MedusaConfig.for_target(tiny_target, 96, 1, 1))
    assert torch.count_nonzero(fresh.medusa_head[0][0].linear.weight) == 0 and bool(fresh.t2d.all())


def test_training_reduces_the_loss(pair):
    _, target = pair
    shard = sampled_shard(target)
    head = random_heads(target)
    rows = list(range(6))
    with torch.no_grad():
        before, _, _ = medusa_loss(head, shard, rows, 0.8)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2)
    for _ in range(60):
        loss, _, _ = medusa_loss(head, shard, rows, 0.8)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        after, accuracy, losses = medusa_loss(head, shard, rows, 0.8)
    assert float(after) < 0.7 * float(before)
    assert accuracy[0] > 0.2 and len(losses) == HEADS


def test_loss_scores_head_i_against_the_target_at_t_plus_1_plus_i(tiny_target):
    """Heads whose LM head is the target's and blocks the identity predict t + 1: head 0 scores the target's
    next-next distribution, so it agrees with it about as often as the target repeats itself; a head fed
    the target's own next-token logits would score 100%."""
    shard = features(tiny_target, [PROMPT])
    head = new_medusa_head(tiny_target, [], tiny_target.vocab_size, 2, 0)
    _, accuracy, _ = medusa_loss(head, shard, [0], 0.8)
    # position t's hidden state through the target's LM head gives the argmax at t (top_ids[:, t]), not t + 1
    logits = head.medusa_head[0](shard["taps"][0].float())
    assert torch.equal(logits.argmax(-1), shard["top_ids"][0, :, 0].long())
    assert accuracy[0] < 0.5


def test_save_load_round_trip(tiny_target, tmp_path):
    head = random_heads(tiny_target, seed=3)
    head.config.extra["note"] = "kept"
    save_head(head, tmp_path / "heads")
    config = json.loads((tmp_path / "heads" / "config.json").read_text())
    assert config["architectures"] == ["MedusaHeads"] and config["medusa_num_heads"] == HEADS
    assert config["medusa_num_layers"] == 1 and config["draft_vocab_size"] == DRAFT_VOCAB
    loaded = load_head(tmp_path / "heads", tiny_target)
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    assert loaded.config == head.config
    assert isinstance(verispec.load(str(tmp_path / "heads")), MedusaHead)  # load(DIR) knows Medusa heads
    assert isinstance(verispec.load_head(str(tmp_path / "heads")), MedusaHead)
    plain = verispec.generate(tiny_target, PROMPT, drafter="none", max_new_tokens=8).token_ids
    by_path = verispec.generate(tiny_target, PROMPT, head=str(tmp_path / "heads"), max_new_tokens=8)
    assert by_path.token_ids == plain and by_path.stats.drafter == "MedusaDrafter"
    with pytest.raises(VerispecError, match="no Medusa heads"):
        load_head(tmp_path)
    with pytest.raises(VerispecError, match="not a draft head"):
        verispec.load_head(tmp_path)


@pytest.mark.parametrize("fmt", ["pt", "safetensors-prefixed"])
def test_loads_the_medusa_repository_layout(tiny_target, tmp_path, fmt):
    """config.json with medusa_num_heads / medusa_num_layers beside medusa_lm_head.pt (the state dict of
    Medusa's `medusa_head` module list: `{i}.{j}.linear.weight`, `{i}.{layers}.weight`) or a safetensors file
    with the `medusa_head.` prefix; full vocabulary, float16 weights as Medusa ships them."""
    from safetensors.torch import save_file

    head = random_heads(tiny_target, seed=4, draft_vocab=tiny_target.vocab_size, layers=2)
    medusa = {k: v.half() for k, v in head.medusa_head.state_dict().items()}
    assert "0.0.linear.weight" in medusa and "2.2.weight" in medusa
    if fmt == "pt":
        torch.save(medusa, tmp_path / "medusa_lm_head.pt")
    else:
        save_file({f"medusa_head.{k}": v for k, v in medusa.items()}, str(tmp_path / "medusa_lm_head.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": HEADS, "medusa_num_layers": 2,
                                                      "base_model_name_or_path": "tiny", "architectures": None}))
    loaded = verispec.load(str(tmp_path))
    assert isinstance(loaded, MedusaHead) and loaded.config.num_layers == 2 and loaded.config.draft_vocab_size == 96
    hidden = torch.randn(4, tiny_target.hidden_size)
    with torch.no_grad():
        expected = head.half().float()(hidden)  # the float16-rounded weights
    torch.testing.assert_close(loaded(hidden), expected)
    plain = verispec.generate(tiny_target, PROMPT, drafter="none", max_new_tokens=8).token_ids
    assert verispec.generate(tiny_target, PROMPT, draft=str(tmp_path), max_new_tokens=8).token_ids == plain


def test_heads_of_another_target_are_refused(tiny_target):
    other = NativeCausalLM.from_hf(tiny_qwen2(seed=0, layers=LAYERS))
    head = random_heads(tiny_target)
    head.config.vocab_size = 50
    with pytest.raises(VerispecError, match="own target"):
        verispec.generate(other, [1, 2, 3], draft=head, max_new_tokens=2)
    with pytest.raises(VerispecError, match="drafter='medusa'"):
        verispec.generate(other, [1, 2, 3], draft=random_heads(tiny_target), drafter="model", max_new_tokens=2)
    with pytest.raises(VerispecError, match="drafter='medusa'"):
        verispec.generate(other, [1, 2, 3], draft=random_heads(tiny_target), drafter="eagle3", max_new_tokens=2)
    with pytest.raises(VerispecError, match="trained head"):
        verispec.generate(other, [1, 2, 3], drafter="medusa", max_new_tokens=2)


# --- drafting -------------------------------------------------------------------------------------------

PROMPTS = [[1, 5, 6, 7, 8, 9, 5, 6, 7], [1, 20, 21], [4], [1, 30, 31, 32, 30, 31, 32, 30, 31, 40, 41, 42]]


def fitted_heads(target) -> MedusaHead:
    """Heads fitted to the target's greedy continuations of PROMPTS, so decoding them gets their tokens
    accepted (a random target has nothing a head could learn in general; a drafter that misaligned the
    target's hidden states would get few accepted even here)."""
    rows = [(p + verispec.generate(target, p, drafter="none", max_new_tokens=40).token_ids + [0] * 48)[:48] for p in PROMPTS]
    shard = features(target, rows)
    head = random_heads(target)
    seen = torch.cat([shard["tokens"].flatten(), shard["top_ids"][..., 0].flatten()]).long().unique()
    rest = torch.tensor([i for i in range(target.vocab_size) if i not in set(seen.tolist())])
    head.set_draft_vocab(torch.cat([seen, rest])[:DRAFT_VOCAB])
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2)
    for _ in range(150):
        loss, _, _ = medusa_loss(head, shard, list(range(len(rows))), 0.8)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval()


@pytest.fixture(scope="module")
def trained_heads(pair):
    return fitted_heads(pair[1])


@pytest.mark.parametrize("draft_len", [1, 2, 3, 6, "auto", "tree"])
def test_greedy_medusa_equals_plain(pair, trained_heads, draft_len):
    _, target = pair
    plain = [verispec.generate(target, p, drafter="none", max_new_tokens=40).token_ids for p in PROMPTS]
    for prompt, expected in zip(PROMPTS, plain):
        got = verispec.generate(target, prompt, draft=trained_heads, draft_len=draft_len, max_new_tokens=40)
        assert got.token_ids == expected, f"prompt {prompt}"
        assert got.stats.drafter == "MedusaDrafter"
    batch = verispec.generate(target, PROMPTS, draft=trained_heads, drafter="medusa", draft_len=draft_len,
                              max_new_tokens=40)
    assert [r.token_ids for r in batch] == plain  # rows of different lengths, leaving at different steps
    if draft_len not in ("auto", "tree"):  # "auto" rightly drafts little here: the tiny target is as cheap as the heads
        assert batch[0].stats.accepted_tokens > 40  # not vacuous: the heads' tokens were accepted


def test_greedy_medusa_alternates_stay_exact(tiny_target, llama_heads):
    """With a tree verifier (priced like a real pair, so it places alternates) the heads' second choices are
    checked too, and the output is still plain decoding's."""
    from test_trees import _decode, _PricedLikeAPair

    placed = 0
    for prompt in PROMPTS:
        expected = verispec.generate(tiny_target, prompt, drafter="none", max_new_tokens=40).token_ids
        (generated,), stats = _decode(tiny_target, MedusaDrafter(llama_heads, tiny_target), [prompt],
                                      _PricedLikeAPair(alternates=True), 40)
        assert generated[: len(expected)] == expected
        placed += stats.alternates_drafted
    assert placed > 0


def test_greedy_medusa_on_the_transformers_backend(pair, trained_heads):
    hf, _ = pair
    plain = [verispec.generate(hf, p, drafter="none", max_new_tokens=30).token_ids for p in PROMPTS]
    batch = verispec.generate(hf, PROMPTS, draft=trained_heads, draft_len=3, max_new_tokens=30)
    assert [r.token_ids for r in batch] == plain
    assert batch[0].stats.accepted_tokens > 20


def test_greedy_medusa_with_random_heads_is_still_exact(tiny_target):
    head = random_heads(tiny_target, seed=5)
    for prompt in PROMPTS:
        expected = verispec.generate(tiny_target, prompt, drafter="none", max_new_tokens=30).token_ids
        assert verispec.generate(tiny_target, prompt, draft=head, draft_len=3, max_new_tokens=30).token_ids == expected



def test_server_scheduler_drafts_with_medusa_heads(tiny_target, llama_heads):
    """The server's scheduler hands the heads the target's final hidden states too (`scheduler_gives_plain_tokens`)."""
    scheduler_gives_plain_tokens(tiny_target, llama_heads, "medusa", PROMPTS)

SAMPLED = [dict(temperature=0.8, seed=11, coupled=False), dict(temperature=1.2, top_k=12, top_p=0.9, seed=5, coupled=False)]


@pytest.fixture(scope="module")
def llama_heads(tiny_target):
    return fitted_heads(tiny_target)


@pytest.mark.parametrize("params", SAMPLED, ids=str)
def test_sampled_medusa_follows_the_target(tiny_hf, tiny_target, llama_heads, params):
    """Over 2000 seeded rows, the first two tokens follow the target's joint distribution (chi-square),
    although the heads can only propose 64 of the 96 tokens and never see their own tokens."""
    from test_sampling_exactness import P_THRESHOLD, first_two_tokens_pvalues, repeating_prompt
    from verispec.sampling import SamplingParams

    prompt = repeating_prompt(tiny_target)
    results = verispec.generate(tiny_target, [prompt] * 2000, draft=llama_heads, draft_len=3, max_new_tokens=3, **params)
    assert results[0].stats.accepted_tokens > 30  # both the accept and the resample paths ran
    first, joint = first_two_tokens_pvalues(tiny_hf, prompt, SamplingParams(**params), [r.token_ids for r in results])
    assert first > P_THRESHOLD and joint > P_THRESHOLD


class ReportsAnotherQ(MedusaDrafter):
    """A classic bug: tokens drawn from one distribution, another reported (here q sharpened, as if the
    temperature were applied twice), so min(1, p / q) and the residual max(0, p - q) use the wrong q.
    (Reporting a one-hot q on the drawn token would not do: that is a deterministic draft, exact too.)"""

    def propose(self, *args, **kwargs):
        draft = super().propose(*args, **kwargs)
        if draft.probs is not None:
            sharpened = draft.probs ** 4
            draft.probs = sharpened / sharpened.sum(-1, keepdim=True).clamp(min=1e-30)
        return draft


def test_negative_control_misreported_q_is_caught(tiny_hf, tiny_target, llama_heads):
    from test_sampling_exactness import first_two_tokens_pvalues, repeating_prompt
    from verispec.api import DRAFTERS
    from verispec.sampling import SamplingParams

    params = SAMPLED[0]
    prompt = repeating_prompt(tiny_target)
    original = DRAFTERS["medusa"]
    DRAFTERS["medusa"] = lambda target, draft, confidence: ReportsAnotherQ(draft, target)
    try:
        results = verispec.generate(tiny_target, [prompt] * 2000, draft=llama_heads, draft_len=3, max_new_tokens=3, **params)
    finally:
        DRAFTERS["medusa"] = original
    first, joint = first_two_tokens_pvalues(tiny_hf, prompt, SamplingParams(**params), [r.token_ids for r in results])
    assert min(first, joint) < 1e-10, (first, joint)  # measured: below 1e-200


# --- smollm2-135m (slow) --------------------------------------------------------------------------------

SMOL_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\n\n\ndef list_python_files(directory):\n",
    "The three primary colors are",
]


SMOL_DATA = (str(Path(sysconfig.get_paths()["stdlib"]) / "json"),)  # see smol_heads
# Prompts whose accepted tokens show the heads learned something: ~17-23 of 200 against ~0 for untrained heads.
ACCEPT_PROMPTS = SMOL_PROMPTS + ["class Stack:\n    def __init__(self):\n",
                                 "def read_json(path):\n    \"\"\"Load a JSON file.\"\"\"\n"]


@pytest.fixture(scope="module")
def smol_heads(tmp_path_factory):
    """Medusa heads for smollm2-135m trained for a few steps on ~4k tokens of the standard library's json package:
    the same files wherever this Python is (the installed packages, the default data, differ from one environment
    to another, and so would the heads and the tokens they get accepted)."""
    from verispec import zoo
    from verispec.heads.train_medusa import train_medusa

    torch.set_num_threads(1)
    zoo.pull("smollm2-135m")
    target = verispec.load("smollm2-135m")
    out = tmp_path_factory.mktemp("smol-medusa")
    config = TrainConfig(steps=30, checkpoint_every=15, lr=3e-3, warmup=3, eval_sequences=8)
    head = train_medusa(target, out, data=SMOL_DATA, max_tokens=4096, draft_vocab=2048, num_heads=3, config=config,
                        seq_len=64, features=out / "features", progress=False)
    return target, head, out


@pytest.mark.slow
def test_smollm_medusa_training_lowers_the_loss_and_resumes(smol_heads):
    from verispec.heads.train_medusa import train_medusa

    target, head, out = smol_heads
    log = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5  # it learns
    held_out = log[-1]["held_out"]
    assert len(held_out["accuracy"]) == 3 and held_out["sequences"] == 8
    assert held_out["accuracy"][0] > 0.1  # head 0 guesses the token after the target's own well above chance
    saved = load_head(out, target)
    assert saved.config.extra["steps"] == 30 and saved.config.target == "smollm2-135m"
    config = TrainConfig(steps=32, checkpoint_every=15, lr=3e-3, warmup=3, eval_sequences=8)
    train_medusa(target, out, data=SMOL_DATA, max_tokens=4096, draft_vocab=2048, num_heads=3, config=config,
                 seq_len=64, features=out / "features", progress=False)
    records = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    curve = [(r["step"], r["tokens"]) for r in records if "held_out" in r]
    assert curve[:2] == [(15, 15 * 2 * 60), (30, 30 * 2 * 60)]  # held-out agreement at each checkpoint, by tokens seen
    assert [r["step"] for r in records if "loss" in r][30:] == [31, 32]  # resumed from the checkpoint


@pytest.mark.slow
@pytest.mark.parametrize("draft_len", [3, "auto"])
def test_smollm_greedy_medusa_equals_plain(smol_heads, draft_len):
    target, _, out = smol_heads
    accepted = greedy_with_head_equals_plain(target, out, ACCEPT_PROMPTS, draft_len, "MedusaDrafter", SMOL_PROMPTS)
    if draft_len == 3:
        assert accepted > 10


@pytest.mark.slow
def test_cli_trains_medusa_heads(tmp_path, smol_heads):
    from verispec.cli import main

    code = main(["train", "medusa", "--target", "smollm2-135m", "--out", str(tmp_path / "h"), "--max-tokens", "2048",
                 "--seq-len", "64", "--draft-vocab", "1024", "--steps", "2", "--heads", "2",
                 "--features", str(tmp_path / "f")])
    assert code == 0 and isinstance(verispec.load(str(tmp_path / "h")), MedusaHead)
    assert verispec.load(str(tmp_path / "h")).config.num_heads == 2
    assert main(["train", "medusa", "--target", "smollm2-135m", "--out", str(tmp_path / "h"), "--heads", "0"]) == 2
