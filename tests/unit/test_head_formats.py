"""EAGLE-3 heads in other engines' layouts: export to speculators (vLLM) and SpecForge (SGLang), read back,
and the real consumer (the `speculators` package) loading verispec's export.

A tiny random head on an 8-layer random target: the contracts are names, config fields, tap ids and
bitwise-equal tensors, so nothing needs training.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_llama
import verispec
from verispec.cli import main
from verispec.errors import VerispecError
from verispec.heads import load_head
from verispec.heads.eagle3 import Eagle3Config, Eagle3Head, save_head
from verispec.heads.formats import export_head
from verispec.models.native import NativeCausalLM

TAPS = (2, 4, 5)  # EAGLE-3's (2, N/2, N-3) for 8 layers, as inputs of those layers
DRAFT_VOCAB = 64  # of the tiny models' 96 tokens
PROMPT = [1, 5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 12]
LAYER_NAMES = ["input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
               "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]


@pytest.fixture(scope="module")
def tiny_hf():
    return tiny_llama(seed=0, layers=8)


@pytest.fixture(scope="module")
def target(tiny_hf):
    return NativeCausalLM.from_hf(tiny_hf)


def random_head(target, draft_vocab: int = DRAFT_VOCAB, taps=TAPS, seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(target, draft_vocab, taps))
    for parameter in head.parameters():  # norms start at one: make every tensor tell
        parameter.data.normal_(0, 0.3)
    head.set_draft_vocab(torch.arange(target.vocab_size)[torch.randperm(target.vocab_size)[:draft_vocab]])
    return head


@pytest.fixture(scope="module")
def head_dir(target, tmp_path_factory):
    return save_head(random_head(target), tmp_path_factory.mktemp("head") / "native")


def assert_same_head(a: Eagle3Head, b: Eagle3Head, target) -> None:
    """Equal tensors, equal taps, and the same draft logits on the same taps and tokens."""
    assert a.state_dict().keys() == b.state_dict().keys()
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
    assert a.config.taps == b.config.taps
    a.bind(target.embed), b.bind(target.embed)
    taps, tokens = torch.randn(2, 9, len(TAPS) * target.hidden_size), torch.randint(0, target.vocab_size, (2, 12))
    with torch.no_grad():
        for x, y in zip(a.unroll(taps, tokens, 3), b.unroll(taps, tokens, 3)):
            assert torch.equal(x, y)


def test_speculators_export_has_vllm_names_and_fields(head_dir, tmp_path):
    out = export_head(head_dir, tmp_path / "spec", to="speculators")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["eagle_aux_hidden_state_layer_ids"] == list(TAPS)  # vLLM taps layer inputs, as verispec
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["norm_before_residual"] is False
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == 96
    assert layer["rope_parameters"]["rope_theta"] == layer["rope_theta"]
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["proposal_type"] == "greedy" and set(spec["verifier"]) == {"name_or_path", "architectures"}
    tensors = load_file(str(out / "model.safetensors"))
    native = load_file(str(head_dir / "model.safetensors"))
    assert set(tensors) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {f"layers.0.{n}" for n in LAYER_NAMES}
    for name, tensor in tensors.items():
        assert torch.equal(tensor, native[name.replace("layers.0.", "midlayer.")]), name
    assert tensors["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * layer["hidden_size"]  # q/k/v read 2H


def test_specforge_export_counts_taps_one_less(head_dir, tmp_path):
    out = export_head(head_dir, tmp_path / "sf", to="specforge")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and "verispec" not in config
    # SpecForge and SGLang name the layer whose output is tapped: the input of layer i is layer i-1's output
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [t - 1 for t in TAPS]
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["num_hidden_layers"] == 1
    assert set(load_file(str(out / "model.safetensors"))) == set(load_file(str(head_dir / "model.safetensors")))


@pytest.mark.parametrize("to", ["speculators", "specforge"])
def test_round_trip_keeps_tensors_taps_and_drafts(head_dir, target, tmp_path, to):
    out = export_head(head_dir, tmp_path / to, to=to)
    native, back = load_head(head_dir), load_head(out, target)
    assert_same_head(native, back, target)
    # and back again: exporting the foreign copy gives the same file
    again = export_head(out, tmp_path / "again", to=to)
    assert load_file(str(again / "model.safetensors")).keys() == load_file(str(out / "model.safetensors")).keys()
    assert_same_head(native, load_head(again), target)
    # the engine drafts with it by path, the same tokens and the same accepted drafts as the native head
    assert isinstance(verispec.load(str(out)), Eagle3Head)
    plain = verispec.generate(target, PROMPT, drafter="none", max_new_tokens=12).token_ids
    ours = verispec.generate(target, PROMPT, head=str(head_dir), drafter="eagle3", draft_len=3, max_new_tokens=12)
    theirs = verispec.generate(target, PROMPT, head=str(out), drafter="eagle3", draft_len=3, max_new_tokens=12)
    assert theirs.token_ids == ours.token_ids == plain
    assert theirs.stats.accepted_tokens == ours.stats.accepted_tokens


def test_a_specforge_checkpoint_as_specforge_writes_it(head_dir, target, tmp_path):
    """SpecForge's own files: a flat transformers-4 config (rope_theta, no head_dim), eagle_config ids
    counting layer outputs, bfloat16, and the target's embedding saved beside the head."""
    from safetensors.torch import save_file

    native = load_head(head_dir)
    c = native.config
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
              "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
              "rope_scaling": None, "rope_theta": c.rope_theta, "vocab_size": c.vocab_size, "torch_dtype": "bfloat16",
              "draft_vocab_size": c.draft_vocab_size, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}
    tensors = {name: tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
               for name, tensor in native.state_dict().items()}
    tensors["embed_tokens.weight"] = target.embed.to(torch.bfloat16)
    (tmp_path / "sf").mkdir()
    save_file(tensors, str(tmp_path / "sf" / "model.safetensors"))
    (tmp_path / "sf" / "config.json").write_text(json.dumps(config))
    head = load_head(tmp_path / "sf", target)
    assert head.config.taps == TAPS and head.config.head_dim == c.head_dim and head.config.rope_theta == c.rope_theta
    assert head.fc.weight.dtype == torch.float32
    for name, tensor in native.state_dict().items():
        expected = tensor.to(torch.bfloat16).to(tensor.dtype) if tensor.is_floating_point() else tensor
        assert torch.equal(head.state_dict()[name], expected), name


