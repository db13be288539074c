"""Each rule against its *paper's* equations, restated here in float64.

test_rules_reference.py checks every rule against the equations of its page, written
in DMuon's own conventions (sum-form momentum, the Frobenius rescale, the adjust_lr
factor). This file starts from the papers instead, as each writes its update: the
EMA momentum ``M ← βM + (1 − β)G`` where the paper keeps one, the paper's step size
(NorMuon's and AdaMuon's ``0.2·√(mn)/‖Ô‖_F``, Muon²'s and Dion's ``√(m/n)``, Moonlight's
``0.2·√max(A, B)``) and the exact polar factor ``U Vᵀ`` of a float64 SVD where the paper
orthogonalises. It then runs DMuon at float32 with the settings that make its update the
paper's: ``nesterov=False`` (none of these papers uses the look-ahead), the ``adjust_lr``
convention the paper's step size reduces to, and a Newton–Schulz iteration that
converges to the polar factor (``polar_express_raw``, whose later triples fix σ = 1
exactly, for 10 steps in fp32 — 2e-6 from the SVD's polar factor on these shapes; the
default ``polar_express`` divides every triple by 1.05, and its iteration stops about
2e-4 below σ = 1, see docs/algorithms/coefficients.md).

Tolerance: 1e-5 on weights of size ~1 after four steps. What DMuon's fp32 arithmetic
(momentum, NS at 2e-6 from the polar factor, normalisations) leaves is 3e-7 to 7e-7 on
every test here. Changes that each failed this file when made to the code on purpose: the
second moment taken over the columns instead of the rows (NorMuon, Dion3), V used before
its update (Muon², large ε), ε moved inside AdaMuon's root, weight decay scaled by
``lr·scale`` instead of ``lr``, MuonBP's full steps one step early, the error-feedback
decay off by 1 %.

Rules left out: MONA and Musec have no paper equations to restate (their pages say what
is reconstructed; test_rules_reference.py restates the pages, test_musec.py Musec's clip
against an SVD); Sign-Muon is restated as far as its abstract fixes it. Muon with
Keller's own iteration is checked against torch.optim.Muon in test_torch_muon_parity.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from dmuon.optim import DMuon

STEPS = 4
TOL = 1e-5
LR, WD, BETA = 0.05, 0.1, 0.9
CONVERGED_NS = dict(
    ns_method="gram",
    ns_coefficients="polar_express_raw",
    ns_steps=10,
    ns_compute_dtype="float32",
)
# tall, wide and square, two of one shape (one batched bucket)
SHAPES = [(12, 8), (12, 8), (8, 12), (10, 10)]


def polar(X: torch.Tensor) -> torch.Tensor:
    """The exact polar factor ``U Vᵀ`` (float64 SVD), over the nonzero singular values: for
    a singular ``X`` the partial isometry ``U sign(Σ) Vᵀ``, the one polar factor that does
    not depend on how the SVD completes the null space (and the limit of Newton–Schulz,
    which leaves a zero singular value at zero)."""
    U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    kept = (S[0] * 1e-10 < S).to(X.dtype)
    return (U * kept) @ Vh


def problem(shapes, seed: int = 0):
    """Float32 starting weights and STEPS float32 gradients per weight (the references read
    the same numbers in float64)."""
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(*s, generator=g) for s in shapes]
    grads = [[torch.randn(*s, generator=g) for s in shapes] for _ in range(STEPS)]
    return weights, grads


def run_dmuon(rule: str, shapes, groups=None, **options):
    """DMuon's weights after STEPS steps (float32), with the options given."""
    weights, grads = problem(shapes)
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    settings = dict(lr=LR, weight_decay=WD, momentum=BETA, nesterov=False, **CONVERGED_NS)
    opt = DMuon(groups(params) if groups else params, rule=rule, **(settings | options))
    for step in grads:
        for p, G in zip(params, step, strict=True):
            p.grad = G.clone()
        opt.step()
    return [p.detach().double() for p in params], opt, params


