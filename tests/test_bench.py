"""The benchmark: its JSON, its collective count, its memory field, its errors.

The mpirun runs are tiny (``--quick``) and every one is under ``timeout``.
No assertion is about speed: timings on a shared machine prove nothing.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import OneRankComm
from gclip import bench

TIMEOUT = 120


def _mpirun() -> str:
    exe = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if exe is None:
        pytest.skip("no mpirun on PATH")
    return exe


def _run(*args: str, ranks: int | None = 2, timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    """``timeout T mpirun -n R python -m gclip.bench ARGS`` (no mpirun when ranks is None)."""
    cmd = ["timeout", str(timeout)]
    if ranks is not None:
        cmd += [_mpirun(), "-n", str(ranks)]
    cmd += [sys.executable, "-m", "gclip.bench", *args]
    env = {**os.environ, "MPIEXEC_TIMEOUT": str(timeout)}  # Hydra's own watchdog too
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30, check=False, env=env)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[dict, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    proc = _run("--quick", "--json", str(out))
    _ok(proc)
    return json.loads(out.read_text()), proc


HAS_TORCH = importlib.util.find_spec("torch") is not None


# ---------------------------------------------------------------------------
# one real run, checked for shape and sense


@pytest.mark.slow
def test_quick_run_has_every_case(quick):
    result, proc = quick
    assert result["schema"] == bench.SCHEMA
    assert result["ranks"] == 2
    cases = {(r["dtype"], r["n"], r["active"]) for r in result["rows"]}
    assert cases == {(d, n, a) for d in ("float64", "float32") for n in (1000, 10000) for a in (False, True)}
    for case in cases:
        impls = {r["impl"] for r in result["rows"] if (r["dtype"], r["n"], r["active"]) == case}
        assert {"floor", "bare", "gclip", "gclip-repro"} <= impls
    # the table is printed once, by rank 0
    assert proc.stdout.count("x floor") == 1
    assert "targets:" in proc.stdout


@pytest.mark.slow
def test_quick_run_times_and_ratios_are_sane(quick):
    result, _ = quick
    rows = result["rows"]
    for r in rows:
        assert r["reps"] == 5
        assert 0 < r["min_s"] <= r["median_s"] < 60, r
        assert r["gb_per_s"] > 0
        moved = r["n"] * (4 if r["dtype"] == "float32" else 8) * (3 if r["active"] else 1)
        assert math.isclose(r["gb_per_s"], moved / r["median_s"] / 1e9, rel_tol=1e-9)
    for r in rows:
        same = {
            x["impl"]: x
            for x in rows
            if (x["dtype"], x["n"], x["active"]) == (r["dtype"], r["n"], r["active"])
        }
        assert math.isclose(r["vs_floor"], r["median_s"] / same["floor"]["median_s"], rel_tol=1e-9)
        assert 1e-3 < r["vs_floor"] < 1e5
        if r["impl"] == "gclip-repro":
            assert math.isclose(r["vs_default"], r["median_s"] / same["gclip"]["median_s"], rel_tol=1e-9)
        if r["impl"] == "gclip":
            assert math.isclose(r["vs_bare"], r["median_s"] / same["bare"]["median_s"], rel_tol=1e-9)
    assert result["allreduce_s"] > 0


@pytest.mark.slow
def test_active_reps_really_clip(quick):
    result, _ = quick
    gclip_rows = [r for r in result["rows"] if r["impl"].startswith("gclip")]
    assert gclip_rows
    assert all(r["misses"] == 0 for r in gclip_rows)


@pytest.mark.slow
def test_default_path_is_exactly_one_buffer_collective(quick):
    result, _ = quick
    counts = result["collectives"]
    for path in ("default_inactive", "default_active", "default_float32"):
        assert counts[path]["total"] == 1, counts[path]
        assert counts[path]["pickle_based"] == 0, counts[path]
        assert counts[path]["same_on_all_ranks"]
    assert counts["reproducible"]["pickle_based"] == 0
    assert counts["reproducible"]["total"] >= 1


@pytest.mark.slow
def test_memory_field_is_present_and_consistent(quick):
    result, _ = quick
    memory = result["memory"]
    got = {(m["dtype"], m["n"], m["mode"]) for m in memory}
    assert got == {
        (d, n, m) for d in ("float64", "float32") for n in (1000, 10000) for m in ("default", "reproducible")
    }
    for m in memory:
        assert m["shard_bytes"] == m["n"] * (4 if m["dtype"] == "float32" else 8)
        assert m["peak_extra_bytes"] >= 0
        assert math.isclose(m["ratio"], m["peak_extra_bytes"] / m["shard_bytes"])
        assert m["rss_extra_bytes"] is None or m["rss_extra_bytes"] >= 0


@pytest.mark.slow
def test_targets_carry_a_verdict(quick):
    result, _ = quick
    names = {t["name"] for t in result["targets"]}
    assert "collectives per default clip" in names
    for t in result["targets"]:
        assert isinstance(t["ok"], bool)
        assert math.isfinite(t["value"])


@pytest.mark.slow
def test_torch_part_runs_or_is_skipped(quick):
    result, _ = quick
    torch_rows = [r for r in result["rows"] if r["impl"] == "torch"]
    if not HAS_TORCH:
        assert result["torch"] is None
        assert not torch_rows
        assert "skipped" in result["torch_note"]
        pytest.skip("torch is not installed: only the skip was checked")
    assert result["torch"]
    assert len(torch_rows) == 8  # 2 dtypes x 2 sizes x active/inactive
    for r in torch_rows:
        assert r["median_s"] > 0 and r["gclip_vs_this"] > 0
    assert {r["dtype"] for r in result["rows"] if r["impl"] == "torch-f64acc"} == {"float32"}


# ---------------------------------------------------------------------------
# other outputs and errors


@pytest.mark.slow
def test_json_to_stdout_and_plot(tmp_path):
    args = ["--quick", "--sizes", "1e3", "--dtypes", "float64", "--no-torch", "--json"]
    has_plot = importlib.util.find_spec("matplotlib") is not None
    png = tmp_path / "bench.png"
    if has_plot:
        args += ["--plot", str(png)]
    proc = _run(*args)
    _ok(proc)
    result = json.loads(proc.stdout)  # stdout holds only the JSON
    assert {r["impl"] for r in result["rows"]} == {"floor", "bare", "gclip", "gclip-repro"}
    assert "x floor" in proc.stderr  # the table moved to stderr
    if has_plot:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ["--sizes", "abc"],
        ["--sizes", "0"],
        ["--dtypes", "float16"],
        ["--repeat", "0"],
        ["--bogus"],
        ["--json", "no-such-folder/x.json"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(args):
    proc = _run(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gclip.bench: error:"), proc.stderr
    assert proc.stdout == ""


@pytest.mark.slow
def test_sizes_beyond_memory_are_refused_before_allocating():
    need = bench.needed_bytes([2 * 10**9], ["float64", "float32"], 2, torch=True)
    free = bench._mem_available()
    if free is None or need <= 0.8 * free:
        pytest.skip("no /proc/meminfo, or a machine big enough to really run 2e9 elements per rank")
    proc = _run("--sizes", "2e9")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs about" in lines[0] and "available" in lines[0], proc.stderr


@pytest.mark.slow
def test_ranks_sweep_runs_each_rank_count(tmp_path):
    out = tmp_path / "sweep.json"
    args = ["--ranks-sweep", "--ranks", "1,2", "--quick", "--sizes", "1e3", "--dtypes", "float64"]
    proc = _run(*args, "--timeout", "100", "--json", str(out), ranks=None, timeout=240)
    _ok(proc)
    result = json.loads(out.read_text())
    assert sorted(run["ranks"] for run in result["runs"]) == [1, 2]
    assert {(r["ranks"], r["active"]) for r in result["sweep"]} == {
        (1, False),
        (1, True),
        (2, False),
        (2, True),
    }
    assert all(r["gclip_s"] > 0 and r["floor_s"] > 0 for r in result["sweep"])
    assert "gclip R=1" in proc.stdout and "gclip R=2" in proc.stdout


@pytest.mark.slow
def test_ranks_sweep_refuses_to_run_under_mpirun():
    proc = _run("--ranks-sweep", "--quick")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "gclip.bench: error: --ranks-sweep launches mpirun itself: run it without mpirun"
    ]


# ---------------------------------------------------------------------------
# pure helpers, in process


def test_parse_sizes():
    assert bench.parse_sizes("1e3, 1e4,10000,2_000") == [1000, 10000, 10000, 2000]
    for bad in ("1.5", "0", "-1e3", "x", "nan", "1e12"):
        with pytest.raises(bench.UsageError):
            bench.parse_sizes(bad)


def test_parse_dtypes():
    assert bench.parse_dtypes("float32, float64") == ["float32", "float64"]
    for bad in ("float16", "", "int32"):
        with pytest.raises(bench.UsageError):
            bench.parse_dtypes(bad)


def test_pin_threads_sets_unset_variables_to_one():
    env = bench.pin_threads([], {"OPENBLAS_NUM_THREADS": "3"})
    assert env is not None
    assert env["OMP_NUM_THREADS"] == "1" and env["MKL_NUM_THREADS"] == "1"
    assert env["OPENBLAS_NUM_THREADS"] == "3"  # set by the user: kept


def test_pin_threads_override_and_once():
    env = bench.pin_threads(["--threads", "2"], {"OMP_NUM_THREADS": "1"})
    assert env is not None and all(env[v] == "2" for v in bench.THREAD_VARS)
    assert bench.pin_threads(["--threads", "2"], env) is None  # already re-executed
    pinned = {v: "1" for v in bench.THREAD_VARS}
    assert bench.pin_threads([], pinned) is None  # nothing to change: no re-exec
    assert bench.pin_threads(["--threads=4"], pinned)["OMP_NUM_THREADS"] == "4"


def test_counting_comm_counts_and_tells_pickle_from_buffer():
    proxy = bench.CountingComm(OneRankComm())
    assert proxy.Get_rank() == 0  # forwarded, not counted
    proxy.Allreduce(np.ones(1), np.zeros(1))
    proxy.allgather("x")
    proxy.allgather("y")
    assert proxy.summary() == {"total": 3, "pickle_based": 2, "calls": {"Allreduce": 1, "allgather": 2}}


def test_slowest_rank_medians_takes_max_per_rep_then_median():
    per_rank = [{"a": [1.0, 5.0, 3.0]}, {"a": [2.0, 1.0, 4.0]}]
    got = bench.slowest_rank_medians(per_rank)["a"]
    assert got == {"median_s": 4.0, "min_s": 2.0, "reps": 3}


def test_needed_bytes_counts_every_rank_and_torchs_copy():
    assert bench.needed_bytes([10, 1000], ["float64"], 2, torch=False) == 1000 * 8 * 2
    assert bench.needed_bytes([1000], ["float32"], 2, torch=True) == 1000 * (4 + 8) * 2
    assert bench.needed_bytes([1000], ["float32", "float64"], 1, torch=False) == 8000


def test_auto_repeat_is_bounded():
    assert bench.auto_repeat(1000) == 300
    assert 7 <= bench.auto_repeat(10**7) < 300
    assert bench.auto_repeat(10**9) == 7
