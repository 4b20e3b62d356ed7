"""Training Medusa-1 heads on features extracted from their target (`heads.data`), the target frozen.

The features are the target's final hidden state (tap index = its layer count: after the final norm, what
its LM head reads) and its top-k next-token log-probabilities, cached in shards like an EAGLE-3 head's
(the same extraction, the same cache, keyed by target and settings). Head i reads h_t and learns the
target's distribution of the token at t + 2 + i, which the shards hold at position t + 1 + i: Medusa-1
with self-distillation's soft labels (Cai et al. 2024, section 2.3.2) rather than the text's tokens. The
loss is sum_i decay^i * CE(p_target, q_head_i) (Medusa's lambda_i = 0.8^i), over positions whose target
argmax is in the draft vocabulary, p renormalized over it (`vocab.soft_targets`, as for EAGLE-3).

The draft vocabulary and the loop (`train.fit_head`: AdamW, warmup and cosine decay, clipped gradients, bfloat16
autocast, checkpoints, resuming, the held-out curve) are `train`'s, the loss `medusa.medusa_loss` (shared with
online learning): this module only knows how to start the heads and what they learn from. Each head's LM head
starts as the target's rows for the draft vocabulary, its residual blocks as the identity
(`medusa_head_from_target`, also the online cold start).
Held-out shards (never trained on) give each head's top-1 agreement with the target's argmax at every checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from verispec.errors import VerispecError
from verispec.heads.medusa import MedusaConfig, MedusaHead, medusa_loss, save_head
from verispec.heads.train import (Objective, TrainConfig, add_common_arguments, check_positive, choose_draft_vocab, fit_head,
                                  target_output_rows, training_features)


def final_tap(target) -> int:
    """The tap index of the target's final normed hidden state: its layer count."""
    return int(target.config.num_hidden_layers)


def medusa_head_from_target(target, token_ids: torch.Tensor | None = None, num_heads: int = 4,
                            num_layers: int = 1) -> MedusaHead:
    """Untrained heads for `target` over the draft vocabulary `token_ids` (target ids, [V] long; None: the
    target's whole vocabulary), as Medusa-1
    starts them: each LM head the target's rows for those ids, each residual block the identity (zero weight).
    Head 0 then guesses x_{t+1} again where it should guess x_{t+2}: a cold start that only training
    (offline, or online from served traffic: `heads.online`) makes useful."""
    token_ids = torch.arange(target.vocab_size) if token_ids is None else token_ids
    head = MedusaHead(MedusaConfig.for_target(target, len(token_ids), num_heads, num_layers))
    head.set_draft_vocab(token_ids)
    lm_head, _ = target_output_rows(target, head.draft_token_ids)
    with torch.no_grad():
        for linear in head.lm_heads():
            linear.weight.copy_(lm_head)
    return head


def new_medusa_head(target, shards: list[Path], draft_vocab: int, num_heads: int, num_layers: int) -> MedusaHead:
    """Heads for `target`, their draft vocabulary chosen from the shards, each LM head the target's rows."""
    token_ids = choose_draft_vocab(shards, target.vocab_size, min(draft_vocab, target.vocab_size),
                                   tuple(sorted(target.eos_token_ids)))
    return medusa_head_from_target(target, token_ids, num_heads, num_layers)


def medusa_objective(config: TrainConfig) -> Objective:
    """Medusa's objective: each head's loss weighted by config.decay^i (`medusa.medusa_loss`)."""
    return lambda head, shard, rows: medusa_loss(head, shard, rows, config.decay)


def train_medusa(target, out: str | Path, *, data: tuple[str, ...] = ("site-packages",), max_tokens: int = 200_000,
                 draft_vocab: int = 32000, num_heads: int = 4, num_layers: int = 1, config: TrainConfig | None = None,
                 features: str | Path | None = None, seq_len: int = 256, self_distill: bool = False,
                 numerics: str = "float32", max_new_tokens: int = 192, progress: bool = True) -> MedusaHead:
    """Extract features (or reuse them), train Medusa heads for `target`, save them into `out`, return them.

    num_heads: K (head i guesses the token 2 + i positions past the target's last); num_layers: residual
    blocks per head; config: the optimizer settings (its `decay` weighs head i's loss by decay^i; its
    `ttt_steps` is EAGLE-3's and unused). Other arguments as `train.train_eagle3`. Resumes from
    `out/checkpoint.pt` when present."""
    from verispec import load

    config = config or TrainConfig()
    target = load(target, numerics=numerics) if isinstance(target, (str, Path)) else target
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tap = final_tap(target)
    spec, training, held_out = training_features(target, (tap,), data, max_tokens, seq_len, self_distill,
                                                 max_new_tokens, features, config, progress)

    torch.manual_seed(config.seed)
    head = new_medusa_head(target, training, draft_vocab, num_heads, num_layers)

    def describe(report: dict) -> str:
        return f"held-out top-1 agreement with the target by head (token t+2, t+3, ...): {report['accuracy']}"

    # head i learns the token 2 + i past position t: the last head trains num_heads + 1 fewer positions than a sequence
    return fit_head(head, out, spec, training, held_out, config, save_head, "medusa", progress, medusa_objective(config),
                    spec.seq_len - num_heads - 1, describe)


# --- the command line: `verispec train medusa` -----------------------------------------------------------

def add_medusa_arguments(parser) -> None:
    """The options of `verispec train medusa`: the common ones and the heads' own."""
    add_common_arguments(parser)
    parser.add_argument("--heads", type=int, default=4, help="K: heads, i.e. tokens drafted per step (default: %(default)s)")
    parser.add_argument("--head-layers", type=int, default=1, help="residual blocks per head (default: %(default)s)")
    parser.add_argument("--decay", type=float, default=0.8, help="head i's loss weight is decay^i (default: %(default)s)")


def run_train_medusa(args) -> int:
    """`verispec train medusa` (the CLI sets the threads and log level before this)."""
    check_positive(args, "max_tokens", "steps", "heads", "batch", "draft_vocab", "seq_len", "checkpoint_every")
    if args.head_layers < 0:
        raise VerispecError(f"--head-layers must be at least 0, got {args.head_layers}")
    if args.seq_len <= args.heads:
        raise VerispecError(f"--seq-len ({args.seq_len}) must exceed --heads ({args.heads})")
    if not 0.0 < args.decay <= 1.0:
        raise VerispecError(f"--decay must be in (0, 1], got {args.decay}")
    config = TrainConfig(steps=args.steps, decay=args.decay, batch_sequences=args.batch, lr=args.lr,
                         checkpoint_every=args.checkpoint_every, precision=args.precision)
    train_medusa(args.target, args.out, data=tuple(args.data or ("site-packages",)), max_tokens=args.max_tokens,
                 draft_vocab=args.draft_vocab, num_heads=args.heads, num_layers=args.head_layers, config=config,
                 features=args.features, seq_len=args.seq_len, self_distill=args.self_distill, numerics=args.numerics,
                 max_new_tokens=args.max_new_tokens)
    print(f"verispec: Medusa heads saved in {args.out}; draft with them: verispec generate --target {args.target} "
          f"--draft {args.out} PROMPT")
    return 0
