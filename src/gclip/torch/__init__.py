"""gclip for PyTorch: ``torch.nn.utils.clip_grad_norm_`` over every rank of a job.

::

    from gclip.torch import clip_grad_norm_

    total_norm = clip_grad_norm_(model.parameters(), max_norm=1.0)

The signatures and returns of torch's ``clip_grad_norm_``, ``get_total_norm``
and ``clip_grads_with_norm_``, plus gclip's keyword-only extras (``comm``,
``replicated``, ``reproducible``). The norm is gclip's engine: each
rank's partial, ONE all-reduce of a small header, the same scale on every
rank, and any rank's bad input raised as the same error on every rank.

- ``comm``: an mpi4py communicator, a ``torch.distributed`` ProcessGroup
  (gloo; NCCL on GPUs) or a DeviceMesh. ``None``: the default torch.distributed
  group when it is initialised, else MPI's COMM_WORLD (refused when MPI sees one
  rank but the process was launched as one of several).
- DTensor gradients (FSDP2, HSDP, tensor parallel, pipeline stages) are read
  from their placements (``gclip.torch._dtensor``): no declaration. Plain tensors on
  more than one rank need ``replicated=`` (no silent default).
- Partials are computed where each tensor lives (``gclip.torch._partials``):
  float64 accumulation in bounded chunks, one sync per device; only the
  header's few numbers cross to the host; the scale is applied on the device,
  each gradient in its own dtype (``_partials.multiply_by``).
- The norm comes back as a float64 0-d tensor on the first gradient's device:
  its value is the float64 global norm (torch returns the gradients' dtype).

See docs/torch.md.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

try:
    import torch
    import torch.distributed as dist
except ImportError:  # pragma: no cover - torch is an optional extra
    raise ImportError("gclip.torch needs PyTorch: pip install 'gclip[torch]'") from None

from .. import clip, drivers, engine, layout
from ..errors import GclipTypeError, GclipValueError
from . import _compile, _device, _dtensor, _gradients, _partials, _replicas
from ._gradients import FLOAT_DTYPES

__all__ = [
    "AGC",
    "FLOAT_DTYPES",
    "AutoClip",
    "ZClip",
    "check",
    "check_replicas",
    "clip_grad_norm_",
    "clip_grads_with_norm_",
    "clip_groups_",
    "explain",
    "get_total_norm",
]


# ---------------------------------------------------------------------------
# the communicator: mpi4py, or a torch.distributed process group


class _Mpi(drivers.Mpi):
    """An mpi4py communicator: the engine's MPI driver (a communicator of one rank answers its
    own sums, as a torch group of one does: no MPI call in a one-process clip)."""

    def __init__(self, comm: Any) -> None:
        super().__init__(comm)
        if self.size == 1:
            self.all_reduce = lambda data, op: data

    def group(self, entry: Any, index: int) -> layout.Group:
        """A replicated= communicator as the ranks of comm it holds."""
        return layout.Group(layout._members(entry, self.comm, index), entry.Get_rank())


_T = TypeVar("_T")


class _TorchGroup:
    """A torch.distributed process group: the same program, its header all-reduced by torch."""

    def __init__(self, group: Any, mesh: Any = None) -> None:
        self.process_group = group
        self.mesh = mesh  # comm=DeviceMesh: replicated= may name its dimensions
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.ranks = {g: i for i, g in enumerate(_global_ranks(group))}  # global rank -> rank in group
        # NCCL reduces only tensors on the current CUDA device; gloo (or "cpu:gloo,cuda:nccl") on the CPU
        self.nccl = dist.get_backend(group) == "nccl"

    @property
    def device(self) -> torch.device:
        """Where the header is reduced: NCCL's current CUDA device (read at each use), else the CPU."""
        return torch.device("cuda", torch.cuda.current_device()) if self.nccl else torch.device("cpu")

    def run(self, program: Generator[engine.Reduce | engine.Gather, Any, _T]) -> _T:
        return drivers.drive(program, self._all_reduce, self._all_gather)

    def _all_reduce(self, data: np.ndarray, op: engine.NormOp) -> np.ndarray:
        if self.size == 1:
            return data  # a group of one: the sum (or max) over it is this rank's own
        buf = torch.tensor(data, dtype=torch.float64, device=self.device)
        dist.all_reduce(
            buf,
            op=dist.ReduceOp.MAX if op is engine.NormOp.MAX else dist.ReduceOp.SUM,
            group=self.process_group,
        )
        out: np.ndarray = buf.cpu().numpy()
        return out

    def _all_gather(self, item: Any) -> list[Any]:  # the error path: one small picklable item per rank
        if self.size == 1:
            return [item]
        items: list[Any] = [None] * self.size
        dist.all_gather_object(items, item, group=self.process_group)
        return items

    def group(self, entry: Any, index: int) -> layout.Group:
        """A replicated= process group as the ranks of comm it holds (layout's rank translation)."""
        if entry is dist.GroupMember.NON_GROUP_MEMBER:
            raise GclipValueError(f"replicated[{index}]: this rank is not in that process group")
        if not _is_process_group(entry):
            raise GclipTypeError(
                f"replicated[{index}] must be True, False or a torch.distributed ProcessGroup "
                f"(comm is a process group), got {type(entry).__name__}"
            )
        members = _global_ranks(entry)
        if any(g not in self.ranks for g in members):
            raise GclipValueError(f"replicated[{index}]: the process group has ranks outside comm")
        return layout.Group(tuple(self.ranks[g] for g in members), dist.get_rank(entry))


