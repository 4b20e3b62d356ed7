"""Self-speculation on one cache (`SharedCacheDrafter`): the target's cheaper copy drafts against the
target's own keys and values. It writes into the target's cache while drafting, so these tests check
that the target never computes with a number the draft wrote: greedy output equals plain decoding,
the cache is left as found, a verify pass after a draft is bitwise the pass without one, and sampled
output follows the target's distribution."""

from __future__ import annotations

import pytest
import torch

import verispec
from conftest import perturbed_copy, tiny_gpt2, tiny_llama, tiny_qwen2
from test_greedy_equivalence import PROMPTS, plain
from test_sampling_exactness import P_THRESHOLD, first_two_tokens_pvalues, repeating_prompt
from verispec.drafters import SharedCacheDrafter
from verispec.errors import VerispecError
from verispec.models.native import NativeCausalLM
from verispec.sampling import SamplingParams

NATIVE = {"llama": tiny_llama, "qwen2": tiny_qwen2}


@pytest.fixture(scope="module", params=sorted(NATIVE))
def native_target(request):
    return NativeCausalLM.from_hf(NATIVE[request.param](seed=0))


def copies(target):
    """The default int4 copy (None: drafter="self" makes it) and a bfloat16 copy, which agrees far more often."""
    return {"int4": None, "bf16": target.lower_precision_copy(torch.bfloat16)}


@pytest.mark.parametrize("draft_len", [1, 3, 6, "auto", "tree"])
@pytest.mark.parametrize("copy", ["int4", "bf16"])
def test_self_drafts_give_plain_greedy_tokens(native_target, copy, draft_len):
    draft = copies(native_target)[copy]
    for prompt in PROMPTS:
        got = verispec.generate(native_target, prompt, drafter="self", draft=draft, draft_len=draft_len, max_new_tokens=40)
        assert got.token_ids == plain(native_target, prompt, 40), f"prompt {prompt}"


@pytest.mark.parametrize("draft_len", [2, 5, "auto"])
def test_self_drafts_in_a_batch_equal_each_row_alone(native_target, draft_len):
    draft = copies(native_target)["bf16"]
    batch = verispec.generate(native_target, PROMPTS, drafter="self", draft=draft, draft_len=draft_len, max_new_tokens=40)
    assert [r.token_ids for r in batch] == [plain(native_target, p, 40) for p in PROMPTS]


def test_self_drafts_are_accepted(native_target):
    """Not a vacuous pass: a bfloat16 copy on the target's cache agrees most of the time, even on a random model."""
    result = verispec.generate(native_target, PROMPTS[0], drafter="self", draft=copies(native_target)["bf16"], draft_len=4,
                               max_new_tokens=40)
    assert result.stats.acceptance_rate > 0.75 and result.stats.mean_accepted_tokens > 3


def test_int4_copy_drafts_better_on_the_shared_cache_than_on_its_own(native_target):
    """The same int4 copy, drafting from the target's exact history against its own approximate one."""
    int4 = native_target.lower_precision_copy(torch.quint4x2)
    shared = own = 0
    for prompt in PROMPTS:
        shared += verispec.generate(native_target, prompt, drafter="self", draft=int4, draft_len=4, max_new_tokens=40).stats.accepted_tokens
        own += verispec.generate(native_target, prompt, drafter="model", draft=int4, draft_len=4, max_new_tokens=40).stats.accepted_tokens
    assert shared > own


def test_propose_leaves_the_cache_as_it_found_it_and_the_target_pass_unchanged(native_target):
    """After drafting on the target's cache, the cache's bookkeeping is as before, and the target's verify
    pass over [last, draft] gives bitwise the logits of the same pass on a cache no draft has touched."""
    target = native_target
    prompt = [1, 5, 6, 7, 8, 9]
    drafted_on, untouched = target.new_cache(1), target.new_cache(1)
    for cache in (drafted_on, untouched):
        target.forward(torch.tensor([prompt[:-1]]), cache)
    drafter = SharedCacheDrafter(target.lower_precision_copy(torch.quint4x2), target)
    drafter.share_cache(drafted_on)
    visible, length = drafted_on.slots.visible.clone(), drafted_on.slots.length
    draft = drafter.propose([prompt], 5, [SamplingParams()], [torch.Generator()])
    assert int(draft.num_drafted[0]) == 5
    assert drafted_on.slots.length == length == drafted_on.store.length
    assert torch.equal(drafted_on.slots.visible, visible)
    assert drafted_on.store.capacity >= length + 5  # the draft did write slots past the end
    tokens = torch.cat([torch.tensor([[prompt[-1]]]), draft.tokens], 1)
    assert torch.equal(target.forward(tokens, drafted_on), target.forward(tokens, untouched))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, seed=11), SamplingParams(temperature=1.2, top_k=12, top_p=0.9, seed=5)],
                         ids=str)
