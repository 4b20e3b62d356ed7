"""Online adaptation of Medusa-1 heads from served traffic (after Liu et al. 2023, "Online Speculative
Decoding"): the heads learn, while serving, to guess what the target actually says to this workload.

Every served token is a free training pair. The drafter already receives the target's final hidden state
h_t of each token its cache keeps (`Drafter.observe_taps`, from every prefill and verify pass), and the
tokens that follow are known one step later, so head i gets (h_t -> x_{t+2+i}) at no target cost. Only
generated positions are kept (their next tokens are the target's own, greedy or sampled: the distillation
labels online speculative decoding uses); the prompt's text is not the target's.

    TrafficRecorder   (one per drafter, engine thread)  a row's hidden states + tokens -> windows [L]
    ReplayBuffer      (shared, locked)                  the newest `buffer_tokens` positions of windows
    OnlineMedusa      (shared; a worker thread)         AdamW steps on a training copy of the heads, with
                                                        `heads.medusa.medusa_loss` (hard labels:
                                                        the served token), within a budget; then publish

A window is L consecutive positions: taps [L, H] and next tokens [L] (x_{t+1} beside h_t), the layout
`medusa_loss` reads from a feature shard (`top_ids` [.., 1] with log-probability 0: a one-hot target).
Consecutive windows of a row overlap by K positions, so every position is scored by every head once;
a finished row's last < L positions are dropped. Tokens outside the draft vocabulary are masked, as in
offline training.

Budget. The worker takes at most one step per `tokens_per_step` served tokens (a step waits for
traffic), and after a step of s seconds rests s * (1 / max_busy - 1), so it is busy at most `max_busy`
of the wall time. PyTorch's thread count is process-wide (torch.set_num_threads in the worker would
slow the target too), so the worker shares the target's intra-op threads and the budget, not a thread
count, is what bounds the cost; bench/online_adaptation.py measures it.

Thread safety (double buffering). Two serving copies of the trainable weights; `live` names the one
drafters read. The worker writes only into the other one (the spare), then flips `live` under a lock.
A drafter holds that same lock for the whole of one forward (`reading`), so (1) it reads one copy from
start to end, never a half-written one, and (2) when the worker later writes into the old live copy
(the new spare), no drafter can still be reading it: its read ended before the flip could take the
lock. The lock is held for a flip (an index) or one head forward (a few ms), never for a training step.
Frozen weights (the LM heads unless `train_lm_heads`, the vocabulary maps) are one tensor shared by all
copies. Output stays exact whatever the weights are: the target verifies every token, and a sampled
draft's q comes from the same copy as its tokens.

The module knows nothing about the engine: drafters feed it (`drafters.medusa`) and read from it.
"""

from __future__ import annotations

import copy
import logging
import random
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Iterator

import torch

from verispec.errors import VerispecError
from verispec.heads.medusa import MedusaConfig, MedusaHead, medusa_loss

log = logging.getLogger("verispec.online")

MAX_BACKLOG = 8  # steps of credit the worker may owe (traffic it could not keep up with is not all trained on later)


