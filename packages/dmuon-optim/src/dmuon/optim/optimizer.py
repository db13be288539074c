"""``DMuon``: the Muon family of update rules as one ``torch.optim.Optimizer``.

A thin class, in the spirit of ``torch.optim.AdamW``: the group defaults and checks
live in ``group_options.py`` (what ``step()`` re-checks: ``group_record.py``), the
state in ``optimizer_state.py``, a loaded dict's checks in ``loaded_state.py``, the
state dicts around torch's in ``state_dicts.py``, fp16 loss scaling in
``loss_scaling.py``, the step in ``stepping.py``, the execution modes in ``engine/``.
``DMuon`` is the :class:`~dmuon.optim.engine.Stepper` its engine drives.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dmuon.comm import CollectiveError, collective_timeout
from dmuon.comm.roll_call import start_responder
from dmuon.optim.assignment import ParamGroups, warn_embedding_matrices
from dmuon.optim.batches import Bucket, Sink
from dmuon.optim.deadline import Deadline, check_timeout
from dmuon.optim.engine.base import Engine, SingleEngine
from dmuon.optim.engine.modes import check_layouts, make_engine
from dmuon.optim.engine.report import StepReport
from dmuon.optim.engine.tensor_split import drop_relaid_grads
from dmuon.optim.group_options import GroupDefaults, check_distinct_params
from dmuon.optim.group_record import GroupRecord, check_groups
from dmuon.optim.loaded_state import check_loaded_state
from dmuon.optim.loss_scaling import AGREED_MODES, scaler_skips, scaler_unscaled, unscale_
from dmuon.optim.optimizer_state import build_state
from dmuon.optim.rules import RULES
from dmuon.optim.scalar import SCALAR_ALGORITHMS
from dmuon.optim.state_dicts import check_saved_groups, load_checked, with_distributed
from dmuon.optim.stepping import check_guard_options, run_step, step_matrices, step_scalars
from dmuon.optim.vote import SignVote, local_vote

__all__ = ["DMuon"]


class DMuon(torch.optim.Optimizer):
    """Muon and its family of update rules, with AdamW or Lion for the scalar parameters.

    Each parameter group carries an ``"rule"``: a matrix rule
    (``"muon"``, ``"normuon"``, ``"adamuon"``, ``"muon2"``, ``"mona"``, ``"musec"``,
    ``"sign_muon"``, ``"dion2"``, ``"dion3"``, ``"muonbp"``, ``"numuon"``, ``"scion"``; the
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
    (0.2·lr) — 1e-3 is ``torch.optim.Muon``'s and Moonlight's default and a common AdamW
    one — and the scalar parameters take the same lr unless ``adamw_lr`` says
    otherwise. Measured on the project's small GPTs, the best matrix lr was about 10×
    AdamW's best (docs: Algorithms, "Where to start"): start at 10× the lr your AdamW
    used, with AdamW's as ``adamw_lr``. With
    ``adjust_lr="original"`` (Keller Jordan's convention) use Muon's usual lr of
    about 0.02.

    It is a true ``torch.optim.Optimizer``: ``step(closure=None)``,
    ``zero_grad``, ``state_dict()`` / ``load_state_dict(state_dict)``,
    step and state-dict hooks, and the LR schedulers of
    ``torch.optim.lr_scheduler`` work; ``add_param_group`` after construction
    works in ``single`` mode only (every distributed mode planned its owners and
    buffers for the parameters it was built with, so it raises ``RuntimeError``
    there: build a new DMuon with every group). Hyperparameters are plain values in
    ``param_groups`` — or a one-element tensor (an ``lr`` tensor), which the group
    keeps and every step reads, as ``torch.optim`` does; state is created for every
    parameter at construction. In a distributed mode every rank must hold the same
    group values: each step compares them across ranks (in its first all-reduce) and
    refuses, on every rank, a step whose ranks differ or whose value one rank refuses.
    Parameters whose ``grad`` is ``None`` are skipped without touching their state.
    The state tensors of matrix parameters are views into one stacked buffer per
    shape: change them in place (or through :meth:`load_state_dict`), do not
    rebind them.

    Args:
        params: parameters, named parameters, or parameter groups (dicts).
        lr: learning rate of the matrix groups.
        rule: the matrix rule of groups that name no ``"rule"``.
        momentum: μ ∈ [0, 1) (sum form, see :class:`~dmuon.optim.transforms.Momentum`).
        nesterov: use ``G + μM`` instead of ``M``.
        weight_decay: decoupled weight decay of the matrix groups (with the base lr).
        cautious_weight_decay: decay a matrix entry only where the update agrees with
            the weight in sign, ``W ← W − lr·wd·𝟙[U⊙W ≥ 0]⊙W − lr·s·U`` (Cautious Weight
            Decay, Chen et al., arXiv 2510.12402; see :func:`~dmuon.optim.apply_update`),
            in every group: AdamW and Lion decay where their own update agrees
            (:func:`~dmuon.optim.adamw_step`, :func:`~dmuon.optim.lion_step`).
        adjust_lr: ``"original"``, ``"match_rms_adamw"``, ``"spectral"`` or ``None``.
        ns_method: ``"gram"`` or ``"standard"`` Newton–Schulz.
        ns_coefficients: a coefficient-set name of :mod:`dmuon.kernels` or triples.
        ns_steps: Newton–Schulz steps.
        tp_path: how a matrix split over a tensor-parallel group is orthogonalised:
            ``"gram"`` on its shards (all-reduces of the small Gram matrix), ``"gather"``
            whole after one all-gather, ``"auto"`` the cheaper by
            :func:`dmuon.comm.tensor_parallel_path` (also a group key).
        state_dtype: dtype the matrix rules' state (momentum, second moments) is stored
            in: ``"bfloat16"`` (or ``torch.bfloat16``) halves its bytes, every step's
            arithmetic still in fp32 (upcast on read, rounded on write); ``None``: the
            parameter's dtype. Scalar (AdamW/Lion) state stays fp32. See
            :mod:`dmuon.optim.state_precision`.
        state_rounding: how low-precision state is rounded on write: ``"nearest"``
            (ties to even) or ``"stochastic"`` (unbiased, reproducible; bfloat16 only).
        scalar_optimizer: ``"adamw"`` or ``"lion"``, for groups with ``rule="scalar"``.
        adamw_lr: learning rate of the scalar groups (``None``: ``lr``).
        adamw_betas: their ``(β₁, β₂)``.
        adamw_eps: their ε (AdamW).
        adamw_weight_decay: their decoupled weight decay.
        mode: the execution mode (``None``: detected; see :attr:`mode`).
        distributed: what ``dmuon.integrations.fsdp.dedicate`` / ``ddp.dedicate`` returned.
        process_group: the group of the ``replicated``/``sharded``/``sign`` modes.
        pipeline_depth: layers whose communication may be in flight at once.
        layer_pack_mb: in the ``replicated``, ``sharded`` and ``sign`` modes, consecutive
            layers whose matrices hold at most this many MiB together are stepped as one
            unit: one collective (all-gather, all-to-all, vote) and one batched rule call
            per shape for all of them, not per layer; ``None``: 1 MiB (PyTorch DDP's first
            bucket), ``0``: every layer alone. Owner mode packs by its dedication's
            ``layer_pack_mb`` (``dedicate(..., layer_pack_mb=)``); given here with it, it
            is refused.
        timeout: seconds every collective of a step may take before every rank raises
            :class:`dmuon.comm.CollectiveError` naming the step, the collective and (by
            the roll call) the rank that stalled. ``"auto"``: at least 300 s, and at
            least 20 times the slowest iteration measured so far (see
            :mod:`dmuon.optim.deadline`); ``None``: the process group's timeout.
        nonfinite: what a NaN/Inf gradient on any rank does: ``"raise"``
            (:class:`~dmuon.optim.engine.NonFiniteGradientError` on every rank, nothing
            updated), ``"skip_step"`` (every rank skips the step, state untouched,
            counted in :attr:`skipped_steps`) or ``None`` (no check: one pass over the
            gradients saved per step; the tiny all-reduce that agrees on the step
            number stays).
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
            each must be accepted by ``rule`` or by a group's rule.

    Raises:
        ValueError: a bad hyperparameter, an unknown group key or rule, or a
            parameter the group's rule cannot take (each error names it and
            says what would be right).

    Attributes:
        sign_vote: the :class:`~dmuon.optim.SignVote` Sign-Muon uses (identity by
            default; the distributed engine sets a majority vote).
        max_batch_elements: the most matrix entries one batched rule call holds
            (``None``: per device, see :func:`~dmuon.optim.default_batch_elements`;
            the results do not depend on it).
        steps_taken: steps this optimizer object has applied.
        skipped_steps: steps skipped for non-finite gradients (``nonfinite="skip_step"``),
            and in owner mode the steps a loss scaler skipped or that were refused.

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
        cautious_weight_decay: bool = False,
        adjust_lr: str | None = "match_rms_adamw",
        ns_method: str = "gram",
        ns_coefficients: Any = "polar_express",
        ns_steps: int = 5,
        tp_path: str = "auto",
        state_dtype: Any = None,
        state_rounding: str = "nearest",
        scalar_optimizer: str = "adamw",
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        mode: str | None = None,
        distributed: Any = None,
        process_group: Any = None,
        pipeline_depth: int = 2,
        layer_pack_mb: float | None = None,
        timeout: float | str | None = "auto",
        nonfinite: str | None = "raise",
        check_every: int | None = None,
        store: Any = None,
        **rule_options: Any,
    ) -> None:
        GroupDefaults.check_rule(rule)
        check_guard_options(timeout, nonfinite, check_every, store)
        self.timeout = check_timeout(timeout)
        self.nonfinite = nonfinite
        self.check_every = check_every
        self.skipped_steps = 0
        self.steps_taken = 0
        matrix = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
            "cautious_weight_decay": cautious_weight_decay,
            "adjust_lr": adjust_lr,
            "ns_method": ns_method,
            "ns_coefficients": ns_coefficients,
            "ns_steps": ns_steps,
            "ns_compute_dtype": None,
            "state_dtype": state_dtype,
            "state_rounding": state_rounding,
            "flatten": None,
            "transposed": False,
            "split_sizes": None,
            "num_heads": None,
            "tp_path": tp_path,
        }
        scalar = {
            "lr": lr if adamw_lr is None else adamw_lr,
            "betas": adamw_betas,
            "eps": adamw_eps,
            "weight_decay": adamw_weight_decay,
            "cautious_weight_decay": cautious_weight_decay,
        }
        self._group_defaults = GroupDefaults.build(
            rule, scalar_optimizer, matrix, scalar, rule_options
        )
        self._reset()
        super().__init__(params, self._group_defaults.torch_defaults())
        self._group_defaults.check_options_used(self.param_groups, _KEYWORDS)
        if not isinstance(params, ParamGroups):  # param_groups(model) chose its matrices
            warn_embedding_matrices(self.param_groups, RULES)
        with collective_timeout(self._deadline.seconds()):  # the plan's and model's checks
            self._engine: Engine = make_engine(
                self,
                mode=mode,
                distributed=distributed,
                process_group=process_group,
                pipeline_depth=pipeline_depth,
                layer_pack_mb=layer_pack_mb,
            )
        self._engine.set_timeout(self._deadline.seconds())
        self._store: Any = store  # the roll call's store (not pickled)
        self._answer_roll_calls()
        self._initialized = True
        for index in range(len(self.param_groups)):
            self._rebuild(index)

    def _reset(self) -> None:
        """The attributes a fresh (or unpickled) optimizer starts with."""
        self._initialized = False
        self.sign_vote: SignVote = local_vote
        self.max_batch_elements: int | None = None
        self._buckets: dict[int, dict[str | None, list[Bucket]]] = {}
        self._records: dict[int, GroupRecord] = {}
        self._engine = SingleEngine()
        self.last_step: StepReport | None = None
        self._deadline: Deadline = Deadline(getattr(self, "timeout", "auto"))
        self._unscaled_step: int | None = None  # the step whose gradients unscale_ unscaled
        self._unscaled_by: weakref.ref[torch.amp.GradScaler] | None = None  # and its scaler
        self._store = None  # unpickled: the roll call's store is MASTER_ADDR's, if any

    @property
    def _rule(self) -> str:
        return self._group_defaults.rule

    @property
    def mode(self) -> str:
        """The execution mode: ``"single"``, ``"owner"``, ``"replicated"``, ``"sharded"``
        or ``"sign"`` (see the Concepts page on execution modes)."""
        return self._engine.mode

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # torch.amp.GradScaler.step then always calls step() (with grad_scale and found_inf
        # set) instead of skipping it on this rank alone: a skip must be every rank's, and
        # in owner mode a skipped step still finishes its communication
        # (see dmuon.optim.loss_scaling)
        return self.mode in AGREED_MODES

    @property
    def engine(self) -> Engine:
        """The engine that runs the steps (its plan, groups and rank)."""
        return self._engine

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its keys are checked and completed, its state created at once.

        Works in ``single`` mode only once the optimizer is built: every distributed
        mode planned its owners, buffers and exchange for the parameters it was built
        with.

        Raises:
            ValueError: unknown key (named, with the accepted ones), bad value, or a
                parameter the group's rule cannot take.
            RuntimeError: the optimizer is built and its mode is not ``single`` (build a
                new DMuon with every group).
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        if self._initialized and self._engine.mode != "single":
            raise RuntimeError(
                f"add_param_group after construction is not supported in mode "
                f"{self._engine.mode!r}: the owner plan covers the parameters the optimizer "
                "was built with; build a new DMuon with every group"
            )
        group = self._group_defaults.normalize(param_group, len(self.param_groups))
        check_distinct_params(group, len(self.param_groups), self.param_groups)
        if self._initialized:  # the new matrices' layouts, as the constructor checked them
            check_layouts(
                [*self.param_groups, group], self._engine.mode, getattr(self._engine, "group", None)
            )
        defaults, self.defaults = self.defaults, {}
        try:
            super().add_param_group(group)
        finally:
            self.defaults = defaults
        if self._initialized:
            self._engine.bind(self)  # the engine learns the new parameters' names and layouts
            self._answer_roll_calls()  # the new matrices may make the step communicate
            self._rebuild(len(self.param_groups) - 1)

    def _answer_roll_calls(self) -> None:
        """Start this process's roll-call responder (:mod:`dmuon.comm.roll_call`, once per
        process) when the step communicates: it answers the roll a peer calls when one of
        its collectives fails, and lets this rank call one. ``single`` mode communicates
        too once matrices split over ranks are among its groups (the step's agreement),
        which :meth:`add_param_group` may bring after construction."""
        if self._engine.world_size > 1 or self._engine.guard_groups():
            start_responder(self._store)

    def _rebuild(self, index: int) -> None:
        """(Re)create buckets and state of group ``index`` (see :func:`build_state`)."""
        group = self.param_groups[index]
        self._buckets[index] = build_state(self.state, group, index, self._engine)
        self._records[index] = GroupRecord.of(group, index)

    # -------------------------------------------------------------------- step

    @torch.compiler.disable(
        reason="DMuon.step runs eagerly under torch.compile: it waits on collectives under "
        "a deadline and reads results on the host, which dynamo cannot trace, and a step "
        "traced in part would apply half of it; compiling a train step with it in it "
        "breaks the graph here (fullgraph=True cannot include it: compile the model, or "
        "the step function without opt.step())"
    )
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One optimization step over every group.

        In a distributed mode this is also where gradients are awaited and results
        published (see :attr:`mode`); :attr:`last_step` reports its phases.

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or ``None``.

        Raises:
            ValueError: a group value set since the last step does not check, on this
                rank (that error) or on another rank
                (:class:`~dmuon.optim.engine.guards.GroupValuesError`, naming the
                rank); or the ranks hold different group values (``GroupValuesError``
                on every rank, naming the group, key and ranks). Raised on every rank
                alike, nothing stepped; the next step with agreed values runs.
            RuntimeError: a group's structure or a parameter's shape changed (on every
                rank alike, as above).
        """
        number = self.steps_taken + self.skipped_steps + 1
        unscaled, self._unscaled_step = self._unscaled_step == number, None
        self._unscaled_by = None
        scaler_skip, refusal = False, None
        if hasattr(self, "found_inf"):  # torch.amp.GradScaler.step, in owner mode
            try:
                scaler_skip = scaler_skips(self, unscaled=unscaled, mode=self.mode)
            except RuntimeError as err:  # every rank refuses alike: skip together, then raise
                scaler_skip, refusal = True, err
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sparse, refused, values = check_groups(self._records, self.param_groups)
        try:
            report, stepped = run_step(
                self,
                self._engine,
                number,
                skip=scaler_skip,
                sparse=sparse,
                values=values,
                refused=refused,
                timeout=self._next_deadline(),
                nonfinite=self.nonfinite,
                check_every=self.check_every,
                stepped=self._count_step,
            )
        except BaseException:
            # a scaler deletes its attributes only when step() returns: a later plain
            # step must not find them
            for attribute in ("found_inf", "grad_scale"):
                self.__dict__.pop(attribute, None)
            raise
        if not stepped:
            self.skipped_steps += 1
        self.last_step = report
        if refusal is not None:
            raise refusal
        return loss

    @torch.compiler.disable(
        reason="DMuon.zero_grad runs eagerly under torch.compile, as torch.optim's: in "
        "owner mode it finishes a dropped backward's reductions (collectives under a "
        "deadline), which dynamo cannot trace"
    )
    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad``; in owner mode it also drops a step that
        will not be taken.

        Owner mode reduces each gradient to its owner during backward. A loop that drops
        a batch after its backward (``loss.backward(); opt.zero_grad()``, no step) leaves
        those reductions pending; this finishes them on every rank, as a skipped step
        would, and forgets them, so that the next backward starts a new step. Call it on
        every rank alike (it communicates when a backward ran since the last step, under
        ``timeout=`` as a step does); a rank whose dropped backward reached none of the
        dedication's parameters would not join. ``model.zero_grad()`` does not do this.
        A dropped step's :meth:`unscale_` is forgotten too (:attr:`unscaled`).
        """
        self._unscaled_step = self._unscaled_by = None
        try:
            with collective_timeout(self._deadline.seconds()):
                self._engine.discard_grads()
        except CollectiveError as err:
            e = self._engine
            raise err.after_roll_call().with_context(
                f"DMuon zero_grad, dropping a backward's reductions after step "
                f"{self.steps_taken + self.skipped_steps} (mode {e.mode!r}, rank {e.rank} of "
                f"{e.world_size})"
            ) from err
        if not set_to_none:  # gradients the step laid out anew: the next backward's differ
            drop_relaid_grads(p for g in self.param_groups for p in g["params"])
        super().zero_grad(set_to_none)

    def unscale_(self, scaler: torch.amp.GradScaler) -> None:
        """``scaler.unscale_(self)``, once the gradients are final: fp16 loss scaling.

        Call it where a training loop calls ``scaler.unscale_(opt)``: after backward,
        before clipping and ``scaler.step(opt)``. In owner mode it finishes the
        gradient reductions first; in owner and ``sign`` mode ``scaler`` must be a
        ``ShardedGradScaler`` (every rank then skips, and scales, alike) and
        ``scaler.step(opt)`` refuses a step without it. See :mod:`dmuon.optim.loss_scaling`::

            scaler = ShardedGradScaler()
            scaler.scale(loss).backward()
            opt.unscale_(scaler)
            dmuon.optim.clip_grad_norm_(opt, 1.0)  # optional
            scaler.step(opt)
            scaler.update()

        Raises:
            TypeError: not a ``torch.amp.GradScaler``, or in owner or ``sign`` mode
                not a ``ShardedGradScaler``.
        """
        with collective_timeout(self.collective_deadline()):  # the reductions it finishes
            unscale_(self._engine, self, scaler)
        self._unscaled_step = self.steps_taken + self.skipped_steps + 1
        self._unscaled_by = weakref.ref(scaler)

    @property
    def unscaled(self) -> bool:
        """Whether :meth:`unscale_` has unscaled the gradients the next step reads.

        ``False`` again once that step has run (taken or skipped), or
        :meth:`zero_grad` dropped it. A training loop that may clip before its scaler
        steps (Lightning's manual optimization) reads it to unscale once per step.

        A step the scaler skips (an Inf found) in ``single``, ``replicated`` or
        ``sharded`` mode never reaches :meth:`step` (``scaler.step(opt)`` skips it
        itself), so the scaler's own record of this optimizer tells: once it has
        stepped (``scaler.step``), or begun a new iteration (``scaler.update()``), the
        gradients the next backward makes are scaled again.
        """
        if self._unscaled_step != self.steps_taken + self.skipped_steps + 1:
            return False
        return scaler_unscaled(self, self._unscaled_by)

    def collective_deadline(self) -> float | None:
        """The deadline, in seconds, of DMuon's collectives now (``None``: the group's).

        What ``timeout=`` gives at this point of training (for ``"auto"``, from the
        iterations measured so far): the steps run under it, and so do the
        collectives of :meth:`unscale_`, of :func:`~dmuon.optim.clip_grad_norm_` and
        :func:`~dmuon.optim.clip_grad_value_`, and of DMuon's checkpoint functions
        (:mod:`dmuon.integrations.checkpoint`).

        Examples:
            >>> import torch
            >>> DMuon([torch.nn.Parameter(torch.zeros(4, 4))], timeout=5).collective_deadline()
            5.0
        """
        self._deadline.setting = check_timeout(self.timeout)
        return self._deadline.seconds()

    def _next_deadline(self) -> float | None:
        """The deadline of this step's collectives (and of the hooks' until the next)."""
        self._deadline.setting = check_timeout(self.timeout)
        self._deadline.observe()
        seconds = self._deadline.seconds()
        self._engine.set_timeout(seconds)
        return seconds

    def _count_step(self) -> int:
        self.steps_taken += 1
        return self.steps_taken

    # ------------------------------------------------- the engine's Stepper calls

    def is_scalar(self, group: Mapping[str, Any]) -> bool:
        """Whether ``group`` is stepped by a scalar optimizer (AdamW/Lion), not a rule."""
        return group["rule"] in SCALAR_ALGORITHMS

    def step_matrices(
        self,
        index: int,
        key: str | None,
        report: StepReport,
        grads: Mapping[torch.Tensor, torch.Tensor] | None = None,
        sink: Sink | None = None,
    ) -> None:
        """Run group ``index``'s rule on its same-shape batches of pipeline group ``key``."""
        step_matrices(
            self.param_groups[index],
            index,
            self._buckets[index].get(key, []),
            self.state,
            report,
            vote=self.sign_vote,
            max_batch_elements=self.max_batch_elements,
            grads=grads,
            sink=sink,
        )

    def step_scalars(
        self, group: Mapping[str, Any], params: list[torch.Tensor] | None = None
    ) -> None:
        """AdamW/Lion on ``params`` (default: the group's) that have a gradient."""
        step_scalars(group, self.state, params, self._engine.stats)

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

        Load-state-dict pre-hooks see the dict as given (they run before DMuon's
        checks); post-hooks see the state as loaded, DMuon's own restoring of its
        buffers already done, and what they change stays (as with ``torch.optim``).
        """
        load_checked(self, self._engine, state_dict, super().load_state_dict)

    def check_param_groups(self, param_groups: Sequence[Mapping[str, Any]]) -> None:
        """Check saved param groups as :meth:`load_state_dict` would, changing nothing.

        Group ``i`` of ``param_groups`` (a state dict's ``"param_groups"``; its
        ``params``, ids or names, are not read) goes with this optimizer's group ``i``
        and its parameters: its keys and values are completed and checked as the
        constructor checks a group. For checkpoint loaders that must refuse a checkpoint
        before they change the model (:mod:`dmuon.integrations.checkpoint`).

        Raises:
            ValueError: another number of groups, or groups with an unknown key, a
                value that does not check or a rule that cannot step their parameters
                (each named as the constructor names it, one line per group).

        Examples:
            >>> import torch
            >>> opt = DMuon([torch.nn.Parameter(torch.zeros(4, 4))])
            >>> saved = opt.state_dict()["param_groups"]
            >>> opt.check_param_groups(saved)
            >>> saved[0]["momentum"] = 1.5
            >>> opt.check_param_groups(saved)  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: param group 0: momentum must be ...
        """
        check_saved_groups(self._group_defaults, param_groups, self.param_groups)

    def state_dict(self) -> dict[str, Any]:
        """The state dict of ``torch.optim.Optimizer``, plus ``"distributed"``: the mode,
        rank, world size and (in owner-like modes) the plan digest and each parameter's
        owner. Parameters another rank steps hold placeholders (empty tensors) under the
        same keys on this rank; the owners hold the values.

        ``"distributed"`` is added before the state-dict post-hooks run (as a post-hook
        put first, for this call only), so that the caller's post-hooks see, and may
        change or drop, the whole dict this returns."""

        return with_distributed(self, self._engine, super().state_dict)

    def __getstate__(self) -> dict[str, Any]:
        if getattr(self, "_engine", None) is not None and self._engine.mode != "single":
            raise TypeError(
                f"a DMuon in mode {self._engine.mode!r} cannot be pickled or deep-copied (its "
                "engine holds process groups and hooks); save and load state_dict() instead"
            )
        state = super().__getstate__()
        state["dmuon_config"] = {
            **self._group_defaults.to_config(),
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
            self._group_defaults = GroupDefaults.from_config(config)
            for key, value in config.get("guards", {}).items():
                setattr(self, key, value)
            self._reset()
        live = getattr(self, "_initialized", False)  # load_state_dict into a live optimizer
        if live or config is not None:  # (unpickled: groups get the keys added since)
            groups = [
                self._group_defaults.normalize(g, i) for i, g in enumerate(state["param_groups"])
            ]
            if live:
                check_loaded_state(
                    state["state"], groups, self._engine.on_shard, self._engine.split_of
                )
            state["param_groups"] = groups
        super().__setstate__(state)
        if config is not None:
            self._engine.bind(self)
        self._initialized = True
        for index in range(len(self.param_groups)):
            self._rebuild(index)


# The constructor's own keywords, offered when a misspelt one reaches the rule options.
_KEYWORDS = tuple(
    p.name
    for p in inspect.signature(DMuon.__init__).parameters.values()
    if p.kind is p.KEYWORD_ONLY or p.name == "lr"
)
