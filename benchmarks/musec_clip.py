"""Does Musec's clip engage in training, and is the m×m-side clip the clip it was?

Trains the byte-level GPT of ``benchmarks/lr_grid.py`` with ``dmuon:musec`` (its
defaults: hard clip, τ = 1, Nesterov momentum μ = 0.95) and, at a few steps, takes
each hidden matrix's Nesterov momentum ``U = G + μM`` (the gradient after clipping,
and the optimizer's public ``momentum_buffer``), normalises it as the rule does,
``B = √k·U/‖U‖_F`` (k = min(m, n)), and reports from a float64 SVD of ``B``:

* the fraction of singular values above τ (the directions the clip cuts), for τ =
  1 and the neighbouring levels, and the step's Frobenius norm relative to Muon's,
  ``‖clip_τ(B)‖_F/√k = √(Σ min(σᵢ, τ)²/k)``;
* the relative Frobenius error, against the SVD clip ``U_B min(Σ_B, τ) V_Bᵀ``, of
  the clip as computed now (``dmuon.kernels.spectral_clip``: ``τ·max(BBᵀ, τ²I)^{-1/2}·B``)
  and as computed before issue 18 (``(I − Π)B + τΠ·polar(B)``, ``Π = (I + sign(BBᵀ − τ²I))/2``,
  re-stated here with the same Newton–Schulz primitive), both in fp32.

Since ``Σσᵢ(B)² = k``, the largest σ is at least 1: at τ = 1 the clip cuts at least
one direction at every step unless all singular values are equal (then it is Muon).

    python benchmarks/musec_clip.py --layers 4 --d-model 128 --tag l4d128
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import sys
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common.data import BatchSampler, load_corpus, validation_batches  # noqa: E402
from benchmarks.common.loop import train  # noqa: E402
from benchmarks.common.metrics import machine_info  # noqa: E402
from benchmarks.common.model import GPT  # noqa: E402
from benchmarks.common.optimizers import build_optimizer  # noqa: E402
from benchmarks.lr_grid import train_namespace  # noqa: E402
from benchmarks.train import settings_from_args  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
TAUS = (0.25, 0.5, 1.0, 2.0)


def svd_clip(B: torch.Tensor, tau: float) -> torch.Tensor:
    """``U min(Σ, τ) Vᵀ`` by a float64 SVD: the reference."""
    U, S, Vh = torch.linalg.svd(B.double(), full_matrices=False)
    return (U * S.clamp(max=tau)) @ Vh


def old_clip(B: torch.Tensor, tau: float, steps: int = 12) -> torch.Tensor:
    """The hard clip before issue 18, ``(I − Π)B + τΠ polar(B)`` (fp32, wide ``B``)."""
    from dmuon.kernels import orthogonalize

    def ns(X: torch.Tensor) -> torch.Tensor:
        return orthogonalize(
            X, method="standard", coefficients="polar_express_raw", steps=steps,
            compute_dtype=torch.float32,
        )  # fmt: skip

    A = B @ B.mT
    sign = ns(A - tau * tau * torch.eye(A.shape[0]))
    sign = 0.5 * (sign + sign.mT)
    P = ns(B)
    return B - 0.5 * (B + sign @ B) + tau * 0.5 * (P + sign @ P)


def measure(U: torch.Tensor) -> dict[str, Any]:
    from dmuon.kernels import spectral_clip

    X = U.float().mT if U.shape[0] > U.shape[1] else U.float()  # wide, as the kernel does
    k = min(X.shape)
    B = X * (math.sqrt(k) / torch.linalg.matrix_norm(X))
    s = torch.linalg.svdvals(B.double())
    ref = svd_clip(B, 1.0)
    err = {
        "now": float(torch.linalg.matrix_norm(spectral_clip(B, 1.0).double() - ref)),
        "before": float(torch.linalg.matrix_norm(old_clip(B, 1.0).double() - ref)),
    }
    return {
        "shape": list(U.shape),
        "sigma_max": float(s[0]),
        "sigma_median": float(s.median()),
        "clipped_fraction": {str(t): float((s > t).double().mean()) for t in TAUS},
        "step_norm_vs_muon": {
            str(t): float(s.clamp(max=t).square().sum().div(k).sqrt()) for t in TAUS
        },
        "rel_error": {k_: v / float(torch.linalg.matrix_norm(ref)) for k_, v in err.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=1e-2, help="Musec's best at 4×128 (lr grid)")
    p.add_argument("--at", default="1,10,25,50,100,150", help="steps measured")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data", default=None, help="text file or folder (default: Python's stdlib)")
    p.add_argument("--tag", default="")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    ns = argparse.Namespace(
        quick=False, eval_every=args.steps, val_batches=2, warmup=None, data=args.data, device="cpu"
    )
    for key in ("steps", "batch_size", "seq_len", "layers", "d_model", "heads"):
        setattr(ns, key, getattr(args, key))
    tns = train_namespace(ns)
    settings = settings_from_args(tns)
    corpus = load_corpus(args.data, val_fraction=tns.val_fraction, pattern=None)
    val = validation_batches(corpus.val, 2, settings.batch_size, settings.model.seq_len, seed=1)
    model = GPT(settings.model)
    opt = build_optimizer(
        "dmuon:musec", model, lr=args.lr, scalar_lr=3e-3, weight_decay=settings.weight_decay,
        betas=settings.betas, eps=settings.eps, momentum=settings.momentum,
    )  # fmt: skip
    opt.attach_schedule(settings.schedule(args.steps))
    dmuon = opt.optimizers[0]
    group = dmuon.param_groups[0]
    mu, nesterov = float(group["momentum"]), bool(group["nesterov"])
    named = dict(zip(group["param_names"], group["params"], strict=True))
    at = {int(s) for s in args.at.split(",")}
    records: dict[int, dict[str, Any]] = {}
    inner_step = opt.step
    count = 0

    def step() -> None:  # this instance's step, wrapped to read G before and M after
        nonlocal count
        count += 1
        grads = {n: q.grad.detach().clone() for n, q in named.items()} if count in at else {}
        inner_step()
        if grads:
            per = {}
            for n, q in named.items():
                M = dmuon.state[q]["momentum_buffer"]
                per[n] = measure(grads[n] + mu * M if nesterov else M.clone())
            records[count] = per
            frac = statistics.median(r["clipped_fraction"]["1.0"] for r in per.values())
            print(f"step {count}: median fraction clipped at τ = 1: {frac:.3f}", flush=True)

    opt.step = step  # type: ignore[method-assign]
    sampler = BatchSampler(corpus.train, settings.batch_size, settings.model.seq_len, 0)
    train(model, opt, sampler, val, steps=args.steps, eval_every=args.steps, clip=settings.clip)
    summary = {}
    for s, per in sorted(records.items()):
        vals = list(per.values())
        summary[s] = {
            "clipped_fraction": {
                str(t): [min(v), statistics.median(v), max(v)]
                for t in TAUS
                if (v := [r["clipped_fraction"][str(t)] for r in vals])
            },
            "step_norm_vs_muon": {
                str(t): [min(v), statistics.median(v), max(v)]
                for t in TAUS
                if (v := [r["step_norm_vs_muon"][str(t)] for r in vals])
            },
            "rel_error_max": {w: max(r["rel_error"][w] for r in vals) for w in ("now", "before")},
        }
    print("step | τ: fraction of singular values clipped (min / median / max over matrices)")
    for s, row in summary.items():
        cells = "  ".join(
            f"{t}: {a:.3f}/{b:.3f}/{c:.3f}" for t, (a, b, c) in row["clipped_fraction"].items()
        )
        e = row["rel_error_max"]
        print(f"{s:4d} | {cells} | rel. error now {e['now']:.1e}, before {e['before']:.1e}")
    out = args.out / ("musec-clip-cpu" + (f"-{args.tag}" if args.tag else "") + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {**machine_info("cpu"), "argv": sys.argv[1:] if argv is None else argv}
    config = {"model": dataclasses.asdict(settings.model)}
    out.write_text(
        json.dumps(
            {
                "meta": meta,
                "config": {**config, "lr": args.lr, "steps": args.steps, "taus": TAUS},
                "summary": summary,
                "matrices": records,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
