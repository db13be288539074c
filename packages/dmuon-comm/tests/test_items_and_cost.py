"""MatrixItem, the Newton–Schulz FLOP count and the default owner cost."""

import pytest
import torch

from dmuon.comm import MatrixItem, NSCost, layer_key, matrix_items, ns_flops, plan_owners


def gram_flops_by_walking_the_iteration(m, n, steps, restarts):
    """Reference: walk the Gram iteration step by step and add up its products."""
    s, l = min(m, n), max(m, n)
    total = 2 * s * s * l  # R = X Xᵀ
    window_start = True
    for i in range(steps):
        if i in restarts and not window_start:
            total += 2 * s * s * l + 2 * s * s * l  # X ← Q X, R ← X Xᵀ
            window_start = True
        total += 2 * s**3  # R·R
        if not window_start:
            total += 2 * s**3  # Q ← Q·Z
        window_start = False
        if i + 1 < steps and (i + 1) not in restarts:
            total += 2 * s**3 + 2 * s**3  # R·Z, Z·(RZ): evolve R
    return total + 2 * s * s * l  # X ← Q X


def test_standard_by_hand():
    # Per step: X Xᵀ 2·768²·3072, A·A 2·768³, B·X 2·768²·3072.
    per_step = 2 * 768**2 * 3072 + 2 * 768**3 + 2 * 768**2 * 3072
    assert ns_flops(768, 3072, method="standard") == 5 * per_step


def test_gram_five_steps_restart_at_two_is_8s2l_plus_28s3():
    s, l = 1024, 4096
    assert ns_flops(s, l) == ns_flops(l, s) == 8 * s * s * l + 28 * s**3


@pytest.mark.parametrize(
    ("m", "n", "steps", "restarts"),
    [
        (96, 300, 5, (2,)),
        (40, 120, 7, (2, 4)),
        (10, 500, 3, (1,)),
        (10, 500, 6, ()),
        (10, 500, 5, (0, 2, 9)),
        (7, 9, 1, (2,)),
        (5, 50, 8, (1, 2, 3, 4, 5, 6, 7)),
    ],
)
def test_gram_closed_form_equals_walking_the_iteration(m, n, steps, restarts):
    assert ns_flops(m, n, steps=steps, restarts=restarts) == gram_flops_by_walking_the_iteration(
        m, n, steps, set(restarts)
    )


def test_square_gram_is_standard_and_batch_multiplies_and_empty_is_zero():
    assert ns_flops(512, 512) == ns_flops(512, 512, method="standard") == 5 * 6 * 512**3
    assert ns_flops(64, 256, batch=8) == 8 * ns_flops(64, 256)
    assert ns_flops(0, 10) == ns_flops(10, 10, steps=0) == 0


def test_flops_bad_input():
    with pytest.raises(ValueError, match="method must be 'gram' or 'standard', got 'svd'"):
        ns_flops(4, 8, method="svd")
    with pytest.raises(ValueError, match="≥ 0"):
        ns_flops(-1, 8)


def test_nscost_is_flops_over_rate_plus_bytes_over_bandwidth_plus_overhead():
    cost = NSCost(flops_per_second=2e12, bytes_per_second=5e11, byte_passes=6, call_overhead=1e-4)
    item = MatrixItem("w", (3, 512, 2048), torch.bfloat16)
    s, l = 512, 2048
    per_matrix = (8 * s * s * l + 28 * s**3) / 2e12 + 6 * 512 * 2048 * 2 / 5e11
    assert cost(item) == pytest.approx(1e-4 + 3 * per_matrix, rel=1e-12)
    standard = NSCost(method="standard", steps=3, byte_passes=0, call_overhead=0)
    assert standard(MatrixItem("w", (64, 128))) == pytest.approx(
        3 * (4 * 64 * 64 * 128 + 2 * 64**3) / standard.flops_per_second
    )


def test_an_empty_matrix_costs_nothing_and_loads_no_rank():
    """The kernels return an empty matrix at once (``dispatch.run``: no call), so the
    cost model charges no call overhead for one and the plan counts no load for it."""
    cost = NSCost()
    assert cost(MatrixItem("w", (0, 4096))) == 0.0
    assert cost(MatrixItem("w", (2, 16, 0))) == 0.0
    assert cost.batch_seconds(0, 4096, 4, 3) == 0.0
    plan = plan_owners([MatrixItem("w", (0, 4096))], 2)
    assert plan.loads == (0.0, 0.0), plan.summary()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "svd"}, "method"),
        ({"flops_per_second": 0}, "flops_per_second"),
        ({"bytes_per_second": -1}, "bytes_per_second"),
        ({"call_overhead": -1e-6}, "call_overhead"),
        ({"steps": -1}, "steps"),
    ],
)
def test_nscost_rejects_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NSCost(**kwargs)


def test_matrix_item_properties_and_validation():
    item = MatrixItem("experts.w", (4, 256, 64), "bfloat16", layer=3)
    assert (item.rows, item.cols, item.batch, item.numel) == (256, 64, 4, 4 * 256 * 64)
    assert item.dtype is torch.bfloat16 and item.nbytes == 2 * item.numel and item.layer == "3"
    assert MatrixItem.from_tensor("t", torch.zeros(2, 3, dtype=torch.float16)).shape == (2, 3)
    with pytest.raises(ValueError, match=r"shape must be \(m, n\) or \(\*batch, m, n\)"):
        MatrixItem("v", (10,))
    with pytest.raises(ValueError, match=r"dtype must be a torch\.dtype"):
        MatrixItem("v", (2, 2), "float8")
    with pytest.raises(ValueError, match="non-empty string"):
        MatrixItem("", (2, 2))


def test_layer_key_and_matrix_items_from_a_model():
    assert layer_key("model.layers.12.self_attn.k_proj.weight") == "model.layers.12"
    assert layer_key("transformer.h.3.mlp.c_fc.weight") == "transformer.h.3"
    assert layer_key("encoder.proj.weight") == "encoder.proj"
    model = torch.nn.ModuleDict(
        {"blocks": torch.nn.ModuleList([torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)])}
    )
    items = matrix_items(model.named_parameters(), dtype=torch.bfloat16)
    assert [(i.name, i.shape, i.layer, i.dtype) for i in items] == [
        ("blocks.0.weight", (8, 4), "blocks.0", torch.bfloat16),
        ("blocks.1.weight", (4, 8), "blocks.1", torch.bfloat16),
    ]  # biases (1-D) are not matrices
