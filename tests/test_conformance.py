"""The judge: `python -m gclip.conformance FILE.py:FUNC`, run as a subprocess.

Each implementation below is written here, independently of gclip, in plain
Python; the judge must pass the correct one, name the bug of each buggy one,
and judge (not crash on) ones that raise, hang, crash or return nonsense.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap

import pytest

import seed_oracle
from gclip import conformance

RANDOM = ("--random", "60")

HELPERS = """
import math

def _norm(shard):
    return math.sqrt(sum(v * v for v in shard))

def _scaled(shards, scale):
    return [[round(v * scale, 12) for v in shard] for shard in shards]

def _scale(limit, norm):
    return min(1.0, limit / norm) if norm else 1.0
"""

IMPLEMENTATIONS = {
    "correct": """
def solve(shards, limit):
    return _scaled(shards, _scale(limit, math.sqrt(sum(v * v for s in shards for v in s))))
""",
    "sum_of_norms": """
def solve(shards, limit):
    return _scaled(shards, _scale(limit, sum(_norm(s) for s in shards)))
""",
    "mean_of_norms": """
def solve(shards, limit):
    norm = sum(_norm(s) for s in shards) / len(shards) if shards else 0.0
    return _scaled(shards, _scale(limit, norm))
""",
    "epsilon": """
def solve(shards, limit):
    norm = math.sqrt(sum(v * v for s in shards for v in s))
    return _scaled(shards, min(1.0, limit / (norm + 1e-6)))
""",
    "garbage": """
import random
_rng = random.Random(7)
def solve(shards, limit):
    return [[round(_rng.uniform(-5, 5), 3) for v in s] for s in shards]
""",
    "unrounded": """
def solve(shards, limit):
    scale = _scale(limit, math.sqrt(sum(v * v for s in shards for v in s)))
    return [[v * scale for v in s] for s in shards]
""",
    "per_rank_unrounded": """
def solve(shards, limit):
    return [[v * _scale(limit, _norm(s)) for v in s] for s in shards]
""",
    "raises": """
def solve(shards, limit):
    raise ValueError("not implemented yet")
""",
    "exits": """
import sys
def solve(shards, limit):
    sys.exit(4)
""",
    "crashes": """
import os
def solve(shards, limit):
    os._exit(9)
""",
    "hangs": """
import time
def solve(shards, limit):
    while True:
        time.sleep(0.05)
""",
    "flat": """
def solve(shards, limit):
    return [v for s in shards for v in s]
""",
    # each shard in another shape (a column of one-element lists): shards are flat lists of numbers
    "columns": """
def solve(shards, limit):
    scale = _scale(limit, math.sqrt(sum(v * v for s in shards for v in s)))
    return [[[v] for v in s] for s in _scaled(shards, scale)]
""",
    "drops_empty": """
def solve(shards, limit):
    out = _scaled(shards, _scale(limit, math.sqrt(sum(v * v for s in shards for v in s))))
    return [s for s in out if s]
""",
    "string": """
def solve(shards, limit):
    return str(shards)
""",
    "noisy": """
def solve(shards, limit):
    print("debug:", shards, limit)
    try:
        input()
    except EOFError:
        pass
    return _scaled(shards, _scale(limit, math.sqrt(sum(v * v for s in shards for v in s))))
""",
}


def write(tmp_path, name: str, body: str, helpers: bool = True) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text((HELPERS if helpers else "") + textwrap.dedent(body))
    return str(path)


def run(*args: str, cwd=None, timeout: int = 120, env=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gclip.conformance", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def judged(spec: str, *args: str, code: int | None = None, **kw) -> dict:
    proc = run(spec, "--json", *RANDOM, *args, **kw)
    assert proc.stdout.count("\n") == 1, (proc.stdout, proc.stderr)
    out = json.loads(proc.stdout)
    assert proc.returncode == (0 if out["passed"] else 1)
    if code is not None:
        assert proc.returncode == code
    return out


def test_a_correct_implementation_passes(tmp_path):
    out = judged(write(tmp_path, "correct", IMPLEMENTATIONS["correct"]) + ":solve", code=0)
    assert out["passed"] is True
    assert out["fingerprint"] is None
    assert out["failures"] == []
    assert out["checks"] >= 35 + 60  # the contract's 7 checks for N = 1..5, and the random layouts


def test_text_verdict_of_a_correct_implementation(tmp_path):
    proc = run(write(tmp_path, "correct", IMPLEMENTATIONS["correct"]) + ":solve", *RANDOM)
    assert proc.returncode == 0, proc.stderr
    assert "verdict: PASS" in proc.stdout
    assert "35 run" in proc.stdout


@pytest.mark.parametrize("which,bug", [("broken", "per-rank"), ("attempt", "rms")])
def test_the_seed_implementations_are_fingerprinted(tmp_path, which, bug):
    path = tmp_path / f"seed_{which}.py"
    path.write_text(seed_oracle.solve_source(which))
    out = judged(f"{path}:solve", code=1)
    assert out["passed"] is False
    assert out["fingerprint"] == bug
    assert out["fingerprint_scores"][bug] == 1.0
    # the judge saw what the original incident report's own run of that code saw, for N = 1..5
    failures = {f["check"]: f for f in out["failures"]}
    for n in range(1, 6):
        for label, actual, expected in seed_oracle.observations(which, n):
            key = f"contract N={n}: {label}"
            if actual == expected:
                assert key not in failures
            else:
                assert failures[key]["actual"] == actual
                assert failures[key]["expected"] == expected


def test_the_seed_file_as_a_whole_can_be_judged(tmp_path, seed_record):
    """The record's script runs its checks and exits when loaded: the judge keeps its solve."""
    path = tmp_path / "broken_script.py"
    path.write_text(seed_record["implementations"]["broken"]["source"])
    proc = run(str(path), "--json", *RANDOM)  # FILE.py alone: the function is `solve`
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    assert out["fingerprint"] == "per-rank"
    assert "sys.exit" in out["note"]


