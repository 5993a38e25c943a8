"""Adaptive clipping for PyTorch: ZClip, AutoClip and AGC over gclip.torch's global norm.

Called as the reference implementations are: ``norm = clipper.step(model)`` (a module or
an iterable of parameters) after ``backward`` and before ``optimizer.step()``. ZClip and
AutoClip read the global norm from :func:`gclip.torch.get_total_norm` (one all-reduce;
DTensor placements say the layout, ``replicated=`` declares plain copies), keep their
state as float64 0-d tensors on the norm's device and decide with ``torch.where``, so the
rule itself reads nothing on the host; the scale is gclip.torch's. Their state is the
same on every rank (it is fed by the agreed norm only) and goes through ``state_dict()``.
AGC sums each unit's squares where the unit lies and reduces the units that a sharding
splits (a row-parallel Linear's rows, FSDP2's 1-D shards) in one all-reduce per mesh
dimension that splits them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .. import engine
from ..errors import GclipError, GclipValueError
from ..limits.groups import adaptive_name, engine_limit, per_group, program, program_limits
from ..limits.rules import ZClipRule, check_int, check_number
from ..limits.units import LAYOUTS, unit_axes, unit_factor
from . import _dtensor, _gradients

__all__ = ["AGC", "AutoClip", "Functions", "ZClip", "clip_groups_", "use"]


class Functions(NamedTuple):
    """What these front ends use of gclip.torch, which hands it in (:func:`use`) as it is
    imported: gclip.torch is built on the core and names these clippers, so they take its
    functions from it rather than import it (no import circle)."""

    total_norm: Callable[..., torch.Tensor]  # gclip.torch.get_total_norm
    clip_with_norm: Callable[..., None]  # gclip.torch.clip_grads_with_norm_
    world: Callable[[Any], Any]  # the communicator of ``comm=``


_GCLIP: list[Functions] = []


def use(functions: Functions) -> None:
    _GCLIP[:] = [functions]


def _gclip() -> Functions:
    if not _GCLIP:
        raise GclipError("use the clippers as gclip.torch.ZClip, AutoClip, AGC and clip_groups_")
    return _GCLIP[0]


@torch.no_grad()
def clip_groups_(
    groups: Iterable[Any],
    max_norms: Sequence[Any],
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    comm: Any = None,
    replicated: Sequence[Any] | None = None,
    reproducible: bool = False,
) -> torch.Tensor:
    """Clip each parameter group's gradients by its own limit and its own GLOBAL norm, in place.

    ``groups``: an optimizer's ``param_groups`` (dicts with "params") or a list of parameter
    iterables; ``max_norms``: one limit per group, None (not clipped, its norm reported), or a
    ``ZClip`` / ``AutoClip`` (it decides its group's limit from the group's global norm).
    Every group's norm comes from the one header all-reduce (``gclip.groups``).

    Returns:
        Each group's global norm before clipping: a 1-D float64 tensor on the first
        gradient's device, the same on every rank.
    """
    world = _gclip().world(comm)
    params = [list(g["params"]) if isinstance(g, dict) else list(g) for g in groups]
    limits, entries = list(max_norms), per_group(replicated, len(params))
    agreed = [adaptive_name(m) or m for m in limits]  # a clipper: its limit decided after the norm
    if len(limits) != len(params) or len(entries) != len(params):
        raise GclipValueError(f"max_norms and replicated need one entry per group ({len(params)} groups)")
    backend = _gradients.backend(True, foreach)

    def counting(given: _gradients.Gradients, entries: Any, tensors: Sequence[Any]) -> engine.Counting:
        return _dtensor.counting(world, tensors, entries, given.wheres)

    calls = [
        engine.check(
            group,
            engine_limit(limit),
            backend,
            rank=world.rank,
            size=world.size,
            replicated=entries[i],
            counting=counting,
            norm_type=norm_type,
            reproducible=reproducible,
            error_if_nonfinite=error_if_nonfinite,
            inplace=True,
        )
        for i, (group, limit) in enumerate(zip(params, agreed))
    ]
    done = world.run(program(calls, program_limits(calls, agreed)))
    device = next((c.arrays[0].device for c in calls if c.arrays), "cpu")
    norms = torch.tensor([n for n, _ in done], dtype=torch.float64).to(device, non_blocking=True)
    for g, (c, (_, factor)) in enumerate(zip(calls, done)):
        if isinstance(agreed[g], str):  # the group's clipper, fed its global norm
            _clip([p for p in params[g] if p.grad is not None], limits[g].decide(norms[g]), norms[g])
        else:
            c.grads.scaled(factor, True)
    return norms


class _TorchOps:
    where = staticmethod(torch.where)
    sqrt = staticmethod(torch.sqrt)


def _parameters(model_or_parameters: Any) -> list[torch.Tensor]:
    if isinstance(model_or_parameters, torch.nn.Module):
        return list(model_or_parameters.parameters())
    if isinstance(model_or_parameters, torch.Tensor):
        return [model_or_parameters]
    return list(model_or_parameters)


def _norm_of(params: list[torch.Tensor], options: dict[str, Any]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The parameters with a gradient and their global norm, as a plain float64 tensor."""
    with_grad = [p for p in params if p.grad is not None]
    norm = _gclip().total_norm([p.grad for p in with_grad], **options)
    if hasattr(norm, "full_tensor"):  # a Replicate DTensor: every rank holds the global value
        norm = norm.to_local()
    return with_grad, norm.to(torch.float64)


