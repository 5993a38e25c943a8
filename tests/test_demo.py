"""The teaching demo: real mpirun runs, the seed oracle, bad input, and a fuzz of the parser.

Most cases are batched (every job under a timeout): one job runs the demo's ``_main`` many times
in-process (argv and all, on the real MPI ranks), since starting a job costs
more than a clip. A few cases go through the real command line as well.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import gclip
import gclip.gallery
from gclip import demo
from gclip._lab.cli import UsageError
from gclip.contract import rounded
from gclip.demo.options import DEFAULT_REPLICATED
from gclip.gallery.contract import seed_checks

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import ROOT  # noqa: E402
from conftest import mpirun as run_mpirun  # noqa: E402

SEED = Path(__file__).parent / "data" / "seed_000_adec46095326f7b8.json"
LAUNCHER = shutil.which(
    "mpirun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
)
TIMEOUT = 120

needs_mpi = pytest.mark.skipif(LAUNCHER is None, reason="mpirun not found")


def demo_run(n: int, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The demo on n ranks, under the suite's timeouts (conftest.mpirun)."""
    return run_mpirun(
        n, sys.executable, "-m", "gclip.demo", *args, timeout=TIMEOUT, env={"NO_COLOR": "1", **(env or {})}
    )


# One job, many demo runs: each case is (id, ranks, argv). Cases for 1 rank run on a
# communicator of one rank (every world rank runs it alone); rank 0's output is kept.
BATCH = r"""
import contextlib, io, json, sys
from mpi4py import MPI
from gclip.demo import command
world = MPI.COMM_WORLD
alone = world.Split(world.Get_rank(), 0)
out = {}
cases = world.bcast(json.loads(sys.stdin.read()) if world.Get_rank() == 0 else None, root=0)
for cid, n, argv in cases:
    comm = world if n == world.Get_size() else alone
    assert n in (1, world.Get_size()), (cid, n)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        command._main(argv, comm)
    if world.Get_rank() == 0:
        out[cid] = buf.getvalue()
if world.Get_rank() == 0:
    print(json.dumps(out))
"""


def batch(n: int, cases: list[tuple[str, int, list[str]]]) -> dict[str, dict]:
    """Run every case in one mpirun of n ranks; returns id -> the JSON object printed."""
    proc = run_mpirun(
        n, sys.executable, "-c", BATCH, input=json.dumps(cases), timeout=TIMEOUT, env={"NO_COLOR": "1"}
    )
    assert proc.returncode == 0, proc.stderr
    raw = json.loads(proc.stdout)
    assert set(raw) == {c[0] for c in cases}
    out = {}
    for cid, text in raw.items():
        lines = text.splitlines()
        assert len(lines) == 1, (cid, text[:300])
        out[cid] = json.loads(lines[0])
    return out


# ---------------------------------------------------------------------------
# the seed oracle: the record's own implementations, run as they are


def oracle(which: str, n: int) -> dict[str, list]:
    """label -> what the record's ``which`` implementation returns for N = n."""
    source = json.loads(SEED.read_text())["implementations"][which]["source"]
    source, count = re.subn(r"^N = 1$", f"N = {n}", source, flags=re.M)
    assert count == 1
    proc = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=60)
    assert proc.returncode in (0, 1), proc.stderr
    return {o["check"]: o for o in json.loads(proc.stdout)["observations"]}


def seed_cases() -> list[tuple[int, object]]:
    return [(n, c) for n in range(1, 6) for c in seed_checks(n) if c.shards]


def test_oracle_expected_matches_contract():
    # the record's expected values and gclip's copy of the checks are the same fixtures
    for n in range(1, 6):
        seen = oracle("broken", n)
        for c in seed_checks(n):
            assert seen[c.label]["expected"] == c.expected


@needs_mpi
@pytest.mark.slow
def test_seed_checks_through_json_shards():
    cases, want = [], {}
    oracles = {(w, n): oracle(w, n) for w in ("broken", "attempt") for n in range(1, 6)}
    for n, c in seed_cases():
        base = ["--json", "--values", "--shards", json.dumps(c.shards), "--max-norm", repr(c.limit)]
        key = f"{n}:{c.label}"
        runs = {
            "global": ([], c.expected),
            "repro": (["--reproducible"], c.expected),
            "per-rank": (["--buggy"], oracles["broken", n][c.label]["actual"]),
            "rms": (["--buggy", "rms"], oracles["attempt", n][c.label]["actual"]),
        }
        for name, (extra, expected) in runs.items():
            cases.append((f"{key}:{name}", len(c.shards), base + extra))
            want[f"{key}:{name}"] = expected
    got = batch(2, cases)
    for cid, expected in want.items():
        assert got[cid]["clipped"] == expected, cid
    # the oracle's failures show up as differences from the correct run, as they should
    assert (
        got["2:norm spans two shards:per-rank"]["clipped"] != got["2:norm spans two shards:global"]["clipped"]
    )
    assert got["3:uneven shard widths:rms"]["correct"]["clipped"] == seed_checks(3)[1].expected


