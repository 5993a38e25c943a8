"""The demo's --layout on 8 real ranks: mpiexec -n 8 python demo_layouts_8.py (run by test_demo_layout.py).

In one job (the demo's own functions, called as its command calls them):
- the JSON's global_norm is the same for the five 3-D layouts of the issue, and
  bit-identical with --reproducible, and equals the model's norm from its
  definition (an independent fsum over every tensor, whole, once);
- every bug of the gallery (the combine bugs and the layout bugs) is
  visibly wrong on a 3-D layout (but nan-mask, which needs a norm that overflows): its norm
  or scale differs from the correct one on some rank, copies drift apart, or ranks are left waiting;
- the hang bug ends: the ranks that waited say which ranks skipped;
- every report is the one --ranks 8 gives (simulated ranks in one process), key for key, but
  for "simulated" and the hang's note (simulated ranks cannot wait: they say who would); numbers
  to 1e-12 relative (MPI adds the ranks' numbers in its own order: sum-of-norms and mean-of-norms,
  which all-reduce norms with no exact sum, can differ in the last bit).
Rank 0 prints one JSON line of findings; any exception aborts the job.
"""

from __future__ import annotations

import json
import sys
import traceback

from mpi4py import MPI

from gclip import gallery
from gclip.demo.layout import run_layout, run_layout_simulated, to_json
from gclip.demo.options import parse_args

comm = MPI.COMM_WORLD
LAYOUTS = ["pp=1,dp=8,tp=1", "pp=2,dp=2,tp=2", "pp=2,dp=1,tp=4", "pp=1,dp=2,tp=4", "pp=2,dp=4,tp=1"]


SIMULATED_DIFFERS: list[str] = []  # the runs whose --ranks 8 report differs


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, float) and isinstance(b, float):
        return a == b or abs(a - b) <= 1e-12 * max(abs(a), abs(b))
    return a == b


def report(*argv: str) -> dict | None:
    real = run_layout(parse_args(list(argv), comm.Get_size()), comm)
    if real is not None:
        sim = run_layout_simulated(parse_args([*argv, "--ranks", str(comm.Get_size())], None))
        a, b = json.loads(to_json(real)), json.loads(to_json(sim))
        assert a.pop("simulated") is False and b.pop("simulated") is True
        if "skip-collective" in argv:
            assert "ranks 4-7 returned without entering the all-reduce" in b["bug_run"]["note"]
            a["bug_run"].pop("note"), b["bug_run"].pop("note")
        if not _same(a, b):
            SIMULATED_DIFFERS.append(" ".join(argv))
    return real


def shows(r: dict) -> str | None:
    """How the bug run departs from the correct one, or None if it does not."""
    c, b = r["correct"], r["bug_run"]
    if b["note"]:
        return "hang: " + b["note"]
    if b["drifted"]:
        return f"copies drifted: {b['drifted'][0]}"
    if any(n != c["norms"][0] for n in b["norms"]):
        return f"norm {b['norms'][0]!r} vs {c['norms'][0]!r}"
    if any(s != c["scales"][0] for s in b["scales"]):
        return f"scale {b['scales'][0]!r} vs {c['scales'][0]!r}"
    return None


def main() -> None:
    findings: dict = {"plain": {}, "reproducible": {}, "bugs": {}, "json": {}}
    for layout in LAYOUTS:
        for key, extra in (("plain", []), ("reproducible", ["--reproducible"])):
            r = report("--layout", layout, "--json", *extra)
            if r is not None:
                findings[key][layout] = [r["global_norm"].hex(), r["model_norm"]]
                if key == "plain":
                    findings["json"][layout] = to_json(r)
    for bug in gallery.BUGS:
        r = report("--layout", "pp=2,dp=2,tp=2", "--buggy", bug.name)
        if r is not None:
            findings["bugs"][bug.name] = shows(r)
    for bug in gallery.LAYOUT_BUGS:
        r = report("--layout", bug.shows_on, "--buggy", bug.name)
        if r is not None:
            findings["bugs"][bug.name] = shows(r)
    r = report("--layout", "pp=2,dp=2,tp=2", "--model", "incidents", "--seed", "3", "--mystery", "1")
    if r is not None:
        findings["bugs"]["layout mystery"] = shows(r)
    if comm.Get_rank() == 0:
        findings["simulated_differs"] = SIMULATED_DIFFERS
        print(json.dumps(findings), flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: BLE001 - one rank's failure ends the job
        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(1)
