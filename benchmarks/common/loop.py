"""The single-process training loop of the convergence benchmark, and evaluation.

Each step: batch ``t`` of the sampler → mean next-byte cross-entropy → backward →
optional global-norm gradient clipping → optimizer step(s) → scheduler step. The
validation loss (mean over a fixed list of batches) is measured before the first
step, every ``eval_every`` steps and after the last. Wall-clock counts training
only (evaluation excluded) so curves of different optimizers compare the cost of
their steps.

Example:
    >>> import torch
    >>> from benchmarks.common.data import BatchSampler
    >>> from benchmarks.common.loop import train
    >>> from benchmarks.common.model import GPT, GPTConfig
    >>> from benchmarks.common.optimizers import build_optimizer
    >>> data = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    >>> model = GPT(GPTConfig.tiny())
    >>> opt = build_optimizer("adamw", model, lr=3e-3)
    >>> sampler = BatchSampler(data, 4, 32)
    >>> curve = train(model, opt, sampler, [sampler.batch(10_000)], steps=4, eval_every=2)
    >>> curve.eval_steps
    [0, 2, 4]
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import torch

from benchmarks.common.data import BatchSampler
from benchmarks.common.model import GPT
from benchmarks.common.optimizers import Optimizers

__all__ = ["Curve", "evaluate", "train"]


@dataclasses.dataclass
class Curve:
    """What one training run measured.

    Attributes:
        train_loss: loss of step t's batch before its update, t = 1..steps run.
        train_seconds: cumulative training wall-clock after step t.
        eval_steps: steps at which validation ran (0 = initial weights).
        val_loss: validation loss at those steps.
        eval_seconds: cumulative training wall-clock at those steps.
        optimizer_seconds: total time spent in optimizer + scheduler steps.
        diverged: a non-finite loss stopped the run early.
    """

    train_loss: list[float] = dataclasses.field(default_factory=list)
    train_seconds: list[float] = dataclasses.field(default_factory=list)
    eval_steps: list[int] = dataclasses.field(default_factory=list)
    val_loss: list[float] = dataclasses.field(default_factory=list)
    eval_seconds: list[float] = dataclasses.field(default_factory=list)
    optimizer_seconds: float = 0.0
    diverged: bool = False

    @property
    def final_val_loss(self) -> float:
        return self.val_loss[-1] if self.val_loss and not self.diverged else math.inf

    def as_dict(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d["final_val_loss"] = self.final_val_loss
        return d


def _synchronize(device: torch.device) -> None:
    # Kernels run asynchronously on an accelerator: wait so the clock measures them.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def evaluate(model: GPT, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss over ``batches`` (equal-size batches, so the mean of means is exact)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total = sum(float(model.loss(x.to(device), y.to(device))) for x, y in batches)
    model.train(was_training)
    return total / len(batches)


def train(
    model: GPT,
    optimizers: Optimizers,
    sampler: BatchSampler,
    val_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    steps: int,
    eval_every: int,
    clip: float = 0.0,
    on_step: Callable[[int, float, float | None], None] | None = None,
) -> Curve:
    """Train ``model`` for ``steps`` steps on batches ``0..steps-1`` of ``sampler``.

    Args:
        model: the model (trained in place).
        optimizers: from :func:`~benchmarks.common.optimizers.build_optimizer`, with
            a schedule attached if wanted.
        sampler: the training batches (batch t at step t, the same for every run).
        val_batches: the fixed validation batches.
        steps: number of updates.
        eval_every: validation period in steps.
        clip: global gradient-norm clipping threshold, 0 for none.
        on_step: called as ``on_step(step, train_loss, val_loss_or_None)`` after
            every step (for progress bars).

    Raises:
        ValueError: ``steps`` or ``eval_every`` < 1, or ``clip`` < 0.
    """
    if steps < 1 or eval_every < 1:
        raise ValueError(f"steps and eval_every must be >= 1, got {steps} and {eval_every}")
    if clip < 0:
        raise ValueError(f"clip must be >= 0 (0 = no clipping), got {clip}")
    curve = Curve()
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    elapsed = 0.0

    def record_eval(step: int) -> float:
        loss = evaluate(model, val_batches)
        curve.eval_steps.append(step)
        curve.val_loss.append(loss)
        curve.eval_seconds.append(elapsed)
        return loss

    record_eval(0)
    model.train()
    for step in range(1, steps + 1):
        x, y = sampler.batch(step - 1, device=device)
        t0 = time.perf_counter()
        loss = model.loss(x, y)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        _synchronize(device)
        t1 = time.perf_counter()
        optimizers.step()
        optimizers.zero_grad()
        _synchronize(device)
        t2 = time.perf_counter()
        elapsed += t2 - t0
        curve.optimizer_seconds += t2 - t1
        value = float(loss.detach())
        curve.train_loss.append(value)
        curve.train_seconds.append(elapsed)
        if not math.isfinite(value):
            curve.diverged = True
            if on_step is not None:
                on_step(step, value, None)
            break
        val = record_eval(step) if step % eval_every == 0 or step == steps else None
        if on_step is not None:
            on_step(step, value, val)
    return curve