@needs_mpi
@pytest.mark.slow
def test_seed_checks_through_the_real_command_line():
    for n, idx, flags, which in [
        (3, 0, [], None),
        (1, 4, [], None),
        (2, 3, [], None),
        (4, 1, ["--buggy"], "broken"),
    ]:
        c = seed_checks(n)[idx]
        proc = demo_run(
            len(c.shards),
            "--json",
            "--values",
            "--shards",
            json.dumps(c.shards),
            "--max-norm",
            str(c.limit),
            *flags,
        )
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        expected = c.expected if which is None else oracle(which, n)[c.label]["actual"]
        assert out["clipped"] == expected
    c = seed_checks(5)[1]  # through the flag's old name, --limit, kept as a hidden alias
    proc = demo_run(
        2, "--json", "--values", "--buggy", "rms", "--shards", json.dumps(c.shards), "--limit", str(c.limit)
    )
    assert json.loads(proc.stdout)["clipped"] == oracle("attempt", 5)[c.label]["actual"]


# ---------------------------------------------------------------------------
# the default demo


@needs_mpi
@pytest.mark.slow
def test_default_demo_on_4_ranks_tells_the_story():
    proc = demo_run(4)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    text = proc.stdout
    assert "global norm" in text
    assert text.count("gclip demo:") == 1  # rank 0 alone prints
    for phase in ("1. local", "2. all-reduce", "3. scale", "What happened"):
        assert phase in text
    for rank in range(4):
        assert re.search(rf"^\s+{rank}\s", text, flags=re.M)
    assert "\033[" not in text  # no colour in a pipe
    assert 15 <= len(text.splitlines()) <= 45


@needs_mpi
@pytest.mark.slow
def test_buggy_text_shows_both_runs_side_by_side():
    proc = demo_run(4, "--buggy")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "per-rank" in text and "correct (global)" in text
    assert "cosine" in text and "max |error|" in text
    assert "direction changed" in text
    assert 15 <= len(text.splitlines()) <= 45


@needs_mpi
@pytest.mark.slow
def test_json_shape_and_its_arithmetic():
    proc = demo_run(2, "--json", "--values", "--size", "5", "--seed", "3", "--max-norm", "2.5")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    for key in ("mode", "ranks", "limit", "global_norm", "clipped", "per_rank", "clipped_norm", "scale"):
        assert key in out
    assert out["mode"] == "global" and out["ranks"] == 2 and out["limit"] == 2.5
    assert [len(s) for s in out["clipped"]] == [5, 5]
    assert [r["rank"] for r in out["per_rank"]] == [0, 1]
    for r in out["per_rank"]:
        assert set(r) >= {"rank", "host", "local_sumsq", "local_norm", "scale"}
        assert isinstance(r["host"], str) and r["host"]
        assert r["local_norm"] == pytest.approx(math.sqrt(r["local_sumsq"]))
        assert r["scale"] == out["scale"]
    # one sum of the local sums of squares gives the global norm, which sets the scale
    total = sum(r["local_sumsq"] for r in out["per_rank"])
    assert out["global_norm"] == pytest.approx(math.sqrt(total), rel=1e-12)
    assert out["global_norm"] > 2.5
    assert out["scale"] == pytest.approx(2.5 / out["global_norm"], rel=1e-12)
    flat = [v for s in out["clipped"] for v in s] + out["clipped_replicated"][0]
    assert math.sqrt(sum(v * v for v in flat)) == pytest.approx(2.5, rel=1e-9)
    assert out["clipped_norm"] == pytest.approx(2.5, rel=1e-12)
    assert out["cosine"] == pytest.approx(1.0, abs=1e-12)
    assert all(v == round(v, 12) for v in flat)


