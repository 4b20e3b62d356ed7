"""EAGLE-3 heads in other engines' files: export a verispec head for vLLM or SGLang, read heads trained there.

A head is the same network everywhere (fc, one decoder layer whose q/k/v read [embedding, hidden], norm,
lm_head, d2t/t2d); the engines differ in three things, and this module converts all three:

    format       who reads it                       config.json                          decoder layer tensors
    verispec     verispec (save_head)               LlamaForCausalLMEagle3 + "verispec"   midlayer.*
    speculators  vLLM (--speculative-config model)  speculators_model_type "eagle3",      layers.0.*
                 llama.cpp convert_hf_to_gguf.py     transformer_layer_config (a Llama)
    specforge    SGLang, SpecForge                   LlamaForCausalLMEagle3, flat Llama    midlayer.*

Tap layer ids. Every engine taps the same residual stream, but counts its layers differently by one:

- verispec: `taps` are the *inputs* of those target layers, i.e. transformers' `hidden_states[i]`
  (tests/exactness/test_heads.py checks this against transformers). Default (2, N/2, N-3).
- vLLM and speculators: the same. `eagle_aux_hidden_state_layer_ids` (top level of config.json, read by
  vllm/transformers_utils/configs/speculators/algos.py `update_eagle3` and
  vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py `get_eagle3_aux_layers_from_config`); the target
  appends `hidden_states + residual` *before* running layer idx (vllm/model_executor/models/llama.py,
  `if idx in self.aux_hidden_state_layers`), so id i is the input of layer i; default (2, N//2, N-3)
  (speculators/models/utils.py `resolve_target_layer_ids`, which also allows i = N, the last layer's output).
- llama.cpp: the same. convert_hf_to_gguf.py (conversion/llama.py) copies the top-level
  `eagle_aux_hidden_state_layer_ids` (else [2, N//2, N-3]) into `target_layers`; common/speculative.cpp
  turns on `llama_set_embeddings_layer_inp(ctx_tgt, id)`, the tensor a model graph stores as
  `t_layer_inp[il] = inpL` before layer il (src/models/llama.cpp).
- SpecForge and SGLang: one less. `eagle_config.eagle_aux_hidden_state_layer_ids` (nested) names the
  layers whose *output* is tapped: SpecForge's HF backend hooks the output of `layers[idx]`
  (specforge/modeling/target/eagle3_target_model.py, default [1, N//2 - 1, N - 4]), and SGLang adds one
  ("we plus 1 here because in sglang, for the ith layer, it takes the output of the (i-1)th layer",
  `set_eagle3_layers_to_capture` in python/sglang/srt/models/llama.py). With no eagle_config, SGLang
  captures the inputs of [2, N//2, N-3]: the same tensors as SpecForge's default.

So verispec tap i is speculators id i and SpecForge id i - 1; export and import convert, and a head reads
the same tensors in every engine.

Other differences handled here: vLLM assumes `norm_before_residual: true` when a speculators config omits
it (the speculators library's default is false), so exports always write it; speculators and SpecForge
drop d2t/t2d when the draft vocabulary is the target's (read back as the identity); their checkpoints may
carry the target's embedding (`embed_tokens.weight`), which verispec never needs. Variants this head's
math does not compute (norm_before_residual, norm_before_fc, fc_norm, norm_output, a Qwen3 layer with
q/k norms, biases, scaled rope) are refused with a clear error, never loaded wrong.

The module knows nothing about training or drafting: it moves tensors and config fields between layouts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from verispec.errors import VerispecError
from verispec.heads.eagle3 import ARCHITECTURE, Eagle3Config, Eagle3Head, default_taps
from verispec.heads.files import CONFIG_FILE, WEIGHTS_FILE, write_head

FORMATS = ("speculators", "specforge")
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"  # speculators' Eagle3SpeculatorConfig default
SPECULATORS_ARCHITECTURES = (SPECULATORS_ARCHITECTURE, "Eagle3DraftModel")  # the latter: its save_pretrained
DEFAULT_SPECULATIVE_TOKENS = 3  # vLLM's num_speculative_tokens when a head does not say how it was trained

# The speculators variants whose math differs from this head's; all must be false to load.
_SPECULATORS_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
# Tensors other engines keep beside the head that the head does not use.
_IGNORED = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")


def format_of(config: dict) -> str:
    """Which layout a head's config.json is in: "verispec", "speculators" or "specforge"."""
    if "verispec" in config:
        return "verispec"
    if config.get("speculators_model_type") == "eagle3":
        return "speculators"
    if ARCHITECTURE in (config.get("architectures") or []):
        return "specforge"
    raise VerispecError(f"config.json describes {config.get('architectures')}, not an EAGLE-3 head "
                        "(verispec, speculators or SpecForge layout)")


