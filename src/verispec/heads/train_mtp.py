"""Training a DeepSeek-V3-style MTP module (`heads.mtp`) on features extracted from its frozen target.

The features are Medusa's (`train_medusa.final_tap`: the target's final hidden state after its final norm,
and its top-k next-token log-probabilities; the same extraction and cache, keyed by target and settings,
so Medusa heads and an MTP module of one target share them). The loop is EAGLE-3's (`train.fit_chained_head`):
training-time test unrolls the module K times over each sequence, step i reading its own output of step
i-1 one position further right, as drafting does, with the loss sum_i decay^i * CE(p_target, q_module)
over positions whose target argmax is in the draft vocabulary (`train.ttt_loss`); AdamW, warmup and cosine
decay, checkpoints, resuming, and held-out agreement per draft position at each checkpoint and at the end.

What is trained: enorm, hnorm, eh_proj, the block and the final norm (which starts as the target's final
norm, so the module begins reading its state as the target reads its own). The token embedding and the
output layer are the target's (bound, frozen, never saved). By default the output layer is the target's
rows for a draft vocabulary of the training features' most frequent tokens (`draft_vocab`); `draft_vocab=None`
keeps the target's whole LM head, DeepSeek's shared head, at the price of reading all of it per drafted
token (see `heads.mtp`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from verispec.errors import VerispecError
from verispec.heads.eagle3 import target_output_rows
from verispec.heads.mtp import MTPConfig, MTPHead, save_head
from verispec.heads.train import (TrainConfig, add_common_arguments, check_positive, choose_draft_vocab, fit_chained_head,
                                  training_features)
from verispec.heads.train_medusa import final_tap


def new_mtp_head(target, shards: list[Path], draft_vocab: int | None, intermediate_size: int | None = None) -> MTPHead:
    """A module for `target`, bound to it: its draft vocabulary chosen from the shards (None: the target's
    whole vocabulary), its final norm the target's."""
    vocab = target.vocab_size
    head = MTPHead(MTPConfig.for_target(target, vocab if draft_vocab is None else min(draft_vocab, vocab), intermediate_size))
    if head.config.draft_vocab_size < vocab:
        head.set_draft_vocab(choose_draft_vocab(shards, vocab, head.config.draft_vocab_size, tuple(sorted(target.eos_token_ids))))
    _, norm = target_output_rows(target, head.draft_token_ids[:1])
    with torch.no_grad():
        head.shared_head.norm.weight.copy_(norm)
    return head.bind_to(target)


def train_mtp(target, out: str | Path, *, data: tuple[str, ...] = ("site-packages",), max_tokens: int = 200_000,
              draft_vocab: int | None = 32000, config: TrainConfig | None = None, features: str | Path | None = None,
              seq_len: int = 256, self_distill: bool = False, numerics: str = "float32", intermediate_size: int | None = None,
              max_new_tokens: int = 192, progress: bool = True) -> MTPHead:
    """Extract features (or reuse them), train an MTP module for `target`, save it into `out`, return it.

    draft_vocab: the output layer's vocabulary (None: the target's whole LM head); config: the optimizer and
    training-time-test settings (`ttt_steps` = K unrolled draft positions, `decay` weighs step i's loss by
    decay^i); intermediate_size: the block's MLP width (default: the target's). Other arguments as
    `train.train_eagle3`. Resumes from `out/checkpoint.pt` when present."""
    from verispec import load

    config = config or TrainConfig()
    target = load(target, numerics=numerics) if isinstance(target, (str, Path)) else target
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec, training, held_out = training_features(target, (final_tap(target),), data, max_tokens, seq_len, self_distill,
                                                 max_new_tokens, features, config, progress)
    torch.manual_seed(config.seed)
    head = new_mtp_head(target, training, draft_vocab, intermediate_size)
    return fit_chained_head(head, out, spec, training, held_out, config, save_head, "mtp", progress)


# --- the command line: `verispec train mtp` ---------------------------------------------------------------

def add_mtp_arguments(parser) -> None:
    """The options of `verispec train mtp`: the common ones and the module's own."""
    add_common_arguments(parser)
    parser.add_argument("--ttt-steps", type=int, default=5,
                        help="K: draft positions unrolled per step (training-time test) (default: %(default)s)")
    parser.add_argument("--decay", type=float, default=0.8, help="step i's loss weight is decay^i (default: %(default)s)")
    parser.add_argument("--intermediate-size", type=int, default=None,
                        help="the block's MLP width (default: the target's; narrower trains and drafts faster)")
    parser.add_argument("--full-vocab", action="store_true",
                        help="score the target's whole vocabulary with its whole LM head (DeepSeek's shared head) "
                             "instead of --draft-vocab rows of it: slower per drafted token on a CPU")


def run_train_mtp(args) -> int:
    """`verispec train mtp` (the CLI sets the threads and log level before this)."""
    check_positive(args, "max_tokens", "steps", "ttt_steps", "batch", "draft_vocab", "seq_len", "checkpoint_every")
    if args.seq_len <= args.ttt_steps:
        raise VerispecError(f"--seq-len ({args.seq_len}) must exceed --ttt-steps ({args.ttt_steps})")
    if not 0.0 < args.decay <= 1.0:
        raise VerispecError(f"--decay must be in (0, 1], got {args.decay}")
    config = TrainConfig(steps=args.steps, ttt_steps=args.ttt_steps, decay=args.decay, batch_sequences=args.batch,
                         lr=args.lr, checkpoint_every=args.checkpoint_every, precision=args.precision)
    train_mtp(args.target, args.out, data=tuple(args.data or ("site-packages",)), max_tokens=args.max_tokens,
              draft_vocab=None if args.full_vocab else args.draft_vocab, config=config, features=args.features,
              seq_len=args.seq_len, self_distill=args.self_distill, numerics=args.numerics,
              intermediate_size=args.intermediate_size, max_new_tokens=args.max_new_tokens)
    print(f"verispec: MTP module saved in {args.out}; draft with it: verispec generate --target {args.target} "
          f"--draft {args.out} PROMPT")
    return 0
