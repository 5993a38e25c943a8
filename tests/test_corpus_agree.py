"""One grade for one behaviour: on every file of tests/corpus, ``gclip.testing.assert_conforms`` and
``gclip.testing.diagnose`` give the grade and the fingerprint that the command gives.

    timeout 600 mpirun -n 2 python -m pytest --with-mpi -q tests/test_corpus_agree.py

The command's grade and fingerprint are tests/test_corpus.py's TABLE (which that file checks against
``python -m gclip.conformance FILE:clip --ranks 2 --torch``). Here the same torch code runs in this
MPI job: each rank hands its arrays to the file's ``clip(parameters, max_norm, group)`` as
parameters with ``.grad`` (as the command's ``--torch`` ranks do), on a gloo group over these ranks.

- ``assert_conforms`` runs the command's cases (``random=12``, seed 0, the row's family): its
  AssertionError names the grade and the fingerprint;
- ``diagnose`` takes each of those cases as one training step (the gradients before and after the
  clip); over the cases the file's grade is the worst step's (fail, then near miss, then pass) and its
  fingerprint the bug most failing steps name (``epsilon`` for a near miss).

A file whose bug is a hang (skip-collective) is left out: inside one's own job a hang can only be
reported by aborting the job (assert_conforms' watchdog), and diagnose needs a step that ends.
"""

from __future__ import annotations

import collections
import importlib.util
import os
import re
import sys
import tempfile

import numpy as np
import pytest

pytestmark = pytest.mark.mpi

torch = pytest.importorskip("torch")
MPI = pytest.importorskip("mpi4py.MPI")

sys.path.insert(0, os.path.dirname(__file__))
from test_corpus import CORPUS, TABLE  # noqa: E402 - the command's table, checked there

# assert_conforms and diagnose take the plain distributed form: a --layout row is the command's alone
ROWS = [row for row in TABLE if row[3] != "skip-collective" and "--layout" not in row[1]]
RANK = ("pass", "near miss", "fail")


@pytest.fixture(scope="module")
def gloo_group():
    """A gloo group over the MPI ranks for this module, destroyed after it (the other MPI
    test modules start their own torch.distributed world)."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    comm = MPI.COMM_WORLD
    folder = comm.bcast(tempfile.mkdtemp(prefix="gclip-corpus-") if comm.Get_rank() == 0 else None)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(folder, 'store')}",
        rank=comm.Get_rank(),
        world_size=comm.Get_size(),
    )
    yield dist.group.WORLD
    dist.destroy_process_group()


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"corpus_{name[:-3]}", CORPUS / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.clip


def numpy_form(clip, group):
    """``clip(parameters, max_norm, group)`` as ``fn(grads, max_norm, comm)``: the clipped .grads."""

    def fn(grads, max_norm, comm):
        params = []
        for a in grads:
            p = torch.nn.Parameter(torch.zeros(a.shape, dtype=torch.from_numpy(np.asarray(a)).dtype))
            p.grad = torch.from_numpy(np.array(a, copy=True))
            params.append(p)
        clip(params, max_norm, group)
        return [p.grad.detach().numpy() for p in params]

    fn.__qualname__ = getattr(clip, "__module__", "clip")
    return fn


def _family(flags: tuple[str, ...]) -> dict:
    out = {"dtype": None, "nonempty_ranks": False, "positive_max_norm": False}
    if "--dtype" in flags:
        out["dtype"] = flags[flags.index("--dtype") + 1]
    out["nonempty_ranks"] = "--nonempty-ranks" in flags
    out["positive_max_norm"] = "--positive-max-norm" in flags
    return out


def _from_message(text: str) -> tuple[str, str | None]:
    """(grade, fingerprint) as assert_conforms' message gives them."""
    verdict = re.search(r"^verdict: (FAIL|NEAR MISS|PASS)\b(.*)$", text, flags=re.M)
    assert verdict, text[:2000]
    grade = verdict.group(1).lower()
    if grade == "near miss":
        return grade, verdict.group(2).strip(" (").split(",")[0]
    named = re.search(r"^fingerprint: ([a-z0-9-]+)", text, flags=re.M)
    return grade, named.group(1) if named else None


def _diagnosed(fn, comm, family: dict) -> tuple[str, str | None]:
    """The file's grade and fingerprint from diagnose, step by step over the command's cases."""
    from gclip.conformance.distributed import rank_cases
    from gclip.conformance.families import Family
    from gclip.testing import diagnose

    cases, _, _ = rank_cases(
        comm.Get_size(), 12, 0, Family(family["dtype"], family["nonempty_ranks"], family["positive_max_norm"])
    )
    grades, bugs = [], collections.Counter()
    for case in cases:
        before = [np.array(a, copy=True) for a in case.ranks[comm.Get_rank()]]
        after = fn([np.array(a, copy=True) for a in before], case.max_norm, comm)
        d = diagnose(before, after, case.max_norm, comm=comm)
        grades.append(d.grade)
        if d.grade == "fail" and d.bug != "unknown":
            bugs[d.bug] += 1
    grade = max(grades, key=RANK.index)
    if grade == "pass":
        return grade, None
    if grade == "near miss":
        return grade, "epsilon"
    return grade, bugs.most_common(1)[0][0] if bugs else "unknown"


@pytest.mark.parametrize("name,family,grade,bug,benign", ROWS, ids=[f"{t[0]}{''.join(t[1])}" for t in ROWS])
def test_assert_conforms_and_diagnose_give_the_commands_grade_and_fingerprint(
    request, name, family, grade, bug, benign
):
    from gclip.testing import assert_conforms

    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        pytest.skip("the table is the command's on 2 ranks")
    fn = numpy_form(_load(name), request.getfixturevalue("gloo_group"))
    kinds = _family(family)
    with pytest.raises(AssertionError) as raised:  # no file of the corpus is exact
        assert_conforms(fn, comm, random=12, seed=0, timeout=20.0, **kinds)
    assert _from_message(str(raised.value)) == (grade, bug)
    assert _diagnosed(fn, comm, kinds) == (grade, bug)