def paper_run(update, shapes, init_state):
    """The paper's weights after STEPS steps: ``update(W, G, state, t)`` in float64."""
    weights, grads = problem(shapes)
    W = [w.double() for w in weights]
    states = [init_state(*s) for s in shapes]
    for t, step in enumerate(grads, start=1):
        W = [update(w, G.double(), st, t) for w, G, st in zip(W, step, states, strict=True)]
    return W, states


def assert_close(ours, paper):
    for x, y in zip(ours, paper, strict=True):
        assert x.shape == y.shape
        err = (x.reshape(y.shape) - y).abs().max().item()
        assert err < TOL, (tuple(y.shape), err)


def zeros(*shape):
    return torch.zeros(*shape, dtype=torch.float64)


def test_muon_is_moonlight_eq4_with_the_exact_polar_factor():
    # Moonlight (Liu et al., arXiv 2502.16982), §2.2, eq. 4, with Muon's momentum
    # (sum form, Nesterov input G + μM, as in its Algorithm 1 and toy_train.py):
    #   M ← μM + G;  O = polar(G + μM);  W ← W − η(0.2·√max(A, B)·O + λW)
    # Conv weights (out, in, k, k) are one (out, in·k·k) matrix (KellerJordan/Muon's
    # view(out, −1)); the shape factor is the flattened one's.
    shapes = [(12, 8), (8, 12), (4, 2, 3, 3)]

    def groups(params):
        return [{"params": params[:2]}, {"params": params[2:], "flatten": True}]

    def update(W, G, st, t):
        shape = W.shape
        W, G = W.reshape(shape[0], -1), G.reshape(shape[0], -1)
        A, B = W.shape
        st["M"] = BETA * st["M"] + G
        O = polar(G + BETA * st["M"])
        return (W - LR * (0.2 * math.sqrt(max(A, B)) * O + WD * W)).reshape(shape)

    ours, opt, params = run_dmuon(
        "muon", shapes, groups, adjust_lr="match_rms_adamw", nesterov=True
    )
    paper, states = paper_run(update, shapes, lambda *s: {"M": zeros(s[0], math.prod(s[1:]))})
    assert_close(ours, paper)
    for p, st in zip(params, states, strict=True):
        assert (opt.state[p]["momentum_buffer"].reshape(st["M"].shape) - st["M"]).abs().max() < 1e-5


def test_normuon_is_the_papers_algorithm_1():
    # NorMuon (Li et al., arXiv 2510.05491), Algorithm 1:
    #   M ← β₁M + (1 − β₁)G;  O = NS(M)                  (here: the exact polar factor)
    #   v ← β₂v + (1 − β₂)·mean_cols(O∘O);  Ô = O/(√v + ε)   (v: one value per row)
    #   η̂ = 0.2·η·√(mn)/‖Ô‖_F;  W ← W − ηλW − η̂·Ô
    beta2, eps = 0.95, 1e-8

    def update(W, G, st, t):
        m, n = W.shape
        st["M"] = BETA * st["M"] + (1 - BETA) * G
        O = polar(st["M"])
        st["v"] = beta2 * st["v"] + (1 - beta2) * (O * O).mean(dim=1)
        O_hat = O / (st["v"].sqrt()[:, None] + eps)
        eta_hat = 0.2 * LR * math.sqrt(m * n) / O_hat.norm()
        return W - LR * WD * W - eta_hat * O_hat

    ours, opt, params = run_dmuon("normuon", SHAPES, adjust_lr="match_rms_adamw", beta2=beta2)
    paper, states = paper_run(update, SHAPES, lambda m, n: {"M": zeros(m, n), "v": zeros(m)})
    assert_close(ours, paper)
    for p, st in zip(params, states, strict=True):
        v = opt.state[p]["row_second_moment"].double()
        assert ((v - st["v"]).abs() / st["v"]).max() < 1e-4  # a moment of O: scale-free


