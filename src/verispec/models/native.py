"""verispec's own forward pass for Llama / Qwen2 decoders, built for decoding and verifying on a CPU.

`NativeCausalLM` runs the weights of a `transformers` model (it borrows the tensors; on AVX2 CPUs it
keeps float32 matrices as `kernels.PanelMatrix` copies, the order its kernels stream them) through a
hand-written pass: RMSNorm, rotary embeddings from precomputed tables, grouped-query
attention, SwiGLU MLP, Qwen2's q/k/v biases, tied or separate LM head. Keys and values live in a
preallocated `NativeStore` on the shared slot axis of `SlotCache`; rollback only moves its length.
Its logits match the `transformers` model's to float32 rounding (~1e-6 relative), not bitwise.

Why not just `transformers`: a verify pass of k+1 tokens should cost about one decode step, since
both read every weight once, but PyTorch's CPU GEMMs make a 5-row product cost 2-3x a 1-row one,
and take different code paths for different row counts, so a token scored in a wide verify pass
need not get bitwise the logits it gets alone. So a pass has two paths:
- small passes (batch * width <= `kernels.MAX_ROWS`, float32 on a CPU with the C kernels): every
  op runs in `verispec.models.kernels`, whose results are bitwise independent of the pass width,
  the batch mates and the holes rollback left; plain decoding and verification see the same numbers;
- big passes (prefill), other devices and dtypes: `scaled_dot_product_attention`, and products by
  `kernels.blocked_linear` (float32 and int4 matrices on AVX2 CPUs, where it measured ~1.4x faster
  than PyTorch's GEMM) or `F.linear`.
Both compute the same function; they differ in float rounding only (~1e-6 relative), and never
within one decode: prefill is the same call for plain and speculative decoding.

A bfloat16 copy of the matrices (`weight_dtype=torch.bfloat16`) halves the bytes per token,
weight-only int8 (`weight_dtype=torch.int8`, one scale per output row) quarters them, and grouped
int4 (`weight_dtype=torch.quint4x2`, one scale per 64 weights) leaves about a seventh: cheaper
*draft* models, whose logits are no longer the float32 model's. `with_output_ids` gives a draft that scores
only part of the vocabulary (a smaller LM head).

The model knows nothing about drafting, verification or tokenization; logits come back float32.
"""

from __future__ import annotations

import copy
import functools
import logging
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from verispec.cache import SlotCache
from verispec.errors import VerispecError
from verispec.models import kernels, stored
from verispec.models.base import CausalLM, ModelCache
from verispec.models.kernels import config as kernel_config
from verispec.models.hf import _eos_ids
from verispec.text import turn_start_ids

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2"})
# RoPE variants whose frequencies are fixed at load time (`dynamic`/`longrope` rescale with length).
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})

# Prompt token rows up to which a 4-bit draft prefills through its decode kernels rather than the
# blocked GEMM (see NativeCausalLM._prefills_in_chunks).
CHUNKED_PREFILL_ROWS = 256

# weight_dtype's tag for ggml's Q4_0 blocks (a draft run with llama.cpp's numerics; see `_store_matrices_as_blocks`)
Q4_0 = "q4_0"
# weight_dtype's tag for a draft whose MLP gate and up matrices are verispec's 3-bit blocks and the rest Q4_0
# (`_store_matrices_as_blocks`); as llama.cpp's mixed file types, the fewer bits go where most of the bytes are
Q3_0 = "q3_0"
Q3_0_FIELDS = ("gate", "up")

# Most prompt tokens per prefill chunk of the float32 model (`CausalLM.prefill_chunk`). Its big passes run on
# PyTorch's GEMM or the blocked one, whose rounding of a row may change with the pass width, so a prompt is
# always read in chunks its tokens fix (`prefill.Chunking`: C tokens from the last end, or up to a chat-turn
# start) and a prefix cache reuses whole chunks only. Turn starts let a conversation's next turn find its
# history up to the last one; C bounds the passes, the finer the slower: on 2 threads of a quiet Zen 5, the
# 1.5B target read 1024 tokens in 18.5 s in 256-token chunks, 16.9 s in 512s and 16.9 s at once (768 tokens:
# 16.4 s in 128s, 13.3 s in 256s, 11.8 s at once), SmolLM2 1024 tokens in 2.17 / 1.88 / 1.85 s for 128 / 256 /
# at once. 256 keeps the prefill within ~10% of one pass (bench/reports/prefix_cache.md).
PREFILL_CHUNK = 256


def _rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default")) or "default"


def supports(hf_model) -> bool:
    """Whether `NativeCausalLM.from_hf` can run this `transformers` model (or `HFCausalLM`) faithfully."""
    if hasattr(hf_model, "new_cache") and hasattr(hf_model, "model"):  # an HFCausalLM wrapper
        hf_model = hf_model.model
    config = getattr(hf_model, "config", None)
    if config is None or getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(config, "hidden_act", "silu") != "silu" or _rope_type(config) not in STATIC_ROPE_TYPES:
        return False
    # Qwen2 may use sliding-window attention in some layers; this forward only does full attention.
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return False
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return False
    decoder = getattr(hf_model, "model", None)
    if decoder is None or not hasattr(decoder, "layers") or not hasattr(decoder, "rotary_emb"):
        return False
    # Quantized or otherwise wrapped projections would not hand out a plain weight matrix.
    return all(
        type(module) is torch.nn.Linear
        for layer in decoder.layers
        for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                       layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)
    )


def _check_taps(taps, num_layers: int) -> tuple[int, ...]:
    """Tap indices as a tuple, each the input of a layer in [0, num_layers) or num_layers: the final hidden
    state after the final norm, what the LM head reads (transformers' last `hidden_states` entry)."""
    taps = tuple(int(i) for i in taps)
    if not taps or any(not 0 <= i <= num_layers for i in taps):
        raise ValueError(f"taps must be layer indices in [0, {num_layers}] ({num_layers}: the final normed hidden "
                         f"state), got {taps}")
    return taps


@dataclass
class _Layer:
    """One decoder layer's weights: [out, in] matrices and optional [out] biases, borrowed from HF."""

    attn_norm: torch.Tensor
    q: torch.Tensor
    q_bias: torch.Tensor | None
    k: torch.Tensor
    k_bias: torch.Tensor | None
    v: torch.Tensor
    v_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    mlp_norm: torch.Tensor
    gate: torch.Tensor
    gate_bias: torch.Tensor | None
    up: torch.Tensor
    up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


# A decoder layer's matrices, by their `_Layer` field names (norms and biases are not matrices).
MATRIX_FIELDS = ("q", "k", "v", "o", "gate", "up", "down")