@dataclass(frozen=True)
class OnlineConfig:
    """How an `OnlineMedusa` learns from traffic: its data, its optimizer and its compute budget."""

    window: int = 32  # L: consecutive positions per training sequence (more than the heads' count)
    batch_windows: int = 4  # windows per optimizer step, drawn at random from the buffer
    buffer_tokens: int = 8192  # the replay buffer's bound, in positions; the oldest windows leave first
    tokens_per_step: float = 16.0  # budget: at most one optimizer step per this many served tokens
    max_busy: float = 0.25  # budget: the worker is busy at most this share of the wall time
    publish_every: int = 1  # optimizer steps between weight swaps into the drafters
    lr: float = 1e-3  # AdamW, constant: the workload moves, so there is no schedule to decay along
    decay: float = 0.8  # head i's loss weight decay^i (Medusa's lambda_i, as offline training)
    grad_clip: float = 0.5
    train_lm_heads: bool = False  # also train each head's LM head (K x V x H more weights, three copies of each)
    seed: int = 0

    def check(self, num_heads: int) -> None:
        """Raise VerispecError on settings that cannot work with `num_heads` heads."""
        if self.window <= num_heads:
            raise VerispecError(f"online window ({self.window}) must exceed the heads' count ({num_heads}): "
                                "head i needs i + 2 tokens after a position")
        if self.batch_windows < 1 or self.publish_every < 1:
            raise VerispecError("online batch_windows and publish_every must be at least 1")
        if self.buffer_tokens < self.window:
            raise VerispecError(f"online buffer_tokens ({self.buffer_tokens}) must hold one window ({self.window})")
        if not self.tokens_per_step > 0 or not 0 < self.max_busy <= 1:
            raise VerispecError(f"online tokens_per_step must be > 0 and max_busy in (0, 1], got {self.tokens_per_step} "
                                f"and {self.max_busy}")
        if not self.lr > 0:
            raise VerispecError(f"online lr must be > 0, got {self.lr}")


