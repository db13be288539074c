"""FlatBucket and make_buckets: layouts, views, packing and grouping by owner."""

import random

import pytest
import torch
from model_lists import gpt_items

from dmuon.comm import FlatBucket, MatrixItem, make_buckets, plan_owners


def test_layout_is_contiguous_in_order_with_optional_alignment():
    b = FlatBucket([("a", (2, 3)), ("b", (5,)), ("c", (1, 1))], dtype=torch.float32)
    assert [(s.name, s.offset, s.numel) for s in b.slots] == [
        ("a", 0, 6),
        ("b", 6, 5),
        ("c", 11, 1),
    ]
    assert b.numel == 12 and b.nbytes == 48
    aligned = FlatBucket([("a", (3,)), ("b", (5,)), ("c", (2,))], dtype=torch.float32, alignment=4)
    assert [s.offset for s in aligned.slots] == [0, 4, 12] and aligned.numel == 14


def test_views_share_the_buffer_so_writes_need_no_copy():
    b = FlatBucket([("a", (2, 2)), ("b", (3,))], dtype=torch.float64)
    b.view("a").add_(torch.eye(2, dtype=torch.float64))
    b.views()["b"].fill_(7)
    assert b.buffer.tolist() == [1, 0, 0, 1, 7, 7, 7]
    assert b.view("b").untyped_storage().data_ptr() == b.buffer.untyped_storage().data_ptr()


def test_pack_and_unpack_round_trip_any_layout():
    src = {"t": torch.randn(4, 3).t(), "v": torch.randn(6)[::2]}  # both non-contiguous
    b = FlatBucket.from_tensors(src, owner=2)
    assert (
        b.owner == 2 and torch.equal(b.view("t"), src["t"]) and torch.equal(b.view("v"), src["v"])
    )
    dst = {"t": torch.empty(3, 4), "v": torch.empty(3)}
    b.unpack_into(dst)
    assert all(torch.equal(dst[k], src[k]) for k in src)


def test_pack_rejects_missing_names_and_wrong_shapes():
    b = FlatBucket([("a", (2, 2)), ("b", (3,))], dtype=torch.float32, owner=1)
    with pytest.raises(ValueError, match=r"no tensor for \['b'\]"):
        b.pack({"a": torch.zeros(2, 2)})
    with pytest.raises(
        ValueError, match=r"tensor 'a' has shape \(4,\), but the plan and bucket say \(2, 2\)"
    ):
        b.pack({"a": torch.zeros(4), "b": torch.zeros(3)})
    assert b.buffer.abs().sum() == 0  # nothing was written before the check failed
    with pytest.raises(ValueError, match=r"destination 'b' has shape \(4,\)"):
        b.unpack_into({"b": torch.zeros(4)})


def test_a_caller_buffer_must_be_a_contiguous_1d_tensor_of_the_dtype():
    storage = torch.zeros(10)
    b = FlatBucket([("a", (2, 2))], dtype=torch.float32, buffer=storage)
    b.view("a").fill_(1)
    assert storage[:4].tolist() == [1, 1, 1, 1]  # the bucket lives in the caller's storage
    with pytest.raises(ValueError, match="buffer must be contiguous"):
        FlatBucket([("a", (2,))], dtype=torch.float32, buffer=torch.zeros(8)[::2])
    with pytest.raises(ValueError, match=r"1-D torch\.float32 tensor with ≥ 4 elements"):
        FlatBucket([("a", (2, 2))], dtype=torch.float32, buffer=torch.zeros(3))
    with pytest.raises(ValueError, match=r"1-D torch\.float32"):
        FlatBucket([("a", (2, 2))], dtype=torch.float32, buffer=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="names in a bucket must be unique"):
        FlatBucket([("a", (2,)), ("a", (2,))], dtype=torch.float32)
    with pytest.raises(ValueError, match="one dtype on one device"):
        FlatBucket.from_tensors({"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.float64)})


def test_make_buckets_groups_by_owner_in_canonical_order():
    plan = plan_owners(gpt_items(layers=4), 3)
    buckets = make_buckets(plan)
    assert [b.owner for b in buckets] == [0, 1, 2]  # one per owner: coalesced
    for b in buckets:
        assert b.names == plan.names_of(b.owner)
        assert all(b.view(n).shape == plan.item(n).shape for n in b.names)


def test_make_buckets_is_the_same_on_every_rank_whatever_the_input_order():
    items = gpt_items(layers=3)
    shuffled = items[:]
    random.Random(3).shuffle(shuffled)
    layouts = [
        [(b.owner, b.layout()) for b in make_buckets(plan_owners(its, 4))]
        for its in (items, shuffled)
    ]
    assert layouts[0] == layouts[1]


def test_make_buckets_splits_by_dtype_and_bucket_bytes_and_subsets():
    items = [
        MatrixItem("a", (4, 4)),  # 64 B
        MatrixItem("b", (2, 4), torch.bfloat16),  # 16 B
        MatrixItem("c", (8, 4)),  # 128 B, larger than the cap: a bucket of its own
        MatrixItem("d", (2, 2)),  # 16 B
    ]
    plan = plan_owners(items, 1)
    buckets = make_buckets(plan, bucket_bytes=100)
    assert [(b.names, b.dtype) for b in buckets] == [
        (("a",), torch.float32),
        (("c",), torch.float32),
        (("d",), torch.float32),
        (("b",), torch.bfloat16),
    ]
    # In bf16: a 32 B + b 16 B, then c 64 B + d 8 B.
    assert [b.names for b in make_buckets(plan, bucket_bytes=100, dtype=torch.bfloat16)] == [
        ("a", "b"),
        ("c", "d"),
    ]
    assert [b.names for b in make_buckets(plan, names=["d", "a"])] == [("a", "d")]
    with pytest.raises(ValueError, match=r"names not in the plan: \['zz'\]"):
        make_buckets(plan, names=["zz"])
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int"):
        make_buckets(plan, bucket_bytes=0)
