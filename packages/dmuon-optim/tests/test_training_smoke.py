"""Every rule trains: a few dozen steps of a tiny network on a learnable task.

The task is teacher–student regression: targets ``y = 2·tanh(2·xA)B`` from a fixed
random teacher, learned by a 32 → 64 → 64 → 8 tanh network. Its three weight
matrices are the rule's; its biases are the scalar optimizer's (AdamW), and biases
alone cannot fit a zero-mean target. Each rule runs 60 steps at the learning rate the
docs tell a user to start from (ten times AdamW's, 1e-2, with the default
``adjust_lr="match_rms_adamw"``) and every other option at its default.

The margin: the full-data loss must fall below ``MARGIN`` = 0.7 of its start. A rule
that never moves its matrices fails it (the control below stays at 1.00), and so did
Musec's old convention, which clipped the momentum in gradient units and so took a
momentum-SGD step far too small for this learning rate (0.90 here; issue 17). The
rules that pass reach 0.16–0.6 (Dion2/Dion3, which update a quarter of the rows per
step, and Scion, whose step size is ``radius`` rather than ``adjust_lr``, are the
slowest).
"""

import pytest
import torch
from torch import nn

from dmuon.optim import RULES, DMuon, param_groups

MARGIN = 0.7
STEPS, BATCH, LR, SCALAR_LR = 60, 64, 1e-2, 1e-2


pytestmark = pytest.mark.usefixtures("one_thread")


def teacher_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    A = torch.randn(32, 32, generator=g) / 32**0.5
    B = torch.randn(32, 8, generator=g) / 32**0.5
    X = torch.randn(512, 32, generator=g)
    return X, 2 * torch.tanh(2 * X @ A) @ B


def loss_ratio(rule: str, matrix_lr: float | None = None, **options) -> float:
    """Full-data loss after ``STEPS`` steps over the loss before the first."""
    X, Y = teacher_data()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)
    )
    opt = DMuon(param_groups(model), lr=LR, rule=rule, adamw_lr=SCALAR_LR, **options)
    if matrix_lr is not None:
        for group in opt.param_groups:
            if group["rule"] != "scalar":
                group["lr"] = matrix_lr

    def full_loss() -> float:
        with torch.no_grad():
            return float(((model(X) - Y) ** 2).mean())

    start = full_loss()
    for t in range(STEPS):
        idx = torch.arange(t * BATCH, (t + 1) * BATCH) % len(X)
        loss = ((model(X[idx]) - Y[idx]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return full_loss() / start


@pytest.mark.parametrize(
    ("rule", "options"),
    [(r, {}) for r in sorted(RULES)] + [("musec", {"clip_mode": "soft"})],
    ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}={v}" for k, v in x.items()),
)
def test_rule_trains_at_its_defaults(rule, options):
    ratio = loss_ratio(rule, **options)
    assert ratio < MARGIN, f"{rule} {options}: loss fell only to {ratio:.2f} of its start"


def test_margin_fails_a_rule_that_never_moves_its_matrices():
    # Muon's chain with the matrices' lr at 0: only the biases (AdamW) train.
    ratio = loss_ratio("muon", matrix_lr=0.0)
    assert ratio > MARGIN, f"the control reached {ratio:.2f}: the margin would not catch it"
