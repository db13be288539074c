"""QK-clip (Kimi K2's MuonClip): bound every attention head's largest logit by τ.

Kimi K2 (arXiv 2507.20534, §2.1, Algorithm 1), after each optimizer step::

    S_max^h = (1/√d) · max_{X∈B} max_{i,j} Q_i^h · K_j^h       (the step's batch B)
    η_h     = min(1, τ / S_max^h)
    W_q^h ← η_h^α W_q^h,   W_k^h ← η_h^{1−α} W_k^h            (α = 0.5: √η_h each)

(MLA: ``q^C, k^C`` by ``η^α, η^{1−α}``, the head-specific rotary ``q^R`` by ``η``, the
shared rotary key untouched; grouped-query attention: see
:mod:`dmuon.optim.qk_heads`.) The clip changes only the weights, never the forward
or the backward, and is idempotent below τ.

:class:`QKClip` is a companion to *any* optimizer (``DMuon`` in every mode,
``torch.optim.AdamW``): call :meth:`QKClip.step` right after ``optimizer.step()``.
It is not an option of ``DMuon`` because the clip needs the model (hooks on its
attention) and nothing of the optimizer, and it must run after every mode's step,
including the scalar optimizers that hold q/k biases.

Distributed training: each rank records the maxima of its own micro-batches; one
``all_reduce(MAX)`` over ``process_group`` gives every rank the step's global
``S_max^h`` (``process_group=None``: the world when torch.distributed is
initialised, else this process alone). The factors are then the same on every rank
and each rank scales the values it holds:

GPT-2's fused ``c_attn`` (a ``Conv1D``, stored ``(in, out)``) holds ``q|k|v`` in its
columns: head ``h``'s query columns take ``η_h^α``, its key columns ``η_h^{1−α}``, the
matching entries of the bias alike, the value columns nothing
(:class:`~dmuon.optim.HeadRows` with ``transposed=True``).

* replicated weights (plain tensors: DDP, DMuon ``replicated``/``single`` mode):
  every rank scales its copy identically, so the copies stay equal;
* DTensor weights (FSDP2's ``Shard(0)``, DMuon ``sharded`` mode): each rank scales
  its local rows with the factors of those rows
  (:func:`~dmuon.optim.row_scaling.scale_rows_`);
* DMuon owner mode (``dedicate``): the clip first waits for the owners'
  publications of the step (``exchange.publication.wait_all_layers()``), after which
  every rank holds the owner's weight bit for bit; scaling that copy with the
  same factor on every rank gives every rank exactly what scaling at the owner
  before its broadcast would (a broadcast copies bits; the product of two equal
  inputs is equal), at no traffic. The owners' momentum is not touched, as in the
  paper. The ZeRO-3-like variant (``reshard_after_forward=True``) keeps a weight on
  its owner only and is refused.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from dmuon.comm import wait_work
from dmuon.comm.process_groups import group_size
from dmuon.optim.attention_hooks import attention_heads, attention_kind, install_hooks
from dmuon.optim.attention_logits import DEFAULT_MAX_ELEMENTS
from dmuon.optim.engine.exchange import OwnerExchange, exchange_of
from dmuon.optim.qk_heads import AttentionHeads, clip_factors, scale_vectors
from dmuon.optim.row_scaling import scale_rows_

__all__ = ["QKClip", "QKClipReport"]


@dataclass(frozen=True)
class QKClipReport:
    """What one :meth:`QKClip.step` saw and did (tensors: no device sync).

    Attributes:
        max_logits: per attention layer, ``S_max^h`` over the step's global batch
            (``-inf`` for a head nothing was recorded for).
        factors: per attention layer, ``η_h`` (1 where ``S_max^h ≤ τ``).

    Examples:
        >>> import torch
        >>> r = QKClipReport({"attn": torch.tensor([50.0, 400.0])},
        ...                  {"attn": torch.tensor([1.0, 0.25])})
        >>> r.max_logit, r.clipped_heads
        (400.0, 1)
    """

    max_logits: dict[str, torch.Tensor]
    factors: dict[str, torch.Tensor]

    @property
    def max_logit(self) -> float:
        """The largest logit of the step over all heads (a device sync)."""
        return max((float(v.max()) for v in self.max_logits.values()), default=-math.inf)

    @property
    def clipped_heads(self) -> int:
        """How many heads were scaled down (a device sync)."""
        return sum(int((f < 1).sum()) for f in self.factors.values())


class QKClip:
    """Kimi K2's QK-clip as a companion object: hooks record, :meth:`step` clips.

    Args:
        model: the model (on every rank the same structure).
        tau: the threshold τ on ``S_max^h`` (> 0; Kimi K2 used 100).
        alpha: the split ``η^α`` to the queries, ``η^{1−α}`` to the keys, in
            ``[0, 1]`` (the paper: 0.5).
        modules: the attention modules to clip (modules or their names in
            ``model``); default: every recognised attention module of ``model``
            (Hugging Face Llama/Qwen2/Mistral attention, Hugging Face GPT-2
            self-attention, ``nn.MultiheadAttention``).
            Pass ``[]`` to clip only ``heads``.
        heads: custom attention layers (:class:`~dmuon.optim.AttentionHeads`); their
            forward calls :meth:`record` with its per-head maxima (e.g. from
            :func:`~dmuon.optim.head_max_logits`).
        process_group: the data-parallel group the maxima are reduced over.
        max_elements: logits the hooks form at once (memory bound of the capture), a
            positive int.

    Raises:
        ValueError: ``tau`` not a positive finite number, ``alpha`` outside
            ``[0, 1]``, ``max_elements`` not a positive int, no attention found, a
            repeated name, ZeRO-3-like owner mode.
        TypeError: ``model`` not an ``nn.Module``; an entry of ``modules`` that is not a
            recognised attention module.

    Examples:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        >>> with torch.no_grad():
        ...     _ = mha.in_proj_weight.mul_(20.0)  # large q/k weights: logits blow up
        >>> clip = QKClip(mha, tau=10.0)
        >>> x = torch.randn(2, 5, 8)
        >>> _ = mha(x, x, x)
        >>> report = clip.step()  # after optimizer.step()
        >>> report.max_logit > 10.0, report.clipped_heads
        (True, 2)
        >>> _ = mha(x, x, x)
        >>> clip.step().max_logit <= 10.0 + 1e-4
        True
    """

    def __init__(
        self,
        model: nn.Module,
        tau: float = 100.0,
        *,
        alpha: float = 0.5,
        modules: Iterable[nn.Module | str] | None = None,
        heads: Sequence[AttentionHeads] = (),
        process_group: dist.ProcessGroup | None = None,
        max_elements: int = DEFAULT_MAX_ELEMENTS,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"QKClip takes the model (an nn.Module) to find its attention modules, got "
                f"{type(model).__name__}"
            )
        if (
            isinstance(tau, bool)
            or not isinstance(tau, (int, float))
            or not (math.isfinite(tau) and tau > 0)
        ):
            raise ValueError(f"tau must be a positive finite number, got {tau!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
        given: object = max_elements  # checked as any object: callers pass what they have
        if isinstance(given, bool) or not isinstance(given, numbers.Integral) or given < 1:
            # an int: it sizes the chunks of logits the hooks form (1.5 or nan sliced
            # nothing sensible, "x" or None failed at the comparison)
            raise ValueError(
                f"max_elements must be a positive int (logits formed at once, default "
                f"{DEFAULT_MAX_ELEMENTS}), got {max_elements!r}"
            )
        max_elements = int(max_elements)
        self.tau = float(tau)
        self.alpha = float(alpha)
        self.process_group = process_group
        self.handles: list[RemovableHandle] = []
        found = self._modules(model, modules)
        self._found = found
        for h in heads:
            if not isinstance(h, AttentionHeads):
                raise TypeError(f"heads must hold AttentionHeads, got {type(h).__name__}")
        self._custom = list(heads)
        attentions = self.attentions
        names = [a.name for a in attentions]
        if not names:
            kinds = {type(m).__name__ for m in model.modules()}
            unknown = sorted(k for k in kinds if "attention" in k.lower())
            raise ValueError(
                f"no attention module found in {type(model).__name__} (recognised: Hugging Face "
                "Llama/Qwen2/Mistral attention, Hugging Face GPT-2 self-attention, "
                "nn.MultiheadAttention"
                + (f"; found unrecognised {unknown}" if unknown else "")
                + "); describe custom attention with heads=[AttentionHeads(...)] and call "
                "QKClip.record from its forward"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"attention names must be unique, got {names}")
        self._heads = {a.name: a.heads for a in attentions}
        self._maxima: dict[str, torch.Tensor | None] = dict.fromkeys(names)
        _exchanges(attentions)  # refuses ZeRO-3-like owner mode now rather than at the step
        self.max_elements = max_elements
        for (n, m), a in zip(found, attentions[: len(found)], strict=True):
            self.handles += install_hooks(n, m, a, self.record, max_elements)

    @property
    def attentions(self) -> list[AttentionHeads]:
        """The attention layers clipped, in a fixed order (the same on every rank).

        Those of recognised modules are read from the modules each time, so that the
        parameters scaled are the modules' current ones: ``fully_shard`` or a
        dedication applied after the ``QKClip`` was made replaces or re-aliases them.
        """
        return [attention_heads(n, m) for n, m in self._found] + self._custom

    @staticmethod
    def _modules(
        model: nn.Module, modules: Iterable[nn.Module | str] | None
    ) -> list[tuple[str, nn.Module]]:
        named = dict(model.named_modules())
        if modules is None:
            out: list[tuple[str, nn.Module]] = []
            inside: list[str] = []
            for n, m in model.named_modules():
                if any(n.startswith(p + ".") for p in inside):
                    continue
                if attention_kind(m) is not None:
                    out.append((n, m))
                    inside.append(n)
            return out
        name_of = {id(m): n for n, m in named.items()}
        out = []
        for m in modules:
            if isinstance(m, str):
                if m not in named:
                    raise ValueError(f"modules: {m!r} is not a module of the model")
                out.append((m, named[m]))
            elif id(m) in name_of:
                out.append((name_of[id(m)], m))
            else:
                raise ValueError(f"modules: a {type(m).__name__} that is not part of the model")
        return out

    def record(self, name: str, maxima: torch.Tensor) -> None:
        """Fold one forward's per-head maxima ``S^h`` of attention ``name`` into the step's.

        The hooks call this; custom attention calls it from its forward (e.g. with
        :func:`~dmuon.optim.head_max_logits` of its queries and keys, times the
        softmax scale it uses).

        Raises:
            KeyError: an unknown ``name``.
            ValueError: ``maxima`` is not ``(heads,)``.
        """
        if name not in self._heads:
            raise KeyError(f"no attention named {name!r}; known: {sorted(self._heads)}")
        heads = self._heads[name]
        if tuple(maxima.shape) != (heads,):
            raise ValueError(
                f"attention {name!r}: maxima must have shape ({heads},), got {tuple(maxima.shape)}"
            )
        m = maxima.detach().double()  # a few numbers per layer; η exact for fp64 models
        prev = self._maxima[name]
        self._maxima[name] = m if prev is None else torch.maximum(prev, m.to(prev.device))

    @torch.no_grad()
    def step(self) -> QKClipReport:
        """Reduce the step's maxima over the ranks, scale the heads over τ, start afresh.

        Call it on every rank after ``optimizer.step()`` (a collective when the
        group has more than one rank).

        Raises:
            RuntimeError: a head's maximum logit is NaN or +inf on some rank (the
                forward's queries or keys were not finite), on every rank alike, naming
                the attention layers and heads. Nothing is scaled (``η`` of a NaN is
                meaningless, and a clip of 1 would hide the divergence); the step's
                maxima are discarded, so the next step records afresh.
        """
        attentions = self.attentions
        device = attentions[0].parts[0].weight.device
        flat = torch.cat(
            [
                torch.full((a.heads,), -math.inf, device=device, dtype=torch.float64)
                if self._maxima[a.name] is None
                else self._maxima[a.name].to(device)  # type: ignore[union-attr]
                for a in attentions
            ]
        )
        # NaN as +inf: a MAX reduction may drop a NaN (gloo's keeps the other rank's number
        # when the NaN is not on the first rank), +inf it keeps, so every rank sees a
        # non-finite maximum wherever one rank recorded it
        flat = torch.nan_to_num(flat, nan=math.inf, posinf=math.inf, neginf=-math.inf)
        if group_size(self.process_group) > 1:
            work = dist.all_reduce(
                flat, op=dist.ReduceOp.MAX, group=self.process_group, async_op=True
            )
            wait_work(work, "all-reduce MAX of QK-clip's per-head logits", self.process_group)
        pieces = flat.split([a.heads for a in attentions])
        s_max = {a.name: p for a, p in zip(attentions, pieces, strict=True)}
        etas = {n: clip_factors(s, self.tau) for n, s in s_max.items()}
        self._maxima = dict.fromkeys(self._maxima)
        report = QKClipReport(max_logits=s_max, factors=etas)
        if not bool((flat > self.tau).any()):  # one sync; nothing to scale (η = 1 everywhere)
            return report
        _refuse_non_finite(s_max)  # +inf > τ: checked only when something is over τ
        for ex in _exchanges(attentions):
            # every rank holds the owners' attention weights of this step (the expert
            # stacks' broadcasts travel on)
            ex.publication.wait_all_layers()
        for tensor, factors, dim in scale_vectors(
            attentions, [etas[a.name] for a in attentions], self.alpha
        ):
            scale_rows_(tensor, factors, dim=dim)
        return report

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _refuse_non_finite(s_max: dict[str, torch.Tensor]) -> None:
    """Raise when a reduced maximum is +inf (a NaN or +inf recorded on some rank).

    The maxima are all-reduced, so every rank raises alike, before anything is scaled.
    """
    bad = {n: torch.nonzero(s == math.inf).flatten().tolist() for n, s in s_max.items()}
    bad = {n: heads for n, heads in bad.items() if heads}
    if bad:
        where = "; ".join(f"attention {n!r} heads {heads}" for n, heads in bad.items())
        raise RuntimeError(
            f"QKClip.step: a non-finite maximum logit (NaN or +inf, on some rank) in {where}: "
            "the forward's queries or keys were not finite (the model diverged: look at the "
            "loss, the learning rate, loss scaling). Nothing was scaled; the step's maxima "
            "are discarded"
        )


def _exchanges(attentions: Sequence[AttentionHeads]) -> list[OwnerExchange]:
    """The owner-mode exchanges the clipped tensors are dedicated to (none: not dedicated)."""
    found: dict[int, OwnerExchange] = {}
    for a in attentions:
        for part in a.parts:
            for t in (part.weight, part.bias):
                ex = None if t is None else exchange_of(t)
                if ex is not None:
                    if ex.publication.reshard_after_forward:
                        raise ValueError(
                            f"attention {a.name!r}: owner mode with reshard_after_forward=True "
                            "(ZeRO-3-like) keeps each weight on its owner only; QK-clip "
                            "needs reshard_after_forward=False"
                        )
                    found[id(ex)] = ex
    return list(found.values())