# --- export ---------------------------------------------------------------------------------------------

def export_head(head_dir: str | Path, out_dir: str | Path, to: str, verifier: str | None = None) -> Path:
    """Write the head in `head_dir` (any layout load_head reads) into `out_dir` in format `to`
    ("speculators" for vLLM and llama.cpp, "specforge" for SGLang): config.json and model.safetensors.

    verifier: the target's Hugging Face id or directory, recorded in a speculators config (vLLM ignores
    it; the speculators library reads the target's layer count from it). Default: the head's target when
    that is a directory or a hub id, else none. Returns out_dir."""
    if to not in FORMATS:
        raise VerispecError(f"unknown head format {to!r}: use one of {', '.join(FORMATS)}")
    head = load_head(head_dir)
    config = head.config
    tensors = dict(head.state_dict())
    if _identity_vocab(head):  # the others keep no vocabulary maps for a full draft vocabulary
        del tensors["d2t"], tensors["t2d"]
    if to == "speculators":
        tensors = {_rename(name, "midlayer.", "layers.0."): tensor for name, tensor in tensors.items()}
        data = _speculators_config(config, verifier)
    else:
        data = _specforge_config(config)
    return write_head(out_dir, tensors, data)


def _layer_config(config: Eagle3Config) -> dict:
    """The one decoder layer as a transformers LlamaConfig dict (rope both ways: transformers 4 reads
    rope_theta, 5 reads rope_parameters)."""
    return {
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,  # the target's: speculators reads the target vocabulary here
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }


def _speculators_config(config: Eagle3Config, verifier: str | None) -> dict:
    """speculators' Eagle3SpeculatorConfig (speculators/models/eagle3/config.py) as its save writes it."""
    verifier = verifier if verifier is not None else _verifier_name(config.target)
    steps = int((config.extra.get("train") or {}).get("ttt_steps") or DEFAULT_SPECULATIVE_TOKENS)
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": _layer_config(config),
        "draft_vocab_size": config.draft_vocab_size,
        "norm_before_residual": False,  # explicit: vLLM assumes true when it is missing
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "target_hidden_size": None,  # the target's hidden size is the head's
        "eagle_aux_hidden_state_layer_ids": list(config.taps),  # inputs of these layers, as ours
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": "float32",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": steps,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": _verifier_architectures(verifier, config.target)},
        },
    }


def _specforge_config(config: Eagle3Config) -> dict:
    """SpecForge's draft config (its configs/*-eagle3.json): a flat one-layer Llama, architecture
    LlamaForCausalLMEagle3, draft_vocab_size, and the taps as SpecForge/SGLang count them (one less)."""
    if min(config.taps) < 1:
        raise VerispecError(f"tap {min(config.taps)} (the embedding output) has no SpecForge/SGLang id: they name "
                            "the layer whose output is tapped; export this head with --to speculators")
    data = {"architectures": [ARCHITECTURE], **_layer_config(config)}
    data.update({"draft_vocab_size": config.draft_vocab_size, "torch_dtype": "float32",
                 "eagle_config": {"eagle_aux_hidden_state_layer_ids": [tap - 1 for tap in config.taps]}})
    return data