def _global_ranks(group: Any) -> list[int]:
    """The group's members as global ranks, in the order of their rank in the group."""
    return sorted(dist.get_process_group_ranks(group), key=lambda g: dist.get_group_rank(group, g))


def _is_process_group(comm: Any) -> bool:
    return dist.is_available() and isinstance(comm, dist.ProcessGroup)


class _Lone(drivers.Driver):
    """One process, no communicator (a compiled call outside any job): its own sums."""

    rank, size = 0, 1

    def __init__(self) -> None:
        self.all_reduce, self.all_gather = (lambda data, op: data), (lambda item: [item])


_LONE = _Lone()


def _world(comm: Any) -> _Mpi | _TorchGroup | _Lone:
    """What to clip over; a one-line error otherwise (the same on every rank: no collective yet)."""
    if comm is None:
        if dist.is_available() and dist.is_initialized():
            return _default_group()
        if torch.compiler.is_compiling():  # mpi4py cannot be traced: one process, or refused
            if _mpi_world_size() > 1:
                raise GclipValueError(
                    "under torch.compile, gclip.torch clips over torch.distributed, not MPI"
                )
            return _LONE
        return _lone_or_mpi()
    if _is_process_group(comm):
        return _TorchGroup(comm)
    if _dtensor.is_mesh(comm):
        return _TorchGroup(_dtensor.mesh_group(comm), comm)
    if dist.is_available() and comm is dist.GroupMember.NON_GROUP_MEMBER:
        raise GclipValueError("comm: this rank is not in that process group (it got the non-member handle)")
    if hasattr(comm, "Get_rank") and hasattr(comm, "Allreduce"):
        return _Mpi(comm)
    raise GclipTypeError(
        f"comm must be an mpi4py communicator or a torch.distributed ProcessGroup, got {type(comm).__name__}"
    )


_DEFAULT: list[_TorchGroup] = []  # the default group, read once per group object


def _default_group() -> _TorchGroup:
    """comm=None under torch.distributed: the default group, as read the last time it was
    this very object (a group's ranks never change; a new init_process_group is a new one)."""
    world = dist.group.WORLD
    if torch.compiler.is_compiling():
        return _TorchGroup(world)  # traced as before: no module state written in a graph
    if not _DEFAULT or _DEFAULT[0].process_group is not world:
        _DEFAULT[:] = [_TorchGroup(world)]
    return _DEFAULT[0]


_MPI_WORLD: list[_Mpi] = []  # MPI.COMM_WORLD as checked on the first call


def _lone_or_mpi() -> _Mpi:
    """comm=None without torch.distributed: MPI's world, checked once per process (as MPI reads
    its launcher's environment once, at MPI_Init): the check of a lone rank reads five
    environment variables, a quarter of a one-tensor clip's cost were it read on every call."""
    if not _MPI_WORLD:
        _MPI_WORLD.append(_Mpi(_mpi_world()))
    return _MPI_WORLD[0]


