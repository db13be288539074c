"""Low-precision state of the matrix rules: stored in ``state_dtype``, computed wide.

``DMuon(..., state_dtype="bfloat16")`` keeps the matrix rules' state (momentum,
second moments) in bfloat16: half the bytes of fp32 state. Every step reads it
*up* into the compute dtype (fp32 for fp16/bf16/fp32 parameters, fp64 for fp64 ones),
runs the whole rule there, and rounds the new state *down* once on write:

    S₃₂ ← upcast(S_bf16);   (U, S₃₂) ← rule(G, S₃₂);   S_bf16 ← round(clamp(S₃₂, ±F))

with ``F`` the largest finite value of ``state_dtype`` (the momentum's saturation
contract, :func:`~dmuon.optim.transforms.momentum.saturate_`, holds in the stored
dtype too). The update ``U`` comes from the fp32 state before rounding, so only what
is *carried to the next step* is rounded.

Rounding (``state_rounding``):

- ``"nearest"`` (default): round-to-nearest, ties to even — the IEEE-754 default and
  what ``Tensor.to``/``copy_`` do. Deterministic; its error is at most half a unit in
  the last place (2⁻⁹ relative for bf16's 8-bit significand), but it is *biased*
  when the increment of a step is below half an ulp of the state: an EMA
  ``v ← β·v + (1 − β)·g²`` with ``1 − β`` < 2⁻⁹ stops moving ("stagnation").
- ``"stochastic"`` (bfloat16 only): round up with probability equal to the distance
  from the lower neighbour, so ``E[round(x)] = x`` and small increments survive in
  expectation — the remedy of Zamirai, Zhang, Aberger and De Sa, "Revisiting
  BFloat16 Training" (2020, arXiv:2010.06192), §3–4. Implemented on the fp32 bit
  pattern: add a uniform random integer in ``[0, 2¹⁶)`` to the 16 bits bf16 drops,
  then truncate them. The random bits come from a ``torch.Generator`` seeded from the
  step number, the parameter's *name* (``param_names``; without names, its position in
  its group) and where the block sits in it (:func:`rounding_seed`), so a run is
  reproducible and a matrix draws the same bits whichever rank steps it, whatever
  batch it sits in and in whatever order a rank lists its group's parameters.

Scalar parameters (AdamW/Lion) keep fp32 state whatever ``state_dtype`` says: their
``exp_avg_sq`` holds squares of gradients that bf16's 8-bit significand resolves
poorly, ε underflows in low precision, and they are a small part of the state of a
model whose matrices take Muon (DESIGN.md, "Numerics").
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import torch

from dmuon.optim.hyperparameters import COMPUTE_DTYPES, STATE_ROUNDING

__all__ = [
    "STATE_ROUNDING",
    "compute_dtype_for",
    "name_key",
    "round_state_",
    "rounding_seed",
    "state_dtype_of",
    "stochastic_round_bf16",
    "store_saturated",
]


def state_dtype_of(group: Any, param_dtype: torch.dtype, spec: Any = None) -> torch.dtype:
    """The dtype a matrix group's state buffer ``spec`` is stored in:
    ``group["state_dtype"]`` or, when that is ``None``, the parameter's dtype — but fp32
    for a second moment (``spec.squares``) of fp16 parameters, whose squares would
    underflow in fp16.

    Examples:
        >>> import torch
        >>> from dmuon.optim.transforms import StateSpec
        >>> state_dtype_of({"state_dtype": "bfloat16"}, torch.float32)
        torch.bfloat16
        >>> state_dtype_of({"state_dtype": None}, torch.float16)
        torch.float16
        >>> state_dtype_of({"state_dtype": None}, torch.float16, StateSpec("v", "matrix", True))
        torch.float32
    """
    name = group.get("state_dtype")
    if name is not None:
        return COMPUTE_DTYPES[name]
    if param_dtype == torch.float16 and getattr(spec, "squares", False):
        return torch.float32
    return param_dtype


def compute_dtype_for(param_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a rule's arithmetic when ``state_dtype`` is set: at least fp32.

    Examples:
        >>> import torch
        >>> compute_dtype_for(torch.bfloat16), compute_dtype_for(torch.float64)
        (torch.float32, torch.float64)
    """
    return torch.promote_types(param_dtype, torch.float32)


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` rounded to bfloat16 stochastically: unbiased, ``E[result] = x``.

    A bf16 number is the top 16 bits of an fp32 one. Adding a uniform integer
    ``r ∈ [0, 2¹⁶)`` to the fp32 bit pattern and truncating the low 16 bits carries
    into the kept bits with probability ``low16 / 2¹⁶`` — the distance of ``x`` from
    its lower (in magnitude) bf16 neighbour in units of the gap — which is stochastic
    rounding (Zamirai et al. 2020, "Revisiting BFloat16 Training", eq. 2). Sign and
    magnitude are separate in IEEE-754, so the same holds for negative numbers;
    infinities stay infinite (their low bits are zero). Finite inputs above bf16's
    largest finite value may round to ±inf: clamp first (:func:`round_state_` does).

    Args:
        x: any floating tensor (converted to fp32 first, round-to-nearest).
        generator: the source of the random bits (on ``x``'s device).

    Examples:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.full((10000,), 1.0 + 2**-9)  # a quarter of the way from 1 to 1 + 2⁻⁷
        >>> r = stochastic_round_bf16(x, g)
        >>> sorted(set(r.float().tolist()))  # only the two neighbours
        [1.0, 1.0078125]
        >>> round(r.float().mean().item(), 3)  # 1 + 2⁻⁹ in expectation
        1.002
    """
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    noise = torch.randint(
        0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator
    )
    kept = (bits + noise) & -65536  # ~0xFFFF as an int32: clear the 16 bits bf16 drops
    out = kept.view(torch.float32).to(torch.bfloat16)  # exact: the low bits are zero
    # a NaN whose payload carries past the sign bit would come out as a number
    return torch.where(torch.isnan(bits.view(torch.float32)), out.new_tensor(float("nan")), out)


@functools.lru_cache(maxsize=65536)
def name_key(name: str) -> int:
    """A parameter name as a 64-bit integer, the same in every process and run.

    BLAKE2b of the UTF-8 name, its first 8 bytes: stable across processes, machines and
    Python versions — Python's ``hash()`` of a ``str`` is salted per process
    (``PYTHONHASHSEED``), so two ranks would disagree. Cached: a step seeds every matrix.

    Examples:
        >>> name_key("h1.weight") == name_key("h1.weight")
        True
        >>> name_key("h1.weight") == name_key("h2.weight")
        False
        >>> name_key("h1.weight")  # fixed for good: the seeds of a run depend on it
        3945095573980450193
    """
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def rounding_seed(
    step: int,
    matrix: str | int,
    start: int,
    shape: tuple[int, ...],
    offset: tuple[int, ...] = (),
) -> int:
    """The seed of the stochastic rounding of one entry's state at one step.

    The contract: a function of *what* is rounded, never of *who* rounds it or *how* it
    is batched — so every rank, every listing order and every batch cut draws the same
    bits for the same matrix, and ranks that step a replicated matrix alike stay equal
    bit for bit. Its inputs:

    - ``step``: the parameter's step count;
    - ``matrix``: the parameter's name (``param_names``, hashed by :func:`name_key`),
      which every rank gives alike whatever order it lists a group's parameters in;
      an ``int`` — its position in its group — only where the group has no names (then
      the engine too names a parameter by position, and ranks must list alike);
    - ``start``: the first row of its block (the blocks of a fused QKV split);
    - ``shape``: the matrix shape;
    - ``offset``: where the part a rank steps sits in the whole parameter, ``()`` for
      the whole of it: a tensor-parallel shard's (dimension, offset), the global
      offset of a rank's local experts — so distinct parts draw distinct bits.

    Mixed into 64 bits by SplitMix64's finaliser. Parameters of different names (and
    blocks, parts) draw different bits; rounding stays unbiased for each.

    Examples:
        >>> rounding_seed(1, "h1.weight", 0, (4, 4)) == rounding_seed(1, "h1.weight", 0, (4, 4))
        True
        >>> rounding_seed(1, "h1.weight", 0, (4, 4)) == rounding_seed(2, "h1.weight", 0, (4, 4))
        False
        >>> rounding_seed(1, "h1.weight", 0, (4, 4)) == rounding_seed(1, "h2.weight", 0, (4, 4))
        False
        >>> rounding_seed(1, "w", 0, (4, 4), (4, 0, 0)) == rounding_seed(1, "w", 0, (4, 4))
        False
    """
    key = name_key(matrix) if isinstance(matrix, str) else int(matrix)
    z = 0
    for v in (step, key, start, *shape, *offset):
        z = (z * 0x9E3779B97F4A7C15 + int(v) + 1) & 0xFFFFFFFFFFFFFFFF
        z ^= z >> 30
        z = (z * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z ^= z >> 27
        z = (z * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        z ^= z >> 31
    return z & 0x7FFFFFFFFFFFFFFF


def store_saturated(dst: torch.Tensor, wide: torch.Tensor) -> None:
    """Clamp the working copy ``wide`` in place to ``±`` the largest finite value of the
    *storage* dtype (``dst``'s), then write it into ``dst`` if it is a copy.

    A finite gradient spike whose square overflows leaves ``±max``, not an ``inf`` that
    would zero that entry's update for the rest of the run (``β₂·inf = inf``). The
    bound is ``dst``'s: fp32's max (3.40e38) rounds to ``inf`` in bf16 (whose max is
    3.39e38) and fp16 (65504), so saturating the fp32 copy alone stored ``inf`` in a
    bf16 state for good. Clamping to the storage max is exact (that max is an fp32
    value) and leaves every entry below it as it was; for an fp32/fp64 state ``wide`` is
    ``dst`` and this is :func:`~dmuon.optim.transforms.momentum.saturate_`. The clamp is
    in place: the caller goes on with ``wide`` as stored. (:func:`round_state_` is the
    same bound for state kept in ``state_dtype``, rounded.)

    Examples:
        >>> import torch
        >>> dst, wide = torch.zeros(2, dtype=torch.bfloat16), torch.tensor([3.4e38, 1.0])
        >>> store_saturated(dst, wide)
        >>> dst.tolist(), wide.tolist()  # bf16's max in both, not inf
        ([3.3895313892515355e+38, 1.0], [3.3895313892515355e+38, 1.0])
    """
    big = torch.finfo(dst.dtype).max
    wide.clamp_(-big, big)
    if wide is not dst:
        dst.copy_(wide)


def round_state_(
    dst: torch.Tensor,
    src: torch.Tensor,
    rounding: str,
    seeds: list[tuple[int, int]] | None = None,
) -> None:
    """Write wide state ``src`` into stored state ``dst`` (same shape), rounded.

    ``src`` is clamped to ``±`` the largest finite value of ``dst``'s dtype first, so
    a momentum that saturated in fp32 stays finite when stored. ``"nearest"`` rounds
    to nearest even (``copy_``). ``"stochastic"`` rounds the rows of ``src``'s first
    dimension in runs: ``seeds`` lists ``(seed, rows)`` pairs covering it, each run
    drawn from a generator seeded with its seed (:func:`rounding_seed`).

    Examples:
        >>> import torch
        >>> dst = torch.zeros(2, dtype=torch.bfloat16)
        >>> round_state_(dst, torch.tensor([1.0 + 2**-8, 3.4e38]), "nearest")  # a tie; overflow
        >>> dst.tolist()  # ties to even (1.0); clamped to bf16's max, not inf
        [1.0, 3.3895313892515355e+38]
    """
    big = torch.finfo(dst.dtype).max
    wide = src.clamp(-big, big) if torch.finfo(src.dtype).max > big else src
    if rounding == "nearest" or dst.dtype != torch.bfloat16:
        dst.copy_(wide)
        return
    if seeds is None:
        raise ValueError("stochastic rounding needs seeds: (seed, rows) pairs")
    gen = torch.Generator(device=dst.device)
    row = 0
    for seed, rows in seeds:
        gen.manual_seed(seed)
        dst[row : row + rows].copy_(stochastic_round_bf16(wide[row : row + rows], gen))
        row += rows
    if row != dst.shape[0]:
        raise ValueError(f"seeds cover {row} rows of {dst.shape[0]}")
