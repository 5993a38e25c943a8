"""Arrays of one rank scaled differently, and a NaN from an overflowing norm: named by the judge
(``python -m gclip.conformance FILE:clip --ranks R``) and by ``gclip.testing.diagnose``.

The functions judged are written here with numpy and mpi4py alone (never gclip): one clips the
arrays at even and at odd positions apart, each set by the global norm of its own set (two optimizers,
each with its own clip: ``dense-expert-apart``); one casts the total sum of squares to float32, so
that a norm above 1.8e19 is inf, and masks it as DeepSpeed did before PR #7171 (0 x inf = NaN:
``nan-mask``). The oracle is numpy on the case's own values.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

HEAD = """
import numpy as np
from mpi4py import MPI

def _sumsq(grads):
    return float(sum(np.sum(np.square(g, dtype=np.float64)) for g in grads))
"""

APART = """
def clip(grads, max_norm, comm):
    out = list(grads)
    for parity in (0, 1):  # the dense arrays (even positions), then the experts' (odd ones)
        mine = [g for i, g in enumerate(grads) if i % 2 == parity]
        norm = comm.allreduce(_sumsq(mine)) ** 0.5
        scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
        for i, g in enumerate(grads):
            if i % 2 == parity:
                out[i] = g * scale
    return out
"""

NAN_MASK = """
def clip(grads, max_norm, comm):
    total = np.float32(comm.allreduce(_sumsq(grads)))  # the total in float32: inf above 3.4e38
    norm = float(np.sqrt(total))
    bad = float(np.isinf(norm) or np.isnan(norm))
    with np.errstate(invalid="ignore"):
        norm = bad * -1.0 + (1.0 - bad) * norm  # 0 x inf = NaN
    clip = max((norm + 1e-6) / max_norm, 1.0) if not np.isnan(norm) else norm
    with np.errstate(invalid="ignore"):
        return [g * (1.0 / clip) for g in grads]