@pytest.mark.parametrize("sign", [True, False], ids=["v2+: NS(sign(M))", "v1: NS(M)"])
def test_adamuon_is_the_papers_algorithm(sign):
    # AdaMuon (Si, Zhang, Shen, arXiv 2507.11005), v2/v3 (v1 without the sign):
    #   M ← β₁M + (1 − β₁)G;  O = NS(sign(M))            (here: the exact polar factor)
    #   V ← β₂V + (1 − β₂)·O∘O;  Ô = O/(√V + ε)          (no bias correction)
    #   W ← W(1 − ηλ) − η·(0.2·√(mn)/‖Ô‖_F)·Ô
    # One documented deviation (adamuon.md, "The rescale"): DMuon rescales Ô to ‖O‖_F,
    # then applies 0.2·√max(m, n); that is the paper's step times ‖O‖_F/√min(m, n), which
    # is 1 unless O is rank-deficient. A ±1 matrix can be singular: sign(M) of the square
    # matrix is, at step 4 (rank 9 of 10), and the paper's step is then √(10/9) times ours.
    beta2, eps = 0.95, 1e-8
    deficient = []

    def update(W, G, st, t):
        m, n = W.shape
        st["M"] = BETA * st["M"] + (1 - BETA) * G
        O = polar(torch.sign(st["M"]) if sign else st["M"])
        st["V"] = beta2 * st["V"] + (1 - beta2) * O * O
        O_hat = O / (st["V"].sqrt() + eps)
        paper_step = (0.2 * math.sqrt(m * n) / O_hat.norm()) * O_hat
        rank_factor = float(O.norm()) / math.sqrt(min(m, n))  # the deviation: 1 at full rank
        deficient.append(rank_factor < 0.99)
        return W * (1 - LR * WD) - LR * rank_factor * paper_step

    ours, opt, params = run_dmuon(
        "adamuon", SHAPES, adjust_lr="match_rms_adamw", beta2=beta2, sign=sign
    )
    paper, states = paper_run(update, SHAPES, lambda m, n: {"M": zeros(m, n), "V": zeros(m, n)})
    assert_close(ours, paper)
    assert any(deficient) == sign  # the deviation was exercised (a Gaussian M has full rank)
    for p, st in zip(params, states, strict=True):  # V, a moment of O: scale-free
        assert (opt.state[p]["second_moment"].double() - st["V"]).abs().max() < 1e-5


@pytest.mark.parametrize("eps", [1e-16, 0.25], ids=["default eps", "eps comparable to V"])
def test_muon2_is_the_papers_update(eps):
    # Muon² (Liu et al., arXiv 2604.09967):
    #   M ← β₁M + (1 − β₁)G;  V ← β₂V + (1 − β₂)G∘G;  M̃ = M/√(V + ε)
    #   O = NS(M̃, K);  θ ← θ − η·√(m/n)·O     (here: the exact polar factor)
    # DMuon's sum-form M is the EMA over (1 − β₁): one factor on M̃, whatever ε, which the
    # polar factor does not see. The large ε puts where ε sits (inside the root) and the
    # absence of a bias correction on V in view.
    beta2 = 0.95

    def update(W, G, st, t):
        m, n = W.shape
        st["M"] = BETA * st["M"] + (1 - BETA) * G
        st["V"] = beta2 * st["V"] + (1 - beta2) * G * G
        O = polar(st["M"] / torch.sqrt(st["V"] + eps))
        return W * (1 - LR * WD) - LR * math.sqrt(m / n) * O

    ours, _, _ = run_dmuon("muon2", SHAPES, adjust_lr="spectral", beta2=beta2, muon2_eps=eps)
    paper, _ = paper_run(update, SHAPES, lambda m, n: {"M": zeros(m, n), "V": zeros(m, n)})
    assert_close(ours, paper)


def top_k(M: torch.Tensor, fraction: float) -> torch.Tensor:
    """The ⌈fraction·rows⌉ rows of ``M`` with the largest L1 norm, in their order."""
    k = math.ceil(fraction * M.shape[0])
    return torch.sort(torch.argsort(M.abs().sum(dim=1), descending=True)[:k]).values