def _borrow(linear: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    bias = linear.bias.detach() if linear.bias is not None else None
    return linear.weight.detach(), bias


class ReadTokens:
    """The tokens a cache's rows have held outside a restricted LM head's ids, with their head rows (float32),
    which that head scores beside its own (`NativeCausalLM.with_output_ids(..., reads=True)`): a text's own
    rare words (its names, identifiers, terms) are the likeliest next tokens among those the head left out.
    One set for the batch (a row may score another's words: a draft's q may be anything), kept per row too,
    so rows that leave a long-lived batch take theirs with them."""

    def __init__(self, hidden_size: int, with_bias: bool, device: torch.device, batch_size: int):
        self.ids: list[int] = []
        self.rows = torch.empty(0, hidden_size, device=device)  # [n, hidden], the full head's rows of `ids`
        self.bias = torch.empty(0, device=device) if with_bias else None
        self.owners: list[set[int]] = [set() for _ in range(batch_size)]  # per batch row: the ids its text held
        self._index()

    def _index(self) -> None:
        self._where = {t: i for i, t in enumerate(self.ids)}
        self._ids = torch.tensor(self.ids, dtype=torch.long, device=self.rows.device)

    def empty_like(self, batch_size: int) -> "ReadTokens":
        return ReadTokens(self.rows.shape[1], self.bias is not None, self.rows.device, batch_size)

    def learn(self, tokens: list[torch.Tensor], outside: torch.Tensor, head, bias: torch.Tensor | None) -> None:
        """Note each row's `tokens` [n] long the head leaves out (`outside` [vocab] bool), adding the rows of those
        the set lacks from the full head (a tensor or a `kernels.QuantizedMatrix`, dequantized: the same weights)."""
        new: dict[int, None] = {}  # in order of first appearance
        for owner, row in zip(self.owners, tokens):
            for t in row[outside[row]].tolist():
                if t not in owner:
                    owner.add(t)
                    if t not in self._where:
                        new[t] = None
        if not new:
            return
        new = list(new)
        index = torch.tensor(new, dtype=torch.long, device=self.rows.device)
        rows = head[index]
        rows = rows.dequantize() if isinstance(rows, kernels.QuantizedMatrix) else rows.float()
        self.rows = torch.cat([self.rows, rows.to(self.rows.device)])
        if self.bias is not None:
            self.bias = torch.cat([self.bias, bias[index].float()])
        self.ids += new
        self._index()

    def select(self, rows: list[int]) -> None:
        """Keep batch rows `rows`, in that order, and only the ids some kept row's text held."""
        self.owners = [self.owners[b] for b in rows]
        held = set().union(*self.owners)
        if len(held) < len(self.ids):
            keep = [i for i, t in enumerate(self.ids) if t in held]
            index = torch.tensor(keep, dtype=torch.long, device=self.rows.device)
            self.ids = [self.ids[i] for i in keep]
            self.rows = self.rows[index]
            self.bias = None if self.bias is None else self.bias[index]
            self._index()

    def concat(self, other: "ReadTokens") -> None:
        """Append other's batch rows (and the rows of its ids this set lacks)."""
        self.owners += [set(owner) for owner in other.owners]
        keep = [i for i, t in enumerate(other.ids) if t not in self._where]
        if keep:
            index = torch.tensor(keep, dtype=torch.long, device=other.rows.device)
            self.ids += [other.ids[i] for i in keep]
            self.rows = torch.cat([self.rows, other.rows[index]])
            self.bias = None if self.bias is None else torch.cat([self.bias, other.bias[index]])
            self._index()

    def score(self, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """Write the held tokens' logits for `hidden` [rows, hidden_size] into `logits` [rows, vocab]."""
        if self.ids:
            extra = hidden.float() @ self.rows.T
            if self.bias is not None:
                extra += self.bias
            logits.index_copy_(1, self._ids, extra.to(logits.dtype))


class NativeStore:
    """Keys and values of every layer on one slot axis of `capacity` slots.

    keys [layers, batch, kv_heads, capacity / 16, head_dim, 16]: blocks of `kernels.SLOT_BLOCK`
    slots, d-major inside a block, so the attention kernel scores 16 slots per vector op from
    contiguous memory; values [layers, batch, kv_heads, capacity, head_dim]. Slots [0, length) hold
    data; capacity doubles when a pass needs room, so steps never reallocate, and trimming only
    moves `length`. Fresh memory is zeroed, so never-written slots (padding after `concat`) hold
    finite numbers that a masked matmul cannot turn into NaN.
    """

    def __init__(self, num_layers: int, batch_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, capacity: int = 0):
        blocks = -(-capacity // kernels.SLOT_BLOCK)
        zeros = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        self.keys = zeros(num_layers, batch_size, kv_heads, blocks, head_dim, kernels.SLOT_BLOCK)
        self.values = zeros(num_layers, batch_size, kv_heads, blocks * kernels.SLOT_BLOCK, head_dim)
        self.length = 0
        self.read: ReadTokens | None = None  # a reading head's extra rows (`NativeCausalLM.with_output_ids`)

    @property
    def capacity(self) -> int:
        return self.values.shape[3]

    @property
    def batch_size(self) -> int:
        return self.values.shape[1]

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys/values [batch, kv_heads, T, head_dim] of one layer at slots start .. start+T-1."""
        slots = torch.arange(start, start + keys.shape[2], device=keys.device)
        # advanced indices on the block and lane axes (split by a slice) put the slot axis first
        self.keys[layer][:, :, slots // kernels.SLOT_BLOCK, :, slots % kernels.SLOT_BLOCK] = keys.permute(2, 0, 1, 3)
        self.values[layer, :, :, start : start + keys.shape[2]] = values

    def key_view(self, layer: int, slots: int) -> torch.Tensor:
        """[batch, kv_heads, slots, head_dim] keys of one layer (a copy out of the block layout)."""
        blocks = self.keys[layer, :, :, : -(-slots // kernels.SLOT_BLOCK)]
        return blocks.transpose(-1, -2).flatten(2, 3)[:, :, :slots]

    def value_view(self, layer: int, slots: int) -> torch.Tensor:
        """[batch, kv_heads, slots, head_dim] values of one layer (a view)."""
        return self.values[layer, :, :, :slots]

    def reserve(self, needed: int) -> None:
        """Make room for `needed` slots, keeping slots [0, length)."""
        if needed > self.capacity:
            self.keys, self.values = self._resized(self.batch_size, max(needed, 2 * self.capacity, 64), (self, 0))

    def _resized(self, batch_size: int, capacity: int, *parts: tuple["NativeStore", int]):
        """New zeroed (keys, values): `batch_size` rows, `capacity` slots, each (store, first row) copied in."""
        blocks = -(-capacity // kernels.SLOT_BLOCK)
        keys_shape, values_shape = list(self.keys.shape), list(self.values.shape)
        keys_shape[1] = values_shape[1] = batch_size
        keys_shape[3], values_shape[3] = blocks, blocks * kernels.SLOT_BLOCK
        keys, values = self.keys.new_zeros(keys_shape), self.values.new_zeros(values_shape)
        for store, row in parts:
            rows = slice(row, row + store.batch_size)
            used = -(-store.length // kernels.SLOT_BLOCK)
            keys[:, rows, :, :used] = store.keys[:, :, :, :used]
            values[:, rows, :, : store.length] = store.values[:, :, :, : store.length]
        return keys, values

    def trim(self, length: int) -> None:
        self.length = min(self.length, length)

    def gather(self, row: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s keys and values at `slots` [n] long: copies [layers, kv_heads, n, head_dim]."""
        slots = slots.to(self.keys.device)
        # advanced indices on the block and lane axes (split by a slice) put the slot axis first
        keys = self.keys[:, row][:, :, slots // kernels.SLOT_BLOCK, :, slots % kernels.SLOT_BLOCK]
        return keys.permute(1, 2, 0, 3).contiguous(), self.values[:, row, :, slots].contiguous()

    def put(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys/values [layers, kv_heads, n, head_dim] at slots start .. start+n-1 of every row
        (a one-row store being prefilled), and extend `length` to there."""
        end = start + keys.shape[2]
        self.reserve(end)
        slots = torch.arange(start, end, device=self.keys.device)
        for b in range(self.batch_size):
            self.keys[:, b][:, :, slots // kernels.SLOT_BLOCK, :, slots % kernels.SLOT_BLOCK] = keys.permute(2, 0, 1, 3)
            self.values[:, b, :, start:end] = values
        self.length = max(self.length, end)

    def select(self, index: torch.Tensor) -> None:
        rows = index.tolist()
        if self.read is not None:
            self.read.select(rows)
        if rows == sorted(set(rows)):
            # Rows leaving (the engine's case): move the kept rows down in place, used slots only, in
            # increasing order so no source is overwritten before it is read; no new store, no copy
            # of unused capacity (a batch-16 store of 500 slots is ~100 MB for a 1.5B model).
            used_blocks = -(-self.length // kernels.SLOT_BLOCK)
            for new, old in enumerate(rows):
                if new != old:
                    self.keys[:, new, :, :used_blocks] = self.keys[:, old, :, :used_blocks]
                    self.values[:, new, :, : self.length] = self.values[:, old, :, : self.length]
            self.keys, self.values = self.keys[:, : len(rows)], self.values[:, : len(rows)]
            return
        index = index.to(self.keys.device)
        self.keys = self.keys.index_select(1, index)
        self.values = self.values.index_select(1, index)

    def concat(self, other: "NativeStore", rows: int | None = None, other_rows: int | None = None) -> None:
        """Append other's rows. `rows` / `other_rows` (batch sizes, in the KVStore contract) are implied by
        the tensors here, which hold their rows even before any slot is written."""
        length = max(self.length, other.length)
        self.keys, self.values = self._resized(self.batch_size + other.batch_size, max(self.capacity, other.capacity, length),
                                               (self, 0), (other, self.batch_size))
        self.length = length
        if self.read is not None or other.read is not None:
            like = self.read or other.read
            mine = self.read or like.empty_like(self.batch_size - other.batch_size)
            mine.concat(other.read or like.empty_like(other.batch_size))
            self.read = mine


@functools.cache
def _fast_bfloat16_matmul() -> bool:
    """Whether a bfloat16 GEMM beats a float32 one on this CPU: with AMX tiles. Without any bfloat16
    instructions PyTorch emulates them (~5x slower than float32 on an AVX2-only CPU); with AVX-512 BF16
    but no AMX it still measured 1.7x slower (a 4-bit Qwen2.5 0.5B draft's 700-token prefill on a
    widened copy, 2 Xeon cores: bfloat16 3.5 s, float32 2.05 s)."""
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except AttributeError:  # an older PyTorch: assume not
        return False


def _widened_dtype() -> torch.dtype:
    """The dtype big passes widen int8 / int4 matrices to: bfloat16 where its GEMM is the faster one."""
    return torch.bfloat16 if _fast_bfloat16_matmul() else torch.float32


class NativeCausalLM(CausalLM):
    """A Llama/Qwen2-family causal LM behind the verispec `CausalLM` contract; see the module docstring."""

    makes_lower_precision_copies = True  # `lower_precision_copy`, for drafter="self"
    shares_prefixes = True  # `NativeStore.gather` / `put`, for a prefix cache

    @property
    def prefill_chunk(self) -> int | None:
        """Aligned prefill chunks for the float32 numbers (`PREFILL_CHUNK`); none under numerics="q8",
        whose kernels give every token row the same numbers at any pass width."""
        return None if self.numerics == "q8" else PREFILL_CHUNK

    _declared_turn_starts: frozenset[int] | None = None  # set through the `turn_start_ids` setter

    @property
    def turn_start_ids(self) -> frozenset[int]:
        """The token ids prefill chunks also end after (`prefill.Chunking`): as declared through the setter,
        else its tokenizer's chat-template turn start (`text.turn_start_ids`), derived once per tokenizer."""
        if self._declared_turn_starts is not None:
            return self._declared_turn_starts
        derived = self.__dict__.get("_derived_turn_starts")
        if derived is None or derived[0] is not self.tokenizer:
            derived = self._derived_turn_starts = (self.tokenizer, turn_start_ids(self.tokenizer))
        return derived[1]

    @turn_start_ids.setter
    def turn_start_ids(self, ids) -> None:
        self._declared_turn_starts = frozenset(int(i) for i in ids)

    def __init__(self, hf_model, tokenizer=None, name: str | None = None, weight_dtype: torch.dtype | None = None,
                 panels: bool | None = None):
        if not supports(hf_model):
            raise ValueError(
                f"{type(hf_model).__name__} is not supported by NativeCausalLM (Llama/Qwen2 with SiLU MLP, static "
                "RoPE, full attention and plain nn.Linear weights): use HFCausalLM"
            )
        config = hf_model.config
        decoder = hf_model.model
        self.config = config
        self.tokenizer = tokenizer
        self.name = name or getattr(config, "_name_or_path", None) or type(hf_model).__name__
        self.eos_token_ids = _eos_ids(hf_model, tokenizer)
        self._hf_model = weakref.ref(hf_model)  # weak: the native must not keep a caller's model alive
        self.max_context = int(getattr(config, "max_position_embeddings", None) or 2048)

        self.embed = decoder.embed_tokens.weight.detach()
        self.lm_head, self.lm_head_bias = _borrow(hf_model.get_output_embeddings())  # the embedding when tied
        self.final_norm = decoder.norm.weight.detach()
        self.device = self.embed.device
        self.dtype = self.embed.dtype
        self.vocab_size = int(self.lm_head.shape[0])
        self.hidden_size = int(config.hidden_size)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or self.hidden_size // self.num_heads)
        self.eps = float(getattr(config, "rms_norm_eps", 1e-6))
        self.scale = self.head_dim ** -0.5

        self.layers = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                layer.input_layernorm.weight.detach(), *_borrow(attn.q_proj), *_borrow(attn.k_proj),
                *_borrow(attn.v_proj), *_borrow(attn.o_proj), layer.post_attention_layernorm.weight.detach(),
                *_borrow(mlp.gate_proj), *_borrow(mlp.up_proj), *_borrow(mlp.down_proj),
            ))

        # RoPE frequencies as the HF model computed them (handles rope_theta and static scalings).
        rotary = decoder.rotary_emb
        self.numerics = "float32"  # the float32 model's numbers (see models.gguf_q8 for "q8")
        self._finish_init(weight_dtype, panels, rotary.inv_freq.detach().float(),
                          float(getattr(rotary, "attention_scaling", 1.0)))

    def _finish_init(self, weight_dtype: torch.dtype | None, panels: bool | None, inv_freq: torch.Tensor,
                     rope_scaling: float) -> None:
        """The part of construction that needs only the weights gathered above (also run by
        `models.gguf_q8`, which gathers them from a GGUF file instead of a transformers model)."""
        self.output_ids: torch.Tensor | None = None  # set when the LM head scores only these token ids
        self._outside: torch.Tensor | None = None  # [vocab] bool, the ids a reading restricted head leaves out
        if weight_dtype in (Q4_0, Q3_0):
            self._store_matrices_as_blocks(Q3_0_FIELDS if weight_dtype == Q3_0 else ())
            panels = False
        elif weight_dtype is not None and weight_dtype != self.dtype:
            self._store_matrices_as(weight_dtype)
        self.weight_dtype = self.lm_head.dtype

        self._inv_freq = inv_freq.to(self.device)
        self._rope_scaling = rope_scaling
        self._cos = self._sin = torch.empty(0, self.head_dim, device=self.device)
        self._rope_tables(min(self.max_context, 4096))

        # The exact small-pass kernels: float32 activations on the CPU (float32 or bfloat16 matrices),
        # contiguous weights, whole vectors per head.
        self._kernels = (
            self.device.type == "cpu" and self.dtype == torch.float32 and kernels.available()
            and self.weight_dtype in (torch.float32, torch.bfloat16, torch.int8, torch.quint4x2)
            and self.head_dim % kernels.lanes() == 0
            and all(w.is_contiguous() for w in (self.embed, self.lm_head))
            and all(t is None or t.is_contiguous() for layer in self.layers for t in vars(layer).values())
        )
        if self._kernels and self.weight_dtype == torch.float32 and (kernels.panels_preferred() if panels is None else panels):
            self._store_matrices_as_panels()
        self._buffers: dict[str, torch.Tensor] | None = None
        self._prepared: tuple[list[dict[str, kernels.Linear]], kernels.Linear] | None = None  # see _linears
        self._stack: kernels.LayerStack | None | bool = False  # see _layer_stack; False: not built yet
        # KernelConfig.fused_layers off runs small passes layer by layer from Python (the same kernel calls)
        self.fused_layers = kernel_config.current().fused_layers
        # Token rows a pass may carry and still be bitwise row-exact (the engine keeps verify passes within).
        self.max_exact_rows = kernels.MAX_ROWS if self._kernels else None
        self._widen_for_prefill()
        self._repack_now()

    @property
    def hf_model(self):
        """The transformers model these weights came from (for comparisons with its own generate()), or None
        once it is gone."""
        return self._hf_model()

    @classmethod
    def from_hf(cls, hf_model, tokenizer=None, name: str | None = None,
                weight_dtype: torch.dtype | None = None, panels: bool | None = None) -> "NativeCausalLM":
        """Build from a `transformers` Llama/Qwen2 model, or from an `HFCausalLM` (whose tokenizer and name
        are reused unless given). The weights are shared with the HF model, not copied.

        weight_dtype=torch.bfloat16 instead keeps bfloat16 copies of the matrices (activations and
        accumulation stay float32): half the bytes per token, so about twice the decode speed on a
        memory-bound CPU, but the logits move by ~1e-2. That is a fine *draft* model (the target
        still decides every token) and never a target whose output must equal the float32 model's.
        weight_dtype=torch.int8 keeps weight-only int8 copies with one scale per output row: a
        quarter of the bytes, the logits move further (~1e-1), still a draft only.
        weight_dtype=torch.quint4x2 (the tag of `kernels.Int4Matrix`) keeps 4-bit copies with one
        scale per 64 weights: 0.5625 bytes per weight; needs matrix widths divisible by 64.
        weight_dtype="q4_0" keeps ggml's Q4_0 blocks (4 bits and a half-float scale per 32 weights, 0.5625 bytes
        per weight; widths divisible by 32) and runs them as a Q4_0 GGUF file runs under numerics="q8": the
        fastest draft format on verispec's kernels.
        Float32 matrices are kept as `kernels.PanelMatrix` copies (16-row panels, the order the AVX2
        kernels stream them) where `kernels.panels_preferred()`, or as `panels` says: the same numbers,
        a copy beside the transformers model's (which stays for its own forward).
        """
        if hasattr(hf_model, "new_cache") and hasattr(hf_model, "model"):  # an HFCausalLM wrapper
            tokenizer = tokenizer if tokenizer is not None else hf_model.tokenizer
            name = name or hf_model.name
            hf_model = hf_model.model
        return cls(hf_model.eval(), tokenizer, name, weight_dtype, panels)

    def _store_matrices_as(self, dtype: torch.dtype) -> None:
        """Replace the borrowed matrices (not norms, biases or the embedding) by `dtype` copies."""
        formats = {torch.bfloat16: lambda w: w.to(torch.bfloat16).contiguous(), torch.int8: kernels.Int8Matrix.quantize,
                   torch.quint4x2: kernels.Int4Matrix.quantize}
        if dtype not in formats:
            raise ValueError(f"matrices can be stored as bfloat16, int8 or int4 (torch.quint4x2), not {dtype}")
        self._convert_matrices(formats[dtype])
        self.name = f"{self.name}-{'int4' if dtype == torch.quint4x2 else str(dtype).removeprefix('torch.')}"

    def _store_matrices_as_blocks(self, three_bit: tuple[str, ...] = ()) -> None:
        """Replace the borrowed matrices by ggml's Q4_0 blocks (`kernels.GGUFMatrix.quantize`, each block's scale
        searched for the least squared error rather than ggml's rule: a draft agrees with its target more often,
        bench/README), those of the layers' `three_bit` fields by verispec's 3-bit Q3_0 blocks: the model then runs
        with llama.cpp's numerics, as a Q4_0 file would (`numerics="q8"`: activations rounded per 32, integer dot
        products), a draft whose step costs
        ~0.75x an int4 copy's at width 1 and ~0.5x at width 8 (0.5B, Zen 5). A draft's step streams its matrices,
        so fewer bits a weight is a cheaper step; the gate and up matrices, over half of a layer's weights, lose
        the least agreement with the target at 3 bits (see `kernels.matrices.Q3_0`). The rounding (seconds for a
        0.5B, most of it the 3-bit scale search) is done once and stored (`models.stored.converted`)."""
        made = kernels.GGUFMatrix.MADE
        types = tuple(made[Q3_0] if field in three_bit else made[Q4_0] for _ in self.layers for field in MATRIX_FIELDS)
        given = iter(stored.converted(self, Q3_0 if three_bit else Q4_0, types + (made[Q4_0],)))
        self._convert_matrices(lambda _: next(given))
        self.numerics = "q8"
        self.name = f"{self.name}-{Q3_0 if three_bit else Q4_0}"

    def _repack_now(self) -> None:
        """A q8 model's matrices repacked for the kernels now, when it is made (a GGUF target, a draft in blocks, a
        copy with its own head), not in its first pass: for a draft that pass is its first prompt prefill, whose cost
        against the target's the start decision learns from (`costs.BOOK.relative_prefill`), and the repacking would
        make the draft look several times dearer than it is (bench/README, "Weights on huge pages")."""
        if self.numerics == "q8" and self._kernels:
            self._linears()

    def matrices(self) -> list:
        """Every matrix the forward multiplies by (the layers', then the LM head), in whatever format it is kept."""
        return [getattr(layer, field) for layer in self.layers for field in MATRIX_FIELDS] + [self.lm_head]

    def _convert_matrices(self, convert) -> None:
        """Replace each matrix (the layers' and the LM head; not norms, biases or the embedding, which
        stays for lookups when tied) by convert(matrix), one at a time."""
        for layer in self.layers:
            for field in MATRIX_FIELDS:
                setattr(layer, field, convert(getattr(layer, field)))
        self.lm_head = convert(self.lm_head)
        self._prepared = None
        self._stack = False

    def _store_matrices_as_panels(self) -> None:
        """Replace the borrowed float32 matrices by `kernels.PanelMatrix` copies."""
        self._convert_matrices(kernels.PanelMatrix.pack)

    def _store_panels_as_rows(self) -> None:
        """Back to row-major float32 matrices (the inverse of `_store_matrices_as_panels`)."""
        self._convert_matrices(lambda w: w.dequantize() if isinstance(w, kernels.PanelMatrix) else w)

    # the GGUF tensor each matrix of a decoder layer was converted from (llama.cpp's names)
    _GGUF_NAMES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
                   "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}

    def use_gguf_blocks(self, path) -> tuple[int, int]:
        """Keep the matrices as the k-quant blocks of the GGUF file they were converted from
        (`kernels.Q4KMatrix` / `Q6KMatrix`): bit for bit the same numbers, a fifth to a third of the
        bytes read per token. A matrix is replaced only when its blocks rebuild it exactly (each is
        checked); the float32 matrices stay for big passes. Returns (matrices replaced, of how many)."""
        from verispec.models import gguf_blocks

        if not self._kernels or self.weight_dtype != torch.float32 or self.output_ids is not None:
            return 0, 0
        # the blocks rebuild row-major float32 products bit for bit: the whole model goes row-major
        self._store_panels_as_rows()
        blocks = gguf_blocks.tensor_blocks(path)
        wanted = [(layer, field, f"blk.{i}.{name}.weight")
                  for i, layer in enumerate(self.layers) for field, name in self._GGUF_NAMES.items()]
        head = "output.weight" if "output.weight" in blocks else "token_embd.weight"
        wanted.append((self, "lm_head", head))
        replaced = 0
        for owner, field, name in wanted:
            dense = getattr(owner, field)
            if name not in blocks or not isinstance(dense, torch.Tensor):
                continue
            kind, raw = blocks[name]
            exact = gguf_blocks.exact_matrix(kind, raw, dense)
            if exact is not None:
                setattr(owner, field, exact)
                replaced += 1
        if replaced < len(wanted):
            log.info("%s: %d of %d matrices kept as float32 (no exact k-quant blocks for them)",
                     self.name, len(wanted) - replaced, len(wanted))
        self._prepared = None
        self._stack = False
        return replaced, len(wanted)

    def with_output_ids(self, output_ids: torch.Tensor, reads: bool = False) -> "NativeCausalLM":
        """A copy sharing every weight whose LM head scores only `output_ids` [n] (the rest get -inf).

        For a draft: a 152k-token head is a quarter of a 0.5B model's bytes per token, and most of
        those tokens are rarely the next one. Logits still span the full vocabulary.

        reads: the head also scores every token the cache's text has held (its prompt, what it
        decoded) from the full head's rows (`ReadTokens`, kept with the cache): a text's rare words are the
        ones it repeats. Those few rows cost little; the tokens neither set holds get -inf.
        """
        output_ids = torch.as_tensor(output_ids, dtype=torch.long).to(self.device)
        if output_ids.ndim != 1 or not len(output_ids) or int(output_ids.min()) < 0 or int(output_ids.max()) >= self.vocab_size:
            raise ValueError(f"output_ids must be a non-empty 1-D list of token ids below {self.vocab_size}")
        if self.output_ids is not None:
            raise ValueError("this model's head is already restricted: restrict the full model instead")
        clone = copy.copy(self)
        quantized = isinstance(self.lm_head, kernels.QuantizedMatrix)
        clone.lm_head = self.lm_head[output_ids] if quantized else self.lm_head[output_ids].contiguous()
        clone.lm_head_bias = None if self.lm_head_bias is None else self.lm_head_bias[output_ids].contiguous()
        clone.output_ids = output_ids
        clone._outside = None
        if reads:  # the full head stays shared for the rows of the text's words (`ReadTokens`)
            clone._outside = torch.ones(self.vocab_size, dtype=torch.bool, device=self.device).index_fill_(0, output_ids, False)
            clone._full_head, clone._full_head_bias = self.lm_head, self.lm_head_bias
        clone.name = f"{self.name}-vocab{len(output_ids)}{'+read' if reads else ''}"
        clone._buffers = None  # activation buffers are per model object
        clone._prepared = None
        clone._stack = False
        clone._repack_now()  # its own head
        return clone

    def lower_precision_copy(self, weight_dtype: torch.dtype, matrices: list | None = None) -> "NativeCausalLM":
        """A copy whose layer and head matrices are `weight_dtype` versions of this model's (bfloat16, int8
        or int4 as `torch.quint4x2`); embedding, norms, biases and RoPE tables are shared. `matrices`, if
        given, are those versions already made (in `matrices()` order: a copy read back from disk by
        `models.stored`), taken as they are.

        Meant as a draft that reads this model's cache (`drafters.SharedCacheDrafter`): it has the same
        layer shapes, and it never prefills, so no widened copies are made for big passes (one, should it
        run, would widen its matrices then)."""
        if self.weight_dtype != torch.float32 or self.output_ids is not None:
            raise ValueError(f"{self.name}: a lower-precision copy is made from a float32 model with its full head")
        clone = copy.copy(self)
        clone.layers = [copy.copy(layer) for layer in self.layers]

        def row_major(matrix):  # the float32 numbers, whatever layout this model keeps them in
            if isinstance(matrix, kernels.ExactBlocks):
                return matrix.dense
            if isinstance(matrix, kernels.GGUFMatrix):
                return matrix.dequantize()  # the file's weights; the copy rounds them again for itself
            return matrix.dequantize() if isinstance(matrix, kernels.PanelMatrix) else matrix

        if matrices is None:
            clone._convert_matrices(row_major)
            clone._store_matrices_as(weight_dtype)
        else:
            given = iter(matrices)
            clone._convert_matrices(lambda _: next(given))
        clone.weight_dtype = clone.lm_head.dtype
        clone.numerics = "float32"  # a draft's own rounded weights, float32 activations
        clone.name = f"{self.name}-self-{'int4' if weight_dtype == torch.quint4x2 else str(weight_dtype).removeprefix('torch.')}"
        clone._buffers = None  # activation buffers are per model object
        return clone

    def same_layer_shapes(self, other) -> bool:
        """Whether `other` can run on this model's cache: the same layers, key/value heads and head size."""
        return (isinstance(other, NativeCausalLM) and len(other.layers) == len(self.layers)
                and (other.num_kv_heads, other.head_dim, other.hidden_size, other.dtype, other.device)
                == (self.num_kv_heads, self.head_dim, self.hidden_size, self.dtype, self.device))

    supports = staticmethod(supports)

    def __repr__(self) -> str:
        path = f"C kernels up to {kernels.MAX_ROWS} rows" if self._kernels else "PyTorch only"
        return f"NativeCausalLM({self.name!r}, vocab={self.vocab_size}, device={self.device}, {path})"

    def new_cache(self, batch_size: int) -> ModelCache:
        store = NativeStore(len(self.layers), batch_size, self.num_kv_heads, self.head_dim, self.dtype, self.device)
        return ModelCache(slots=SlotCache(batch_size, self.device), store=store)

    def _rope_tables(self, positions: int) -> None:
        """cos/sin [positions, head_dim] computed like transformers' rotary embedding; grown by doubling."""
        if positions <= self._cos.shape[0]:
            return
        positions = max(positions, 2 * self._cos.shape[0])
        freqs = torch.arange(positions, device=self.device).float()[:, None] * self._inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self._cos = (angles.cos() * self._rope_scaling).to(self.dtype).contiguous()
        self._sin = (angles.sin() * self._rope_scaling).to(self.dtype).contiguous()

    # --- the contract ---------------------------------------------------------------------------

    supports_trees = True

    def extend(self, tokens: torch.Tensor, cache: ModelCache) -> None:
        """A prompt's read (`CausalLM.extend`): the last layer stops once its keys and values are stored, and no
        final norm or LM head runs (a 1.5B's last layer past its keys and values is ~3% of its prefill, and
        its 152k-row LM head ran once a chunk); the keys and values are the very ones `forward` stores."""
        self.forward(tokens, cache, last_only=True, outputs=False)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: ModelCache, visible: torch.Tensor | None = None,
                last_only: bool = False, tree: torch.Tensor | None = None, taps: tuple[int, ...] | None = None,
                outputs: bool = True):
        """tokens [B, T] long, visible [B, T] bool (False = padding), tree [B, T, T] bool (a token tree, see
        `CausalLM.forward`) -> logits [B, T or 1, vocab] float32.

        taps (layer indices in [0, layers]): also return the hidden states at the inputs of those layers
        (the residual stream after layer i - 1; the embedding for 0; for i = layers, the final hidden state
        after the final norm, as the LM head reads it) for every position of the pass, even with last_only:
        (logits, hidden [B, T, len(taps) * hidden_size] float32, in `taps` order). The logits are bitwise
        those of the same pass without taps.

        outputs=False (`extend`): store the tokens' keys and values, return None."""
        if not outputs and taps is not None:
            raise ValueError("taps are outputs: a pass that computes none (outputs=False) has no taps to return")
        tokens = tokens.to(self.device)
        batch, width = tokens.shape
        if visible is None:
            visible = torch.ones_like(tokens, dtype=torch.bool)
        if taps is not None:
            taps = _check_taps(taps, len(self.layers))
        if ((last_only or self.numerics == "q8") and tree is None and batch * width > self._pass_rows
                and self._prefills_in_chunks(batch, width)):
            rows = self._pass_rows // batch
            chunks = [self.forward(tokens[:, begin : begin + rows], cache, visible[:, begin : begin + rows], last_only=last_only,
                                   taps=taps, outputs=outputs)
                      for begin in range(0, width, rows)]
            if not outputs:
                return None
            if taps is None:
                return chunks[-1] if last_only else torch.cat(chunks, dim=1)
            logits = chunks[-1][0] if last_only else torch.cat([c[0] for c in chunks], dim=1)
            return logits, torch.cat([c[1] for c in chunks], dim=1)
        if self.numerics == "q8" and batch * width > self._pass_rows:
            raise VerispecError(f"{self.name}: a pass of {batch} x {width} token rows is wider than the q8 kernels take "
                                f"({self._pass_rows} rows{' with a tree' if tree is not None else ''})")
        store: NativeStore = cache.store
        start = cache.slots.length
        if store.length != start:
            raise RuntimeError(f"cache out of step: {store.length} stored slots, {start} in the slot bookkeeping")
        if tree is not None:
            tree = tree.to(self.device, torch.bool).contiguous()
        _, position_ids = cache.slots.extend(visible.to(self.device), tree)
        store.reserve(start + width)
        self._rope_tables(int(position_ids.max()) + 1)
        tapped = [] if taps is not None else None  # filled by the pass: [B, T, hidden] per tap, in layer order
        layer_taps = tuple(i for i in taps if i < len(self.layers)) if taps is not None else None
        final_tap = taps is not None and len(self.layers) in taps  # every row's final hidden state, even with last_only
        if self._kernels and batch * width <= self._pass_rows:
            hidden = self._small_pass(tokens, position_ids, cache.slots.visible, store, start, tree, layer_taps, tapped,
                                      outputs=outputs)
        else:
            with kernels.torch_threads():  # PyTorch's GEMMs, on every thread even inside a decode step
                hidden = self._big_pass(tokens, position_ids, cache.slots.visible, store, start, tree, last_only,
                                        layer_taps, tapped, every_row=final_tap)
        store.length = start + width
        if not outputs:
            if self._outside is not None:  # a head that scores its text's words learns the prompt's as it reads them
                self._learn_read_tokens(store, tokens, visible)
            return None
        if final_tap:
            tapped.append(hidden)  # the LM head's input, the last of the taps in layer order
        if last_only:
            hidden = hidden[:, -1:]  # the LM head is the biggest matrix: score only what the caller reads
        rows = hidden.reshape(-1, self.hidden_size)
        if self._kernels and rows.shape[0] <= self._pass_rows:
            _, head = self._linears()
            logits = head(rows.contiguous(), torch.empty(rows.shape[0], self.lm_head.shape[0]))
        else:
            with kernels.torch_threads():
                logits = self._linears_of(rows, (self.lm_head, self.lm_head_bias))[0]
        if self.output_ids is not None:  # a restricted head: every other token gets probability 0
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            logits = full.index_copy_(1, self.output_ids, logits.to(full.dtype))
            if self._outside is not None:  # ... but those the text has held
                self._learn_read_tokens(store, tokens, visible).score(rows, logits)
        logits = logits.view(batch, -1, self.vocab_size).float()
        if taps is None:
            return logits
        by_layer = dict(zip(sorted(set(taps)), tapped))
        return logits, torch.cat([by_layer[i].float() for i in taps], -1)

    def _learn_read_tokens(self, store: NativeStore, tokens: torch.Tensor, visible: torch.Tensor) -> ReadTokens:
        """The tokens the cache's text has held, with this pass's visible tokens [B, T] added, for a head that
        scores them (`with_output_ids(..., reads=True)`)."""
        if store.read is None:
            store.read = ReadTokens(self.hidden_size, self.lm_head_bias is not None, self.device, tokens.shape[0])
        store.read.learn([row[seen] for row, seen in zip(tokens, visible)], self._outside, self._full_head, self._full_head_bias)
        return store.read

    @property
    def _pass_rows(self) -> int:
        """Most token rows a pass of the small-pass kernels carries: `kernels.Q8_MAX_ROWS` under llama.cpp's
        numerics (every row the same numbers at any width), else `kernels.MAX_ROWS`."""
        return kernels.Q8_MAX_ROWS if self.numerics == "q8" else kernels.MAX_ROWS

    @property
    def _blocked(self) -> bool:
        """Big passes (prefill) multiply with verispec's blocked GEMM where it beats PyTorch's (AVX2 CPUs)."""
        return self._kernels and kernels.blocked_preferred()

    def _prefills_in_chunks(self, batch: int, width: int) -> bool:
        """Whether a prompt prefill runs as small passes of `kernels.MAX_ROWS` token rows: for 4-bit matrices
        multiplied with int8-rounded activations, up to `CHUNKED_PREFILL_ROWS` rows where the big pass
        would use `kernels.blocked_linear` (which widens int4 panels as it packs them), at any width
        otherwise. Measured on 2 AVX2 cores, Qwen2.5 0.5B, chunks against the blocked GEMM (paired
        runs): 51 tokens 0.41 s against 0.75, 147 even (1.2 s), 201 even (1.6 s), 709 5.9 s against
        5.0 (the GEMM's packing pays off with the rows; the chunks stream the weights again every 32
        rows, and their attention is slower than PyTorch's on long contexts). Chunks give a draft's
        prefill the very arithmetic of its decode steps, and neither path keeps a widened copy
        (~2 GB of float32 for that draft). Where PyTorch's GEMM does big passes (AVX-512 CPUs), a widened
        float32 copy (made at load and kept, `_widen_for_prefill`) measured faster than chunks at every prompt
        length (2 Xeon cores, same draft: 60 tokens 0.26 s against 0.34, 200 0.65 against 0.96, 700 2.05
        against 2.92), so chunks run there only if `KernelConfig.chunked_prefill` asks for them.
        `KernelConfig.wide_prefill` turns chunks off everywhere."""
        settings = kernel_config.current()
        if self.numerics == "q8":  # llama.cpp's numerics exist only in the small-pass kernels
            return self._kernels and batch <= self._pass_rows
        if not (self._kernels and batch <= kernels.MAX_ROWS and self.weight_dtype == torch.quint4x2
                and kernels._int4_code() in (kernels.Format.INT4_VNNI, kernels.Format.INT4_AVX2)
                and not settings.wide_prefill):
            return False
        if self._blocked:
            return batch * width <= CHUNKED_PREFILL_ROWS
        return settings.chunked_prefill

    def _widen_for_prefill(self) -> None:
        """Make now, at load, the widened copies of int8 / int4 layer matrices that prompt prefills will
        multiply (`_linear`; ~1 s and ~1.4 GB of float32 for a 0.5B draft), so the first request does not
        pay for them and the draft/target prefill ratio the start decision learns from (`costs.BOOK`) is
        not inflated by them. Not where prefills take another path: 4-bit chunks or the blocked GEMM,
        which widens int4 panels as it packs them. The LM head is left alone: a prefill scores one row
        per prompt, which the small-pass kernels do."""
        quantized = self.weight_dtype in (torch.int8, torch.quint4x2) and self.device.type == "cpu"
        if not quantized or self._prefills_in_chunks(1, kernels.MAX_ROWS + 1):
            return
        if self.weight_dtype == torch.quint4x2 and self._blocked:
            return
        dtype = _widened_dtype()
        for layer in self.layers:
            for field in MATRIX_FIELDS:
                matrix = getattr(layer, field)
                if isinstance(matrix, (kernels.Int8Matrix, kernels.Int4Matrix)):
                    matrix.widened(dtype)

    # --- small passes: the exact C kernels --------------------------------------------------------

    def _buffers_for(self, rows: int) -> dict[str, torch.Tensor]:
        """Activation buffers [rows, ...]: views of storage kept for the widest pass so far, reused by every
        layer and step (so one model runs one pass at a time)."""
        if self._buffers is None or self._buffers["normed"].shape[0] < rows:
            heads, kv, inter = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.layers[0].gate.shape[0]
            widths = {"normed": self.hidden_size, "delta": self.hidden_size, "q": heads, "k": kv, "v": kv,
                      "attended": heads, "gate": inter, "up": inter}
            self._buffers = {name: torch.empty(rows, width, dtype=torch.float32) for name, width in widths.items()}
        return {name: buffer[:rows] for name, buffer in self._buffers.items()}

    def _linears(self) -> tuple[list[dict], kernels.Linear]:
        """(per layer {qkv, o, gate_up, down}, the LM head): each matrix checked once for the kernels; the
        products that share an input (q, k, v; gate, up) run as one `kernels.LinearGroup` call."""
        if self._prepared is None:
            def linear(layer, name):
                return kernels.Linear(getattr(layer, name), getattr(layer, f"{name}_bias"))

            layers = [{"qkv": kernels.LinearGroup([linear(layer, "q"), linear(layer, "k"), linear(layer, "v")]),
                       "o": linear(layer, "o"),
                       "gate_up": kernels.LinearGroup([linear(layer, "gate"), linear(layer, "up")]),
                       "down": linear(layer, "down")}
                      for layer in self.layers]
            self._prepared = layers, kernels.Linear(self.lm_head, self.lm_head_bias)
        return self._prepared

    def _segment_stacks(self, taps: tuple[int, ...]) -> list[tuple[int, int, kernels.LayerStack]]:
        """The layers split at each tap, (first layer, end, LayerStack of layers first..end-1) in order, so a
        fused pass can stop at a tap's input; built once per set of taps and rebuilt with the whole stack
        (which must exist: `_layer_stack()` is not None)."""
        stack = self._layer_stack()
        built = self.__dict__.get("_segments")
        if built is None or built[0] is not stack:
            built = self._segments = (stack, {})
        bounds = tuple(sorted(set(taps) | {0}))
        if bounds not in built[1]:
            segments = []
            for begin, end in zip(bounds, bounds[1:] + (len(self.layers),)):
                segments.append((begin, end, kernels.LayerStack(stack._layers[begin:end])))
            built[1][bounds] = segments
        return built[1][bounds]

    def _layer_stack(self) -> kernels.LayerStack | None:
        """Every layer's norms and products as one `kernels.LayerStack` (one C call a pass), built once;
        None where a layer's products mix weight formats."""
        if self._stack is False:
            linears, _ = self._linears()
            self._stack = kernels.LayerStack.build([
                (layer.attn_norm, linear["qkv"], linear["o"], layer.mlp_norm, linear["gate_up"], linear["down"])
                for layer, linear in zip(self.layers, linears)])
        return self._stack

    def _small_pass(self, tokens, position_ids, visible, store: NativeStore, start: int, tree=None,
                    taps: tuple[int, ...] | None = None, tapped: list | None = None,
                    outputs: bool = True) -> torch.Tensor | None:
        """Hidden states [B, T, hidden] after the final norm, every op a row-exact kernel. With `taps`, the
        inputs of those layers are appended to `tapped` ([B, T, hidden] each, in increasing layer order).
        outputs=False: the last layer stops once its keys and values are stored; returns None."""
        batch, width = tokens.shape
        rows = batch * width
        buf = self._buffers_for(rows)
        positions = position_ids.reshape(-1).contiguous()
        x = self._embed(tokens.reshape(-1))  # the residual stream [rows, hidden], a fresh copy
        stack = self._layer_stack() if self.fused_layers else None
        if stack is not None:
            segments = self._segment_stacks(taps) if taps else [(0, len(self.layers), stack)]
            tap_set = set(taps or ())
            for begin, end, part in segments:
                if begin and begin in tap_set:
                    # a segment ends with its last MLP output in delta, not yet added: the C loop's first
                    # rms_norm of the next layer would add it in place (the same float32 sum), done here instead
                    x.add_(buf["delta"])
                if begin in tap_set:
                    tapped.append(x.clone().view(batch, width, self.hidden_size))
                part(x, buf, batch, width, self.num_heads, self.num_kv_heads, self.head_dim, positions, self._cos,
                     self._sin, store.keys[begin:end], store.values[begin:end], visible, start, self.scale, self.eps, tree,
                     keys_only_last=not outputs and end == len(self.layers))
            if not outputs:
                return None
            out = torch.empty(rows, self.hidden_size)
            kernels.rms_norm(x, self.final_norm, self.eps, out, buf["delta"])
            return out.view(batch, width, self.hidden_size)
        linears, _ = self._linears()
        residual = None  # the last sublayer's output, added to x inside the next rms_norm
        for index, (layer, linear) in enumerate(zip(self.layers, linears)):
            kernels.rms_norm(x, layer.attn_norm, self.eps, buf["normed"], residual)
            if taps and index in taps:
                tapped.append(x.clone().view(batch, width, self.hidden_size))  # x += residual happened in rms_norm
            linear["qkv"](buf["normed"], (buf["q"], buf["k"], buf["v"]))
            kernels.rope_(buf["q"], self.num_heads, positions, self._cos, self._sin)
            kernels.rope_(buf["k"], self.num_kv_heads, positions, self._cos, self._sin)
            shape = (batch, width, self.num_kv_heads, self.head_dim)
            kernels.cache_write(buf["k"].view(shape), buf["v"].view(shape), store.keys[index], store.values[index], start)
            if not outputs and index == len(self.layers) - 1:
                return None  # nothing reads the last layer's output
            kernels.slot_attention(buf["q"].view(batch, width, self.num_heads, self.head_dim), store.keys[index],
                                   store.values[index], visible, start, self.scale,
                                   out=buf["attended"].view(batch, width, self.num_heads, self.head_dim), tree=tree)
            linear["o"](buf["attended"], buf["delta"])
            kernels.rms_norm(x, layer.mlp_norm, self.eps, buf["normed"], buf["delta"])
            linear["gate_up"](buf["normed"], (buf["gate"], buf["up"]))
            kernels.silu_mul_(buf["gate"], buf["up"])
            residual = linear["down"](buf["gate"], buf["delta"])
        out = torch.empty(rows, self.hidden_size)  # returned to the caller: not a reused buffer
        kernels.rms_norm(x, self.final_norm, self.eps, out, residual)
        return out.view(batch, width, self.hidden_size)

    # --- big passes (prefill) and other devices: PyTorch ops ---------------------------------------

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embedding rows of tokens [...] -> [..., hidden], fresh tensors (a quantized table dequantizes its rows)."""
        if isinstance(self.embed, kernels.GGUFMatrix):
            return self.embed.rows(tokens)
        return F.embedding(tokens, self.embed)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Same op sequence as transformers' LlamaRMSNorm / Qwen2RMSNorm: statistics in float32.
        hidden = x.float()
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return weight * (hidden * torch.rsqrt(variance + self.eps)).to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # RoPE (Su et al. 2021) in transformers' half-split layout: x*cos + rotate_half(x)*sin.
        half = x.shape[-1] // 2
        return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)

    def _linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(weight, kernels.ExactBlocks):
            weight = weight.dense  # the float32 matrix the blocks rebuild exactly
        elif isinstance(weight, kernels.PanelMatrix):
            weight = weight.dequantize()  # a transient row-major copy (the panels' own GEMM is the usual path)
        elif isinstance(weight, kernels.QuantizedMatrix):
            # weight-only int8 or int4 (a draft): a big pass multiplies a widened copy, made at load
            # (`_widen_for_prefill`) or at the first big pass, and kept (widening every prefill cost ~1 s for
            # a 0.5B draft; PyTorch's own int8-weight matmul is ~100x slower on a CPU without AMX), in the
            # dtype whose GEMM is faster here (`_widened_dtype`).
            weight = weight.widened(_widened_dtype())
        elif weight.dtype == torch.bfloat16 and self.device.type == "cpu" and not _fast_bfloat16_matmul():
            weight = weight.float()  # a transient copy: converting is cheaper than the slow bfloat16 GEMM
        if weight.dtype == x.dtype:
            return F.linear(x, weight, bias)
        # lower-precision matrices (a draft): multiply in their dtype, return to the activations' dtype
        out = F.linear(x.to(weight.dtype), weight).to(x.dtype)
        return out if bias is None else out + bias

    def _linears_of(self, x: torch.Tensor, *pairs) -> list[torch.Tensor]:
        """`_linear(x, weight, bias)` for each (weight, bias) pair sharing x: one `kernels.blocked_linear`
        call (x packed once) when the big-pass GEMM is verispec's own."""
        if self._blocked and x.dtype == torch.float32 and all(kernels.blocked_takes(w) for w, _ in pairs):
            return kernels.blocked_linear(x, [w for w, _ in pairs], [b for _, b in pairs])
        return [self._linear(x, weight, bias) for weight, bias in pairs]

    def _big_pass(self, tokens, position_ids, visible, store: NativeStore, start: int, tree=None,
                  last_only: bool = False, taps: tuple[int, ...] | None = None, tapped: list | None = None,
                  every_row: bool = False) -> torch.Tensor:
        """Hidden states [B, T, hidden] after the final norm (last_only: [B, 1, hidden], the last layer
        computing only the last row past its keys and values: a prefill reads nothing else; unless
        `every_row`, when it computes the other rows too, apart, so the last row's bits do not change). With
        `taps`, the inputs of those layers, every row, are appended to `tapped` in increasing layer order."""
        batch, width = tokens.shape
        end = start + width
        cos = self._cos[position_ids][:, None]  # [B, 1, T, D], broadcast over heads
        sin = self._sin[position_ids][:, None]
        slot = torch.arange(end, device=self.device)
        own = start + torch.arange(width, device=self.device)
        # Causal over slots with holes and padding masked; every query also sees its own slot, so a
        # padding query (nothing visible) gets a finite result instead of the NaN of an empty softmax.
        allowed = (visible[:, None, :end] & (slot <= own[:, None])) | (slot == own[:, None])
        if tree is not None:  # new slots: only the token's own path
            allowed[:, :, start:end] &= tree | torch.eye(width, dtype=torch.bool, device=self.device)
        allowed = allowed[:, None]
        x = self._embed(tokens)
        for index, layer in enumerate(self.layers):
            if taps and index in taps:
                tapped.append(x)
            h = self._rms_norm(x, layer.attn_norm)
            final = last_only and index == len(self.layers) - 1  # keys and values for every row, the rest for the last
            if final:
                k, v = self._linears_of(h, (layer.k, layer.k_bias), (layer.v, layer.v_bias))
            else:
                q, k, v = self._linears_of(h, (layer.q, layer.q_bias), (layer.k, layer.k_bias), (layer.v, layer.v_bias))
            k, v = (t.view(batch, t.shape[1], -1, self.head_dim).transpose(1, 2) for t in (k, v))
            store.write(index, start, self._rotate(k, cos, sin), v)
            if not final:
                x = self._big_rows(store, index, layer, x, q, cos, sin, allowed, end)
                continue
            parts = [slice(None, -1), slice(-1, None)] if every_row and width > 1 else [slice(-1, None)]
            x = torch.cat([self._big_rows(store, index, layer, x[:, rows], self._linears_of(h[:, rows], (layer.q, layer.q_bias))[0],
                                          cos[:, :, rows], sin[:, :, rows], allowed[:, :, rows], end)
                           for rows in parts], 1)
        return self._rms_norm(x, self.final_norm)

    def _big_rows(self, store: NativeStore, index: int, layer, x, q, cos, sin, allowed, end: int) -> torch.Tensor:
        """Layer `index` past its keys and values (already stored) for rows x [B, n, hidden] with their
        queries q [B, n, heads * head_dim] (not yet rotated), rope tables and mask -> its output [B, n, hidden]."""
        batch, width = x.shape[:2]
        q = q.view(batch, width, -1, self.head_dim).transpose(1, 2)
        attended = F.scaled_dot_product_attention(
            self._rotate(q, cos, sin), store.key_view(index, end), store.value_view(index, end),
            attn_mask=allowed, scale=self.scale, enable_gqa=self.num_kv_heads != self.num_heads)
        x = x + self._linears_of(attended.transpose(1, 2).reshape(batch, width, -1), (layer.o, layer.o_bias))[0]
        h = self._rms_norm(x, layer.mlp_norm)
        gate, up = self._linears_of(h, (layer.gate, layer.gate_bias), (layer.up, layer.up_bias))
        return x + self._linears_of(F.silu(gate) * up, (layer.down, layer.down_bias))[0]
