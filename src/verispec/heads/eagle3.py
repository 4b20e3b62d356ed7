"""The EAGLE-3 draft head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language
Models via Training-Time Test"), as the EAGLE repository and SpecForge build it.

The head reads the target's hidden states at the inputs of three layers (low, middle, high: by default
layers 2, N/2 and N-3 of an N-layer target), concatenated [.., 3H] and projected by `fc` to H. One
decoder layer then takes, per position, the target's embedding of the next token beside that projection:

    x   = cat(input_layernorm(embed(token)), hidden_norm(h))          [.., 2H]   (q/k/v take 2H)
    h'  = h + o(attention(x));  h'' = h' + mlp(post_attention_layernorm(h'))
    logits over the draft vocabulary = lm_head(norm(h''))

so position t, given the target's state h_t and token x_{t+1}, predicts x_{t+2}. Drafting further, the
head feeds its own h'' (already H wide: no `fc`) with the token it chose, one position to the right.
Its vocabulary is a subset of the target's: draft id i is target id i + d2t[i]; t2d[v] says whether
target id v has a draft id. The token embedding is the target's own, shared and never trained.

The module knows nothing about data, training loops or the engine: it computes, given hidden states,
tokens and a key/value history, the next hidden state and draft logits.
"""

from __future__ import annotations

import functools
import json
import math
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from verispec.errors import VerispecError
from verispec.heads.files import CONFIG_FILE, WEIGHTS_FILE, write_head
from verispec.heads.vocab import DraftVocab

ARCHITECTURE = "LlamaForCausalLMEagle3"  # the name SpecForge and SGLang give this layout


def default_taps(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high taps for an N-layer target: the inputs of layers 2, N/2, N-3."""
    if num_layers < 6:
        raise VerispecError(f"an EAGLE-3 head taps three distinct layers; a {num_layers}-layer target has too few")
    return 2, num_layers // 2, num_layers - 3


@dataclass
class Eagle3Config:
    """The head's shape: the target's layer sizes, the draft vocabulary and where it taps the target."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    taps: tuple[int, ...]  # inputs of these target layers (transformers' hidden_states[i])
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    target: str = ""  # the target model's name, for users and for checks at load
    target_num_layers: int = 0
    extra: dict = field(default_factory=dict)  # training facts kept with the head (tokens seen, ...)

    @classmethod
    def for_target(cls, target, draft_vocab_size: int, taps: tuple[int, ...] | None = None,
                   intermediate_size: int | None = None) -> "Eagle3Config":
        """The head of `target` (a verispec CausalLM with a transformers `config`): its sizes, rope and eps.
        intermediate_size: the head's MLP width (default: the target's); a narrower one trains faster and
        drafts cheaper, which matters more on a CPU than the last point of acceptance."""
        config = target.config
        layers = int(config.num_hidden_layers)
        heads = int(config.num_attention_heads)
        return cls(
            hidden_size=int(config.hidden_size), intermediate_size=int(intermediate_size or config.intermediate_size),
            num_attention_heads=heads, num_key_value_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            vocab_size=int(target.vocab_size), draft_vocab_size=int(draft_vocab_size),
            taps=tuple(taps) if taps is not None else default_taps(layers),
            rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_theta(config)),
            max_position_embeddings=int(getattr(config, "max_position_embeddings", None) or 32768),
            target=str(getattr(target, "name", "")), target_num_layers=layers)

    def to_json(self) -> dict:
        """config.json: the transformers/SpecForge fields of a one-layer Llama draft, plus where it taps."""
        fields = asdict(self)
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.hidden_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "torch_dtype": "float32",
            # vLLM's and llama.cpp's convention (the residual stream entering each listed layer), which is ours;
            # SGLang reads the nested one and counts the tapped layer's output, one less (heads/formats.py)
            "eagle_aux_hidden_state_layer_ids": list(self.taps),
            **({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [t - 1 for t in self.taps]}} if min(self.taps) > 0 else {}),
            "verispec": {"taps": list(self.taps), "taps_are": "inputs of these target layers",
                         "target": self.target, "target_num_layers": self.target_num_layers, **fields["extra"]},
        }

    @classmethod
    def from_json(cls, data: dict) -> "Eagle3Config":
        ours = data.get("verispec", {})
        taps = ours.get("taps") or data.get("eagle_aux_hidden_state_layer_ids")
        if not taps:
            raise VerispecError("the head's config.json names no tap layers (verispec.taps or eagle_aux_hidden_state_layer_ids)")
        heads = int(data["num_attention_heads"])
        known = {"taps", "taps_are", "target", "target_num_layers"}
        return cls(
            hidden_size=int(data["hidden_size"]), intermediate_size=int(data["intermediate_size"]),
            num_attention_heads=heads, num_key_value_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or data["hidden_size"] // heads),
            vocab_size=int(data["vocab_size"]), draft_vocab_size=int(data.get("draft_vocab_size") or data["vocab_size"]),
            taps=tuple(int(i) for i in taps), rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_theta=float(data.get("rope_theta", 10000.0)),
            max_position_embeddings=int(data.get("max_position_embeddings", 32768)),
            target=str(ours.get("target", "")), target_num_layers=int(ours.get("target_num_layers", 0)),
            extra={k: v for k, v in ours.items() if k not in known})


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_theta", getattr(config, "rope_theta", 10000.0))


