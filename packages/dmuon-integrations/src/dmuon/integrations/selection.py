"""Which parameters are dedicated, how they are planned, and which groups carry them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dmuon.comm import MatrixItem, layer_key
from dmuon.comm.process_groups import check_member
from dmuon.optim import param_groups
from dmuon.optim.engine import item_shape
from dmuon.optim.engine.params import is_dtensor

__all__ = ["Predicate", "mesh_groups", "split_parameters", "tensor_parallel_dim"]

Predicate = Callable[[str, torch.Tensor], bool]


def split_parameters(
    model: nn.Module,
    predicate: Predicate | None = None,
    *,
    layer_of: Callable[[str], str] = layer_key,
    dedicate_rest: bool = False,
) -> tuple[list[tuple[MatrixItem, torch.Tensor]], list[tuple[str, str, torch.Tensor]]]:
    """``(dedicated, rest)``: the planned items of the chosen parameters, and the others.

    The default choice is what :func:`dmuon.optim.param_groups` puts in a matrix
    group (the hidden weight matrices, conv weights, expert stacks); ``predicate(name,
    param)`` overrides it. Frozen parameters are in neither list, on every rank alike;
    a tied weight appears once. With ``dedicate_rest`` (``ddp.dedicate(scalars="owner")``)
    the others are planned too, after the chosen ones, whole, each as a ``(1, numel)``
    item, and ``rest`` is empty. Their owners step them element-wise (AdamW, Lion), so
    the plan costs them as one row: :class:`~dmuon.comm.NSCost` of a ``1 × numel`` item is
    its byte term, the element-wise work. By its own shape, an embedding ``V × d`` would
    cost the Newton–Schulz of a ``d × V`` matrix (Llama-3.1-8B's: several times its
    largest hidden matrix), and its owner would get no other matrix.

    Examples:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.LayerNorm(4))
        >>> dedicated, rest = split_parameters(model)
        >>> [i.name for i, _ in dedicated], [n for n, _, _ in rest]
        (['1.weight'], ['0.weight', '1.bias', '2.weight', '2.bias'])
        >>> everything, rest = split_parameters(model, dedicate_rest=True)
        >>> [(i.name, i.shape) for i, _ in everything][:3], rest
        ([('1.weight', (4, 4)), ('0.weight', (1, 40)), ('1.bias', (1, 4))], [])

    Raises:
        TypeError: ``layer_of`` returned something other than a str (named with the
            parameter).
    """
    dedicated: list[tuple[MatrixItem, torch.Tensor]] = []
    rest: list[tuple[str, str, torch.Tensor]] = []
    order = {id(p): k for k, (_, p) in enumerate(model.named_parameters())}
    entries = []
    for group in param_groups(model):
        matrix = group.get("rule") != "scalar"
        for name, p in zip(group["param_names"], group["params"], strict=True):
            entries.append((order[id(p)], name, p, group if matrix else {}, matrix))
    for _, name, p, group, matrix in sorted(entries, key=lambda e: e[0]):
        chosen = predicate(name, p) if predicate is not None else matrix
        if chosen:
            item = MatrixItem(name, item_shape(p, group), p.dtype, _layer(layer_of, name))
            dedicated.append((item, p))
        else:
            rest.append((name, _layer(layer_of, name), p))
    if dedicate_rest:
        dedicated += [(MatrixItem(n, (1, p.numel()), p.dtype, k), p) for n, k, p in rest]
        rest = []
    return dedicated, rest


def _layer(layer_of: Callable[[str], str], name: str) -> str:
    """``layer_of(name)``, which must be a str: the key names the layer (a module, for the
    hooks) and orders the layers. An int was turned into a str for a dedicated matrix but
    kept for an all-reduced one, where sorting the keys failed (``expected string``) far
    from the call, so that ``ddp.dedicate`` refused what ``fsdp.dedicate`` took."""
    key = layer_of(name)
    if not isinstance(key, str):
        raise TypeError(
            f"layer_of({name!r}) returned {key!r} ({type(key).__name__}); layer_of maps each "
            "parameter name to its layer key, a str (e.g. dmuon.comm.layer_key gives "
            "'model.layers.3' for 'model.layers.3.mlp.up.weight'); return the name itself "
            "for a layer of its own"
        )
    return key


def mesh_groups(mesh: Any) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """``(group, replicate_group)`` of a mesh argument.

    ``None`` → the world; a ``ProcessGroup`` → itself; a 1-D ``DeviceMesh`` → its
    group; a 2-D ``DeviceMesh`` (HSDP, FSDP2's convention: dim 0 replicates, dim 1
    shards; or dims named ``"replicate"`` and ``"shard"``) → (shard group,
    replicate group).

    Raises:
        ValueError: a mesh of more than two dimensions, or something else.

    Examples:
        >>> from dmuon.integrations import mesh_groups
        >>> mesh_groups(None)  # the default process group, no replicas
        (None, None)

        With 4 ranks as HSDP 2 × 2, FSDP2's convention (dim 0 replicates)::

            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            shard_group, replicate_group = mesh_groups(mesh)
    """
    if mesh is None:
        return None, None
    check_member(mesh, "the group or mesh")
    if isinstance(mesh, dist.ProcessGroup):
        return mesh, None
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise ValueError(
            f"mesh must be a DeviceMesh, a ProcessGroup or None, got {type(mesh).__name__}"
        )
    if mesh.ndim == 1:
        return mesh.get_group(), None
    if mesh.ndim == 2:
        names = mesh.mesh_dim_names or ()
        rep, shard = 0, 1
        if "replicate" in names and "shard" in names:
            rep, shard = names.index("replicate"), names.index("shard")
        return mesh.get_group(shard), mesh.get_group(rep)
    raise ValueError(
        f"mesh has {mesh.ndim} dimensions; pass the 1-D data-parallel mesh, or the 2-D "
        "(replicate, shard) mesh of HSDP"
    )


def tensor_parallel_dim(
    mesh: Any, model: nn.Module, parameters: Iterable[torch.Tensor] | None = None
) -> int | None:
    """The dimension of a 2-D ``mesh`` that ``model``'s DTensor parameters are split over
    (``parallelize_module`` on ``mesh["tp"]``), or ``None``.

    **The rule**: a dimension of ``mesh`` is *used* when the process group of one of its
    slices (this rank's) is the group of some mesh dimension of some DTensor parameter of
    ``model``. When exactly one dimension is used, it is the tensor-parallel dimension and
    the other one is the data-parallel dimension owner mode plans its owners over
    (``dedicate(model, mesh)`` on a ``dp × tp`` mesh). ``None`` when ``mesh`` is not a 2-D
    ``DeviceMesh``, when no parameter is a DTensor on one of its dimensions (a 2-D mesh
    is then HSDP's, replicate × shard), or when both are used (FSDP2 already sharded the
    model over ``dp``: the dedication refuses its DTensors, naming one). Every rank reads
    the same placements and meshes, so every rank decides alike, without a collective.
    ``parameters``: read these instead of all of ``model``'s (the dedicated ones, when
    FSDP2 already sharded the others over ``dp`` with the dedicated ones ignored).

    Examples:
        >>> from torch import nn
        >>> tensor_parallel_dim(None, nn.Linear(2, 2)) is None
        True
    """
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2:
        return None
    groups: set[tuple[int, ...]] = set()
    for p in model.parameters() if parameters is None else parameters:
        if is_dtensor(p):
            pm = p.device_mesh  # type: ignore[attr-defined]
            for d in range(pm.ndim):
                groups.add(tuple(dist.get_process_group_ranks(pm.get_group(d))))
    used = [d for d in range(2) if tuple(dist.get_process_group_ranks(mesh.get_group(d))) in groups]
    return used[0] if len(used) == 1 else None