def test_self_drafts_sample_the_target_distribution(params):
    """The first two sampled tokens over 2000 rows follow the target's joint distribution p(t1) p(t2 | t1)
    (rows in batches of 8, so every draft pass stays on the exact kernels and is not skipped)."""
    target = tiny_llama(seed=0)
    native = NativeCausalLM.from_hf(target)
    draft = NativeCausalLM.from_hf(perturbed_copy(target, scale=0.3))  # same shapes, often disagrees
    prompt = repeating_prompt(target)
    outputs, accepted = [], 0
    for first in range(0, 2000, 8):
        results = verispec.generate(native, [prompt] * 8, drafter="self", draft=draft, draft_len=3, temperature=params.temperature,
                                    top_k=params.top_k, top_p=params.top_p, seed=params.seed + first, coupled=False,
                                    max_new_tokens=3)
        outputs += [r.token_ids for r in results]
        accepted += results[0].stats.accepted_tokens
    assert accepted > 100  # both the accept and the resample paths ran
    first, joint = first_two_tokens_pvalues(target, prompt, params, outputs)
    assert first > P_THRESHOLD and joint > P_THRESHOLD


def test_self_drafter_needs_a_native_target_and_a_matching_copy():
    with pytest.raises(VerispecError, match="native-backend"):
        verispec.generate(tiny_gpt2(seed=0), [1, 2, 3], drafter="self", max_new_tokens=4)
    target = NativeCausalLM.from_hf(tiny_llama(seed=0))
    other = NativeCausalLM.from_hf(tiny_llama(seed=1, layers=3))
    with pytest.raises(VerispecError, match="copy of"):
        verispec.generate(target, [1, 2, 3], drafter="self", draft=other, max_new_tokens=4)


def test_self_drafts_under_continuous_batching(native_target):
    """Rows join a decoding batch (its shared cache grows) and leave it (rows are selected, the emptied
    batch makes a new cache); every request still gets plain decoding's tokens."""
    from conftest import job
    from verispec.api import make_drafter
    from verispec.server.scheduler import Scheduler

    target = native_target
    draft = target.lower_precision_copy(torch.bfloat16)
    cases = [([5, 6, 7], 20, 4), ([30, 31], 9, "auto"), ([40, 41, 42, 43], 33, 2), ([50], 14, None)]
    # the references first: a native model runs one pass at a time, and the scheduler's thread will be using it
    expected = {tuple(prompt): plain(target, prompt, n) for prompt, n, _ in [([20, 21], 60, None), *cases]}
    scheduler = Scheduler(target, lambda speculate: make_drafter(target, draft, "self" if speculate else "none"), max_batch=3)
    scheduler.start()
    try:
        for _ in range(2):  # the second round joins a batch that emptied
            long_job, long_result = job([20, 21], max_new_tokens=60)
            scheduler.submit([long_job])
            opening = long_result.items.get(timeout=30)
            assert opening.finish_reason is None  # decoding when the others join
            later = [job(prompt, max_new_tokens=n, draft=setting) for prompt, n, setting in cases]
            scheduler.submit([j for j, _ in later])
            assert opening.tokens + long_result.result() == expected[(20, 21)]
            for (_, collector), (prompt, _, _) in zip(later, cases):
                assert collector.result() == expected[tuple(prompt)], f"prompt {prompt}"
    finally:
        scheduler.stop()


