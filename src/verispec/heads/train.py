"""Training an EAGLE-3 head on features extracted from its target (`heads.data`), with training-time test.

Each step takes a few sequences of cached features and unrolls the head K times over them (EAGLE-3's
training-time test: step i feeds the head its own outputs of step i-1, one position further right, as
drafting does). The loss is sum_i 0.8^i * CE(p_target, q_head) at every position, where p_target is the
target's next-token distribution restricted to the draft vocabulary and renormalized (from its cached
top-k log-probabilities), and positions whose target argmax is outside the draft vocabulary are left out
(as SpecForge does). AdamW with a linear warmup and cosine decay; gradients clipped.

The draft vocabulary is the `draft_vocab` most frequent tokens of the training features (the text's tokens
and the target's argmax tokens), plus the target's EOS tokens. The head's `norm` and `lm_head` start as
the target's final norm and its LM head rows for that vocabulary, so the head begins by reading its
hidden state the way the target reads its own; every other weight starts from PyTorch's defaults.

Checkpoints (`checkpoint.pt`: weights, optimizer, step, random state) are written every
`checkpoint_every` steps and at the end, with the head itself (`config.json`, `model.safetensors`) in
the output directory; a run started again with the same output directory resumes. Held-out shards
(never trained on) give the top-1 agreement with the target's argmax per unrolled step: the chance that
the k-th drafted token is accepted when the ones before were (greedy).

The loop (`fit_head`) knows a head only through its objective (`Objective`): training-time test
(`ttt_loss`, which reads a head only through `eagle3.ChainedHead`'s steps, so `train_mtp` trains a
DeepSeek-V3-style MTP module with it too) or Medusa's loss (`train_medusa`).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from verispec.errors import VerispecError
from verispec.heads.data import FeatureSpec, extract, load_shard
from verispec.heads.eagle3 import (Eagle3Config, Eagle3Head, default_taps, save_head, target_embedding,
                                   target_output_rows)
from verispec.heads.vocab import soft_targets

CHECKPOINT = "checkpoint.pt"
LOG = "train.jsonl"


@dataclass
class TrainConfig:
    steps: int = 1000  # optimizer steps
    ttt_steps: int = 5  # K: unrolled draft positions trained per step
    decay: float = 0.8  # weight of step i's loss: decay ** i
    batch_sequences: int = 2  # sequences per optimizer step (from one shard)
    lr: float = 3e-4
    warmup: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    checkpoint_every: int = 100
    held_out_shards: int = 1
    eval_sequences: int = 8  # held-out sequences the final report reads
    seed: int = 0
    precision: str = "auto"  # "bfloat16": matmuls autocast to bfloat16 (weights and the optimizer stay float32)
    extra: dict = field(default_factory=dict)

    def autocast(self, device: torch.device):
        """The autocast context of a training step: bfloat16 where asked, or under "auto" where the device
        multiplies bfloat16 natively (CUDA, a CPU with AVX-512 BF16 / AMX: about twice float32's speed);
        otherwise float32."""
        wanted = self.precision
        if wanted == "auto":
            native = torch.cuda.is_available() if device.type == "cuda" else torch.ops.mkldnn._is_mkldnn_bf16_supported()
            wanted = "bfloat16" if native else "float32"
        if wanted not in ("bfloat16", "float32"):
            raise VerispecError(f"precision must be auto, bfloat16 or float32, got {self.precision!r}")
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=wanted == "bfloat16")


def choose_draft_vocab(shards: list[Path], vocab_size: int, size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` most frequent target ids among the shards' tokens and target argmaxes (and `always`),
    sorted; ids never seen fill up the rest in id order."""
    size = min(size, vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for path in shards:
        shard = load_shard(path)
        for ids in (shard["tokens"].long().flatten(), shard["top_ids"][..., 0].long().flatten()):
            counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    counts[list(always)] = counts.max() + 1
    # stable order: by count, ties by id
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))[:size]
    return torch.tensor(sorted(order), dtype=torch.long)


