"""gclip.torch where a layout could count silently wrong, or where torch is right and gclip
refused (tests/torch_agree_check.py, 4 torchrun CPU processes, gloo), every case in one
torchrun job (tests/torch_batch.py), which the tests share; ``stale`` runs last, as the mesh it
leaves recorded is the one it tests.

The oracle: math.fsum over the squares of every full gradient (``full_tensor()``), each tensor
once; torch's own clip on the same gradients where it is right.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="gclip.torch needs PyTorch (pip install 'gclip[torch]')")

from torch_jobs import Batch

pytestmark = pytest.mark.slow

RANKS = 4
AGREED = "GclipValueError: ranks 0, 1, 2, 3 of 4: "
CASES = {name: ("torch_agree_check", name) for name in ("mismatch", "tp_sp", "inf_meta", "ep", "stale")}


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Batch:
    return Batch(RANKS, CASES, tmp_path_factory.mktemp("agree"))


def test_the_job_of_every_case_ends_cleanly(job):
    job.assert_finished()


def close(got, oracle, rel=1e-12) -> bool:
    return isinstance(got, float) and abs(got - oracle) <= rel * oracle


def same_everywhere(every: list[dict], key: str) -> str:
    (value,) = {r[key] for r in every}
    return value


def test_a_mesh_recorded_from_an_earlier_root_is_refused_and_the_declaration_it_names_is_exact(job):
    every = job.reports("stale")
    oracle = every[0]["oracle"]
    assert all(r["recorded_root"] == ["pp", "dp"] for r in every)  # torch recorded the earlier root
    assert all(close(r["torch"], oracle, 1e-6) for r in every)
    # as torch is called: one agreed error (not the sqrt(2)-too-large sum over "pp" stages)
    refused = same_everywhere(every, "as_torch")
    assert refused.startswith(AGREED) and "replicated='pp'" in refused and "comm=" in refused
    # both declarations the error names give the true norm
    assert all(close(r["declared"], oracle) for r in every)
    by_comm = same_everywhere(every, "comm")
    assert by_comm.startswith(AGREED) and "replicated='rep'" in by_comm  # comm's own names
    assert all(close(r["comm_declared"], oracle) for r in every)
    unknown = same_everywhere(every, "comm_rep_unknown")
    assert "'rep' is not a dimension of the mesh torch records" in unknown and "comm=" in unknown


def test_mismatched_dtensor_lists_are_one_agreed_error(job):
    every = job.reports("mismatch")
    oracle = every[0]["oracle"]
    for key, rank, counts in (
        ("fewer", 2, "15, the others 16"),
        ("no_grad", 1, "15, the others 16"),
        ("placements", 3, "17, the others 17"),
    ):
        line = same_everywhere(every, key)
        assert line.startswith("GclipValueError: the ranks of mesh 0-3 disagree on the DTensors"), line
        assert f"rank {rank} {counts}" in line, line
        assert len(line) < 400
    assert "Replicate()" in same_everywhere(every, "placements")
    assert all(close(r["alike"], oracle) for r in every)


def test_partial_gradients_of_sequence_parallel_are_reduced_and_counted_once(job):
    every = job.reports("tp_sp")
    oracle = every[0]["oracle"]
    for r in every:
        assert "(Partial(sum),)" in r["placements"]
        assert close(r["norm"], oracle, 1e-6)  # the Partial sums reduced in float32, as full_tensor does
        assert close(r["torch"], oracle, 1e-6)
        assert abs(r["clipped"] - r["limit"]) <= 1e-6 * r["limit"]
        assert r["still_partial"] == 4  # the gradients stay Partial, scaled in place
        assert r["all_reduces"] == 2  # one for the Partial group (one mesh, one dtype), the header
        assert r["all_reduces_without_partial"] == 1  # none of its own where there is no Partial


def test_max_norm_inf_returns_the_norm_and_scales_nothing_and_meta_is_one_line(job):
    every = job.reports("inf_meta")
    oracle = every[0]["oracle"]
    for r in every:
        assert close(r["norm"], oracle) and r["norm_tensor_inf"] == r["norm"]
        assert r["unchanged"] and r["torch_unchanged"]
        assert close(r["torch"], oracle, 1e-6)
        assert r["meta"].startswith(AGREED + "parameters[0].grad is on the meta device")


def test_expert_parallel_meshes_in_one_call_count_each_expert_once(job):
    every = job.reports("ep")
    oracle = every[0]["oracle"]
    for r in every:
        assert close(r["norm"], oracle), r["norm"]
        assert "must have the same mesh" in r["torch"], r["torch"]  # torch 2.13: refused