@pytest.mark.parametrize("draft_len", [3, "auto"])
def test_coupled_self_drafts_give_plain_sampling_tokens(native_target, draft_len):
    """Gumbel-max coupled sampling: a seeded call with self drafts returns, token for token, what plain
    coupled sampling returns for that seed (sampled rows, drafted and verified on the shared cache)."""
    common = dict(temperature=0.9, top_p=0.95, coupled=True, max_new_tokens=24)
    for seed, prompt in enumerate(PROMPTS):
        plain_tokens = verispec.generate(native_target, prompt, drafter="none", seed=seed, **common).token_ids
        drafted = verispec.generate(native_target, prompt, drafter="self", draft=copies(native_target)["bf16"], draft_len=draft_len,
                                    seed=seed, **common)
        assert drafted.token_ids == plain_tokens, f"prompt {prompt}"
        assert drafted.stats.accepted_tokens > 0


def test_auto_drafts_with_the_self_copy_when_a_call_can_pay_for_it():
    """drafter="auto" without a draft model: the target's int4 copy for a native float32 target and a call long
    enough to repay making it (or once it exists), prompt lookup otherwise; a draft model keeps "model"."""
    from verispec.api import SELF_COPY_MIN_TOKENS, _SELF_DRAFTS, resolve_drafter

    target = NativeCausalLM.from_hf(tiny_llama(seed=5))
    assert resolve_drafter(target, None, "auto", SELF_COPY_MIN_TOKENS - 1) == "ngram"
    assert resolve_drafter(target, target, "auto", 1000) == "model"
    assert resolve_drafter(target, None, "ngram", 1000) == "ngram"
    assert target not in _SELF_DRAFTS
    short = verispec.generate(target, PROMPTS[0], max_new_tokens=SELF_COPY_MIN_TOKENS - 1)
    assert short.stats.drafter == "NgramDrafter" and target not in _SELF_DRAFTS
    long = verispec.generate(target, PROMPTS[0], max_new_tokens=SELF_COPY_MIN_TOKENS)
    assert long.stats.drafter == "SharedCacheDrafter" and target in _SELF_DRAFTS
    assert long.token_ids == plain(target, PROMPTS[0], SELF_COPY_MIN_TOKENS)
    # The copy exists now: short calls use it too. Rows count together: a batch of two asking for 20 each pays.
    assert verispec.generate(target, PROMPTS[0], max_new_tokens=8).stats.drafter == "SharedCacheDrafter"
    fresh = NativeCausalLM.from_hf(tiny_llama(seed=6))
    assert resolve_drafter(fresh, None, "auto", 20) == "ngram" and 20 < SELF_COPY_MIN_TOKENS <= 2 * 20
    assert verispec.generate(fresh, PROMPTS[:2], max_new_tokens=20)[0].stats.drafter == "SharedCacheDrafter"
    assert resolve_drafter(NativeCausalLM.from_hf(tiny_llama(seed=6)), None, "auto", None) == "self"  # a server


def test_auto_falls_back_to_prompt_lookup_where_no_int4_copy_can_draft():
    from verispec.api import resolve_drafter

    assert resolve_drafter(tiny_llama(seed=0), None, "auto", 1000) == "ngram"  # transformers backend
    int8 = NativeCausalLM.from_hf(tiny_llama(seed=0), weight_dtype=torch.int8)
    assert resolve_drafter(int8, None, "auto", 1000) == "ngram"  # not a float32 target
    restricted = NativeCausalLM.from_hf(tiny_llama(seed=0)).with_output_ids(torch.arange(50))
    assert resolve_drafter(restricted, None, "auto", 1000) == "ngram"
    torch.manual_seed(0)
    config = tiny_llama(seed=0).model.config
    config.hidden_size, config.intermediate_size, config.head_dim = 96, 160, 48  # widths that are not whole int4 groups
    config.num_attention_heads = config.num_key_value_heads = 2
    from transformers import LlamaForCausalLM

    from verispec.models.hf import HFCausalLM
    odd = NativeCausalLM.from_hf(HFCausalLM(LlamaForCausalLM(config), name="odd"))
    assert odd.max_exact_rows is not None  # on the kernels: only the widths rule the copy out
    with pytest.raises(VerispecError, match="divisible"):
        verispec.generate(odd, PROMPTS[0], drafter="self", max_new_tokens=4)
    assert resolve_drafter(odd, None, "auto", 1000) == "ngram"
    assert verispec.generate(odd, PROMPTS[0], max_new_tokens=70).stats.drafter == "NgramDrafter"
