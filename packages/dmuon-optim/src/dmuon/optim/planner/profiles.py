"""Device and interconnect profiles: the rates the step-time model divides by.

Datasheet figures (dense, no structured sparsity; per GPU):

========  ===================  ========  ==========  ======================================
device    bf16 tensor FLOP/s   memory    HBM B/s     source
========  ===================  ========  ==========  ======================================
A100      312e12               80 GB     2.039e12    NVIDIA A100 Tensor Core GPU datasheet
                                                     (SXM4 80GB), 2021
A800      312e12               80 GB     2.039e12    NVIDIA A800 40GB/80GB datasheet (SXM4),
                                                     2022; NVLink 400 GB/s
H100      989e12               80 GB     3.35e12     NVIDIA H100 Tensor Core GPU datasheet
                                                     (SXM5), 2023
H200      989e12               141 GB    4.8e12      NVIDIA H200 Tensor Core GPU datasheet
                                                     (SXM), 2024
B200      2.25e15              180 GB    8.0e12      NVIDIA HGX B200 / DGX B200 datasheets,
                                                     2024 (per GPU: 1/8 of the 8-GPU figures)
========  ===================  ========  ==========  ======================================

Interconnects, per GPU and per direction (NVLink figures are half the bidirectional
totals the datasheets quote; InfiniBand is one NIC per GPU):

==============  =========  ===============================================
preset          B/s        source
==============  =========  ===============================================
nvlink3         300e9      A100 datasheet: NVLink 600 GB/s bidirectional
nvlink3-a800    200e9      A800 datasheet: NVLink 400 GB/s bidirectional
nvlink4         450e9      H100/H200 datasheets: 900 GB/s bidirectional
nvlink5         900e9      B200 datasheet: 1.8 TB/s bidirectional
ib-hdr          25e9       InfiniBand HDR, 200 Gb/s per port
ib-ndr          50e9       InfiniBand NDR, 400 Gb/s per port
eth-100g        12.5e9     100 Gb/s Ethernet
pcie4           25e9       PCIe 4.0 x16, ~32 GB/s raw per direction, less protocol
==============  =========  ===============================================

``α`` is the latency of one algorithm step (one hop of a ring): 1 µs on NVLink,
5 µs over InfiniBand, 10 µs over Ethernet — assumed, of the order nccl-tests shows
for small messages (an 8-byte all-reduce on 8 NVLink GPUs, 2(N−1) = 14 steps, takes
some 10–20 µs); ``--calibrate`` fits it on the machine at hand.

A datasheet rate is a peak. The *efficiencies* say how much of it a workload
sustains; they are stated assumptions, not measurements, until ``--calibrate``
replaces them: NS kernels at 0.6 of the tensor peak (large bf16/fp16 GEMMs on these
parts sustain 0.6–0.8 of peak in cuBLAS; the smaller s×s products of Gram NS less),
memory-bound element-wise work at 0.8 of HBM bandwidth, collectives at 0.8 of the
link rate (bus bandwidth over link rate of large NCCL collectives).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

__all__ = [
    "DEVICES",
    "INTERCONNECTS",
    "ClusterProfile",
    "DeviceProfile",
    "Link",
    "load_device_profile",
]


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator (or a CPU) as the step-time model sees it.

    Attributes:
        name: e.g. ``"H100"``.
        peak_flops: dense bf16/fp16 matrix-product rate, FLOP/s.
        memory_bytes: device memory.
        memory_bandwidth: memory bandwidth, B/s.
        ns_efficiency: fraction of ``peak_flops`` Newton–Schulz products sustain.
        memory_efficiency: fraction of ``memory_bandwidth`` element-wise work sustains.
        call_overhead: fixed seconds per (batched) Newton–Schulz call (launches).
        matrix_overhead: seconds of optimizer-step work per matrix a rank steps beyond
            its Newton–Schulz call (momentum, update, bookkeeping); 0 unless measured
            by ``--calibrate``.
        sign_overhead: seconds per matrix that Sign-Muon's rule takes beyond Muon's in a
            step (the sign, the spectral normalisation of the voted signs — a Gram
            product and ``λ_max`` —, the longer chain); 0 unless measured by
            ``--calibrate``.
        vote_overhead: seconds per element of the majority vote's own work on a rank
            (packing the signs, counting the votes, unpacking the result), beyond its
            two transfers; 0 unless measured by ``--calibrate`` on ranks.
        overlap: whether communication can run behind compute (a GPU: separate
            streams and copy engines); ``--calibrate`` on a CPU sets ``False``, since
            gloo's collectives compete with the ranks' compute for the same cores.
        source: where the figures come from.
        measured: rates measured by ``--calibrate`` (name → value), if any.
    """

    name: str
    peak_flops: float
    memory_bytes: float
    memory_bandwidth: float
    ns_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    call_overhead: float = 50e-6
    matrix_overhead: float = 0.0
    sign_overhead: float = 0.0
    vote_overhead: float = 0.0
    overlap: bool = True
    source: str = ""
    measured: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("peak_flops", "memory_bytes", "memory_bandwidth"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and value < float("inf")):
                raise ValueError(
                    f"device profile {self.name!r}: {name} must be a finite number > 0, "
                    f"got {value!r}"
                )
        for name in ("ns_efficiency", "memory_efficiency"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise ValueError(
                    f"device profile {self.name!r}: {name} must be in (0, 1], got {value!r}"
                )
        if not isinstance(self.overlap, bool):
            raise ValueError(
                f"device profile {self.name!r}: overlap must be true or false, got {self.overlap!r}"
            )
        for name in ("call_overhead", "matrix_overhead", "sign_overhead", "vote_overhead"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(
                    f"device profile {self.name!r}: {name} must be ≥ 0 seconds, got {value!r}"
                )

    @property
    def ns_flops_per_second(self) -> float:
        """Sustained Newton–Schulz rate: ``peak_flops · ns_efficiency``."""
        return self.peak_flops * self.ns_efficiency

    @property
    def bytes_per_second(self) -> float:
        """Sustained element-wise rate: ``memory_bandwidth · memory_efficiency``."""
        return self.memory_bandwidth * self.memory_efficiency

    def to_json(self) -> dict[str, Any]:
        """Plain dict, as :func:`load_device_profile` reads it."""
        return asdict(self)


_A = "NVIDIA {} Tensor Core GPU datasheet"
DEVICES: dict[str, DeviceProfile] = {
    "A100": DeviceProfile(
        "A100", 312e12, 80e9, 2.039e12, source=_A.format("A100") + " (SXM4 80GB)"
    ),
    "A800": DeviceProfile(
        "A800", 312e12, 80e9, 2.039e12, source="NVIDIA A800 datasheet (SXM4 80GB)"
    ),
    "H100": DeviceProfile("H100", 989e12, 80e9, 3.35e12, source=_A.format("H100") + " (SXM5)"),
    "H200": DeviceProfile("H200", 989e12, 141e9, 4.8e12, source=_A.format("H200") + " (SXM)"),
    "B200": DeviceProfile(
        "B200", 2.25e15, 180e9, 8.0e12, source="NVIDIA HGX/DGX B200 datasheets, per GPU"
    ),
}
"""Datasheet presets (see the module table for the sources)."""

DEFAULT_INTRA = {
    "A100": "nvlink3",
    "A800": "nvlink3-a800",
    "H100": "nvlink4",
    "H200": "nvlink4",
    "B200": "nvlink5",
}


@dataclass(frozen=True)
class Link:
    """A class of link: ``α + B/(bandwidth·efficiency)`` per message step (Hockney).

    Attributes:
        name: preset name or ``"custom"``.
        bandwidth: bytes per second per GPU and direction.
        alpha: seconds of latency per algorithm step.
        efficiency: fraction of ``bandwidth`` large collectives sustain.
        source: where the figures come from.
        collective_bandwidth: measured effective bandwidth (B/s) of a collective kind
            (``"all_gather"``, ``"reduce_scatter"``, …) where it differs from the
            all-reduce's: gloo's all-gather and reduce-scatter move their ring bytes far
            slower than its all-reduce (2.7× and 3.5× the ring time at 29 MB on 2 CPU
            ranks). Empty for presets: the ring model at ``effective_bandwidth``.
    """

    name: str
    bandwidth: float
    alpha: float = 10e-6
    efficiency: float = 0.8
    source: str = ""
    collective_bandwidth: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (isinstance(self.bandwidth, (int, float)) and 0 < self.bandwidth < float("inf")):
            raise ValueError(
                f"link {self.name!r}: bandwidth must be a finite number > 0 B/s, "
                f"got {self.bandwidth!r}"
            )
        if not (isinstance(self.alpha, (int, float)) and self.alpha >= 0):
            raise ValueError(f"link {self.name!r}: alpha must be ≥ 0 s, got {self.alpha!r}")
        if not (isinstance(self.efficiency, (int, float)) and 0 < self.efficiency <= 1):
            raise ValueError(
                f"link {self.name!r}: efficiency must be in (0, 1], got {self.efficiency!r}"
            )
        for kind, value in self.collective_bandwidth.items():
            if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ValueError(
                    f"link {self.name!r}: collective_bandwidth[{kind!r}] must be a finite "
                    f"number > 0 B/s, got {value!r}"
                )

    @property
    def effective_bandwidth(self) -> float:
        """``bandwidth · efficiency``."""
        return self.bandwidth * self.efficiency

    @classmethod
    def from_fit(cls, fit: Mapping[str, Any]) -> Link:
        """The link a :func:`~dmuon.optim.planner.calibrate.fit_link` result measured:
        its all-reduce α and bandwidth (already sustained: efficiency 1) and, where the
        fit has them, the per-collective bandwidths."""
        return cls(
            "measured",
            float(fit["bandwidth"]),
            alpha=float(fit["alpha"]),
            efficiency=1.0,
            source=f"all-reduce α–β fit on {fit.get('world')} {fit.get('backend')} ranks",
            collective_bandwidth={
                k: float(v) for k, v in fit.get("bandwidth_by_collective", {}).items()
            },
        )

    def bandwidth_for(self, collective: str) -> float:
        """The effective bandwidth a ``collective`` moves its bytes at (measured, else
        :attr:`effective_bandwidth`)."""
        return self.collective_bandwidth.get(collective, self.effective_bandwidth)


INTERCONNECTS: dict[str, Link] = {
    "nvlink3": Link("nvlink3", 300e9, 1e-6, source="A100 datasheet: NVLink 600 GB/s bidirectional"),
    "nvlink3-a800": Link(
        "nvlink3-a800", 200e9, 1e-6, source="A800 datasheet: NVLink 400 GB/s bidirectional"
    ),
    "nvlink4": Link("nvlink4", 450e9, 1e-6, source="H100 datasheet: NVLink 900 GB/s bidirectional"),
    "nvlink5": Link("nvlink5", 900e9, 1e-6, source="B200 datasheet: NVLink 1.8 TB/s bidirectional"),
    "ib-hdr": Link("ib-hdr", 25e9, 5e-6, source="InfiniBand HDR 200 Gb/s, one port per GPU"),
    "ib-ndr": Link("ib-ndr", 50e9, 5e-6, source="InfiniBand NDR 400 Gb/s, one port per GPU"),
    "eth-100g": Link("eth-100g", 12.5e9, 10e-6, source="100 Gb/s Ethernet"),
    "pcie4": Link("pcie4", 25e9, 1e-6, source="PCIe 4.0 x16"),
}
"""Interconnect presets, per GPU and direction (see the module table)."""


@dataclass(frozen=True)
class ClusterProfile:
    """``gpus`` devices, ``gpus_per_node`` per node, two classes of link.

    A group that fits in one node runs at the intra-node link; a group that spans
    nodes is limited by the inter-node link (a flat ring crosses a node boundary at
    every node, and its slowest hop sets the pace).
    """

    device: DeviceProfile
    gpus: int
    gpus_per_node: int
    intra: Link
    inter: Link

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int ≥ 1, got {value!r}")

    def link(self, group_size: int) -> Link:
        """The link a collective over ``group_size`` consecutive ranks runs at."""
        return self.intra if group_size <= self.gpus_per_node else self.inter

    def with_gpus(self, gpus: int) -> ClusterProfile:
        """The same cluster with ``gpus`` devices."""
        return replace(self, gpus=gpus)


def load_device_profile(spec: str) -> DeviceProfile:
    """A preset name (:data:`DEVICES`) or a JSON file.

    The JSON is either what :meth:`DeviceProfile.to_json` writes (``--calibrate``
    does), or a ``benchmarks/gpu_check.py`` result with a ``device`` block: there the
    planner reads the GPU name to pick the datasheet preset and, where the check
    measured a GEMM rate, uses it as the sustained Newton–Schulz rate.

    Raises:
        ValueError: an unknown preset, an unreadable file, or a field out of range
            (named).

    Examples:
        >>> load_device_profile("h100").peak_flops
        989000000000000.0
    """
    if spec.upper() in DEVICES:
        return DEVICES[spec.upper()]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(
            f"device {spec!r} is neither a preset ({', '.join(DEVICES)}) nor a JSON file"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"device profile {spec!r} is not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise ValueError(f"device profile {spec!r} must be a JSON object")
    if "peak_flops" in data:
        known = {f.name for f in fields(DeviceProfile)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"device profile {spec!r}: unknown field(s) {unknown}; known: {sorted(known)}"
            )
        return DeviceProfile(**data)
    return _from_gpu_check(data, spec)


def _from_gpu_check(data: dict[str, Any], spec: str) -> DeviceProfile:
    """``benchmarks/gpu_check.py``'s result: ``meta.gpu`` names the device; the NS rows'
    achieved ``tflops`` (median over the cases that ran) give the NS efficiency, or
    else the best measured GEMM rate (``gemm_flops``)."""
    meta = data.get("meta")
    name = str(meta.get("gpu", "")) if isinstance(meta, dict) else ""
    preset = next((DEVICES[k] for k in DEVICES if k in name.upper()), None)
    if preset is None:
        raise ValueError(
            f"device profile {spec!r}: field 'meta.gpu' ({name!r}) names none of "
            f"{list(DEVICES)}, and the file has no 'peak_flops'; write a profile with "
            "--calibrate or give a preset"
        )
    rates = sorted(
        float(r["tflops"]) * 1e12
        for r in data.get("ns", [])
        if isinstance(r, dict) and r.get("status") == "ok" and r.get("tflops")
    )
    gemm = [float(v) for v in (data.get("gemm_flops") or {}).values() if v]
    if rates:
        rate, what = rates[len(rates) // 2], "median NS rate"
    elif gemm:
        rate, what = max(gemm), "best GEMM rate"
    else:
        return replace(preset, source=f"{preset.source} (named by {spec})")
    eff = min(1.0, rate / preset.peak_flops)
    return replace(
        preset,
        ns_efficiency=eff,
        source=f"{preset.source}; NS efficiency {eff:.2f} = {what} in {Path(spec).name}",
        measured={"ns_flops_per_second": rate},
    )
