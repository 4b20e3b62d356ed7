"""Medusa-1 heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads"), as the Medusa repository builds them.

K heads read the target's last hidden state h_t (after its final norm: what its LM head reads, Medusa's
`outputs[0]`). Head i is `num_layers` residual blocks and its own LM head:

    r = h + SiLU(W r + b)   (each block, W starting at zero: the identity)
    logits_i = lm_head_i(r)   over the draft vocabulary

and predicts the token at t + 2 + i: the target itself predicts t + 1 from h_t, so after one target pass
the heads propose the K tokens that follow the target's own. They never see the tokens they propose,
which makes them cheap (one matrix product per head, no cache) and their later guesses weaker than a
chained head's. Each LM head starts as the target's (its rows for the draft vocabulary), as Medusa-1 does.
Its vocabulary may be a subset of the target's (`DraftVocab`: d2t/t2d, as EAGLE-3 heads keep it).

Files: verispec's layout is config.json (architecture "MedusaHeads", Medusa's `medusa_num_heads` and
`medusa_num_layers`, our sizes and training facts) and model.safetensors with Medusa's own names
(`medusa_head.{i}.{j}.linear.weight/bias`, `medusa_head.{i}.{num_layers}.weight`) plus d2t and t2d.
`load_head` also reads the Medusa repository's layout: a config.json with `medusa_num_heads` beside
`medusa_lm_head.safetensors` or `medusa_lm_head.pt` (the state dict of its `medusa_head` module list,
full vocabulary).

The module knows nothing about data, training loops or the engine: given final hidden states, it
computes each head's logits, and their loss against the target's tokens (offline training, `train_medusa`,
and online, `online`, share it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from verispec.errors import VerispecError
from verispec.heads.files import CONFIG_FILE, WEIGHTS_FILE, write_head
from verispec.heads.vocab import DraftVocab, soft_targets

ARCHITECTURE = "MedusaHeads"
MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")  # the Medusa repository's, in preference order


@dataclass
class MedusaConfig:
    """The heads' shape: how many, how deep, the target's width and the draft vocabulary."""

    hidden_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    num_heads: int = 4  # K: head i predicts the token at t + 2 + i
    num_layers: int = 1  # residual blocks per head
    target: str = ""  # the target model's name, for users and for checks at load
    extra: dict = field(default_factory=dict)  # training facts kept with the heads (steps, held-out accuracy, ...)

    @classmethod
    def for_target(cls, target, draft_vocab_size: int, num_heads: int = 4, num_layers: int = 1) -> "MedusaConfig":
        """The heads of `target` (a verispec CausalLM): its width and vocabulary."""
        if num_heads < 1 or num_layers < 0:
            raise VerispecError(f"Medusa needs at least one head and no negative depth, got {num_heads} heads of "
                                f"{num_layers} blocks")
        return cls(hidden_size=int(target.config.hidden_size), vocab_size=int(target.vocab_size),
                   draft_vocab_size=int(draft_vocab_size), num_heads=num_heads, num_layers=num_layers,
                   target=str(getattr(target, "name", "")))

    def to_json(self) -> dict:
        return {
            "architectures": [ARCHITECTURE],
            "medusa_num_heads": self.num_heads,
            "medusa_num_layers": self.num_layers,
            "base_model_name_or_path": self.target,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "torch_dtype": "float32",
            "verispec": {"reads": "the target's final hidden state after its final norm", **self.extra},
        }

    @classmethod
    def from_json(cls, data: dict) -> "MedusaConfig":
        ours = {k: v for k, v in (data.get("verispec") or {}).items() if k != "reads"}
        vocab = int(data["vocab_size"])
        return cls(hidden_size=int(data["hidden_size"]), vocab_size=vocab,
                   draft_vocab_size=int(data.get("draft_vocab_size") or vocab),
                   num_heads=int(data["medusa_num_heads"]), num_layers=int(data.get("medusa_num_layers", 1)),
                   target=str(data.get("base_model_name_or_path") or ""), extra=ours)


class ResBlock(nn.Module):
    """x + SiLU(linear(x)), the linear's weight starting at zero (the block starts as the identity)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHead(DraftVocab, nn.Module):
    """`medusa_head` (K sequences of residual blocks and an LM head) and the d2t/t2d maps.
    Shapes: H hidden, K heads, V draft vocabulary."""

    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.medusa_head = nn.ModuleList(
            nn.Sequential(*[ResBlock(h) for _ in range(config.num_layers)], nn.Linear(h, config.draft_vocab_size, bias=False))
            for _ in range(config.num_heads))
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool)
                             if config.draft_vocab_size == config.vocab_size else torch.zeros(config.vocab_size, dtype=torch.bool))

    def lm_heads(self) -> list[nn.Linear]:
        return [head[-1] for head in self.medusa_head]

    def forward(self, hidden: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """The target's final hidden states [.., H] -> logits [.., K, V] float32 over the draft vocabulary
        (the first `heads` heads only, if given); head i's predict the token 2 + i positions on."""
        hidden = hidden.to(self.lm_heads()[0].weight.dtype)
        return torch.stack([head(hidden) for head in self.medusa_head[:heads]], -2).float()


# --- the loss -------------------------------------------------------------------------------------

def medusa_loss(head: MedusaHead, shard: dict, rows: list[int], decay: float):
    """(loss, [accuracy of head i], [loss of head i]) over sequences `rows` of a shard whose taps are the
    target's final hidden states.

    Head i at position t reads h_t and is scored against the target's distribution at t + 1 + i (the
    token t + 2 + i), for t in [0, T - 1 - i)."""
    tokens = shard["tokens"][rows]
    length, width = tokens.shape[1], head.config.hidden_size
    if length < head.config.num_heads + 1:
        raise VerispecError(f"sequences of {length} tokens are too short for {head.config.num_heads} Medusa heads")
    hidden = shard["taps"][rows].float()
    if hidden.shape[-1] != width:
        raise VerispecError(f"the features hold {hidden.shape[-1]} numbers per token, not one final hidden state of "
                            f"{width}: extract them with taps=(the target's layer count,)")
    total, accuracy, losses = 0.0, [], []
    draft_to_target = head.draft_token_ids
    for i, layers in enumerate(head.medusa_head):
        span = length - 1 - i
        logits = layers(hidden[:, :span]).float()
        ids = shard["top_ids"][rows, 1 + i : 1 + i + span]
        p, mask = soft_targets(ids, shard["top_logprobs"][rows, 1 + i : 1 + i + span], head)
        per_position = -(p * torch.log_softmax(logits, -1)).sum(-1)
        count = mask.sum().clamp(min=1)
        loss = (per_position * mask).sum() / count
        total = total + decay ** i * loss
        hits = (draft_to_target[logits.argmax(-1)] == ids[..., 0].long()) & mask
        accuracy.append(float(hits.sum()) / float(count))
        losses.append(float(loss.detach()))
    return total, accuracy, losses


# --- files ------------------------------------------------------------------------------------------

def is_head_directory(path: str | Path) -> bool:
    """Whether `path` holds Medusa heads: ours (config.json names MedusaHeads) or the Medusa repository's
    (config.json with medusa_num_heads beside a medusa_lm_head file)."""
    directory = Path(path).expanduser()
    try:
        data = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(data, dict):
        return False
    if ARCHITECTURE in (data.get("architectures") or []):
        return True
    return "medusa_num_heads" in data and any((directory / name).is_file() for name in MEDUSA_FILES)


def save_head(head: MedusaHead, directory: str | Path) -> Path:
    """Write config.json and model.safetensors into `directory`, atomically per file."""
    return write_head(directory, head.state_dict(), head.config.to_json())


def load_head(directory: str | Path, target=None) -> MedusaHead:
    """Medusa heads saved by `save_head`, or in the Medusa repository's layout, in eval mode and float32.
    `target` (optional) is checked against the heads' vocabulary and width."""
    directory = Path(directory).expanduser()
    if not is_head_directory(directory):
        raise VerispecError(f"{directory} holds no Medusa heads: it needs {CONFIG_FILE} naming {ARCHITECTURE} and "
                            f"{WEIGHTS_FILE}, or Medusa's config.json and {' or '.join(MEDUSA_FILES)} "
                            "(train heads with `verispec train medusa`)")
    data = json.loads((directory / CONFIG_FILE).read_text())
    if ARCHITECTURE in (data.get("architectures") or []):
        from safetensors.torch import load_file

        head = MedusaHead(MedusaConfig.from_json(data))
        tensors = load_file(str(directory / WEIGHTS_FILE))
    else:
        tensors = _medusa_tensors(directory)
        head = MedusaHead(_medusa_config(data, tensors))
        tensors.update(d2t=head.d2t, t2d=head.t2d)  # the full vocabulary
    missing, unexpected = head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()},
                                               strict=False)
    if missing or unexpected:
        raise VerispecError(f"the weights in {directory} do not fit its config: missing {missing}, unexpected {unexpected}")
    if target is not None:
        check_target(head, target)
    return head.eval()


