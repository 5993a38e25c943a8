"""gclip.testing inside pytest-mpi, on the ranks the suite runs on (1..4).

    mpirun -n 3 python -m pytest --with-mpi -m mpi tests/test_judge_mpi.py

The clips are written here with numpy and mpi4py alone. On one rank a
per-rank clip IS the global clip (the oracle: the same arithmetic), so it
must pass there and fail everywhere else; every rank must get the same
verdict and, when it fails, the same message.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.mpi

MPI = pytest.importorskip("mpi4py.MPI")


def _sumsq(grads) -> float:
    return float(sum(np.sum(np.square(g, dtype=np.float64)) for g in grads))


def in_place(grads, max_norm, comm):
    norm = comm.allreduce(_sumsq(grads), op=MPI.SUM) ** 0.5
    for g in grads:
        g *= min(1.0, max_norm / norm) if norm > 0 else 1.0


def returning_buffer(grads, max_norm, comm):
    total = np.zeros(1)
    comm.Allreduce(np.array([_sumsq(grads)]), total, op=MPI.SUM)
    norm = float(np.sqrt(total[0]))
    return [g * (min(1.0, max_norm / norm) if norm > 0 else 1.0) for g in grads]


def per_rank(grads, max_norm, comm):
    norm = _sumsq(grads) ** 0.5
    return [g * (min(1.0, max_norm / norm) if norm > 0 else 1.0) for g in grads]


def sum_of_norms(grads, max_norm, comm):
    norm = comm.allreduce(_sumsq(grads) ** 0.5, op=MPI.SUM)
    return [g * (min(1.0, max_norm / norm) if norm > 0 else 1.0) for g in grads]


def _outcome(fn) -> str:
    from gclip.testing import assert_conforms

    try:
        assert_conforms(fn, comm=MPI.COMM_WORLD, random=20)
    except AssertionError as exc:
        return str(exc)
    return "passed"


@pytest.mark.parametrize("fn", [in_place, returning_buffer])
def test_correct_clips_conform_on_every_rank(fn):
    outcomes = MPI.COMM_WORLD.allgather(_outcome(fn))
    assert outcomes == ["passed"] * MPI.COMM_WORLD.Get_size()


@pytest.mark.parametrize("fn,bug", [(per_rank, "per-rank"), (sum_of_norms, "sum-of-norms")])
def test_a_buggy_clip_fails_on_every_rank_with_the_same_message(fn, bug):
    comm = MPI.COMM_WORLD
    outcomes = comm.allgather(_outcome(fn))
    if comm.Get_size() == 1:  # one rank: its own norm is the global norm
        assert outcomes == ["passed"]
        return
    assert len(set(outcomes)) == 1, "the ranks disagree"
    message = outcomes[0]
    assert f"fingerprint: {bug}:" in message
    assert "verdict: FAIL" in message and f"on {comm.Get_size()} ranks" in message


def test_diagnose_names_a_per_rank_clip_of_a_training_step():
    from gclip.testing import diagnose

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng([rank, 11])
    grads = [rng.standard_normal(5 + rank), rng.standard_normal((2, 3)).astype(np.float32)]
    before = [g.copy() for g in grads]
    norm = _sumsq(grads) ** 0.5  # the training code's clip: this rank's norm only
    for g in grads:
        g *= min(1.0, 0.5 / norm)
    d = diagnose(before, grads, 0.5, comm=comm)
    assert comm.allgather(str(d)) == [str(d)] * size  # the same report on every rank
    true = comm.allreduce(_sumsq(before)) ** 0.5
    assert d.global_norm == pytest.approx(true, rel=1e-12)
    assert d.scales[rank] == pytest.approx(min(1.0, 0.5 / norm), rel=1e-6)
    if size == 1:
        assert d.bug is None and d.same_scale
    else:
        assert d.bug == "per-rank" and not d.same_scale
        assert "verdict: wrong: per-rank" in str(d)


def test_diagnose_passes_the_global_clip():
    from gclip.testing import diagnose

    comm = MPI.COMM_WORLD
    grads = [np.arange(1.0, 6.0) * (comm.Get_rank() + 1)]
    before = [g.copy() for g in grads]
    in_place(grads, 1.0, comm)
    d = diagnose(before, grads, 1.0, comm=comm)
    assert d.bug is None and d.same_scale and d.clipped and "verdict: correct" in str(d)


def float32_positive_only(grads, max_norm, comm):
    """As Megatron-LM: float32 gradients asserted, and a limit of 0 taken for "clipping off"."""
    if not max_norm > 0:
        raise ValueError("clipping is off")  # every rank alike: no rank waits for another
    norm = comm.allreduce(_sumsq(grads), op=MPI.SUM) ** 0.5
    assert all(g.dtype == np.float32 for g in grads), "gradients must be float32"  # after the collective
    for g in grads:
        g *= min(1.0, max_norm / norm) if norm > 0 else 1.0


def test_a_family_judges_code_that_assumes_it():
    from gclip.testing import assert_conforms

    comm = MPI.COMM_WORLD
    if comm.Get_size() == 1:
        pytest.skip("a one-rank suite warns instead (a per-rank clip would pass)")
    with pytest.raises(AssertionError, match=r"gradients must be float32"):
        assert_conforms(float32_positive_only, comm=comm, random=10)
    with pytest.raises(AssertionError, match=r"clipping is off"):
        assert_conforms(float32_positive_only, comm=comm, random=10, dtype="float32")
    assert_conforms(float32_positive_only, comm=comm, random=10, dtype="float32", positive_max_norm=True)
