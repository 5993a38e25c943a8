"""One rank of the judge's MPI job: ``python -m gclip.conformance.rank JOBDIR``.

The judge writes ``JOBDIR/job.json`` (what to load, how to call it, the first
case to run) and ``JOBDIR/cases.pkl``; every rank appends one JSON line per
event to ``JOBDIR/rank<R>.jsonl``: hello (its pid, so the judge can end it),
loading and ready (before and after loading the file), then per case start,
each collective entered and left (see ``recorder``), the outcome, and done
once every rank has finished the case.

Between cases the ranks meet in a barrier on a communicator of the judge's
own, never the one the function gets: a rank that skipped the function's
collective waits there (it has said so) instead of entering the next case's
collective, where it would pair with the others' stuck one and hide the hang.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
from typing import Any

import numpy as np

__all__ = ["call_numpy", "main", "outcome_event"]

MESSAGE_LIMIT = 200  # characters of an exception kept


class _Sink:
    """Appends events to this rank's file, one line each, unbuffered (the judge tails it)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, event: dict) -> None:
        data = (json.dumps(event) + "\n").encode()
        while data:
            data = data[os.write(self.fd, data) :]


def outcome_event(value: Any, given: list[np.ndarray], was: Any = None) -> dict:
    """The outcome of one call as an event: the arrays, or why the return is no clip
    (``was``: the arrays' shapes and dtypes recorded before the call)."""
    from .outcome import encode, returned_arrays

    arrays, why = returned_arrays(value, given, was)
    if arrays is None:
        return {"kind": "bad", "msg": why}
    return {"kind": "value", "value": encode(arrays)}


def call_numpy(
    fn: Any, arrays: list[np.ndarray], max_norm: float, comm: Any, *extra: Any, attrs: Any = None
) -> dict:
    """Call ``fn(grads, max_norm, comm, *extra)`` on copies; its outcome as an event
    (``attrs``: per array, the attributes it carries, see ``params``)."""
    from .._lab.lines import exception_line
    from .outcome import before
    from .params import with_attributes

    given = [np.array(a, copy=True) for a in arrays]
    if attrs is not None:
        given = [with_attributes(g, a) for g, a in zip(given, attrs)]
    was = before(given)  # before the call: a clip that reshapes its input changes the input too
    try:
        value = fn(given, max_norm, comm, *extra)
    except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are outcomes too
        return {"kind": "raised", "msg": exception_line(exc, limit=MESSAGE_LIMIT)}
    return outcome_event(value, given, was)


def _call_torch(fn: Any, arrays: list[np.ndarray], max_norm: float, group: Any, attrs: Any = None) -> dict:
    """Call ``fn(parameters, max_norm, group)``; the parameters' .grad after it is the outcome
    (``attrs``: per parameter, the attributes set on it, see ``params``)."""
    import torch

    from .._lab.lines import exception_line
    from .outcome import before, changed, encode

    params = []
    for i, a in enumerate(arrays):
        p = torch.nn.Parameter(torch.zeros(a.shape, dtype=torch.from_numpy(a).dtype))
        p.grad = torch.from_numpy(np.array(a, copy=True))
        for key, value in (attrs[i] if attrs is not None else {}).items():
            setattr(p, "param_name" if key == "name" else key, value)  # a tensor's .name is torch's
        params.append(p)
    if attrs is not None and hasattr(group, "named"):  # layout.named_parameters(), as a module's
        group.named = [(a["name"], p) for a, p in zip(attrs, params)]
    was = before([p.grad for p in params])  # shape, dtype and device of each .grad, before the call
    try:
        fn(params, max_norm, group)
    except BaseException as exc:  # noqa: BLE001 - as above
        return {"kind": "raised", "msg": exception_line(exc, limit=MESSAGE_LIMIT)}
    lost = [i for i, p in enumerate(params) if p.grad is None]
    if lost:
        return {"kind": "bad", "msg": f"parameter {lost[0]}'s .grad became None"}
    why = changed([p.grad for p in params], was, "parameter", ".grad ")
    if why is not None:
        return {"kind": "bad", "msg": why}
    return {"kind": "value", "value": encode([p.grad.detach().cpu().numpy() for p in params])}