def _clip(params: list[torch.Tensor], limit: Any, norm: torch.Tensor) -> None:
    if isinstance(limit, float) and math.isinf(limit):
        return  # no limit this step
    if isinstance(limit, torch.Tensor):  # inf where no spike and no cap: nothing to scale
        limit = torch.where(torch.isinf(limit), torch.maximum(norm, torch.zeros_like(norm)), limit)
    _gclip().clip_with_norm(params, limit, norm)


def _floats(state: Any) -> Any:
    return state.detach().cpu() if isinstance(state, torch.Tensor) else state


class ZClip:
    """ZClip (arXiv 2504.02507) over the global norm, with the reference implementation's
    arguments, defaults and call order; gclip's exact scale ``min(1, limit / norm)``.

    ``step(model_or_parameters, **options)`` takes :func:`gclip.torch.get_total_norm`'s
    options (``norm_type``, ``comm``, ``replicated``, ``reproducible``) and returns the
    norm before clipping.
    """

    def __init__(
        self,
        alpha: float = 0.97,
        z_thresh: float = 2.5,
        max_grad_norm: float | None = 1.0,
        eps: float = 1e-6,
        warmup_steps: int = 25,
        mode: str = "zscore",
        clip_option: str = "adaptive_scaling",
    ) -> None:
        self.rule = ZClipRule(alpha, z_thresh, max_grad_norm, eps, warmup_steps, mode, clip_option)
        self.last_limit: Any = math.inf  # this step's limit, for logging (a tensor after the warmup)

    @torch.no_grad()
    def step(self, model_or_parameters: Any, **options: Any) -> torch.Tensor:
        params, norm = _norm_of(_parameters(model_or_parameters), options)
        _clip(params, self.decide(norm), norm)
        return norm

    def decide(self, norm: torch.Tensor) -> Any:
        """This step's limit for a global norm computed elsewhere (a float64 0-d tensor; inf:
        none), the state advanced: what ``clip_groups_`` calls for a group it limits."""
        limit, _, seen = self.rule.limit(norm, _TorchOps)
        self.rule.update(seen, torch.isfinite(norm), _TorchOps)
        self.last_limit = limit
        return limit

    def state_dict(self) -> dict[str, Any]:
        state = self.rule.state()
        state["warmup"] = [[_floats(x), _floats(f)] for x, f in state["warmup"]]
        state["mean"], state["var"] = _floats(state["mean"]), _floats(state["var"])
        return state

    def load_state_dict(self, state: dict[str, Any], device: Any = None) -> None:
        def on(x: Any) -> Any:
            return torch.as_tensor(
                x, dtype=torch.float64 if not isinstance(x, bool) else torch.bool, device=device
            )

        self.rule.load(state)
        self.rule.warmup = [(on(x), on(f)) for x, f in self.rule.warmup]
        if self.rule.mean is not None:
            self.rule.mean, self.rule.var = on(self.rule.mean), on(self.rule.var)


class AutoClip:
    """AutoClip (arXiv 2007.14469) over the global norm: the limit is the ``percentile``-th
    percentile (linear interpolation, as numpy's) of every finite global norm seen, this
    step's included, or of the last ``window`` of them. The history is a float64 tensor on
    the norm's device (an inf or NaN norm is kept as NaN and left out: ``nanquantile``)."""

    def __init__(self, percentile: float = 10.0, window: int | None = None) -> None:
        self.percentile = check_number("percentile", percentile, zero=True, high=math.nextafter(100.0, 101.0))
        self.window = None if window is None else check_int("window", window, 1)
        self.history: torch.Tensor | None = None  # grows by doubling; ``seen`` values are live
        self.seen = 0

    @torch.no_grad()
    def step(self, model_or_parameters: Any, **options: Any) -> torch.Tensor:
        params, norm = _norm_of(_parameters(model_or_parameters), options)
        _clip(params, self.decide(norm), norm)
        return norm

    def decide(self, norm: torch.Tensor) -> torch.Tensor:
        """This step's limit for a global norm computed elsewhere (a float64 0-d tensor; inf:
        none), the history grown: what ``clip_groups_`` calls for a group it limits."""
        self._record(torch.where(torch.isfinite(norm), norm, torch.full_like(norm, math.nan)))
        live = self.history[: self.seen] if self.window is None else self._window()  # type: ignore[index]
        limit = torch.nanquantile(live, self.percentile / 100.0, interpolation="linear")
        return torch.where(torch.isnan(limit), torch.full_like(limit, math.inf), limit)

    def _record(self, value: torch.Tensor) -> None:
        size = self.seen if self.window is None else min(self.seen, self.window)
        if self.history is None or size >= self.history.numel():
            grown = torch.empty(max(16, 2 * size), dtype=torch.float64, device=value.device)
            if self.history is not None:
                grown[:size] = self._window() if self.window is not None else self.history[:size]
            self.history = grown
            if self.window is not None:
                self.seen = size
        if self.window is not None and self.seen >= self.window:
            self.history[: self.window - 1] = self.history[self.seen - self.window + 1 : self.seen].clone()
            self.seen = self.window - 1
        self.history[self.seen] = value
        self.seen += 1

    def _window(self) -> torch.Tensor:
        assert self.history is not None
        start = 0 if self.window is None else max(0, self.seen - self.window)
        return self.history[start : self.seen]

    def state_dict(self) -> dict[str, Any]:
        live = self._window() if self.history is not None else torch.empty(0, dtype=torch.float64)
        return {"history": live.detach().cpu().clone(), "percentile": self.percentile, "window": self.window}

    def load_state_dict(self, state: dict[str, Any], device: Any = None) -> None:
        history = torch.as_tensor(state["history"], dtype=torch.float64, device=device).reshape(-1)
        if self.window is not None:
            history = history[-self.window :]
        self.history = torch.empty(max(16, 2 * history.numel()), dtype=torch.float64, device=device)
        self.history[: history.numel()] = history
        self.seen = history.numel()