@_compile.constant_result
def _mpi_world_size() -> int:
    return int(_mpi_world().Get_size())


def _mpi_world() -> Any:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        drivers.refuse_lone_rank(
            "comm=None: torch.distributed is not initialised and",
            "Call torch.distributed.init_process_group() first, or pass comm=",
        )
    return world


# ---------------------------------------------------------------------------
# one rank's checked call, the norm, the scale


_LISTS = (list, tuple)
_NOT_READ = (torch.Tensor, list, tuple, str, bytes)


def _run(
    items: Any, max_norm: Any, backend: engine.Backend, *, comm: Any, replicated: Any, **settings: Any
) -> torch.Tensor:
    """One call of the engine (``gclip.engine``), run over ``comm``, the gradients scaled in place
    unless ``max_norm`` is ``engine.NO_LIMIT``: the global norm as torch returns it, a 0-d tensor
    on the first gradient's device (in float64). Tensors on an accelerator (and calls under
    torch.compile) take the sync-free path (``_device``)."""
    world = _world(comm)
    if type(items) not in _LISTS and isinstance(items, Iterable) and not isinstance(items, _NOT_READ):
        items = list(items)  # a generator: read once, here (anything else: the checks say what it is)
    _device.check()  # a failure the device path has not raised yet: raised here

    def counting(given: _gradients.Gradients, entries: Any, tensors: Sequence[Any]) -> engine.Counting:
        return _dtensor.counting(world, tensors, entries, given.wheres)  # placements, declarations, groups

    listed = items if isinstance(items, (list, tuple)) else [items]
    if _device.eligible(
        world,
        listed,
        settings.get("norm_type", 2.0),
        bool(settings.get("reproducible", False)),
        bool(settings.get("error_if_nonfinite", False)),
    ):
        return _device.clip(
            world,
            items,
            max_norm,
            backend,
            replicated=replicated,
            counting=counting,
            inplace=bool(settings.get("inplace", False)),
            norm_type=settings.get("norm_type", 2.0),
        )
    host = _on_host_eagerly if torch.compiler.is_compiling() else _on_host
    return host(world, items, max_norm, backend, replicated, counting, settings)


def _on_host(
    world: Any,
    items: Any,
    max_norm: Any,
    backend: engine.Backend,
    replicated: Any,
    counting: Any,
    settings: dict[str, Any],
) -> torch.Tensor:
    """The host path: the engine's checks and program, the sums read on the host."""
    args = engine.check(
        items,
        max_norm,
        backend,
        rank=world.rank,
        size=world.size,
        replicated=replicated,
        counting=counting,
        **settings,
    )
    driver: Any = world
    done = engine.alone(args) if world.size == 1 else None  # one process: no header to agree on
    norm, scale = done if done is not None else driver.run(engine.program(args))
    if max_norm is not engine.NO_LIMIT:
        args.grads.scaled(scale, True)
    device = args.arrays[0].device if args.arrays else _CPU
    if device == _CPU:  # numpy's 0-d array, shared: half torch.full's cost
        return torch.from_numpy(np.array(norm))
    # torch.full: a fill kernel, where torch.tensor would copy from the host and wait for the device
    return torch.full((), norm, dtype=torch.float64, device=device)


_CPU = torch.device("cpu")


# under torch.compile, what the device path does not take (error_if_nonfinite=True, reproducible,
# norm_type='inf') runs eagerly, a graph break: numpy and the host reads cannot be traced
_on_host_eagerly = _compile.eagerly(_on_host)


# ---------------------------------------------------------------------------
# the API (torch's signatures, gclip's keyword-only extras)


def check() -> None:
    """Raise, on every rank together, a failure of the sync-free path not raised yet (on an
    accelerator it is raised at the latest by the next call). See ``gclip.torch._device``."""
    _device.check()