@needs_mpi
@pytest.mark.slow
def test_every_gallery_bug_differs_from_the_correct_run_on_default_data():
    names = [b.name for b in gclip.gallery.BUGS]
    cases = [(name, 4, ["--json", "--values", "--buggy", name]) for name in names]
    got = batch(4, [*cases, ("global", 4, ["--json", "--values"])])
    for name in names:
        out = got[name]
        assert out["mode"] == name and "correct" in out and "cosine" in out
        assert out["clipped"] != out["correct"]["clipped"], name
        assert out["max_abs_error"] == "nan" if name == "nan-mask" else out["max_abs_error"] > 0, name
        assert out["correct"]["clipped_norm"] == pytest.approx(1.0, rel=1e-9), name
    # the correct run inside a bug run is the plain correct run (inf-pow uses the inf-norm)
    assert got["per-rank"]["correct"]["clipped"] == got["global"]["clipped"]
    assert got["inf-pow"]["norm_type"] == "inf"
    assert got["per-rank"]["clipped_norm"] > 1.5  # up to sqrt(4) x limit
    assert got["per-rank"]["cosine"] < 0.99  # the direction changed
    assert len({r["scale"] for r in got["per-rank"]["per_rank"]}) == 4
    assert got["fp16-sumsq"]["clipped_norm"] == 0.0  # wiped out
    assert set(got["nan-mask"]["scales"]) == {"nan"} and got["nan-mask"]["norms_used"][0] == "inf"
    assert got["double-count"]["norms_used"][0] > got["double-count"]["correct"]["global_norm"]
    assert got["double-count"]["true_global_norm"] == got["double-count"]["correct"]["global_norm"]
    assert "global_norm" not in got["per-rank"]  # a bug's run has no global norm of its own