def ttt_loss(head: Eagle3Head, shard: dict, rows: list[int], steps: int, decay: float):
    """(loss, [accuracy of step i], [loss of step i]) over sequences `rows` of a shard, K = steps unrolled."""
    tokens = shard["tokens"][rows].long()
    width = tokens.shape[1] - steps
    if width < 1:
        raise VerispecError(f"sequences of {tokens.shape[1]} tokens are too short for {steps} unrolled steps")
    taps = shard["taps"][rows, :width].float()
    logits = head.unroll(taps, tokens, steps)
    total, accuracy, losses = 0.0, [], []
    draft_to_target = head.draft_token_ids
    for i, step_logits in enumerate(logits):
        ids, logprobs = shard["top_ids"][rows, 1 + i : 1 + i + width], shard["top_logprobs"][rows, 1 + i : 1 + i + width]
        p, mask = soft_targets(ids, logprobs, head)
        per_position = -(p * torch.log_softmax(step_logits, -1)).sum(-1)
        count = mask.sum().clamp(min=1)
        loss = (per_position * mask).sum() / count
        total = total + decay ** i * loss
        hits = (draft_to_target[step_logits.argmax(-1)] == ids[..., 0].long()) & mask
        accuracy.append(float(hits.sum()) / float(count))
        losses.append(float(loss.detach()))
    return total, accuracy, losses


def _features_dir(target_name: str, spec: FeatureSpec) -> Path:
    from verispec import zoo

    key = hashlib.sha256(json.dumps(spec.to_json(), sort_keys=True).encode()).hexdigest()[:12]
    safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in target_name)
    return zoo.home() / "features" / f"{safe}-{key}"


