"""Any causal LM that `transformers` loads, behind the verispec model contract.

Holes and left padding are expressed to the model as a 2-D attention mask plus explicit position
ids, which every `transformers` causal LM accepts; rollback crops the DynamicCache.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from verispec.cache import SlotCache
from verispec.errors import VerispecError
from verispec.models import kernels
from verispec.models.base import CausalLM, ModelCache


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """The given device, else CUDA when present, else CPU. Raises VerispecError for a device this build
    of PyTorch cannot use (an unknown name, CUDA on a CPU-only build or machine)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise VerispecError(f"unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise VerispecError(f"device {str(device)!r} needs CUDA, which this PyTorch build or machine does not have: "
                            "use device='cpu' (or leave device unset)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise VerispecError("device 'mps' is not available here: use device='cpu' (or leave device unset)")
    return device


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    for source in (getattr(generation_config, "eos_token_id", None), getattr(model.config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


class HFStore:
    """A transformers DynamicCache as a verispec KVStore."""

    def __init__(self, config):
        self.config = config
        self.cache = DynamicCache(config=config)

    def trim(self, length: int) -> None:
        # transformers 5 crops by a negative count of slots to drop
        excess = self.cache.get_seq_length() - length
        if excess > 0:
            self.cache.crop(-excess)

    def select(self, index: torch.Tensor) -> None:
        if self.cache.get_seq_length():
            self.cache.batch_select_indices(index)

    def layer_tensors(self, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per layer (keys, values) [rows, heads, slots, dim], or None while the cache is empty."""
        if not self.cache.get_seq_length():
            return None
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    def concat(self, other: "HFStore", rows: int, other_rows: int) -> None:
        mine, theirs = self.layer_tensors(rows), other.layer_tensors(other_rows)
        if mine is None and theirs is None:
            return
        template = mine or theirs
        empty = lambda n: [(k.new_zeros(n, k.shape[1], 0, k.shape[3]), v.new_zeros(n, v.shape[1], 0, v.shape[3])) for k, v in template]
        mine, theirs = mine or empty(rows), theirs or empty(other_rows)
        merged = []
        for (k1, v1), (k2, v2) in zip(mine, theirs):
            length = max(k1.shape[-2], k2.shape[-2])
            merged.append((torch.cat([_pad_slots(k1, length), _pad_slots(k2, length)], 0),
                           torch.cat([_pad_slots(v1, length), _pad_slots(v2, length)], 0)))
        self.cache = DynamicCache(merged, config=self.config)


def _pad_slots(x: torch.Tensor, length: int) -> torch.Tensor:
    """[batch, heads, slots, dim] -> slots padded with zeros to `length`."""
    return torch.nn.functional.pad(x, (0, 0, 0, length - x.shape[-2]))


class HFCausalLM(CausalLM):
    """Wraps a `transformers` PreTrainedModel (and optionally its tokenizer)."""

    source_gguf = None  # the GGUF file the weights were converted from, when known (see verispec.load)

    def __init__(self, model, tokenizer=None, name: str | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config
        self.name = name or getattr(model.config, "_name_or_path", None) or type(model).__name__
        self.device = next(model.parameters(), torch.empty(0)).device
        self.vocab_size = int(model.get_output_embeddings().out_features)
        self.output_ids: torch.Tensor | None = None  # set when the output layer scores only these token ids
        self.max_context = int(
            getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None) or 2048
        )
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters

    def __repr__(self) -> str:
        return f"HFCausalLM({self.name!r}, vocab={self.vocab_size}, device={self.device})"

    def new_cache(self, batch_size: int) -> ModelCache:
        return ModelCache(slots=SlotCache(batch_size, self.device), store=HFStore(self.config))

    supports_trees = False  # transformers' attention takes a 2-D mask here: one causal chain per row

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: ModelCache, visible: torch.Tensor | None = None, last_only: bool = False,
                tree: torch.Tensor | None = None, taps: tuple[int, ...] | None = None):
        """See `CausalLM.forward`. taps: also return the inputs of those decoder layers, every position, as
        (logits, hidden [B, T, len(taps) * hidden_size] float32) (transformers' `hidden_states[i]`; i = layers is
        the final hidden state after the final norm)."""
        if tree is not None:
            raise ValueError(f"{self.name} runs on transformers, which verifies chains only: pass tree=None")
        tokens = tokens.to(self.device)
        if visible is None:
            visible = torch.ones_like(tokens, dtype=torch.bool)
        attention_mask, position_ids = cache.slots.extend(visible.to(self.device))
        with kernels.torch_threads():  # every op is PyTorch's: all the threads, even inside a decode step
            out = self.model(
                input_ids=tokens,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache.store.cache,
                use_cache=True,
                output_hidden_states=taps is not None,
                **({"logits_to_keep": 1} if last_only and self._takes_logits_to_keep else {}),
            )
        logits = out.logits[:, -1:].float() if last_only else out.logits.float()
        if self.output_ids is not None:  # a restricted output layer: every other token gets probability 0
            full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
            logits = full.index_copy_(-1, self.output_ids.to(logits.device), logits)
        if taps is None:
            return logits
        layers = len(out.hidden_states) - 1  # hidden_states[i]: the input of layer i; the last is normed
        if not taps or any(not 0 <= int(i) <= layers for i in taps):
            raise ValueError(f"taps must be layer indices in [0, {layers}] ({layers}: the final normed hidden state), "
                             f"got {tuple(taps)}")
        return logits, torch.cat([out.hidden_states[int(i)].float() for i in taps], -1)