@torch.no_grad()
def get_total_norm(
    tensors: torch.Tensor | Iterable[torch.Tensor],
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    comm: Any = None,
    replicated: Sequence[Any] | None = None,
    reproducible: bool = False,
) -> torch.Tensor:
    """The global norm of the tensors of every rank of ``comm``, as one vector.

    As ``torch.nn.utils.get_total_norm``, over the ranks of ``comm``: each
    rank passes its own tensors (its gradients; None is an error). Returns the
    norm as a float64 0-d tensor on the first tensor's device, the same on every
    rank. ``foreach`` is accepted for torch's signature; the partials are
    computed in bounded float64 chunks either way.

    Args:
        comm: an mpi4py communicator, a torch.distributed ProcessGroup or a DeviceMesh;
            None: the default torch.distributed group if initialised, else MPI COMM_WORLD.
        replicated: what plain tensors hold (DTensors: their placements say), one
            entry per tensor or one for all: False (a shard), True (the same on
            every rank of comm), the communicator / ProcessGroup of the ranks that
            hold identical copies, or mesh dimension names (a copy counts once; see
            ``gclip.torch._dtensor``). Required for plain tensors on more than one rank.
        reproducible: the same bits for any rank count and layout (p in 1, 2, inf).
    """
    return _run(
        tensors,
        engine.NO_LIMIT,
        _gradients.backend(False, None),
        comm=comm,
        replicated=replicated,
        norm_type=norm_type,
        reproducible=reproducible,
        error_if_nonfinite=error_if_nonfinite,
    )


@torch.no_grad()
def clip_grads_with_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    total_norm: torch.Tensor | float,
    foreach: bool | None = None,
) -> None:
    """Scale the parameters' gradients in place by min(1, max_norm / total_norm).

    As ``torch.nn.utils.clip_grads_with_norm_``, with gclip's exact scale (no
    ``+ 1e-6``; an inf or NaN norm leaves the gradients untouched). Local: no
    communication; pass the global norm from :func:`get_total_norm`.
    """
    if _is_inf(max_norm):
        return  # no limit: nothing to scale (as torch's clip with max_norm=inf)
    scale = clip.clip_scale(total_norm, max_norm)
    grads = _gradients.gradients(parameters, None, of_parameters=True, reduce=False).scaled_tensors
    _partials.multiply_by(grads, scale, foreach)


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    comm: Any = None,
    replicated: Sequence[Any] | None = None,
    reproducible: bool = False,
    scaler: Any = None,
) -> torch.Tensor:
    """Clip the gradients of every rank's parameters by their GLOBAL norm, in place.

    As ``torch.nn.utils.clip_grad_norm_``, over the ranks of ``comm``: every
    rank's gradients are scaled by the same min(1, max_norm / global norm).
    ``parameters`` is a tensor or any iterable (a generator is read once);
    parameters without a gradient are skipped; the same parameter given twice
    counts and is scaled once. A non-finite norm leaves the gradients untouched
    (check the returned norm, or pass ``error_if_nonfinite=True``: then
    NonFiniteNormError on every rank).

    Args:
        max_norm: the limit, >= 0 (a number, or a tensor of one value); ``inf``: the norm
            alone, nothing scaled (as torch, the usual way to log the norm).
        norm_type: p > 0, or inf / 'inf'.
        foreach: False scales tensor by tensor; None or True with torch's foreach kernels.
        comm, replicated, reproducible: as in :func:`get_total_norm` (one
            replicated entry per parameter given).
        scaler: the ``torch.amp.GradScaler`` whose ``unscale_(optimizer)`` came just before:
            every rank's ``found_inf`` rides in the norm's header (no collective of its own) and
            comes back agreed, so ``scaler.step`` skips, and ``scaler.update`` backs off, on
            every rank together (see docs/torch.md, "AMP").

    Returns:
        The global norm before clipping: a float64 0-d tensor (a plain tensor, also for
        DTensor gradients) on the first gradient's device, the same value on every rank.
    """
    limit = engine.NO_LIMIT if _is_inf(max_norm) else max_norm
    found = _found_infs(scaler)
    if found:
        probe = torch.stack([f.to(found[0].device, torch.float64).reshape(()) for f in found]).sum()
        probe = torch.where(probe > 0, math.inf, 0.0).reshape(1)  # no host read
        backend = _gradients.probed_backend(foreach, probe)
    else:
        backend = _gradients.backend(True, foreach)
    settings = {
        "norm_type": norm_type,
        "error_if_nonfinite": error_if_nonfinite,
        "reproducible": reproducible,
    }
    norm = _run(parameters, limit, backend, comm=comm, replicated=replicated, inplace=True, **settings)
    for f in found:  # the agreed verdict: a non-finite global norm is found_inf on every rank
        f.copy_(torch.where(torch.isfinite(norm).to(f.device), f, torch.ones_like(f)))
    return norm


