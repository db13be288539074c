"""The hooks that connect a model's forward and backward to an owner exchange.

Only public module and tensor hooks are used (no framework internals):

* ``param.register_post_accumulate_grad_hook``: a parameter's gradient is complete
  (accumulated into ``.grad``) → ``exchange.reduction.grad_ready``
  (:meth:`~dmuon.optim.engine.Reduction.grad_ready`),
  which starts the layer's reduction once the layer is complete and every earlier
  layer was started;
* ``module.register_forward_pre_hook`` on each layer's module: before the layer
  runs → ``exchange.publication.forward_enter``, which waits for that layer's published
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
* ``module.register_load_state_dict_pre_hook`` on the model and on each module holding
  a dedicated parameter or a stack: the broadcasts in flight land before a
  ``load_state_dict`` copies weights in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dmuon.comm import layer_key
from dmuon.optim import OwnerExchange

__all__ = ["install_hooks", "module_of_layer"]


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
    parts = key.split(".")
    while parts:
        try:
            return model.get_submodule(".".join(parts))
        except AttributeError:
            parts.pop()
    return model


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
    forward pre-hook that waits for the layer's published weights (and, with
    ``reshard_after_forward``, hooks that release and re-gather them). Per layer holding
    expert stacks (:func:`~dmuon.comm.layer_key` of their names, as for the dense layers;
    below a container that is never called, the first module that is not one): a forward
    pre-hook that waits for their broadcasts from their owners among the replicas (a
    gradient of a stack whose hook never ran is refused at its backward). On ``model``: a
    state-dict pre-hook that waits for broadcasts still in flight (ZeRO-3-like: that
    refuses freed weights). On ``model`` and each module holding a dedicated parameter or
    a stack: a load-state-dict pre-hook that waits for them before loaded weights are
    copied in (ZeRO-3-like: that refuses a write into a freed weight).

    Returns:
        The hook handles (``handle.remove()`` undoes them).

    Examples:
        >>> import torch
        >>> from dmuon.integrations import install_hooks
        >>> from dmuon.integrations.fsdp import dedicate
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
        >>> ded = dedicate(model)
        >>> ded.remove()  # take dedicate's hooks off ...
        >>> handles = install_hooks(model, ded.exchange)  # ... and put them back
        >>> len(handles)  # 2 gradient, 2 forward pre-, 1 state-dict pre-, 3 load pre-hooks
        8
    """
    handles: list[RemovableHandle] = []

    def grad_hook(p: torch.Tensor) -> None:
        exchange.reduction.grad_ready(p)

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
        handles.append(p.register_post_accumulate_grad_hook(exchange.reduction.expert_grad_ready))

    def call(method: Callable[[str], None], key: str) -> Callable[..., None]:
        # Under torch.compile the layer hooks run eagerly, between graphs: they wait on
        # collectives (a deadline, a Work handle), which dynamo cannot trace, and the
        # state they read changes every step, which would recompile. So one graph
        # break per hooked layer, in the first step only, as FSDP2's own hooks
        # (torch._dynamo.config.skip_fsdp_hooks); see the guide "torch.compile".
        @torch.compiler.disable
        def hook(*_: Any) -> None:
            method(key)

        return hook

    for key in exchange.layer_keys():
        # a pack of small layers (never under ZeRO-3-like) waits before whichever of its
        # layers runs first; the wait is for the whole pack, the other hooks find it done
        members = (module_of_layer(model, k) for k in exchange.layer(key).members)
        for module in {id(m): m for m in members}.values():
            handles.append(
                module.register_forward_pre_hook(call(exchange.publication.forward_enter, key))
            )
            if exchange.reshard_after_forward:
                handles.append(
                    module.register_forward_hook(call(exchange.publication.forward_exit, key))
                )
                handles.append(
                    module.register_full_backward_pre_hook(
                        call(exchange.publication.backward_enter, key)
                    )
                )
    handles += _expert_waits(model, exchange)
    handles.append(model.register_state_dict_pre_hook(_current_weights(exchange)))
    handles += _load_waits(model, exchange)
    return handles


