"""How each matrix parameter is laid out over its device mesh, read from its DTensor placements.

A model parallelised with torch's public APIs (``fully_shard`` on a ``dp`` mesh
dimension, ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` on a
``tp`` one) holds its matrices as DTensors. Their ``placements`` — one per mesh
dimension — say which mesh dimension splits which tensor dimension. An engine that
orthogonalised a shard as if it were the whole matrix would be silently wrong (the
bug users report in other implementations), so every mode states what it steps
correctly and refuses the rest, before any collective, with an error that names the
parameter, its placements and the mode that does take it. Placements are the same
on every rank, so every rank refuses alike and none waits for the others.

What each mode takes today:

=====================================  =======================================
placements of a matrix                 mode
=====================================  =======================================
none (a plain tensor)                  ``single``, ``owner``, ``replicated``,
                                       ``sign``
``Shard(0)`` over one mesh dimension,  ``sharded`` (FSDP2; HSDP; a colwise
``Replicate()`` over the others        layer's rows, whose gradient is
                                       complete); ``single`` on the shards
                                       of a 2-D matrix
                                       (:mod:`~dmuon.optim.engine.tensor_split`);
                                       ``replicated`` and ``owner`` with
                                       owners over the *other* dimension
                                       of a ``dp × tp`` mesh, the owner's
                                       ``tp`` row stepping the shards
                                       (:mod:`~dmuon.optim.engine.owner_split`)
``Replicate()`` on every mesh          ``single``, ``replicated`` and
dimension (a layer kept whole inside   ``owner``: every rank holds the whole
a tensor-parallel model)               matrix, stepped as a plain one on its
                                       local tensor after its gradient's
                                       pending sums (``Partial``) are
                                       carried out (:attr:`MatrixPlacement.
                                       replicated_whole`)
``Shard(1)`` over one mesh dimension,  ``single`` on the shards (a rowwise
``Replicate()`` over the others        tensor-parallel layer's columns);
                                       ``replicated`` and ``owner`` over
                                       ``dp × tp`` as above
FSDP2 over tensor parallelism: a 2-D   ``sharded``: the rows travel to an
matrix with ``Shard(0)`` (or           owner over ``dp``, whose ``tp`` row
``_StridedShard(0)`` over a ``tp``     steps the tensor-parallel shards
``Shard(0)``) on ``dp`` and            together (:attr:`MatrixPlacement.
``Shard(0)``/``Shard(1)`` on a later   sharded_split`)
mesh dimension ``tp``
a stack ``(E, m, n)`` (group key       ``single``, each rank its own whole
``flatten=False``) with ``Shard(d)``,  matrices as a batch (expert
``d`` a leading dimension, over one    parallelism: no gather, no
mesh dimension, ``Replicate()`` over   collective); ``replicated`` with
the others                             ``process_group`` the ``dp`` group of a
                                       ``dp × ep`` mesh (one owner among the
                                       replicas steps them,
                                       :mod:`~dmuon.optim.engine.expert_split`);
                                       ``owner`` (``ddp.dedicate``) when the
                                       dimension is the whole dedication
                                       group (no replicas: each rank steps
                                       its experts where they live);
                                       ``d = 0`` also ``sharded`` (FSDP2's
                                       rows of a stack are whole experts,
                                       stepped where they are)
a stack sharded along leading          ``single`` and ``sharded``, each rank
dimensions over several mesh           its own whole experts as a batch
dimensions (Hugging Face's expert      (:attr:`MatrixPlacement.whole_experts`)
parallelism under FSDP2:
``_StridedShard(0)`` on ``efsdp``,
``Shard(0)`` on ``ep``)
anything else: other strided shards,   refused by every mode
``Partial``, two shards of one
matrix dimension in the wrong order
=====================================  =======================================

torch's ``_StridedShard`` (what FSDP2 puts on ``dp`` over a tensor-parallel
``Shard(0)``) is not a ``Shard`` subclass in every torch release and answers
``is_shard()`` with False in some; it is counted as a shard of its ``dim`` all the
same. It is taken only where FSDP2 puts it: on the data-parallel mesh dimension, with
a split factor equal to the size of the later mesh dimension that shards the same
rows — then each ``dp`` rank holds a block of rows of its ``tp`` shard, and gathering
the rows over ``dp`` gives that shard. Any other split factor is an unknown layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from dmuon.optim.engine.params import EngineParam, is_dtensor

__all__ = [
    "MatrixPlacement",
    "check_placements",
    "placement_of",
    "placement_of_param",
    "sharded_scalars",
    "supported_by",
]


@dataclass(frozen=True)
class MatrixPlacement:
    """One parameter's layout over its device mesh.

    Attributes:
        name: the parameter's name.
        placements: its placements as text, one per mesh dimension (``()`` for a plain
            tensor), e.g. ``("Shard(dim=0)",)``.
        mesh_dims: the names of the mesh dimensions (``"dim0"``… where unnamed).
        shards: ``(mesh dim, tensor dim, strided)`` for each mesh dimension that splits
            the tensor.
        partial: the mesh dimensions on which the tensor is a pending sum (``Partial``).
        unknown: the mesh dimensions of a placement this module does not know.
        ndim: the tensor's number of dimensions (only a 2-D tensor is stepped on its
            shards).
        stack: the tensor is a stack of matrices over its leading dimensions (an expert
            stack ``(E, m, n)``, param group key ``flatten=False``), not one matrix.

    Examples:
        >>> rowwise = MatrixPlacement("fc2.weight", ("Shard(dim=1)",), ("tp",), ((0, 1, False),))
        >>> rowwise.summary(), rowwise.row_sharded
        ("(Shard(dim=1),) on mesh dims ('tp',)", False)
        >>> supported_by(rowwise), supported_by(MatrixPlacement("fc1.weight"))
        (('single', 'replicated', 'owner'), ('single', 'owner', 'replicated', 'sign'))
    """

    name: str
    placements: tuple[str, ...] = ()
    mesh_dims: tuple[str, ...] = ()
    shards: tuple[tuple[int, int, bool], ...] = ()
    partial: tuple[int, ...] = ()
    unknown: tuple[int, ...] = ()
    ndim: int = 2
    stack: bool = False

    @property
    def distributed(self) -> bool:
        """True for a DTensor."""
        return bool(self.placements)

    @property
    def split_dim(self) -> int | None:
        """The tensor dimension of the one plain ``Shard`` over exactly one mesh dimension,
        with ``Replicate()`` over the others; ``None`` for any other layout."""
        if len(self.shards) != 1 or self.shards[0][2] or self.partial or self.unknown:
            return None
        return self.shards[0][1]

    @property
    def replicated_whole(self) -> bool:
        """A DTensor with ``Replicate()`` on every mesh dimension: each rank holds the whole
        parameter (a small layer kept replicated inside a tensor-parallel model, as
        torchtitan's ``NoParallel`` router gate). Its local tensor *is* the matrix, so the
        modes that step plain matrices step it the same way, on ``to_local()``; only its
        gradient needs care: DTensor may hand it a pending sum (``Partial()``, e.g. when the
        layer reads a sequence-sharded activation), which is carried out (summed over that
        mesh dimension, DTensor's meaning) before the rule reads it. Any number of
        dimensions: the group's layout (``flatten``, ``split_sizes``, ``num_heads``) cuts
        the whole local tensor as it cuts a plain one.

        Examples:
            >>> whole = MatrixPlacement("gate.weight", ("Replicate()",), ("tp",))
            >>> whole.replicated_whole, supported_by(whole)
            (True, ('single', 'replicated', 'owner'))
        """
        return self.distributed and not (self.shards or self.partial or self.unknown)

    @property
    def row_sharded(self) -> bool:
        """``Shard(0)`` over exactly one mesh dimension, ``Replicate()`` over the others:
        each rank holds whole rows of the matrix (FSDP2, HSDP, a colwise TP layer)."""
        return self.split_dim == 0

    @property
    def tensor_split(self) -> bool:
        """A 2-D tensor with ``Shard(0)`` or ``Shard(1)`` over exactly one mesh dimension,
        ``Replicate()`` over the others: each rank holds whole rows or whole columns,
        which ``single`` mode steps on the shards (:mod:`~dmuon.optim.engine.tensor_split`)."""
        return self.ndim == 2 and self.split_dim in (0, 1)

    @property
    def sharded_split(self) -> bool:
        """FSDP2 over tensor parallelism: a 2-D tensor whose rows are sharded over one mesh
        dimension (``dp``) and which is split by ``Shard(0)`` or ``Shard(1)`` over a later
        one (``tp``), ``Replicate()`` over any other. Rows over ``dp`` of a row split are
        FSDP2's ``_StridedShard(0)`` (each ``dp`` rank a block of its ``tp`` shard's rows),
        of a column split a plain ``Shard(0)``: either way the rows gathered over ``dp``
        are this rank's ``tp`` shard, which ``sharded`` mode's owner steps with its ``tp``
        row (:mod:`~dmuon.optim.engine.tensor_split`).

        Examples:
            >>> colwise = MatrixPlacement("w", ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"),
            ...                           ("dp", "tp"), ((0, 0, True), (1, 0, False)))
            >>> colwise.sharded_split, colwise.tensor_split, supported_by(colwise)
            (True, False, ('sharded',))
            >>> rows_twice = MatrixPlacement("w", ("Shard(dim=0)", "Shard(dim=0)"), ("dp", "tp"),
            ...                              ((0, 0, False), (1, 0, False)))  # tp inside dp
            >>> rows_twice.sharded_split, supported_by(rows_twice)
            (False, ())
        """
        if self.ndim != 2 or self.partial or self.unknown or len(self.shards) != 2:
            return False
        (d_dp, rows, strided), (d_tp, split, tp_strided) = sorted(self.shards)
        if rows != 0 or tp_strided or d_dp > d_tp:
            return False
        return (split == 0 and strided) or (split == 1 and not strided)

    @property
    def sharded_split_dims(self) -> tuple[int, int, int]:
        """``(dp mesh dim, tp mesh dim, tensor dim split over tp)`` of a
        :attr:`sharded_split` matrix."""
        if not self.sharded_split:
            raise ValueError(f"{self.name!r} is not FSDP2 over tensor parallelism")
        (d_dp, _, _), (d_tp, split, _) = sorted(self.shards)
        return d_dp, d_tp, split

    @property
    def expert_split(self) -> bool:
        """A stack of matrices (:attr:`stack`) with ``Shard(d)`` over exactly one mesh
        dimension, ``d`` one of its leading (batch) dimensions, ``Replicate()`` over the
        others: each rank holds whole matrices — its experts — which ``single`` mode steps
        where they are, as a batch, with no collective.

        Examples:
            >>> ep = MatrixPlacement("w", ("Shard(dim=0)",), ("ep",), ((0, 0, False),), ndim=3,
            ...                      stack=True)
            >>> ep.expert_split, ep.tensor_split, supported_by(ep)
            (True, False, ('sharded', 'single', 'replicated', 'owner'))
        """
        d = self.split_dim
        return self.stack and self.ndim > 2 and d is not None and d < self.ndim - 2

    @property
    def whole_experts(self) -> bool:
        """A stack of matrices (:attr:`stack`) sharded only along its leading (expert)
        dimensions, over any number of mesh dimensions (:attr:`expert_split` over one;
        Hugging Face's expert parallelism with FSDP2 on top puts FSDP2's
        ``_StridedShard(0)`` on ``efsdp`` and ``Shard(0)`` on ``ep``), ``Replicate()`` over
        the others: every rank holds whole experts, with their whole gradients once FSDP2
        or the expert dispatch has run, so ``single`` and ``sharded`` mode step them where
        they are, as one batch, with no collective.

        Examples:
            >>> hf = MatrixPlacement("w", ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"),
            ...                      ("efsdp", "ep"), ((0, 0, True), (1, 0, False)), ndim=3,
            ...                      stack=True)
            >>> hf.whole_experts, hf.expert_split, supported_by(hf)
            (True, False, ('sharded', 'single'))
        """
        return (
            self.stack
            and self.ndim > 2
            and bool(self.shards)
            and not self.partial
            and not self.unknown
            and all(dim < self.ndim - 2 for _, dim, _ in self.shards)
        )

    def summary(self) -> str:
        """``(Shard(dim=0),) on mesh dims ('tp',)`` — what the errors print."""
        if not self.distributed:
            return "a plain tensor (no placements)"
        inner = ", ".join(self.placements) + ("," if len(self.placements) == 1 else "")
        return f"({inner}) on mesh dims {self.mesh_dims!r}"

    def what(self) -> str:
        """In words, how the matrix is laid out.

        Examples:
            >>> MatrixPlacement("w", ("Replicate()",), ("tp",)).what().split(" (")[0]
            'replicated whole'
            >>> rows = MatrixPlacement("w", ("Shard(dim=1)", "Shard(dim=0)"), ("efsdp", "ep"),
            ...                        ((0, 1, False), (1, 0, False)), ndim=3, stack=True)
            >>> rows.what().split(":")[0]  # torchtitan's FSDP2 when efsdp × ep > num_experts
            "a stack of matrices split along matrix dim 1 over mesh dim(s) ['efsdp']"
            >>> supported_by(rows)
            ()
        """
        if self.partial:
            return "a pending sum (Partial) on some ranks"
        if self.sharded_split:
            d_dp, d_tp, split = self.sharded_split_dims
            return (
                f"rows sharded over mesh dim {self.mesh_dims[d_dp]!r} (FSDP2) of a matrix split "
                f"along tensor dim {split} over {self.mesh_dims[d_tp]!r} (tensor parallelism)"
            )
        if self.whole_experts and len(self.shards) > 1:
            return (
                "a stack of matrices split along its leading dim over several mesh "
                "dimensions: each rank holds whole experts"
            )
        cut = [(d, t) for d, t, _ in self.shards if t >= self.ndim - 2]
        if self.stack and self.ndim > 2 and cut:
            return (
                "a stack of matrices split along matrix dim "
                f"{', '.join(str(t) for t in sorted({t for _, t in cut}))} over mesh dim(s) "
                f"{sorted({self.mesh_dims[d] for d, _ in cut})}: every matrix of the stack is "
                "cut (an expert's rows sharded by FSDP2, or tensor parallelism inside the "
                "experts); DMuon steps whole experts only: shard the stack on its leading "
                "(expert) dimension"
            )
        if len(self.shards) > 1:
            return (
                "split over several mesh dimensions in a layout no mode steps (FSDP2 over "
                "tensor parallelism is rows on dp, then a Shard(0) or Shard(1) on tp)"
            )
        if any(strided for _, _, strided in self.shards):
            return "a strided shard"
        if self.expert_split:
            return (
                f"a stack of matrices split along its leading dim {self.shards[0][1]}: each "
                "rank holds whole experts"
            )
        if self.shards and self.shards[0][1] != 0:
            return (
                f"split along tensor dim {self.shards[0][1]} (columns: a rowwise "
                "tensor-parallel layer)"
            )
        if self.unknown:
            return "laid out by a placement DMuon does not know"
        if not self.shards:
            return "replicated whole (Replicate() on every mesh dimension)"
        return "split by rows over one mesh dimension"


def placement_of(p: torch.Tensor, name: str, stack: bool = False) -> MatrixPlacement:
    """The layout of ``p`` read from its public DTensor ``placements`` and ``device_mesh``;
    ``stack``: ``p`` is a stack of matrices over its leading dimensions (see
    :attr:`MatrixPlacement.stack`; :func:`placement_of_param` reads it from the group).

    Examples:
        >>> import torch
        >>> placement_of(torch.zeros(2, 2), "w").summary()
        'a plain tensor (no placements)'
    """
    if not is_dtensor(p):
        return MatrixPlacement(name, ndim=p.dim(), stack=stack)
    mesh = p.device_mesh  # type: ignore[attr-defined]
    placements = tuple(p.placements)  # type: ignore[attr-defined]
    names = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
    shards: list[tuple[int, int, bool]] = []
    partial: list[int] = []
    unknown: list[int] = []
    for d, pl in enumerate(placements):
        kind = _kind(pl)
        if kind == "strided" and not _fsdp_strided(d, pl, placements, mesh):
            kind = "unknown"
        if kind == "shard":
            shards.append((d, int(pl.dim) % p.dim(), False))
        elif kind == "strided":
            shards.append((d, int(pl.dim) % p.dim(), True))
        elif kind == "partial":
            partial.append(d)
        elif kind != "replicate":
            unknown.append(d)
    return MatrixPlacement(
        name,
        tuple(repr(pl) for pl in placements),
        tuple(str(n) for n in names),
        tuple(shards),
        tuple(partial),
        tuple(unknown),
        p.dim(),
        stack,
    )


def placement_of_param(e: EngineParam) -> MatrixPlacement:
    """:func:`placement_of` an optimizer parameter, a stack when its group says so
    (``flatten=False`` on a tensor of more than 2 dimensions: its planned
    :attr:`~dmuon.optim.engine.params.EngineParam.item` keeps every dimension).
    """
    return placement_of(e.param, e.name, stack=e.param.dim() > 2 and len(e.item.shape) > 2)


def _fsdp_strided(d: int, pl: Any, placements: tuple[Any, ...], mesh: Any) -> bool:
    """A strided shard on mesh dim ``d`` as FSDP2 lays it over tensor parallelism: its split
    factor is the size of the later mesh dimensions that shard the same tensor dimension
    (read from the placement's public ``split_factor`` field when it has one)."""
    later = [
        int(mesh.size(k))
        for k in range(d + 1, len(placements))
        if _kind(placements[k]) == "shard" and int(placements[k].dim) == int(pl.dim)
    ]
    factor = getattr(pl, "split_factor", None)
    expected = 1
    for size in later:
        expected *= size
    return bool(later) and (factor is None or int(factor) == expected)


def _kind(pl: Any) -> str:
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(pl, Shard) and type(pl) is Shard:
        return "shard"
    if isinstance(pl, Replicate) or (
        callable(getattr(pl, "is_replicate", None)) and pl.is_replicate()
    ):
        return "replicate"
    if callable(getattr(pl, "is_partial", None)) and pl.is_partial():
        return "partial"
    if isinstance(getattr(pl, "dim", None), int):  # a Shard subclass or _StridedShard
        return "strided"
    return "unknown"


def supported_by(pl: MatrixPlacement) -> tuple[str, ...]:
    """The modes that step a matrix of layout ``pl`` correctly today.

    Examples:
        >>> fsdp = MatrixPlacement("w", ("Shard(dim=0)",), ("dp",), ((0, 0, False),))
        >>> supported_by(fsdp)
        ('sharded', 'single', 'replicated', 'owner')
    """
    if not pl.distributed:
        return ("single", "owner", "replicated", "sign")
    if pl.replicated_whole:
        return ("single", "replicated", "owner")
    if pl.sharded_split:
        return ("sharded",)
    if pl.whole_experts and not pl.expert_split:  # over several mesh dims
        return ("sharded", "single")
    modes = ("sharded",) if pl.row_sharded else ()
    return modes + (("single", "replicated", "owner") if pl.tensor_split or pl.expert_split else ())


def sharded_scalars(params: Iterable[EngineParam]) -> list[str]:
    """The scalar parameters (AdamW/Lion groups) that are DTensors split over some mesh
    dimension: FSDP2 shards every parameter it manages (``Shard(0)`` over ``dp``), so such
    a parameter says that FSDP2 reduce-scatters its gradient, as a ``Shard(0)`` matrix
    does. Mode detection reads them (:func:`~dmuon.optim.engine.modes.make_engine`): a
    model whose only parameters are scalars has no matrix to tell FSDP2 by.

    Examples:
        >>> import torch
        >>> from dmuon.optim import DMuon
        >>> from dmuon.optim.engine import collect_params
        >>> opt = DMuon([{"params": [torch.nn.Parameter(torch.ones(4))], "rule": "adamw"}])
        >>> sharded_scalars(collect_params(opt.param_groups))  # a plain tensor
        []
    """
    return [e.name for e in params if not e.matrix and placement_of(e.param, e.name).shards]


def _check_scalars(params: list[EngineParam], mode: str) -> None:
    """Refuse, in ``sign`` mode, a scalar parameter that is a DTensor: sign mode averages
    the scalar gradients itself, in one flat buffer of local tensors, which a DTensor
    gradient cannot be copied into (it crashed inside ``FlatBucket.pack`` with torch's
    "got mixed torch.Tensor and DTensor"); and under FSDP2 the gradient is already
    averaged, while Sign-Muon's matrices need each rank's local gradient, which FSDP2 does
    not leave. Every other mode steps a DTensor scalar on its local tensor."""
    if mode != "sign":
        return
    for e in params:
        if e.matrix or not is_dtensor(e.param):
            continue
        pl = placement_of(e.param, e.name)
        fsdp = (
            "FSDP2 shards every parameter it manages and averages its gradient, while "
            "Sign-Muon votes on each rank's own local gradients: train the model without "
            "fully_shard for mode='sign', or keep FSDP2 and leave mode unset "
            "(mode='sharded', which steps FSDP2's parameters), or dedicate the matrices "
            "(dmuon.integrations.fsdp.dedicate: owner mode)"
            if pl.shards
            else "sign mode averages the scalar gradients itself, over local tensors: keep "
            "this parameter a plain tensor (out of DTensor parallelism), or use "
            "mode='single' or mode='replicated'"
        )
        raise ValueError(
            f"scalar parameter {e.name!r} (shape {tuple(e.param.shape)}) is a DTensor with "
            f"placements {pl.summary()}, which mode='sign' does not step; {fsdp}"
        )


def check_placements(params: Iterable[EngineParam], mode: str) -> None:
    """Refuse every matrix parameter ``mode`` does not step correctly, and in ``sign``
    mode every scalar parameter that is a DTensor (:func:`_check_scalars`).

    Raises:
        ValueError: naming the first such parameter, its placements, and the mode that
            takes it (or that none does yet).

    Examples:
        >>> import torch
        >>> from dmuon.optim import DMuon
        >>> from dmuon.optim.engine import collect_params
        >>> opt = DMuon([torch.nn.Parameter(torch.ones(4, 4))])
        >>> check_placements(collect_params(opt.param_groups), "single")  # a plain matrix
        >>> check_placements(collect_params(opt.param_groups), "sharded")
        Traceback (most recent call last):
            ...
        ValueError: matrix parameter 'group0.param0' is a plain tensor, but mode='sharded' ...
    """
    params = list(params)
    experts = [e.name for e in params if e.matrix and placement_of_param(e).expert_split]
    layouts = {e.name: placement_of_param(e) for e in params if e.matrix}
    every = (
        set.intersection(*(set(supported_by(pl)) for pl in layouts.values())) if layouts else set()
    )
    for e in params:
        if not e.matrix:
            continue
        pl = placement_of_param(e)
        modes = supported_by(pl)
        if mode in modes:
            continue
        if not pl.distributed:
            ep = (
                f"; expert stacks split over a mesh dimension ({experts[0]!r}) beside plain "
                "matrices are stepped by mode='single' (each rank its own experts; you "
                "synchronise the replicated gradients, as DDP would), or in owner mode by "
                "ddp.dedicate(model) over the ranks they are split over"
                if experts
                else ""
            )
            raise ValueError(
                f"matrix parameter {e.name!r} is a plain tensor, but mode={mode!r} steps "
                "DTensor shards; sharded mode steps FSDP2's sharded matrices (call fully_shard "
                f"on the model first, or pick another mode){ep}"
            )
        if pl.whole_experts:
            sharded = (
                "; if FSDP2 sharded it (every matrix of the model a DTensor), mode='sharded' "
                "steps it too, where it is"
                if "sharded" in modes
                else ""
            )
            replicated = (
                ", or mode='replicated' with process_group= the data-parallel group of a "
                "dp × ep mesh (one owner among the replicas steps them)"
                if pl.expert_split
                else ""
            )
            raise ValueError(
                f"matrix parameter {e.name!r} has placements {pl.summary()} ({pl.what()}), "
                f"which mode={mode!r} does not step; mode='single' does: each rank steps the "
                "experts it holds, as one batch of whole matrices, with no gather (expert "
                f"parallelism): pass mode='single'{replicated}{sharded}"
            )
        if pl.replicated_whole:
            why = (
                "FSDP2 shards every parameter it manages (this one would be Shard(0) over dp, "
                "which sharded mode steps); a DTensor replicated on every mesh dimension is "
                "one FSDP2 does not manage, so nothing would average its gradient over the "
                "data-parallel ranks: pass its module to fully_shard, or "
                if mode == "sharded"
                else "Sign-Muon votes on each rank's local gradient, which a replicated "
                "DTensor's placements do not describe: "
            )
            raise ValueError(
                f"matrix parameter {e.name!r} has placements {pl.summary()} ({pl.what()}), "
                f"which mode={mode!r} does not step. {why}use mode='single' (every rank steps "
                "the whole matrix), mode='replicated' (one owner steps it, the result is "
                "all-gathered) or owner mode (dmuon.integrations.ddp.dedicate(model, mesh)), "
                "which step it whole after carrying out its gradient's pending sums (Partial)"
            )
        if pl.sharded_split:
            raise ValueError(
                f"matrix parameter {e.name!r} has placements {pl.summary()} ({pl.what()}), "
                f"which mode={mode!r} does not step; mode='sharded' does: its rows travel to "
                "an owner over the data-parallel dimension, whose tensor-parallel row steps the "
                "shards together (leave mode unset, or pass mode='sharded')"
            )
        if "sharded" in modes and "sharded" not in every:
            # Sharded mode takes this matrix but not another one: "leave mode unset"
            # (which picks sharded mode) would only move the refusal to that one.
            other = next(n for n, o in layouts.items() if "sharded" not in supported_by(o))
            fits = [m for m in modes if m in every]
            advice = (
                f"mode={fits[0]!r} steps every matrix here: pass mode={fits[0]!r}"
                if fits
                else "no mode steps every matrix here: give these matrices separate optimizers"
            )
            raise ValueError(
                f"matrix parameter {e.name!r} has placements {pl.summary()} ({pl.what()}), "
                f"which mode={mode!r} does not step; mode='sharded' steps it, but not "
                f"{other!r} ({layouts[other].summary()}, {layouts[other].what()}); {advice}"
            )
        if "sharded" in modes:
            also = "; mode='single' steps it on its shards" if "single" in modes else ""
            raise ValueError(
                f"matrix parameter {e.name!r} has placements {pl.summary()} ({pl.what()}), "
                f"which mode={mode!r} does not step; mode='sharded' does: leave mode unset, "
                "or dedicate the matrices (dmuon.integrations.fsdp.dedicate) and pass them to "
                f"fully_shard(..., ignored_params=...){also}"
            )
        if modes:
            raise ValueError(
                f"matrix parameter {e.name!r} has placements {pl.summary()} ({pl.what()}), "
                f"which mode={mode!r} does not step; mode='single' does, on the shards, with "
                "the tensor-parallel Gram Newton–Schulz (no gather): pass mode='single', or "
                "mode='replicated' with process_group= the data-parallel group of a dp × tp "
                "mesh (owners over dp, each owner's tp row steps the shards), or dedicate the "
                "model over the dp × tp mesh (dmuon.integrations.ddp.dedicate(model, mesh): "
                "owner mode)"
            )
        raise ValueError(
            f"matrix parameter {e.name!r} has placements {pl.summary()} ({pl.what()}); no "
            f"execution mode of DMuon steps it yet (asked: mode={mode!r}), and orthogonalising "
            "its shard as if it were the whole matrix would be silently wrong. Supported: "
            "plain tensors (modes single, owner, replicated, sign); Replicate() on every "
            "mesh dimension (modes single, owner, replicated); FSDP2 over tensor "
            "parallelism (mode='sharded'); a 2-D matrix with Shard(0) "
            "or Shard(1) over one mesh dimension and Replicate() elsewhere (mode='single' or, "
            "owners over the other ranks, mode='replicated', on the shards; Shard(0) also "
            "mode='sharded', FSDP2/HSDP); a stack of matrices (flatten=False) with Shard on a "
            "leading (expert) dimension over one mesh dimension and Replicate() elsewhere "
            "(mode='single', each rank its experts, or mode='replicated' over dp). Keep this "
            "matrix out of tensor parallelism, or out of DMuon (give it to another optimizer)"
        )
    # after the matrices: their refusal says more (which mode steps the model), and a
    # scalar's is only reached when every matrix is one the mode takes
    _check_scalars(params, mode)