@pytest.mark.parametrize("normalise", [False, True], ids=["dion2", "dion3 (NorDion2)"])
def test_dion2_and_dion3_are_the_papers_update_over_several_steps(normalise):
    # Dion2 (Ahn, Amsel, Langford, arXiv 2512.16928; microsoft/dion dion2.py):
    #   M ← M + G;  S = top-k rows (Dion2: of the shorter side) by L1 norm, k = ⌈αm⌉
    #   U = M[S];  M[S] ← μ·M[S];  O = NS(U)        (here: the exact polar factor)
    #   W ← W(1 − η·λ);  W[S] ← W[S] − η·√(m/n)·O   (the full shape's factor)
    # NorDion2 = Dion3 (nordion2.py): rows always, and between NS and the step
    #   v[S] ← β₂v[S] + (1 − β₂)·mean_cols(O∘O);  Ô = O/(√v[S] + ε);  Ô ← Ô·‖O‖_F/‖Ô‖_F
    # The error feedback only shows over several steps: the unselected rows accumulate.
    fraction, beta2, eps = 0.5, 0.95, 1e-8

    def update(W, G, st, t):
        m, n = W.shape
        st["M"] = st["M"] + G
        cols = not normalise and n < m
        Mw = st["M"].T.clone() if cols else st["M"].clone()
        S = top_k(Mw, fraction)
        U = Mw[S].clone()
        Mw[S] = BETA * Mw[S]
        st["M"] = Mw.T if cols else Mw
        O = polar(U)
        if normalise:
            st["v"][S] = beta2 * st["v"][S] + (1 - beta2) * (O * O).mean(dim=1)
            O_hat = O / (st["v"][S].sqrt()[:, None] + eps)
            O = O_hat * (O.norm() / O_hat.norm())
        step = torch.zeros_like(Mw)
        step[S] = O
        return W * (1 - LR * WD) - LR * math.sqrt(m / n) * (step.T if cols else step)

    rule = "dion3" if normalise else "dion2"
    ours, opt, params = run_dmuon(rule, SHAPES, adjust_lr="spectral", fraction=fraction)
    paper, states = paper_run(update, SHAPES, lambda m, n: {"M": zeros(m, n), "v": zeros(m)})
    assert_close(ours, paper)
    for p, st in zip(params, states, strict=True):
        assert (opt.state[p]["momentum_buffer"] - st["M"]).abs().max() < 1e-5


def test_muonbp_is_the_papers_block_periodic_update():
    # MuonBP (Khaled et al., arXiv 2510.16981): sum-form momentum M ← μM + G, then
    #   t ≡ 0 (mod P):  W ← W − η_full·s(m, n)·polar(M)
    #   otherwise:      W_ij ← W_ij − η_block·s(m_i, n_j)·polar(M_ij)   for each block
    # each step RMS-matched with the shape it orthogonalised (s = 0.2·√max, Moonlight's),
    # and decoupled weight decay. Blocks as torch.tensor_split lays them out; (9, 12) cut
    # 2 × 2 has blocks of two shapes (5 × 6 and 4 × 6), so two factors in one step.
    period, row_blocks, col_blocks, eta_block, eta_full = 3, 2, 2, 0.5, 2.0
    shapes = [(12, 8), (9, 12), (10, 10)]

    def s(m, n):
        return 0.2 * math.sqrt(max(m, n))

    def update(W, G, st, t):
        m, n = W.shape
        st["M"] = BETA * st["M"] + G
        if t % period == 0:
            return W * (1 - LR * WD) - LR * eta_full * s(m, n) * polar(st["M"])
        step = torch.zeros_like(W)
        for rows in torch.arange(m).tensor_split(row_blocks):
            for cols in torch.arange(n).tensor_split(col_blocks):
                block = st["M"][rows][:, cols]
                step[rows[:, None], cols] = eta_block * s(len(rows), len(cols)) * polar(block)
        return W * (1 - LR * WD) - LR * step

    ours, _, _ = run_dmuon(
        "muonbp", shapes, adjust_lr="match_rms_adamw", period=period, row_blocks=row_blocks,
        col_blocks=col_blocks, block_lr_scale=eta_block, full_lr_scale=eta_full,
    )  # fmt: skip
    paper, _ = paper_run(update, shapes, lambda m, n: {"M": zeros(m, n)})
    assert_close(ours, paper)