class ReplayBuffer:
    """The newest windows of served traffic, bounded in positions; safe to fill and sample from two threads."""

    def __init__(self, capacity_tokens: int, window: int):
        self.window = window
        self._windows: deque[tuple[torch.Tensor, torch.Tensor]] = deque(maxlen=max(1, capacity_tokens // window))
        self._lock = threading.Lock()
        self.added = 0  # windows ever added

    def __len__(self) -> int:
        return len(self._windows)

    @property
    def tokens(self) -> int:
        """Positions held (at most the capacity rounded down to whole windows)."""
        return len(self._windows) * self.window

    def add(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """One window: final hidden states [L, H] and the token after each [L] long."""
        with self._lock:
            self._windows.append((hidden, next_tokens))
            self.added += 1

    def sample(self, count: int, rng: random.Random) -> dict | None:
        """Up to `count` distinct windows at random, as the feature shard `medusa_loss` reads (rows 0..n-1):
        taps [n, L, H], top_ids [n, L, 1] (the token after each position, one-hot: log-probability 0) and
        tokens [n, L] (read for the length only). None while the buffer is empty."""
        with self._lock:
            chosen = rng.sample(list(self._windows), min(count, len(self._windows)))
        if not chosen:
            return None
        # stacked outside inference mode, so the inference tensors the engine handed over become normal ones
        taps = torch.stack([h for h, _ in chosen]).float()
        ids = torch.stack([t for _, t in chosen])
        return {"taps": taps, "tokens": ids, "top_ids": ids[..., None], "top_logprobs": torch.zeros(*ids.shape, 1)}


@dataclass
class _Stream:
    """One row's generated positions not yet cut into windows."""

    prompt_length: int
    seen: int = 0  # hidden states observed (positions 0..seen-1)
    start: int | None = None  # position of pending's first row
    pending: torch.Tensor | None = None  # [n, H]: hidden states of positions start..start+n-1


class TrafficRecorder:
    """Cuts one batch's served rows into training windows for `learner` (called by its drafter, on the
    engine thread: rows join with `add`, leave with `select`)."""

    def __init__(self, learner: "OnlineMedusa"):
        self.learner = learner
        self.window, self.overlap = learner.options.window, learner.config.num_heads
        self.rows: list[_Stream] = []

    def add(self, prompts: list[list[int]]) -> None:
        self.rows.extend(_Stream(len(p)) for p in prompts)

    def observe(self, hidden: list[torch.Tensor | None]) -> None:
        """Per row, the target's final hidden states [n, H] of the n tokens its cache just kept. The prompt's
        (positions before prompt_length - 1) are skipped: their next tokens are the user's, not the target's."""
        served = 0
        for stream, states in zip(self.rows, hidden):
            if states is None or not states.numel():
                continue
            skip = max(0, stream.prompt_length - 1 - stream.seen)
            if skip < states.shape[0]:
                kept = states[skip:].float()
                stream.pending = kept if stream.pending is None else torch.cat([stream.pending, kept])
                stream.start = stream.seen + skip if stream.start is None else stream.start
                served += kept.shape[0]
            stream.seen += states.shape[0]
        if served:
            self.learner.served(served)

    def cut(self, sequences: list[list[int]]) -> None:
        """Windows of each row whose next tokens are all known (every observed position's is: the engine's
        sequence runs one token past the target's cache), to the learner's buffer."""
        for stream, sequence in zip(self.rows, sequences):
            while stream.pending is not None and stream.pending.shape[0] >= self.window:
                start, end = stream.start, stream.start + self.window
                self.learner.buffer.add(stream.pending[: self.window].clone(),
                                        torch.tensor(sequence[start + 1 : end + 1], dtype=torch.long))
                step = self.window - self.overlap  # the next window re-reads the last K positions for the later heads
                stream.pending, stream.start = stream.pending[step:], start + step

    def select(self, rows: list[int]) -> None:
        self.rows = [self.rows[b] for b in rows]


class OnlineMedusa:
    """Medusa heads that keep learning from what they serve. Pass it where a head goes (`draft=`); drafters
    read its live weights (`reading`) and feed it their traffic (`recorder`).

    head: the starting heads (trained, or `train_medusa.medusa_head_from_target` for a cold start); they
    are copied, not changed. Training runs on a worker thread started by `start()` (or `with`) and ended by
    `close()`; without it, `train_due()` takes the steps due, on the caller's thread (deterministic)."""

    def __init__(self, head: MedusaHead, options: OnlineConfig | None = None):
        self.options = options or OnlineConfig()
        self.options.check(head.config.num_heads)
        trainable = {name for name, _ in head.named_parameters()
                     if self.options.train_lm_heads or not name.endswith(f".{head.config.num_layers}.weight")}
        if not trainable:
            raise VerispecError("these Medusa heads have no residual blocks to train online: give heads with "
                                "num_layers >= 1, or OnlineConfig(train_lm_heads=True)")
        # frozen tensors (and the vocabulary maps) are shared by every copy: one in memory, never written
        shared = {id(p): torch.nn.Parameter(p.detach(), requires_grad=False)
                  for name, p in head.named_parameters() if name not in trainable}
        shared.update({id(b): b for b in head.buffers()})
        self.training = copy.deepcopy(head, memo=dict(shared)).train()
        self._serving = [copy.deepcopy(head, memo=dict(shared)).eval().requires_grad_(False) for _ in range(2)]
        self._trainable = sorted(trainable)
        parameters = [p for name, p in self.training.named_parameters() if name in trainable]
        self.optimizer = torch.optim.AdamW(parameters, lr=self.options.lr, weight_decay=0.0)
        self.buffer = ReplayBuffer(self.options.buffer_tokens, self.options.window)
        self.rng = random.Random(self.options.seed)
        self._live = 0  # the serving copy drafters read
        self._lock = threading.Lock()  # held by a drafter's forward, and by the worker's flip
        self._wake = threading.Condition()  # traffic arrived, or close()
        self._credit = 0.0  # optimizer steps the traffic so far allows
        self._closed = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what stopped the worker, if anything did
        self.version = 0  # weight swaps published
        self.steps = 0
        self.served_tokens = 0
        self.busy_seconds = 0.0
        self.history: list[dict] = []  # per step: served tokens at the time, loss, head accuracies on the batch

    @property
    def config(self) -> MedusaConfig:
        """The heads' shape (what `check_target` and the drafter read)."""
        return self.training.config

    # --- the drafters' side --------------------------------------------------------------------------------

    @contextmanager
    def reading(self) -> Iterator[MedusaHead]:
        """The live heads, which stay unchanged until the block ends (hold it for one forward only)."""
        with self._lock:
            yield self._serving[self._live]

    def recorder(self) -> TrafficRecorder:
        """A recorder for one drafter's rows."""
        return TrafficRecorder(self)

    def served(self, tokens: int) -> None:
        """`tokens` more generated positions were served: credit for tokens / tokens_per_step steps."""
        with self._wake:
            self.served_tokens += tokens
            self._credit = min(self._credit + tokens / self.options.tokens_per_step, float(MAX_BACKLOG))
            self._wake.notify()

    # --- learning -----------------------------------------------------------------------------------------

    def step(self) -> float | None:
        """One AdamW step of the training copy on a batch of the buffer (`medusa_loss`); its loss, None if
        the buffer is empty. Not published until `publish`. Callable from the engine's thread too (which
        decodes under inference mode: gradients are switched back on here)."""
        with torch.inference_mode(False), torch.enable_grad():
            return self._step()

    def _step(self) -> float | None:
        batch = self.buffer.sample(self.options.batch_windows, self.rng)
        if batch is None:
            return None
        loss, accuracy, _ = medusa_loss(self.training, batch, list(range(batch["taps"].shape[0])), self.options.decay)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.training.parameters(), self.options.grad_clip)
        self.optimizer.step()
        self.steps += 1
        self.history.append({"step": self.steps, "served_tokens": self.served_tokens, "loss": round(float(loss.detach()), 4),
                             "accuracy": [round(a, 3) for a in accuracy]})
        return float(loss.detach())

    @torch.no_grad()
    def publish(self) -> None:
        """Copy the training weights into the spare serving copy, then make it the live one."""
        spare = self._serving[1 - self._live]
        source = dict(self.training.named_parameters())
        for name, parameter in spare.named_parameters():
            if name in source and parameter is not source[name]:  # shared frozen tensors need no copy
                parameter.copy_(source[name].detach())
        with self._lock:
            self._live = 1 - self._live
            self.version += 1

    def train_due(self) -> int:
        """Take, on this thread, the steps the traffic so far allows (and publish): for callers that want
        learning at chosen points (tests, a batch job), not with the worker running. Returns the steps taken."""
        if self._thread is not None:
            raise VerispecError("train_due() trains on the caller's thread; this OnlineMedusa has a worker: use one or the other")
        taken = 0
        while self._credit >= 1 and len(self.buffer):
            self._credit -= 1
            self.step()
            taken += 1
            if self.steps % self.options.publish_every == 0:
                self.publish()
        return taken

    # --- the worker ---------------------------------------------------------------------------------------

    def start(self) -> "OnlineMedusa":
        """Start the worker thread (once)."""
        if self._closed:
            raise VerispecError("this OnlineMedusa was closed: make a new one")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="verispec-online-medusa", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float = 30.0) -> None:
        """Stop the worker after its current step and wait for it. The heads keep their latest weights."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"the online learner's worker did not stop within {timeout} s")

    def __enter__(self) -> "OnlineMedusa":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    self._wake.wait_for(lambda: self._closed or (self._credit >= 1 and len(self.buffer) > 0))
                    if self._closed:
                        return
                    self._credit -= 1
                started = time.perf_counter()
                self.step()
                if self.steps % self.options.publish_every == 0:
                    self.publish()
                busy = time.perf_counter() - started
                self.busy_seconds += busy
                with self._wake:  # rest so that busy time stays within max_busy of the wall time
                    self._wake.wait_for(lambda: self._closed, timeout=busy * (1 / self.options.max_busy - 1))
        except BaseException as exc:  # noqa: BLE001 - the drafters keep serving the last published weights
            self.error = exc
            log.exception("online learning stopped; drafting continues with the last published heads")

    def summary(self) -> dict:
        """What the learner has done: steps, swaps, traffic, buffer, worker time, the latest batch loss."""
        last = self.history[-1] if self.history else {}
        return {"steps": self.steps, "version": self.version, "served_tokens": self.served_tokens,
                "buffer_tokens": self.buffer.tokens, "windows_added": self.buffer.added,
                "busy_seconds": round(self.busy_seconds, 3), "loss": last.get("loss"), "accuracy": last.get("accuracy"),
                "options": asdict(self.options)}
