"""A DeepSeek-V3-style multi-token prediction (MTP) module (DeepSeek-AI 2024, "DeepSeek-V3 Technical
Report", section 2.2), trained here on a frozen target as a draft head.

The module reads, per position t, the target's hidden state h_t beside the target's embedding of the
next token x_{t+1}, and one decoder block turns them into a state that predicts x_{t+2}:

    h'  = eh_proj(cat(enorm(embed(x_{t+1})), hnorm(h_t)))                  [.., 2H] -> [.., H]
    h'' = block(h')   (pre-norm attention over the module's own key/value history, then a SiLU MLP)
    s   = shared_head.norm(h'');  logits = shared_head.head(s)             over the draft vocabulary

The report writes the concatenation hidden state first; DeepSeek's released weights, and vLLM that
serves them, put the embedding first. The order means nothing to a module trained here; this one
follows the released layout and its names (enorm, hnorm, eh_proj, the block's input_layernorm /
self_attn / post_attention_layernorm / mlp, shared_head.norm and shared_head.head).

Which h_t. The report calls h^0 "the representation given by the main model" without saying whether the
main model's final RMSNorm has been applied (deepseek-ai/DeepSeek-V3 issue 839 asks; it went unanswered);
vLLM, serving the released weights, hands its MTP layer the state after it. verispec uses that state
too: tap index = the target's layer count, what its LM head reads, which every backend's prefill and
verify passes already return (Medusa reads it) at no extra cost, where the state before the norm would
need a tap of its own. `hnorm` renormalizes it anyway: the two differ by the final norm's per-channel
weight, which eh_proj can absorb.

Chaining. Drafting further, the module feeds its own output state s (after `shared_head.norm`: the state
its output layer reads, as h_t is the state the target's reads) with the token it chose, one position to
the right: DeepSeek's sequential MTP with its one module used again at every depth, which is what vLLM
does when it drafts more tokens than a model has MTP modules (recycling the normed state too), and what
EAGLE does. It is trained for that with training-time test (K unrolled steps, loss sum_i 0.8^i * soft CE
against the target: `heads.train`), and drafted by the EAGLE-3 drafter's chain (`drafters.mtp`); both
come from `eagle3.ChainedHead`.

Shared embedding and output layer. Both are the target's, bound at load (`bind_to`), never trained and
never saved: a file holds only the module's own weights. The output layer scores either the target's
whole vocabulary with its whole LM head (DeepSeek's shared head) or, by default, a draft vocabulary
(`DraftVocab`: the target's most frequent tokens, d2t/t2d as EAGLE-3 and Medusa keep it) with the
target's rows for those tokens. On a CPU the default matters: Qwen2.5-1.5B's LM head is 151,936 x 1536
(233M weights, a seventh of the whole target), read once per drafted token, where 32,000 rows read a
fifth of that; the price is that the module never proposes a token outside its vocabulary.

The module knows nothing about data, training loops or the engine: given the target's final hidden
states, tokens and a key/value history, it computes the next state and draft logits.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from verispec.errors import VerispecError
from verispec.heads.eagle3 import MLP, Attention, ChainedHead, Eagle3Config, RMSNorm, target_embedding, target_output_rows
from verispec.heads.files import CONFIG_FILE, WEIGHTS_FILE, write_head
from verispec.heads.vocab import DraftVocab

ARCHITECTURE = "VerispecMTPHead"
MODEL_TYPE = "verispec_mtp"


@dataclass
class MTPConfig:
    """The module's shape: the target's layer sizes, the draft vocabulary, and the target's depth (its
    final hidden state is tap `target_num_layers`)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int  # = vocab_size: the target's whole LM head
    target_num_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    target: str = ""  # the target model's name, for users and for checks at load
    extra: dict = field(default_factory=dict)  # training facts kept with the module (steps, held-out agreement, ...)

    @property
    def taps(self) -> tuple[int, ...]:
        """The target state the module reads: its final hidden state, after its final norm."""
        return (self.target_num_layers,)

    @classmethod
    def for_target(cls, target, draft_vocab_size: int, intermediate_size: int | None = None) -> "MTPConfig":
        """The module of `target` (a verispec CausalLM): its layer's sizes, rope and eps (as an EAGLE-3
        head's layer takes them). intermediate_size: the block's MLP width (default: the target's)."""
        layer = Eagle3Config.for_target(target, draft_vocab_size, taps=(0,), intermediate_size=intermediate_size)
        return cls(**{name: getattr(layer, name) for name in (
            "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
            "draft_vocab_size", "target_num_layers", "rms_norm_eps", "rope_theta", "max_position_embeddings", "target")})

    def to_json(self) -> dict:
        fields = asdict(self)
        return {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            "num_nextn_predict_layers": 1,
            **{name: fields[name] for name in ("hidden_size", "intermediate_size", "num_attention_heads",
                                               "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab_size",
                                               "rms_norm_eps", "rope_theta", "max_position_embeddings")},
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "verispec": {"reads": "the target's final hidden state after its final norm", "target": self.target,
                         "target_num_layers": self.target_num_layers,
                         "shared": "the target's token embedding and output layer, bound at load, never saved",
                         **fields["extra"]},
        }

    @classmethod
    def from_json(cls, data: dict) -> "MTPConfig":
        ours = data.get("verispec") or {}
        heads = int(data["num_attention_heads"])
        known = {"reads", "target", "target_num_layers", "shared"}
        return cls(
            hidden_size=int(data["hidden_size"]), intermediate_size=int(data["intermediate_size"]),
            num_attention_heads=heads, num_key_value_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or data["hidden_size"] // heads), vocab_size=int(data["vocab_size"]),
            draft_vocab_size=int(data.get("draft_vocab_size") or data["vocab_size"]),
            target_num_layers=int(ours["target_num_layers"]), rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_theta=float(data.get("rope_theta", 10000.0)),
            max_position_embeddings=int(data.get("max_position_embeddings", 32768)), target=str(ours.get("target", "")),
            extra={k: v for k, v in ours.items() if k not in known})


