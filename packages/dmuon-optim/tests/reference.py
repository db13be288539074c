"""Direct, unbatched float64 re-statements of every rule, written from the equations.

Nothing here imports dmuon.optim: each function takes ONE matrix, its state as a
dict of float64 tensors, the hyperparameters and the step number, and returns the
new weight. The Newton–Schulz here is the textbook quintic loop with the
normalisation of dmuon.kernels (divide by the largest entry, then by ‖·‖_F + 1e-7);
in float64 the Gram iteration the optimizer runs agrees with it to ~1e-13.
"""

from __future__ import annotations

import math

import torch

from dmuon.kernels import get_coefficients


def ns(X: torch.Tensor, coefficients="polar_express", steps: int = 5) -> torch.Tensor:
    X = X.to(torch.float64)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    amax = X.abs().max()
    if amax > 0:
        X = X / amax
    X = X / (X.norm() + 1e-7)
    schedule = (
        get_coefficients(coefficients, steps) if isinstance(coefficients, str) else coefficients
    )
    for a, b, c in schedule:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def adjust(convention, m: int, n: int) -> float:
    if convention == "original":
        return math.sqrt(max(1.0, m / n))
    if convention == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    if convention == "spectral":
        return math.sqrt(m / n)
    return 1.0


def momentum_input(G, st, hp):
    """Sum-form momentum; returns the tensor NS sees."""
    st["momentum_buffer"] = hp["momentum"] * st["momentum_buffer"] + G
    M = st["momentum_buffer"]
    return G + hp["momentum"] * M if hp["nesterov"] else M


def rescale(Y, X):
    ny = Y.norm()
    return Y * (X.norm() / ny) if ny > 0 else Y * 0


def topk_rows(M, fraction):
    k = max(1, min(M.shape[0], math.ceil(fraction * M.shape[0])))
    order = torch.argsort(M.abs().sum(dim=1), descending=True)
    return torch.sort(order[:k]).values


def svd_clip(X, tau, mode):
    U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    S2 = torch.clamp(S, max=tau) if mode == "hard" else S / torch.sqrt(1 + (S / tau) ** 2)
    return U @ torch.diag(S2) @ Vh


