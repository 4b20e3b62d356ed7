"""A plain-PyTorch forward pass for Llama / Qwen2 decoders, built for decoding and verifying on a CPU.

`NativeCausalLM` runs the same weights as a `transformers` model (it borrows the tensors, no copy)
through a hand-written pass: RMSNorm, rotary embeddings from precomputed tables, grouped-query
attention, SwiGLU MLP, Qwen2's q/k/v biases, tied or separate LM head. Keys and values live in a
preallocated `NativeStore` on the shared slot axis of `SlotCache`; rollback only moves its length.

Why not just `transformers`: a verify pass of k+1 tokens must cost about what one decode step
costs, because both read every weight once. PyTorch's CPU GEMMs make a 5-row product cost 2-3x a
1-row product, and they take different code paths for different row counts, so a token scored in a
wide verify pass need not get bitwise the logits it gets alone. Small passes (at most
`kernels.MAX_ROWS` rows) therefore go through `verispec.models.kernels`: a linear layer that reads
the weights once per tile of rows and computes every row independently, and an attention that
skips invisible slots instead of masking them. In that regime a row's logits are bitwise the same
whatever the pass width, its batch mates, or the holes rollback left in its cache. Big passes
(prefill) and non-CPU / non-float32 models use `F.linear` and `scaled_dot_product_attention`.

The model knows nothing about drafting, verification or tokenization; logits come back float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from verispec.cache import SlotCache
from verispec.models import kernels
from verispec.models.base import ModelCache
from verispec.models.hf import _eos_ids

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2"})
# RoPE variants whose frequencies are fixed at load time (`dynamic`/`longrope` rescale with length).
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


def _rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default")) or "default"


def supports(hf_model) -> bool:
    """Whether `NativeCausalLM.from_hf` can run this `transformers` model (or `HFCausalLM`) exactly."""
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


def _borrow(linear: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    bias = linear.bias.detach() if linear.bias is not None else None
    return linear.weight.detach(), bias


class NativeStore:
    """Keys and values of every layer: [layers, batch, capacity, kv_heads, head_dim] each.

    Slots [0, length) hold data; capacity doubles when a pass needs more room, so appending never
    reallocates per step, and trimming only moves `length`. Fresh memory is zeroed, so a slot that
    was never written (padding after `concat`) holds finite values.
    """

    def __init__(self, num_layers: int, batch_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, capacity: int = 0):
        shape = (num_layers, batch_size, capacity, kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    def reserve(self, needed: int) -> None:
        """Make room for `needed` slots, keeping slots [0, length)."""
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity, 64)
        self.keys = self._regrow(self.keys, capacity)
        self.values = self._regrow(self.values, capacity)

    def _regrow(self, tensor: torch.Tensor, capacity: int) -> torch.Tensor:
        shape = list(tensor.shape)
        shape[2] = capacity
        grown = tensor.new_zeros(shape)
        grown[:, :, : self.length] = tensor[:, :, : self.length]
        return grown

    def trim(self, length: int) -> None:
        self.length = min(self.length, length)

    def select(self, index: torch.Tensor) -> None:
        index = index.to(self.keys.device)
        self.keys = self.keys.index_select(1, index)
        self.values = self.values.index_select(1, index)

    def concat(self, other: "NativeStore", rows: int | None = None, other_rows: int | None = None) -> None:
        """Append other's rows; `rows` / `other_rows` (the KVStore contract's batch sizes) are
        implied by the tensors, which hold their rows even before any slot is written."""
        length = max(self.length, other.length)
        capacity = max(self.capacity, other.capacity, length)
        merged = []
        for mine, theirs in ((self.keys, other.keys), (self.values, other.values)):
            shape = list(mine.shape)
            shape[1] += theirs.shape[1]
            shape[2] = capacity
            out = mine.new_zeros(shape)
            out[:, : mine.shape[1], : self.length] = mine[:, :, : self.length]
            out[:, mine.shape[1] :, : other.length] = theirs[:, :, : other.length]
            merged.append(out)
        self.keys, self.values = merged
        self.length = length


class NativeCausalLM:
    """A Llama/Qwen2-family causal LM behind the verispec `CausalLM` contract; see the module docstring."""

    def __init__(self, hf_model, tokenizer=None, name: str | None = None):
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
        self.max_context = int(getattr(config, "max_position_embeddings", None) or 2048)

        self.embed = decoder.embed_tokens.weight.detach()
        self.lm_head, self.lm_head_bias = _borrow(hf_model.get_output_embeddings())  # the embedding when tied
        self.final_norm = decoder.norm.weight.detach()
        self.device = self.embed.device
        self.dtype = self.embed.dtype
        self.vocab_size = int(self.lm_head.shape[0])

        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
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
        self._inv_freq = rotary.inv_freq.detach().float().to(self.device)
        self._rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self._cos = self._sin = torch.empty(0, self.head_dim, device=self.device)
        self._rope_tables(min(self.max_context, 4096))

        # The exact small-pass kernels exist for float32 on the CPU only.
        self._kernels = self.device.type == "cpu" and self.dtype == torch.float32 and kernels.available()
        self._kernel_attention = self._kernels and kernels.attention_supported(self.head_dim)

    @classmethod
    def from_hf(cls, hf_model, tokenizer=None, name: str | None = None) -> "NativeCausalLM":
        """Build from a `transformers` Llama/Qwen2 model, or from an `HFCausalLM` (its tokenizer and name
        are reused unless given). The weights are shared with the HF model, not copied."""
        if hasattr(hf_model, "new_cache") and hasattr(hf_model, "model"):  # an HFCausalLM wrapper
            tokenizer = tokenizer if tokenizer is not None else hf_model.tokenizer
            name = name or hf_model.name
            hf_model = hf_model.model
        return cls(hf_model.eval(), tokenizer, name)

    supports = staticmethod(supports)

    def __repr__(self) -> str:
        path = "exact kernels" if self._kernels else "torch"
        return f"NativeCausalLM({self.name!r}, vocab={self.vocab_size}, device={self.device}, small passes: {path})"

    def new_cache(self, batch_size: int) -> ModelCache:
        store = NativeStore(len(self.layers), batch_size, self.num_kv_heads, self.head_dim, self.dtype, self.device)
        return ModelCache(slots=SlotCache(batch_size, self.device), store=store)

    # --- building blocks ---------------------------------------------------------------------

    def _rope_tables(self, positions: int) -> None:
        """cos/sin [positions, head_dim] computed like transformers' rotary embedding, once per size."""
        if positions <= self._cos.shape[0]:
            return
        freqs = torch.arange(positions, device=self.device).float()[:, None] * self._inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self._cos = (angles.cos() * self._rope_scaling).to(self.dtype)
        self._sin = (angles.sin() * self._rope_scaling).to(self.dtype)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Same op sequence as transformers' LlamaRMSNorm / Qwen2RMSNorm: statistics in float32.
        hidden = x.float()
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return weight * (hidden * torch.rsqrt(variance + self.eps)).to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # RoPE (Su et al. 2021) in the half-split layout of transformers: x*cos + rotate_half(x)*sin.
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos) + (rotated * sin)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, exact: bool) -> torch.Tensor:
        """x [..., in] -> [..., out]; `exact` routes through the row-independent kernel."""
        if exact:
            rows = x.reshape(-1, x.shape[-1])
            return kernels.rowwise_linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight, bias)

    def _attention(self, q: torch.Tensor, store: NativeStore, layer: int, visible: torch.Tensor, start: int,
                   exact: bool) -> torch.Tensor:
        """q [B, T, H, D] of tokens at slots start..start+T-1 -> [B, T, H, D]."""
        if exact and self._kernel_attention:
            return kernels.slot_attention(q, store.keys[layer], store.values[layer], visible, start, self.scale)
        width, slots = q.shape[1], start + q.shape[1]
        keys = store.keys[layer, :, :slots].transpose(1, 2)  # [B, KVH, S, D]
        values = store.values[layer, :, :slots].transpose(1, 2)
        slot = torch.arange(slots, device=q.device)
        own = start + torch.arange(width, device=q.device)
        # Causal over slots, holes and padding masked; every query also sees its own slot, so a
        # padding query (nothing visible) gets a finite result instead of a NaN from an empty softmax.
        allowed = (visible[:, None, :slots] & (slot[None, None, :] <= own[None, :, None])) | (slot == own[:, None])
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=allowed[:, None],
                                             scale=self.scale, enable_gqa=self.num_kv_heads != self.num_heads)
        return out.transpose(1, 2)

    # --- the contract ---------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: ModelCache, visible: torch.Tensor | None = None,
                last_only: bool = False) -> torch.Tensor:
        """tokens [B, T] long, visible [B, T] bool (False = padding) -> logits [B, T or 1, vocab] float32."""
        tokens = tokens.to(self.device)
        batch, width = tokens.shape
        if visible is None:
            visible = torch.ones_like(tokens, dtype=torch.bool)
        store: NativeStore = cache.store
        start = cache.slots.length
        if store.length != start:
            raise RuntimeError(f"cache out of step: {store.length} stored slots, {start} in the slot bookkeeping")
        _, position_ids = cache.slots.extend(visible.to(self.device))
        slots_visible = cache.slots.visible  # [B, start + T], row stride = slot capacity
        store.reserve(start + width)
        self._rope_tables(int(position_ids.max()) + 1)
        cos = self._cos[position_ids][:, :, None]  # [B, T, 1, D], broadcast over heads
        sin = self._sin[position_ids][:, :, None]
        exact = self._kernels and batch * width <= kernels.MAX_ROWS
        end = start + width

        x = F.embedding(tokens, self.embed)
        for index, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.attn_norm)
            q = self._linear(h, layer.q, layer.q_bias, exact).view(batch, width, self.num_heads, self.head_dim)
            k = self._linear(h, layer.k, layer.k_bias, exact).view(batch, width, self.num_kv_heads, self.head_dim)
            v = self._linear(h, layer.v, layer.v_bias, exact).view(batch, width, self.num_kv_heads, self.head_dim)
            store.keys[index, :, start:end] = self._rotate(k, cos, sin)
            store.values[index, :, start:end] = v
            attended = self._attention(self._rotate(q, cos, sin), store, index, slots_visible, start, exact)
            x = x + self._linear(attended.reshape(batch, width, -1), layer.o, layer.o_bias, exact)
            h = self._rms_norm(x, layer.mlp_norm)
            gate = self._linear(h, layer.gate, layer.gate_bias, exact)
            up = self._linear(h, layer.up, layer.up_bias, exact)
            x = x + self._linear(F.silu(gate) * up, layer.down, layer.down_bias, exact)
        store.length = end

        if last_only:
            x = x[:, -1:]  # the LM head is the biggest matrix: score only what the caller reads
        x = self._rms_norm(x, self.final_norm)
        exact_head = self._kernels and x.shape[0] * x.shape[1] <= kernels.MAX_ROWS
        return self._linear(x, self.lm_head, self.lm_head_bias, exact_head).float()
