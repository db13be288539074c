"""The hooks that connect a model's forward and backward to an owner exchange.

Only public module and tensor hooks are used (no framework internals):

* ``param.register_post_accumulate_grad_hook``: a parameter's gradient is complete
  (accumulated into ``.grad``) → ``exchange.reduction.grad_ready``
  (:meth:`~dmuon.optim.engine.Reduction.grad_ready`),
  which starts the layer's reduction once the layer is complete and every earlier
  layer was started;
* ``module.register_forward_pre_hook`` on each layer's module (below a container a
  forward never calls, each first module that is not one), ahead of the model's own: before
  the layer runs → ``exchange.publication.forward_enter``, which waits for that layer's published
  weights only (the later layers' broadcasts keep travelling meanwhile); a pack of
  small layers (:func:`~dmuon.optim.engine.layer_record.pack_layers`) has the hook on
  each of its layers' modules, and the first to run waits for the whole pack;
* with ``reshard_after_forward`` (ZeRO-3-like) also ``register_forward_hook`` →
  ``exchange.publication.forward_exit`` (free the layer on non-owners) and
  ``register_full_backward_pre_hook`` → ``exchange.publication.backward_enter`` (bring it back
  for backward, prefetch the layer before it);
* ``module.register_forward_pre_hook`` on each layer holding expert stacks stepped in
  place (``dp × ep``): ``exchange.publication.experts_enter``, which waits for that
  layer's stacks' broadcasts from their owners among the replicas only;
* ``module.register_forward_pre_hook`` on each other module holding a dedicated
  parameter (a ``Linear`` inside a block), ZeRO-2-like: ``exchange.publication.wait_published``
  for its layer, so that a submodule called directly after ``opt.step()`` reads current
  weights too, compiled or not; inside its layer's forward it does nothing (the layer's
  pre-hook marks the forward entered, a ``register_forward_hook(always_call=True)`` on the
  layer's module marks it left), which keeps it out of a compiled model's graphs;
* ``module.register_state_dict_pre_hook`` and
  ``module.register_load_state_dict_pre_hook`` on the model and on each module holding
  a dedicated parameter or a stack: the broadcasts in flight land before a
  ``state_dict`` (the model's or a submodule's) reads the weights or a
  ``load_state_dict`` copies weights in.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dmuon.comm import layer_key
from dmuon.comm.owner_plan import natural_key
from dmuon.optim import OwnerExchange

__all__ = [
    "check_one_module",
    "check_untied",
    "held_below",
    "install_hooks",
    "layer_modules",
    "module_of_layer",
    "wait_modules",
]


def module_of_layer(model: nn.Module, key: str) -> nn.Module:
    """The module a layer key names: the longest prefix of ``key`` that is a submodule.

    ``"blocks.3"`` → ``model.blocks[3]``; a key that names no module (a parameter
    held by the root) falls back to ``model`` itself.

    Examples:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
        >>> module_of_layer(model, "1.0") is model[1][0], module_of_layer(model, "w") is model
        (True, True)
    """
    return model.get_submodule(_prefix_of_layer(model, key))


def _prefix_of_layer(model: nn.Module, key: str) -> str:
    """The name of the module :func:`module_of_layer` finds (``""``: the model)."""
    parts = key.split(".")
    while parts:
        prefix = ".".join(parts)
        try:
            model.get_submodule(prefix)
            return prefix
        except AttributeError:
            parts.pop()
    return ""


def _hook_reason(what: str) -> str:
    """The ``reason=`` of a hook's ``torch.compiler.disable``: dynamo's graph-break
    message, and the error of ``torch.compile(fullgraph=True)``, which cannot include it."""
    return (
        f"DMuon's owner-mode hook {what}: it waits on collectives under a deadline, which "
        "dynamo cannot trace, so it runs eagerly between graphs. torch.compile("
        "fullgraph=True) is not supported in owner mode: compile without it (one graph "
        "break per hooked layer, no recompile; see DMuon's guide 'torch.compile')"
    )


def install_hooks(model: nn.Module, exchange: OwnerExchange) -> list[RemovableHandle]:
    """Install the gradient and forward hooks of ``exchange`` on ``model``.

    :func:`dmuon.integrations.fsdp.dedicate` and :func:`dmuon.integrations.ddp.dedicate`
    call it. To put a dedication's hooks back after ``ded.remove()`` (e.g. after swapping
    modules), call ``ded.reinstall()``: it runs this and also restores ``ddp.dedicate``'s
    buffer broadcast and ``fsdp.dedicate``'s partial-use check. Per dedicated or
    all-reduced parameter: a post-accumulate-grad hook that hands the gradient to the
    exchange. Per expert stack
    stepped in place (:attr:`OwnerExchange.experts`): with ``reduce_op="avg"`` a
    gradient hook that divides it by the world (the dispatch summed every rank's loss
    into it), and a post-accumulate-grad hook that starts its reduction to its owner among
    its replicas (``Reduction.expert_grad_ready``). Per layer: a
    forward pre-hook that waits for the layer's published weights, on the module its key
    names or, below a container a forward never calls, on each first module that is not
    one (:func:`layer_modules`), and, with ``reshard_after_forward``, hooks that release
    and re-gather them. The waits are registered first (``prepend=True``): the model's own
    pre-hooks read current weights. ZeRO-2-like, on every other module holding a
    dedicated parameter (a ``Linear`` inside a block): a forward pre-hook that waits for
    its layer's publication, so that the submodule called directly reads current weights
    too, and on the layer's module a forward hook that marks the layer's forward left
    (:func:`_holder_waits`). Per layer holding
    expert stacks (:func:`~dmuon.comm.layer_key` of their names, as for the dense layers;
    below a container that is never called, the first module that is not one): a forward
    pre-hook that waits for their broadcasts from their owners among the replicas (a
    gradient of a stack whose hook never ran is refused at its backward). On ``model`` and
    each module holding a dedicated parameter or a stack: a state-dict pre-hook that waits
    for broadcasts still in flight (ZeRO-3-like: that refuses freed weights), and a
    load-state-dict pre-hook that waits for them before loaded weights are copied in
    (ZeRO-3-like: that refuses a write into a freed weight).

    Returns:
        The hook handles (``handle.remove()`` undoes them).

    Raises:
        ValueError: with ``reshard_after_forward``, a layer waited for at several modules
            (:func:`check_one_module`); no hook is installed then.

    Examples:
        >>> import torch
        >>> from dmuon.integrations import install_hooks
        >>> from dmuon.integrations.fsdp import dedicate
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
        >>> ded = dedicate(model)
        >>> ded.remove()  # take dedicate's hooks off ...
        >>> handles = install_hooks(model, ded.exchange)  # ... and put them back
        >>> len(handles)  # 2 gradient, 2 forward pre-, 3 state-dict pre-, 3 load pre-hooks
        10
    """
    where = wait_modules(model, exchange)
    if exchange.reshard_after_forward:
        check_one_module({k: m for k, m in where.items() if exchange.layer(k).dedicated})
    handles: list[RemovableHandle] = []

    # The gradient hooks hold the reduction weakly: torch keeps them on the C++ side of
    # each parameter, where Python's garbage collector does not see the cycle parameter →
    # hook → exchange → parameter, so a model, optimizer and dedication dropped without
    # remove() were never freed. While the model lives its forward hooks (below, plain
    # Python references) keep the exchange alive.
    reduction = weakref.ref(exchange.reduction)

    def grad_hook(p: torch.Tensor) -> None:
        r = reduction()
        if r is not None:
            r.grad_ready(p)

    def expert_grad_hook(p: torch.Tensor) -> None:
        r = reduction()
        if r is not None:
            r.expert_grad_ready(p)

    for name in [*exchange.names, *exchange.replicated_names]:
        p = exchange.param(name)
        handles.append(p.register_post_accumulate_grad_hook(grad_hook))
    n = exchange.world_size
    divide = exchange.reduction.reduce_op == "avg" and n > 1
    for p in exchange.experts:
        if divide:
            # the dispatch's backward sums every rank's loss into each expert: the gradient
            # of the ranks' mean loss, as the dense ones are averaged
            handles.append(p.register_hook(lambda g: g / n))
        # on dp × ep, its reduction to its owner among the replicas, started in backward
        handles.append(p.register_post_accumulate_grad_hook(expert_grad_hook))

    # ZeRO-2-like: per layer key with a module holding its weights below the layer's
    # hooks (_holder_keys), whether the layer's forward is running with its wait done
    # (its pre-hook sets it, its forward hook clears it): those holders' hooks read it
    # (_holder_waits)
    held = _holders(model, exchange)
    # the publication's own dict: its publish() clears a mark a forward interrupted by a
    # KeyboardInterrupt left set (no forward hook runs then)
    entered = exchange.publication.entered
    entered.update(
        dict.fromkeys(
            (k for keys in _holder_keys(exchange, where, held).values() for k in keys), False
        )
    )

    def call(
        method: Callable[[str], None], key: str, what: str, enters: bool = False
    ) -> Callable[..., None]:
        # Under torch.compile the layer hooks run eagerly, between graphs: they wait on
        # collectives (a deadline, a Work handle), which dynamo cannot trace, and the
        # state they read changes every step, which would recompile. So one graph
        # break per hooked layer, in the first step only, as FSDP2's own hooks
        # (torch._dynamo.config.skip_fsdp_hooks); see the guide "torch.compile". The
        # reason is what a fullgraph=True compile's error shows.
        @torch.compiler.disable(reason=_hook_reason(f"{what} layer {key!r}"))
        def hook(*_: Any) -> None:
            method(key)
            if enters and key in entered:
                entered[key] = True

        return hook

    def leave(key: str) -> Callable[..., None]:
        # disabled too, though a plain store: the layer's module runs eagerly (its
        # pre-hook breaks the graph), and dynamo would compile a frame for this hook
        @torch.compiler.disable(
            reason=f"DMuon's owner-mode hook marks the end of layer {key!r}'s forward "
            "(a store, no collective)"
        )
        def hook(*_: Any) -> None:
            entered[key] = False

        return hook

    for key in exchange.layer_keys():
        # a pack of small layers (never under ZeRO-3-like) waits before whichever of its
        # layers runs first; the wait is for the whole pack, the other hooks find it done.
        # The waits go first (prepend): a pre-hook of the model's own reads current weights
        for module in (model.get_submodule(prefix) for prefix in where[key]):
            handles.append(
                module.register_forward_pre_hook(
                    call(
                        exchange.publication.forward_enter,
                        key,
                        "waits for the owners' broadcast of the weights of",
                        enters=True,
                    ),
                    prepend=True,
                )
            )
            if key in entered:
                # always_call: a forward that raises leaves the layer too
                handles.append(module.register_forward_hook(leave(key), always_call=True))
            if exchange.reshard_after_forward:
                handles.append(
                    module.register_forward_hook(
                        call(
                            exchange.publication.forward_exit,
                            key,
                            "frees (ZeRO-3-like) the weights this rank does not own of",
                        )
                    )
                )
                handles.append(
                    module.register_full_backward_pre_hook(
                        call(
                            exchange.publication.backward_enter,
                            key,
                            "re-gathers (ZeRO-3-like) from their owners the weights of",
                        ),
                        prepend=True,
                    )
                )
    handles += _expert_waits(model, exchange)
    handles += _holder_waits(model, exchange, where, held, entered)
    handles += _state_dict_waits(model, exchange, held)
    handles += _load_waits(model, exchange, held)
    return handles


# stock modules that read a child's weights without calling the child: the wait goes on
# the parent (nn.MultiheadAttention passes out_proj.weight to its functional attention)
_READ_BY_PARENT: dict[type[nn.Module], tuple[str, ...]] = {nn.MultiheadAttention: ("out_proj",)}


def _called_above(model: nn.Module, prefix: str) -> str:
    """``prefix``, or the parent that reads its weights without calling it
    (:data:`_READ_BY_PARENT`, subclasses included)."""
    while prefix:
        parent, _, child = prefix.rpartition(".")
        holder = model.get_submodule(parent)
        if not any(
            isinstance(holder, kind) and child in children
            for kind, children in _READ_BY_PARENT.items()
        ):
            break
        prefix = parent
    return prefix


def _meeting(holders: Iterable[str]) -> str:
    """The deepest module at or above every one of ``holders``."""
    common: list[str] | None = None
    for holder in holders:
        parts = holder.split(".") if holder else []
        n = 0
        if common is None:
            common = parts
            continue
        while n < min(len(common), len(parts)) and common[n] == parts[n]:
            n += 1
        common = common[:n]
    return ".".join(common or [])


def _never_called(module: nn.Module) -> bool:
    """A module without a forward of its own: a ``ModuleList``, ``ModuleDict``,
    ``ParameterList`` or ``ParameterDict``, or a plain ``nn.Module`` used as a namespace.
    A forward iterates or indexes it, and never calls it (its hooks never run)."""
    return type(module).forward is nn.Module.forward


def _under(name: str, prefix: str) -> bool:
    """Whether module ``name`` is ``prefix`` or below it (``""``: the model)."""
    return not prefix or name == prefix or name.startswith(prefix + ".")


def _first_called(model: nn.Module, start: str, holder: str) -> str:
    """From module ``start`` down to ``holder`` (at or below it), the first module that a
    forward calls (:func:`_never_called`); when none is (a ``ParameterList`` holding the
    parameter), the first module above ``start`` that is."""
    parts = holder.split(".") if holder else []
    for depth in range(len(start.split(".")) if start else 0, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        if not _never_called(model.get_submodule(prefix)):
            return prefix
    prefix = start
    while prefix and _never_called(model.get_submodule(prefix)):
        prefix = prefix.rpartition(".")[0]
    return prefix


def layer_modules(model: nn.Module, keys: Iterable[str], names: Iterable[str]) -> list[str]:
    """The modules whose forward pre-hooks wait for a layer (of a pack: each of its layer
    ``keys``), whose parameters are ``names``: each key's module (:func:`module_of_layer`;
    for a custom ``layer_of`` key that names no module, the deepest module holding all of
    ``names`` under its longest prefix that is one; the ``out_proj`` of an
    ``nn.MultiheadAttention``, which reads its weight without calling it: the attention
    module) or, when a forward never calls that module (a ``ModuleList`` of blocks that a
    nested list or a custom ``layer_of`` names, or a plain ``nn.Module`` without a
    forward), the first module below it that a forward calls, on the way to each of its
    parameters.

    Examples:
        >>> from torch import nn
        >>> stages = nn.ModuleList([nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])])
        >>> layer_modules(nn.Sequential(stages), ["0.0"], ["0.0.0.weight", "0.0.1.weight"])
        ['0.0.0', '0.0.1']
    """
    names = list(names)
    found: dict[str, None] = {}
    for key in keys:
        start = _prefix_of_layer(model, key)
        holders = {h for n in names if _under(h := n.rpartition(".")[0], start)}
        if start != key and holders:  # a key that names no module: where its weights meet
            start = _meeting(holders)
        start = _called_above(model, start)
        if not _never_called(model.get_submodule(start)):
            found[start] = None
            continue
        for holder in sorted(holders, key=natural_key) or [start]:
            found[_first_called(model, start, holder)] = None
    return list(found)


def wait_modules(model: nn.Module, exchange: OwnerExchange) -> dict[str, list[str]]:
    """Per layer key of ``exchange``, the modules of ``model`` whose forward pre-hooks wait
    for it (:func:`layer_modules`, on the way to its dedicated weights; ``""``: the model).

    Examples:
        >>> import torch
        >>> from dmuon.integrations import ddp
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        >>> model.scale = torch.nn.Parameter(torch.ones(4, 4))  # held by the model itself
        >>> wait_modules(model, ddp.dedicate(model, layer_pack_mb=0).exchange)
        {'0': ['0'], '1': ['1'], 'scale': ['']}
    """
    return {
        key: layer_modules(model, layer.members, layer.dedicated or exchange.layer_names(key))
        for key in exchange.layer_keys()
        for layer in [exchange.layer(key)]
    }


def check_one_module(layers: Mapping[str, Sequence[str]]) -> None:
    """ZeRO-3-like owner mode gathers a layer before its module's forward, frees it after,
    and gathers it again before the module's backward, freeing the layers backward is done
    with: refuse a layer waited for at several modules (:func:`layer_modules`: a container
    of blocks), whose first module's exit would free what the others read, and a module
    waiting for several layers, whose backward would free one for the next.

    Args:
        layers: per layer key, the modules that wait for it (:func:`layer_modules`).

    Raises:
        ValueError: a layer with more than one module, or a module with more than one
            layer, naming them.

    Examples:
        >>> check_one_module({"blocks.0": ["blocks.0"], "blocks.1": ["blocks.1"]})  # taken
        >>> try:
        ...     check_one_module({"stages.0": ["stages.0.0", "stages.0.1"]})
        ... except ValueError as err:
        ...     print(str(err)[:50])
        layer 'stages.0' names a module that a forward nev
    """
    for key, prefixes in layers.items():
        if len(prefixes) > 1:
            raise ValueError(
                f"layer {key!r} names a module that a forward never calls (a container); "
                f"its weights would be gathered before each of the modules {list(prefixes)} "
                "and freed after each, and reshard_after_forward=True (ZeRO-3-like) needs "
                "one module per layer that the forward calls. Pass layer_of= mapping each "
                f"parameter to such a module (e.g. {prefixes[0]!r} for its parameters), or "
                "reshard_after_forward=False"
            )
    by_module: dict[str, list[str]] = {}
    for key, prefixes in layers.items():
        for prefix in prefixes:
            by_module.setdefault(prefix, []).append(key)
    for prefix, keys in by_module.items():
        if len(keys) > 1:
            where = f"module {prefix!r}" if prefix else "the model"
            raise ValueError(
                f"{where} is where layers {keys} are waited for (an attention module's "
                "out_proj is read by the attention; a custom layer_of key that names no "
                "module waits where its weights meet); reshard_after_forward=True "
                "(ZeRO-3-like) gathers a layer before that module's backward and frees the "
                "one before, so it needs one layer per module. Pass layer_of= mapping "
                f"their parameters to one layer (e.g. {keys[0]!r}), or "
                "reshard_after_forward=False"
            )


def check_untied(
    model: nn.Module, dedicated: Iterable[torch.Tensor], layer_of: Callable[[str], str]
) -> None:
    """ZeRO-3-like owner mode frees a layer's weights after its module's forward: refuse a
    dedicated weight that modules of two layers hold (a weight tied across layers: an
    embedding and the output head, one hidden matrix shared by two blocks), which the
    second module would read freed.

    A module object listed twice (one block reused, ALBERT-style) and a weight tied within
    one layer are taken: the hooks gather the weight around each call of the layer.

    Args:
        model: the model.
        dedicated: the dedicated parameters.
        layer_of: name → layer key (``dedicate``'s ``layer_of``).

    Raises:
        ValueError: naming the weight, its holders and their layers.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.ModuleDict({"embed": nn.Embedding(8, 4), "head": nn.Linear(4, 8)})
        >>> model.head.weight = model.embed.weight
        >>> check_untied(model, [], lambda n: n.split(".")[0])  # nothing dedicated: taken
        >>> try:
        ...     check_untied(model, [model.head.weight], lambda n: n.split(".")[0])
        ... except ValueError as err:
        ...     print(str(err)[:62])
        weight 'embed.weight' is also 'head.weight': modules of layers
    """
    ids = {id(p) for p in dedicated}
    holders: dict[int, dict[int, tuple[str, str]]] = {}  # weight → holder → (name, layer)
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in ids:
            holder = model.get_submodule(name.rpartition(".")[0])
            holders.setdefault(id(p), {}).setdefault(id(holder), (name, layer_of(name)))
    for by_holder in holders.values():
        named = list(by_holder.values())
        layers = list(dict.fromkeys(layer for _, layer in named))
        if len(layers) > 1:
            aliases = " and ".join(repr(n) for n, _ in named[1:])
            raise ValueError(
                f"weight {named[0][0]!r} is also {aliases}: modules of layers {layers} hold "
                "it, and reshard_after_forward=True (ZeRO-3-like) frees a layer's weights "
                "after its module's forward, so the later one would read it freed. Leave it "
                "out of the dedication (predicate=; scalars='all_reduce' for an embedding "
                "tied with the output head), untie it, or pass reshard_after_forward=False"
            )


def _waiting_module(model: nn.Module, name: str) -> str:
    """Where parameter ``name``'s wait goes, by the dense layers' rule
    (:func:`layer_modules` of its :func:`~dmuon.comm.layer_key`): its layer (the
    transformer block), or when that is a container a forward never calls (a
    ``ModuleList`` of blocks), the first module below it on the way to the parameter's
    holder that a forward calls.
    ``"blocks.0.moe.w1"`` → ``"blocks.0"``; ``"stages.0.0.moe.w1"`` (``stages.0`` a
    ``ModuleList``) → ``"stages.0.0"``; a parameter of the root → ``""``; one of a
    container that holds parameters itself (``moe.experts.0`` of a ``ParameterList``) →
    the module above it (``moe``)."""
    return layer_modules(model, [layer_key(name)], [name])[0]


def _expert_waits(model: nn.Module, exchange: OwnerExchange) -> list[RemovableHandle]:
    """A forward pre-hook on the layer of each expert stack of ``exchange``
    (:func:`_waiting_module`; one per layer, so ``torch.compile`` breaks its graph there
    alone, as for the dense layers): it waits for that layer's stacks' broadcasts back
    from their owners, the later layers' travel on. So the whole layer's forward reads
    current stacks."""
    if not exchange.experts:
        return []
    experts = {id(p) for p in exchange.experts}
    by_module: dict[str, set[int]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in experts:
            by_module.setdefault(_waiting_module(model, name), set()).add(id(p))
    held = {i for ids in by_module.values() for i in ids}
    if experts - held:  # held outside this model: the root's pre-hook waits for them
        by_module.setdefault("", set()).update(experts - held)
    handles = []
    for prefix, ids in by_module.items():
        where = f"module {prefix!r}" if prefix else "the model"

        @torch.compiler.disable(  # as the layers' hooks (install_hooks)
            reason=_hook_reason(f"waits for the owners' broadcast of the expert stacks of {where}")
        )
        def hook(*_: Any, ids: frozenset[int] = frozenset(ids), where: str = where) -> None:
            exchange.publication.experts_enter(ids, where)

        handles.append(model.get_submodule(prefix).register_forward_pre_hook(hook, prepend=True))
    return handles


def _holders(model: nn.Module, exchange: OwnerExchange) -> dict[str, list[tuple[str, str | None]]]:
    """The model (``""``) and every module holding a dedicated parameter or an expert stack
    of ``exchange``: per module, its own name for each such parameter and the exchange's
    (``None`` for a stack)."""
    ours = {id(exchange.param(n)): n for n in exchange.names}
    experts = {id(p) for p in exchange.experts}
    held: dict[str, list[tuple[str, str | None]]] = {"": []}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in ours or id(p) in experts:
            prefix, _, local = name.rpartition(".")
            held.setdefault(prefix, []).append((local, ours.get(id(p))))
    return held


def _holder_keys(
    exchange: OwnerExchange,
    where: Mapping[str, Sequence[str]],
    held: Mapping[str, list[tuple[str, str | None]]],
) -> dict[str, tuple[str, ...]]:
    """ZeRO-2-like: per module holding a dedicated parameter (``held``: :func:`_holders`),
    the layers it holds weights of whose hooks do not sit on it (``where``:
    :func:`wait_modules`): the holders :func:`_holder_waits` hooks. ZeRO-3-like: none."""
    if exchange.reshard_after_forward:
        return {}
    key_of: dict[str, str] = {}
    for key in exchange.layer_keys():
        for name in exchange.layer(key).dedicated or exchange.layer_names(key):
            key_of[name] = key
    out = {}
    for prefix, mine in held.items():
        keys = dict.fromkeys(key_of[n] for _, n in mine if n is not None and n in key_of)
        if found := tuple(k for k in keys if prefix not in where.get(k, ())):
            out[prefix] = found
    return out


def _holder_waits(
    model: nn.Module,
    exchange: OwnerExchange,
    where: Mapping[str, Sequence[str]],
    held: Mapping[str, list[tuple[str, str | None]]],
    entered: Mapping[str, bool],
) -> list[RemovableHandle]:
    """ZeRO-2-like: a forward pre-hook on every module holding a dedicated parameter
    (``held``: :func:`_holders`) that its layer's hook does not already sit on (``where``:
    :func:`wait_modules`), which waits for that layer's publication.

    The layer's hook runs only when the layer's module is called: a submodule called
    directly right after ``opt.step()`` (``model.blocks[1].fc(h)`` for a probe or partial
    inference) would read the weights of the step before on a rank that does not own
    them. It leaves the layers' forward-order bookkeeping alone (it is not
    ``forward_enter``). ZeRO-3-like (``reshard_after_forward``) installs none: waiting
    would re-gather the layer (a collective the other ranks do not join) outside its
    forward.

    Inside the layer's forward the wait is done: ``entered[key]`` (a plain dict the
    layer's pre-hook sets, after its wait, and its forward hook clears, ``always_call``)
    says so, and the holder's hook does nothing. That is also what makes it free under
    ``torch.compile``: dynamo reads ``entered[key]`` while tracing and guards on it. Under
    a compiled model (or layer) the holder is traced right after the layer's eager
    pre-hook set it, so the hook traces to nothing — no graph break per holder, and the
    guard holds every step (no recompile). A holder compiled on its own
    (``torch.compile(model.blocks[1].fc)``) is traced with it clear, so its hook calls the
    wait, ``torch.compiler.disable``-d: one graph break there, and the compiled probe reads
    current weights as the eager one does. (An earlier version returned whenever
    ``torch.compiler.is_compiling()``, assuming a whole compiled model: such a probe read
    the previous step's weights on a non-owner rank.) The flag is never set outside the
    layer's forward, where the weights cannot be republished, so it errs only towards a
    wait that finds the layer landed; a mark a forward interrupted by a ``KeyboardInterrupt``
    left set (no forward hook runs for a ``BaseException`` that is not an ``Exception``) is
    cleared when the layer is next published
    (:meth:`~dmuon.optim.engine.publication.Publication.publish`)."""
    handles = []
    for prefix, keys in _holder_keys(exchange, where, held).items():
        where_ = f"module {prefix!r}" if prefix else "the model"

        @torch.compiler.disable(
            reason=_hook_reason(
                f"waits for the owners' broadcast of the weights {where_} holds (it was "
                "called outside its layer's forward)"
            )
        )
        def wait(keys: tuple[str, ...]) -> None:
            for key in keys:
                exchange.publication.wait_published(key)

        def holder_wait(
            *_: Any, keys: tuple[str, ...] = keys, wait: Callable[..., None] = wait
        ) -> None:
            outside = tuple(key for key in keys if not entered.get(key, False))
            if outside:
                wait(outside)

        submodule = model.get_submodule(prefix)
        handles.append(submodule.register_forward_pre_hook(holder_wait, prepend=True))
    return handles


def held_below(
    held: Mapping[str, list[tuple[str, str | None]]],
) -> dict[str, list[tuple[str, str | None]]]:
    """Every module holding a weight of ``held`` (its name → its weights' local names and
    their dedicated names), and every module above one, the model's ``""`` included →
    every held weight of that module and the modules under it, named from it, in
    ``held``'s order.

    One walk up from each holder (modules × depth): a scan of every holder per module was
    modules², 2.8 s of ``dedicate()`` at 2574 modules.

    Examples:
        >>> held_below({"a.b": [("weight", "a.b.weight")], "c": [("bias", None)]})["a"]
        [('b.weight', 'a.b.weight')]
        >>> sorted(held_below({"a.b": [("weight", "a.b.weight")], "c": [("bias", None)]}))
        ['', 'a', 'a.b', 'c']
    """
    out: dict[str, list[tuple[str, str | None]]] = {"": []}
    for module, mine in held.items():
        parts = module.split(".") if module else []
        for k in range(len(parts) + 1):
            rel = ".".join(parts[k:])
            out.setdefault(".".join(parts[:k]), []).extend(
                (f"{rel}.{local}" if rel else local, n) for local, n in mine
            )
    return out


def _load_waits(
    model: nn.Module, exchange: OwnerExchange, held: Mapping[str, list[tuple[str, str | None]]]
) -> list[RemovableHandle]:
    """A load-state-dict pre-hook on the model, on every module holding a dedicated
    parameter or an expert stack of ``exchange`` (``held``: :func:`_holders`) and on every
    module above one: whichever ``load_state_dict`` copies one in (the model's or a
    submodule's) lets the broadcasts still in flight land first, not over the loaded
    weights. ZeRO-3-like: the expert stacks' land; a load that would write into a
    dedicated weight this rank does not own, freed between forwards, is refused, naming
    it, by the first hook torch runs — the one of the module whose ``load_state_dict``
    was called, which looks at every weight below it — so before anything is copied (a
    load of other entries, or of resident weights, goes on)."""

    below = held_below(held)

    def hook_for(mine: list[tuple[str, str | None]]) -> Callable[..., None]:
        def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
            publication = exchange.publication
            publication.wait_in_flight()
            if not exchange.reshard_after_forward:
                return
            freed = [
                n
                for local, n in mine
                if n is not None and publication.released(n) and prefix + local in state_dict
            ]
            if freed:
                raise RuntimeError(
                    f"rank {exchange.rank}: dedicated weight {freed[0]!r} is freed on this "
                    "rank (ZeRO-3-like owner mode keeps only the owned ones between "
                    "forwards), and load_state_dict cannot write into it; call ded.wait() "
                    "on every rank first, or load with dmuon.integrations.checkpoint"
                )

        return hook

    return [
        model.get_submodule(prefix).register_load_state_dict_pre_hook(hook_for(below[prefix]))
        for prefix in sorted(below)
    ]


def _state_dict_waits(
    model: nn.Module, exchange: OwnerExchange, held: Mapping[str, list[tuple[str, str | None]]]
) -> list[RemovableHandle]:
    """A state-dict pre-hook on the model and on every module holding a dedicated parameter
    or an expert stack (``held``: :func:`_holders`): the state dict of the model or of any
    submodule holds the owners' latest weights.

    ZeRO-2-like (default): the last step's broadcasts may still be in flight, and a
    weight this rank does not own would be saved one step old: wait for them (this
    issues no collective the other ranks do not issue in their next forward anyway).
    ZeRO-3-like: freed weights would be saved as NaN: refuse (the model's hook: any freed
    weight; a module's: one it holds).
    """

    def hook_for(mine: list[tuple[str, str | None]] | None) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            publication = exchange.publication
            publication.wait_in_flight()
            if not exchange.reshard_after_forward:
                return
            if mine is None:  # the model: every weight
                released = publication.released_names()
            else:  # a module: the weights it holds
                released = [n for _, n in mine if n is not None and publication.released(n)]
            if released:
                raise RuntimeError(
                    f"rank {exchange.rank}: {len(released)} dedicated weight(s) are freed on "
                    "this rank (ZeRO-3-like owner mode keeps only the owned ones between "
                    f"forwards), e.g. {released[0]!r}; call ded.wait() on every rank before "
                    "state_dict(), or save with dmuon.integrations.checkpoint"
                )

        return hook

    return [
        model.get_submodule(prefix).register_state_dict_pre_hook(
            hook_for(None if not prefix else mine)
        )
        for prefix, mine in held.items()
    ]
