"""Per-shape choice between the torch path and the Triton kernels, measured, checked, cached.

Which implementation of the symmetric products is fastest depends on the GPU,
the Gram size ``m``, the aspect ratio ``n/m``, the batch and the dtype: cuBLAS is
hard to beat on small or square products, the triangle-only kernels win on large
ones. So the first time a problem is seen ``"auto"`` measures instead of guessing
(DMuon's ``syrk_dispatch``; Triton's own ``@autotune`` does the same one level down,
for tile sizes):

1. build a random normalised batch of that shape and dtype (the user's data is
   not used: a zero gradient would make the cross-check vacuous);
2. run the torch path on it: the reference;
3. run every candidate; reject one that raises, or whose result is not finite or
   differs from the reference by more than the cross-check tolerance;
4. time the reference and the survivors with the timer; the fastest wins;
5. remember the decision in memory and in a JSON file keyed by GPU name, problem
   (method, batch, m, n, dtype, steps, restarts) and library versions.

A later process on the same GPU with the same versions reads the file and does
not measure again. The timer, the candidates, the device name and the versions
are injectable so the logic is testable without a GPU and without real time.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import statistics
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from dmuon.kernels._version import __version__
from dmuon.kernels.symmetric_ops import TORCH_OPS, SymmetricOps

__all__ = [
    "CROSS_CHECK_TOLERANCE",
    "Autotuner",
    "Decision",
    "TuneKey",
    "autotune_cache_dir",
    "clear_autotune_cache",
    "cross_check_error",
    "cuda_event_timer",
    "default_autotuner",
]

Timer = Callable[[Callable[[], object]], float]
Iterate = Callable[[torch.Tensor, SymmetricOps], torch.Tensor]

CROSS_CHECK_TOLERANCE: dict[torch.dtype, float] = {  # see the docstring below
    # Largest entry of |candidate − torch| over the largest entry of |torch|, after a whole
    # Newton–Schulz call. Two correct implementations differ only by rounding compounded
    # over ~5 steps: a few units of the dtype's unit roundoff times the growth of the
    # iteration (fp16 u = 4.9e-4, bf16 u = 3.9e-3, fp32 u = 6e-8). A wrong tile, a
    # missing mirror or a bad coefficient moves entries by O(1) and is far outside.
    torch.float16: 5e-2,
    torch.bfloat16: 2e-1,
    torch.float32: 1e-3,
}
"""Largest :func:`cross_check_error` a candidate may show against the torch path, per
compute dtype, before the autotuner rejects it (a few unit roundoffs times the growth of
five Newton–Schulz steps; a wrong kernel is off by O(1))."""
_FORMAT = 1
_log = logging.getLogger("dmuon.kernels")


def cuda_event_timer(fn: Callable[[], object], *, warmup: int = 1, repeat: int = 5) -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs, timed with CUDA events.

    Examples:
        >>> import torch
        >>> from dmuon.kernels import cuda_event_timer
        >>> X = torch.randn(1024, 1024, device="cuda")  # on a CUDA machine
        >>> seconds = cuda_event_timer(lambda: X @ X)
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def cross_check_error(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """``max|candidate − reference| / max|reference|`` in float64; ``inf`` if not finite.

    The autotuner rejects a candidate whose error exceeds
    :data:`CROSS_CHECK_TOLERANCE` for the compute dtype.

    Examples:
        >>> import torch
        >>> from dmuon.kernels import cross_check_error
        >>> round(cross_check_error(torch.tensor([1.0, 2.1]), torch.tensor([1.0, 2.0])), 4)
        0.05
        >>> cross_check_error(torch.tensor([float("nan")]), torch.tensor([1.0]))
        inf
    """
    c, r = candidate.to(torch.float64), reference.to(torch.float64)
    if c.shape != r.shape or not bool(torch.isfinite(c).all()):
        return float("inf")
    scale = float(r.abs().max()) if r.numel() else 0.0
    diff = float((c - r).abs().max()) if r.numel() else 0.0
    return diff / scale if scale > 0 else diff


def autotune_cache_dir() -> pathlib.Path:
    """Where the autotune decisions are kept on disk.

    ``$DMUON_KERNELS_CACHE_DIR`` if set, else the platform's user cache directory:
    ``$XDG_CACHE_HOME/dmuon-kernels`` (``~/.cache/dmuon-kernels``) on Linux,
    ``~/Library/Caches/dmuon-kernels`` on macOS, ``%LOCALAPPDATA%\\dmuon-kernels\\Cache``
    on Windows.

    Examples:
        >>> import os
        >>> from dmuon.kernels import autotune_cache_dir
        >>> os.environ["DMUON_KERNELS_CACHE_DIR"] = "/tmp/my-cache"
        >>> str(autotune_cache_dir())
        '/tmp/my-cache'
    """
    explicit = os.environ.get("DMUON_KERNELS_CACHE_DIR")
    if explicit:
        return pathlib.Path(explicit).expanduser()
    home = pathlib.Path.home()
    if sys.platform == "darwin":
        return home / "Library" / "Caches" / "dmuon-kernels"
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or str(home / "AppData" / "Local")
        return pathlib.Path(base) / "dmuon-kernels" / "Cache"
    base = os.environ.get("XDG_CACHE_HOME") or str(home / ".cache")
    return pathlib.Path(base) / "dmuon-kernels"


@dataclass(frozen=True)
class TuneKey:
    """What a decision depends on. Its string form is the key of the on-disk cache.

    A decision is only reused for the same GPU, problem and library versions: a new
    driver, torch or Triton release re-tunes.

    Examples:
        >>> from dmuon.kernels import TuneKey
        >>> key = TuneKey("NVIDIA H100 sm90", "gram", 1, 1024, 4096, "float16", 5, (2,),
        ...               (("torch", "2.13.0"),))
        >>> str(key)
        'NVIDIA H100 sm90|gram|B=1|1024x4096|float16|steps=5|restarts=2|torch=2.13.0'
    """

    device: str
    method: str
    batch: int
    m: int
    n: int
    dtype: str
    steps: int
    restarts: tuple[int, ...]
    versions: tuple[tuple[str, str], ...]

    def __str__(self) -> str:
        versions = ",".join(f"{k}={v}" for k, v in self.versions)
        restarts = ",".join(map(str, self.restarts))
        return (
            f"{self.device}|{self.method}|B={self.batch}|{self.m}x{self.n}|{self.dtype}|"
            f"steps={self.steps}|restarts={restarts}|{versions}"
        )


@dataclass
class Decision:
    """The outcome of tuning one key: the winner, every timing, every rejection and why.

    Examples:
        >>> from dmuon.kernels import Decision
        >>> d = Decision("triton", {"torch": 2e-3, "triton": 1e-3}, {"triton_syrk": "error 0.4"})
        >>> Decision.from_json(d.to_json()) == d
        True
    """

    winner: str
    seconds: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"winner": self.winner, "seconds": self.seconds, "rejected": self.rejected}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Decision:
        return cls(str(d["winner"]), dict(d.get("seconds", {})), dict(d.get("rejected", {})))


def _default_versions() -> tuple[tuple[str, str], ...]:
    import importlib.metadata

    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = "none"
    return (
        ("dmuon-kernels", __version__),
        ("torch", torch.__version__),
        ("triton", triton_version),
        ("cuda", str(torch.version.cuda)),
    )


def _default_device_name(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm{major}{minor}"


_DEFAULT_DIR = object()


class Autotuner:
    """Chooses, per problem, the fastest :class:`~dmuon.kernels.SymmetricOps` that is correct.

    Args:
        timer: ``timer(fn) -> seconds`` (default :func:`cuda_event_timer`).
        cache_dir: directory of the JSON decision file; ``None`` keeps decisions in
            memory only; default :func:`autotune_cache_dir` read at construction.
        versions: ``(name, version)`` pairs that invalidate decisions when they change
            (default: dmuon-kernels, torch, triton, CUDA).
        device_name: ``device -> str`` naming the GPU (default: name and capability).
        tolerance: cross-check tolerance per compute dtype (default
            :data:`CROSS_CHECK_TOLERANCE`).

    Examples:
        >>> from dmuon.kernels import Autotuner, TORCH_OPS
        >>> tuner = Autotuner(timer=lambda fn: 1.0, cache_dir=None, device_name=lambda d: "cpu")
        >>> key = tuner.key(torch.device("cpu"), "gram", 1, 8, 32, torch.float32, 5, (2,))
        >>> tuner.lookup(key) is None
        True
    """

    def __init__(
        self,
        *,
        timer: Timer | None = None,
        cache_dir: Any = _DEFAULT_DIR,
        versions: tuple[tuple[str, str], ...] | None = None,
        device_name: Callable[[torch.device], str] | None = None,
        tolerance: Mapping[torch.dtype, float] | None = None,
    ) -> None:
        self.timer: Timer = timer or cuda_event_timer
        directory = autotune_cache_dir() if cache_dir is _DEFAULT_DIR else cache_dir
        self.cache_file: pathlib.Path | None = (
            None if directory is None else pathlib.Path(directory) / f"autotune-v{_FORMAT}.json"
        )
        self.versions = versions if versions is not None else _default_versions()
        self.device_name = device_name or _default_device_name
        self.tolerance = dict(tolerance or CROSS_CHECK_TOLERANCE)
        self._memory: dict[str, Decision] = {}
        self._disk: dict[str, Any] | None = None
        self._disk_warned = False

    def key(
        self,
        device: torch.device,
        method: str,
        batch: int,
        m: int,
        n: int,
        dtype: torch.dtype,
        steps: int,
        restarts: tuple[int, ...],
    ) -> TuneKey:
        """The key of a problem: ``(B, m, n)`` wide batch, compute dtype, schedule length."""
        return TuneKey(
            self.device_name(device),
            method,
            batch,
            m,
            n,
            str(dtype).removeprefix("torch."),
            steps,
            tuple(restarts),
            tuple(self.versions),
        )

    # -- cache --------------------------------------------------------------------------

    def _read_disk(self) -> dict[str, Any]:
        if self._disk is None:
            self._disk = {}
            if self.cache_file is not None and self.cache_file.exists():
                try:
                    data = json.loads(self.cache_file.read_text())
                    if data.get("format") == _FORMAT:
                        self._disk = dict(data.get("entries", {}))
                except (OSError, ValueError, AttributeError) as exc:
                    _log.warning("ignoring unreadable autotune cache %s: %s", self.cache_file, exc)
        return self._disk

    def _write_disk(self, key: str, decision: Decision) -> None:
        if self.cache_file is None:
            return
        try:
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            self._disk = None  # merge with what other processes wrote meanwhile
            entries = dict(self._read_disk())
            entries[key] = decision.to_json()
            payload = json.dumps({"format": _FORMAT, "entries": entries}, indent=1, sort_keys=True)
            # Write-then-rename: concurrent ranks never see a half-written file.
            fd, tmp = tempfile.mkstemp(dir=self.cache_file.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(payload)
            os.replace(tmp, self.cache_file)
            self._disk = entries
        except OSError as exc:
            if not self._disk_warned:
                _log.warning("cannot write autotune cache %s: %s", self.cache_file, exc)
                self._disk_warned = True

    def lookup(self, key: TuneKey) -> Decision | None:
        """The remembered decision for ``key``: memory first, then the file; ``None`` if unseen."""
        text = str(key)
        if text in self._memory:
            return self._memory[text]
        entry = self._read_disk().get(text)
        if entry is None:
            return None
        try:
            decision = Decision.from_json(entry)
        except (KeyError, TypeError, ValueError):
            return None
        self._memory[text] = decision
        return decision

    def clear(self, *, disk: bool = False) -> None:
        """Forget decisions in memory (and delete the file with ``disk=True``)."""
        self._memory.clear()
        self._disk = None
        if disk and self.cache_file is not None:
            self.cache_file.unlink(missing_ok=True)

    # -- tuning -------------------------------------------------------------------------

    def tune(
        self,
        key: TuneKey,
        iterate: Iterate,
        candidates: Mapping[str, SymmetricOps],
        sample: torch.Tensor,
        reference: SymmetricOps = TORCH_OPS,
    ) -> Decision:
        """Cross-check and time ``candidates`` against ``reference`` on ``sample``; remember.

        ``iterate(X, ops)`` runs the iteration with one set of products. The reference
        always survives (it is what the others are checked against).
        """
        tol = self.tolerance.get(sample.dtype, self.tolerance[torch.float32])
        expected = iterate(sample, reference)
        decision = Decision(winner=reference.name)
        survivors = {reference.name: reference}
        for name, ops in candidates.items():
            if name == reference.name:
                continue
            try:
                err = cross_check_error(iterate(sample, ops), expected)
            except Exception as exc:  # a kernel that cannot run here is just not chosen
                decision.rejected[name] = f"raised {type(exc).__name__}: {exc}"
                continue
            if not err <= tol:
                decision.rejected[name] = f"cross-check error {err:.3g} > tolerance {tol:.3g}"
                continue
            survivors[name] = ops
        for name, ops in survivors.items():

            def run(ops: SymmetricOps = ops) -> torch.Tensor:
                return iterate(sample, ops)

            decision.seconds[name] = float(self.timer(run))
        decision.winner = min(decision.seconds, key=decision.seconds.__getitem__)
        _log.info("autotune %s -> %s %s", key, decision.winner, decision.seconds)
        if decision.rejected:
            _log.info("autotune %s rejected %s", key, decision.rejected)
        self._memory[str(key)] = decision
        self._write_disk(str(key), decision)
        return decision

    def choose(
        self,
        key: TuneKey,
        iterate: Iterate,
        candidates: Mapping[str, SymmetricOps],
        make_sample: Callable[[], torch.Tensor],
        reference: SymmetricOps = TORCH_OPS,
    ) -> SymmetricOps:
        """The remembered winner for ``key``, tuning first if it was never seen."""
        decision = self.lookup(key)
        options = {reference.name: reference, **candidates}
        if decision is None or decision.winner not in options:
            decision = self.tune(key, iterate, candidates, make_sample(), reference)
        return options[decision.winner]


_default: Autotuner | None = None


def default_autotuner() -> Autotuner:
    """The process-wide :class:`Autotuner` ``backend="auto"`` uses (created on first use).

    Examples:
        >>> from dmuon.kernels import default_autotuner
        >>> default_autotuner() is default_autotuner()
        True
    """
    global _default
    if _default is None:
        _default = Autotuner()
    return _default


def clear_autotune_cache(*, disk: bool = False) -> None:
    """Forget the default autotuner's decisions (and delete its file with ``disk=True``).

    Examples:
        >>> from dmuon.kernels import clear_autotune_cache
        >>> clear_autotune_cache()
    """
    global _default
    if _default is not None:
        _default.clear(disk=disk)
    elif disk:
        (autotune_cache_dir() / f"autotune-v{_FORMAT}.json").unlink(missing_ok=True)
    _default = None
