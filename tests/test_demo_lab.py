"""The demo's lab features: --seed data, --ranks (simulated), the one-rank hint, --mystery, --values,
the buggy JSON's names and the plot's first panel.

Most runs are in-process (``command._main`` with --ranks needs no MPI); a few go
through mpirun (conftest.mpirun, under a timeout) to compare simulated and real ranks.
The oracles are numpy and hand arithmetic, never the demo's own report code.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest

import gclip
import gclip.gallery
from conftest import OneRankComm, mpirun, venv_env
from gclip import demo
from gclip._lab.cli import UsageError
from gclip.demo import command, options
from gclip.demo.figure import norms_panel

BIAS = np.array([30.0, -40.0])  # the demo's replicated tensor, norm 50


def run_here(*argv: str) -> str:
    """The demo's output for argv, in this process (one rank, or --ranks R simulated)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert command._main(list(argv), OneRankComm()) == 0
    return buf.getvalue()


def json_here(*argv: str) -> dict:
    lines = run_here("--json", *argv).splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


# ---------------------------------------------------------------------------
# --seed: seed 0 is the tutorial's data, every other seed its own


def test_seed_0_is_the_tutorials_data():
    for rank, want in enumerate([100.0, 400.0, 50.0, 200.0, 100.0, 400.0, 50.0, 200.0]):
        raw = np.random.default_rng([0, rank]).standard_normal(1000)  # the values' own stream
        expected = raw * (want / np.linalg.norm(raw))
        np.testing.assert_array_equal(demo.random_shard(0, rank, 1000), expected)
    out = json_here("--ranks", "4")
    # 100^2 + 400^2 + 50^2 + 200^2 + 50^2 (the bias, once) = 215000, as the tutorial says
    assert out["true_global_norm"] == pytest.approx(math.sqrt(215000), rel=1e-12)
    assert f"{out['true_global_norm']:.6g}" == "463.681"


def _norms(seed: int, ranks: int = 4) -> list[float]:
    return [float(np.linalg.norm(demo.random_shard(seed, r, 1000))) for r in range(ranks)]


def test_other_seeds_give_other_norms():
    seen = {tuple(round(n, 6) for n in _norms(0))}
    for seed in range(1, 41):  # a class of 40 students, one seed each
        norms = _norms(seed)
        key = tuple(round(n, 6) for n in norms)
        assert key not in seen, seed  # never seed 0's, nor another seed's
        seen.add(key)
        assert sorted(norms) != pytest.approx([50.0, 100.0, 200.0, 400.0])
        top = max(norms)
        # the pattern: the largest, halved once, twice and three times, in some order
        assert sorted(norms) == pytest.approx([top / 8, top / 4, top / 2, top], rel=1e-12)
        assert all(abs(n - round(n)) < 1e-9 for n in norms)  # whole numbers
        assert norms[0] != pytest.approx(top)  # rank 0 never holds the largest: rank0-norm != max-of-norms
        assert top**2 > 65504  # its sum of squares overflows float16: fp16-sumsq shows
        assert demo.shard_norm(seed, 5) == pytest.approx(norms[1])  # the pattern repeats every 4 ranks


def test_seed_changes_the_demos_numbers():
    base = json_here("--ranks", "4")
    for seed in range(1, 6):
        out = json_here("--ranks", "4", "--seed", str(seed))
        assert out["data"]["seed"] == seed
        assert out["data"]["shard_norms"] == pytest.approx(_norms(seed))
        assert out["true_global_norm"] != pytest.approx(base["true_global_norm"])
        want = math.sqrt(sum(n * n for n in _norms(seed)) + 2500)
        assert out["true_global_norm"] == pytest.approx(want, rel=1e-12)


# ---------------------------------------------------------------------------
# --ranks R: simulated ranks, said so; refused under mpirun; the one-rank hint


