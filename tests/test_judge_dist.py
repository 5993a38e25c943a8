"""The distributed judge: ``python -m gclip.conformance FILE.py:FUNC --ranks R``, as a user runs it.

Every function judged here is written in this file with numpy and mpi4py
alone (never gclip): the correct ones must pass, each buggy one must fail
with the gallery bug it is named after, and the ones that hang, raise on one
rank, die or deadlock must be reported naming the ranks, within the time
limit, with nothing left running (``pgrep -f`` on the judge's job folder,
which the test puts in its own temporary directory).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

HEAD = """
import os, signal, time
import numpy as np
from mpi4py import MPI

def _sumsq(grads):
    return float(sum(np.sum(np.square(g, dtype=np.float64)) for g in grads))

def _scale(max_norm, norm, eps=0.0):
    return min(1.0, max_norm / (norm + eps)) if norm + eps > 0 else 1.0
"""

FUNCTIONS = {
    # correct: in place with the pickled allreduce; returning with the buffer Allreduce
    "in_place_pickled": """
def clip(grads, max_norm, comm):
    s = _scale(max_norm, comm.allreduce(_sumsq(grads), op=MPI.SUM) ** 0.5)
    for g in grads:
        g *= s
""",
    "returning_buffer": """
def clip(grads, max_norm, comm):
    total = np.zeros(1)
    comm.Allreduce(np.array([_sumsq(grads)]), total, op=MPI.SUM)
    s = _scale(max_norm, float(np.sqrt(total[0])))
    return tuple(g * s for g in grads)
""",
    "nonblocking": """
def clip(grads, max_norm, comm):
    total = np.zeros(1)
    comm.Iallreduce(np.array([_sumsq(grads)]), total, op=MPI.SUM).Wait()
    s = _scale(max_norm, float(np.sqrt(total[0])))
    return [g * s for g in grads], float(np.sqrt(total[0]))
""",
    # the gallery's bugs, written as a learner would
    "per_rank": """
def clip(grads, max_norm, comm):
    s = _scale(max_norm, _sumsq(grads) ** 0.5)
    return [g * s for g in grads]
""",
    "sum_of_norms": """
def clip(grads, max_norm, comm):
    s = _scale(max_norm, comm.allreduce(_sumsq(grads) ** 0.5, op=MPI.SUM))
    return [g * s for g in grads]
""",
    "rank0_norm": """
def clip(grads, max_norm, comm):
    s = _scale(max_norm, comm.bcast(_sumsq(grads) ** 0.5, root=0))
    return [g * s for g in grads]
""",
    "max_of_norms": """
def clip(grads, max_norm, comm):
    s = _scale(max_norm, max(comm.allgather(_sumsq(grads) ** 0.5)))
    return [g * s for g in grads]
""",
    "rms": """
def clip(grads, max_norm, comm):
    count = comm.allreduce(sum(g.size for g in grads))
    s = _scale(max_norm, (comm.allreduce(_sumsq(grads)) / count) ** 0.5 if count else 0.0)
    return [g * s for g in grads]
""",
    "mean_of_norms": """
def clip(grads, max_norm, comm):
    s = _scale(max_norm, comm.allreduce(_sumsq(grads) ** 0.5) / comm.Get_size())
    return [g * s for g in grads]
""",
    "fp16_sum_of_squares": """
def clip(grads, max_norm, comm):
    local = np.float16(0)
    for g in grads:
        local = np.float16(local + np.sum(np.square(g.astype(np.float16)), dtype=np.float16))
    norm = comm.allreduce(float(local)) ** 0.5
    s = min(1.0, max_norm / norm) if norm > 0 else 1.0  # an overflow (inf) wipes the gradient
    return [g * s for g in grads]
""",
    "float32_sum_of_squares": """
def clip(grads, max_norm, comm):
    local = np.float32(0)
    for g in grads:
        local = np.float32(local + np.sum(np.square(g.astype(np.float32)), dtype=np.float32))
    total = np.zeros(1, dtype=np.float32)
    comm.Allreduce(np.array([local]), total, op=MPI.SUM)
    s = _scale(max_norm, float(np.sqrt(total[0])))  # inf beyond float32's range: the gradient is wiped
    return [g * s for g in grads]
""",
    # unknown to the gallery: each rank's last array left out of its sum of squares
    "drops_last_array": """
