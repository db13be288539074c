"""pack_signs / unpack_signs: 8 signs per byte, zero counts as +; pack_votes / unpack_votes."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dmuon.comm import pack_signs, pack_votes, unpack_signs, unpack_votes


def pack_by_hand(values):
    """Reference: bit k%8 of byte k//8 is 1 for values ≥ 0 (pads with set bits)."""
    out = []
    for start in range(0, len(values), 8):
        byte = 0
        for bit, v in enumerate(values[start : start + 8]):
            byte |= int(v >= 0) << bit
        byte |= sum(1 << b for b in range(len(values[start : start + 8]), 8))
        out.append(byte)
    return out


@pytest.mark.parametrize("residue", range(8))
@given(data=st.data())
def test_round_trip_for_every_length_mod_8(residue, data):
    n = 8 * data.draw(st.integers(0, 12)) + residue
    values = data.draw(
        st.lists(
            st.sampled_from([-2.5, -1.0, -1e-30, -0.0, 0.0, 1e-30, 1.0, 3.0]),
            min_size=n,
            max_size=n,
        )
    )
    x = torch.tensor(values, dtype=torch.float32)
    bits = pack_signs(x)
    assert bits.dtype == torch.uint8 and bits.shape == (-(-n // 8),)
    assert bits.tolist() == pack_by_hand(values)
    expected = torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(unpack_signs(bits, (n,)), expected)


@given(
    shape=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64, torch.int32]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_any_shape_and_dtype(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    out = unpack_signs(pack_signs(x), x.shape, dtype=torch.float64)
    assert out.shape == x.shape and torch.equal(out, torch.where(x >= 0, 1.0, -1.0).double())


def test_zero_counts_as_plus_and_nan_as_minus_and_bit_order_is_lsb_first():
    x = torch.tensor([0.0, -0.0, float("nan"), -1.0, 1.0, -1.0, -1.0, -1.0, -1.0])
    assert pack_signs(x).tolist() == [0b00010011, 0b11111110]
    assert unpack_signs(pack_signs(x), (9,)).tolist() == [1, 1, -1, -1, 1, -1, -1, -1, -1]


def test_non_contiguous_input_packs_its_logical_order():
    x = torch.tensor([[1.0, -1.0], [-1.0, 1.0], [1.0, 1.0]]).t()  # [[1,-1,1],[-1,1,1]]
    assert torch.equal(unpack_signs(pack_signs(x), x.shape), x)


def test_bad_input():
    with pytest.raises(ValueError, match="real numeric tensor"):
        pack_signs(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="1-D uint8"):
        unpack_signs(torch.zeros(2, dtype=torch.int8), (3,))
    with pytest.raises(ValueError, match=r"holds 8 signs but shape \(3, 3\) needs 9"):
        unpack_signs(torch.zeros(1, dtype=torch.uint8), (3, 3))
    # a size inferred from the bytes handed the padding back as entries (7 signs, 8 votes)
    with pytest.raises(ValueError, match=r"no negative size .* got \(-1,\)"):
        unpack_signs(pack_signs(torch.ones(6)), (-1,))
    with pytest.raises(ValueError, match=r"no negative size .* got \(2, -1\)"):
        unpack_votes(pack_votes(torch.ones(6)), (2, -1))


# pack_votes / unpack_votes: five votes in {−1, 0, +1} per byte, base 3 (majority_vote's)


def pack_votes_by_hand(values):
    """Reference: digit k%5 (base 3, least significant first) of byte k//5 is sign + 1,
    sign(0) = 0 (NaN too); the padding abstains (digit 1)."""

    def sign(v):
        return 1 if v > 0 else -1 if v < 0 else 0  # NaN compares false both ways

    out = []
    for start in range(0, len(values), 5):
        part = [sign(v) for v in values[start : start + 5]]
        part += [0] * (5 - len(part))
        out.append(sum((s + 1) * 3**i for i, s in enumerate(part)))
    return out


@pytest.mark.parametrize("residue", range(5))
@given(data=st.data())
def test_votes_round_trip_for_every_length_mod_5(residue, data):
    n = 5 * data.draw(st.integers(0, 12)) + residue
    values = data.draw(
        st.lists(
            st.sampled_from([-2.5, -1e-30, -0.0, 0.0, float("nan"), 1e-30, 3.0]),
            min_size=n,
            max_size=n,
        )
    )
    x = torch.tensor(values, dtype=torch.float32)
    packed = pack_votes(x)
    assert packed.dtype == torch.uint8 and packed.shape == (-(-n // 5),)
    assert packed.tolist() == pack_votes_by_hand(values)
    assert max(packed.tolist(), default=0) <= 242
    expected = (x > 0).float() - (x < 0).float()  # NaN: 0
    assert torch.equal(unpack_votes(packed, (n,)), expected)


@given(
    shape=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.int32]),
    seed=st.integers(0, 2**16),
)
def test_votes_round_trip_any_shape_and_dtype(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, shape, generator=g).to(dtype)  # zeros included
    out = unpack_votes(pack_votes(x), x.shape, dtype=torch.int32)
    assert out.shape == x.shape and torch.equal(out, torch.sign(x.to(torch.float64)).int())


def test_bad_vote_input():
    with pytest.raises(ValueError, match="real numeric tensor"):
        pack_votes(torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="1-D uint8"):
        unpack_votes(torch.zeros(2, dtype=torch.int8), (3,))
    with pytest.raises(ValueError, match=r"holds 5 votes but shape \(2, 3\) needs 6"):
        unpack_votes(torch.zeros(1, dtype=torch.uint8), (2, 3))
