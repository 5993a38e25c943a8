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