def rule_step(rule, W, G, st, hp, t, vote=lambda s: s):
    """New weight after one step of ``rule`` on one matrix (float64)."""
    m, n = W.shape
    ns_ = lambda X: ns(X, hp["ns_coefficients"], hp["ns_steps"])  # noqa: E731
    scale = adjust(hp["adjust_lr"], m, n)
    if rule == "muon":
        D = ns_(momentum_input(G, st, hp))
    elif rule == "normuon":
        O = ns_(momentum_input(G, st, hp))
        st["row_second_moment"] = hp["beta2"] * st["row_second_moment"] + (1 - hp["beta2"]) * (
            O**2
        ).mean(dim=1)
        D = rescale(O / (st["row_second_moment"].sqrt()[:, None] + hp["eps"]), O)
    elif rule == "adamuon":
        U = momentum_input(G, st, hp)
        O = ns_(torch.sign(U) if hp["sign"] else U)
        st["second_moment"] = hp["beta2"] * st["second_moment"] + (1 - hp["beta2"]) * O**2
        D = rescale(O / (st["second_moment"].sqrt() + hp["eps"]), O)
    elif rule == "muon2":
        U = momentum_input(G, st, hp)
        st["grad_second_moment"] = hp["beta2"] * st["grad_second_moment"] + (1 - hp["beta2"]) * G**2
        D = ns_(U / torch.sqrt(st["grad_second_moment"] + hp["muon2_eps"]))
    elif rule == "mona":
        U = momentum_input(G, st, hp)
        prev = G if t == 1 else st["prev_grad"]
        st["grad_diff_avg"] = hp["mona_beta"] * st["grad_diff_avg"] + (1 - hp["mona_beta"]) * (
            G - prev
        )
        st["prev_grad"] = G.clone()
        D = ns_(U + hp["mona_gamma"] / (1 - hp["momentum"]) * st["grad_diff_avg"])
    elif rule == "musec":
        U = momentum_input(G, st, hp)
        # Muon's Frobenius norm divided by τ, ‖B‖_F = √min(m, n)/τ, then the clip at one.
        nu = U.norm()
        B = U * (math.sqrt(min(m, n)) / (hp["clip_tau"] * nu)) if nu > 0 else U * 0
        D = svd_clip(B, 1.0, hp["clip_mode"])
    elif rule == "sign_muon":
        S = vote(torch.sign(ns_(momentum_input(G, st, hp))))
        if hp["local_polar"]:
            S = ns_(S)
        sigma = torch.linalg.matrix_norm(S, ord=2)
        D = S / sigma if sigma > 0 else S * 0
    elif rule in ("dion2", "dion3"):
        st["momentum_buffer"] = st["momentum_buffer"] + G
        M = st["momentum_buffer"]
        cols = rule == "dion2" and (
            hp["select_dim"] == "cols" or (hp["select_dim"] == "auto" and n < m)
        )
        Mw = M.T.clone() if cols else M.clone()
        idx = topk_rows(Mw, hp["fraction"])
        U = Mw[idx].clone()
        Mw[idx] = hp["momentum"] * Mw[idx]
        st["momentum_buffer"] = Mw.T.clone() if cols else Mw
        O = ns_(U)
        if rule == "dion3":
            v = st["row_second_moment"]
            v[idx] = hp["beta2"] * v[idx] + (1 - hp["beta2"]) * (O**2).mean(dim=1)
            O = rescale(O / (v[idx].sqrt()[:, None] + hp["eps"]), O)
        Dw = torch.zeros_like(Mw)
        Dw[idx] = O
        D = Dw.T if cols else Dw
    elif rule == "muonbp":
        U = momentum_input(G, st, hp)
        if t % hp["period"] == 0:
            D = ns_(U)
            scale *= hp["full_lr_scale"]
        else:
            D = torch.empty_like(U)
            for rows in torch.arange(m).tensor_split(hp["row_blocks"]):
                for cols_ in torch.arange(n).tensor_split(hp["col_blocks"]):
                    if len(rows) == 0 or len(cols_) == 0:
                        continue
                    blk = U[rows][:, cols_]
                    f = adjust(hp["adjust_lr"], len(rows), len(cols_)) * hp["block_lr_scale"]
                    D[rows[:, None], cols_[None, :]] = ns_(blk) * f
            scale = 1.0
    elif rule == "numuon":
        U = momentum_input(G, st, hp)
        k = max(1, math.ceil(hp["rank_fraction"] * min(m, n)))
        Uu, _, Vh = torch.linalg.svd(U, full_matrices=False)
        D = Uu[:, :k] @ Vh[:k]
    elif rule == "scion":
        # Scion (arXiv 2502.07529): the paper's EMA d = (1 − μ)·M of the sum-form
        # buffer M, whose polar factor is M's; step ρ·√(m/n)·polar(d).
        D = ns_((1 - hp["momentum"]) * momentum_input(G, st, hp))
        scale = hp["radius"] * math.sqrt(m / n)
    else:
        raise AssertionError(rule)
    return W * (1 - hp["lr"] * hp["weight_decay"]) - hp["lr"] * scale * D


def init_state(rule, m, n):
    z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
    st = {"momentum_buffer": z(m, n)}
    extra = {
        "normuon": {"row_second_moment": z(m)},
        "adamuon": {"second_moment": z(m, n)},
        "muon2": {"grad_second_moment": z(m, n)},
        "mona": {"prev_grad": z(m, n), "grad_diff_avg": z(m, n)},
        "dion3": {"row_second_moment": z(m)},
    }
    st.update(extra.get(rule, {}))
    return st