class BorrowedLinear(nn.Module):
    """A bias-free linear layer whose weight [out, in] belongs to another model (the target's output rows):
    a non-persistent buffer, so it is never trained nor saved; `KernelLinear` rounds it like any matrix."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SharedHead(nn.Module):
    """DeepSeek-V3's `shared_head`: the module's own final norm, then the target's output layer (`head`,
    bound by `MTPHead.bind`)."""

    def __init__(self, config: MTPConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head: nn.Module | None = None


class MTPHead(DraftVocab, ChainedHead, nn.Module):
    """enorm, hnorm, eh_proj, one decoder block, shared_head.norm and the d2t/t2d maps; the target's
    embedding (`embed`) and output rows (`shared_head.head`) are bound with `bind` / `bind_to`.
    Shapes: B batch, T positions, H hidden, V draft vocabulary."""

    def __init__(self, config: MTPConfig):
        super().__init__()
        self.config = config
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(config, in_features=h)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(config)
        self.shared_head = SharedHead(config)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.full((config.vocab_size,), config.draft_vocab_size == config.vocab_size))
        self.embed: torch.Tensor | None = None  # [vocab, H], the target's, bound by `bind`
        self.rounded: str | None = None  # the format `quantize` rounded the matrices to (None: float)
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    # --- what the module shares with its target --------------------------------------------------------

    def bind(self, embedding, output: torch.Tensor) -> "MTPHead":
        """Use the target's token embedding [vocab, H] (a float tensor, or a GGUF target's quantized table read
        with `rows`) and its LM head's rows for the draft vocabulary [V, H] float32, in draft-id order (the
        whole LM head when V = vocab): shared, not copied. Returns self."""
        config = self.config
        if tuple(embedding.shape) != (config.vocab_size, config.hidden_size):
            raise VerispecError(f"the MTP module was trained for a target with a {config.vocab_size} x {config.hidden_size} "
                                f"embedding ({config.target or 'unnamed'}); this target's is {tuple(embedding.shape)}: "
                                "use it with the target it was trained on")
        if tuple(output.shape) != (config.draft_vocab_size, config.hidden_size):
            raise VerispecError(f"the output rows are {tuple(output.shape)}, not {config.draft_vocab_size} x {config.hidden_size}")
        if self.rounded is not None:
            raise VerispecError("this module's matrices are rounded: bind the float module, then quantize it")
        self.embed = embedding.detach() if isinstance(embedding, torch.Tensor) else embedding
        self.shared_head.head = BorrowedLinear(output.detach())
        return self

    def bind_to(self, target) -> "MTPHead":
        """Bind the embedding and output rows of `target` (a verispec CausalLM: native, GGUF or transformers).
        Returns self."""
        return self.bind(target_embedding(target), target_output_layer(target, self.draft_token_ids))

    @property
    def bound(self) -> tuple:
        """What `bind` was given (to bind a copy of the module alike); empty while unbound."""
        return () if self.embed is None else (self.embed, self.shared_head.head.weight)

    def quantize(self, weights: str) -> "MTPHead":
        """Round every matrix, the bound output rows included, to `weights` ("q4_0", "q8_0", "int8", "int4" or "bfloat16") for
        drafting on a CPU with verispec's kernels (`KernelLinear`). Inference only. Returns self."""
        if self.shared_head.head is None:
            raise VerispecError("bind the MTP module to its target before quantizing it (its output layer is the target's)")
        self._round_matrices([self, self.self_attn, self.mlp, self.shared_head], weights, (nn.Linear, BorrowedLinear))
        return self.eval()

    @property
    def in_features(self) -> int:
        """Width of the target state the module reads: H."""
        return self.config.hidden_size

    # --- the module (`ChainedHead`'s steps) ------------------------------------------------------------

    def project(self, taps: torch.Tensor) -> torch.Tensor:
        """The target's final hidden states [.., H] are the module's hidden input as they are."""
        return taps.float()

    def qkv(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """tokens [B, T] long (x_{t+1}), hidden [B, T, H] (h_t), positions [B, T] -> q [B, heads, T, D] and k, v
        [B, kv_heads, T, D], rotated, and the block's residual h' [B, T, H]."""
        embeds = self.embed_rows(tokens).to(hidden.dtype)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], -1))
        return (*self._attention_inputs(self.self_attn, self.input_layernorm(x), positions), x)

    def finish(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The module's output state [B, T, H] after `shared_head.norm` (what its output layer reads, and
        what the next draft step reads as h), given h' [B, T, H] and the attention output [B, heads, T, D]."""
        batch, _, width, _ = attended.shape
        h = residual + self.self_attn.o_proj(attended.transpose(1, 2).reshape(batch, width, -1))
        h = h + self.mlp(self.post_attention_layernorm(h))
        return self.shared_head.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The module's output state [.., H] -> logits over the draft vocabulary [.., V] float32."""
        if self.shared_head.head is None:
            raise VerispecError("the MTP module has no output layer: bind it to its target first (MTPHead.bind_to)")
        return self.shared_head.head(hidden).float()