class KernelLinear(nn.Module):
    """A drafting-time stand-in for a bias-free `nn.Linear`: its weight rounded to ggml's Q4_0 / Q8_0 blocks, int8
    or int4 (or narrowed to bfloat16) and multiplied by verispec's CPU kernels, a quarter to a seventh of float32's
    bytes. A head's weights only shape its proposals, never the output, so rounding them is safe: it
    can only change how many proposals the target accepts. Inference only (no gradients)."""

    FORMATS = ("bfloat16", "int8", "int4", "q4_0", "q8_0")

    def __init__(self, linear: nn.Linear, weights: str):
        from verispec.models import kernels

        super().__init__()
        if weights not in self.FORMATS:
            raise VerispecError(f"a head's weights can be {', '.join(self.FORMATS)}, not {weights!r}")
        dense = linear.weight.detach().float().contiguous()
        if weights == "int4" and dense.shape[1] % kernels.Int4Matrix.GROUP or weights in kernels.GGUFMatrix.MADE and dense.shape[1] % 32:
            weights = "int8"  # int4 groups and ggml's blocks must tile the rows
        self.matrix = {"bfloat16": lambda w: w.to(torch.bfloat16).contiguous(), "int8": kernels.Int8Matrix.quantize,
                       "int4": kernels.Int4Matrix.quantize,
                       **{name: functools.partial(kernels.GGUFMatrix.quantize, kind=kind)
                          for name, kind in kernels.GGUFMatrix.MADE.items()}}[weights](dense)
        self.in_features, self.out_features = dense.shape[1], dense.shape[0]
        self.format = weights

    @property
    def weight(self) -> torch.Tensor:
        """The rounded weight as float32 (for inspection; the kernels read `matrix`)."""
        matrix = self.matrix
        return matrix.float() if isinstance(matrix, torch.Tensor) else matrix.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from verispec.models import kernels

        linear = _LINEARS.get(self)
        if linear is None:  # made once: building the C product each call cost ~50 us, a tenth of the product itself
            linear = _LINEARS[self] = kernels.Linear(self.matrix)
        rows = x.reshape(-1, self.in_features).float().contiguous()
        return linear(rows, torch.empty(rows.shape[0], self.out_features)).view(*x.shape[:-1], self.out_features)


class KernelGroup:
    """`KernelLinear`s that read the same input (q, k, v; gate, up) multiplied in one kernel call per weight format
    (`kernels.LinearGroup`): one wake of the thread pool and one rounding of x instead of one per matrix, each
    output bitwise what its own call gives. At a draft step's one to three rows those fixed costs are a third of
    a head's products."""

    def __init__(self, linears: list["KernelLinear"]):
        from verispec.models import kernels

        self.group = kernels.LinearGroup([kernels.Linear(linear.matrix) for linear in linears])
        self.in_features, self.widths = linears[0].in_features, [linear.out_features for linear in linears]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        rows = x.reshape(-1, self.in_features).float().contiguous()
        outs = tuple(torch.empty(rows.shape[0], width) for width in self.widths)
        self.group(rows, outs)
        return [out.view(*x.shape[:-1], width) for out, width in zip(outs, self.widths)]


# The kernel call (`kernels.Linear`) of each `KernelLinear`, made on its first forward and kept outside the module,
# so copying or pickling a head never meets its C pointers.
_LINEARS: "weakref.WeakKeyDictionary[KernelLinear, object]" = weakref.WeakKeyDictionary()