def test_list_bugs_json_without_mpirun():
    proc = subprocess.run(
        [sys.executable, "-m", "gclip.demo", "--list-bugs", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1
    listed = json.loads(lines[0])
    bugs = [b for b in listed if b["kind"] == "combine"]  # the layout bugs follow: test_demo_layout
    assert [b["name"] for b in bugs] == [b.name for b in gclip.gallery.BUGS]
    usage = len(gclip.gallery.USAGE_BUGS)
    layout = len(listed) - len(bugs) - usage
    assert [b["kind"] for b in listed] == ["combine"] * len(bugs) + ["layout"] * layout + ["usage"] * usage
    for b in bugs:
        assert b["summary"] and b["explanation"]
    # every bug cites a checked public incident, but two teaching examples that have none
    assert [b["name"] for b in bugs if not b["incident"]] == ["rank0-norm", "max-of-norms"]
    text = subprocess.run(
        [sys.executable, "-m", "gclip.demo", "--list-bugs"], capture_output=True, text=True, timeout=60
    ).stdout
    for b in gclip.gallery.BUGS:
        assert b.name in text and b.incident in text


def test_list_bugs_marks_the_usage_bugs_says_where_to_see_them_and_buggy_refuses_them():
    """Every bug --list-bugs offers to --buggy runs; the usage bugs are marked, not offered, and
    --buggy NAME refuses them in one line that points to where they are shown (a file that exists)."""
    listed = json.loads(
        subprocess.run(
            [sys.executable, "-m", "gclip.demo", "--list-bugs", "--json"], capture_output=True, text=True,
            timeout=60,
        ).stdout
    )  # fmt: skip
    usage = [b for b in listed if b["kind"] == "usage"]
    assert [b["name"] for b in usage] == [b.name for b in gclip.gallery.USAGE_BUGS]
    assert all(b["buggy"] is False for b in usage) and all(b["buggy"] for b in listed if b not in usage)
    text = subprocess.run(
        [sys.executable, "-m", "gclip.demo", "--list-bugs"], capture_output=True, text=True, timeout=60
    ).stdout
    assert "usage bugs, not run by --buggy" in text
    for b in usage:
        assert re.search(rf"{b['name']} +\[usage bug\]", text)
        see = b["see"]
        for path in ("docs/torch.md", "tests/test_torch_usage_bugs.py"):
            assert path in see and (ROOT / path).is_file()
        assert "Three usage bugs of the gallery" in (ROOT / "docs" / "torch.md").read_text()
        proc = subprocess.run(
            [sys.executable, "-m", "gclip.demo", "--buggy", b["name"], "--ranks", "2"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and see in proc.stderr and "not of the clip" in proc.stderr
    for b in listed:  # what is offered runs (a layout bug on its layout, simulated)
        if b["buggy"] and b["kind"] == "combine":
            argv = ["--buggy", b["name"], "--ranks", "2", "--json"]
        elif b["buggy"]:
            argv = ["--buggy", b["name"], "--layout", b["shows_on"], "--ranks", "8", "--json"]
        else:
            continue
        assert demo.parse_args(argv, None).bug == b["name"]


# ---------------------------------------------------------------------------
# bad input: one line on stderr, exit 2, every rank, no hang

BAD = {
    "shard count": ["--shards", "[[1,2]]"],
    "not a number": ["--shards", '[[1],["x"]]'],
    "bool": ["--shards", "[[1],[true]]"],
    "NaN": ["--shards", "[[1],[NaN]]"],
    "Infinity": ["--shards", "[[Infinity],[1]]"],
    "overflow": ["--shards", "[[1e999],[1]]"],
    "not JSON": ["--shards", "[[1],[2]"],
    "nested": ["--shards", "[[1],[[2]]]"],
    "not lists": ["--shards", "[1, 2]"],
    "limit negative": ["--max-norm", "-1"],
    "limit negative, old flag": ["--limit", "-1"],
    "limit NaN": ["--max-norm", "nan"],
    "limit inf": ["--max-norm", "inf"],
    "limit word": ["--max-norm", "one"],
    "unknown flag": ["--bogus"],
    "unknown bug": ["--buggy", "nope"],
    "replicated": ["--replicated", '{"a": 1}'],
    "norm type": ["--norm-type", "0"],
    "size": ["--size", "-1"],
    "deep": ["--shards", "[" * 50000 + "]" * 50000],
    "unicode": ["--shards", '[["\u00e9\u4e2d\U0001f600"],[1]]'],
    "huge int": ["--shards", "[[" + "9" * 400 + "],[1]]"],
    "plot folder": ["--plot", os.path.join("no-such-folder", "x.png")],
}


@needs_mpi
@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2_on_every_rank():
    with ThreadPoolExecutor(max_workers=3) as pool:  # jobs mostly wait on interpreter start-up
        procs = dict(zip(BAD, pool.map(lambda args: demo_run(2, *args), BAD.values())))
    for name, proc in procs.items():
        assert proc.returncode == 2, (name, proc.stdout, proc.stderr)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, (name, proc.stderr)
        assert lines[0].startswith("gclip.demo: error: "), name
        assert "Traceback" not in proc.stderr, name
        assert proc.stdout == "", name


@needs_mpi
@pytest.mark.slow
def test_extreme_but_valid_values_through_mpirun():
    # huge values overflow a plain sum of squares, tiny ones underflow it: both must clip right
    for shards in ([[1e300, -1e300], [1e300]], [[1e-300, 5e-324], [-1e-300]]):
        proc = demo_run(2, "--json", "--shards", json.dumps(shards), "--max-norm", "1e-310")
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        big = max(abs(v) for s in shards for v in s)
        norm = big * math.sqrt(sum((v / big) ** 2 for s in shards for v in s))
        assert out["global_norm"] == pytest.approx(norm, rel=1e-12)
        assert out["clipped_norm"] == pytest.approx(1e-310, rel=1e-6)


# ---------------------------------------------------------------------------
# the plot


@needs_mpi
@pytest.mark.slow
def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "demo.png"
    proc = demo_run(2, "--buggy", "--plot", str(path))
    assert proc.returncode == 0, proc.stderr
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000
    assert str(path) in proc.stdout


@needs_mpi
@pytest.mark.slow
def test_plot_without_matplotlib_is_a_usage_error(tmp_path):
    fake = tmp_path / "site" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('matplotlib is hidden by the test')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    proc = demo_run(2, "--plot", str(tmp_path / "x.png"), env=env)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install 'gclip[plot]'" in lines[0]
    assert not (tmp_path / "x.png").exists()


def test_require_names_the_extra(monkeypatch):
    from gclip._lab import plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(UsageError, match=r"gclip\[plot\]"):
        plots.require()


def test_sweep_per_rank_grows_like_sqrt_r_and_global_stays_at_the_limit():
    opts = demo.parse_args(["--size", "50"], ranks=4)
    curves = demo.sweep(opts, ["global", "per-rank"], max_ranks=16)
    assert curves["global"] == pytest.approx([1.0] * 16, rel=1e-9)
    assert curves["per-rank"][0] == pytest.approx(1.0, rel=1e-9)
    for r, v in enumerate(curves["per-rank"], start=1):
        assert v <= math.sqrt(r) + 1e-9
    assert curves["per-rank"][-1] > 3.0


# ---------------------------------------------------------------------------
# fuzz: the parser accepts exactly the valid inputs, and fails in one line


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**400), max_value=10**400)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=20,
)
shard_lists = st.lists(
    st.lists(st.integers(-(10**30), 10**30) | st.floats(allow_nan=False, allow_infinity=False), max_size=5),
    min_size=1,
    max_size=4,
)
limits = st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12) | st.integers(-5, 10**400)


