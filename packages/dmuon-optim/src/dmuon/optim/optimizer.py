"""``DMuon``: the Muon family of update rules as one ``torch.optim.Optimizer``."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from dmuon.comm import CollectiveError, collective_timeout
from dmuon.comm.roll_call import note_phase, start_responder
from dmuon.optim.buckets import Bucket, Sink, build_buckets, state_shapes, step_bucket
from dmuon.optim.engine.base import Engine, SingleEngine
from dmuon.optim.engine.exchange import exchange_of
from dmuon.optim.engine.guards import (
    NONFINITE_POLICIES,
    NonFiniteGradientError,
    check_agreement,
    nonfinite_ranks,
)
from dmuon.optim.engine.modes import make_engine
from dmuon.optim.engine.report import StepReport
from dmuon.optim.hyperparameters import BOOKKEEPING_KEYS, MATRIX_KEYS, SCALAR_KEYS
from dmuon.optim.layout import matrix_layout
from dmuon.optim.rules import RULES, get_rule
from dmuon.optim.scalar import SCALAR_ALGORITHMS, adamw_step, lion_step, scalar_state_shapes
from dmuon.optim.vote import SignVote, local_vote

__all__ = ["DMuon"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The structural keys a group's buckets depend on; changing them after construction
# would silently mismatch the state, so step() refuses.
_STRUCTURE = ("algorithm", "flatten", "split_sizes", "num_heads")


class DMuon(torch.optim.Optimizer):
    """Muon and its family of update rules, with AdamW or Lion for the scalar parameters.

    Each parameter group carries an ``algorithm``: a matrix rule
    (``"muon"``, ``"normuon"``, ``"adamuon"``, ``"muon2"``, ``"mona"``, ``"musec"``,
    ``"sign_muon"``, ``"dion2"``, ``"dion3"``, ``"muonbp"``, ``"numuon"``; the
    default is ``rule``) or a scalar optimizer (``"adamw"``, ``"lion"``; the
    placeholder ``"scalar"`` means ``scalar_optimizer``). For Muon, a matrix ``W``
    with gradient ``G`` takes the step

        M ← μM + G,    O = NS(G + μM),    W ← W·(1 − lr·wd) − lr·s(m, n)·O

    with ``NS`` the Newton–Schulz polar factor and ``s`` the ``adjust_lr``
    convention; every rule is a chain of small transforms documented on its page.
    Same-shape matrices of a group are stacked and orthogonalised in one batched
    call per shape (on a CPU, in calls of at most ``max_batch_elements`` entries:
    large matrices one by one, small ones by the dozen). Build the groups of a
    model with
    :func:`dmuon.optim.param_groups`.

    The default ``lr = 1e-3`` goes with the default ``adjust_lr="match_rms_adamw"``:
    that convention gives every matrix's update the RMS of a typical AdamW update
    (0.2·lr), so the learning rates that work for AdamW work here — 1e-3 is
    ``torch.optim.Muon``'s and Moonlight's default and a common AdamW one — and the
    scalar parameters take the same lr unless ``adamw_lr`` says otherwise. With
    ``adjust_lr="original"`` (Keller Jordan's convention) use Muon's usual lr of
    about 0.02.

    It is a true ``torch.optim.Optimizer``: ``step(closure=None)``,
    ``zero_grad``, ``state_dict()`` / ``load_state_dict(state_dict)``,
    ``add_param_group``, step and state-dict hooks, and the LR schedulers of
    ``torch.optim.lr_scheduler`` work; hyperparameters are plain values in
    ``param_groups``; state is created for every parameter at construction.
    Parameters whose ``grad`` is ``None`` are skipped without touching their state.
    The state tensors of matrix parameters are views into one stacked buffer per
    shape: change them in place (or through :meth:`load_state_dict`), do not
    rebind them.

    Args:
        params: parameters, named parameters, or parameter groups (dicts).
        lr: learning rate of the matrix groups.
        rule: the matrix rule of groups that name no ``algorithm``.
        momentum: μ ∈ [0, 1) (sum form, see :class:`~dmuon.optim.transforms.Momentum`).
        nesterov: use ``G + μM`` instead of ``M``.
        weight_decay: decoupled weight decay of the matrix groups (with the base lr).
        adjust_lr: ``"original"``, ``"match_rms_adamw"``, ``"spectral"`` or ``None``.
        ns_method: ``"gram"`` or ``"standard"`` Newton–Schulz.
        ns_coefficients: a coefficient-set name of :mod:`dmuon.kernels` or triples.
        ns_steps: Newton–Schulz steps.
        scalar_optimizer: ``"adamw"`` or ``"lion"``, for groups with ``algorithm="scalar"``.
        adamw_lr: learning rate of the scalar groups (``None``: ``lr``).
        adamw_betas: their ``(β₁, β₂)``.
        adamw_eps: their ε (AdamW).
        adamw_weight_decay: their decoupled weight decay.
        mode: the execution mode (``None``: detected; see :attr:`mode`).
        distributed: what ``dmuon.integrations.fsdp.dedicate`` / ``ddp.dedicate`` returned.
        process_group: the group of the ``replicated``/``sharded``/``sign`` modes.
        pipeline_depth: layers whose communication may be in flight at once.
        timeout: seconds every collective of a step may take before every rank raises
            :class:`dmuon.comm.CollectiveError` naming the step and the collective
            (``None``: the process group's timeout).
        nonfinite: what a NaN/Inf gradient on any rank does: ``"raise"``
            (:class:`~dmuon.optim.engine.NonFiniteGradientError` on every rank, nothing
            updated), ``"skip_step"`` (every rank skips the step, state untouched,
            counted in :attr:`skipped_steps`) or ``None`` (no check: one pass over the
            gradients and one tiny all-reduce saved per step).
        check_every: compare a checksum of the replicated parameters across ranks every
            that many steps (``None``: never); a difference raises
            :class:`~dmuon.optim.engine.RankDivergenceError` naming the parameter.
        store: the rendezvous ``torch.distributed.Store`` through which, after a failed
            collective, the surviving ranks call the roll and name the rank that died or
            stalled (:mod:`dmuon.comm.roll_call`). ``None``: a client of
            ``MASTER_ADDR:MASTER_PORT`` when both are set (``torchrun``, ``env://``);
            without either, errors name the step and the collective but not the rank.
        **rule_options: defaults of rule hyperparameters (e.g. ``beta2=0.9`` for
            NorMuon, ``fraction=0.5`` for Dion2, ``ns_compute_dtype="float32"``);
            each must be accepted by ``rule`` or by a group's algorithm.

    Raises:
        ValueError: a bad hyperparameter, an unknown group key or rule, or a
            parameter the group's algorithm cannot take (each error names it and
            says what would be right).

    Attributes:
        sign_vote: the :class:`~dmuon.optim.SignVote` Sign-Muon uses (identity by
            default; the distributed engine sets a majority vote).
        max_batch_elements: the most matrix entries one batched rule call holds
            (``None``: per device, see :func:`~dmuon.optim.default_batch_elements`;
            the results do not depend on it).
        steps_taken: steps this optimizer object has applied.
        skipped_steps: steps skipped for non-finite gradients (``nonfinite="skip_step"``).

    Examples:
        >>> import torch
        >>> from dmuon.optim import DMuon, param_groups
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
        ...                             torch.nn.Linear(32, 4))
        >>> opt = DMuon(param_groups(model), lr=1e-3, rule="muon")
        >>> model(torch.randn(16, 8)).square().mean().backward()
        >>> opt.step()
        >>> opt.zero_grad()
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        *,
        rule: str = "muon",
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        adjust_lr: str | None = "match_rms_adamw",
        ns_method: str = "gram",
        ns_coefficients: Any = "polar_express",
        ns_steps: int = 5,
        scalar_optimizer: str = "adamw",
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        mode: str | None = None,
        distributed: Any = None,
        process_group: Any = None,
        pipeline_depth: int = 2,
        timeout: float | None = None,
        nonfinite: str | None = "raise",
        check_every: int | None = None,
        store: Any = None,
        **rule_options: Any,
    ) -> None:
        get_rule(rule)
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
        ):
            raise ValueError(
                f"timeout must be a positive number of seconds, or None for the process "
                f"group's timeout; got {timeout!r}"
            )
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"nonfinite must be 'raise', 'skip_step' or None (no check); got {nonfinite!r}"
            )
        if check_every is not None and (
            isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1
        ):
            raise ValueError(
                f"check_every must be an int ≥ 1 (compare parameters across ranks every that "
                f"many steps) or None (never); got {check_every!r}"
            )
        if store is not None and not isinstance(store, torch.distributed.Store):
            raise ValueError(
                "store must be a torch.distributed.Store (e.g. the TCPStore the process group "
                f"was initialised with) or None; got {type(store).__name__}"
            )
        self.timeout = None if timeout is None else float(timeout)
        self.nonfinite = nonfinite
        self.check_every = check_every
        self.skipped_steps = 0
        self.steps_taken = 0
        if scalar_optimizer not in SCALAR_ALGORITHMS:
            raise ValueError(
                f"scalar_optimizer must be one of {list(SCALAR_ALGORITHMS)}, "
                f"got {scalar_optimizer!r}"
            )
        self._rule = rule
        self._scalar_optimizer = scalar_optimizer
        self._initialized = False
        self.sign_vote: SignVote = local_vote
        self.max_batch_elements: int | None = None
        self._buckets: dict[int, dict[str | None, list[Bucket]]] = {}
        self._structure: dict[int, tuple[Any, ...]] = {}
        self._engine: Engine = SingleEngine()
        self.last_step: StepReport | None = None
        matrix = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
            "adjust_lr": adjust_lr,
            "ns_method": ns_method,
            "ns_coefficients": ns_coefficients,
            "ns_steps": ns_steps,
            "ns_compute_dtype": None,
            "flatten": None,
            "split_sizes": None,
            "num_heads": None,
        }
        self._matrix_defaults = {
            k: _check(k, v, MATRIX_KEYS[k], "DMuon") for k, v in matrix.items()
        }
        scalar = {
            "lr": lr if adamw_lr is None else adamw_lr,
            "betas": adamw_betas,
            "eps": adamw_eps,
            "weight_decay": adamw_weight_decay,
        }
        names = {"lr": "adamw_lr", "betas": "adamw_betas", "eps": "adamw_eps"}
        names["weight_decay"] = "adamw_weight_decay"
        self._scalar_defaults = {
            k: _check(names[k], v, SCALAR_KEYS["adamw"][k], "DMuon") for k, v in scalar.items()
        }
        self._rule_options = dict(rule_options)
        for key, value in self._rule_options.items():
            if key in MATRIX_KEYS:
                self._matrix_defaults[key] = _check(key, value, MATRIX_KEYS[key], "DMuon")
        defaults = {"algorithm": rule, **self._matrix_defaults}
        for key, opt in get_rule(rule).options.items():
            defaults[key] = self._rule_options.get(key, opt.default)
        super().__init__(params, defaults)
        used = set(MATRIX_KEYS) | set(get_rule(rule).options)
        for group in self.param_groups:
            if group["algorithm"] in RULES:
                used |= set(get_rule(group["algorithm"]).options)
        unused = sorted(set(self._rule_options) - used)
        if unused:
            rules_used = sorted({g["algorithm"] for g in self.param_groups} & set(RULES) | {rule})
            raise ValueError(
                f"unknown option(s) {unused} for rule(s) {rules_used}; accepted options: "
                f"{sorted(used)}"
            )
        self._engine = make_engine(
            self,
            mode=mode,
            distributed=distributed,
            process_group=process_group,
            pipeline_depth=pipeline_depth,
        )
        exchange = getattr(self._engine, "exchange", None)
        if exchange is not None:
            exchange.timeout = self.timeout
        if self._engine.world_size > 1:
            start_responder(store)  # answers roll calls when a peer's collective fails
        self._initialized = True
        for index in range(len(self.param_groups)):
            self._rebuild(index)

    # ------------------------------------------------------------------ engine

    @property
    def mode(self) -> str:
        """The execution mode: ``"single"``, ``"owner"``, ``"replicated"``, ``"sharded"``
        or ``"sign"`` (see the Concepts page on execution modes)."""
        return self._engine.mode

    @property
    def engine(self) -> Engine:
        """The engine that runs the steps (its plan, groups and rank)."""
        return self._engine

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its keys are checked and completed, its state created at once.

        Raises:
            ValueError: unknown key (named, with the accepted ones), bad value, or a
                parameter the group's algorithm cannot take.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        if self._initialized and self._engine.mode != "single":
            raise RuntimeError(
                f"add_param_group after construction is not supported in mode "
                f"{self._engine.mode!r}: the owner plan covers the parameters the optimizer "
                "was built with; build a new DMuon with every group"
            )
        group = self._normalize_group(param_group, len(self.param_groups))
        seen = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        for k, p in enumerate(group["params"]):
            if id(p) in seen:
                name = _name(group.get("param_names"), k, len(self.param_groups), p)
                raise ValueError(
                    f"{name} appears in more than one parameter group (it is already in "
                    f"param group {seen[id(p)]}); param_groups(model) assigns each parameter once"
                )
        defaults, self.defaults = self.defaults, {}
        try:
            super().add_param_group(group)
        finally:
            self.defaults = defaults
        if self._initialized:
            self._rebuild(len(self.param_groups) - 1)

    def _normalize_group(self, param_group: Mapping[str, Any], index: int) -> dict[str, Any]:
        group = dict(param_group)
        params = group.get("params")
        if params is None:
            raise ValueError(f"param group {index} has no 'params'")
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError("parameters must be an ordered collection (a list), not a set")
        params = list(params)
        if params and all(isinstance(p, tuple) for p in params):
            group["param_names"] = [n for n, _ in params]
            params = [p for _, p in params]
        group["params"] = params
        where = f"param group {index}"
        algorithm = group.get("algorithm", self._rule)
        if algorithm == "scalar":
            algorithm = self._scalar_optimizer
        accepted_algorithms = sorted(RULES) + list(SCALAR_ALGORITHMS) + ["scalar"]
        if algorithm not in RULES and algorithm not in SCALAR_ALGORITHMS:
            raise ValueError(
                f"{where}: unknown algorithm {algorithm!r}; expected one of {accepted_algorithms}"
            )
        group["algorithm"] = algorithm
        if algorithm in SCALAR_ALGORITHMS:
            keys = SCALAR_KEYS[algorithm]
            defaults = dict(self._scalar_defaults)
        else:
            rule = get_rule(algorithm)
            keys = {**MATRIX_KEYS, **rule.options}
            defaults = dict(self._matrix_defaults)
            for key, opt in rule.options.items():
                defaults[key] = self._rule_options.get(key, opt.default)
        unknown = sorted(k for k in group if k not in keys and k not in BOOKKEEPING_KEYS)
        if algorithm in SCALAR_ALGORITHMS and "max_momentum" in group and "momentum" in unknown:
            # OneCycleLR/CyclicLR(cycle_momentum=True) write "momentum" into every
            # group; it cycles the matrix groups' μ and is ignored by AdamW/Lion.
            unknown.remove("momentum")
        if unknown:
            raise ValueError(
                f"{where}: unknown key(s) {unknown} for algorithm {algorithm!r}; accepted keys: "
                f"{sorted(keys)} (and {sorted(BOOKKEEPING_KEYS)})"
            )
        for key, opt in keys.items():
            value = group[key] if key in group else defaults[key]
            group[key] = _check(key, value, opt, where)
        names = group.get("param_names")
        for i, p in enumerate(params):
            self._check_param(p, algorithm, group, _name(names, i, index, p))
        return group

    def _check_param(self, p: Any, algorithm: str, group: Mapping[str, Any], name: str) -> None:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{name} is a {type(p).__name__}; DMuon optimizes torch.Tensors")
        if p.dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"{name} has dtype {p.dtype}; DMuon optimizes real floating-point parameters "
                f"({', '.join(str(d) for d in _FLOAT_DTYPES)})"
            )
        if algorithm in RULES:
            matrix_layout(p, dict(group), name)
            # a dedicated weight freed on this rank (ZeRO-3-like) is one broadcast NaN;
            # another rank owns it, this one never updates it
            freed = exchange_of(p) is not None and 0 in p.stride() and p.numel() > 1
            if not p.is_contiguous() and not freed:
                raise ValueError(
                    f"{name} is not contiguous; matrix rules update "
                    "parameters through views — make it contiguous (e.g. not channels_last)"
                )

    def _rebuild(self, index: int) -> None:
        """(Re)create buckets and state of group ``index``, keeping values of matching shape.

        The engine says which parameters this rank steps and in which pipeline group;
        the others get placeholder state (same keys, empty tensors), so every rank's
        state dict has the same keys.
        """
        group = self.param_groups[index]
        names = group.get("param_names")
        algorithm = group["algorithm"]
        engine = self._engine
        if algorithm in SCALAR_ALGORITHMS:
            self._buckets[index] = {}
            for p in group["params"]:
                old = self.state.get(p, {})
                new: dict[str, torch.Tensor] = {}
                full = engine.steps(p)
                for key in scalar_state_shapes(algorithm, p):
                    if key == "step":
                        t = torch.zeros((), dtype=torch.float32)
                    elif full:
                        t = torch.zeros_like(p, memory_format=torch.preserve_format)
                    else:
                        t = _placeholder(p)
                    value = old.get(key)
                    if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(t.shape):
                        t.copy_(value)
                    new[key] = t
                self.state[p] = new
        else:
            rule = get_rule(algorithm)
            self._buckets[index] = {}
            built: set[int] = set()
            for pipeline_group in engine.step_groups():

                def include(i: int, p: torch.Tensor, key: str | None = pipeline_group) -> bool:
                    return engine.steps(p) and engine.group_of(p) == key

                buckets, new_state = build_buckets(
                    group,
                    rule,
                    lambda p: self.state.get(p, {}),
                    lambda i: _name(names, i, index, group["params"][i]),
                    include=include,
                )
                self._buckets[index][pipeline_group] = buckets
                for p, st in new_state.items():
                    self.state[p] = st
                    built.add(id(p))
            for p in group["params"]:
                if id(p) not in built:  # stepped by another rank (or frozen): placeholders
                    step = torch.zeros((), dtype=torch.float32)
                    _copy_step(step, self.state.get(p, {}))
                    holder = {"step": step}
                    for spec in rule.state_specs():
                        holder[spec.name] = _placeholder(p)
                    self.state[p] = holder
        self._structure[index] = _structure_of(group)

    # -------------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One optimization step over every group.

        In a distributed mode this is also where gradients are awaited and results
        published (see :attr:`mode`); :attr:`last_step` reports its phases.

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            if self._structure.get(index) != _structure_of(group):
                raise RuntimeError(
                    f"param group {index} changed its structure ({', '.join(_STRUCTURE)} or its "
                    "parameters) after construction; create a new optimizer or use "
                    "add_param_group"
                )
        engine = self._engine
        if engine.mode != "owner":
            dedicated = next((e.name for e in engine.params if exchange_of(e.param)), None)
            if dedicated is not None:
                raise RuntimeError(
                    f"parameter {dedicated!r} was dedicated to an owner after this optimizer "
                    f"was built (mode {engine.mode!r}): the dedication now reduces its gradient "
                    "to one rank and publishes its weight, which this optimizer does not know. "
                    "Call dedicate() first, then build DMuon(..., distributed=ded)"
                )
        report = StepReport(engine.mode, engine.rank, engine.world_size)
        number = self.steps_taken + self.skipped_steps + 1
        t0 = time.perf_counter()
        note_phase(f"DMuon step {number}")
        try:
            with collective_timeout(self.timeout):
                with report.phase("comm_wait"):  # the guards' flags are communication too
                    engine.begin_step()
                    finite = self.nonfinite is None or self._gradients_finite(number)
                if not finite:
                    engine.skip_step()
                    self.skipped_steps += 1
                    note_phase(f"outside DMuon (forward, backward, user code), step {number} done")
                    report.seconds["total"] = time.perf_counter() - t0
                    self.last_step = report
                    return loss
                exchange = getattr(engine, "exchange", None)
                if exchange is not None:
                    exchange.published_step = number
                engine.step(self, report)
                self.steps_taken += 1
                if self.check_every is not None and self.steps_taken % self.check_every == 0:
                    check_agreement(engine)
        except CollectiveError as err:
            raise err.after_roll_call().with_context(
                f"DMuon step {number} (mode {engine.mode!r}, rank {engine.rank} of "
                f"{engine.world_size})"
            ) from err
        note_phase(f"outside DMuon (forward, backward, user code), step {number} done")
        report.seconds["total"] = time.perf_counter() - t0
        self.last_step = report
        return loss

    def _gradients_finite(self, number: int) -> bool:
        """Agree with every rank whether all gradients are finite; raise or say skip."""
        ranks, names = nonfinite_ranks(self._engine)
        if not ranks:
            return True
        if self.nonfinite == "skip_step":
            return False
        engine = self._engine
        self._engine.skip_step()  # no collective left in flight: the optimizer stays usable
        here = f"; on this rank: {names[:5]}" if names else ""
        raise NonFiniteGradientError(
            f"DMuon step {number}: non-finite (NaN or Inf) gradient on rank(s) {ranks}{here}. "
            f"Nothing was updated on any rank (rank {engine.rank} of {engine.world_size}). "
            "Lower the learning rate or clip the gradients, or pass nonfinite='skip_step' to "
            "skip such steps on every rank (counted in skipped_steps)",
            ranks,
            names,
        )

    def is_scalar(self, group: Mapping[str, Any]) -> bool:
        """Whether ``group`` is stepped by a scalar optimizer (AdamW/Lion), not a rule."""
        return group["algorithm"] in SCALAR_ALGORITHMS

    def step_matrices(
        self,
        index: int,
        key: str | None,
        report: StepReport,
        grads: Mapping[torch.Tensor, torch.Tensor] | None = None,
        sink: Sink | None = None,
    ) -> None:
        """Run group ``index``'s rule on its buckets of pipeline group ``key``."""
        group = self.param_groups[index]
        buckets = self._buckets[index].get(key, [])
        if not buckets:
            return
        active: dict[int, torch.Tensor] = {}
        for b in buckets:
            for e in b.entries:
                has = e.param.grad is not None if grads is None else e.param in grads
                if has:
                    active[id(e.param)] = e.param
        if not active:
            return
        torch._foreach_add_([self.state[p]["step"] for p in active.values()], 1.0)
        rule = get_rule(group["algorithm"])
        names = group.get("param_names")
        timings: dict[str, float] = {}
        for b in buckets:
            ran = step_bucket(
                b,
                group,
                rule,
                self.state,
                self.sign_vote,
                self.max_batch_elements,
                grads=grads,
                sink=sink,
                timings=timings,
            )
            report.matrices += ran
            report.rule_calls += int(ran > 0)
        for phase, seconds in timings.items():
            report.add(phase, seconds)
        index_of = {id(p): i for i, p in enumerate(group["params"])}
        report.stepped.extend(
            names[index_of[id(p)]] if names else f"group{index}.param{index_of[id(p)]}"
            for p in active.values()
        )

    def step_scalars(
        self, group: Mapping[str, Any], params: list[torch.Tensor] | None = None
    ) -> None:
        """AdamW/Lion on ``params`` (default: the group's) that have a gradient."""
        candidates = group["params"] if params is None else params
        params = [p for p in candidates if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        if any(g.is_sparse for g in grads):  # type: ignore[union-attr]
            raise RuntimeError("DMuon does not support sparse gradients")
        states = [self.state[p] for p in params]
        steps = [s["step"] for s in states]
        if group["algorithm"] == "adamw":
            adamw_step(
                params,
                grads,  # type: ignore[arg-type]
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                steps,
                lr=float(group["lr"]),
                betas=group["betas"],
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
            )
        else:
            lion_step(
                params,
                grads,  # type: ignore[arg-type]
                [s["exp_avg"] for s in states],
                steps,
                lr=float(group["lr"]),
                betas=group["betas"],
                weight_decay=float(group["weight_decay"]),
            )

    # ------------------------------------------------------------- state dicts

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict`; checked before anything changes.

        In a distributed mode a state dict is rank-local: parameters another rank
        steps hold empty placeholders. Load on each rank the dict that rank saved
        (same mode, world size and plan), or use :mod:`dmuon.integrations.checkpoint`,
        which reshards.

        Raises:
            ValueError: a missing or extra group, parameter or state key, a tensor of
                the wrong shape, a group whose hyperparameters do not validate, or a
                placeholder for a parameter this rank steps (a dict saved by another
                rank, mode or world size). The optimizer is unchanged when it raises.
        """
        if not self._optimizer_load_state_dict_pre_hooks:
            if not isinstance(state_dict, Mapping):
                raise ValueError(f"state_dict must be a dict, got {type(state_dict).__name__}")
            missing = [k for k in ("state", "param_groups") if k not in state_dict]
            if missing:
                raise ValueError(
                    f"state dict is missing key(s) {missing}; an optimizer state dict has "
                    "'state' and 'param_groups'"
                )
        # Registered last, so it checks the dict the caller's own pre-hooks return,
        # and runs before torch's load changes anything.
        handle = self.register_load_state_dict_pre_hook(_refuse_foreign_placeholders)
        try:
            super().load_state_dict(state_dict)
        finally:
            handle.remove()

    def state_dict(self) -> dict[str, Any]:
        """The state dict of ``torch.optim.Optimizer``, plus ``"distributed"``: the mode,
        rank, world size and (in owner-like modes) the plan digest and each parameter's
        owner. Parameters another rank steps hold placeholders (empty tensors) under the
        same keys on this rank; the owners hold the values."""
        sd = super().state_dict()
        sd["distributed"] = self._engine.describe()
        return sd

    def __getstate__(self) -> dict[str, Any]:
        if getattr(self, "_engine", None) is not None and self._engine.mode != "single":
            raise TypeError(
                f"a DMuon in mode {self._engine.mode!r} cannot be pickled or deep-copied (its "
                "engine holds process groups and hooks); save and load state_dict() instead"
            )
        state = super().__getstate__()
        state["dmuon_config"] = {
            "rule": self._rule,
            "scalar_optimizer": self._scalar_optimizer,
            "matrix_defaults": self._matrix_defaults,
            "scalar_defaults": self._scalar_defaults,
            "rule_options": self._rule_options,
            "guards": {
                "timeout": self.timeout,
                "nonfinite": self.nonfinite,
                "check_every": self.check_every,
                "skipped_steps": self.skipped_steps,
                "steps_taken": self.steps_taken,
            },
        }
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        config = state.pop("dmuon_config", None)
        if config is not None:  # unpickling a fresh object
            self._rule = config["rule"]
            self._scalar_optimizer = config["scalar_optimizer"]
            self._matrix_defaults = config["matrix_defaults"]
            self._scalar_defaults = config["scalar_defaults"]
            self._rule_options = config["rule_options"]
            for key, value in config.get("guards", {}).items():
                setattr(self, key, value)
            self.sign_vote = local_vote
            self.max_batch_elements = None
            self._buckets, self._structure = {}, {}
            self._engine = SingleEngine()
            self.last_step = None
        if getattr(self, "_initialized", False):  # load_state_dict into a live optimizer
            groups = [self._normalize_group(g, i) for i, g in enumerate(state["param_groups"])]
            self._check_loaded_state(state["state"], groups)
            state["param_groups"] = groups
        super().__setstate__(state)
        if config is not None:
            self._engine.bind(self)
        self._initialized = True
        for index in range(len(self.param_groups)):
            self._rebuild(index)

    def _check_loaded_state(self, state: Mapping[Any, Any], groups: list[dict[str, Any]]) -> None:
        params = {p for g in groups for p in g["params"]}
        extra = [k for k in state if not (isinstance(k, torch.Tensor) and k in params)]
        if extra:
            raise ValueError(
                f"state dict has state for parameter id(s) {extra} that belong to no group of "
                "this optimizer"
            )
        for gi, g in enumerate(groups):
            names = g.get("param_names")
            for i, p in enumerate(g["params"]):
                name = _name(names, i, gi, p)
                if g["algorithm"] in SCALAR_ALGORITHMS:
                    expected = scalar_state_shapes(g["algorithm"], p)
                else:
                    layout = matrix_layout(p, g, name)
                    expected = state_shapes(get_rule(g["algorithm"]), layout)
                st = state.get(p)
                if st is None:
                    raise ValueError(
                        f"state dict has no state for {name}; expected keys {sorted(expected)}"
                    )
                missing = sorted(set(expected) - set(st))
                surplus = sorted(set(st) - set(expected))
                if missing or surplus:
                    raise ValueError(
                        f"state of {name} (algorithm {g['algorithm']!r}): missing key(s) "
                        f"{missing}, unexpected key(s) {surplus}; expected {sorted(expected)}"
                    )
                for key, shape in expected.items():
                    value = st[key]
                    if key != "step" and isinstance(value, torch.Tensor) and value.numel() == 0:
                        continue  # a placeholder: another rank steps this parameter
                    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
                        got = tuple(value.shape) if isinstance(value, torch.Tensor) else value
                        raise ValueError(
                            f"state {key!r} of {name} has shape {got}; expected {shape}"
                        )


def _refuse_foreign_placeholders(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Raise if ``state_dict`` holds a placeholder where this rank holds full state.

    A placeholder (an empty tensor) stands for state another rank keeps; loading one
    for a parameter this rank steps would restart its momentum from zero without a
    word. The pattern is read off this optimizer's live state, which ``_rebuild``
    shaped after what this rank steps. Malformed dicts are left to the checks that
    name them (torch's group sizes, ``_check_loaded_state``'s keys and shapes).
    """
    saved_groups, state = state_dict.get("param_groups"), state_dict.get("state")
    if not isinstance(opt, DMuon) or not isinstance(state, Mapping):
        return
    if not isinstance(saved_groups, list) or len(saved_groups) != len(opt.param_groups):
        return
    for gi, (live, saved) in enumerate(zip(opt.param_groups, saved_groups, strict=True)):
        ids = saved.get("params") if isinstance(saved, Mapping) else None
        if not isinstance(ids, list) or len(ids) != len(live["params"]):
            return
        for i, (p, pid) in enumerate(zip(live["params"], ids, strict=True)):
            theirs = state.get(pid)
            if not isinstance(theirs, Mapping):
                continue
            for key, mine in opt.state.get(p, {}).items():
                other = theirs.get(key)
                if key == "step" or not isinstance(mine, torch.Tensor) or mine.numel() == 0:
                    continue
                if isinstance(other, torch.Tensor) and other.numel() == 0:
                    name = _name(live.get("param_names"), i, gi, p)
                    raise ValueError(_foreign_placeholder_message(opt, state_dict, key, name))


def _foreign_placeholder_message(
    opt: DMuon, state_dict: Mapping[str, Any], key: str, name: str
) -> str:
    engine = opt.engine
    saved = state_dict.get("distributed")
    if isinstance(saved, Mapping) and "rank" in saved:
        saver = (
            f"rank {saved['rank']} of {saved.get('world_size', '?')} in "
            f"{saved.get('mode', '?')!r} mode"
        )
    else:
        saver = "a rank it does not name (no 'distributed' entry)"
    return (
        f"state {key!r} of {name} is an empty placeholder in this state dict, saved by "
        f"{saver}, where another rank steps that parameter; this is rank {engine.rank} of "
        f"{engine.world_size} in {engine.mode!r} mode, which steps it, so loading would "
        "restart its state from zero. Load the state dict this same rank saved (same mode, "
        "world size and plan), or save and load with dmuon.integrations.checkpoint "
        "(save/load or full_state_dict/load_full_state_dict), which reshards the state to "
        "the ranks that step each parameter"
    )


def _check(key: str, value: Any, opt: Any, where: str) -> Any:
    try:
        return opt.check(value)
    except ValueError as e:
        raise ValueError(f"{where}: {key} {e}") from None


def _name(names: list[str] | None, i: int, group_index: int, p: Any) -> str:
    shape = tuple(p.shape) if isinstance(p, torch.Tensor) else "?"
    if names is not None and i < len(names):
        return f"parameter {names[i]!r} (param group {group_index}, shape {shape})"
    return f"parameter {i} of param group {group_index} (shape {shape})"


def _structure_of(group: Mapping[str, Any]) -> tuple[Any, ...]:
    return (*(group.get(k) for k in _STRUCTURE), tuple(id(p) for p in group["params"]))


def _placeholder(p: torch.Tensor) -> torch.Tensor:
    """Empty state for a parameter another rank steps (same key, no memory)."""
    return torch.zeros(0, dtype=p.dtype, device=p.device)


def _copy_step(step: torch.Tensor, old: Mapping[str, Any]) -> None:
    value = old.get("step")
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        step.copy_(value.reshape(()))