def clip(grads, max_norm, comm):
    s = _scale(max_norm, comm.allreduce(_sumsq(grads[:-1])) ** 0.5)
    return [g * s for g in grads]
""",
    "epsilon": """
def clip(grads, max_norm, comm):
    s = _scale(max_norm, comm.allreduce(_sumsq(grads)) ** 0.5, eps=1e-6)
    for g in grads:
        g *= s
""",
    # the right values in another shape: reversed axes (2-D and 3-D arrays), or flattened
    "reshaped": """
def clip(grads, max_norm, comm):
    s = _scale(max_norm, comm.allreduce(_sumsq(grads)) ** 0.5)
    return [(g * s).reshape(g.shape[::-1]) for g in grads]
""",
    "flattened": """
def clip(grads, max_norm, comm):
    s = _scale(max_norm, comm.allreduce(_sumsq(grads)) ** 0.5)
    return [np.ravel(g) * s for g in grads]
""",
    # faults
    "skip": """
def clip(grads, max_norm, comm):
    if not grads:
        return grads
    s = _scale(max_norm, comm.allreduce(_sumsq(grads)) ** 0.5)
    return [g * s for g in grads]
""",
    # the same skip with the collective on COMM_WORLD, not the comm given (as much real code does)
    "skip_on_world": """
def clip(grads, max_norm, comm):
    if not grads:
        return grads
    s = _scale(max_norm, MPI.COMM_WORLD.allreduce(_sumsq(grads)) ** 0.5)
    return [g * s for g in grads]
""",
    "skip_on_imported_world": """
from mpi4py.MPI import COMM_WORLD

def clip(grads, max_norm, comm):
    if not grads:
        return grads
    s = _scale(max_norm, COMM_WORLD.allreduce(_sumsq(grads)) ** 0.5)
    return [g * s for g in grads]
""",
    "correct_on_world": """
def clip(grads, max_norm, comm):
    s = _scale(max_norm, MPI.COMM_WORLD.allreduce(_sumsq(grads)) ** 0.5)
    return [g * s for g in grads]
""",
    "raises_on_rank_1": """
def clip(grads, max_norm, comm):
    if comm.Get_rank() == 1:
        raise ValueError("rank 1 is unhappy")
    s = _scale(max_norm, comm.allreduce(_sumsq(grads)) ** 0.5)
    return [g * s for g in grads]
""",
    "rank_2_killed": """
def clip(grads, max_norm, comm):
    if comm.Get_rank() == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    s = _scale(max_norm, comm.allreduce(_sumsq(grads)) ** 0.5)
    return [g * s for g in grads]
""",
    "deadlock": """
def clip(grads, max_norm, comm):
    if comm.Get_rank() == 0:
        comm.recv(source=1)
    s = _scale(max_norm, comm.allreduce(_sumsq(grads)) ** 0.5)
    return [g * s for g in grads]
""",
    "hangs_once": """
def clip(grads, max_norm, comm):
    total = comm.allreduce(_sumsq(grads))
    if max_norm == 0 and total == 1.0 and comm.Get_rank() == 1:  # only in "contract N=1: zero limit"
        return grads
    comm.Barrier()
    return [g * _scale(max_norm, total ** 0.5) for g in grads]