def test_full_draft_vocabulary_has_no_maps_in_foreign_files(target, tmp_path):
    head = random_head(target, draft_vocab=target.vocab_size)
    save_head(head, tmp_path / "full")
    for to in ("speculators", "specforge"):
        out = export_head(tmp_path / "full", tmp_path / to, to=to)
        assert not {"d2t", "t2d"} & set(load_file(str(out / "model.safetensors")))  # as speculators/SpecForge save it
        back = load_head(out)
        assert not back.d2t.any() and bool(back.t2d.all())
        assert_same_head(load_head(tmp_path / "full"), back, target)


def test_foreign_head_without_tap_ids_takes_the_targets_defaults(head_dir, target, tmp_path):
    out = export_head(head_dir, tmp_path / "sf", to="specforge")
    config = json.loads((out / "config.json").read_text())
    del config["eagle_config"]  # as SpecForge's own configs often are: SGLang then taps (2, N/2, N-3)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(VerispecError, match="load it with its target"):
        load_head(out)
    assert load_head(out, target).config.taps == (2, 4, 5)


@pytest.mark.parametrize("change, message", [
    ({"norm_before_residual": True}, "norm_before_residual"),
    ({"fc_norm": True}, "fc_norm"),
    ({"transformer_layer_config": {"model_type": "qwen3"}}, "qwen3"),
    ({"transformer_layer_config": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}}, "rope"),
])
def test_variants_the_head_cannot_compute_are_refused(head_dir, tmp_path, change, message):
    out = export_head(head_dir, tmp_path / "spec", to="speculators")
    config = json.loads((out / "config.json").read_text())
    for key, value in change.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(VerispecError, match=message):
        load_head(out)


def test_unknown_format_and_foreign_config_are_refused(head_dir, tmp_path):
    with pytest.raises(VerispecError, match="speculators, specforge"):
        export_head(head_dir, tmp_path / "x", to="gguf")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "other" / "model.safetensors").write_bytes(b"")
    with pytest.raises(VerispecError, match="not a draft head"):
        load_head(tmp_path / "other")