def _verifier_name(target: str) -> str | None:
    """The head's target as something Hugging Face can load: a directory or an "org/name" id, else None."""
    if target and (Path(target).expanduser().is_dir() or (target.count("/") == 1 and not target.startswith((".", "/")))):
        return target
    return None


def _verifier_architectures(verifier: str | None, target: str) -> list[str]:
    """The target's architectures from its config.json: the verifier directory's, or the zoo's converted copy."""
    from verispec import zoo

    candidates = [Path(verifier).expanduser()] if verifier else []
    if target in zoo.ZOO:
        candidates.append(zoo.local_path(target) / "hf")
    for directory in candidates:
        try:
            return list(json.loads((directory / CONFIG_FILE).read_text()).get("architectures") or [])
        except (OSError, ValueError):
            continue
    return []


# --- import ---------------------------------------------------------------------------------------------

def load_head(directory: str | Path, target=None) -> Eagle3Head:
    """Any EAGLE-3 head: verispec's own layout (`eagle3.load_head`), or a speculators or SpecForge one,
    converted (`load_foreign`)."""
    from verispec.heads.eagle3 import load_head as load_ours

    try:
        data = json.loads((Path(directory).expanduser() / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        data = {"verispec": {}}  # let load_ours say what is missing
    return load_ours(directory, target) if "verispec" in data else load_foreign(directory, data, target)


def load_foreign(directory: str | Path, data: dict, target=None) -> Eagle3Head:
    """A head trained elsewhere (speculators or SpecForge layout, config.json already read into `data`),
    converted to verispec's names and tap ids; in eval mode, bound to `target` when given. Used by
    load_head; `target` also supplies the default taps when the config names none."""
    from safetensors.torch import load_file

    from verispec.heads.eagle3 import target_embedding

    directory = Path(directory)
    kind = format_of(data)
    config = _speculators_to_config(data, target, directory) if kind == "speculators" else _specforge_to_config(data, target, directory)
    tensors = load_file(str(directory / WEIGHTS_FILE))
    for name in _IGNORED:
        tensors.pop(name, None)
    tensors = {_rename(name, "layers.0.", "midlayer."): tensor for name, tensor in tensors.items()}
    if "d2t" not in tensors and "t2d" not in tensors:  # a full draft vocabulary: the identity map
        if config.draft_vocab_size != config.vocab_size:
            raise VerispecError(f"{directory}/{WEIGHTS_FILE} has no d2t/t2d, but its draft vocabulary ({config.draft_vocab_size}) "
                                f"is smaller than the target's ({config.vocab_size}): the head's file is incomplete")
        tensors["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        tensors["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    head = Eagle3Head(config)
    tensors = {name: tensor.to(head.state_dict()[name].dtype) if name in head.state_dict() else tensor
               for name, tensor in tensors.items()}
    missing, unexpected = head.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise VerispecError(f"{directory}/{WEIGHTS_FILE} ({kind} layout) does not fit an EAGLE-3 head of its config: "
                            f"missing {missing}, unexpected {unexpected}")
    head.eval()
    if target is not None:
        head.bind(target_embedding(target))
    return head


def _speculators_to_config(data: dict, target, directory: Path) -> Eagle3Config:
    layer = data.get("transformer_layer_config") or {}
    if (layer.get("model_type") or "llama") != "llama":
        raise VerispecError(f"{directory}: a {layer.get('model_type')!r} decoder layer (speculators); verispec's EAGLE-3 head "
                            "is a Llama layer: retrain with a llama transformer_layer_config")
    on = [flag for flag in _SPECULATORS_FLAGS if data.get(flag)]
    if on:
        raise VerispecError(f"{directory}: this speculators head sets {', '.join(on)}, a variant verispec's EAGLE-3 head "
                            "does not compute; it cannot draft here")
    verifier = ((data.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    taps = data.get("eagle_aux_hidden_state_layer_ids")  # inputs of these layers, as ours
    if not taps:
        taps = default_taps(_target_layers(target, verifier, directory))
    config = _layer_to_config(layer, data, taps, directory)
    return _with_target(config, target, verifier or "")


def _specforge_to_config(data: dict, target, directory: Path) -> Eagle3Config:
    ids = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    # SpecForge/SGLang name the layer whose output is tapped: our tap (an input) is one more
    taps = [i + 1 for i in ids] if ids else default_taps(_target_layers(target, None, directory))
    return _with_target(_layer_to_config(data, data, taps, directory), target, "")


def _layer_to_config(layer: dict, data: dict, taps, directory: Path) -> Eagle3Config:
    """Eagle3Config from a one-layer Llama config dict `layer` and the head's own fields in `data`."""
    if int(layer.get("num_hidden_layers") or 1) != 1:
        raise VerispecError(f"{directory}: a {layer['num_hidden_layers']}-layer EAGLE-3 draft; verispec's head has one layer")
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        raise VerispecError(f"{directory}: the head's layer has biases; verispec's EAGLE-3 head has none")
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise VerispecError(f"{directory}: the head uses {rope.get('rope_type', rope.get('type'))!r} rope scaling; "
                            "verispec's EAGLE-3 head rotates with plain rope")
    hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
    if data.get("target_hidden_size") not in (None, hidden):
        raise VerispecError(f"{directory}: target_hidden_size {data['target_hidden_size']} differs from the head's "
                            f"{hidden}; verispec's EAGLE-3 head reads taps as wide as itself")
    vocab = int(layer["vocab_size"])
    return Eagle3Config(
        hidden_size=hidden, intermediate_size=int(layer["intermediate_size"]), num_attention_heads=heads,
        num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads), vocab_size=vocab,
        draft_vocab_size=int(data.get("draft_vocab_size") or vocab), taps=tuple(int(i) for i in taps),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta") or layer.get("rope_theta") or 10000.0),
        max_position_embeddings=int(layer.get("max_position_embeddings") or 32768))


def _with_target(config: Eagle3Config, target, verifier: str) -> Eagle3Config:
    """Record which target the head is for: the one given, else the verifier the file names."""
    if target is not None:
        config.target = str(getattr(target, "name", "") or verifier)
        config.target_num_layers = int(getattr(target.config, "num_hidden_layers", 0) or 0)
    else:
        config.target = verifier
    return config


def _target_layers(target, verifier: str | None, directory: Path) -> int:
    """The target's layer count, for the default taps: from the target, or the verifier's local config.json."""
    if target is not None and getattr(getattr(target, "config", None), "num_hidden_layers", None):
        return int(target.config.num_hidden_layers)
    if verifier and (Path(verifier).expanduser() / CONFIG_FILE).is_file():
        data = json.loads((Path(verifier).expanduser() / CONFIG_FILE).read_text())
        return int((data.get("text_config") or data)["num_hidden_layers"])
    raise VerispecError(f"{directory}/{CONFIG_FILE} names no tap layers (eagle_aux_hidden_state_layer_ids), so they are the "
                        "target's defaults (2, N/2, N-3): load it with its target (verispec.load_head(DIR, target)), or "
                        "write the ids into config.json")


def _identity_vocab(head: Eagle3Head) -> bool:
    return head.config.draft_vocab_size == head.config.vocab_size and not bool(head.d2t.any())


def _rename(name: str, old: str, new: str) -> str:
    return new + name[len(old):] if name.startswith(old) else name


# --- the command ----------------------------------------------------------------------------------------

def add_export_arguments(p) -> None:
    p.add_argument("head", metavar="HEAD_DIR", help="a trained head's directory (verispec, speculators or SpecForge layout)")
    p.add_argument("--to", required=True, choices=FORMATS,
                   help="speculators: vLLM (--speculative-config) and llama.cpp's converter; specforge: SGLang")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write config.json and model.safetensors into")
    p.add_argument("--verifier", default=None,
                   help="the target's Hugging Face id or directory, recorded in a speculators config (default: the head's target)")


def run_export(args) -> int:
    out = export_head(args.head, args.out, args.to, verifier=args.verifier)
    print(f"verispec: {args.to} head written to {out}")
    return 0