def _barrier(comm: Any) -> None:
    """The judge's barrier between cases, waiting asleep: MPI's own spins, and ranks spinning
    on an oversubscribed machine starve the one still inside the function (a torch rank's
    gloo threads above all) until the case's timeout."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.0005)


def main(jobdir: str) -> int:
    with open(os.path.join(jobdir, "job.json")) as f:
        job = json.load(f)
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1")))
    early = _Sink(os.path.join(jobdir, f"rank{rank}.jsonl")) if rank >= 0 else None
    if early is not None:
        early({"e": "hello", "pid": os.getpid()})  # before MPI starts: the judge can end us from now
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    sink = early or _Sink(os.path.join(jobdir, f"rank{world.Get_rank()}.jsonl"))
    if early is None:
        sink({"e": "hello", "pid": os.getpid()})
    from .._lab.lines import exception_line
    from . import recorder
    from .target import form_error, load

    private = world.Dup()  # the judge's barrier, apart from whatever the function does
    comm = recorder.recorded(world.Dup())
    rec = recorder.install(recorder.Recorder(sink))
    recorder.record_world()  # before the file is loaded: its COMM_WORLD records too (for good here)
    group = None
    if job["mode"] in ("torch", "torch-layout"):
        import torch.distributed as dist

        store = os.path.join(jobdir, "torch-store")
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=world.Get_rank(), world_size=world.Get_size()
        )
        recorder.record_torch()
        group = dist.group.WORLD
        if job["mode"] == "torch-layout":  # the mesh's groups, made before the file is loaded
            from .params import TorchLayout

            group = TorchLayout(job["layout"], world.Get_rank())
    sink({"e": "loading"})  # the judge names a rank that never says "ready" after this
    try:
        fn, note = load(job["kind"], job["where"], job["func"])
    except LookupError as exc:
        sink({"e": "usage", "msg": str(exc)})
        return 0
    except BaseException as exc:  # noqa: BLE001 - anything the file does while loading
        sink({"e": "usage", "msg": f"cannot load {job['where']}: {exception_line(exc, limit=MESSAGE_LIMIT)}"})
        return 0
    misfit = form_error(fn, job["mode"], f"{job['where']}:{job['func']}")
    if misfit is not None:
        sink({"e": "usage", "msg": misfit})
        return 0
    with open(os.path.join(jobdir, "cases.pkl"), "rb") as f:
        cases = pickle.load(f)
    mesh = None
    if job["mode"] in ("layout", "torch-layout"):
        from ..layout import Mesh

        mesh = Mesh(comm, **job["layout"])
    sink({"e": "ready", "note": note})
    _barrier(private)
    for i in range(job["first"], len(cases)):
        case = cases[i]
        sink({"e": "start", "c": i})
        if mesh is not None:
            from .layout_cases import layout_inputs
            from .params import attributes

            arrays, entries, pieces = layout_inputs(case, mesh)  # collective (Split): outside the record
            attrs = [attributes(p, mesh.shape, mesh.coords) for p in pieces]
            rec.begin(i)
            if group is not None:
                event = _call_torch(fn, arrays, case.max_norm, group, attrs)
            else:
                event = call_numpy(fn, arrays, case.max_norm, comm, mesh, entries, attrs=attrs)
        elif group is not None:
            rec.begin(i)
            event = _call_torch(fn, case.ranks[world.Get_rank()], case.max_norm, group)
        else:
            rec.begin(i)
            event = call_numpy(fn, case.ranks[world.Get_rank()], case.max_norm, comm)
        rec.end()
        sink({"e": "outcome", "c": i, **event})
        _barrier(private)
        sink({"e": "done", "c": i})
    sink({"e": "end"})
    if group is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