def target_output_layer(target, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the target's LM head [len(ids), H] float32: the target's own tensor, not a copy, when
    `ids` is its whole vocabulary in order and it holds float32 weights."""
    lm_head = getattr(target, "lm_head", None)
    whole = len(ids) == target.vocab_size and bool((ids == torch.arange(len(ids), device=ids.device)).all())
    if whole and isinstance(lm_head, torch.Tensor) and lm_head.dtype == torch.float32:
        return lm_head
    return target_output_rows(target, ids.cpu())[0]


def check_target(head: MTPHead, target) -> None:
    """The module must read this target's final hidden state and score its vocabulary."""
    config = head.config
    width, layers = int(target.config.hidden_size), int(target.config.num_hidden_layers)
    if (config.vocab_size, config.hidden_size, config.target_num_layers) != (target.vocab_size, width, layers):
        raise VerispecError(f"the MTP module was trained for {config.target or 'another target'!r} ({config.vocab_size} "
                            f"tokens, width {config.hidden_size}, {config.target_num_layers} layers); "
                            f"{getattr(target, 'name', target)!r} has {target.vocab_size} tokens, width {width}, {layers} "
                            "layers: use it with its own target")


# --- files ------------------------------------------------------------------------------------------

def is_head_directory(path: str | Path) -> bool:
    """Whether `path` holds an MTP module saved by verispec (its config.json names the architecture)."""
    try:
        data = json.loads((Path(path).expanduser() / CONFIG_FILE).read_text())
        return ARCHITECTURE in (data.get("architectures") or [])
    except (OSError, ValueError, AttributeError):
        return False


def save_head(head: MTPHead, directory: str | Path) -> Path:
    """Write config.json and model.safetensors (the module's own weights, d2t and t2d; neither the target's
    embedding nor its output rows) into `directory`, atomically per file."""
    return write_head(directory, head.state_dict(), head.config.to_json())


def load_head(directory: str | Path, target=None) -> MTPHead:
    """An MTP module saved by `save_head`, in eval mode; checked against and bound to `target` when one is
    given (else bound by its drafter)."""
    from safetensors.torch import load_file

    directory = Path(directory).expanduser()
    if not is_head_directory(directory) or not (directory / WEIGHTS_FILE).is_file():
        raise VerispecError(f"{directory} holds no MTP module: it needs {CONFIG_FILE} naming {ARCHITECTURE} and "
                            f"{WEIGHTS_FILE} (train one with `verispec train mtp`)")
    head = MTPHead(MTPConfig.from_json(json.loads((directory / CONFIG_FILE).read_text())))
    missing, unexpected = head.load_state_dict(load_file(str(directory / WEIGHTS_FILE)), strict=False)
    if missing or unexpected:
        raise VerispecError(f"{directory}/{WEIGHTS_FILE} does not fit its config: missing {missing}, unexpected {unexpected}")
    head.eval()
    if target is not None:
        check_target(head, target)
        head.bind_to(target)
    return head
