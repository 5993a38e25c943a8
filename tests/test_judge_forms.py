"""The judge's guards around the call: a function whose signature does not fit the form asked for
is a usage error (exit 2) naming the command that fits, and a clip that changes the shape, dtype or
device of what it was given fails, naming the rank, the array and both shapes, with numpy (in place
or returned) and with ``--torch`` (each parameter's ``.grad``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

FUNCTIONS = """
import numpy as np
from mpi4py import MPI

def _scale(grads, max_norm, comm):
    norm = comm.allreduce(float(sum(np.sum(np.square(g, dtype=np.float64)) for g in grads))) ** 0.5
    return min(1.0, max_norm / norm) if norm > 0 else 1.0

def single(shards, limit):
    return shards

def dist(grads, max_norm, comm):
    s = _scale(grads, max_norm, comm)
    for g in grads:
        g *= s

def layout(grads, max_norm, comm, mesh, replicated):
    return grads

def keyword(grads, max_norm, *, comm):
    return grads

def replaced_flat(grads, max_norm, comm):  # the list's items replaced by flat copies, None returned
    s = _scale(grads, max_norm, comm)
    for i, g in enumerate(grads):
        grads[i] = g.ravel() * s

def reshaped_in_place(grads, max_norm, comm):  # the arrays' own shape set to flat, then scaled
    s = _scale(grads, max_norm, comm)
    for g in grads:
        g.shape = (-1,)
        g *= s

def replaced_wider(grads, max_norm, comm):  # float64 copies in the caller's list
    s = _scale(grads, max_norm, comm)
    for i, g in enumerate(grads):
        grads[i] = g.astype(np.float64) * s
"""

TORCH_FUNCTIONS = """
import torch
import torch.distributed as dist

def _scale(parameters, max_norm):
    total = torch.zeros(1, dtype=torch.float64)
    for p in parameters:
        total += p.grad.double().square().sum()
    dist.all_reduce(total)
    norm = float(total.sqrt())
    return min(1.0, max_norm / norm) if norm > 0 else 1.0

def flat_data(parameters, max_norm, group):
    s = _scale(parameters, max_norm)
    for p in parameters:
        p.grad.data = p.grad.reshape(-1) * s

def wider_data(parameters, max_norm, group):
    s = _scale(parameters, max_norm)
    for p in parameters:
        p.grad.data = p.grad.double() * s
