"""What one optimizer step did on this rank: seconds per phase and counts.

The engine fills a :class:`StepReport` on every step (``DMuon.last_step``) so that
benchmarks can split a step into communication wait, the rule (momentum and
Newton–Schulz) and applying the update without instrumenting the optimizer, and
tests can check who orthogonalised what.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["PHASES", "StepReport"]

PHASES = ("comm_wait", "rule", "apply", "publish", "scalar")


@dataclass
class StepReport:
    """Seconds per phase and counts of one ``DMuon.step`` on this rank.

    Phases (host wall-clock seconds; on a GPU they measure launch and wait time,
    not kernel time, unless the caller synchronises):

    * ``comm_wait``: waiting for gradients to arrive (reductions, all-to-alls, the
      presence flags) and for earlier publications to finish;
    * ``rule``: the update rule on stacked batches (momentum, Newton–Schulz, …);
    * ``apply``: weight decay and the scaled update;
    * ``publish``: starting (and, where the mode must, finishing) the transfer of
      results to the other ranks;
    * ``scalar``: the AdamW/Lion step of the scalar parameters.

    Attributes:
        mode: the execution mode.
        rank: this rank in the engine's group (0 for ``single``).
        world_size: ranks of that group (HSDP: replicate × shard).
        seconds: seconds per phase, plus ``"total"``.
        matrices: matrices this rank ran the rule on (a 3-D stack of ``E`` counts
            ``E``; a fused QKV split into three counts three).
        stepped: names of the matrix parameters this rank stepped.
        rule_calls: batched rule calls (one per bucket chunk).
        groups: pipeline groups processed.

    Examples:
        >>> report = StepReport("single")
        >>> with report.phase("rule"):
        ...     pass
        >>> sorted(report.seconds)
        ['rule']
    """

    mode: str
    rank: int = 0
    world_size: int = 1
    seconds: dict[str, float] = field(default_factory=dict)
    matrices: int = 0
    stepped: list[str] = field(default_factory=list)
    rule_calls: int = 0
    groups: int = 0

    def add(self, phase: str, seconds: float) -> None:
        """Add ``seconds`` to ``phase``."""
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body and add it to phase ``name``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def as_dict(self) -> dict[str, object]:
        """Plain values for JSON."""
        return {
            "mode": self.mode,
            "rank": self.rank,
            "world_size": self.world_size,
            "seconds": dict(self.seconds),
            "matrices": self.matrices,
            "stepped": list(self.stepped),
            "rule_calls": self.rule_calls,
            "groups": self.groups,
        }