def _valid_number(v) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _expect(shards, ranks: int):
    """What a correct parser returns for this JSON value, or None if it must refuse it."""
    if not isinstance(shards, list) or len(shards) != ranks:
        return None
    if not all(isinstance(s, list) and all(_valid_number(v) for v in s) for s in shards):
        return None
    return [[float(v) for v in s] for s in shards]


def _check(shards_text: str, limit_text: str, ranks: int):
    try:
        opts = demo.parse_args([f"--shards={shards_text}", f"--max-norm={limit_text}"], ranks=ranks)
    except (UsageError, gclip.GclipError) as exc:
        message = str(exc)
        assert message and "\n" not in message and len(message) < 400
        return None
    assert all(math.isfinite(v) for s in opts.shards for v in s)
    assert math.isfinite(opts.limit) and opts.limit >= 0
    assert opts.replicated == []
    return opts


@settings(max_examples=300, deadline=None)
@given(value=json_values | shard_lists, limit=limits, ranks=st.integers(1, 4))
def test_fuzz_parse_accepts_exactly_the_valid_inputs(value, limit, ranks):
    text = json.dumps(value)  # NaN and Infinity come out as JSON-ish tokens, as a user might type
    limit_text = limit if isinstance(limit, str) else repr(limit)
    opts = _check(text, limit_text, ranks)
    want = _expect(value, ranks)
    try:
        limit_ok = math.isfinite(float(limit_text)) and float(limit_text) >= 0
    except ValueError:
        limit_ok = False
    if want is None or not limit_ok:
        assert opts is None
    else:
        assert opts is not None and opts.shards == want and opts.limit == float(limit_text)


literals = (
    st.sampled_from(["1e999", "-1e400", "1e-400", "5e-324", "-0.0", "1.7976931348623157e308", "0", "true"])
    | st.integers(-(10**400), 10**400).map(str)
    | st.floats(allow_nan=False, allow_infinity=False).map(repr)
)


@settings(max_examples=200, deadline=None)
@given(shards=st.lists(st.lists(literals, max_size=4), min_size=1, max_size=3))
def test_fuzz_parse_of_number_literals(shards):
    # overflowing literals (1e999, 400-digit integers) must be refused, tiny ones kept
    text = "[" + ",".join("[" + ",".join(s) + "]" for s in shards) + "]"
    opts = _check(text, "1", len(shards))
    valid = all(lit != "true" and math.isfinite(_as_float(lit)) for s in shards for lit in s)
    assert (opts is not None) == valid
    if valid:
        assert opts.shards == [[_as_float(lit) for lit in s] for s in shards]


def _as_float(literal: str) -> float:
    try:
        return float(literal) if literal != "true" else math.nan
    except OverflowError:
        return math.inf


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=40) | st.integers(1, 3000).map(lambda d: "[" * d + "]" * d))
def test_fuzz_parse_of_arbitrary_text(text):
    _check(text, "1", 1)


def test_parse_data_defaults():
    shards, limit, reps, p = demo.parse_data(None, "1")
    assert shards is None and limit == 1.0 and reps == list(DEFAULT_REPLICATED) and p is None
    assert demo.parse_data("[[1, 2]]", "0", None, "inf", ranks=1)[2:] == ([], math.inf)
    assert rounded([1 / 3])[0] == round(1 / 3, 12)


def test_the_old_limit_flag_is_a_hidden_alias_of_max_norm():
    old = demo.parse_args(["--limit", "2.5", "--shards", "[[3, 4]]"], ranks=1)
    assert old == demo.parse_args(["--max-norm", "2.5", "--shards", "[[3, 4]]"], ranks=1)
    assert old.limit == 2.5
    assert demo.parse_args(["--limit=0"], ranks=1).limit == 0.0
    with pytest.raises(UsageError, match="--max-norm"):
        demo.parse_args(["--limit", "-1"], ranks=1)
    proc = subprocess.run(
        [sys.executable, "-m", "gclip.demo", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "--max-norm" in proc.stdout and "--limit" not in proc.stdout
