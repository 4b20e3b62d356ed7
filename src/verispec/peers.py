"""llama.cpp as a peer: its own `llama-completion` binary run on the same GGUF file and prompt.

A CPU user's yardstick is llama.cpp's plain decoding of the file they already have, so `verispec bench
--peer llama.cpp` times it beside verispec in the same run. The binary is llama.cpp's, built from the
sources the `llama-cpp-python` sdist vendors (bench/peers/build_llama_cpp.sh; no other route to
llama.cpp exists on a machine whose only network is PyPI). It is timed by its own counters (prompt eval
+ eval, what `llama_perf_context_print` reports), so its model load and warm-up are not charged to it,
as verispec's load is not charged to verispec.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from verispec.errors import VerispecError

BUILD_HINT = "build it with `bash bench/peers/build_llama_cpp.sh` (~10 min) or point VERISPEC_LLAMA_CPP at its bin/ folder"

_PROMPT = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
_EVAL = re.compile(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs")
_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")  # llama-speculative-simple
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
_ACCEPTED = re.compile(r"n_accept\s*=\s*(\d+)")


@dataclass
class PeerRun:
    """One completion by the peer: its text and its own timings."""

    text: str
    prompt_tokens: int  # as the peer counted them: a check that both read the same prompt
    new_tokens: int
    prompt_seconds: float
    decode_seconds: float
    drafted: int = 0  # speculative runs: draft tokens proposed and accepted
    accepted: int = 0

    @property
    def seconds(self) -> float:
        """Prompt prefill plus decoding, as verispec's end-to-end time counts them."""
        return self.prompt_seconds + self.decode_seconds


def _run(binary: Path, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run one of llama.cpp's tools to the end; a failure is a VerispecError quoting the end of its log."""
    done = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise VerispecError(f"{binary.name} failed (exit {done.returncode}): {tail}")
    return done


def default_bin_dir() -> Path:
    home = Path(os.environ.get("VERISPEC_HOME") or Path.home() / ".cache" / "verispec")
    return home / "peers" / "llama.cpp" / "build" / "bin"


class LlamaCpp:
    """llama.cpp's `llama-completion`: greedy completions of raw prompts (no chat template: a chat prompt
    is passed already rendered, special tokens and all, as verispec renders it)."""

    name = "llama.cpp"

    def __init__(self, bin_dir: str | os.PathLike | None = None):
        where = Path(bin_dir or os.environ.get("VERISPEC_LLAMA_CPP") or default_bin_dir())
        self.binary = where / "llama-completion"
        self.speculative_binary = where / "llama-speculative-simple"
        if not self.binary.is_file():
            found = shutil.which("llama-completion")
            if bin_dir is None and found:
                self.binary = Path(found)
            else:
                raise VerispecError(f"llama.cpp's llama-completion is not at {where}: {BUILD_HINT}")

    def complete(self, gguf: str | os.PathLike, prompt: str, max_new_tokens: int, threads: int,
                 timeout: float = 600.0) -> PeerRun:
        """Greedy completion of `prompt` (text) by the GGUF file, `threads` threads, at most `max_new_tokens`
        new tokens (fewer at an end-of-generation token, as verispec stops)."""
        # -p with --no-escape: the prompt as it is (-f drops a final newline, escapes are processed by default)
        done = _run(self.binary, ["-m", str(gguf), "-p", prompt, "--no-escape", "-n", str(max_new_tokens), "-t", str(threads),
                                  "-tb", str(threads), "--temp", "0", "--top-k", "1", "-no-cnv", "--no-display-prompt",
                                  "-c", "4096", "--seed", "0"], timeout)
        prompt_match, eval_match = _PROMPT.search(done.stderr), _EVAL.search(done.stderr)
        if not (prompt_match and eval_match):
            raise VerispecError("llama-completion printed no timings (an unexpected llama.cpp version?)")
        runs = int(eval_match.group(2))
        # eval runs: every generated token after the first, which the prompt's pass samples
        return PeerRun(text=done.stdout, prompt_tokens=int(prompt_match.group(2)), new_tokens=runs + 1,
                       prompt_seconds=float(prompt_match.group(1)) / 1000, decode_seconds=float(eval_match.group(1)) / 1000)

    def speculative(self, gguf: str | os.PathLike, draft_gguf: str | os.PathLike, prompt: str, max_new_tokens: int,
                    threads: int, draft_max: int = 16, timeout: float = 600.0) -> PeerRun:
        """Greedy speculative completion by llama.cpp's `llama-speculative-simple`: `draft_gguf` drafts up to
        `draft_max` tokens a step for `gguf` (llama.cpp's own draft-model speculation, its defaults otherwise)."""
        if not self.speculative_binary.is_file():
            raise VerispecError(f"llama.cpp's llama-speculative-simple is not at {self.speculative_binary.parent}: {BUILD_HINT}")
        done = _run(self.speculative_binary,
                    ["-m", str(gguf), "-md", str(draft_gguf), "--spec-type", "draft-simple", "-p", prompt, "--no-escape",
                     "-n", str(max_new_tokens), "-t", str(threads), "-tb", str(threads), "-td", str(threads),
                     "--temp", "0", "--top-k", "1", "-c", "4096", "--spec-draft-n-max", str(draft_max), "--seed", "0"], timeout)
        log = done.stderr + done.stdout
        encoded, decoded = _ENCODED.search(log), _DECODED.search(log)
        if not (encoded and decoded):
            raise VerispecError("llama-speculative-simple printed no timings (an unexpected llama.cpp version?)")
        drafted, accepted = _DRAFTED.search(log), _ACCEPTED.search(log)
        return PeerRun(text=done.stdout, prompt_tokens=int(encoded.group(1)), new_tokens=int(decoded.group(1)),
                       prompt_seconds=float(encoded.group(2)), decode_seconds=float(decoded.group(2)),
                       drafted=int(drafted.group(1)) if drafted else 0, accepted=int(accepted.group(1)) if accepted else 0)