def training_features(target, taps: tuple[int, ...], data: tuple[str, ...], max_tokens: int, seq_len: int,
                      self_distill: bool, max_new_tokens: int, features, config: TrainConfig,
                      progress: bool) -> tuple[FeatureSpec, list[Path], list[Path]]:
    """(the spec, the training shards, the held-out shards) of a head's features: extracted from `target`
    (or found in the cache under `features`, by default keyed by target and settings), the last
    config.held_out_shards never trained on."""
    spec = FeatureSpec(target=target.name, taps=taps, seq_len=seq_len, sources=tuple(data), self_distill=self_distill,
                       max_new_tokens=max_new_tokens, numerics=target.numerics)
    if max_tokens < 2 * spec.seq_len * spec.shard_sequences and config.held_out_shards:
        spec.shard_sequences = max(1, max_tokens // (2 * spec.seq_len))  # room for a held-out shard
    features = Path(features) if features is not None else _features_dir(target.name, spec)
    shards = extract(target, features, spec, max_tokens, progress=progress)
    held_out = shards[len(shards) - config.held_out_shards :] if config.held_out_shards else []
    training = shards[: len(shards) - len(held_out)]
    if not training:
        raise VerispecError(f"{max_tokens} tokens make {len(shards)} shard(s), all held out: raise --max-tokens")
    return spec, training, held_out


def new_head(target, shards: list[Path], draft_vocab: int, taps: tuple[int, ...],
             intermediate_size: int | None = None) -> Eagle3Head:
    """A head for `target`, its draft vocabulary chosen from the shards, its norm and LM head the target's."""
    config = Eagle3Config.for_target(target, min(draft_vocab, target.vocab_size), taps, intermediate_size)
    head = Eagle3Head(config)
    head.set_draft_vocab(choose_draft_vocab(shards, target.vocab_size, config.draft_vocab_size,
                                            tuple(sorted(target.eos_token_ids))))
    lm_head, norm = target_output_rows(target, head.draft_token_ids)
    with torch.no_grad():
        head.lm_head.weight.copy_(lm_head)
        head.norm.weight.copy_(norm)
    return head.bind(target_embedding(target))


# What a head learns from: (head, shard, rows) -> (the loss to minimise, the top-1 agreement with the target per
# draft position, the loss per position). EAGLE-3's and an MTP module's: `chained_objective`; Medusa's:
# `train_medusa.medusa_objective`.
Objective = Callable[[torch.nn.Module, dict, list[int]], tuple[torch.Tensor, list[float], list[float]]]


def chained_objective(config: "TrainConfig") -> Objective:
    """A chained head's objective: training-time test over `config.ttt_steps` unrolled steps (`ttt_loss`)."""
    return lambda head, shard, rows: ttt_loss(head, shard, rows, config.ttt_steps, config.decay)


def evaluate(head, shards: list[Path], config: "TrainConfig", objective: Objective) -> dict:
    """Per draft position, the held-out top-1 agreement with the target and the loss (over up to
    config.eval_sequences sequences)."""
    head.eval()
    sums = losses = None
    seen = 0
    with torch.no_grad(), config.autocast(head.d2t.device):
        for path in shards:
            shard = load_shard(path)
            for row in range(shard["tokens"].shape[0]):
                if seen >= config.eval_sequences:
                    break
                _, accuracy, loss = objective(head, shard, [row])
                sums = accuracy if sums is None else [a + b for a, b in zip(sums, accuracy)]
                losses = loss if losses is None else [a + b for a, b in zip(losses, loss)]
                seen += 1
    head.train()
    if not seen:
        raise VerispecError("no held-out sequence to evaluate the head on: TrainConfig.eval_sequences must be at "
                            "least 1")
    return {"accuracy": [round(a / seen, 4) for a in sums], "loss": [round(x / seen, 4) for x in losses], "sequences": seen}


def train_eagle3(target, out: str | Path, *, data: tuple[str, ...] = ("site-packages",), max_tokens: int = 200_000,
                 draft_vocab: int = 32000, config: TrainConfig | None = None, taps: tuple[int, ...] | None = None,
                 features: str | Path | None = None, seq_len: int = 256, self_distill: bool = False,
                 numerics: str = "float32", intermediate_size: int | None = None, max_new_tokens: int = 192,
                 progress: bool = True) -> Eagle3Head:
    """Extract features (or reuse them), train an EAGLE-3 head for `target`, save it into `out`, return it.

    max_tokens: tokens of training text (features cached under `features`, by default in the verispec
    home, keyed by target and settings); draft_vocab: the head's output vocabulary; config: the optimizer
    and training-time-test settings; numerics: the target's ("q8" for a GGUF target run with llama.cpp's
    numerics: its features come from that target, so the head learns what it says, and prefill is fast);
    intermediate_size: the head's MLP width (default: the target's). Resumes from `out/checkpoint.pt`
    when present."""
    from verispec import load

    config = config or TrainConfig()
    target = load(target, numerics=numerics) if isinstance(target, (str, Path)) else target
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    taps = tuple(taps) if taps is not None else default_taps(int(target.config.num_hidden_layers))
    spec, training, held_out = training_features(target, taps, data, max_tokens, seq_len, self_distill, max_new_tokens,
                                                 features, config, progress)

    torch.manual_seed(config.seed)
    head = new_head(target, training, draft_vocab, taps, intermediate_size)
    return fit_chained_head(head, out, spec, training, held_out, config, save_head, "eagle3", progress)


def fit_chained_head(head, out: Path, spec: FeatureSpec, training: list[Path], held_out: list[Path], config: TrainConfig,
                     save, name: str, progress: bool):
    """`fit_head` for a head that drafts a chain (`eagle3.ChainedHead`: EAGLE-3's, an MTP module), trained by
    training-time test; its summary is the agreement per unrolled step and the tokens per pass they make."""
    def describe(report: dict) -> str:
        return (f"held-out top-1 agreement with the target by draft position: {report['accuracy']} (a greedy chain of "
                f"{len(report['accuracy'])}: {expected_tokens_per_pass(report['accuracy']):.2f} tokens per target pass)")

    return fit_head(head, out, spec, training, held_out, config, save, name, progress, chained_objective(config),
                    spec.seq_len - config.ttt_steps, describe)


def fit_head(head, out: Path, spec: FeatureSpec, training: list[Path], held_out: list[Path], config: TrainConfig, save,
             name: str, progress: bool, objective: Objective, positions: int, describe: Callable[[dict], str]):
    """The training loop of every head: AdamW on `objective` over random rows of the training shards,
    checkpoints (`save` writes the head itself) and the held-out curve in out/train.jsonl, the final held-out
    agreement per draft position in the head's config (and printed as `describe` puts it). positions: the
    positions of a sequence a step trains on (for the curve's tokens axis). Resumes from out/checkpoint.pt when
    present. Returns the head, in eval mode."""
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=config.lr,
                                  weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, config))
    start, rng = _resume(out, head, optimizer, schedule, config)
    log = (out / LOG).open("a")
    bar = tqdm(total=config.steps, initial=start, desc=f"train {name}", unit="step", disable=not progress)
    head.train()
    started = time.perf_counter()
    tokens_per_step = config.batch_sequences * positions
    shard_cache: dict[Path, dict] = {}
    for step in range(start, config.steps):
        path = rng.choice(training)
        if path not in shard_cache:
            shard_cache.clear()  # one shard in memory at a time
            shard_cache[path] = load_shard(path)
        shard = shard_cache[path]
        rows = rng.sample(range(shard["tokens"].shape[0]), min(config.batch_sequences, shard["tokens"].shape[0]))
        with config.autocast(head.d2t.device):
            loss, accuracy, _ = objective(head, shard, rows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), config.grad_clip)
        optimizer.step()
        schedule.step()
        record = {"step": step + 1, "loss": round(float(loss.detach()), 4), "accuracy": [round(a, 3) for a in accuracy],
                  "lr": schedule.get_last_lr()[0], "seconds": round(time.perf_counter() - started, 1)}
        log.write(json.dumps(record) + "\n")
        log.flush()
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", acc0=f"{accuracy[0]:.2f}")
        bar.update(1)
        if (step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps:
            _checkpoint(out, head, optimizer, schedule, step + 1, rng, config, spec, save=save)
            if held_out and step + 1 < config.steps:  # the curve of acceptance against tokens trained on
                report = evaluate(head, held_out, config, objective)
                log.write(json.dumps({"step": step + 1, "tokens": (step + 1) * tokens_per_step, "held_out": report}) + "\n")
                log.flush()
    bar.close()
    report = evaluate(head, held_out, config, objective) if held_out else None
    if report is not None:
        head.config.extra["held_out"] = report
        log.write(json.dumps({"step": config.steps, "tokens": config.steps * tokens_per_step, "held_out": report}) + "\n")
        save(head, out)
        if progress:
            print(f"verispec: {describe(report)}")
    log.close()
    head.eval()
    return head


def expected_tokens_per_pass(accuracy: list[float], k: int | None = None) -> float:
    """Tokens a greedy chain of k drafts yields per target pass, from the held-out agreement of each
    unrolled step (step i's agreement is the chance its token is accepted when the ones before were: the
    steps are fed the true tokens): 1 + sum_j prod_{i<=j} a_i (the target's own token always comes)."""
    total, reach = 1.0, 1.0
    for a in accuracy[: k if k is not None else len(accuracy)]:
        reach *= a
        total += reach
    return total


def _lr_factor(step: int, config: TrainConfig) -> float:
    if step < config.warmup:
        return (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _checkpoint(out: Path, head: Eagle3Head, optimizer, schedule, step: int, rng: random.Random,
                config: TrainConfig, spec: FeatureSpec, save=save_head) -> None:
    """Write out/checkpoint.pt (weights, optimizer, step, random state) and the head itself (`save`: its kind's)."""
    head.config.extra.update({"steps": step, "train": {k: v for k, v in asdict(config).items() if k != "extra"},
                              "features": spec.to_json()})
    state = {"head": head.state_dict(), "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
             "step": step, "rng": rng.getstate(), "torch_rng": torch.get_rng_state(), "config": asdict(config)}
    partial = out / (CHECKPOINT + ".partial")
    torch.save(state, partial)
    partial.replace(out / CHECKPOINT)
    save(head, out)


def _resume(out: Path, head: Eagle3Head, optimizer, schedule, config: TrainConfig) -> tuple[int, random.Random]:
    """(the step to start from, the batch-choosing random stream), restored from out/checkpoint.pt if any."""
    rng = random.Random(config.seed)
    path = out / CHECKPOINT
    if not path.exists():
        return 0, rng
    state = torch.load(path, weights_only=False)
    if not torch.equal(state["head"]["t2d"], head.t2d):
        raise VerispecError(f"{path} was trained with another draft vocabulary: use a new --out directory")
    head.load_state_dict(state["head"])
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    rng.setstate(state["rng"])
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"]), rng


# --- the command line: `verispec train eagle3` -----------------------------------------------------------

def add_train_arguments(parser) -> None:
    """The options of `verispec train eagle3`: the common ones and the head's own."""
    add_common_arguments(parser)
    parser.add_argument("--ttt-steps", type=int, default=5, help="draft positions unrolled per step (default: %(default)s)")
    parser.add_argument("--intermediate-size", type=int, default=None,
                        help="the head's MLP width (default: the target's; narrower trains and drafts faster)")
    parser.add_argument("--taps", default=None, help="comma-separated target layers whose inputs the head reads "
                                                     "(default: 2, N/2, N-3)")


def add_common_arguments(parser) -> None:
    """The options every `verispec train HEAD` takes: target, data, features, optimizer, checkpoints."""
    parser.add_argument("--target", required=True, help="the target model: zoo name, local directory or .gguf file")
    parser.add_argument("--out", required=True, help="directory for the head (config.json, model.safetensors), its "
                                                    "checkpoint and train.jsonl; a run with the same --out resumes")
    parser.add_argument("--data", action="append", default=None, metavar="SOURCE",
                        help="training text (repeatable): site-packages (the default: installed Python sources), "
                             "site-packages-prompts[:N] (N function signature + docstring prompts cut from them, answered "
                             "by the target with --self-distill), a .jsonl prompt file, a text file or a directory")
    parser.add_argument("--self-distill", action="store_true",
                        help="append the target's own greedy answers to .jsonl prompts (slower; learns what it says)")
    parser.add_argument("--max-tokens", type=int, default=200_000, help="tokens of training features (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence (default: %(default)s)")
    parser.add_argument("--draft-vocab", type=int, default=32000, help="the head's output vocabulary (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default: %(default)s)")
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (default: %(default)s)")
    parser.add_argument("--features", default=None, help="feature cache directory (default: under the verispec home, "
                                                         "keyed by target and settings, reused across runs)")
    parser.add_argument("--numerics", choices=("float32", "q8"), default="float32",
                        help="the target's numerics (q8: a GGUF file's blocks, llama.cpp's numbers; draft for it with "
                             "the head trained on it) (default: %(default)s)")
    parser.add_argument("--precision", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="training matmuls: auto = bfloat16 where the CPU/GPU has it natively (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=192,
                        help="answer length per prompt when self-distilling (default: %(default)s)")


def check_positive(args, *names: str) -> None:
    """Each named CLI argument is at least 1, or a VerispecError names the flag (the `verispec train` commands)."""
    for name in names:
        if getattr(args, name) < 1:
            raise VerispecError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")


def run_train(args) -> int:
    """`verispec train eagle3` (the CLI sets the threads and log level, `--threads` / `--quiet`, before this)."""
    check_positive(args, "max_tokens", "steps", "ttt_steps", "batch", "draft_vocab", "seq_len", "checkpoint_every")
    if args.seq_len <= args.ttt_steps:
        raise VerispecError(f"--seq-len ({args.seq_len}) must exceed --ttt-steps ({args.ttt_steps})")
    taps = tuple(int(t) for t in args.taps.split(",")) if args.taps else None
    config = TrainConfig(steps=args.steps, ttt_steps=args.ttt_steps, batch_sequences=args.batch, lr=args.lr,
                         checkpoint_every=args.checkpoint_every, precision=args.precision)
    train_eagle3(args.target, args.out, data=tuple(args.data or ("site-packages",)), max_tokens=args.max_tokens,
                 draft_vocab=args.draft_vocab, config=config, taps=taps, features=args.features, seq_len=args.seq_len,
                 self_distill=args.self_distill, numerics=args.numerics, intermediate_size=args.intermediate_size,
                 max_new_tokens=args.max_new_tokens)
    print(f"verispec: head saved in {args.out}; draft with it: verispec generate --target {args.target} --draft {args.out} PROMPT")
    return 0