def test_simulated_ranks_say_so_and_tell_the_same_story():
    text = run_here("--ranks", "4")
    words = " ".join(text.split())  # the report wraps its lines
    assert "4 simulated in this one process" in words
    assert "the all-reduce is a sum over a list" in words
    assert "this ran on 1 rank" not in text
    rows = re.findall(r"^\s+(\d)\s+simulated\s", text, flags=re.M)
    assert rows == ["0", "1", "2", "3"]
    assert "463.681" in text and "the same on all 4 ranks" in text


@pytest.mark.slow
def test_simulated_ranks_match_real_ranks():
    real = mpirun(4, sys.executable, "-m", "gclip.demo", "--json", "--buggy", timeout=120, env=venv_env())
    assert real.returncode == 0, real.stderr
    got = json.loads(real.stdout)
    sim = json_here("--ranks", "4", "--buggy")
    assert (got["simulated"], sim["simulated"]) == (False, True)
    assert {r["host"] for r in sim["per_rank"]} == {"simulated"}
    for key in ("true_global_norm", "clipped_norm", "cosine", "max_abs_error"):
        assert sim[key] == pytest.approx(got[key], rel=1e-12), key
    for key in ("norms_used", "scales"):
        assert sim[key] == pytest.approx(got[key], rel=1e-12), key


@pytest.mark.slow
def test_ranks_under_mpirun_is_refused_in_one_line():
    proc = mpirun(2, sys.executable, "-m", "gclip.demo", "--ranks", "4", timeout=120, env=venv_env())
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gclip.demo: error: --ranks simulates"), proc.stderr
    assert proc.stdout == ""


