"""Training features for a draft head: the target's hidden-state taps and its next-token distribution,
computed by prefill over training text and cached in shard files.

What text. This machine has no internet beyond PyPI, so the data is what ships with it:
- `site-packages` (the default): Python source files of the installed packages, code and docstrings
  together, read in a fixed order. It is what a coding target writes, it is plentiful (hundreds of MB),
  and it overlaps none of the benchmark prompts, so acceptance measured on them is not inflated;
- files given with `--data`: `.jsonl` prompt sets (`prompt`, `turns` or `text` fields: e.g. the dev halves
  of Spec-Bench and HumanEval in ../shared/data; `turns` are read through the chat template, as the bench
  and the server read instructions), or plain text / source files, or directories of them.
  Training on the prompts one later benchmarks overstates acceptance there; the extraction says so;
- `site-packages-prompts[:N]`: N prompts (default 1000) shaped like HumanEval's, cut from the same sources (a
  module's imports, one of its functions' signature and docstring: `corpus.function_prompts`); read as code
  prompts, so with self-distillation each is followed by the target's own answer: what the target writes when
  asked for code, which the benchmark's coding prompts ask of a head;
- self-distillation (`self_distill=True`, for prompt sets): the target's own greedy answers to the
  prompts are appended to them, so the head learns what the target says rather than what a human wrote
  (EAGLE and SpecForge regenerate their data this way). It costs one greedy generation per prompt.

What is stored, per sequence of `seq_len` tokens (shards of `shard_sequences` sequences, safetensors):
`tokens` [N, T] int32, `taps` [N, T, len(taps) * H] float16 (the inputs of the tapped layers), and the
target's top-`top_k` next-token log-probabilities over its full vocabulary, `top_ids` [N, T, K] int32 and
`top_logprobs` [N, T, K] float16; a head's draft vocabulary is chosen later, from these files. A shard is
written under a temporary name and renamed when complete, so an interrupted run resumes at the first
missing shard (self-distilled answers are kept in `answers.jsonl`, so it does not decode them again);
`manifest.json` pins the target, taps, sequence length and sources the shards belong to.

The module knows nothing about the head or its training.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from verispec.corpus import function_prompts, site_packages_files
from verispec.errors import VerispecError

MANIFEST = "manifest.json"
PROMPTS_SOURCE = "site-packages-prompts"  # function prompts cut from the installed sources (see the module doc)
ANSWERS = "answers.jsonl"  # self-distilled answers, kept for resumed runs


@dataclass
class FeatureSpec:
    """What a feature directory holds; a directory made for another spec is not reused."""

    target: str
    taps: tuple[int, ...]
    seq_len: int = 256
    top_k: int = 32
    shard_sequences: int = 16
    sources: tuple[str, ...] = ("site-packages",)
    self_distill: bool = False
    max_new_tokens: int = 192  # per prompt, when self-distilling
    numerics: str = "float32"  # the target's (CausalLM.numerics): a q8 target's features are its own

    def to_json(self) -> dict:
        data = asdict(self)
        data["taps"], data["sources"] = list(self.taps), list(self.sources)
        return data


TEXT, CODE_PROMPT, CHAT_PROMPT = "text", "code", "chat"  # what a document is, for how it is tokenized


def _prompt_texts(path: Path) -> list[tuple[str, str]]:
    """(text, kind) of a .jsonl prompt set: `turns` are instructions (read through the chat template, as
    the bench and the server read them), `prompt` / `text` are text to continue."""
    texts = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        for key in ("prompt", "text"):
            if isinstance(row.get(key), str):
                texts.append((row[key], CODE_PROMPT))
        texts.extend((t, CHAT_PROMPT) for t in row.get("turns", []) if isinstance(t, str))
    return texts


def documents(sources: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    """(text, kind) for each document of the sources, in a fixed order. A source is "site-packages",
    "site-packages-prompts[:N]", a .jsonl prompt file, a text file, or a directory of them; kind is TEXT,
    CODE_PROMPT or CHAT_PROMPT."""
    for source in sources:
        if source == "site-packages":
            for path in site_packages_files():
                try:
                    yield path.read_text(errors="ignore"), TEXT
                except OSError:
                    continue
            continue
        name, _, count = source.partition(":")
        if name == PROMPTS_SOURCE:
            if count and not count.isdigit():
                raise VerispecError(f"training data {source!r}: give {PROMPTS_SOURCE} or {PROMPTS_SOURCE}:N (a count)")
            yield from ((text, CODE_PROMPT) for text in function_prompts(int(count or 1000)))
            continue
        path = Path(source).expanduser()
        if not path.exists():
            raise VerispecError(f"training data {source!r} does not exist: give site-packages, a .jsonl prompt file, "
                                "a text file or a directory")
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if not file.is_file():
                continue
            if file.suffix == ".jsonl":
                yield from _prompt_texts(file)
            else:
                yield file.read_text(errors="ignore"), TEXT


def token_sequences(target, spec: FeatureSpec, answers: "AnswerCache | None" = None) -> Iterator[list[int]]:
    """The token stream of the sources cut into sequences of spec.seq_len tokens (documents joined by
    EOS; a prompt followed by the target's greedy answer when self-distilling, taken from `answers` when
    an earlier run wrote it there)."""
    from verispec.text import encode_prompt

    tokenizer = target.tokenizer
    if tokenizer is None:
        raise VerispecError(f"{target.name} has no tokenizer: feature extraction needs one to read text")
    separator = [min(target.eos_token_ids)] if target.eos_token_ids else []
    buffer: list[int] = []
    prompts: list[list[int]] = []  # waiting to be answered together

    def flush() -> Iterator[list[int]]:
        nonlocal buffer
        cache = answers if answers is not None else AnswerCache(None)
        missing = [p for p in prompts if cache.get(p) is None]
        if missing:
            cache.put(missing, _greedy_answers(target, missing, spec.max_new_tokens))
        for ids, answer in zip(prompts, [cache.get(p) for p in prompts]):
            buffer.extend(ids + answer + separator)
        prompts.clear()
        while len(buffer) >= spec.seq_len:
            yield buffer[: spec.seq_len]
            buffer = buffer[spec.seq_len :]

    for text, kind in documents(spec.sources):
        if kind == CHAT_PROMPT and getattr(tokenizer, "chat_template", None):
            ids = encode_prompt(tokenizer, text, chat=True)
        else:
            ids = tokenizer.encode(text, add_special_tokens=False)
        if kind != TEXT and spec.self_distill and ids:
            prompts.append(ids[-(target.max_context - spec.max_new_tokens - 1):])
            if len(prompts) < ANSWER_BATCH:
                continue
        else:
            buffer.extend(ids + separator)
        yield from flush()
    yield from flush()


class AnswerCache:
    """The target's self-distilled answers by prompt, appended to a JSON-lines file (when given) so a
    resumed extraction does not decode them again: they are the slow part of self-distillation."""

    def __init__(self, path: Path | None):
        self.path, self.known = path, {}
        if path is not None and path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by an interrupted run
                self.known[tuple(row["prompt"])] = row["answer"]

    def get(self, prompt: list[int]) -> list[int] | None:
        return self.known.get(tuple(prompt))

    def put(self, prompts: list[list[int]], answers: list[list[int]]) -> None:
        for prompt, answer in zip(prompts, answers):
            self.known[tuple(prompt)] = answer
        if self.path is not None:
            with self.path.open("a") as f:
                f.writelines(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in zip(prompts, answers))


ANSWER_BATCH = 8  # prompts answered in one batch when self-distilling: a CPU pass of 8 rows costs < 2 of one


def _greedy_answers(target, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The target's greedy answers to prompts, decoded together in one batch (each row is exactly what
    it would be alone: the engine's rows are independent)."""
    from verispec.drafters import NoDrafter
    from verispec.engine import Request, SpeculativeEngine

    engine = SpeculativeEngine(target, NoDrafter)  # plain greedy decoding: the target's own tokens
    answers: list[list[int]] = [[] for _ in prompts]
    requests = [Request(p, max_new_tokens=max_new_tokens, id=i) for i, p in enumerate(prompts)]
    for event in engine.stream(requests):
        answers[event.request_id].extend(event.tokens)
    return answers