def test_cli_export(head_dir, tmp_path, capsys):
    assert main(["export", str(head_dir), "--to", "specforge", "--out", str(tmp_path / "sf")]) == 0
    assert "specforge head written" in capsys.readouterr().out
    assert (tmp_path / "sf" / "config.json").is_file() and (tmp_path / "sf" / "model.safetensors").is_file()
    assert main(["export", str(tmp_path / "sf"), "--to", "speculators", "--out", str(tmp_path / "spec"),
                 "--verifier", "org/target"]) == 0
    assert json.loads((tmp_path / "spec" / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == "org/target"
    with pytest.raises(SystemExit):
        main(["export", str(head_dir), "--to", "gguf", "--out", str(tmp_path / "x")])
    assert main(["export", str(tmp_path), "--to", "speculators", "--out", str(tmp_path / "x")]) == 2
    assert "not a draft head" in capsys.readouterr().err


# --- the real consumer ----------------------------------------------------------------------------------

def test_speculators_package_loads_the_export(head_dir, tiny_hf, target, tmp_path):
    """vLLM's own format library reads verispec's export with its config and model classes: same tensors,
    same tap ids, and its Eagle3 forward gives our head's logits."""
    try:
        from speculators import SpeculatorModel
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    except ImportError as exc:
        pytest.skip(f"the speculators package is not importable ({exc}); .ci/run installs it")
    tiny_hf.model.save_pretrained(tmp_path / "target")  # the verifier: it checks the tap ids against its layers
    out = export_head(head_dir, tmp_path / "spec", to="speculators", verifier=str(tmp_path / "target"))
    model = SpeculatorModel.from_pretrained(str(out))
    assert isinstance(model, Eagle3DraftModel) and isinstance(model.config, Eagle3SpeculatorConfig)
    assert list(model.config.eagle_aux_hidden_state_layer_ids) == list(TAPS)
    assert model.config.draft_vocab_size == DRAFT_VOCAB and model.config.norm_before_residual is False
    ours = load_head(head_dir)
    theirs = model.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, theirs[name.replace("midlayer.", "layers.0.")]), name
    # one training-time-test step of their forward is our head's first step (they align tokens with taps)
    model.embed_tokens.weight.data.copy_(target.embed)  # the target's embedding, shared as verispec shares it
    model._attn_impl, model._create_mask_fn = "eager", _float_mask()  # eager: flex attention would compile
    for layer in model.layers:
        layer.self_attn.config._attn_implementation = "eager"
    logits = []
    model.lm_head.register_forward_hook(lambda module, inputs, output: logits.append(output))
    ours.bind(target.embed)
    tokens = torch.tensor([PROMPT])
    _, taps = target.forward(tokens, target.new_cache(1), taps=TAPS)
    width = len(PROMPT) - 1
    with torch.no_grad():
        expected = ours.unroll(taps[:, :width], tokens, 1)[0]  # [1, width, V]: position t beside token t+1
        model.eval()(taps[:, :width], tokens[:, 1:], torch.zeros(1, width, dtype=torch.long), ttt_steps=1)
    torch.testing.assert_close(logits[0], expected, rtol=1e-5, atol=1e-5)


def _float_mask():
    from speculators.models.attention import create_float_mask

    return create_float_mask


def test_our_config_names_taps_in_each_convention():
    """verispec's own config.json: the top-level ids count layer inputs (vLLM, llama.cpp, ours); the nested
    eagle_config ids, which SGLang reads, count the tapped layer's output (one less)."""
    from verispec.heads.eagle3 import Eagle3Config

    config = Eagle3Config(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                          vocab_size=32, draft_vocab_size=16, taps=(2, 4, 5))
    data = config.to_json()
    assert data["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] == data["verispec"]["taps"]
    assert data["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert Eagle3Config.from_json(data).taps == (2, 4, 5)
    at_zero = Eagle3Config(**{**config.__dict__, "taps": (0, 2, 3)}).to_json()
    assert "eagle_config" not in at_zero  # no output-counted id for the embedding