def test_one_rank_without_ranks_prints_how_to_start_more():
    proc = subprocess.run(
        [sys.executable, "-m", "gclip.demo"], capture_output=True, text=True, timeout=60, env=venv_env()
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "this ran on 1 rank" in text
    assert "mpirun -n 4 python -m gclip.demo" in text and "--ranks 4 to simulate 4 ranks" in text
    assert "adds the 1 numbers" not in text and "all 1 ranks" not in text  # no "1 ranks" anywhere
    assert not re.search(r"\b1 ranks\b", text)
    # your own one-shard data on one rank is no mistake: no hint then
    assert "this ran on 1 rank" not in run_here("--shards", "[[3, 4]]", "--ranks", "1")
    one = subprocess.run(
        [sys.executable, "-m", "gclip.demo", "--shards", "[[3, 4]]"],
        capture_output=True,
        text=True,
        timeout=60,
        env=venv_env(),
    )
    assert one.returncode == 0 and "this ran on 1 rank" not in one.stdout


@pytest.mark.slow
def test_no_hint_on_several_real_ranks():
    proc = mpirun(2, sys.executable, "-m", "gclip.demo", timeout=120, env=venv_env())
    assert proc.returncode == 0, proc.stderr
    assert "this ran on 1 rank" not in proc.stdout and "simulated" not in proc.stdout


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--ranks", "0"], "--ranks must be between 1 and 64"),
        (["--ranks", "65"], "--ranks must be between 1 and 64"),
        (["--ranks", "8", "--layout", "pp=2,dp=2,tp=2", "--mystery", "6"], "from 1 to 5"),
        (["--model", "incidents"], "--model goes with --layout"),
        (["--buggy", "clip-before-unscale"], "tests/test_torch_usage_bugs.py"),
        (["--buggy", "nope"], "invalid choice: 'nope'"),
        (["--ranks", "3", "--shards", "[[1], [2]]"], "2 shards for 3 ranks"),
        (["--mystery", "0"], "from 1 to 9"),
        (["--mystery", "10"], "from 1 to 9"),
        (["--mystery", "2", "--buggy"], "drop --buggy"),
        (["--values"], "--values goes with --json"),
    ],
)
def test_lab_flags_refuse_what_they_cannot_do(argv, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        demo.parse_args(argv, ranks=1)


def test_shards_for_two_ranks_on_one_suggests_ranks():
    with pytest.raises(UsageError, match=r"\(mpirun -n 2, or --ranks 2\)"):
        demo.parse_args(["--shards", "[[3, 0], [0, 4]]"], ranks=1)
    opts = demo.parse_args(["--shards", "[[3, 0], [0, 4]]", "--ranks", "2"], ranks=1)
    assert opts.simulate == 2


def test_the_demo_says_mpirun_as_the_lab_does(capsys):
    """The lab and the README launch with mpirun: the gallery and the usage line say the same."""
    gallery = run_here("--list-bugs")
    assert "mpirun -n 4 python -m gclip.demo --buggy NAME" in gallery
    assert "mpirun -n 8 python -m gclip.demo --layout AXES --buggy NAME" in gallery
    with pytest.raises(SystemExit):
        demo.parse_args(["--help"], ranks=1)
    assert capsys.readouterr().out.startswith("usage: mpirun -n 4 python -m gclip.demo")
    assert "mpiexec" not in gallery


# ---------------------------------------------------------------------------
# --mystery K: a gallery bug with its name kept out


def _giveaways(name: str) -> list[str]:
    bug = gclip.gallery.STRATEGIES[name]
    return [name, bug.summary, bug.explanation] + ([bug.incident] if bug.incident else [])


@pytest.mark.parametrize("k", range(1, 10))
def test_mystery_runs_its_bug_without_naming_it(k):
    name = demo.mysteries(0)[k - 1]
    hidden = json_here("--ranks", "4", "--mystery", str(k))
    named = json_here("--ranks", "4", "--buggy", name)
    assert hidden["mode"] == f"mystery-{k}" and hidden["mystery"] == k
    assert "bug" not in hidden
    for key in ("norms_used", "scales", "clipped_norm", "cosine", "max_abs_error", "true_global_norm"):
        assert hidden[key] == named[key], key
    text = run_here("--ranks", "4", "--mystery", str(k))
    assert f"mystery {k}" in text and "Your turn:" in text
    for output in (text, json.dumps(hidden)):
        for words in _giveaways(name):
            assert not re.search(rf"(?<![\w-]){re.escape(words)}(?![\w-])", output), (k, words)


def test_the_mystery_pool_is_the_gallery_but_the_inf_norm_bug():
    """inf-pow shows only on the inf-norm, and a run on the inf-norm says so (its header, table 1's
    max |x|): it would name itself, so it is no mystery (it stays in the gallery, --buggy inf-pow)."""
    added = gclip.demo.options.ADDED  # added to the gallery after the seeds were handed out
    assert sorted(demo.MYSTERY_POOL) == sorted(
        b.name for b in gclip.gallery.BUGS if b.name != "inf-pow" and b.name not in added
    )
    assert "inf norm" in run_here("--ranks", "4", "--buggy", "inf-pow")
    for seed in (0, 7, 8, 40):
        assert sorted(demo.mysteries(seed)) == sorted(demo.MYSTERY_POOL)  # each seed: the pool, in its order
        for k in range(1, 10):
            text = run_here("--ranks", "4", "--seed", str(seed), "--mystery", str(k))
            assert "inf norm" not in text and "max |x|" not in text and "sum of squares" in text


def test_every_pair_of_distinct_bugs_is_a_mystery_pair_once():
    pairs = options.MYSTERY_PAIRS
    assert {frozenset(p) for p in pairs} == {
        frozenset(p) for p in itertools.combinations(demo.MYSTERY_POOL, 2)
    }
    assert len(pairs) == math.comb(9, 2) == 36


def test_a_class_of_40_sees_40_different_mysteries():
    """Seeds 0..40 (the tutorial's and a class of 40): no two give the same mystery pair with the same
    numbers; no two of seeds 1..36 the same pair; consecutive seeds (students side by side) no bug in
    common; and every seed its own global norm, so no table can be copied from another seed."""
    seen = {}
    for seed in range(41):
        pair = demo.mysteries(seed)[:2]
        assert pair[0] != pair[1]
        norms = tuple(round(n, 6) for n in _norms(seed))
        key = (frozenset(pair), tuple(sorted(norms)))
        assert key not in seen, (seed, seen.get(key))
        seen[key] = seed
        assert not set(pair) & set(demo.mysteries(seed + 1)[:2]), seed
    for start in (1, 5, 1000, 10**9):  # any 36 consecutive seeds: 36 different pairs
        assert len({frozenset(demo.mysteries(s)[:2]) for s in range(start, start + 36)}) == 36
    globals_ = [round(math.sqrt(math.fsum(n * n for n in _norms(s)) + 2500), 6) for s in range(41)]
    assert len(set(globals_)) == 41
    largest = [max(_norms(s)) for s in range(1, 68)]  # any 67 consecutive seeds: their own largest norm
    assert len({round(x, 6) for x in largest}) == 67


def test_the_worked_examples_keep_their_mysteries_and_numbers():
    """The lab's documents work seed 43, which no student is handed (mysteries rms and double-count,
    norms 300, 75, 600, 150), and the tutorial seed 0 (100, 400, 50, 200)."""
    assert demo.mysteries(43)[:2] == ("rms", "double-count")
    assert _norms(43) == pytest.approx([300.0, 75.0, 600.0, 150.0], rel=1e-12)
    assert _norms(0) == pytest.approx([100.0, 400.0, 50.0, 200.0], rel=1e-12)


def test_mystery_evidence_is_enough_to_tell_the_bugs_apart():
    """Each mystery leaves a different trace in its JSON on the default data (4 ranks)."""
    local = [math.sqrt(100**2 + 2500), 400.0, 50.0, 200.0]  # rank 0 counts the bias
    g = math.sqrt(215000)
    want = {
        "mean-of-norms": sum(local) / 4,
        "rank0-norm": local[0],
        "double-count": math.sqrt(215000 + 3 * 2500),  # the bias counted on all 4 ranks
        "sum-of-norms": sum(local),
        "max-of-norms": 400.0,
        "rms": g / math.sqrt(4002),
        "epsilon": g,
    }
    for k, name in enumerate(demo.mysteries(0), start=1):
        out = json_here("--ranks", "4", "--mystery", str(k))
        used = out["norms_used"]
        if name == "per-rank":
            own = [math.sqrt(100**2 + 2500), math.sqrt(400**2 + 2500), math.sqrt(50**2 + 2500)]
            assert used[:3] == pytest.approx(own, rel=1e-12)  # each rank's shard and its bias copy
        elif name == "fp16-sumsq":
            assert used == ["inf"] * 4 and out["clipped_norm"] == 0.0
        else:
            assert used == pytest.approx([want[name]] * 4, rel=1e-12), name
    eps = json_here("--ranks", "4", "--mystery", str(demo.mysteries(0).index("epsilon") + 1))
    assert eps["scales"][0] == pytest.approx(1 / (g + 1e-6), rel=1e-12)
    assert eps["scales"][0] < eps["correct"]["scale"]
    text = run_here("--ranks", "4", "--mystery", str(demo.mysteries(0).index("epsilon") + 1))
    assert f"-> {1 / g:.12g}" in text and f"-> {1 / (g + 1e-6):.12g}" in text  # 12 digits: they differ


# ---------------------------------------------------------------------------
# the JSON: values only when asked; a bug's norms named as what they are


def test_json_leaves_the_values_out_unless_asked():
    out = run_here("--ranks", "4", "--json")
    assert len(out) < 4000  # not 4000 values on one line
    parsed = json.loads(out)
    assert "clipped" not in parsed and "clipped_replicated" not in parsed
    # the counts of values per rank (the shards, not the bias), named as counts, apart from the values
    assert parsed["values_per_rank"] == [1000] * 4 and "values" not in parsed
    assert json_here("--ranks", "2", "--shards", "[[3, 0], [0, 4, 5]]")["values_per_rank"] == [2, 3]
    full = json_here("--ranks", "4", "--values")
    assert [len(s) for s in full["clipped"]] == [1000] * 4
    assert len(full["clipped_replicated"]) == 4
    buggy = json_here("--ranks", "4", "--buggy")
    assert "clipped" not in buggy and "clipped" not in buggy["correct"]
    assert [len(s) for s in json_here("--ranks", "4", "--buggy", "--values")["correct"]["clipped"]] == [
        1000
    ] * 4


def test_buggy_json_separates_the_norm_used_from_the_true_global_norm():
    out = json_here("--ranks", "4", "--buggy")
    assert "global_norm" not in out and "scale" not in out  # rank 0's local norm is no global norm
    assert out["true_global_norm"] == pytest.approx(math.sqrt(215000), rel=1e-12)
    own = [math.sqrt(n * n + 2500) for n in (100.0, 400.0, 50.0, 200.0)]  # shard + own bias copy
    assert out["norms_used"] == pytest.approx(own, rel=1e-12)
    assert out["scales"] == pytest.approx([1 / n for n in own], rel=1e-12)
    assert out["correct"]["global_norm"] == out["true_global_norm"]
    plain = json_here("--ranks", "4")
    assert plain["global_norm"] == plain["true_global_norm"] == out["true_global_norm"]


# ---------------------------------------------------------------------------
# the plot's first panel: the norm each rank actually used


def test_plot_panel_1_shows_the_norm_each_rank_used():
    from gclip.demo.ranks import run_simulated

    opts = demo.parse_args(["--buggy", "--ranks", "4"], ranks=1)
    bars = norms_panel(run_simulated(opts), opts)
    local, used = bars.values()
    assert local == pytest.approx([math.sqrt(12500), 400, 50, 200], rel=1e-12)
    # rank 2's scale came from sqrt(50^2 + 50^2) = 70.71: its shard and its copy of the bias
    assert used[2] == pytest.approx(50 * math.sqrt(2), rel=1e-12)
    assert list(bars)[1] == "norm used by the bug (per-rank)"
    opts = demo.parse_args(["--mystery", "4", "--ranks", "4"], ranks=1)
    assert list(norms_panel(run_simulated(opts), opts))[1] == "norm used by the bug (mystery 4)"


def test_a_mystery_plot_names_no_bug(tmp_path):
    pytest.importorskip("matplotlib")
    from gclip.demo.figure import render_plot
    from gclip.demo.ranks import run_simulated

    opts = demo.parse_args(["--mystery", "4", "--ranks", "4", "--size", "50"], ranks=1)
    seen = []
    import gclip._lab.plots as plots

    original = plots.lines

    def spy(ax, x, series, **kw):
        seen.extend(series)
        return original(ax, x, series, **kw)

    plots.lines = spy
    try:
        render_plot(run_simulated(opts), opts, str(tmp_path / "m.png"))
    finally:
        plots.lines = original
    assert "per-rank" not in seen and "bug (mystery 4)" in seen
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------------------
# pytest-mpi: the demo on the real ranks of this job gives what --ranks R simulates


def _close(a, b) -> bool:
    """JSON values equal within 1e-12 relative; the strings JSON spells inf and NaN with, exactly."""
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(map(_close, a, b))
    if isinstance(a, str) or isinstance(b, str) or a is None or b is None:
        return a == b
    return a == pytest.approx(b, rel=1e-12, abs=1e-300)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "argv",
    [["--buggy"], ["--mystery", "5"], ["--buggy", "fp16-sumsq"], ["--seed", "3", "--buggy", "rms"]],
    ids=str,
)
def test_real_ranks_match_simulated_ranks(argv):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        command._main(["--json", *argv], comm)  # rank 0 prints
    real = comm.bcast(json.loads(buf.getvalue()) if comm.Get_rank() == 0 else None, root=0)
    sim = json_here("--ranks", str(comm.Get_size()), *argv)
    problems = []
    for key in ("true_global_norm", "norms_used", "scales", "clipped_norm", "max_abs_error"):
        if not _close(sim[key], real[key]):
            problems.append(key)
    verdicts = comm.allgather(problems)  # every rank agrees before asserting: no rank left waiting
    assert verdicts == [[]] * comm.Get_size(), verdicts
    assert real["simulated"] is False and sim["simulated"] is True