def test_text_verdict_names_the_bug(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text(seed_oracle.solve_source("broken"))
    proc = run(f"{path}:solve", *RANDOM)
    assert proc.returncode == 1
    assert "verdict: FAIL" in proc.stdout
    assert "fingerprint: per-rank" in proc.stdout
    assert "norm spans two shards" in proc.stdout


@pytest.mark.parametrize(
    "name,bug",
    [
        ("sum_of_norms", "sum-of-norms"),
        ("mean_of_norms", "mean-of-norms"),
        ("epsilon", "epsilon"),
        ("per_rank_unrounded", "per-rank"),  # its rounding is wrong too, but its norm is per-rank
    ],
)
def test_independent_buggy_implementations_are_fingerprinted(tmp_path, name, bug):
    out = judged(write(tmp_path, name, IMPLEMENTATIONS[name]) + ":solve", code=1)
    assert out["fingerprint"] == bug
    assert out["failed"] > 0


@pytest.mark.parametrize("name", ["garbage", "unrounded"])
def test_failures_like_no_known_bug_are_unknown(tmp_path, name):
    out = judged(write(tmp_path, name, IMPLEMENTATIONS[name]) + ":solve", code=1)
    assert out["fingerprint"] == "unknown"


def test_unrounded_results_fail_for_the_rounding(tmp_path):
    out = judged(write(tmp_path, "unrounded", IMPLEMENTATIONS["unrounded"]) + ":solve", code=1)
    assert all("12 decimals" in f["reason"] for f in out["failures"])
    # exact but for the rounding: no harsher than a near miss of that size, still exit 1
    assert out["grade"] == "near miss"
    assert re.fullmatch(
        r"off by at most \S+ in the last digits: not rounded to 12 decimals", out["near_miss"]
    ), out["near_miss"]
    size = float(out["near_miss"].split()[4])
    assert 0 < size < 1e-12  # the measured difference of an unrounded exact clip, not the tolerance
    shown = [
        abs(a - b)
        for f in out["failures"]
        for ra, rb in zip(f["actual"], f["expected"])
        for a, b in zip(ra, rb)
    ]
    assert max(shown) <= size  # the failures shown are some of those measured


@pytest.mark.parametrize(
    "name,reason",
    [
        ("raises", "raised ValueError: not implemented yet"),
        ("exits", "raised SystemExit: 4"),
        ("flat", "not a list of numbers"),
        ("columns", "item 0 as list, not a number"),
        ("string", "returned str"),
    ],
)
def test_misbehaving_implementations_are_judged_not_crashed_on(tmp_path, name, reason):
    out = judged(write(tmp_path, name, IMPLEMENTATIONS[name]) + ":solve", code=1)
    assert out["fingerprint"] == "unknown"
    assert out["stopped"] is None
    nonempty = [f for f in out["failures"] if any(f["shards"])]  # some values to return
    assert nonempty and all(reason in f["reason"] for f in nonempty)
    assert all(f["actual"] is None for f in nonempty)


def test_wrong_layout_is_named(tmp_path):
    out = judged(write(tmp_path, "drops_empty", IMPLEMENTATIONS["drops_empty"]) + ":solve", code=1)
    reasons = [f["reason"] for f in out["failures"]]
    assert reasons and all(r.startswith("wrong layout") for r in reasons)
    assert any(f["check"].endswith("zero norm") for f in out["failures"])


@pytest.mark.parametrize(
    "name,reason", [("hangs", "timed out"), ("crashes", "crashed the process (exit status 9)")]
)
def test_hangs_and_crashes_are_judged_within_the_timeout(tmp_path, name, reason):
    out = judged(write(tmp_path, name, IMPLEMENTATIONS[name]) + ":solve", "--timeout", "0.5", timeout=60)
    assert out["passed"] is False
    assert out["fingerprint"] == "unknown"
    assert out["failures"] and all(reason in f["reason"] for f in out["failures"])
    assert out["stopped"] is not None and out["checks"] == len(out["failures"]) == conformance.MAX_LOST


def test_output_and_input_of_the_implementation_do_not_disturb_the_judge(tmp_path):
    out = judged(write(tmp_path, "noisy", IMPLEMENTATIONS["noisy"]) + ":solve", code=0)
    assert out["passed"] is True


def test_module_func_spec(tmp_path):
    pkg = tmp_path / "myclip"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "impl.py").write_text(HELPERS + textwrap.dedent(IMPLEMENTATIONS["correct"]))
    out = judged("myclip.impl:solve", cwd=tmp_path, code=0)
    assert out["target"] == "myclip.impl:solve"
    assert out["passed"] is True