def check_target(head: MedusaHead, target) -> None:
    """The heads must read this target's hidden states and score its vocabulary."""
    width = int(target.config.hidden_size)
    if head.config.vocab_size != target.vocab_size or head.config.hidden_size != width:
        raise VerispecError(f"the Medusa heads were trained for {head.config.target or 'another target'!r} "
                            f"({head.config.vocab_size} tokens, width {head.config.hidden_size}); "
                            f"{getattr(target, 'name', target)!r} has {target.vocab_size} tokens, width {width}: "
                            "use them with their own target")


def _medusa_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """The Medusa repository's head weights, named as `MedusaHead` names them (its files hold the state dict
    of the `medusa_head` module list itself, or of a model around it)."""
    path = next(directory / name for name in MEDUSA_FILES if (directory / name).is_file())
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        tensors = load_file(str(path))
    else:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    named = {}
    for name, tensor in tensors.items():
        name = name[name.index("medusa_head."):] if "medusa_head." in name else "medusa_head." + name
        named[name] = tensor
    return named


def _medusa_config(data: dict, tensors: dict[str, torch.Tensor]) -> MedusaConfig:
    """A MedusaConfig for the Medusa repository's config.json, sizes read from the LM head weights."""
    heads, layers = int(data["medusa_num_heads"]), int(data.get("medusa_num_layers", 1))
    lm_head = tensors.get(f"medusa_head.0.{layers}.weight")
    if lm_head is None:
        raise VerispecError(f"Medusa weights without medusa_head.0.{layers}.weight: not {heads} heads of {layers} blocks")
    vocab, hidden = lm_head.shape
    return MedusaConfig(hidden_size=int(hidden), vocab_size=int(vocab), draft_vocab_size=int(vocab), num_heads=heads,
                        num_layers=layers, target=str(data.get("base_model_name_or_path") or ""))
