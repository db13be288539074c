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
  place (``dp × ep``) and on the modules below it down to each stack's holder:
  ``exchange.publication.experts_enter``, which waits for those stacks' broadcasts from
  their owners among the replicas only;
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
    ``reshard_after_forward``, hooks that release and re-gather them). Per expert stack, on
    its layer (:func:`~dmuon.comm.layer_key` of its name, as for the dense layers) and each
    module below it down to its holder: a forward pre-hook that waits for its broadcast
    from its owner among the replicas, in the first of them a forward calls (a gradient of
    a stack whose hooks never ran is refused at its backward). On ``model``: a state-dict
    pre-hook that waits for broadcasts still in flight (ZeRO-3-like: that refuses freed
    weights). On ``model`` and each module holding a dedicated parameter or a stack: a
    load-state-dict pre-hook that waits for them before loaded weights are copied in
    (ZeRO-3-like: that refuses freed weights).

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


def _chain(name: str) -> list[str]:
    """The modules from parameter ``name``'s layer (the module :func:`~dmuon.comm.layer_key`
    names, the transformer block) down to the module holding it, outermost first: the
    first of them a forward calls waits. ``"blocks.0.moe.experts.w1"`` →
    ``["blocks.0", "blocks.0.moe", "blocks.0.moe.experts"]``; a parameter of the root →
    ``[""]``."""
    holder = name.rpartition(".")[0]
    layer = layer_key(name)
    if not holder.startswith(layer):  # no layer above its holder: the holder alone
        return [holder]
    parts = holder.split(".")
    depth = len(layer.split(".")) if layer else 0
    return [".".join(parts[:i]) for i in range(depth, len(parts) + 1)]


def _expert_waits(model: nn.Module, exchange: OwnerExchange) -> list[RemovableHandle]:
    """A forward pre-hook on the layer of each expert stack of ``exchange`` and on every
    module below it down to the one holding the stack (:func:`_chain`): the first of them
    a forward calls waits for those stacks' broadcasts back from their owners (the later
    layers' travel on); the others find them waited. So the whole layer's forward reads
    current stacks, and a layer whose container is only iterated, never called (a
    ``ModuleList`` of blocks), waits in the block it calls."""
    if not exchange.experts:
        return []
    experts = {id(p) for p in exchange.experts}
    by_module: dict[str, set[int]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in experts:
            for prefix in _chain(name):
                by_module.setdefault(prefix, set()).add(id(p))
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
    over the loaded weights. ZeRO-3-like: the expert stacks' land; the dedicated weights
    this rank does not own are freed, and a load into them is refused, naming one."""
    ours = {id(exchange.param(n)) for n in exchange.names} | {id(p) for p in exchange.experts}
    holders = {"": model}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in ours:
            prefix = name.rpartition(".")[0]
            holders.setdefault(prefix, model.get_submodule(prefix))

    def hook(*_: Any) -> None:
        publication = exchange.publication
        publication.wait_experts()
        if not exchange.reshard_after_forward:
            if publication.pending_publications():
                publication.wait_all_published()
            return
        released = publication.released_names()
        if released:
            raise RuntimeError(
                f"rank {exchange.rank}: {len(released)} dedicated weight(s) are freed on this "
                f"rank (ZeRO-3-like owner mode keeps only the owned ones between forwards), "
                f"e.g. {released[0]!r}, and load_state_dict cannot write into them; call "
                "ded.wait() on every rank first, or load with dmuon.integrations.checkpoint"
            )

    return [m.register_load_state_dict_pre_hook(hook) for m in holders.values()]


def _current_weights(exchange: OwnerExchange) -> Callable[..., None]:
    """A state-dict pre-hook: the state dict holds the owners' latest weights.

    ZeRO-2-like (default): the last step's broadcasts may still be in flight, and a
    weight this rank does not own would be saved one step old: wait for them (this
    issues no collective the other ranks do not issue in their next forward anyway).
    ZeRO-3-like: freed weights would be saved as NaN: refuse.
    """

    def hook(*_: Any) -> None:
        publication = exchange.publication
        publication.wait_experts()  # ZeRO-3-like too: the experts are never freed
        if not exchange.reshard_after_forward:
            if publication.pending_publications():
                publication.wait_all_published()
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