@torch.inference_mode()
def features_of(target, sequences: torch.Tensor, taps: tuple[int, ...], top_k: int, bar: tqdm | None = None) -> dict[str, torch.Tensor]:
    """One shard's tensors for sequences [N, T] long: a prefill pass per sequence on a fresh cache
    (`bar`, if given, advances by each sequence's tokens)."""
    out = {"tokens": sequences.to(torch.int32), "taps": [], "top_ids": [], "top_logprobs": []}
    for row in sequences:
        logits, hidden = target.forward(row[None], target.new_cache(1), taps=taps)
        top = torch.log_softmax(logits[0].float(), -1).topk(top_k, -1)
        out["taps"].append(hidden[0].to(torch.float16))
        out["top_ids"].append(top.indices.to(torch.int32))
        out["top_logprobs"].append(top.values.to(torch.float16))
        if bar is not None:
            bar.update(len(row))
    return {k: (v if isinstance(v, torch.Tensor) else torch.stack(v)) for k, v in out.items()}


def extract(target, directory: str | Path, spec: FeatureSpec, max_tokens: int, progress: bool = True) -> list[Path]:
    """Make (or complete) the shards in `directory` until they hold at least `max_tokens` tokens; returns
    every shard path, in order. Shards already there are kept (resumable)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    manifest = directory / MANIFEST
    if manifest.exists():
        found = json.loads(manifest.read_text())
        if found.get("spec") != spec.to_json():
            raise VerispecError(f"{directory} holds features made with other settings ({found.get('spec')}); "
                                "use another --features directory or delete it")
    else:
        manifest.write_text(json.dumps({"spec": spec.to_json()}, indent=2) + "\n")
    if any(s.endswith(".jsonl") for s in spec.sources):
        print("verispec: note: training on prompt sets you benchmark on overstates acceptance there")
    per_shard = spec.seq_len * spec.shard_sequences
    shards = -(-max_tokens // per_shard)
    paths = [directory / f"shard-{i:05d}.safetensors" for i in range(shards)]
    missing = [i for i, p in enumerate(paths) if not p.exists()]
    if not missing:
        return paths
    stream = token_sequences(target, spec, AnswerCache(directory / ANSWERS))
    bar = tqdm(total=len(missing) * per_shard, unit="tok", desc="features", disable=not progress, smoothing=0.1)
    started = time.perf_counter()
    for i in range(shards):
        batch = [next(stream, None) for _ in range(spec.shard_sequences)]
        if batch[-1] is None:
            bar.close()
            raise VerispecError(f"the training data ran out after {i} shards ({i * per_shard} tokens): add sources "
                                "with --data or lower --max-tokens")
        if paths[i].exists():
            continue  # made by an earlier run: the token stream is the same, so skip its sequences
        tensors = features_of(target, torch.tensor(batch), spec.taps, spec.top_k, bar)
        partial = paths[i].with_name(paths[i].name + ".partial")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(partial))
        partial.replace(paths[i])
    bar.close()
    if progress:
        print(f"verispec: {len(missing) * per_shard} tokens of features in {time.perf_counter() - started:.0f} s -> {directory}")
    return paths


def load_shard(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))
