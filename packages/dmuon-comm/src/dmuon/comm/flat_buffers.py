"""Flat buckets: many tensors of one dtype in one contiguous buffer, grouped by owner.

One collective on one flat buffer costs one start-up latency instead of one per
tensor. A :class:`FlatBucket` hands out *views* into its buffer, so gradients can
be accumulated straight into it (as DDP's ``gradient_as_bucket_view`` does) and
results read straight out of it: packing and unpacking copies are only needed
when the tensors live elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from dmuon.comm.owner_plan import OwnerPlan

__all__ = ["BucketSlot", "FlatBucket", "make_buckets"]


@dataclass(frozen=True)
class BucketSlot:
    """Where one tensor lives in a bucket.

    Attributes:
        name: the tensor's name.
        shape: its shape.
        offset: first element in the flat buffer.
        numel: number of elements.

    Examples:
        >>> BucketSlot("w", (2, 3), offset=4, numel=6).end
        10
    """

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int

    @property
    def end(self) -> int:
        """One past the slot's last element."""
        return self.offset + self.numel


class FlatBucket:
    """A flat, contiguous 1-D buffer holding named tensors of one dtype.

    Args:
        shapes: ``(name, shape)`` pairs, laid out in this order.
        dtype: element type of the buffer.
        owner: the rank the bucket's items belong to (``-1``: none).
        device: where to allocate the buffer.
        alignment: every slot starts at a multiple of this many elements.
        buffer: storage to use instead of allocating: a contiguous 1-D tensor of
            ``dtype`` with at least the layout's number of elements.

    Raises:
        ValueError: repeated names, bad shapes or alignment, or a ``buffer`` of the
            wrong dtype, dimension, size or layout (it must be contiguous: the
            collectives use it in place).

    Examples:
        >>> import torch
        >>> b = FlatBucket([("a", (2, 2)), ("b", (3,))], dtype=torch.float32, owner=1)
        >>> b.view("a").fill_(1.0); b.view("b").fill_(2.0)  # doctest: +ELLIPSIS
        tensor(...)
        >>> b.buffer
        tensor([1., 1., 1., 1., 2., 2., 2.])
        >>> b.view("a").data_ptr() == b.buffer.data_ptr()  # a view, not a copy
        True
    """

    def __init__(
        self,
        shapes: Iterable[tuple[str, Sequence[int]]],
        *,
        dtype: torch.dtype,
        owner: int = -1,
        device: torch.device | str | None = None,
        alignment: int = 1,
        buffer: torch.Tensor | None = None,
    ) -> None:
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
            raise ValueError(f"alignment must be an int ≥ 1 (elements), got {alignment!r}")
        slots: list[BucketSlot] = []
        offset = 0
        for name, shape in shapes:
            shape_t = tuple(int(d) for d in shape)
            if any(d < 0 for d in shape_t):
                raise ValueError(f"tensor {name!r}: shape must be non-negative, got {shape_t}")
            offset = -(-offset // alignment) * alignment
            numel = math.prod(shape_t)
            slots.append(BucketSlot(name, shape_t, offset, numel))
            offset += numel
        names = [s.name for s in slots]
        if len(set(names)) != len(names):
            raise ValueError(f"names in a bucket must be unique, got {names}")
        self.slots: tuple[BucketSlot, ...] = tuple(slots)
        self.owner = owner
        self.dtype = dtype
        self.numel = offset
        if buffer is None:
            buffer = torch.zeros(offset, dtype=dtype, device=device)
        else:
            if buffer.dtype != dtype or buffer.dim() != 1 or buffer.numel() < offset:
                raise ValueError(
                    f"buffer must be a 1-D {dtype} tensor with ≥ {offset} elements, got "
                    f"{buffer.dtype} of shape {tuple(buffer.shape)}"
                )
            if not buffer.is_contiguous():
                raise ValueError(
                    "buffer must be contiguous: collectives send and receive it in place "
                    f"(got strides {buffer.stride()}); pass buffer.contiguous() or let the "
                    "bucket allocate"
                )
            buffer = buffer[:offset]
        self.buffer = buffer
        self._index = {s.name: s for s in slots}
        self._views = {s.name: buffer[s.offset : s.end].view(s.shape) for s in slots}
        self._names = tuple(s.name for s in slots)

    def __repr__(self) -> str:
        return (
            f"FlatBucket(owner={self.owner}, dtype={self.dtype}, tensors={len(self.slots)}, "
            f"numel={self.numel})"
        )

    def __len__(self) -> int:
        return len(self.slots)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    @property
    def names(self) -> tuple[str, ...]:
        """Names of the tensors, in layout order."""
        return self._names

    @property
    def nbytes(self) -> int:
        """Bytes of the flat buffer."""
        return self.numel * self.buffer.element_size()

    @property
    def device(self) -> torch.device:
        """Device of the buffer."""
        return self.buffer.device

    def layout(self) -> tuple[tuple[str, tuple[int, ...], int], ...]:
        """``(name, shape, offset)`` per slot: what must match across ranks."""
        return tuple((s.name, s.shape, s.offset) for s in self.slots)

    def view(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as a view into the buffer (writes go to the bucket)."""
        try:
            return self._views[name]
        except KeyError:
            raise KeyError(f"{name!r} is not in this bucket (it holds {self.names})") from None

    def views(self) -> dict[str, torch.Tensor]:
        """Every tensor as a view into the buffer, by name."""
        return dict(self._views)

    def pack(self, tensors: Mapping[str, torch.Tensor]) -> FlatBucket:
        """Copy ``tensors`` into the bucket (any layout; each must match its slot's shape).

        Every name of the bucket must be present; extra names are ignored, so one
        mapping can fill several buckets. Returns the bucket.

        Raises:
            ValueError: a name is missing or a tensor's shape differs from its slot.
        """
        missing = [n for n in self.names if n not in tensors]
        if missing:
            raise ValueError(
                f"pack: no tensor for {missing[:5]} (the bucket for owner {self.owner} "
                f"holds {len(self.names)} tensors)"
            )
        for slot in self.slots:
            t = tensors[slot.name]
            if tuple(t.shape) != slot.shape:
                raise ValueError(
                    f"pack: tensor {slot.name!r} has shape {tuple(t.shape)}, but the plan "
                    f"and bucket say {slot.shape}"
                )
        for slot in self.slots:
            self._views[slot.name].copy_(tensors[slot.name])
        return self

    def unpack_into(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy the bucket's tensors out to ``tensors`` (names present in both).

        Raises:
            ValueError: a destination's shape differs from its slot.
        """
        for slot in self.slots:
            if slot.name in tensors and tuple(tensors[slot.name].shape) != slot.shape:
                raise ValueError(
                    f"unpack_into: destination {slot.name!r} has shape "
                    f"{tuple(tensors[slot.name].shape)}, the bucket holds {slot.shape}"
                )
        with torch.no_grad():  # destinations may be a model's Parameters (leaves needing grad)
            for slot in self.slots:
                if slot.name in tensors:
                    tensors[slot.name].copy_(self._views[slot.name])

    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping[str, torch.Tensor],
        *,
        owner: int = -1,
        alignment: int = 1,
    ) -> FlatBucket:
        """A new bucket holding copies of ``tensors`` (one dtype and device).

        Examples:
            >>> import torch
            >>> b = FlatBucket.from_tensors({"x": torch.ones(2, 2), "y": torch.zeros(3)})
            >>> b.numel, b.names
            (7, ('x', 'y'))
        """
        if not tensors:
            raise ValueError("from_tensors needs at least one tensor")
        dtypes = {t.dtype for t in tensors.values()}
        devices = {t.device for t in tensors.values()}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(
                f"a bucket holds one dtype on one device, got dtypes {sorted(map(str, dtypes))} "
                f"and devices {sorted(map(str, devices))}"
            )
        bucket = cls(
            ((n, tuple(t.shape)) for n, t in tensors.items()),
            dtype=dtypes.pop(),
            owner=owner,
            device=devices.pop(),
            alignment=alignment,
        )
        return bucket.pack(tensors)


def make_buckets(
    plan: OwnerPlan,
    *,
    names: Iterable[str] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    bucket_bytes: int | None = None,
    alignment: int = 1,
) -> list[FlatBucket]:
    """Buckets for the items of ``plan``, grouped by owner, then by dtype.

    Buckets come in owner order (rank 0's first) and hold their items in the plan's
    canonical order, so every rank that calls this with the same plan and
    arguments gets the same layouts — what the owner-rooted collectives need. A
    bucket is closed when the next item would take it past ``bucket_bytes``
    (counted without the ``alignment`` padding: an aligned bucket may exceed it by
    up to ``alignment - 1`` elements per item); an item larger than that gets a
    bucket of its own. With ``bucket_bytes=None``
    (default) each owner has one bucket per dtype: the collectives are coalesced
    per owner.

    Args:
        plan: the owner plan.
        names: a subset of the items (e.g. one layer group, for pipelining);
            default all.
        dtype: buffer dtype for every item (e.g. bf16 for communication); default
            each item's own dtype.
        device: where to allocate.
        bucket_bytes: largest bucket, in bytes; ``None`` for no limit.
        alignment: slot alignment in elements.

    Raises:
        ValueError: unknown names, or a ``bucket_bytes`` that is not a positive int.

    Examples:
        >>> from dmuon.comm import MatrixItem, plan_owners, make_buckets
        >>> items = [MatrixItem(f"h.{i}.w", (64, 64), layer=f"h.{i}") for i in range(4)]
        >>> plan = plan_owners(items, 2)
        >>> for bucket in make_buckets(plan):
        ...     print(bucket.owner, bucket.names)
        0 ('h.0.w', 'h.2.w')
        1 ('h.1.w', 'h.3.w')
    """
    if bucket_bytes is not None and (
        isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1
    ):
        raise ValueError(f"bucket_bytes must be a positive int or None, got {bucket_bytes!r}")
    wanted: set[str] | None = None
    if names is not None:
        wanted = set(names)
        unknown = sorted(n for n in wanted if n not in plan)
        if unknown:
            raise ValueError(f"names not in the plan: {unknown[:5]}")
    buckets: list[FlatBucket] = []
    for rank in range(plan.world_size):
        by_dtype: dict[torch.dtype, list[list[tuple[str, tuple[int, ...]]]]] = {}
        sizes: dict[torch.dtype, int] = {}
        for item in plan.items_of(rank):
            if wanted is not None and item.name not in wanted:
                continue
            dt = dtype or item.dtype
            nbytes = item.numel * torch.empty((), dtype=dt).element_size()
            groups = by_dtype.setdefault(dt, [[]])
            if bucket_bytes is not None and groups[-1] and sizes.get(dt, 0) + nbytes > bucket_bytes:
                groups.append([])
                sizes[dt] = 0
            groups[-1].append((item.name, item.shape))
            sizes[dt] = sizes.get(dt, 0) + nbytes
        for dt, groups in by_dtype.items():
            for members in groups:
                buckets.append(
                    FlatBucket(members, dtype=dt, owner=rank, device=device, alignment=alignment)
                )
    return buckets
