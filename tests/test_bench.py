"""The benchmark: its JSON, its collective count, its memory field, its targets, its errors.

The mpirun runs are tiny (``--quick``) and every one is under a timeout. No
assertion is about speed: timings on a shared machine prove nothing. The
arithmetic (ratios, GB/s, targets, counts, memory) is checked on hand-made
inputs whose answers were worked out by hand, not recomputed from the
bench's own output.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import OneRankComm
from gclip._lab import mpirun
from gclip._lab.cli import UsageError
from gclip.bench import collectives, memory, options, run, sweep, table, targets, timing, workloads
from gclip.bench.machine import blas_info, cpu_info, machine_line, numba_target

TIMEOUT = 120


def _run(*args: str, ranks: int | None = 2, timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    """``mpirun -n R python -m gclip.bench ARGS`` under a timeout (no mpirun when ranks is None)."""
    cmd = [sys.executable, "-m", "gclip.bench", *args]
    if ranks is None:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    try:
        return mpirun.run(ranks, *cmd, timeout=timeout)
    except mpirun.MpirunNotFound:
        pytest.skip("no mpirun on PATH")


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
    assert result["schema"] == run.SCHEMA
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
def test_quick_run_names_its_machine_beside_the_table_and_in_the_json(quick):
    result, proc = quick
    machine = result["machine"]
    assert machine["cpu"]["model"] and machine["cpu"]["cpus"] == os.cpu_count()
    assert machine["numba"]["cpu_name"].startswith(os.environ.get("NUMBA_CPU_NAME", "host"))
    assert machine["blas"] and all(b.get("internal_api") for b in machine["blas"])
    first = proc.stdout.splitlines()[0]
    assert first == machine_line(machine) and first.startswith(f"machine: {machine['cpu']['model']}")


@pytest.mark.slow
def test_quick_run_times_are_sane(quick):
    result, _ = quick
    for r in result["rows"]:
        assert r["reps"] == workloads.QUICK_REPEAT
        assert 0 < r["min_s"] <= r["median_s"] < 60, r
        assert r["gb_per_s"] > 0
        assert 1e-3 < r["vs_floor"] < 1e5
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
def test_memory_field_has_every_case(quick):
    result, _ = quick
    memory_rows = result["memory"]
    got = {(m["dtype"], m["n"], m["mode"]) for m in memory_rows}
    assert got == {
        (d, n, m) for d in ("float64", "float32") for n in (1000, 10000) for m in ("default", "reproducible")
    }
    for m in memory_rows:
        assert m["shard_bytes"] == m["n"] * (4 if m["dtype"] == "float32" else 8)
        assert m["peak_extra_bytes"] >= 0
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
@pytest.mark.skipif(HAS_TORCH, reason="torch is installed: test_torch_part_runs checks its rows")
def test_torch_part_is_skipped_without_torch(quick):
    result, _ = quick
    assert result["torch"] is None
    assert not [r for r in result["rows"] if r["impl"] == "torch"]
    assert "skipped" in result["torch_note"]


@pytest.mark.slow
@pytest.mark.torch
def test_torch_part_runs(quick):
    result, _ = quick
    torch_rows = [r for r in result["rows"] if r["impl"] == "torch"]
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
    need = memory.needed_bytes([2 * 10**9], ["float64", "float32"], 2, torch=True)
    free = memory.mem_available()
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
    assert options.parse_sizes("1e3, 1e4,10000,2_000") == [1000, 10000, 10000, 2000]
    for bad in ("1.5", "0", "-1e3", "x", "nan", "1e12"):
        with pytest.raises(UsageError):
            options.parse_sizes(bad)


def test_parse_dtypes():
    assert options.parse_dtypes("float32, float64") == ["float32", "float64"]
    for bad in ("float16", "", "int32"):
        with pytest.raises(UsageError):
            options.parse_dtypes(bad)


def test_pin_threads_sets_unset_variables_to_one():
    env = options.pin_threads([], {"OPENBLAS_NUM_THREADS": "3"})
    assert env is not None
    assert env["OMP_NUM_THREADS"] == "1" and env["MKL_NUM_THREADS"] == "1"
    assert env["OPENBLAS_NUM_THREADS"] == "3"  # set by the user: kept


def test_pin_threads_override_and_once():
    env = options.pin_threads(["--threads", "2"], {"OMP_NUM_THREADS": "1"})
    assert env is not None and all(env[v] == "2" for v in options.THREAD_VARS)
    assert options.pin_threads(["--threads", "2"], env) is None  # already re-executed
    pinned = {v: "1" for v in options.THREAD_VARS}
    assert options.pin_threads([], pinned) is None  # nothing to change: no re-exec
    assert options.pin_threads(["--threads=4"], pinned)["OMP_NUM_THREADS"] == "4"


def test_counting_comm_counts_and_tells_pickle_from_buffer():
    proxy = collectives.CountingComm(OneRankComm())
    assert proxy.Get_rank() == 0  # forwarded, not counted
    proxy.Allreduce(np.ones(1), np.zeros(1))
    proxy.allgather("x")
    proxy.allgather("y")
    assert proxy.summary() == {"total": 3, "pickle_based": 2, "calls": {"Allreduce": 1, "allgather": 2}}


def test_slowest_rank_medians_takes_max_per_rep_then_median():
    per_rank = [{"a": [1.0, 5.0, 3.0]}, {"a": [2.0, 1.0, 4.0]}]
    got = timing.slowest_rank_medians(per_rank)["a"]
    assert got == {"median_s": 4.0, "min_s": 2.0, "reps": 3}
    cpu = [{"a": [0.5, 1.0, 3.0]}, {"a": [2.0, 0.5, 0.25]}]  # the busiest rank per rep: 2, 1, 3
    got = timing.slowest_rank_medians(per_rank, cpu)["a"]
    assert got == {"median_s": 4.0, "min_s": 2.0, "reps": 3, "cpu_median_s": 2.0}


def test_cpu_ratio_of_reproducible_over_default_by_hand():
    got = {"times": _times(**{"floor": 1e-4, "bare": 1.5e-4, "gclip": 2e-4, "gclip-repro": 3e-4})}
    got["misses"] = 0
    got["times"]["gclip"]["cpu_median_s"] = 1e-4
    got["times"]["gclip-repro"]["cpu_median_s"] = 1.25e-4
    rows = {r["impl"]: r for r in run.case_rows(10**7, "float32", 4, False, got)}
    assert rows["gclip-repro"]["vs_default"] == pytest.approx(1.5)
    assert rows["gclip-repro"]["cpu_vs_default"] == pytest.approx(1.25)
    verdict = {t["name"]: t for t in targets.targets(list(rows.values()), [], {"default_active": _ONE}, 1e-6)}
    repro = verdict["float32 1e7 inactive: reproducible / default"]
    assert repro["value"] == pytest.approx(1.25) and repro["ok"] is True  # CPU time first: 1.25 <= 1.5
    assert "in wall time 1.50" in repro["note"]


_ONE = {"total": 1, "pickle_based": 0}


def test_cpu_ratio_of_gclip_over_the_floor_by_hand():
    got = {
        "times": _times(**{"floor": 1e-3, "bare": 1.2e-3, "gclip": 1.5e-3, "gclip-repro": 3e-3}),
        "misses": 0,
    }
    got["times"]["floor"]["cpu_median_s"] = 0.8e-3
    got["times"]["gclip"]["cpu_median_s"] = 0.9e-3
    rows = {r["impl"]: r for r in run.case_rows(10**7, "float32", 4, False, got)}
    assert rows["gclip"]["cpu_vs_floor"] == pytest.approx(1.125) and "cpu_vs_floor" not in rows["bare"]
    verdict = {t["name"]: t for t in targets.targets(list(rows.values()), [], {"default_active": _ONE}, 1e-6)}
    floor = verdict["float32 1e7 inactive: gclip / floor"]
    assert floor["value"] == pytest.approx(1.5) and floor["ok"] is False  # the verdict stays wall time
    assert floor["note"] == "in CPU time 1.12"


def test_needed_bytes_counts_every_rank_and_torchs_copy():
    assert memory.needed_bytes([10, 1000], ["float64"], 2, torch=False) == 1000 * 8 * 2
    assert memory.needed_bytes([1000], ["float32"], 2, torch=True) == 1000 * (4 + 8) * 2
    assert memory.needed_bytes([1000], ["float32", "float64"], 1, torch=False) == 8000


def test_auto_repeat_is_bounded():
    assert workloads.auto_repeat(1000) == 300
    assert 7 <= workloads.auto_repeat(10**7) < 300
    assert workloads.auto_repeat(10**9) == 7


# ---------------------------------------------------------------------------
# the arithmetic, on hand-made inputs with answers worked out by hand


def _times(**medians: float) -> dict:
    return {impl: {"median_s": t, "min_s": t / 2, "reps": 5} for impl, t in medians.items()}


def test_case_rows_ratios_and_bandwidth_by_hand():
    got = {
        "times": _times(**{"floor": 1e-4, "bare": 1.5e-4, "gclip": 2e-4, "gclip-repro": 3e-4, "torch": 4e-4})
    }
    got["misses"] = 2
    rows = {r["impl"]: r for r in run.case_rows(1000, "float64", 8, True, got)}
    # active: 1000 float64 values read twice and written once = 24000 bytes
    assert [rows[i]["gb_per_s"] for i in ("floor", "bare", "gclip", "gclip-repro", "torch")] == pytest.approx(
        [0.24, 0.16, 0.12, 0.08, 0.06]
    )
    assert [rows[i]["vs_floor"] for i in ("floor", "bare", "gclip", "gclip-repro", "torch")] == pytest.approx(
        [1.0, 1.5, 2.0, 3.0, 4.0]
    )
    assert rows["gclip"]["vs_bare"] == pytest.approx(4 / 3)
    assert rows["gclip-repro"]["vs_default"] == pytest.approx(1.5)
    assert rows["torch"]["gclip_vs_this"] == pytest.approx(0.5)
    assert rows["gclip"]["misses"] == rows["gclip-repro"]["misses"] == 2
    assert "misses" not in rows["floor"] and "vs_bare" not in rows["floor"]
    inactive = {r["impl"]: r for r in run.case_rows(1000, "float32", 4, False, got)}
    assert inactive["floor"]["gb_per_s"] == pytest.approx(0.04)  # 4000 bytes, read once
    assert inactive["gclip"]["misses"] == 0  # an inactive clip cannot miss


def _measured(**changes) -> targets.Measured:
    """A run that meets some targets and misses others; each value chosen by hand."""

    def gclip_row(n, dtype, active, vs_floor, median=1e-5):
        return {
            "n": n,
            "dtype": dtype,
            "active": active,
            "impl": "gclip",
            "vs_floor": vs_floor,
            "median_s": median,
        }

    rows = [
        gclip_row(10**7, "float64", False, 1.2),  # limit 1.10: MISS
        gclip_row(10**7, "float64", True, 1.05),  # ok
        gclip_row(10**7, "float32", False, 1.2),  # limit 1.25: ok
        gclip_row(10**7, "float32", True, 1.3),  # MISS
        gclip_row(10**4, "float64", False, 1.0, median=1e-5),
        {"n": 10**4, "dtype": "float64", "active": False, "impl": "bare", "median_s": 8e-6},
        {"n": 10**7, "dtype": "float64", "active": True, "impl": "torch", "gclip_vs_this": 0.8},
        {"n": 10**4, "dtype": "float32", "active": False, "impl": "torch", "gclip_vs_this": 1.1},  # MISS
    ]
    memory_rows = [
        {"n": 10**6, "dtype": "float64", "mode": "default", "ratio": 0.04},
        {"n": 10**3, "dtype": "float64", "mode": "default", "ratio": 3.0},  # below 1e6: not judged
        {"n": 10**7, "dtype": "float64", "mode": "reproducible", "ratio": 0.06},  # MISS
    ]
    counts = {"default_active": {"total": 1, "pickle_based": 0}}
    base = {"rows": rows, "memory": memory_rows, "collectives": counts, "allreduce_s": 6e-6}
    return targets.Measured(**{**base, **changes})


def test_targets_flag_each_miss_and_only_the_misses():
    got = [(t["name"], t["value"], t["limit"], t["ok"]) for t in targets.evaluate(_measured())]
    assert got == [
        ("float64 1e7 inactive: gclip / floor", 1.2, 1.10, False),
        ("float64 1e7 active: gclip / floor", 1.05, 1.10, True),
        ("float32 1e7 inactive: gclip / floor", 1.2, 1.25, True),
        ("float32 1e7 active: gclip / floor", 1.3, 1.25, False),
        ("gclip / torch, every case", 1.1, 1.0, False),
        ("1e4 float64 step: share of one Allreduce", pytest.approx(0.6), 0.5, True),  # 6 us / 10 us
        ("peak extra memory / shard, default, n >= 1e6", 0.04, 0.05, True),
        ("peak extra memory / shard, reproducible, n >= 1e6", 0.06, 0.05, False),
        ("collectives per default clip", 1, 1, True),
    ]
    notes = {t["name"]: t["note"] for t in targets.evaluate(_measured())}
    assert notes["gclip / torch, every case"] == "worst: float32 1e4 inactive"
    assert notes["1e4 float64 step: share of one Allreduce"].endswith("unchecked: 0.75")  # 6 us / 8 us
    assert notes["peak extra memory / shard, reproducible, n >= 1e6"] == "worst: float64 1e7"


def test_one_pickle_based_collective_misses_the_collectives_target():
    pickled = _measured(collectives={"default_active": {"total": 1, "pickle_based": 1}})
    assert targets.evaluate(pickled)[-1] == {
        "name": "collectives per default clip",
        "value": 1,
        "limit": 1,
        "ok": False,
        "note": "",
    }
    two = _measured(collectives={"default_active": {"total": 2, "pickle_based": 0}})
    assert targets.evaluate(two)[-1]["ok"] is False


def test_targets_not_measured_are_left_out():
    small = _measured(rows=[], memory=[])  # no 1e7 shard, no torch, no memory rows
    assert [t["name"] for t in targets.evaluate(small)] == ["collectives per default clip"]


def test_the_table_prints_a_miss_as_MISS():
    cases = [("float64", 10**7, False, 1e-2, 1.3e-2), ("float64", 10**7, True, 1e-2, 1.05e-2)]
    rows = []
    for dtype, n, active, floor, gclip_s in cases:
        times = _times(**{"floor": floor, "bare": floor, "gclip": gclip_s, "gclip-repro": gclip_s})
        rows += run.case_rows(n, dtype, 8, active, {"times": times, "misses": 0})
    counts = {"default_active": {"total": 1, "pickle_based": 0}}
    result = {
        "rows": rows,
        "memory": [],
        "collectives": counts,
        "targets": targets.targets(rows, [], counts, 1e-6),
        "ranks": 2,
        "threads": 1,
        "timing": "t",
        "caches": "warm",
        "allreduce_s": 1e-6,
        "torch_note": "off",
        "load_average": {"start": 0.0, "end": 0.0},
        "environment": {"env": {}},
    }
    text = table.format_table(result)
    assert "  MISS float64 1e7 inactive: gclip / floor: 1.3 (limit 1.1)" in text.splitlines()
    assert "  ok   float64 1e7 active: gclip / floor: 1.05 (limit 1.1)" in text.splitlines()


class _Recorder:
    """A communicator that logs every call made to it (the oracle the proxy's counts are held to)."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def Get_rank(self):
        self.log.append("Get_rank")
        return 0

    def Allreduce(self, send, recv, op=None):
        self.log.append("Allreduce")
        recv[...] = send

    def bcast(self, obj, root=0):
        self.log.append("bcast")
        return obj

    def Barrier(self):
        self.log.append("Barrier")

    def allgather(self, obj):
        self.log.append("allgather")
        return [obj]


def test_counting_comm_counts_the_real_calls_it_forwards():
    inner = _Recorder()
    proxy = collectives.CountingComm(inner)
    out = np.zeros(2)
    assert proxy.Get_rank() == 0
    proxy.Allreduce(np.array([1.0, 2.0]), out)
    assert proxy.bcast("a") == "a" and proxy.bcast("b") == "b"
    proxy.Barrier()
    assert proxy.allgather(7) == [7]
    assert inner.log == ["Get_rank", "Allreduce", "bcast", "bcast", "Barrier", "allgather"]  # all forwarded
    assert out.tolist() == [1.0, 2.0]
    assert proxy.summary() == {
        "total": 5,  # Get_rank is no communication
        "pickle_based": 3,  # bcast twice, allgather
        "calls": {"Allreduce": 1, "Barrier": 1, "allgather": 1, "bcast": 2},
    }


def test_count_collectives_counts_one_clip_only():
    def fake_clip(x, limit, comm):
        comm.Allreduce(x, np.empty_like(x))
        comm.bcast(limit)

    inner = _Recorder()
    got = collectives.count_collectives(inner, fake_clip, lambda proxy: ((np.ones(3), 1.0), {}))
    assert got == {
        "total": 2,
        "pickle_based": 1,
        "calls": {"Allreduce": 1, "bcast": 1},
        "same_on_all_ranks": True,
    }
    assert inner.log == ["Allreduce", "bcast", "allgather"]  # the gather of counts is not counted


def test_peak_extra_bytes_sees_a_known_allocation():
    n = 10**6
    traced, rss = memory.peak_extra_bytes(lambda: np.ones(n))  # 8 MB, freed at once
    assert 8 * n <= traced < 8 * n + 100_000
    assert rss is None or rss >= 0
    nothing, _ = memory.peak_extra_bytes(lambda: None)
    assert nothing < 10_000


def test_sweep_rows_and_the_oversubscription_note():
    def one_run(ranks, floor_s, gclip_s):
        rows = [
            {"n": 1000, "dtype": "float64", "active": True, "impl": "floor", "median_s": floor_s},
            {
                "n": 1000,
                "dtype": "float64",
                "active": True,
                "impl": "gclip",
                "median_s": gclip_s,
                "vs_floor": 3.0,
            },
        ]
        return {"ranks": ranks, "allreduce_s": 1e-6 * ranks, "rows": rows}

    rows = sweep.sweep_rows([one_run(1, 1e-6, 3e-6), one_run(4, 2e-6, 6e-6)])
    assert [(r["ranks"], r["gclip_s"], r["floor_s"], r["allreduce_s"]) for r in rows] == [
        (1, 3e-6, 1e-6, 1e-6),
        (4, 6e-6, 2e-6, 4e-6),
    ]
    text = sweep.format_sweep({"sweep": rows, "cpus": 2})
    assert "gclip R=1" in text and "gclip R=4" in text
    assert "R=4 oversubscribes the 2 cores" in text
    assert "oversubscribes" not in sweep.format_sweep({"sweep": rows, "cpus": 4})


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9B14
flags\t\t: fpu sse4_2 avx fma f16c avx2 avx512f avx512bw avx512vl avx512_bf16 sha_ni

processor\t: 1
model name\t: another CPU (never read: the first processor's fields)
"""


def test_cpu_info_reads_the_model_and_the_vector_extensions():
    cpu = cpu_info(CPUINFO)
    assert cpu["model"] == "AMD EPYC 9B14"
    assert cpu["family"] == "cpu family 25, model 17"
    assert cpu["vector"] == [
        "sse4_2",
        "avx",
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512_bf16",
    ]


def test_numba_target_names_the_code_generation_and_its_vector_width(monkeypatch):
    pytest.importorskip("numba")
    monkeypatch.setenv("NUMBA_CPU_NAME", "haswell")
    monkeypatch.setenv("NUMBA_CPU_FEATURES", "")
    got = numba_target()
    assert (got["cpu_name"], got["cpu_features"], got["vector_bits"]) == ("haswell", "", 256)
    monkeypatch.setenv("NUMBA_CPU_FEATURES", "+avx2,+fma,-avx512f")
    assert numba_target()["vector_bits"] == 256
    monkeypatch.delenv("NUMBA_CPU_NAME")
    monkeypatch.delenv("NUMBA_CPU_FEATURES")
    assert numba_target()["cpu_name"].startswith("host (")


def test_the_vector_width_used_is_read_from_numbas_own_code():
    pytest.importorskip("numba")
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the probe reads x86 registers")
    got = numba_target()
    assert got["vector_bits_used"] in (128, 256, 512) and got["vector_bits_used"] <= got["vector_bits"]
    machine = {
        "cpu": cpu_info(CPUINFO),
        "numba": {**got, "vector_bits": 512, "vector_bits_used": 256},
        "blas": [],
    }
    assert ", 512-bit vectors allowed, 256-bit used (LLVM's tuning for this CPU);" in machine_line(machine)


def test_machine_line_names_cpu_target_and_blas():
    machine = {
        "cpu": cpu_info(CPUINFO),
        "numba": {"cpu_name": "haswell", "cpu_features": "", "vector_bits": 256, "kernels": True},
        "blas": [{"internal_api": "openblas", "version": "0.3.31", "num_threads": 1, "architecture": "Zen"}],
    }
    line = machine_line(machine)
    assert line.startswith("machine: AMD EPYC 9B14, cpu family 25, model 17 (")
    assert "numba target haswell features=its own, 256-bit vectors" in line
    assert line.endswith("BLAS openblas 0.3.31 core Zen, 1 thread(s)")
    assert machine_line(None) == "machine: not recorded"
    assert sweep.format_sweep({"sweep": [], "cpus": 2, "machine": machine}).splitlines()[0] == line


def test_blas_info_names_the_library_and_its_threads():
    (first, *_) = blas_info()
    assert first["internal_api"] and first["source"]


def test_sweep_runs_each_rank_count_without_gnu_timeout():
    args = SimpleNamespace(sizes=[1000], dtypes=["float64"], repeat=5, threads=2)
    cmd = sweep.sweep_command(args, "out.json")
    assert cmd[:3] == [sys.executable, "-m", "gclip.bench"]
    assert "timeout" not in cmd and "mpirun" not in " ".join(cmd)  # mpirun and its timeout: _lab.mpirun
    assert cmd[cmd.index("--threads") + 1] == "2" and "--no-torch" in cmd


def test_collective_cases_cover_each_path_once():
    names = [c.name for c in workloads.COLLECTIVE_CASES]
    assert names == [
        "default_inactive",
        "default_active",
        "default_float32",
        "reproducible",
        "layout_flag",
        "layout_communicator",
    ]
    inactive = workloads.COLLECTIVE_CASES[0]
    assert inactive.limit_factor > 1  # above the norm: nothing to scale
    assert all(c.limit_factor < 1 for c in workloads.COLLECTIVE_CASES[1:])