class AGC:
    """Adaptive gradient clipping, unit-wise (timm's ``unitwise_norm`` units in torch's
    out-first layout): ``AGC(clipping, eps).step(model_or_parameters)``.

    DTensor parameters are read from their placements: a unit split by ``Shard(d)`` on a
    mesh dimension (d >= 1 for a matrix's rows, any d for a vector, which is one unit) has
    its squares summed over that dimension, every such parameter in one all-reduce per
    (mesh, dimension). ``Partial`` gradients are refused (reduce them first). Plain
    tensors are whole on each rank, or split over the ProcessGroup given per parameter in
    ``split=``.
    """

    def __init__(self, clipping: float = 0.01, eps: float = 1e-3, *, layout: str = "out-first") -> None:
        self.clipping = check_number("clipping", clipping)
        self.eps = check_number("eps", eps, zero=True)
        if layout not in LAYOUTS:
            raise GclipValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.layout = layout

    @torch.no_grad()
    def step(self, model_or_parameters: Any, *, split: Iterable[Any] | None = None) -> None:
        params = [p for p in _parameters(model_or_parameters) if p.grad is not None]
        entries = [None] * len(params) if split is None else list(split)
        if len(entries) != len(params):
            raise GclipValueError(f"split needs one entry per parameter with a gradient, got {len(entries)}")
        units = []  # (local grad, p_sq, g_sq)
        groups: dict[Any, tuple[Any, list[int]]] = {}
        for i, (p, where) in enumerate(zip(params, entries)):
            w, g, shape, over = _local(p, i, where, self.layout)
            axes = unit_axes(shape, self.layout)
            p_sq, g_sq = (_unit_sq(x, axes) for x in (w, g))
            for group in over:
                groups.setdefault(group, (group, []))[1].append(i)
            units.append((g, p_sq, g_sq))
        for group, members in groups.values():  # one all-reduce per group that splits units
            flat = torch.cat([t.reshape(-1) for i in members for t in units[i][1:]])
            dist.all_reduce(flat, group=group)
            at = 0
            for i in members:
                for t in units[i][1:]:
                    t.copy_(flat[at : at + t.numel()].reshape(t.shape))
                    at += t.numel()
        for g, p_sq, g_sq in units:
            factor = unit_factor(p_sq, g_sq, self.clipping, self.eps, torch)
            g.copy_(g.to(torch.float64) * factor)  # in float64, rounded once


def _unit_sq(x: torch.Tensor, axes: tuple[int, ...] | None) -> torch.Tensor:
    x64 = x.to(torch.float64)
    if axes is None:  # one unit: the whole tensor
        return (x64 * x64).sum().reshape([1] * x.dim())
    return (x64 * x64).sum(dim=axes, keepdim=True)


def _local(
    p: torch.Tensor, i: int, split: Any, layout: str
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], list[Any]]:
    """(local weight, local grad, the global shape, the process groups over which its units are split)."""
    g = p.grad
    assert g is not None
    if not hasattr(g, "placements"):
        return p.detach(), g, tuple(g.shape), [] if split is None else [split]
    from torch.distributed.tensor import Partial, Shard

    if any(isinstance(pl, Partial) for pl in g.placements):
        raise GclipValueError(f"AGC: parameters[{i}].grad is Partial (not yet reduced); reduce it first")
    if tuple(p.placements) != tuple(g.placements):
        raise GclipValueError(
            f"AGC: parameters[{i}] and its grad are laid out differently ({p.placements} vs {g.placements})"
        )
    axes = unit_axes(tuple(g.shape), layout)
    over = [
        g.device_mesh.get_group(m)
        for m, pl in enumerate(g.placements)
        if isinstance(pl, Shard) and (axes is None or pl.dim in axes) and g.device_mesh.size(m) > 1
    ]
    return p.to_local().detach(), g.to_local(), tuple(g.shape), over