""",
}

QUICK = ("--random", "12", "--timeout", "20")  # no case of a working function comes near 20 s
HANG = ("--timeout", "3")  # where a case must hang: the time each hang costs


def judge(tmp_path, name: str, *args: str, ranks: int = 3, timeout: int = 240) -> tuple[int, dict]:
    path = tmp_path / f"{name}.py"
    path.write_text(HEAD + textwrap.dedent(FUNCTIONS[name]))
    jobs = tmp_path / "jobs"
    jobs.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_"))}
    env["TMPDIR"] = str(jobs)  # the judge's job folder, so that pgrep can find its ranks
    cmd = [sys.executable, "-m", "gclip.conformance", f"{path}:clip", "--ranks", str(ranks), "--json"]
    proc = subprocess.run([*cmd, *QUICK, *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.stdout.count("\n") == 1, (proc.stdout[-2000:], proc.stderr[-2000:])
    left = subprocess.run(["pgrep", "-f", str(jobs)], capture_output=True, text=True)
    assert left.stdout == "", f"left running: {left.stdout}"
    out = json.loads(proc.stdout)
    assert proc.returncode == (0 if out["passed"] else 1), proc.stderr
    return proc.returncode, out


@pytest.mark.parametrize("name", ["in_place_pickled", "returning_buffer", "nonblocking", "correct_on_world"])
def test_correct_distributed_functions_pass(tmp_path, name):
    code, out = judge(tmp_path, name)
    assert code == 0 and out["passed"] and out["grade"] == "pass"
    assert out["checks"] == 35 + 8 + 3 + 7 + 12 and out["failures"] == []
    assert out["fingerprint"] is None and out["ranks"] == 3


@pytest.mark.parametrize(
    "name,bug",
    [
        ("per_rank", "per-rank"),
        ("sum_of_norms", "sum-of-norms"),
        ("rank0_norm", "rank0-norm"),
        ("max_of_norms", "max-of-norms"),
    ],
)
def test_buggy_distributed_functions_are_named_with_each_ranks_scale(tmp_path, name, bug):
    code, out = judge(tmp_path, name)
    assert code == 1 and out["grade"] == "fail" and out["fingerprint"] == bug
    first = out["failures"][0]
    assert first["check"] == "contract N=1: norm spans two shards"
    assert [r["rank"] for r in first["ranks"]] == [0, 1, 2]
    assert all(r["outcome"] == "returned" for r in first["ranks"])
    assert first["expected_scale"] == pytest.approx(0.4) and first["global_norm"] == pytest.approx(5.0)
    # rank 0 held [3, 0], rank 1 [0, 4], limit 2: each bug's own scale, computed by hand
    scale = {"per-rank": (2 / 3, 0.5), "sum-of-norms": (2 / 7, 2 / 7), "rank0-norm": (2 / 3, 2 / 3)}
    scale["max-of-norms"] = (0.5, 0.5)
    assert first["ranks"][0]["actual"][0][0] == pytest.approx(3 * scale[bug][0])
    assert first["ranks"][1]["actual"][0][1] == pytest.approx(4 * scale[bug][1])


@pytest.mark.parametrize(
    "name,bug", [("rms", "rms"), ("mean_of_norms", "mean-of-norms"), ("fp16_sum_of_squares", "fp16-sumsq")]
)
def test_the_rest_of_the_gallery_is_named(tmp_path, name, bug):
    code, out = judge(tmp_path, name)
    assert code == 1 and out["grade"] == "fail" and out["fingerprint"] == bug


def test_the_epsilon_is_a_named_near_miss_with_its_size(tmp_path):
    code, out = judge(tmp_path, "epsilon")
    assert code == 1 and out["passed"] is False
    assert out["grade"] == "near miss" and out["fingerprint"] == "epsilon"
    size = float(out["near_miss"].split("off by at most ")[1].split()[0])
    assert 1e-9 < size < 1e-4


@pytest.mark.parametrize("name,shape", [("reshaped", "(4, 3)"), ("flattened", "(12,)")])
def test_a_return_in_another_shape_fails_naming_both_shapes(tmp_path, name, shape):
    code, out = judge(tmp_path, name)
    assert code == 1 and out["grade"] == "fail"
    reasons = {f["check"]: f["reason"] for f in out["failures"]}
    assert reasons["holdings: 2-D and 3-D arrays"] == (
        f"ranks 0, 1, 2 returned no clip: returned array 0 of shape {shape} for one of shape (3, 4)"
    )
    assert not any(c.startswith("contract") for c in reasons)  # 1-D arrays keep their shape either way


def test_an_array_left_out_on_each_rank_gets_a_hint(tmp_path):
    code, out = judge(tmp_path, "drops_last_array")
    assert code == 1 and out["fingerprint"] == "unknown"
    (failure,) = [f for f in out["failures"] if f["check"] == "holdings: every rank holds three arrays"]
    # each rank holds arrays of 3, 1 and 5 values: the 5 are left out on every rank
    assert failure["scales"][-1].endswith("is the norm without each rank's last array")


def test_a_float32_sum_of_squares_is_a_near_miss_as_in_one_process(tmp_path):
    code, out = judge(tmp_path, "float32_sum_of_squares", "--random", "40")
    assert code == 1 and out["grade"] == "near miss" and out["fingerprint"] == "unknown"
    size = float(out["near_miss"].split("off by at most ")[1].split()[0])
    assert 1e-9 < size < 1e-6  # float32's rounding, not more
    assert out["near_miss"].endswith("on 1 check with a norm above 1.8e+19 (float32 overflows) by up to 1")
    scales = {f["check"]: f["scales"] for f in out["failures"]}
    assert not any("as expected" in line for lines in scales.values() for line in lines)
    rounding = "(rounding, e.g. float32 arithmetic)"
    assert scales["holdings: only rank 0 holds arrays"][-1].endswith(rounding)  # no local-norm hint
    assert scales["dtypes: float32 and float64 on each rank"][-1].endswith(rounding)
    assert "its sum of squares overflowed" in scales["edge: huge values (squares near 1e200)"][-1]


def test_a_rank_that_skips_the_collective_is_a_hang_naming_the_ranks(tmp_path):
    code, out = judge(tmp_path, "skip", *HANG)
    assert code == 1 and out["fingerprint"] == "skip-collective"
    first = out["failures"][0]
    assert first["reason"] == (
        "rank 2 returned without entering the collective; ranks 0, 1 waited in allreduce (ended after 3 s)"
    )
    assert [r["outcome"] for r in first["ranks"]] == ["did not finish", "did not finish", "returned"]
    assert first["ranks"][0]["collectives"] == ["allreduce"] and first["ranks"][2]["collectives"] == []
    assert out["stopped"].startswith("3 cases hung")


@pytest.mark.parametrize("name", ["skip_on_world", "skip_on_imported_world"])
def test_a_skipped_collective_on_comm_world_is_named_too(tmp_path, name):
    code, out = judge(tmp_path, name, "--random", "0", *HANG)
    assert code == 1 and out["fingerprint"] == "skip-collective"
    assert out["failures"][0]["reason"] == (
        "rank 2 returned without entering the collective; ranks 0, 1 waited in allreduce (ended after 3 s)"
    )
    assert out["failures"][0]["ranks"][0]["collectives"] == ["allreduce"]


@pytest.mark.parametrize(
    "name,reason",
    [
        (
            "raises_on_rank_1",
            "rank 1 raised ValueError: rank 1 is unhappy without entering the collective; ranks 0, 2 waited",
        ),
        (
            "rank_2_killed",
            "rank 2 died during the call (its process ended), without entering the collective; ",
        ),
        ("deadlock", "deadlock: rank 0 waited in recv, ranks 1, 2 waited in allreduce"),
    ],
)
def test_exceptions_deaths_and_deadlocks_name_the_ranks(tmp_path, name, reason):
    code, out = judge(tmp_path, name, "--random", "0", "--nonempty-ranks", *HANG)
    assert code == 1 and all(f["reason"].startswith(reason) for f in out["failures"])
    if name == "deadlock":  # a hang stops the job after 3 cases
        assert out["stopped"] is not None and len(out["failures"]) == 3 and out["not_run"] == {}
        return
    # a rank that raised or died: its family of cases is left after 3, the others go on
    # (--random 0 --nonempty-ranks on 3 ranks: 10 float64 cases, 2 with float32 and float64, 1 float32)
    assert out["stopped"] is None and out["not_run"] == {"float64": 7}
    assert out["checks"] == len(out["failures"]) == 3 + 2 + 1
    (line,) = [line for line in out["families"] if line.split("  ")[0] == "float64"]
    assert line.endswith(
        "crashed on each of the 3 cases run (a rank raised or died), "
        "the other 7 not run (the other families went on)"
    )
    assert any(line.startswith("float32 and float64 ") for line in out["families"])


def test_after_a_hang_the_judge_goes_on_with_a_fresh_job(tmp_path):
    code, out = judge(tmp_path, "hangs_once", "--random", "0", *HANG)
    assert code == 1 and out["stopped"] is None and out["checks"] == 35 + 8 + 3 + 7  # every case ran
    (failure,) = out["failures"]
    assert failure["check"] == "contract N=1: zero limit"
    assert failure["reason"] == (
        "rank 1 returned after 1 collective, without entering the 2nd; ranks 0, 2 waited in Barrier "
        "(ended after 3 s)"
    )


def test_text_verdict_of_a_hang(tmp_path):
    path = tmp_path / "skip.py"
    path.write_text(HEAD + textwrap.dedent(FUNCTIONS["skip"]))
    proc = subprocess.run(
        [sys.executable, "-m", "gclip.conformance", f"{path}:clip", "--ranks", "3", *QUICK, *HANG],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 1
    assert "fingerprint: skip-collective" in proc.stdout
    assert "rank 2: no arrays; returned; entered no collective" in proc.stdout
    assert proc.stdout.count("verdict: FAIL") == 1


def test_text_verdict_of_a_deadlock_points_to_the_reasons_not_to_scales(tmp_path):
    path = tmp_path / "deadlock.py"
    path.write_text(HEAD + textwrap.dedent(FUNCTIONS["deadlock"]))
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_"))}
    env["TMPDIR"] = str(jobs)
    cmd = [sys.executable, "-m", "gclip.conformance", f"{path}:clip", "--ranks", "3", "--random", "0", *HANG]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "fingerprint: unknown (it fails like no bug of the gallery: see the reasons below)" in proc.stdout
    assert "scale" not in proc.stdout  # a hang has no scales to show
    assert "    reason   deadlock: rank 0 waited in recv, ranks 1, 2 waited in allreduce" in proc.stdout
    left = subprocess.run(["pgrep", "-f", str(jobs)], capture_output=True, text=True)
    assert left.stdout == "", f"left running: {left.stdout}"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--ranks", "1"], "--ranks"),
        (["--torch"], "--torch needs --ranks"),
        (["--layout", "pp=2,tp=2", "--ranks", "3"], "is 4 ranks, but --ranks says 3"),
        (["--layout", "pp=2,xx=2"], "unknown axis"),
        (["--layout", "tp=5"], "does not split them evenly"),
        (["--dtype", "float32"], "need --ranks R or --layout L"),
    ],
)
def test_usage_errors_of_the_distributed_judge(tmp_path, args, message):
    path = tmp_path / "f.py"
    path.write_text(HEAD + textwrap.dedent(FUNCTIONS["per_rank"]))
    proc = subprocess.run(
        [sys.executable, "-m", "gclip.conformance", f"{path}:clip", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gclip.conformance: error:") and message in lines[0]


def test_a_missing_function_is_a_usage_error_found_by_the_ranks(tmp_path):
    path = tmp_path / "f.py"
    path.write_text(HEAD)
    proc = subprocess.run(
        [sys.executable, "-m", "gclip.conformance", f"{path}:clip", "--ranks", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "no function 'clip'" in proc.stderr


LOADS = {
    # rank 1 never finishes loading the file; the others do, and wait for it
    "hangs_at_import": """
