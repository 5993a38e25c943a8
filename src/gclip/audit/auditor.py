"""The hooks: what backward left, what the optimizer receives, and one report per step.

:class:`Auditor` installs, process-wide:

- a wrapper around ``torch.autograd.backward`` (``Tensor.backward`` calls it): when it
  returns (DDP's all-reduce and FSDP's reduce-scatter have finished by then, in backward's
  own final callbacks), the sketch of every optimizer parameter's gradient is taken
  (``capture``). Gradient accumulation takes it after each backward: the last one counts.
  What rescales the gradients on purpose after backward is part of "what backward
  produced": ``GradScaler.unscale_`` and a pipeline schedule's ``scale_grads`` (dividing by
  the micro-batches) take the sketch again after they return;
- a global optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``):
  a step without a closure is audited there; a step with one (Lightning runs forward,
  backward and its clip inside ``optimizer.step(closure)``, as LBFGS does) gets its closure
  wrapped, and is audited when the closure first returns. A wrapped optimizer (accelerate's
  ``AcceleratedOptimizer``, torchtitan's container) steps its inner one inside its own step:
  a parameter is audited once per backward, so the inner step is not audited again;
- recorders on the clip functions (torch's ``clip_grad_norm_`` and ``clip_grads_with_norm_``,
  gclip.torch's ``clip_grad_norm_``): the max_norm the script clips with, when the command
  line does not give it;
- recorders of the layout the script builds: the parameters of each
  ``DistributedDataParallel`` (copies over its process group) and each rank's pipeline
  stage (``PipelineStage``), beside the DTensor placements that gclip reads.

Each audited step is collective: every rank sends one small row (``verdict.Row``) through
``all_gather_object`` on the default group, and every rank grades the same step
(``verdict.grade_step``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..conformance import limits
from . import capture, verdict
from . import limits as audit_limits

__all__ = ["Auditor"]

PLAIN = ("auto", "replicated", "sharded")
# torch's clip functions, recorded for their max_norm: (name, whether it returns the norm)
# a step whose gradients no backward left, on any rank: not audited (nothing to compare with)
UNSEEN = (
    "gclip.audit: an optimizer stepped on gradients that no backward left (one that clips inside its"
    " own step, as DeepSpeed's ZeRO: read it from its update, gclip.audit.update): not audited"
)
CLIPS = (("clip_grad_norm_", True), ("clip_grads_with_norm_", False), ("_clip_grads_with_norm_", False))


class Auditor:
    """Hooks that audit every optimizer step of this process (see the module's docstring)."""

    def __init__(
        self,
        *,
        max_norm: float | None = None,
        steps: int | None = None,
        plain: str = "auto",
        report: Callable[[verdict.StepReport], None] | None = None,
        seed: int = 0,
        adaptive: str | None = None,
        max_norms: list[float | None] | None = None,
        agc: tuple[float, float] | None = None,
    ) -> None:
        if plain not in PLAIN:
            raise ValueError(f"plain must be one of {', '.join(PLAIN)}, got {plain!r}")
        self.max_norm = max_norm
        self.steps = steps
        self.plain = plain
        self.report = report
        self.seed = seed
        self.reports: list[verdict.StepReport] = []
        self._params: dict[int, Any] = {}  # id -> parameter, of every optimizer
        self._seeds: dict[int, int] = {}
        self._before: dict[int, capture.Sketch] = {}
        self._backward = 0  # how many backward passes so far
        self._audited: dict[int, int] = {}  # parameter id -> the backward it was audited after
        self._ddp: dict[int, Any] = {}  # parameter id -> its DDP's process group
        self._stages: list[int] = []  # this rank's pipeline stages
        self._seen_max_norm: float | None = None
        self._seen_norm: float | None = None
        self._holders: dict[tuple[int, ...], list[tuple[tuple[int, ...], str]]] = {}
        self._undo: list[Callable[[], None]] = []
        self._stepping = False
        self.adaptive = adaptive
        self._thresholds: Any = None  # the adaptive clipper's candidates, made on the first step
        if adaptive is not None:
            self._make_threshold = limits.threshold(adaptive)
        self.max_norms = max_norms  # one limit per optimizer parameter group (None: not clipped)
        self.agc = agc  # (clipping, eps): the script clips unit-wise
        self._units_before: dict[int, list[capture.Sketch]] = {}

    # -- installing

    def install(self) -> Auditor:
        from torch.optim.optimizer import Optimizer, register_optimizer_step_pre_hook

        handle = register_optimizer_step_pre_hook(self._pre_step)
        self._undo.append(handle.remove)
        self._patch(Optimizer, "add_param_group", self._wrap_add_param_group)
        self._patch(torch.autograd, "backward", self._wrap_backward)
        for module in (torch.nn.utils, torch.nn.utils.clip_grad):
            for name, returns_norm in CLIPS:
                if hasattr(module, name):
                    self._patch(module, name, self._recorder(returns_norm))
        import gclip.torch as gclip_torch

        self._patch(gclip_torch, "clip_grad_norm_", self._recorder(returns_norm=True))
        from torch.nn.parallel import DistributedDataParallel

        self._patch(DistributedDataParallel, "__init__", self._wrap_ddp_init)
        try:
            from torch.amp import GradScaler
        except ImportError:  # pragma: no cover - older torch
            GradScaler = None
        if GradScaler is not None:
            self._patch(GradScaler, "unscale_", self._wrap_unscale)
        try:
            from torch.distributed.pipelining.stage import _PipelineStageBase
        except ImportError:  # pragma: no cover - older torch
            _PipelineStageBase = None
        if _PipelineStageBase is not None:
            self._patch(_PipelineStageBase, "__init__", self._wrap_stage_init)
            self._patch(_PipelineStageBase, "scale_grads", self._wrap_scale_grads)
        return self

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> Auditor:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _patch(self, owner: Any, name: str, wrap: Callable[[Any], Any]) -> None:
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        setattr(owner, name, wrap(original))
        self._undo.append(lambda: setattr(owner, name, original))

    def watch(self, parameters: Any) -> None:
        """Audit these parameters too (an optimizer made before the hooks were installed)."""
        for p in parameters:
            if isinstance(p, torch.Tensor) and id(p) not in self._params:
                self._seeds[id(p)] = self.seed * 1_000_003 + len(self._params)
                self._params[id(p)] = p

    # -- the wrappers

    def _wrap_add_param_group(self, original: Any) -> Any:
        auditor = self

        @functools.wraps(original)
        def add_param_group(opt: Any, group: dict[str, Any]) -> Any:
            out = original(opt, group)
            params = group.get("params", [])
            auditor.watch([params] if isinstance(params, torch.Tensor) else list(params))
            return out

        return add_param_group

    def _wrap_backward(self, original: Any) -> Any:
        auditor = self

        @functools.wraps(original)
        def backward(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            auditor._backward += 1
            auditor._take(auditor._params.values())
            return out

        return backward

    def _wrap_unscale(self, original: Any) -> Any:
        auditor = self

        @functools.wraps(original)
        def unscale_(scaler: Any, optimizer: Any) -> Any:
            out = original(scaler, optimizer)
            auditor._take(p for g in optimizer.param_groups for p in g["params"])
            return out

        return unscale_

    def _wrap_scale_grads(self, original: Any) -> Any:
        auditor = self

        @functools.wraps(original)
        def scale_grads(stage: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(stage, *args, **kwargs)
            auditor._take(stage.submod.parameters())
            return out

        return scale_grads

    def _wrap_stage_init(self, original: Any) -> Any:
        auditor = self

        @functools.wraps(original)
        def __init__(stage: Any, *args: Any, **kwargs: Any) -> None:
            original(stage, *args, **kwargs)
            auditor._stages.append(int(stage.stage_index))

        return __init__

    def _wrap_ddp_init(self, original: Any) -> Any:
        auditor = self

        @functools.wraps(original)
        def __init__(ddp: Any, *args: Any, **kwargs: Any) -> None:
            original(ddp, *args, **kwargs)
            for p in ddp.module.parameters():
                auditor._ddp[id(p)] = ddp.process_group

        return __init__

    def _recorder(self, returns_norm: bool) -> Callable[[Any], Any]:
        auditor = self

        def wrap(original: Any) -> Any:
            @functools.wraps(original)
            def clip(parameters: Any, max_norm: Any, *args: Any, **kwargs: Any) -> Any:
                out = original(parameters, max_norm, *args, **kwargs)
                try:
                    auditor._seen_max_norm = float(max_norm)
                    norm = out if returns_norm else (args[0] if args else kwargs.get("total_norm"))
                    if norm is not None:
                        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
                        auditor._seen_norm = float(norm)
                except (TypeError, ValueError, RuntimeError):
                    pass  # a recorder never changes what the clip does
                return out

            return clip

        return wrap

    def _take(self, params: Any) -> None:
        for p in list(params):
            if isinstance(p, torch.Tensor) and p.grad is not None and id(p) in self._seeds:
                self._before[id(p)] = capture.sketch(p.grad, self._seeds[id(p)])
                if self.agc is not None:
                    self._units_before[id(p)] = capture.unit_sketches(p.grad, self._seeds[id(p)])

    # -- the step

    def _pre_step(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._stepping:
            return None
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._step(optimizer)
            return None
        if getattr(closure, "_gclip_audit", False):
            return None
        auditor = self
        done = []

        def audited_closure(*a: Any, **k: Any) -> Any:
            out = closure(*a, **k)
            if not done:  # LBFGS calls it again to re-evaluate: the first call is the step's
                done.append(True)
                auditor._step(optimizer)
            return out

        audited_closure._gclip_audit = True  # type: ignore[attr-defined]
        if "closure" in kwargs:
            return args, {**kwargs, "closure": audited_closure}
        return (args[0], audited_closure, *args[2:]), kwargs

    def _step(self, optimizer: Any) -> None:
        if self.steps is not None and len(self.reports) >= self.steps:
            return
        params: list[Any] = []
        groups: dict[int, int] = {}  # parameter id -> its parameter group
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                groups.setdefault(id(p), g)
                if p.grad is not None and id(p) not in {id(q) for q in params}:
                    params.append(p)
        self.watch(params)
        if self._backward == 0 or all(self._audited.get(id(p)) == self._backward for p in params):
            return  # no backward since this optimizer's parameters were audited: a wrapper's inner step
        self._stepping = True
        try:
            self._audit(params, groups, len(optimizer.param_groups))
        finally:
            self._stepping = False

    def _audit(self, params: list[Any], groups: dict[int, int], group_count: int) -> None:
        pieces = []
        layout = self._layout(params)
        stage = self._stage(params)
        units = self._unit_pieces(params, layout, stage) if self.agc is not None else ()
        for p, (holders, copies) in zip(params, layout):
            seed = self._seeds[id(p)]
            before = self._before.get(id(p))
            after = capture.sketch(p.grad, seed)
            seen = before is not None
            if before is None:  # no backward left it: nothing to compare with
                before = after._replace(sumsq=0.0)
            scale, uniform = capture.factor(before, after)
            placed = _is_dtensor(p.grad)
            piece = verdict.Piece(
                holders,
                copies,
                before.sumsq,
                before.count,
                scale,
                uniform,
                before.dtype,
                placed,
                seen,
                groups.get(id(p), 0),
            )
            pieces.append(piece)
            self._audited[id(p)] = self._backward
        holds = self._holds(params)
        row = verdict.Row(
            _rank(), stage, pieces, self._seen_max_norm, self._seen_norm, holds, units, group_count
        )
        rows = _gather(row)
        self._seen_max_norm = self._seen_norm = None
        if not any(p.seen for r in rows for p in r.pieces):  # the same on every rank
            if _rank() == 0:
                print(UNSEEN, flush=True)
            return
        if self.max_norms is not None:
            report = audit_limits.grade_groups(len(self.reports), rows, self.max_norms)
        elif self.agc is not None:
            report = audit_limits.grade_agc(len(self.reports), rows, *self.agc)
        elif self.adaptive is None:
            report = verdict.grade_step(len(self.reports), rows, self.max_norm, self.max_norm is not None)
        else:
            limit, more, bounded = self._adaptive_limits(rows)
            source = f"--adaptive {self.adaptive}" + (
                "" if bounded else ": no limit this step, the norm shown"
            )
            report = verdict.grade_step(len(self.reports), rows, limit, True, more, source=source)
        self.reports.append(report)
        if self.report is not None:
            self.report(report)

    def _unit_pieces(self, params: list[Any], layout: list[Any], stage: int | None) -> tuple:
        """This rank's unit pieces for --agc, each copy once (the first holder's): (unit, weight
        squares, gradient squares as backward left them, the factor the optimizer's got)."""
        rank, out = _rank(), []
        for i, (p, (holders, _)) in enumerate(zip(params, layout)):
            before = self._units_before.get(id(p))
            if holders[0] != rank or before is None:
                continue
            after = capture.unit_sketches(p.grad, self._seeds[id(p)])
            first = _first_unit(p)
            for k, (b, a, w_sq) in enumerate(zip(before, after, capture.unit_squares(p))):
                factor, uniform = capture.factor(b, a)
                out.append(((stage, i, first + k), w_sq, b.sumsq, factor if uniform else math.nan))
        return tuple(out)

    def _adaptive_limits(self, rows: list[verdict.Row]) -> tuple[float, dict[str, list[float]], bool]:
        """This step's correct limit (the adaptive rule fed the true global norm) and, per bug of
        the adaptive limits, the norm per rank that gives its scale at that limit; whether the rule
        set a limit at all."""
        if self._thresholds is None:
            self._thresholds = limits.AdaptiveCandidates(self._make_threshold, len(rows))
        owned = [math.fsum(p.sumsq for p in row.pieces if p.holders[0] == row.rank) for row in rows]
        every = [math.fsum(p.sumsq for p in row.pieces) for row in rows]
        want = self._thresholds.step(owned, every)
        bounds, norms = want.pop("global")
        # a bug's limit m at norm n scales by m / n, which the correct limit gives at n * limit / m;
        # where the correct rule sets no limit (inf), the true norm stands in: it leaves the correct
        # clip's scale at 1 and lets a bug that clips anyway be named
        limit = bounds[0] if math.isfinite(bounds[0]) else norms[0]
        more = {
            name: [0.0 if math.isinf(m) else n * limit / m if m > 0 else math.inf for m, n in zip(*got)]
            for name, got in want.items()
        }
        return limit, more, math.isfinite(bounds[0])

    # -- the layout

    def _entry(self, p: Any, has_dtensor: bool, staged: bool) -> Any:
        if _is_dtensor(p.grad):
            return False  # its placements say
        group = self._ddp.get(id(p))
        if group is not None:
            return True if dist.get_world_size(group) == dist.get_world_size() else group
        if self.plain != "auto":
            return self.plain == "replicated"
        return has_dtensor or not staged  # TP's plain tensors, DDP by hand: copies; a stage's own: not

    def _layout(self, params: list[Any]) -> list[tuple[tuple[int, ...], str]]:
        """Per parameter: the ranks holding identical copies of its local gradient, and what
        the copies are ("dp": data-parallel replicas, "tp": tensor-parallel duplicates)."""
        key = tuple(id(p) for p in params)
        if key in self._holders:
            return self._holders[key]
        rank = _rank()
        if not _distributed():
            out = [((rank,), "") for _ in params]
        else:
            import gclip.torch as gclip_torch

            has_dtensor = any(_is_dtensor(p.grad) for p in params)
            staged = bool(self._stages)
            entries = [self._entry(p, has_dtensor, staged) for p in params]
            names = [f"{rank}:{i}" for i in range(len(params))]
            rows = gclip_torch.explain([p.grad for p in params], replicated=entries, names=names)
            holders: dict[int, tuple[int, ...]] = {}
            for found in rows:
                for label in found.name.replace(" = ", " / ").split(" / "):
                    who, _, index = label.partition(":")
                    if int(who) == rank:
                        holders[int(index)] = tuple(found.ranks)
            out = []
            for i, p in enumerate(params):
                members = holders[i]
                out.append((members, self._copies(p, members) if len(members) > 1 else ""))
        self._holders[key] = out
        return out

    def _copies(self, p: Any, members: tuple[int, ...]) -> str:
        if id(p) in self._ddp or not _is_dtensor(p.grad):
            return "dp" if id(p) in self._ddp or self.plain == "replicated" or not self._has_tp() else "tp"
        mesh, placements = p.grad.device_mesh, p.grad.placements
        names = mesh.mesh_dim_names or ()
        replicated = [n for n, q in zip(names or [""] * len(placements), placements) if q.is_replicate()]
        if any("tp" not in n for n in replicated):
            return "dp"
        return "tp"

    def _has_tp(self) -> bool:
        return any(_is_dtensor(p.grad) for p in self._params.values() if p.grad is not None)

    def _holds(self, params: list[Any]) -> str:
        """What this rank's gradients are, in words: '6 DTensor (Shard(dim=0),) on mesh dp=4'."""
        kinds: dict[str, int] = {}
        for p in params:
            g = p.grad
            if _is_dtensor(g):
                mesh = g.device_mesh
                dims = ", ".join(f"{n}={k}" for n, k in zip(mesh.mesh_dim_names or (), mesh.mesh.shape))
                what = f"DTensor {tuple(g.placements)} on mesh ({dims or tuple(mesh.mesh.shape)})"
            elif id(p) in self._ddp:
                what = "DDP"
            else:
                what = "plain"
            kinds[what] = kinds.get(what, 0) + 1
        return "; ".join(f"{n} {what}" for what, n in kinds.items()) + " gradients"

    def _stage(self, params: list[Any]) -> int | None:
        if self._stages:
            return min(self._stages)
        for p in params:
            if _is_dtensor(p.grad):
                mesh = p.grad.device_mesh
                root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
                names = root.mesh_dim_names or ()
                if "pp" in names:
                    coord = root.get_coordinate()
                    return None if coord is None else int(coord[names.index("pp")])
        return None


def _first_unit(p: Any) -> int:
    """The global index of this rank's first unit of ``p`` (rows: dim 0; a vector is unit 0)."""
    if p.dim() <= 1 or not _is_dtensor(p):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return int(offset[0])


def _is_dtensor(t: Any) -> bool:
    return t is not None and hasattr(t, "placements") and hasattr(t, "to_local")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _gather(row: verdict.Row) -> list[verdict.Row]:
    if not _distributed():
        return [row]
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return rows