"""


def judge(tmp_path, code: str, *args: str, ranks: int = 3) -> dict:
    path = tmp_path / "target.py"
    path.write_text(HEAD + textwrap.dedent(code))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_"))}
    cmd = [sys.executable, "-m", "gclip.conformance", f"{path}:clip", "--ranks", str(ranks), "--json"]
    proc = subprocess.run([*cmd, "--random", "12", "--timeout", "20", *args], capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip
    assert proc.returncode == 1, (proc.stdout[-2000:], proc.stderr[-2000:])
    return json.loads(proc.stdout)


def _norm(arrays) -> float:
    return math.sqrt(math.fsum(float(v) ** 2 for a in arrays for v in np.ravel(a)))


def test_arrays_of_one_rank_scaled_apart_are_said_so_and_named(tmp_path):
    out = judge(tmp_path, APART)
    assert out["grade"] == "fail" and out["fingerprint"] == "dense-expert-apart"
    from gclip.conformance.spread import make_rank_cases

    cases = {c.label: c for c in make_rank_cases(3, 12, 0)}
    shown = [f for f in out["failures"] if f["check"] == "holdings: every rank holds three arrays"]
    assert shown, [f["check"] for f in out["failures"]]
    case = cases["holdings: every rank holds three arrays"]
    even = _norm([a for arrays in case.ranks for a in arrays[0::2]])
    odd = _norm([a for arrays in case.ranks for a in arrays[1::2]])
    assert even > case.max_norm and odd > case.max_norm  # both sets clipped: two scales on every rank
    text = "\n".join(shown[0]["scales"])
    for r in range(3):
        said = [line for line in shown[0]["scales"] if line.strip().startswith(f"rank {r}'s arrays")]
        assert len(said) == 1, text
        for which, norm in (("arrays 0, 2", even), ("array 1", odd)):
            got = float(said[0].split(f"{which}: scale ")[1].split(" ")[0])
            assert got == pytest.approx(case.max_norm / norm, rel=1e-5), said[0]


def test_a_nan_from_an_overflowing_norm_is_named_nan_mask(tmp_path):
    out = judge(tmp_path, NAN_MASK, "--positive-max-norm")
    assert out["grade"] == "fail" and out["fingerprint"] == "nan-mask"
    huge = [f for f in out["failures"] if "huge values" in f["check"]]
    assert huge and "NaN" in huge[0]["reason"]


def test_diagnose_names_a_split_with_its_scales_and_an_epsilon_near_miss():
    from mpi4py import MPI

    from gclip.testing import diagnose

    before = [np.array([3.0, 4.0]), np.array([1.0, 2.0]), np.array([0.5])]
    even, odd = _norm(before[0::2]), _norm(before[1::2])
    after = [before[0] / even, before[1] / odd, before[2] / even]
    d = diagnose(before, after, 1.0, comm=MPI.COMM_SELF)
    assert d.grade == "fail" and d.bug == "dense-expert-apart"
    assert [ids for ids, _ in d.split[0]] == [[1], [0, 2]]
    assert [s for _, s in d.split[0]] == pytest.approx([1 / odd, 1 / even], rel=1e-9)
    assert "rank 0's arrays were scaled differently" in str(d)
    tiny = [np.array([3e-9, -4e-9])]  # the epsilon dominates a tiny norm: the command's near miss
    d = diagnose(tiny, [tiny[0] * (1e-9 / (5e-9 + 1e-6))], 1e-9, comm=MPI.COMM_SELF)
    assert (d.grade, d.bug) == ("near miss", "epsilon")
    d = diagnose(tiny, [tiny[0] * (1e-9 / 5e-9)], 1e-9, comm=MPI.COMM_SELF)
    assert (d.grade, d.bug) == ("pass", None)


def test_diagnose_names_the_nan_of_an_overflowing_norm():
    from mpi4py import MPI

    from gclip.testing import diagnose

    before = [np.array([3e20, -4e20])]  # norm 5e20: its square overflows a float32 total
    assert 5e20**2 > float(np.finfo(np.float32).max)
    d = diagnose(before, [np.full(2, np.nan)], 1.0, comm=MPI.COMM_SELF)
    assert d.grade == "fail" and d.bug == "nan-mask" and math.isnan(d.scales[0])
    wiped = diagnose(before, [np.zeros(2)], 1.0, comm=MPI.COMM_SELF)  # a float32 clip: max_norm / inf = 0
    assert wiped.grade == "near miss" and wiped.bug is None and "float32 overflows" in wiped.benign


def test_the_layout_judge_runs_the_new_layout_bugs_on_the_lab_model():
    """--layout's gallery: dense-expert-apart scales the experts and the other tensors by the limit over
    the norm of each set (from the model's definition, each tensor whole, once); expert-tp-shards-dropped
    applies one scale, larger than the correct one (its norm leaves tp-ranks > 0's expert shards out)."""
    from gclip import Mesh
    from gclip._lab import transformer
    from gclip.conformance.layout_cases import layout_inputs, make_layout_cases, parse_layout, simulate

    shape = parse_layout("dp=2,ep=2,tp=2")
    case = make_layout_cases(shape, 0, seed=0)[0]  # float64, the limit half the model's norm
    assert case.dtype == "float64" and not case.frozen
    whole = transformer.model_shapes(True)
    squares = {n: float(np.sum(np.square(transformer.full_tensor(n, s)))) for n, s in whole.items()}
    experts = math.sqrt(math.fsum(v for n, v in squares.items() if ".experts." in n))
    dense = math.sqrt(math.fsum(v for n, v in squares.items() if ".experts." not in n))
    apart, dropped = (
        simulate(case, shape, "dense-expert-apart"),
        simulate(case, shape, "expert-tp-shards-dropped"),
    )
    correct = case.max_norm / math.hypot(experts, dense)
    one = set()
    for r in range(8):
        arrays, _, pieces = layout_inputs(case, Mesh((r, 8), **shape))
        for x, y, z, piece in zip(arrays, apart[r], dropped[r], pieces):
            if not np.any(x):
                continue
            want = min(1.0, case.max_norm / (experts if ".experts." in piece.name else dense))
            assert float(np.max(np.abs(y - want * x))) <= 1e-12 * float(np.max(np.abs(x))), piece.name
            one.add(round(float(np.dot(z.ravel(), x.ravel()) / np.dot(x.ravel(), x.ravel())), 12))
    assert len(one) == 1 and one.pop() > correct * 1.01


def test_diagnose_says_when_float64_values_come_back_rounded_to_float32():
    from mpi4py import MPI

    from gclip.testing import diagnose

    rng = np.random.default_rng(1)
    before = [rng.standard_normal(n) * 10 for n in (5, 7, 3, 9)]
    scale = 1.0 / _norm(before)
    rounded = [(b * scale).astype(np.float32).astype(np.float64) for b in before]  # a float32 clip
    assert any(not np.array_equal(r, b * scale) for r, b in zip(rounded, before))  # it did round
    d = diagnose(before, rounded, 1.0, comm=MPI.COMM_SELF)
    assert d.grade == "fail" and d.narrowed == (0,)
    assert "rank 0: float64 values given, float32 values back" in str(d)
    assert "a clip must apply one scale everywhere" not in str(d)
    exact = diagnose(before, [b * scale for b in before], 1.0, comm=MPI.COMM_SELF)
    assert exact.grade == "pass" and exact.narrowed == ()
    # a split whose two scales are apart by more than float32 rounding: no such note
    split = [before[0] * scale, before[1] * scale / 2, before[2] * scale, before[3] * scale / 2]
    assert "float32" not in str(diagnose(before, split, 1.0, comm=MPI.COMM_SELF))


def test_a_split_line_tells_its_scales_apart_and_names_float32_rounding():
    from gclip.conformance import implied

    close = implied.split_line("rank 0", [([0], 0.4 * (1 + 6e-8)), ([1, 2], 0.4)], 2.0)
    words = close.split(": ", 1)[1].split("; ")
    assert words[0] != words[1].replace("arrays 1, 2", "array 0")  # the two scales print apart
    assert close.endswith("(apart by float32 rounding alone: were the values rounded to float32?)")
    far = implied.split_line("rank 0", [([0], 0.4), ([1], 0.2)], 2.0)
    assert far == (
        "  rank 0's arrays were scaled differently: array 0: scale 0.4 (implies norm 5); "
        "array 1: scale 0.2 (implies norm 10)"
    )