if MPI.COMM_WORLD.Get_rank() == 1:
    time.sleep(600)

def clip(grads, max_norm, comm):
    return grads
""",
    "raises_at_import": """
if MPI.COMM_WORLD.Get_rank() == 2:
    raise RuntimeError("no config on rank 2")

def clip(grads, max_norm, comm):
    return grads
""",
}


@pytest.mark.parametrize(
    "name,error",
    [
        (
            "hangs_at_import",
            "rank 1 was still loading it (running the file's top level) 10 s after ranks 0, 2",
        ),
        ("raises_at_import", "RuntimeError: no config on rank 2 (on rank 2 only)"),
    ],
)
def test_a_file_that_cannot_load_on_one_rank_names_it(tmp_path, name, error):
    path = tmp_path / f"{name}.py"
    path.write_text(HEAD + textwrap.dedent(LOADS[name]))
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_"))}
    env["TMPDIR"] = str(jobs)
    cmd = [sys.executable, "-m", "gclip.conformance", f"{path}:clip", "--ranks", "3", "--json", *HANG]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert time.monotonic() - started < 60  # the load lag (10 s) and a job's start, not 120 s
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    out = json.loads(proc.stdout)
    assert out["passed"] is False and out["target"] == f"{path}:clip"
    assert out["error"].startswith(f"cannot load {path}") and error in out["error"]
    assert proc.stderr.strip() == f"gclip.conformance: error: {out['error']}"  # one line
    left = subprocess.run(["pgrep", "-f", str(jobs)], capture_output=True, text=True)
    assert left.stdout == "", f"left running: {left.stdout}"


def test_under_mpirun_the_judge_refuses_once(tmp_path):
    from conftest import mpirun

    path = tmp_path / "f.py"
    path.write_text(HEAD + textwrap.dedent(FUNCTIONS["per_rank"]))
    proc = mpirun(2, sys.executable, "-m", "gclip.conformance", f"{path}:clip", "--ranks", "2", timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stdout == ""
    assert proc.stderr.count("launches its own MPI job") == 1
