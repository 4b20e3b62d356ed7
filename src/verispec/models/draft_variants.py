"""Cheaper copies of a draft model. Verification stays exact whatever the draft is, so a draft may be
approximate: what these buy is speed, at some cost in acceptance (measure both with `verispec bench`).

- `quantize_int8`: int8 weights for every Linear layer (PyTorch dynamic quantization, fbgemm), about a
  quarter of the bytes to read per token. Rows of a batch share one activation scale, which is fine
  for a draft (it only proposes) but would not be for a target.
- `restrict_vocabulary`: the draft scores only the first `size` token ids plus the special tokens.
  Byte-level BPE vocabularies are numbered in merge order, so low ids are the frequent tokens. The
  output layer is sliced accordingly (for Qwen2.5-0.5B the 151,936-row output layer is a quarter of
  the model's weights); q is zero elsewhere, which the exact acceptance rule handles.
`quantize_int8` works on the `transformers` backend (`HFCausalLM`); the native backend has its own,
row-exact weight-only int8 (`verispec.load(name, weight_dtype="int8")`). `restrict_vocabulary` works
on both.
"""

from __future__ import annotations

import copy

import torch

from verispec.errors import VerispecError
from verispec.models.hf import HFCausalLM


def _hf(model) -> HFCausalLM:
    if not isinstance(model, HFCausalLM):
        raise VerispecError(f"{getattr(model, 'name', model)!r}: cheap draft variants need the transformers backend; "
                            "load the draft with verispec.load(name, backend='hf')")
    return model


def quantize_int8(model: HFCausalLM) -> HFCausalLM:
    """A copy of `model` with int8 dynamic-quantized Linear layers (CPU)."""
    from torch.ao.quantization import quantize_dynamic

    model = _hf(model)
    quantized = quantize_dynamic(copy.deepcopy(model.model).float().cpu(), {torch.nn.Linear}, dtype=torch.qint8)
    out = HFCausalLM(quantized, model.tokenizer, name=model.name + "-int8")
    out.vocab_size, out.output_ids = model.vocab_size, model.output_ids
    return out


def draft_vocabulary(model, size: int) -> torch.Tensor:
    """Token ids a restricted draft head keeps: [0, size) plus the special tokens, sorted."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise VerispecError(f"a draft vocabulary size must be a positive integer, got {size!r}")
    full = model.vocab_size
    special = set(model.eos_token_ids)
    if model.tokenizer is not None:
        special.update(i for i in model.tokenizer.all_special_ids if i is not None)
    return torch.tensor(sorted(set(range(min(size, full))) | {i for i in special if i < full}), dtype=torch.long)


def restrict_vocabulary(model, size: int, reads: bool = False):
    """A copy of `model` whose output layer scores only token ids [0, size) and the special tokens.

    The copy shares every weight but the (sliced) output layer; its logits still span the full
    vocabulary, -inf outside `output_ids` [n]. Either backend. reads (native backend): the head also
    scores every token its cache's text has held (`NativeCausalLM.with_output_ids`).
    """
    if hasattr(model, "with_output_ids"):  # the native backend slices its own head
        if model.output_ids is not None:
            raise VerispecError(f"{model.name!r} already scores a restricted vocabulary")
        return model.with_output_ids(draft_vocabulary(model, size), reads=reads)
    if reads:
        raise VerispecError("a head that reads its text's tokens needs the native backend: load the draft without backend='hf'")
    model = _hf(model)
    output_ids = draft_vocabulary(model, size)
    keep = output_ids.tolist()
    full = model.vocab_size
    head = model.model.get_output_embeddings()
    if not isinstance(head.weight, torch.Tensor):
        raise VerispecError("restrict the vocabulary before quantizing: the output layer is already packed")
    sliced = torch.nn.Linear(head.in_features, len(keep), bias=head.bias is not None, device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        sliced.weight.copy_(head.weight[output_ids.to(head.weight.device)])
        if head.bias is not None:
            sliced.bias.copy_(head.bias[output_ids.to(head.weight.device)])
    clone = copy.copy(model.model)  # shallow: shares all modules, then gets its own output layer
    clone._modules = dict(model.model._modules)
    clone.set_output_embeddings(sliced)
    out = HFCausalLM(clone, model.tokenizer, name=f"{model.name}-vocab{len(keep)}")
    out.vocab_size, out.output_ids = full, output_ids  # logits still come back over the full vocabulary
    return out
