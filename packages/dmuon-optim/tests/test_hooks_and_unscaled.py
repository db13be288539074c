"""State-dict hooks see what ``torch.optim`` hooks see; ``unscaled`` ends with its step.

The reference for the hooks is ``torch.optim.AdamW``: a load-state-dict post-hook runs
after the state is loaded, and what it changes stays; a state-dict post-hook sees the
dict ``state_dict()`` returns. DMuon restores its own buffers after torch's load
(undoing torch's cast of fp32 state to a bf16 parameter's dtype) and adds
``"distributed"`` to the state dict: both must happen before the caller's post-hooks.

``DMuon.unscaled`` (documented: ``False`` again once the step the gradients were
unscaled for has run, taken or skipped) must also end with a step a ``GradScaler``
skips in ``single`` mode, where the scaler does not call ``step()`` at all: otherwise
the next iteration's recipe (``if not opt.unscaled: opt.unscale_(scaler)``) clips
still-scaled gradients. The reference is the norm of the same gradients computed
without loss scaling.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

from dmuon.optim import DMuon, clip_grad_norm_, param_groups

HOOK_DICTS = (
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(dtype)


def _trained(kind: str, dtype: torch.dtype = torch.float32):
    """A model and an optimizer (``"dmuon"`` or ``"adamw"``) after two steps."""
    m = _model(dtype)
    opt = _make(kind, m)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        m(torch.randn(3, 4, generator=g, dtype=dtype)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def _make(kind: str, m: nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(m.parameters(), lr=0.01)
    return DMuon(param_groups(m), lr=0.01, state_dtype="float32", ns_compute_dtype="float32")


def _buffers(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every non-empty state tensor but ``step``, in parameter order."""
    return [
        v
        for g in opt.param_groups
        for p in g["params"]
        for k, v in opt.state[p].items()
        if k != "step" and torch.is_tensor(v) and v.numel()
    ]


# ------------------------------------------------------------ load_state_dict


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["adamw", "dmuon"])
@pytest.mark.parametrize("prepend", [False, True])
def test_a_load_post_hooks_changes_stay(kind, dtype, prepend):
    """A post-hook that zeroes every moment ("fresh moments" after a resume): AdamW keeps
    the zeros; so must DMuon, whose restoring of fp32 state for bf16 parameters used to
    run after the hooks and copy the saved moments back over them."""
    m, opt = _trained(kind, dtype)
    saved = copy.deepcopy(opt.state_dict())
    assert any(float(b.abs().sum()) > 0 for b in _buffers(opt))
    fresh = _make(kind, m)
    fresh.register_load_state_dict_post_hook(
        lambda o: [b.zero_() for b in _buffers(o)], prepend=prepend
    )
    fresh.load_state_dict(saved)
    sums = [float(b.abs().sum()) for b in _buffers(fresh)]
    assert sums and all(s == 0 for s in sums), (kind, dtype, sums)


def test_a_load_post_hook_sees_the_state_as_loaded():
    """bf16 parameters, fp32 state: the hook sees the fp32 state with the saved values
    (the state after the load), not torch's bf16 casts of it."""
    m, opt = _trained("dmuon", torch.bfloat16)
    saved = copy.deepcopy(opt.state_dict())
    fresh = _make("dmuon", m)
    seen: list[list[torch.Tensor]] = []
    fresh.register_load_state_dict_post_hook(
        lambda o: seen.append([b.clone() for b in _buffers(o)])
    )
    fresh.load_state_dict(saved)
    at_hook = seen[0]
    final = _buffers(fresh)
    expected = _buffers(opt)
    assert [b.dtype for b in at_hook] == [b.dtype for b in expected]
    assert all(torch.equal(a, e) for a, e in zip(at_hook, expected, strict=True))
    assert all(torch.equal(a, f) for a, f in zip(at_hook, final, strict=True))


def test_a_load_pre_hook_sees_the_dict_as_given():
    """Before DMuon checks or loads anything, as AdamW's pre-hooks do; its result is loaded."""
    m, opt = _trained("dmuon")
    saved = copy.deepcopy(opt.state_dict())
    fresh = _make("dmuon", m)
    seen = []

    def pre(o, sd):
        seen.append(sd)
        sd = dict(sd)
        sd["param_groups"] = [dict(g, lr=0.5) for g in sd["param_groups"]]
        return sd

    fresh.register_load_state_dict_pre_hook(pre)
    fresh.load_state_dict(saved)
    assert seen[0].keys() == {"state", "param_groups", "distributed"}
    assert all(g["lr"] == 0.5 for g in fresh.param_groups)