# containers a forward iterates or indexes and never calls (they have no forward)
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def _waiting_module(model: nn.Module, name: str) -> str:
    """Where parameter ``name``'s wait goes: its layer (the module
    :func:`~dmuon.comm.layer_key` names, the transformer block, as for the dense layers),
    or when that is a container a forward never calls (a ``ModuleList`` of blocks), the
    first module below it on the way to the parameter's holder that is not one.
    ``"blocks.0.moe.w1"`` → ``"blocks.0"``; ``"stages.0.0.moe.w1"`` (``stages.0`` a
    ``ModuleList``) → ``"stages.0.0"``; a parameter of the root → ``""``; one of a
    container that holds parameters itself (``moe.experts.0`` of a ``ParameterList``) →
    the module above it (``moe``)."""
    holder = name.rpartition(".")[0]
    layer = layer_key(name)
    start = layer if holder.startswith(layer) else holder  # else no layer above the holder
    parts = holder.split(".") if holder else []
    for depth in range(len(start.split(".")) if start else 0, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        if not isinstance(model.get_submodule(prefix), _CONTAINERS):
            return prefix
    # containers all the way down (a ParameterList holding the stacks): the module above
    prefix = start
    while prefix and isinstance(model.get_submodule(prefix), _CONTAINERS):
        prefix = prefix.rpartition(".")[0]
    return prefix


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

        @torch.compiler.disable  # as the layers' hooks (install_hooks)
        def hook(*_: Any, ids: frozenset[int] = frozenset(ids), where: str = where) -> None:
            exchange.publication.experts_enter(ids, where)

        handles.append(model.get_submodule(prefix).register_forward_pre_hook(hook))
    return handles


def _load_waits(model: nn.Module, exchange: OwnerExchange) -> list[RemovableHandle]:
    """A load-state-dict pre-hook on the model and on every module holding a dedicated
    parameter or an expert stack of ``exchange``: whichever ``load_state_dict`` copies one
    in (the model's or a submodule's) lets the broadcasts still in flight land first, not
    over the loaded weights. ZeRO-3-like: the expert stacks' land; a load that would write
    into a dedicated weight this rank does not own, freed between forwards, is refused,
    naming it (a load of other entries, or of resident weights, goes on)."""
    ours = {id(exchange.param(n)): n for n in exchange.names}
    experts = {id(p) for p in exchange.experts}
    # per holding module: (its name for the parameter, the exchange's name or None)
    held: dict[str, list[tuple[str, str | None]]] = {"": []}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in ours or id(p) in experts:
            prefix, _, local = name.rpartition(".")
            held.setdefault(prefix, []).append((local, ours.get(id(p))))

    def hook_for(mine: list[tuple[str, str | None]]) -> Callable[..., None]:
        def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
            publication = exchange.publication
            publication.wait_in_flight()
            if not exchange.reshard_after_forward:
                return
            released = set(publication.released_names())
            freed = [n for local, n in mine if n in released and prefix + local in state_dict]
            if freed:
                raise RuntimeError(
                    f"rank {exchange.rank}: dedicated weight {freed[0]!r} is freed on this "
                    "rank (ZeRO-3-like owner mode keeps only the owned ones between "
                    "forwards), and load_state_dict cannot write into it; call ded.wait() "
                    "on every rank first, or load with dmuon.integrations.checkpoint"
                )

        return hook

    return [
        model.get_submodule(prefix).register_load_state_dict_pre_hook(hook_for(mine))
        for prefix, mine in held.items()
    ]


def _current_weights(exchange: OwnerExchange) -> Callable[..., None]:
    """A state-dict pre-hook: the state dict holds the owners' latest weights.

    ZeRO-2-like (default): the last step's broadcasts may still be in flight, and a
    weight this rank does not own would be saved one step old: wait for them (this
    issues no collective the other ranks do not issue in their next forward anyway).
    ZeRO-3-like: freed weights would be saved as NaN: refuse.
    """

    def hook(*_: Any) -> None:
        publication = exchange.publication
        publication.wait_in_flight()
        if not exchange.reshard_after_forward:
            return
        released = publication.released_names()
        if released:
            raise RuntimeError(
                f"rank {exchange.rank}: {len(released)} dedicated weight(s) are freed on this "
                f"rank (ZeRO-3-like owner mode keeps only the owned ones between forwards), "
                f"e.g. {released[0]!r}; call ded.wait() on every rank before state_dict(), "
                "or save with dmuon.integrations.checkpoint"
            )

    return hook