def test_numuon_is_the_papers_top_k_step():
    # NuMuon (Dolatabadi et al., arXiv 2603.03597):
    #   M ← βM + (1 − β)G;  k = ⌈r·min(m, n)⌉;  U_k, V_k = top-k singular vectors of M
    #   θ ← θ − γ·U_k V_kᵀ      (no shape factor: adjust_lr=None; decoupled decay as Muon)
    # With k + oversample ≥ min(m, n) the range finder spans everything: exact.
    rank_fraction = 0.25

    def update(W, G, st, t):
        m, n = W.shape
        st["M"] = BETA * st["M"] + (1 - BETA) * G
        k = math.ceil(rank_fraction * min(m, n))
        U, _, Vh = torch.linalg.svd(st["M"], full_matrices=False)
        return W * (1 - LR * WD) - LR * U[:, :k] @ Vh[:k]

    ours, _, _ = run_dmuon("numuon", SHAPES, adjust_lr=None, rank_fraction=rank_fraction)
    paper, _ = paper_run(update, SHAPES, lambda m, n: {"M": zeros(m, n)})
    assert_close(ours, paper)


@pytest.mark.parametrize("constrained", [False, True], ids=["uSCG", "SCG"])
def test_scion_is_the_papers_spectral_lmo_step(constrained):
    # Scion (Pethick et al., arXiv 2502.07529), §3 and Table 2, for a hidden matrix:
    #   d ← βd + (1 − β)G;  lmo(d) = −ρ·√(m/n)·polar(d)   (here: the exact polar factor)
    #   W ← (1 − γλ)W + γ·lmo(d)        λ = 0: uSCG;  λ = 1: SCG (the constrained Scion)
    radius, wd = 3.0, (1.0 if constrained else 0.0)

    def update(W, G, st, t):
        m, n = W.shape
        st["d"] = BETA * st["d"] + (1 - BETA) * G
        return (1 - LR * wd) * W + LR * (-radius * math.sqrt(m / n) * polar(st["d"]))

    ours, _, _ = run_dmuon("scion", SHAPES, radius=radius, weight_decay=wd)
    paper, _ = paper_run(update, SHAPES, lambda m, n: {"d": zeros(m, n)})
    assert_close(ours, paper)


@pytest.mark.parametrize("local_polar", [False, True])
def test_sign_muon_is_the_abstracts_step_on_one_process(local_polar):
    # Sign-Muon (Mishra, Trivedi, Kumar, arXiv 2605.16311), as far as its abstract fixes
    # it (sign_muon.md says what is reconstructed): on one process the vote is the identity,
    #   m ← βm + (1 − β)G;  S = sign(polar(m));  optionally S ← polar(S)
    #   W ← W(1 − ηλ) − η·s(m, n)·S/‖S‖₂   (spectral-norm-normalised; the adjust_lr factor
    #                                         s and the decoupled decay are DMuon's choices)
    def update(W, G, st, t):
        m, n = W.shape
        st["m"] = BETA * st["m"] + (1 - BETA) * G
        S = torch.sign(polar(st["m"]))
        if local_polar:
            S = polar(S)
        step = 0.2 * math.sqrt(max(m, n)) * S / torch.linalg.matrix_norm(S, ord=2)
        return W * (1 - LR * WD) - LR * step

    ours, _, _ = run_dmuon(
        "sign_muon", SHAPES, adjust_lr="match_rms_adamw", local_polar=local_polar
    )
    paper, _ = paper_run(update, SHAPES, lambda m, n: {"m": zeros(m, n)})
    assert_close(ours, paper)
