import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dmuon.kernels import ns_flops, orthogonalize


def test_standard_by_hand_768x3072():
    # Per step: X Xᵀ 2·768²·3072, A·A 2·768³, B·X 2·768²·3072.
    per_step = 2 * 768**2 * 3072 + 2 * 768**3 + 2 * 768**2 * 3072
    assert ns_flops(768, 3072, method="standard", steps=5) == 5 * per_step == 40_768_634_880


def test_gram_by_hand_1024x4096():
    s, l = 1024, 4096
    count = 2 * s * s * l  # R = X Xᵀ
    count += 2 * s**3 + 4 * s**3  # i=0: R·R; evolve R (R·Z, Z·RZ)
    count += 2 * s**3 + 2 * s**3  # i=1: R·R, Q·Z; no evolve (restart next)
    count += 4 * s * s * l + 2 * s**3 + 4 * s**3  # i=2: restart (Q·X, X Xᵀ); R·R; evolve
    count += 2 * s**3 + 2 * s**3 + 4 * s**3  # i=3: R·R, Q·Z, evolve
    count += 2 * s**3 + 2 * s**3  # i=4: R·R, Q·Z, last step
    count += 2 * s * s * l  # X ← Q X
    assert ns_flops(1024, 4096, method="gram") == count == 8 * s * s * l + 28 * s**3


def test_tall_counts_like_wide_and_batch_multiplies():
    assert ns_flops(4096, 1024) == ns_flops(1024, 4096)
    assert ns_flops(64, 256, batch=8) == 8 * ns_flops(64, 256)


def test_square_gram_counts_as_standard():
    assert ns_flops(512, 512, method="gram") == ns_flops(512, 512, method="standard")


@pytest.mark.parametrize("method", ["gram", "standard"])
@pytest.mark.parametrize(
    ("shape", "steps", "restarts"),
    [
        ((96, 300), 5, (2,)),
        ((300, 96), 5, (2,)),
        ((4, 40, 120), 7, (2, 4)),
        ((64, 64), 5, (2,)),
        ((10, 500), 3, (1,)),
        ((10, 500), 6, ()),
    ],
)
def test_count_equals_what_torch_executes(method, shape, steps, restarts):
    # Reference computed another way: torch's own FLOP counter over the real call.
    G = torch.randn(*shape)
    with FlopCounterMode(display=False) as counter:
        orthogonalize(G, method=method, steps=steps, restarts=restarts, compute_dtype=torch.float32)
    batch = shape[0] if len(shape) == 3 else 1
    expected = ns_flops(
        shape[-2], shape[-1], method=method, steps=steps, restarts=restarts, batch=batch
    )
    assert counter.get_total_flops() == expected


def test_empty_is_zero_and_bad_method_raises():
    assert ns_flops(0, 10) == 0
    with pytest.raises(ValueError, match="method must be 'gram' or 'standard', got 'svd'"):
        ns_flops(4, 8, method="svd")
    for bad in ({"m": -4}, {"steps": -1}, {"batch": -2}):
        args = {"m": 4, "n": 8, **bad}
        with pytest.raises(ValueError, match="must be ≥ 0"):
            ns_flops(args.pop("m"), args.pop("n"), **args)
