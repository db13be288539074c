"""``dmuon-plan --calibrate``: measure this machine's rates and write a device profile.

What is timed (median of ``repeats`` after warm-ups; wall clock, so a loaded machine
reads slower — the profile records the machine it ran on):

* a dense square GEMM in the compute dtype → ``peak_flops`` (the measured rate
  stands for the peak: ``ns_efficiency`` is then relative to what GEMMs reach here);
* :func:`dmuon.kernels.orthogonalize` on the model's matrix shapes (largest first,
  within a time budget) → ``ns_efficiency = Σ ns_flops / Σ seconds / peak_flops``;
* the same on an 8 × 8 matrix → ``call_overhead`` (the fixed cost of one call);
* a ``DMuon`` step (``mode="single"``) over one matrix of each timed shape →
  ``matrix_overhead = (t_step − Σ t_NS) / matrices`` (momentum, update, bookkeeping);
* the same step with ``rule="sign_muon"`` → ``sign_overhead = (t_sign − t_step) /
  matrices`` (the sign and spectral-normalisation links; one process votes alone);
* ``torch.optim.AdamW`` (foreach) on a 2²² -element parameter →
  ``memory_bandwidth = k·(3e + 16)/t`` (the bytes the step model charges AdamW) with
  ``memory_efficiency = 1`` (already a sustained rate);
* on a CPU, ``overlap = False``: gloo's collectives run on threads that compete
  with the ranks' compute for the same cores, so nothing hides behind compute;
* an all-reduce of 8 bytes and of 16 MiB on ``world`` ranks of the active backend
  (gloo on CPU, NCCL on GPUs) → α and bandwidth of the ring model, fitted as
  ``benchmarks/comm.py`` does: ``α = t_small / 2(N−1)``,
  ``bandwidth = 2(N−1)/N·B / (t_large − 2(N−1)α)``; and a packed
  :func:`dmuon.comm.majority_vote` of the same ``B/4`` elements → ``vote_overhead =
  (t_vote − t_wire)/elements``, ``t_wire`` the α–β time of its all-to-all and
  all-gather of ``(N−1)/N·elements/8`` bytes each (the packing and counting a rank
  does, under the same sharing of the cores as the ranks). The fit runs on gloo ranks
  (CPU tensors), so only a CPU profile takes ``vote_overhead`` from it; a CUDA profile
  keeps 0. An all-gather and a reduce-scatter of the same ``B`` on the ranks give their
  own effective bandwidths (ring bytes over time beyond ``(N−1)α``), which the link then
  uses for those collectives (gloo's are far slower per ring byte than its all-reduce).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from dmuon.kernels import ns_flops, orthogonalize
from dmuon.optim.planner.config import ModelSpec
from dmuon.optim.planner.profiles import DeviceProfile

__all__ = ["calibrate", "fit_link"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _link_rank(rank: int, world: int, repeats: int) -> tuple[float, float, float, dict[str, float]]:
    import torch.distributed as dist

    from dmuon.comm import VOTES_PER_BYTE, cost_model, majority_vote
    from dmuon.comm.torch_compat import all_gather_single, reduce_scatter_single

    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    small = torch.zeros(2, device=device)
    large = torch.zeros(4 << 20, device=device)

    def timed(fn: Callable[[], Any]) -> float:
        out = []
        for k in range(repeats + 2):
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            elapsed = torch.tensor([time.perf_counter() - t0], device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if k >= 2:
                out.append(elapsed.item())
        return statistics.median(out)

    t_small = timed(lambda: dist.all_reduce(small))
    t_large = timed(lambda: dist.all_reduce(large))
    alpha = t_small / (2 * (world - 1))
    moved = 2 * (world - 1) / world * large.nbytes
    bandwidth = moved / max(t_large - 2 * (world - 1) * alpha, 1e-9)
    signs = torch.randn(large.numel(), device=device)
    t_vote = timed(lambda: majority_vote(signs, method="packed"))
    # its all-to-all and all-gather: (N−1) latency steps and (N−1)/N of the packed bytes each
    wire = 2 * (
        (world - 1) * alpha + (world - 1) / world * signs.numel() / VOTES_PER_BYTE / bandwidth
    )
    # FSDP2's collectives: the ring bytes each rank sends, over what they took beyond α
    shard = torch.zeros(large.numel() // world, device=device)
    gathered = torch.empty(shard.numel() * world, device=device)
    by_collective = {}
    for kind, fn in (
        ("all_gather", lambda: all_gather_single(gathered, shard)),
        ("reduce_scatter", lambda: reduce_scatter_single(shard, gathered)),
    ):
        sent = cost_model(kind, gathered.nbytes, world).bytes_sent
        by_collective[kind] = sent / max(timed(fn) - (world - 1) * alpha, 1e-9)
    return alpha, bandwidth, max(0.0, t_vote - wire) / signs.numel(), by_collective


def fit_link(world: int = 2, repeats: int = 5, timeout: float = 300.0) -> dict[str, float]:
    """α (s) and bandwidth (B/s) of the ring all-reduce on ``world`` local ranks, and the
    majority vote's own seconds per element beyond its transfers.

    Uses gloo on CPU (:func:`dmuon.comm.testing.run_on_ranks`).
    """
    from dmuon.comm.testing import run_on_ranks

    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise ValueError(f"world must be an int ≥ 2 to time a collective, got {world!r}")
    out = run_on_ranks(_link_rank, world, args=(repeats,), timeout=timeout)
    alpha, bandwidth, vote, by_collective = out[0]
    return {
        "alpha": alpha,
        "bandwidth": bandwidth,
        "bandwidth_by_collective": by_collective,
        "vote_seconds_per_element": vote,
        "world": world,
        "backend": "gloo",
    }


def calibrate(
    spec: ModelSpec,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    repeats: int = 5,
    ns_budget_s: float = 20.0,
    link_world: int = 2,
    progress: Callable[[str], None] = lambda s: None,
) -> DeviceProfile:
    """Measure this machine and return its :class:`DeviceProfile` (see the module doc).

    Args:
        spec: the model whose matrix shapes are timed.
        device: ``"cpu"`` or ``"cuda"``.
        dtype: compute dtype of the GEMM and Newton–Schulz timings.
        repeats: timed repetitions per measurement (median).
        ns_budget_s: stop timing further NS shapes after this many seconds.
        link_world: ranks for the collective fit (0: skip it).
        progress: called with a line of text per measurement.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch.cuda.is_available() is False")
    size = 4096 if dev.type == "cuda" else 1024
    a = torch.randn(size, size, device=dev, dtype=dtype)
    b = torch.randn(size, size, device=dev, dtype=dtype)
    t = _median_seconds(lambda: a @ b, dev, repeats)
    peak = 2 * size**3 / t
    progress(f"GEMM {size}³ {dtype}: {peak / 1e9:.1f} GFLOP/s")

    shapes = sorted({(i.rows, i.cols) for i in spec.matrices}, key=lambda s: -s[0] * s[1])
    flops = seconds = 0.0
    timed_shapes: list[dict[str, Any]] = []
    start = time.perf_counter()
    for m, n in shapes:
        if time.perf_counter() - start > ns_budget_s and timed_shapes:
            break
        g = torch.randn(m, n, device=dev)

        def ns(g: torch.Tensor = g) -> torch.Tensor:
            return orthogonalize(g, method="gram", steps=5, compute_dtype=dtype)

        s = _median_seconds(ns, dev, max(1, repeats // 2))
        f = ns_flops(m, n, method="gram", steps=5)
        flops, seconds = flops + f, seconds + s
        timed_shapes.append({"shape": [m, n], "seconds": s, "flops_per_second": f / s})
        progress(f"NS {m}×{n}: {f / s / 1e9:.1f} GFLOP/s")
    ns_rate = flops / seconds
    # One DMuon step (mode "single") over one matrix of each timed shape: what it takes
    # beyond the Newton–Schulz calls is the per-matrix optimizer overhead.
    from dmuon.optim import DMuon

    params = [torch.nn.Parameter(torch.randn(*r["shape"], device=dev)) for r in timed_shapes]
    for q in params:
        q.grad = torch.randn_like(q)
    step_opt = DMuon(
        [{"params": params}], mode="single", ns_compute_dtype=str(dtype).removeprefix("torch.")
    )
    # the overheads are differences of two step times: a median of every repeat each
    t_step = _median_seconds(step_opt.step, dev, repeats)
    matrix_overhead = max(0.0, (t_step - seconds) / len(params))
    progress(f"DMuon step beyond NS: {matrix_overhead * 1e6:.0f} µs per matrix")
    sign_opt = DMuon(
        [{"params": params}],
        rule="sign_muon",
        mode="single",
        ns_compute_dtype=str(dtype).removeprefix("torch."),
    )
    t_sign = _median_seconds(sign_opt.step, dev, repeats)
    sign_overhead = max(0.0, (t_sign - t_step) / len(params))
    progress(f"Sign-Muon beyond Muon: {sign_overhead * 1e6:.0f} µs per matrix")
    tiny = torch.randn(8, 8, device=dev)
    overhead = _median_seconds(
        lambda: orthogonalize(tiny, method="gram", steps=5, compute_dtype=dtype), dev, repeats
    )
    progress(f"NS call overhead (8×8): {overhead * 1e6:.0f} µs")

    k = 1 << 22
    p = torch.nn.Parameter(torch.zeros(k, device=dev))
    p.grad = torch.randn(k, device=dev)
    opt = torch.optim.AdamW([p], lr=1e-3, foreach=True)
    t_adam = _median_seconds(opt.step, dev, repeats)
    bandwidth = k * (3 * 4 + 16) / t_adam
    progress(f"AdamW on {k} fp32 elements: {bandwidth / 1e9:.1f} GB/s effective")

    measured: dict[str, Any] = {
        "gemm_flops_per_second": peak,
        "ns_flops_per_second": ns_rate,
        "ns_shapes": timed_shapes,
        "adamw_seconds_per_element": t_adam / k,
        "dtype": str(dtype).removeprefix("torch."),
        "model": spec.name,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None,
        },
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if link_world:
        link = fit_link(link_world, repeats)
        measured["link"] = link
        progress(
            f"all-reduce on {link_world} ranks ({link['backend']}): "
            f"α {link['alpha'] * 1e6:.0f} µs, {link['bandwidth'] / 1e9:.2f} GB/s"
        )
    if dev.type == "cuda":
        memory = float(torch.cuda.get_device_properties(dev).total_memory)
        name = torch.cuda.get_device_name(dev)
    else:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        name = f"cpu ({measured['machine']['cpu']}, {torch.get_num_threads()} threads)"
    return DeviceProfile(
        name=name,
        peak_flops=peak,
        memory_bytes=memory,
        memory_bandwidth=bandwidth,
        ns_efficiency=min(1.0, ns_rate / peak),
        memory_efficiency=1.0,
        call_overhead=overhead,
        matrix_overhead=matrix_overhead,
        sign_overhead=sign_overhead,
        # the link fit runs on gloo ranks: its vote timing is a CPU's, so a GPU profile
        # leaves the vote's own work unmodelled (0) rather than charge it a CPU's rate
        vote_overhead=(
            measured["link"]["vote_seconds_per_element"]
            if link_world and dev.type == "cpu"
            else 0.0
        ),
        overlap=dev.type == "cuda",
        source=f"dmuon-plan --calibrate, {measured['date']}",
        measured=measured,
    )