def test_no_dmuon_hook_outlives_its_call():
    """DMuon's own hooks are registered per call: none stays behind to be pickled, copied
    or run by a later call."""
    _, opt = _trained("dmuon")
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert all(not getattr(opt, name) for name in HOOK_DICTS)
    twin = copy.deepcopy(opt)
    calls = []
    twin.register_load_state_dict_post_hook(lambda o: calls.append("load"))
    twin.register_state_dict_post_hook(lambda o, sd: calls.append("distributed" in sd))
    twin.load_state_dict(twin.state_dict())
    assert calls == [True, "load"]


# ----------------------------------------------------------------- state_dict


@pytest.mark.parametrize("prepend", [False, True])
def test_a_state_dict_post_hook_sees_the_whole_dict(prepend):
    """AdamW's post-hooks see the dict ``state_dict()`` returns; DMuon's see its
    ``"distributed"`` entry too, and may change or drop it."""
    _, opt = _trained("dmuon")
    seen = []

    def post(o, sd):
        seen.append(dict(sd))
        sd = dict(sd)
        sd["distributed"] = dict(sd["distributed"], note="hooked")
        return sd

    opt.register_state_dict_post_hook(post, prepend=prepend)
    sd = opt.state_dict()
    assert seen[0].keys() == {"state", "param_groups", "distributed"}
    assert seen[0]["distributed"]["mode"] == "single"
    assert sd["distributed"]["note"] == "hooked"


# ------------------------------------------------------------------- unscaled


def _grad_norm_unscaled(m: nn.Module, x: torch.Tensor) -> float:
    """The reference: the 2-norm of the gradients of the same loss, never scaled."""
    twin = copy.deepcopy(m)
    twin.zero_grad()
    twin(x).square().mean().backward()
    return float(torch.nn.utils.get_total_norm([p.grad for p in twin.parameters()]))


@pytest.mark.parametrize("zero", ["model", "optimizer"])
def test_unscaled_ends_with_a_skipped_step(zero):
    """Iteration 0's loss is infinite, so the scaler skips its step without calling
    ``step()``; iteration 1 must find ``unscaled`` False, unscale, and clip the
    unscaled gradients (the norm equals the unscaled norm, not 2¹⁰ times it), with
    ``model.zero_grad()`` (which DMuon never sees) as with ``opt.zero_grad()``."""
    torch.manual_seed(0)
    m = _model()
    opt = DMuon(param_groups(m), lr=0.02)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    g = torch.Generator().manual_seed(3)
    flags, norms, refs = [], [], []
    for t in range(3):
        x = torch.randn(5, 4, generator=g)
        if t:
            refs.append(_grad_norm_unscaled(m, x))
        loss = m(x).square().mean()
        if t == 0:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        flags.append(opt.unscaled)
        if not opt.unscaled:
            opt.unscale_(scaler)
        flags.append(opt.unscaled)
        norm = float(clip_grad_norm_(opt, 10.0))
        if t:
            norms.append(norm)
        scaler.step(opt)
        flags.append(opt.unscaled)
        scaler.update()
        (m if zero == "model" else opt).zero_grad()
    assert flags == [False, True, False] * 3, flags
    assert opt.steps_taken == 2 and opt.skipped_steps == 0
    assert norms == pytest.approx(refs, rel=1e-5), (norms, refs)


def test_unscaled_until_the_scaler_steps_or_updates():
    """Between ``unscale_`` and ``scaler.step`` it stays True, also after clipping
    (the gradients changed in place, still unscaled); ``update`` alone ends it too."""
    m = _model()
    opt = DMuon(param_groups(m), lr=0.02)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(m(torch.ones(2, 4)).sum()).backward()
    opt.unscale_(scaler)
    clip_grad_norm_(opt, 1e-3)
    assert opt.unscaled
    scaler.update()
    assert not opt.unscaled


def test_a_disabled_or_freed_scaler_leaves_the_step_count_to_decide():
    """A disabled scaler records nothing (its ``unscale_`` returns at once), and a freed
    one cannot be asked: ``unscaled`` then holds until the step, as before."""
    m = _model()
    opt = DMuon(param_groups(m), lr=0.02)
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    m(torch.ones(2, 4)).sum().backward()
    opt.unscale_(disabled)
    assert opt.unscaled
    opt.step()
    assert not opt.unscaled
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(m(torch.ones(2, 4)).sum()).backward()
    opt.unscale_(scaler)
    del scaler
    gc.collect()
    assert opt.unscaled
    opt.step()
    assert not opt.unscaled