"""


def _run(tmp_path, source: str, func: str, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "funcs.py"
    path.write_text(textwrap.dedent(source))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_"))}
    cmd = [sys.executable, "-m", "gclip.conformance", f"{path}:{func}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)


@pytest.mark.parametrize(
    "func,args,fits",
    [
        ("dist", (), ":dist --ranks 2"),
        ("layout", (), ":layout --layout dp=2"),
        ("single", ("--ranks", "2"), ":single"),
        ("layout", ("--ranks", "2"), ":layout --layout dp=2"),
        ("single", ("--ranks", "2", "--torch"), ":single"),
    ],
)
def test_a_signature_that_does_not_fit_is_a_usage_error_naming_the_command_that_fits(
    tmp_path, func, args, fits
):
    proc = _run(tmp_path, FUNCTIONS, func, "--random", "2", *args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"gclip.conformance: error: {func} takes ")
    assert "run python -m gclip.conformance " in line and line.endswith(f"funcs.py{fits}")
    assert proc.stdout == ""


def test_a_required_keyword_argument_is_a_usage_error(tmp_path):
    proc = _run(tmp_path, FUNCTIONS, "keyword", "--ranks", "2", "--random", "0")
    assert proc.returncode == 2 and "required keyword-only argument" in proc.stderr


def test_the_form_check_reads_defaults_and_star_args():
    from gclip.conformance.target import form_error

    def optional_comm(grads, max_norm, comm=None):
        return grads

    def star(*args):
        return args[0]

    def two(shards, limit):
        return shards

    assert form_error(optional_comm, "single", "f.py:optional_comm") is None  # fits both forms
    assert form_error(optional_comm, "numpy", "f.py:optional_comm") is None
    assert form_error(star, "layout", "f.py:star") is None
    assert form_error(two, "numpy", "f.py:two").endswith("run python -m gclip.conformance f.py:two")
    assert form_error(dict, "numpy", "x:dict") is None  # no signature to read: called and judged
    assert form_error(len, "numpy", "x:len").startswith("len takes 1 positional argument, not the 3")


SHAPES, DTYPES = "holdings: 2-D and 3-D arrays", "dtypes: float32 and float64 on each rank"


def _judge_json(tmp_path, source, func, *args):
    proc = _run(tmp_path, source, func, "--json", "--random", "2", "--timeout", "20", *args)
    out = json.loads(proc.stdout)
    assert proc.returncode == 1 and out["grade"] == "fail", proc.stderr
    return {f["check"]: f["reason"] for f in out["failures"]}


@pytest.mark.parametrize(
    "func,reason",
    [
        ("replaced_flat", "changed array 0's shape from (3, 4) to (12,) in place"),
        ("reshaped_in_place", "changed array 0's shape from (3, 4) to (12,) in place"),
        ("replaced_wider", "changed array 0's dtype from float32 to float64 in place"),
    ],
)
def test_a_numpy_clip_that_changes_its_arrays_fails_naming_rank_array_and_shapes(tmp_path, func, reason):
    reasons = _judge_json(tmp_path, FUNCTIONS, func, "--ranks", "2")
    check = SHAPES if "shape" in reason else DTYPES
    assert reasons[check] == f"ranks 0, 1 returned no clip: {reason}"


@pytest.mark.parametrize(
    "func,reason",
    [
        ("flat_data", "changed parameter 0's .grad shape from (3, 4) to (12,) in place"),
        ("wider_data", "changed parameter 0's .grad dtype from torch.float32 to torch.float64 in place"),
    ],
)
def test_a_torch_clip_that_changes_a_grad_fails_naming_rank_parameter_and_shapes(tmp_path, func, reason):
    pytest.importorskip("torch", reason="--torch needs PyTorch")
    reasons = _judge_json(tmp_path, TORCH_FUNCTIONS, func, "--ranks", "2", "--torch")
    check = SHAPES if "shape" in reason else DTYPES
    assert reasons[check] == f"ranks 0, 1 returned no clip: {reason}"


def test_a_family_keeps_only_its_cases_and_casts_them():
    import numpy as np

    from gclip.conformance.families import Family, choose
    from gclip.conformance.spread import make_rank_cases

    cases = make_rank_cases(2, 30, 0)
    assert choose(cases, Family()) == cases
    kept = choose(cases, Family("float32", nonempty=True, positive=True))
    assert 0 < len(kept) < len(cases)
    for case in kept:
        assert case.max_norm > 0
        assert all(sum(a.size for a in arrays) > 0 for arrays in case.ranks)
        assert all(a.dtype == np.float32 and np.all(np.isfinite(a)) for arrays in case.ranks for a in arrays)
    # the values are the same numbers, rounded to float32
    by_label = {c.label: c for c in cases}
    for case in kept:
        for mine, theirs in zip(case.ranks, by_label[case.label].ranks):
            for a, b in zip(mine, theirs):
                assert np.array_equal(a, b.astype(np.float32))


def test_nan_is_reported_as_nan():
    import numpy as np

    from gclip.conformance.dist_verdict import DistCase, _why
    from gclip.conformance.outcome import CaseRun, RankRun

    given = [[np.array([3.0, 0.0])], [np.array([0.0, 4.0])]]
    expected = [[np.array([1.2, 0.0])], [np.array([0.0, 1.6])]]
    case = DistCase("c", given, 2.0, expected, 5.0, 0.4)
    run = CaseRun([RankRun("value", expected[0]), RankRun("value", [np.array([np.nan, np.nan])])])
    assert _why(case, run) == "NaN on rank 1: rank 1 array 0 has 2 NaN values where a number was expected"


def test_implied_norms_are_named_through_the_epsilon_and_float32():
    import math

    from gclip.conformance.implied import norm_hints

    sumsq, counts = [9.0, 16.0], [2, 2]  # local norms 3 and 4, global 5, mean 3.5
    assert norm_hints(3.5 + 1e-6, sumsq, counts, "rank") == [
        "the mean of the local norms + 1e-6 (torch's epsilon)"
    ]
    off32 = 3.5 * (1 + 1e-6)  # a float32 rounding off the mean
    assert norm_hints(off32, sumsq, counts, "rank") == [
        "the mean of the local norms, off by float32 rounding"
    ]
    assert norm_hints(7.0, sumsq, counts, "rank")[0].startswith("the sum of the local norms")
    assert norm_hints(math.sqrt(25.0) + 1e-6, sumsq, counts, "rank") == [
        "the global norm + 1e-6 (an epsilon added to the norm, as torch does)"
    ]


def test_assert_conforms_refuses_a_function_of_another_form():
    pytest.importorskip("mpi4py")
    from gclip.testing import assert_conforms

    def single(shards, limit):
        return shards

    with pytest.warns(UserWarning), pytest.raises(TypeError, match="takes 2 positional arguments, not the 3"):
        assert_conforms(single)


def test_a_family_the_function_cannot_take_is_counted_apart():
    from types import SimpleNamespace

    import numpy as np

    from gclip.conformance.families import family_lines
    from gclip.conformance.outcome import CaseRun, RankRun

    f32, f64 = np.ones(2, np.float32), np.ones(2)
    cases = [SimpleNamespace(ranks=[[f32], [f32]]), SimpleNamespace(ranks=[[f64], [f64]])]
    cases.append(SimpleNamespace(ranks=[[f64], []]))
    runs = [CaseRun([RankRun("value"), RankRun("value")]), CaseRun([RankRun("raised"), RankRun("raised")])]
    runs.append(CaseRun([RankRun("lost"), RankRun("value")], "rank 0 died during the call"))
    reasons = {1: "ranks 0, 1 raised AssertionError", 2: "rank 0 died during the call"}
    verdict = SimpleNamespace(cases=cases, runs=runs, reasons=reasons, failed=[1, 2])
    assert [line.split() for line in family_lines(verdict)] == [
        ["by", "family", "of", "cases:"],
        ["float32", "1", "of", "1", "pass"],
        ["float64", "raised", "on", "every", "case"],
        ["float64,", "a", "rank", "with", "nothing", "0", "of", "1", "pass,", "1", "did", "not", "finish"],
    ]
    # a family left after its crashes: its cases run and those not run, the other rows as they were
    verdict.not_run = (("float64, a rank with nothing", 7),)
    assert (
        family_lines(verdict)[-1].split()[5:]
        == (
            "crashed on the one case run (a rank raised or died), the other 7 not run "
            "(the other families went on)"
        ).split()
    )
    verdict.reasons, verdict.failed, verdict.not_run = {1: "wrong values on ranks 0, 1"}, [1], ()
    assert family_lines(verdict) == []  # wrong values only: no family to leave out
