"""The Python API: `load` a model once, `generate` (or `stream`) with any drafter.

Resolves names, tokenizes, picks the drafter once from the `DRAFTERS` table, and runs the engine.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Sequence

import torch
from transformers import PreTrainedModel

from verispec.drafters import (CrossTokenizerDrafter, Eagle3Drafter, HybridDrafter, MedusaDrafter, ModelDrafter, MTPDrafter,
                               NgramDrafter, NoDrafter, SharedCacheDrafter, StagedDrafter, SuffixDrafter)
from verispec.drafters.base import Drafter
from verispec.drafters.lookup_first import LookupFirstDrafter
from verispec.engine import Request, SpeculativeEngine, TokenEvent
from verispec import options
from verispec.errors import VerispecError
from verispec.grammar import response_format_grammar
from verispec.heads import HEAD_TYPES, Eagle3Head, MedusaHead, MTPHead, OnlineMedusa, is_head_directory, load_head
from verispec.models import stored
from verispec.models.base import CausalLM
from verispec.models.draft_variants import restrict_vocabulary
from verispec.models.hf import HFCausalLM, pick_device
from verispec.options import DraftLen
from verispec.sampling import Cascade, SamplingParams, TokenLogprob, default_coupled
from verispec.stats import SpecStats
from verispec.text import IncrementalText, StopSequences, encode_prompt, final_text, normalize_stop

_LOADED: dict[tuple, HFCausalLM] = {}


BACKENDS = ("auto", "native", "hf")


def load(name_or_path: Any, dtype: torch.dtype | str | None = None, device: str | torch.device | None = None, tokenizer=None,
         backend: str = "auto", weight_dtype: torch.dtype | str | None = None, gguf_blocks: bool | None = None,
         numerics: str = "float32") -> CausalLM:
    """A model ready for `generate`: a zoo name (`smollm2-135m`), a local directory, a `.gguf` file,
    a hub id, or a `transformers` model object. Loaded once per process and reused.

    backend: "native" runs Llama/Qwen2-family weights through verispec's own forward pass (fast,
    row-exact small-batch kernels on CPU); "hf" through `transformers`; "auto" picks native when the
    architecture is supported. Both backends give the same tokens.

    weight_dtype (native backend only): keep the matrices as "bf16" (half the bytes per token),
    "int8" (weight-only, one scale per output row: a quarter) or "int4" (weight-only, one scale per
    64 weights: about a seventh), or "q4_0" (ggml's Q4_0 blocks, about a seventh, run as a Q4_0 GGUF file
    runs under numerics="q8": activations rounded to 8 bits per 32), or "q3_0" (the same, with the MLP's gate
    and up matrices in verispec's 3-bit blocks of 32: about a ninth for those). The logits move: meant for
    *draft* models, whose output the target checks, never for a target.

    gguf_blocks (native backend, float32 matrices): a model converted from a GGUF file (every zoo
    model) keeps the matrices stored there as Q4_K / Q6_K blocks in that form and the kernels rebuild
    each weight exactly as the conversion did: the same numbers bit for bit, a fifth to a third of the
    bytes read per decode step (plain decoding about twice as fast on a 2-core CPU). Off by default
    (VERISPEC_GGUF_BLOCKS=1 turns it on): with a plain step that fast, a draft model's prompt prefill
    and wider verify passes are no longer hidden, and speculation stops paying on short chat answers.

    numerics: "float32" (the default) runs the float32 model a GGUF file stands for (converted once, as
    above). "q8" runs a GGUF file (a zoo name or a .gguf path) with llama.cpp's numerics, straight from
    the file's own Q4_K / Q5_K / Q6_K or Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks, memory-mapped: activations
    rounded to 8 bits per block (ggml's Q8_K per 256, Q8_0 / Q8_1 per 32) and integer dot products
    (`verispec.models.gguf_q8`). It loads in seconds at about the
    file's size and decodes at memory speed; its logits are not the float32 model's but llama.cpp's up
    to float32 rounding, and speculation is exact with respect to them (every token row is computed
    alike at any pass width).
    """
    if numerics not in ("float32", "q8"):
        raise VerispecError(f"numerics must be 'float32' or 'q8', got {numerics!r}")
    if numerics == "q8":
        return _load_q8(name_or_path, tokenizer, backend, weight_dtype, dtype, device)
    if backend not in BACKENDS:
        raise VerispecError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    weight_dtype = _parse_weight_dtype(weight_dtype)
    if weight_dtype is not None and backend == "hf":
        raise VerispecError("weight_dtype needs the native backend: drop backend='hf' or weight_dtype")
    if isinstance(name_or_path, (CausalLM, *HEAD_TYPES)):  # already a verispec model or head
        return name_or_path
    if gguf_blocks is None:
        gguf_blocks = os.environ.get("VERISPEC_GGUF_BLOCKS", "0") not in ("0", "false", "no", "")
    if isinstance(name_or_path, PreTrainedModel):  # a transformers model object
        return _wrap(HFCausalLM(name_or_path, tokenizer), backend, weight_dtype, gguf_blocks)
    if not isinstance(name_or_path, str) or not name_or_path:
        raise VerispecError(f"a model must be a zoo name, a path, a hub id or a loaded model, got {name_or_path!r}")
    if is_head_directory(name_or_path):  # a trained draft head: draft=load(DIR) drafts with it
        return load_head(name_or_path)
    dtype = _parse_dtype(dtype)
    key = (name_or_path, dtype, str(device))
    if key not in _LOADED:
        _LOADED[key] = _load_uncached(name_or_path, dtype, pick_device(device))
    return _wrap(_LOADED[key], backend, weight_dtype, gguf_blocks)


def load_draft(name_or_path: Any, target: CausalLM, weight_dtype: torch.dtype | str | None = None,
               vocab: int | str | None = "auto", **load_options):
    """A draft model (or head) for `target`. A draft named by path or zoo name takes `weight_dtype`, by default
    the target's kind of numbers: `Q8_DRAFT_WEIGHTS` beside a `numerics="q8"` target (a float32 0.5B draft reads
    ~2 GB a token there, several of that target's steps), float32 beside a float32 one. A loaded model is used
    as it is. load_options: `load`'s other keywords (dtype, ...).

    vocab: the draft's LM head scores the first `vocab` token ids, the special tokens and every token of the
    text it has read (`draft_variants.restrict_vocabulary(..., reads=True)`); None (or "all") scores them all. "auto":
    `DRAFT_HEAD_TOKENS` beside a q8 target where the vocabulary is at least twice that (Qwen2.5's 152k head
    is a quarter of the 0.5B Q4_0 draft's bytes), else None."""
    if not isinstance(name_or_path, str):
        if weight_dtype is not None:
            raise VerispecError("a draft's weight_dtype applies to a draft named by path or zoo name; "
                                "load this one with verispec.load(..., weight_dtype=...) instead")
        return load(name_or_path)
    if weight_dtype is None and target.numerics == "q8":
        weight_dtype = Q8_DRAFT_WEIGHTS
    vocab = options.draft_vocab(vocab)
    draft = load(name_or_path, weight_dtype=weight_dtype, **load_options)
    from verispec.models.native import NativeCausalLM

    if not isinstance(draft, NativeCausalLM):  # a trained head, or a model on the transformers backend
        if vocab not in ("auto", None):
            raise VerispecError(f"a draft vocab applies to a draft model on the native backend, not {name_or_path!r}: drop it")
        return draft
    if vocab == "auto":
        vocab = DRAFT_HEAD_TOKENS if target.numerics == "q8" and draft.vocab_size >= 2 * DRAFT_HEAD_TOKENS else None
    if vocab is None:
        return draft
    # one restricted copy per draft and size, so the costs measured on it (`costs.BOOK`) carry over between calls
    copies = _READING_DRAFTS.setdefault(draft, {})
    if vocab not in copies:
        copies[vocab] = restrict_vocabulary(draft, vocab, reads=True)
    return copies[vocab]


# A named draft's matrices beside a q8 target (`load_draft`): ggml's Q4_0 blocks, the MLP's gate and up in verispec's
# 3-bit ones. Its step streams ~10% fewer bytes than all-Q4_0's for a few % less acceptance: ~2% faster end to end
# (the Qwen pair, AMD EPYC; bench/README "3-bit draft blocks").
Q8_DRAFT_WEIGHTS = "q3_0"
# Token ids a draft's LM head scores beside a q8 target (`load_draft`), plus the special tokens and its text's own.
# On the Qwen pair (0.5B Q4_0 draft, 1.5B q8 target, Intel Xeon, 10 HumanEval and Spec-Bench prompts, staged
# drafting) 32k gave 1.10x the whole head's tokens/s (median; 64k 1.10x), identical output.
DRAFT_HEAD_TOKENS = 32768
_READING_DRAFTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _load_q8(name_or_path, tokenizer, backend: str, weight_dtype, dtype, device) -> CausalLM:
    """`load(..., numerics="q8")`: a GGUF file's own blocks with llama.cpp's numerics (models.gguf_q8)."""
    from pathlib import Path

    from verispec import zoo
    from verispec.models import gguf_q8

    if backend == "hf" or weight_dtype is not None or _parse_dtype(dtype) != torch.float32:
        raise VerispecError("numerics='q8' runs the GGUF file's own blocks on the native backend: drop backend='hf', "
                            "weight_dtype and dtype")
    if device is not None and torch.device(device).type != "cpu":
        raise VerispecError("numerics='q8' runs on the CPU: drop device")
    if not isinstance(name_or_path, str) or not name_or_path:
        raise VerispecError(f"numerics='q8' takes a zoo name or a .gguf file, got {name_or_path!r}")
    if name_or_path in zoo.ZOO:
        path = zoo.gguf_path(name_or_path)
        if not path.is_file():
            zoo.pull(name_or_path)
    else:
        path = Path(name_or_path).expanduser()
        if path.suffix.lower() != ".gguf" or not path.is_file():
            raise VerispecError(f"numerics='q8' takes a zoo name ({', '.join(zoo.ZOO)}) or a .gguf file; "
                                f"{name_or_path!r} is neither")
    key = (str(path.resolve()), "q8", id(tokenizer) if tokenizer is not None else None)
    if key not in _LOADED:
        _LOADED[key] = gguf_q8.load(path, tokenizer=tokenizer, name=name_or_path)
    return _LOADED[key]


# Native forwards built per transformers module and weight dtype. Keyed by the module itself, weakly:
# an entry lives as long as the user's model and can never be mistaken for another model's.
_NATIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _wrap(model: HFCausalLM, backend: str, weight_dtype: torch.dtype | None = None,
          gguf_blocks: bool = False) -> CausalLM:
    """The model on the requested backend; the native one shares the transformers model's weights
    (or keeps `weight_dtype` copies of its matrices, or the exact blocks of its source GGUF)."""
    from verispec.models.native import NativeCausalLM, supports

    native_ok = supports(model.model)
    if weight_dtype is not None and not native_ok:
        raise VerispecError(f"weight_dtype needs the native backend, which {model.name!r} ({model.config.model_type}) "
                            "does not have: drop weight_dtype")
    if backend == "hf" or (backend == "auto" and not native_ok):
        return model
    if backend == "native" and not native_ok:
        raise VerispecError(f"{model.name!r} ({model.config.model_type}) has no native forward: use backend='hf'")
    source = model.source_gguf if gguf_blocks and weight_dtype is None else None
    built = _NATIVE.setdefault(model.model, {})
    key = (weight_dtype, source is not None)
    native = built.get(key)
    if native is None or native.tokenizer is not model.tokenizer:
        try:
            # exact blocks rebuild row-major products: no panel copy to pack and then undo
            native = NativeCausalLM.from_hf(model, weight_dtype=weight_dtype, panels=False if source is not None else None)
        except ValueError as exc:  # e.g. int4 on matrices whose width is not a whole number of groups
            raise VerispecError(f"{model.name}: {exc}") from None
        if source is not None:
            native.use_gguf_blocks(source)
        built[key] = native
    return native


def _parse_weight_dtype(dtype) -> torch.dtype | str | None:
    if dtype is None or dtype in ("fp32", "float32", torch.float32):
        return None
    if dtype in ("q4_0", "q3_0"):
        return dtype  # ggml's Q4_0 blocks (and verispec's 3-bit ones), multiplied with llama.cpp's numerics (NativeCausalLM)
    if dtype in ("int8", torch.int8):
        return torch.int8
    if dtype in ("int4", torch.quint4x2):
        return torch.quint4x2  # the tag of verispec's grouped int4 matrices
    if dtype not in ("bf16", "bfloat16", torch.bfloat16):
        raise VerispecError(f"weight_dtype must be fp32, bf16, int8, int4 or q4_0, got {dtype!r}")
    return torch.bfloat16


def _parse_dtype(dtype) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in names:
        raise VerispecError(f"unknown dtype {dtype!r}: use one of {sorted(names)}")
    return names[dtype]


def _load_uncached(name: str, dtype: torch.dtype, device: torch.device) -> HFCausalLM:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verispec import zoo

    path, gguf_file = zoo.resolve(name)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device)
    except OSError as exc:
        raise VerispecError(
            f"could not load model {name!r} ({exc.__class__.__name__}: {str(exc).splitlines()[0]}); "
            f"use a zoo name ({', '.join(zoo.ZOO)}), a local directory with config.json, or a .gguf file"
        ) from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError):
        tokenizer = None
    loaded = HFCausalLM(model, tokenizer, name=name)
    loaded.source_gguf = zoo.source_gguf(path, gguf_file)  # for exact k-quant blocks (see `load`)
    return loaded


# How each drafter is built, chosen once per call: (target, draft model or None, draft_confidence) -> Drafter.
DRAFTERS: dict[str, Callable[[CausalLM, CausalLM | None, float], Drafter]] = {
    "model": lambda target, draft, confidence: ModelDrafter(draft, target.vocab_size, min_confidence=confidence),
    "cross_tokenizer": lambda target, draft, confidence: CrossTokenizerDrafter(draft, target),
    "hybrid": lambda target, draft, confidence: HybridDrafter(ModelDrafter(draft, target.vocab_size, min_confidence=confidence)),
    "self": lambda target, draft, confidence: SharedCacheDrafter(draft if draft is not None else self_draft(target), target,
                                                                 min_confidence=confidence),
    "staged": lambda target, draft, confidence: StagedDrafter(
        ModelDrafter(draft, target.vocab_size, min_confidence=confidence) if draft is not None
        else SharedCacheDrafter(self_draft(target), target, min_confidence=confidence),
        SuffixDrafter(suffix_index(target), target.vocab_size)),
    "eagle3": lambda target, draft, confidence: Eagle3Drafter(draft, target, min_confidence=confidence),
    "medusa": lambda target, draft, confidence: MedusaDrafter(draft, target, min_confidence=confidence),
    "mtp": lambda target, draft, confidence: MTPDrafter(draft, target, min_confidence=confidence),
    "head+suffix": lambda target, draft, confidence: LookupFirstDrafter(
        DRAFTERS[head_drafter(draft)](target, draft, confidence), SuffixDrafter(suffix_index(target), target.vocab_size)),
    "ngram": lambda target, draft, confidence: NgramDrafter(),
    "suffix": lambda target, draft, confidence: SuffixDrafter(suffix_index(target), target.vocab_size),
    "rest": lambda target, draft, confidence: SuffixDrafter(suffix_index(target), target.vocab_size,
                                                            datastore=target_datastore(target)),
    "none": lambda target, draft, confidence: NoDrafter(),
}


# The drafter each kind of trained head drafts with (and the only one it drafts with).
HEAD_DRAFTERS: dict[type, str] = {Eagle3Head: "eagle3", MedusaHead: "medusa", OnlineMedusa: "medusa", MTPHead: "mtp"}


# The heads "auto" pairs with suffix lookup ("head+suffix"): those that skip a step and read what they skipped later.
LOOKUP_FIRST_HEADS = ("eagle3", "mtp")


def head_drafter(draft) -> str | None:
    """The drafter name of a trained head (`HEAD_DRAFTERS`), None for anything else."""
    return next((name for kind, name in HEAD_DRAFTERS.items() if isinstance(draft, kind)), None)


# Each target's index of earlier outputs for drafter="suffix": every call (and every lane of a server) on
# that target drafts from the outputs of the ones before it. Token ids mean something only to one vocabulary.
# The drafters that read it (a benchmark clears it before each timed call, or a prompt's later rounds would draft
# their answer from its first).
SUFFIX_INDEX_DRAFTERS = ("suffix", "rest", "staged", "head+suffix")
_SUFFIX_INDEXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def suffix_index(target: CausalLM):
    """The `SuffixIndex` that drafter="suffix" shares across calls on `target` (made on first use)."""
    from verispec.drafters.suffix import SuffixIndex

    index = _SUFFIX_INDEXES.get(target)
    if index is None:
        index = _SUFFIX_INDEXES[target] = SuffixIndex()
    return index


# Each target's datastore for drafter="rest" (`drafters.datastore.datastore_for`), read once per process.
_DATASTORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def target_datastore(target: CausalLM):
    """The datastore drafter="rest" drafts from on `target`: built on first use (cached on disk), then kept in memory."""
    from verispec.drafters.datastore import datastore_for

    store = _DATASTORES.get(target)
    if store is None:
        store = _DATASTORES[target] = datastore_for(target)
    return store


# Each native target's int4 copy for drafter="self", made once and kept while the target lives.
_SELF_DRAFTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def self_draft(target: CausalLM) -> CausalLM:
    """The target's own int4 copy (`NativeCausalLM.lower_precision_copy`), the default draft of
    drafter="self": made on first use (~0.56 bytes per weight more memory) and reused."""
    draft = _SELF_DRAFTS.get(target)
    if draft is None:
        if not target.makes_lower_precision_copies or target.weight_dtype != torch.float32:
            raise VerispecError(f"drafter='self' drafts with an int4 copy of a native-backend float32 target; "
                                f"{target.name!r} is not one: load it with backend='native' (no weight_dtype), or "
                                "use drafter='model' with a draft model")
        try:
            draft = _SELF_DRAFTS[target] = stored.int4_copy(target)
        except ValueError as exc:  # e.g. matrix widths that are not whole int4 groups
            raise VerispecError(f"{target.name}: {exc}; pass a draft copy made with weight_dtype='int8' or 'bf16'") from None
    return draft


_SAME_VOCAB: dict[tuple[int, int], tuple] = {}


def _same_vocabulary(a, b) -> bool:
    """Tokenizers map the same strings to the same ids (memoized: a 150k-entry comparison is not free).
    The memo holds both tokenizers, so their ids cannot be reused by other objects."""
    key = (id(a), id(b))
    if key not in _SAME_VOCAB:
        _SAME_VOCAB[key] = (a, b, a is b or a.get_vocab() == b.get_vocab())
    return _SAME_VOCAB[key][2]


def shares_vocabulary(target: CausalLM, draft: CausalLM) -> bool:
    """Whether the draft numbers tokens as the target does: the same strings with the same ids where both have a
    tokenizer, else the same vocabulary size. Decides once, by declaration, which drafter a draft model gets."""
    if target.tokenizer is not None and draft.tokenizer is not None:
        return _same_vocabulary(target.tokenizer, draft.tokenizer)
    return draft.vocab_size == target.vocab_size


def drafts_through_text(target: CausalLM, draft: CausalLM) -> bool:
    """Whether a draft model must draft through text (`CrossTokenizerDrafter`): its vocabulary is not the
    target's, and both have a tokenizer to bridge them."""
    return target.tokenizer is not None and draft.tokenizer is not None and not shares_vocabulary(target, draft)


def check_compatible(target: CausalLM, draft: CausalLM, drafter: str = "model") -> None:
    """A drafter that hands the draft's token ids to the target (`drafter`: "model", "hybrid") needs one
    vocabulary; drafting across tokenizers ("cross_tokenizer") needs both tokenizers, to go through text."""
    if drafter == "cross_tokenizer":
        if target.tokenizer is None or draft.tokenizer is None:
            missing = target.name if target.tokenizer is None else draft.name
            raise VerispecError(f"drafter='cross_tokenizer' drafts through text, but {missing!r} has no tokenizer: load it "
                                "with one, or use a draft with the target's vocabulary")
        return
    if shares_vocabulary(target, draft):
        return
    if target.tokenizer is not None and draft.tokenizer is not None:
        raise VerispecError(
            f"draft {draft.name!r} and target {target.name!r} have different tokenizers, which drafter={drafter!r} "
            "cannot bridge: use drafter='model' or 'auto' (they draft through text across tokenizers), or a draft "
            "model from the target's family (same tokenizer)"
        )
    raise VerispecError(
        f"draft {draft.name!r} has {draft.vocab_size} tokens but target {target.name!r} has {target.vocab_size}: "
        "they must share one vocabulary, or both have tokenizers (to draft through text); choose a matching draft or "
        "drafter='ngram'"
    )


# drafter="auto" without a draft model makes the target's int4 copy only for a call asking for at least
# this many new tokens (or when the copy exists, in memory or on disk): making it takes about as long as 13-17 of the target's
# decode steps (Qwen2.5-Coder 1.5B: 2.7-3.5 s against 0.21 s a step on a 2-core Xeon), and drafting with
# it saves about half of each step there (Spec-Bench 1.78x), so a first call breaks even near 30 tokens.
SELF_COPY_MIN_TOKENS = 32


def self_draft_possible(target: CausalLM) -> bool:
    """Whether `self_draft` can give this target a copy that drafts on its C kernels: a native float32
    target with its full head, on a CPU with the kernels, whose matrix widths are whole int4 groups."""
    if target in _SELF_DRAFTS:
        return True
    if target.max_exact_rows is None or not target.makes_lower_precision_copies:
        return False
    if target.numerics != "float32":
        # a q8 target's step already reads ~4.5 bits a weight: an int4 copy's costs nearly as much (the 1.5B's
        # drafted at 0.86-0.90x of plain decoding on Spec-Bench and HumanEval, 2026-11-26)
        return False
    if target.weight_dtype != torch.float32 or target.output_ids is not None:
        return False
    from verispec.models.kernels import Int4Matrix
    return all(int(matrix.shape[1]) % Int4Matrix.GROUP == 0 for matrix in target.matrices())


def resolve_drafter(target: CausalLM, draft: CausalLM | None, drafter: str, new_tokens: int | None = None) -> str:
    """The drafter "auto" stands for (other names are returned as they are).

    With a draft model: "model" (with its confidence deciding how far each draft goes, it beat prompt lookup
    first, "hybrid", on HumanEval and matched or beat it on 12 of 13 Spec-Bench categories), or "staged" where
    target and draft both run llama.cpp's numerics (a q8 target, a draft in ggml's Q4_0 blocks: there the draft
    model sped up by suffix proposals raced ahead of it, see the comment below); and where the
    draft's vocabulary is not the target's and both have tokenizers (`drafts_through_text`), "auto" and
    "model" both mean "cross_tokenizer" (the draft drafts in its own vocabulary, its text re-encoded). Without one:
    "self" where the target can have an int4 copy (`self_draft_possible`) and the call is long enough to
    pay for making it (`new_tokens` in all rows at least SELF_COPY_MIN_TOKENS, None for a server or a
    session that will make many calls) or need not make it (it is in memory, or stored on disk and read
    back in a fraction of a second: `models.stored`); else "ngram" (so for a q8 target, `numerics="q8"`, whose int4
    copy would cost nearly a step a token).
    """
    if drafter in ("auto", "model") and draft is not None and head_drafter(draft) is None and drafts_through_text(target, draft):
        return "cross_tokenizer"
    if drafter != "auto":
        return drafter
    if head_drafter(draft) is not None:
        # a chain head (EAGLE-3, MTP) with suffix lookup beside it, which drafts repeated text for free: ahead of
        # the head alone on HumanEval (1.36x against 1.21x plain) and Spec-Bench (0.98x against 0.93x), q8 1.5B
        return "head+suffix" if head_drafter(draft) in LOOKUP_FIRST_HEADS else head_drafter(draft)
    if draft is not None:
        # Both in llama.cpp's numerics (the 1.5B q8 target, the 0.5B in Q4_0 blocks), staged drafting raced ahead of the
        # draft model alone: HumanEval 1.67x against 1.50x plain, Spec-Bench 1.09x against 1.03x (AMD Zen 5), HumanEval
        # 1.55x against 1.41x (an Intel Xeon, Emerald Rapids), 2026-11-26.
        # With an int4 draft its wider draft passes cost too much (0.47x plain on a loaded machine), so "model" there.
        both_q8 = target.numerics == "q8" and draft.numerics == "q8"
        return "staged" if both_q8 else "model"
    if self_draft_possible(target) and (target in _SELF_DRAFTS or new_tokens is None or new_tokens >= SELF_COPY_MIN_TOKENS
                                        or stored.has_copy(target)):
        return "self"
    # e.g. a q8 target (llama.cpp's numerics), whose int4 copy raced at 0.86-0.90x of plain: prompt lookup raced at
    # 1.24x plain on HumanEval and 1.11x on Spec-Bench there, suffix decoding at 1.21x and 1.07x (same runs)
    return "ngram"


def make_drafter(target: CausalLM, draft: CausalLM | None, drafter: str, draft_confidence: float = 0.0) -> Drafter:
    drafter = resolve_drafter(target, draft, options.drafter_name(drafter))
    if drafter in HEAD_DRAFTERS.values() and head_drafter(draft) != drafter:
        if head_drafter(draft) is not None:
            raise VerispecError(f"a trained head drafts with drafter={head_drafter(draft)!r} (or 'auto'), not {drafter!r}")
        raise VerispecError(f"drafter={drafter!r} drafts with a trained head: pass draft=verispec.load_head(DIR) (or the "
                            f"head's directory); train one with `verispec train {drafter}`")
    if drafter == "head+suffix" and head_drafter(draft) is None:
        raise VerispecError("drafter='head+suffix' drafts with a trained head where suffix lookup has nothing better: pass "
                            "draft=verispec.load_head(DIR) (or the head's directory)")
    if head_drafter(draft) is not None and drafter in ("model", "cross_tokenizer", "hybrid", "self", "staged"):
        raise VerispecError(f"a trained head drafts with drafter={head_drafter(draft)!r} (or 'auto'), not {drafter!r}")
    if head_drafter(draft) is not None and draft.config.vocab_size != target.vocab_size:
        raise VerispecError(f"the head was trained for {draft.config.target!r} ({draft.config.vocab_size} tokens); "
                            f"{target.name!r} has {target.vocab_size}: use it with its own target")
    if drafter == "staged" and draft is not None:
        check_compatible(target, draft, drafter)
    if drafter in ("model", "cross_tokenizer", "hybrid"):
        if draft is None:
            raise VerispecError(f"drafter={drafter!r} needs a draft model: pass draft=NAME_OR_PATH")
        check_compatible(target, draft, drafter)
    if drafter == "self" and draft is not None and not target.same_layer_shapes(draft):
        raise VerispecError(f"drafter='self' drafts on the target's cache, so the draft must be a native-backend copy of "
                            f"{target.name!r} (e.g. verispec.load(name, weight_dtype='int8')); {draft.name!r} is not: "
                            "drop draft= to use the target's int4 copy, or use drafter='model'")
    if not isinstance(draft_confidence, (int, float)) or not 0.0 <= draft_confidence < 1.0:
        raise VerispecError(f"draft_confidence must be in [0, 1) (0 drafts every position), got {draft_confidence!r}")
    return DRAFTERS[drafter](target, draft, draft_confidence)


@dataclass
class GenerationResult:
    text: str | None  # None when the prompt was token ids and the model has no tokenizer
    token_ids: list[int]  # generated tokens only (EOS included when it ended the sequence)
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    stats: SpecStats = field(repr=False, default_factory=SpecStats)  # shared by every row of one call
    logprobs: list[TokenLogprob] | None = None  # per generated token, when asked for (`generate(logprobs=...)`)


def _normalize_prompts(prompt) -> tuple[list, bool]:
    """-> (list of str-or-token-list, was_batch)."""
    def is_ids(x):
        return isinstance(x, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(prompt, str):
        return [prompt], False
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.tolist()
    if is_ids(prompt) and len(prompt) > 0:
        return [list(prompt)], False
    if isinstance(prompt, (list, tuple)) and prompt:
        for i, p in enumerate(prompt):
            if not (isinstance(p, str) or (is_ids(p))):
                raise VerispecError(f"prompt {i} of the batch is {type(p).__name__}: each element must be text or a list of token ids")
        return [list(p) if not isinstance(p, str) else p for p in prompt], True
    raise VerispecError(f"prompt must be text, token ids, or a non-empty list of either; got {prompt!r:.80}")


def _tokenize(target: CausalLM, prompts: list, chat: bool, system: str | None = None) -> list[list[int]]:
    ids = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p:
                raise VerispecError(f"prompt {i} is empty text: give the model something to continue")
            p = encode_prompt(target.tokenizer, p, chat=chat, system=system)
        if not p:
            raise VerispecError(f"prompt {i} has no tokens: give at least one token")
        bad = [t for t in p if not 0 <= t < target.vocab_size]
        if bad:
            raise VerispecError(f"prompt {i} has token ids outside the vocabulary [0, {target.vocab_size}): {bad[:5]}")
        ids.append(p)
    return ids


class Session:
    """Everything one call needs, resolved and checked once."""

    def __init__(self, target, prompt, *, draft=None, drafter="auto", draft_len="auto", temperature=0.0, top_k=0, top_p=1.0,
                 seed=None, coupled=None, blockwise=True, typical_acceptance=0.0, max_new_tokens=128, chat=False, stop=None,
                 draft_confidence=0.0, system=None, head=None, presence_penalty=0.0, frequency_penalty=0.0,
                 repetition_penalty=1.0, min_p=0.0, logit_bias=None, min_tokens=0, logprobs=None, processed_logprobs=False,
                 response_format=None, cascade=None):
        # The options first: a bad value fails before any model loads.
        draft_len = DraftLen.parse(draft_len)
        max_new_tokens = options.max_new_tokens(max_new_tokens)
        options.drafter_name(drafter)
        if coupled is None:  # seeded sampling reproduces its text by default
            coupled = default_coupled(seed, temperature, typical_acceptance, cascade)
        self.sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, coupled=coupled,
                                       blockwise=blockwise, typical_acceptance=typical_acceptance, cascade=cascade,
                                       presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                       repetition_penalty=repetition_penalty, min_p=min_p, logit_bias=logit_bias or (),
                                       min_tokens=min_tokens)
        if not isinstance(processed_logprobs, bool):
            raise VerispecError(f"processed_logprobs must be True or False, got {processed_logprobs!r}")
        if system is not None and not chat:
            raise VerispecError("system= is a system prompt for the chat template: pass chat=True as well, or drop system=")
        self.target = load(target)
        if head is not None:  # a trained draft head (a directory or `load_head`'s result) is the draft
            if draft is not None:
                raise VerispecError("give either draft= or head=, not both")
            draft = head if isinstance(head, HEAD_TYPES) else load_head(head)
        draft_model = load_draft(draft, self.target) if draft is not None else None
        prompts, self.batched = _normalize_prompts(prompt)
        self.prompt_ids = _tokenize(self.target, prompts, chat, system)
        self.stop = normalize_stop(stop)
        if self.stop and self.target.tokenizer is None:
            raise VerispecError("stop sequences need a tokenizer: load the model with one, or drop stop=")
        auto = drafter == "auto"
        drafter = resolve_drafter(self.target, draft_model, drafter, len(self.prompt_ids) * max_new_tokens)
        make_drafter(self.target, draft_model, drafter, draft_confidence)  # fail on a bad drafter choice now
        # "auto" with a draft model and adaptive lengths: prompt lookup instead where the draft's prompt
        # prefill would not pay (a fixed draft_len keeps its drafter, so a seed reproduces its sample).
        fallback = (lambda: make_drafter(self.target, None, "ngram")) if auto and draft_model is not None and draft_len.adaptive else None
        self.engine = SpeculativeEngine(self.target, lambda: make_drafter(self.target, draft_model, drafter, draft_confidence), draft_len,
                                        fallback=fallback)
        checker = StopSequences(self.target.tokenizer, self.stop) if self.stop else None
        grammar = response_format_grammar(response_format, self.target.tokenizer, self.target.vocab_size,
                                          self.target.eos_token_ids)
        # Row b of a seeded batch uses seed + b, so rows are independent draws and each is reproducible alone.
        self.requests = [
            Request(prompt=ids, sampling=replace(self.sampling, seed=None if seed is None else seed + b),
                    max_new_tokens=max_new_tokens, stop_checker=checker, id=b, logprobs=logprobs,
                    processed_logprobs=processed_logprobs, grammar=grammar)
            for b, ids in enumerate(self.prompt_ids)
        ]
        self.stats = SpecStats()

    def events(self) -> Iterator[TokenEvent]:
        return self.engine.stream(self.requests, stats=self.stats)


def generate(target, prompt, *, draft=None, drafter: str = "auto", draft_len: DraftLen | int | str = "auto", temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = None, coupled: bool | None = None, blockwise: bool = True,
             typical_acceptance: float = 0.0, max_new_tokens: int = 128,
             chat: bool = False, stop: str | Sequence[str] | None = None,
             draft_confidence: float = 0.0, system: str | None = None, head=None, presence_penalty: float = 0.0,
             frequency_penalty: float = 0.0, repetition_penalty: float = 1.0, min_p: float = 0.0,
             logit_bias: dict[int, float] | None = None, min_tokens: int = 0, logprobs: int | None = None,
             processed_logprobs: bool = False, response_format: dict | None = None,
             cascade: Cascade | dict | str | None = None) -> GenerationResult | list[GenerationResult]:
    """Generate from `prompt` with speculative decoding; the output is what the target alone would give.

    target / draft: zoo name, path, hub id or loaded model. prompt: text, token ids, or a list of
    either (a batch: returns a list). drafter: "auto" ("model" if a draft model is given; with an adaptive
    draft_len, a draft model whose prompt prefill could not pay for itself over a quarter of max_new_tokens, by the
    costs this process measured, gives way to n-gram for that call; one that can starts, in a one-prompt call,
    after a few answer tokens drafted by n-gram: `policy.start_after`. Without one, "self" for a native
    float32 target on a CPU with verispec's kernels when the call asks for at least SELF_COPY_MIN_TOKENS
    new tokens or the copy exists (in memory or stored on disk), else n-gram (a q8 target: always): see
    `resolve_drafter`),
    "model", "cross_tokenizer" (a draft model with another tokenizer drafts in its own vocabulary, its text
    re-encoded with the target's: what "auto" and "model" pick when the vocabularies differ), "self" (the
    target's own int4 copy drafts on the target's cache; native float32 targets; `draft`
    may give another copy with the target's layer shapes), "hybrid" (prompt lookup when it finds a match,
    else the draft model), "staged" (the draft model, or without one the target's int4 copy, drafts by
    speculating itself: suffix-decoding proposals checked in one pass of the draft model, which keeps the
    prefix it agrees with and one token of its own; the draft tokens are distributed as its own), "ngram", "suffix" (suffix decoding: the longest match of the text's end in the
    prompt, the output so far and earlier calls' outputs on this target, most frequent continuation first), "rest"
    ("suffix", and a datastore of the installed packages' Python sources where that matches further: REST), or
    "none" (plain decoding). draft_len: "auto" (the default) drafts while the draft model's confidence
    says the next token pays for itself, up to 10, and decides from measured acceptance and costs
    whether to draft at all; "tree" does the same and also adds a second candidate beside positions
    where that pays for its row (native targets: token-tree verification; a greedy row's second choice,
    a sampled row's second draw, judged exactly; coupled and typical rows draft chains);
    an int drafts that many tokens each step. draft_confidence: a draft model
    also stops drafting a row at a token it gives less than this probability. temperature 0 is greedy.
    coupled: sample by the Gumbel-max coupling (`CoupledVerifier`): a seeded call then returns the same
    tokens with any drafter and draft length, plain decoding included, at some cost in acceptance (a
    draft token agrees with chance at least (1 - TV) / (1 + TV) where speculative sampling accepts with
    1 - TV). None (the default) couples seeded sampled calls, so a seed reproduces its text whatever the
    draft lengths and timing; coupled=False keeps speculative sampling, exact too but its sample depends
    on how the steps were drafted.
    presence_penalty, frequency_penalty (OpenAI's, in [-2, 2], over generated tokens), repetition_penalty
    (HF/vLLM's, > 0, over prompt and generated tokens), logit_bias ({token id: bias in [-100, 100]}),
    min_tokens (no EOS before that many tokens), min_p (drop tokens below min_p times the top one's
    probability): as plain decoding applies them, at every draft position with the history up to it, so
    the output is still exactly the target's.
    logprobs: n >= 0 returns each generated token's log-probability under the target in
    GenerationResult.logprobs, with the n most likely tokens beside it; from the target's raw logits
    (vLLM's default), or after logit_bias, min_tokens and penalties with processed_logprobs=True (before
    temperature and the filters either way).
    blockwise: speculative sampling judges each draft as a block (`BlockVerifier`, the default), which
    accepts at least as many tokens in expectation as the token-by-token rule (False).
    typical_acceptance: eps > 0 trades exactness for speed at temperature > 0 (`TypicalVerifier`, Medusa's
    rule; e.g. 0.09): a draft token is kept while the target gives it more than
    min(eps, sqrt(eps) * exp(-entropy)). LOSSY: the text is plausible to the target but no longer a sample
    of its distribution. Greedy decoding is unaffected (exact either way).
    cascade: a speculative cascade (`CascadeVerifier`, Narasimhan et al. 2025), e.g. {"rule": "chow", "alpha":
    0.1} or "chow:0.1": where the deferral rule finds the draft model good enough (chow: its top probability
    above 1 - alpha; diff: above the target's minus alpha) its token stands unchecked. LOSSY, greedy decoding
    too; more tokens per target pass the larger alpha (chow 0 / diff -1: exact). Needs a draft model's
    probabilities: deterministic drafts (n-gram) always defer.
    chat: each text prompt is one user turn in the model's chat template; system: a system turn before
    it (with chat=True).
    response_format: structured output, OpenAI's shapes: {"type": "json_object"} (any JSON object), {"type":
    "json_schema", "json_schema": {"name": ..., "schema": {...}}}, or verispec's {"type": "regex", "pattern": ...} and
    {"type": "lark", "grammar": ...}. Every position, draft positions included, is masked to what the grammar
    allows after the tokens before it (`verispec.grammar`), so the output is exactly plain constrained decoding's;
    it stops when the grammar is complete. A bad schema or pattern raises VerispecError.
    head: a trained draft head (its directory, or `verispec.load_head(DIR)`): an EAGLE-3 head (`verispec train
    eagle3` makes one) drafts with drafter="eagle3", Medusa heads (`verispec train medusa`, or the Medusa
    repository's files) with drafter="medusa", an MTP module (`verispec train mtp`) with drafter="mtp"; "auto"
    picks the head's own. draft=head works the same.
    """
    session = Session(target, prompt, draft=draft, drafter=drafter, draft_len=draft_len, temperature=temperature,
                      top_k=top_k, top_p=top_p, seed=seed, coupled=coupled, blockwise=blockwise,
                      typical_acceptance=typical_acceptance, max_new_tokens=max_new_tokens, chat=chat,
                      stop=stop, draft_confidence=draft_confidence, system=system, head=head, presence_penalty=presence_penalty,
                      frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty, min_p=min_p,
                      logit_bias=logit_bias, min_tokens=min_tokens, logprobs=logprobs, processed_logprobs=processed_logprobs,
                      response_format=response_format, cascade=cascade)
    generated = [[] for _ in session.prompt_ids]
    logprobs_out = [[] if logprobs is not None else None for _ in session.prompt_ids]
    finish = ["length"] * len(generated)
    for event in session.events():
        generated[event.request_id].extend(event.tokens)
        if event.logprobs is not None:
            logprobs_out[event.request_id].extend(event.logprobs)
        if event.finish_reason:
            finish[event.request_id] = event.finish_reason
    tokenizer = session.target.tokenizer
    results = [
        GenerationResult(
            text=final_text(tokenizer, ids, session.stop) if tokenizer is not None else None,
            token_ids=ids,
            finish_reason=reason,
            prompt_tokens=len(prompt_ids),
            stats=session.stats,
            logprobs=token_logprobs,
        )
        for ids, reason, prompt_ids, token_logprobs in zip(generated, finish, session.prompt_ids, logprobs_out)
    ]
    return results if session.batched else results[0]


@dataclass
class StreamChunk:
    text: str  # new visible text ("" when the model has no tokenizer)
    token_ids: list[int]
    from_draft: list[bool]
    finish_reason: str | None
    stats: SpecStats
    logprobs: list[TokenLogprob] | None = None  # per token of token_ids, when asked for


def stream(target, prompt, **options) -> Iterator[StreamChunk]:
    """Like `generate` for one prompt, yielding the tokens of each step as they are accepted."""
    session = Session(target, prompt, **options)
    if session.batched:
        raise VerispecError("stream() takes one prompt; use generate() for a batch")
    tokenizer = session.target.tokenizer
    text = IncrementalText(tokenizer, session.stop) if tokenizer is not None else None
    for event in session.events():
        delta = text.push(event.tokens, event.finish_reason is not None) if text else ""
        yield StreamChunk(delta, event.tokens, event.from_draft, event.finish_reason, session.stats, event.logprobs)