def _is_inf(max_norm: Any) -> bool:
    """max_norm = +inf (a number or a one-value tensor): the norm alone, as torch allows."""
    try:
        return isinstance(max_norm, (int, float, torch.Tensor)) and float(max_norm) == math.inf
    except (TypeError, ValueError, RuntimeError):
        return False  # not one number: refused by the checks, on every rank together


def _found_infs(scaler: Any) -> list[torch.Tensor]:
    """The found_inf tensors of the optimizers ``scaler.unscale_`` has unscaled this step.

    GradScaler has no public reader of them: this reads ``_per_optimizer_states`` (each
    optimizer's stage and ``found_inf_per_device``), the state ``scaler.step`` and
    ``scaler.update`` decide from, and writes the agreed verdict back into those tensors."""
    if scaler is None:
        return []
    from torch.amp.grad_scaler import GradScaler, OptState

    if not isinstance(scaler, GradScaler):
        raise GclipTypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    if not scaler.is_enabled():
        return []
    states = scaler._per_optimizer_states.values()
    found = [f for s in states if s["stage"] is OptState.UNSCALED for f in s["found_inf_per_device"].values()]
    if not found:
        raise GclipValueError(
            "scaler=: no optimizer has been unscaled this step: call scaler.unscale_(optimizer) "
            "before the clip, as torch's AMP recipe does"
        )
    return found


# ---------------------------------------------------------------------------
# diagnostics: who counts what, and are copies still copies (gclip.torch._replicas)


@torch.no_grad()
def explain(
    tensors: torch.Tensor | Iterable[torch.Tensor],
    *,
    replicated: Any = None,
    names: Sequence[str] | None = None,
    comm: Any = None,
    norm_type: float | str = 2.0,
) -> list[Any]:
    """Who counts what: one ``gclip.replicas.Row`` per tensor (or shard), the same list on every rank.

    As ``gclip.replicas.explain``, over a torch group or DeviceMesh, read as the clip reads
    the tensors (DTensor placements, ``replicated=`` for plain tensors): each row names the
    tensor, its local shape and dtype, the ranks holding it, the one that counts it and its
    share of the global norm**p. A diagnostic (it gathers every rank's list).
    """
    world = _world(comm)
    collect = lambda: _gradients.gradients(tensors, replicated, of_parameters=False)  # noqa: E731
    return _replicas.explain(world, collect, names, norm_type)


@torch.no_grad()
def check_replicas(
    tensors: torch.Tensor | Iterable[torch.Tensor],
    *,
    replicated: Any = None,
    names: Sequence[str] | None = None,
    comm: Any = None,
) -> None:
    """Check, bit for bit, that the copies of each tensor (parameters, gradients) agree.

    Over a torch group or DeviceMesh; who holds copies is read as the clip reads it. Every
    rank raises the same one-line GclipValueError naming the tensor and the ranks whose copy
    differs (a crc32 per tensor is gathered: a diagnostic, not for every step).
    """
    world = _world(comm)
    collect = lambda: _gradients.gradients(tensors, replicated, of_parameters=False)  # noqa: E731
    _replicas.check_replicas(world, collect, names)


from ._fused import make_clip_step  # noqa: E402 - the clip folded into fused optimizers' step

clip_step = make_clip_step(get_total_norm, clip_grads_with_norm_)


from . import _limits  # noqa: E402 - the limits' torch front ends, handed what they use

_limits.use(_limits.Functions(get_total_norm, clip_grads_with_norm_, _world))
AGC, AutoClip, ZClip, clip_groups_ = _limits.AGC, _limits.AutoClip, _limits.ZClip, _limits.clip_groups_