# The `KernelGroup` of a module whose `FUSED` children `ChainedHead._round_matrices` rounded (absent while they are
# nn.Linears, e.g. in training: those run one by one). Kept outside the module, so copying or pickling a head never
# meets its C pointers.
_FUSED: "weakref.WeakKeyDictionary[nn.Module, KernelGroup]" = weakref.WeakKeyDictionary()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention whose q/k/v read `in_features` numbers per position (EAGLE-3's: the 2H-wide
    [embedding, hidden] input; an MTP module's: its H-wide projection)."""

    FUSED = ("q_proj", "k_proj", "v_proj")  # one input: one kernel call once rounded (`KernelGroup`)

    def __init__(self, config: Eagle3Config, in_features: int | None = None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        width = in_features or 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)


class MLP(nn.Module):
    FUSED = ("gate_proj", "up_proj")  # one input: one kernel call once rounded (`KernelGroup`)

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = _FUSED.get(self)
        gate, up = fused(x) if fused is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(F.silu(gate) * up)


class MidLayer(nn.Module):
    """The head's one decoder layer (SpecForge's `midlayer`)."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)


class ChainedHead:
    """What a one-layer head that drafts a chain has whatever its layer reads (EAGLE-3's and an MTP
    module's, `heads.mtp`): the target's token embedding, rotary attention over its own key/value history,
    and training-time test. Mixin for an nn.Module with `config` (num_attention_heads, num_key_value_heads,
    head_dim), an `inv_freq` buffer, `embed` and these steps:

        hidden = project(taps)                                  the target's taps -> the layer's hidden input
        q, k, v, residual = qkv(tokens, hidden, positions)      the layer's attention inputs beside token x_{t+1}
        hidden = finish(residual, attend(q, keys, values, allowed))   the state fed to the next draft step
        logits(hidden)                                          over the draft vocabulary
    """

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """The target's embedding of tokens [...] long -> [..., H] float32."""
        if self.embed is None:
            raise VerispecError(f"the head has no token embedding: bind it to its target first ({type(self).__name__}.bind)")
        if isinstance(self.embed, torch.Tensor):
            return F.embedding(tokens, self.embed).float()
        return self.embed.rows(tokens.cpu()).to(tokens.device)

    def _rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, 1, T, D] of positions [B, T] (transformers' half-split layout)."""
        angles = positions[:, None, :, None].float() * self.inv_freq
        angles = torch.cat([angles, angles], -1)
        return angles.cos(), angles.sin()

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, heads, T, D] rotated by `_rotation`'s cos and sin."""
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def _attention_inputs(self, attn: "Attention", x: torch.Tensor, positions: torch.Tensor):
        """q [B, heads, T, D] and k, v [B, kv_heads, T, D] of `attn` for its input x [B, T, width], rotated."""
        batch, width, _ = x.shape
        fused = _FUSED.get(attn)
        q, k, v = fused(x) if fused is not None else (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
        q = q.view(batch, width, attn.heads, attn.head_dim).transpose(1, 2)
        k = k.view(batch, width, attn.kv_heads, attn.head_dim).transpose(1, 2)
        v = v.view(batch, width, attn.kv_heads, attn.head_dim).transpose(1, 2)
        cos, sin = self._rotation(positions)
        return self._rope(q, cos, sin), self._rope(k, cos, sin), v

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Plain masked attention: q [B, heads, T, D] over keys/values [B, kv_heads, S, D], allowed [B, T, S] bool."""
        scale = 1.0 / math.sqrt(q.shape[-1])
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[:, None], scale=scale,
                                              enable_gqa=keys.shape[1] != q.shape[1])

    def _round_matrices(self, parents: list[nn.Module], weights: str, kinds: tuple[type, ...] = (nn.Linear,)) -> None:
        """`quantize`'s work: every child of `parents` of one of `kinds` replaced by a `KernelLinear`, and a parent's
        `FUSED` children (those reading one input) grouped into one kernel call (`KernelGroup`)."""
        from verispec.models import kernels

        if not kernels.available():
            raise VerispecError("quantized heads need verispec's C kernels (a C compiler and an AVX2 CPU); "
                                "draft with float32 weights instead (weights=None)")
        if self.rounded is not None:
            raise VerispecError(f"this head's matrices are already rounded to {self.rounded}: quantize the float head")
        for parent in parents:
            for name, child in list(parent.named_children()):
                if isinstance(child, kinds):
                    setattr(parent, name, KernelLinear(child, weights))
            if hasattr(parent, "FUSED"):
                _FUSED[parent] = KernelGroup([getattr(parent, name) for name in parent.FUSED])
        self.rounded = weights

    def unroll(self, taps: torch.Tensor, tokens: torch.Tensor, steps: int, visible: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Training-time test (EAGLE-3 section 3.2): `steps` passes over a whole sequence, each feeding the
        head its own previous output, as drafting will.

        taps [B, T, in_features]: the target's, at positions 0..T-1; tokens [B, T + steps] long: the
        sequence, so tokens[:, t + 1 + i] is the token beside position t at step i; visible [B, T] bool
        (False = padding). Step i's query at position t sits at position t + i and attends to step 0's keys
        at positions <= t and to its own keys of steps 1..i at t (the chain it would have drafted).
        Returns per step the logits [B, T, V]; step i's logits at t predict tokens[:, t + 2 + i].
        """
        batch, width, _ = taps.shape
        positions = torch.arange(width, device=taps.device)[None].expand(batch, width)
        causal = torch.tril(torch.ones(width, width, dtype=torch.bool, device=taps.device))
        allowed = causal[None] if visible is None else causal[None] & visible[:, None, :]
        allowed = allowed | torch.eye(width, dtype=torch.bool, device=taps.device)[None]  # padding sees itself
        hidden = self.project(taps)
        keys, values, outputs = [], [], []
        group = self.config.num_attention_heads // self.config.num_key_value_heads
        scale = 1.0 / math.sqrt(self.config.head_dim)
        for i in range(steps):
            q, k, v, residual = self.qkv(tokens[:, 1 + i : 1 + i + width], hidden, positions + i)
            keys.append(k.repeat_interleave(group, 1))
            values.append(v.repeat_interleave(group, 1))
            # scores against step 0 (causal) and, per later step, the key at the same index (the diagonal)
            scores = [(q @ keys[0].transpose(-1, -2) * scale).masked_fill(~allowed[:, None], float("-inf"))]
            scores += [((q * key).sum(-1) * scale)[..., None] for key in keys[1:]]
            weights = torch.cat(scores, -1).softmax(-1)
            attended = weights[..., :width] @ values[0]
            for j, value in enumerate(values[1:]):
                attended = attended + weights[..., width + j : width + j + 1] * value
            hidden = self.finish(residual, attended)
            outputs.append(self.logits(hidden))
        return outputs


class Eagle3Head(DraftVocab, ChainedHead, nn.Module):
    """fc, midlayer, norm, lm_head and the d2t/t2d maps; `embed` (the target's token embedding) is bound
    with `bind` and never saved or trained. Shapes: B batch, T positions, H hidden, V draft vocabulary."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(len(config.taps) * h, h, bias=False)
        self.midlayer = MidLayer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.embed: torch.Tensor | None = None  # [vocab, H], the target's, bound by `bind`
        self.rounded: str | None = None  # the format `quantize` rounded the matrices to (None: float)
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    # --- vocabulary: `set_draft_vocab`, `draft_token_ids` (DraftVocab) and the target's embedding ---

    def bind(self, embedding) -> "Eagle3Head":
        """Use the target's token embedding [vocab, H] (shared, not copied): a float tensor, or a quantized
        table whose `rows(ids)` dequantizes the rows looked up (a GGUF target's). Returns self."""
        if tuple(embedding.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise VerispecError(f"the head was trained for a target with a {self.config.vocab_size} x "
                                f"{self.config.hidden_size} embedding ({self.config.target or 'unnamed'}); this target's is "
                                f"{tuple(embedding.shape)}: use the head with the target it was trained on")
        self.embed = embedding.detach() if isinstance(embedding, torch.Tensor) else embedding
        return self

    def bind_to(self, target) -> "Eagle3Head":
        """Bind what the head shares with `target` (a verispec CausalLM): its token embedding. Returns self."""
        return self.bind(target_embedding(target))

    @property
    def bound(self) -> tuple:
        """What `bind` was given (to bind a copy of the head alike); empty while unbound."""
        return () if self.embed is None else (self.embed,)

    def quantize(self, weights: str) -> "Eagle3Head":
        """Round every matrix to `weights` ("q4_0", "q8_0", "int8", "int4" or "bfloat16") for drafting on a CPU with
        verispec's kernels (`KernelLinear`): a draft token then reads a seventh (q4_0, int4) to a quarter (int8) of
        float32's bytes.
        For inference only; a saved head keeps its float32 weights. Returns self."""
        self._round_matrices([self, self.midlayer.self_attn, self.midlayer.mlp], weights)
        return self.eval()

    @property
    def in_features(self) -> int:
        """Width of the taps the head reads: len(taps) * H."""
        return len(self.config.taps) * self.config.hidden_size

    # --- the layer ---------------------------------------------------------------------------------

    def project(self, taps: torch.Tensor) -> torch.Tensor:
        """The target's taps [.., len(taps) * H] -> the head's hidden input [.., H]."""
        return self.fc(taps.float())

    def qkv(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """tokens [B, T] long, hidden [B, T, H], positions [B, T] -> q [B, heads, T, D] and k, v [B, kv_heads, T, D],
        rotated, and the layer's residual [B, T, H] (EAGLE-3's: the hidden input itself)."""
        layer = self.midlayer
        embeds = self.embed_rows(tokens).to(hidden.dtype)
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], -1)
        return (*self._attention_inputs(layer.self_attn, x, positions), hidden)

    def finish(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's output [B, T, H] (pre-norm: the hidden state fed to the next draft step), given its
        residual [B, T, H] (`qkv`'s) and the attention output [B, heads, T, D]."""
        layer = self.midlayer
        batch, _, width, _ = attended.shape
        h = residual + layer.self_attn.o_proj(attended.transpose(1, 2).reshape(batch, width, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's output [.., H] -> logits over the draft vocabulary [.., V] float32."""
        return self.lm_head(self.norm(hidden)).float()


# --- files ------------------------------------------------------------------------------------------

def is_head_directory(path: str | Path) -> bool:
    """Whether `path` is a directory holding a trained EAGLE-3 head (its config.json says so: verispec's and
    SpecForge's architecture, or a speculators eagle3 config)."""
    try:
        data = json.loads((Path(path).expanduser() / CONFIG_FILE).read_text())
        return ARCHITECTURE in (data.get("architectures") or []) or data.get("speculators_model_type") == "eagle3"
    except (OSError, ValueError, AttributeError):
        return False


def save_head(head: Eagle3Head, directory: str | Path) -> Path:
    """Write config.json and model.safetensors (EAGLE-3 names: fc.weight, midlayer.*, norm.weight,
    lm_head.weight, d2t, t2d; no embedding) into `directory`, atomically per file."""
    return write_head(directory, head.state_dict(), head.config.to_json())


def load_head(directory: str | Path, target=None) -> Eagle3Head:
    """An EAGLE-3 head saved by `save_head`, in eval mode; bound to `target`'s embedding when a target is
    given. Heads trained elsewhere (speculators/vLLM or SpecForge layouts) load through `formats.load_head`."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHTS_FILE).is_file():
        raise VerispecError(f"{directory} is not a draft head: it needs {CONFIG_FILE} and {WEIGHTS_FILE} "
                            "(train one with `verispec train eagle3`)")
    data = json.loads((directory / CONFIG_FILE).read_text())
    if "verispec" not in data:  # trained elsewhere: other tensor names, other tap ids
        raise VerispecError(f"{directory} holds a head in another layout (speculators or SpecForge): read it with "
                            "verispec.load_head, which converts it")
    if ARCHITECTURE not in (data.get("architectures") or []):
        raise VerispecError(f"{directory}/{CONFIG_FILE} describes {data.get('architectures')}, not an EAGLE-3 head")
    head = Eagle3Head(Eagle3Config.from_json(data))
    tensors = load_file(str(directory / WEIGHTS_FILE))
    tensors.pop("embed_tokens.weight", None)  # some exports carry the target's embedding: ours is bound
    missing, unexpected = head.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise VerispecError(f"{directory}/{WEIGHTS_FILE} does not fit the config: missing {missing}, unexpected {unexpected}")
    head.eval()
    if target is not None:
        head.bind(target_embedding(target))
    return head


def target_embedding(target):
    """The token embedding [vocab, H] of a verispec CausalLM (native or transformers backend): a float
    tensor, or a GGUF target's quantized table (looked up with `rows`)."""
    from verispec.models.kernels import GGUFMatrix

    if isinstance(getattr(target, "embed", None), (torch.Tensor, GGUFMatrix)):
        return target.embed
    model = getattr(target, "model", None)
    if model is not None and hasattr(model, "get_input_embeddings"):
        return model.get_input_embeddings().weight
    raise VerispecError(f"cannot find the token embedding of {getattr(target, 'name', target)!r}")


def target_output_rows(target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows `ids` of the target's LM head [len(ids), H], its final norm weight [H]), float32: what a head
    starts its own output layer from. Native targets (float, or a GGUF file's blocks) and transformers models."""
    from verispec.models.kernels import GGUFMatrix

    lm_head, norm = getattr(target, "lm_head", None), getattr(target, "final_norm", None)
    if isinstance(lm_head, GGUFMatrix) and norm is not None:
        return lm_head.rows(ids), norm.float()
    if isinstance(lm_head, torch.Tensor) and norm is not None:
        return lm_head[ids].float(), norm.float()
    model = getattr(target, "hf_model", None)
    model = model if model is not None else getattr(target, "model", None)
    if model is None or not hasattr(model, "get_output_embeddings"):
        raise VerispecError(f"cannot read the output layer of {getattr(target, 'name', target)!r}")
    return model.get_output_embeddings().weight.detach()[ids].float(), model.model.norm.weight.detach().float()