def test_the_judge_needs_no_mpi(tmp_path):
    """mpi4py hidden behind a package that cannot be imported: the judge still works."""
    fake = tmp_path / "fake" / "mpi4py"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no MPI on this machine')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "fake")}
    spec = write(tmp_path, "correct", IMPLEMENTATIONS["correct"]) + ":solve"
    assert judged(spec, env=env, code=0)["passed"] is True
    proc = run("missing.py:solve", env=env)
    assert proc.returncode == 2 and "no such file" in proc.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["missing.py:solve"], "no such file"),
        (["{impl}:no_such_function"], "no function 'no_such_function'"),
        (["{impl}:math"], "not callable"),
        (["{impl}:"], "bad target"),
        (["{impl}:not-a-name"], "bad target"),
        (["plain_word"], "bad target"),
        (["no_such_module_here:solve"], "cannot load"),
        (["{syntax}:solve"], "cannot load"),
        (["{impl}:solve", "--random", "-1"], "--random"),
        (["{impl}:solve", "--timeout", "0"], "--timeout"),
        (["{impl}:solve", "--no-such-flag"], "unrecognized"),
        ([], "required"),
    ],
)
def test_usage_errors_exit_2_with_one_line(tmp_path, args, message):
    impl = write(tmp_path, "impl", IMPLEMENTATIONS["correct"])
    syntax = tmp_path / "syntax.py"
    syntax.write_text("def solve(:\n")
    proc = run(*(a.format(impl=impl, syntax=syntax) for a in args), cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gclip.conformance: error:")
    assert message in lines[0]
    assert proc.stdout == ""


def test_a_file_that_cannot_load_is_exit_2_and_json_under_json(tmp_path):
    syntax = tmp_path / "syntax.py"
    syntax.write_text("def solve(:\n")
    proc = run(f"{syntax}:solve", "--json", cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    out = json.loads(proc.stdout)
    assert out == {"target": f"{syntax}:solve", "passed": False, "error": out["error"]}
    assert out["error"].startswith(f"cannot load {syntax}: SyntaxError")
    assert proc.stderr.strip() == f"gclip.conformance: error: {out['error']}"


# ---------------------------------------------------------------------------
# in-process: what the cases cover


def test_random_cases_cover_every_knob_of_the_contract():
    cases = conformance.make_cases(300, seed=1)
    random_cases = [c for c in cases if c.label.startswith("random")]
    assert len(random_cases) == 300
    assert len([c for c in cases if c.label.startswith("contract")]) == 35

    def norm(case):
        return math.sqrt(math.fsum(v * v for s in case.shards for v in s))

    counts = {len(c.shards) for c in random_cases}
    assert {0, 1, 2, 3, 4} <= counts and max(counts) >= 6
    assert any(any(len(s) == 0 for s in c.shards) and len(c.shards) > 1 for c in random_cases)
    assert any(len({len(s) for s in c.shards}) > 1 for c in random_cases)  # uneven widths
    assert any(c.limit == 0 and norm(c) > 0 for c in random_cases)
    assert any(0 < c.limit < norm(c) for c in random_cases)  # clipped
    assert any(c.limit > norm(c) > 0 for c in random_cases)  # unchanged
    assert any(norm(c) == 0 and c.shards for c in random_cases)
    assert any(v < 0 for c in random_cases for s in c.shards for v in s)


def test_random_cases_are_seeded():
    assert conformance.make_cases(50, seed=3) == conformance.make_cases(50, seed=3)
    assert conformance.make_cases(50, seed=3) != conformance.make_cases(50, seed=4)


@pytest.mark.parametrize(
    "spec,kind", [("a/b.py:f", "file"), ("pkg.mod:solve", "module"), ("mod:Cls.method", "module")]
)
def test_parse_target(tmp_path, spec, kind, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b.py").write_text("")
    target = conformance.parse_target(spec)
    assert target.kind == kind
    assert str(target) == spec
