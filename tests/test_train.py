"""The trainer: `mpirun -n R python -m gclip.train`, run as a subprocess under a timeout.

The key promise: with --reproducible the loss trajectory has the same bits for
R = 1, 2, 4. The rest: clipping is active on many (not all) steps, the loss
falls, a per-rank bug departs from the correct run, --plot writes a PNG, bad
input exits 2 with one line. The model's math is checked in-process against
finite differences and against a plain single-process training loop.
"""

from __future__ import annotations

import json
import math
import sys
from functools import cache

import numpy as np
import pytest

from conftest import mpirun
from gclip import train

STEPS = 40
slow = pytest.mark.slow  # these launch mpirun
BASE = ("--steps", str(STEPS), "--max-norm", "0.1", "--lr", "1.0")


@cache
def run_json(n: int, *args: str) -> dict:
    proc = mpirun(n, sys.executable, "-m", "gclip.train", *BASE, "--json", *args, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout  # rank 0 alone prints, one line
    return json.loads(lines[0])


@slow
@pytest.mark.parametrize("n", [2, 4])
def test_reproducible_losses_are_bitwise_equal_across_rank_counts(n):
    one, many = run_json(1, "--reproducible"), run_json(n, "--reproducible")
    assert (one["ranks"], many["ranks"]) == (1, n)
    assert len(many["losses"]) == STEPS
    assert many["losses"] == one["losses"]  # == on floats read from JSON: the same bits
    assert many["final_loss"] == one["final_loss"]
    assert [n[0] for n in many["norms_used"]] == [n[0] for n in one["norms_used"]]
    assert many["true_global_norms"] == one["true_global_norms"]
    assert many["digest"] == one["digest"]


@slow
def test_clipping_is_active_on_many_steps_but_not_all():
    out = run_json(2, "--reproducible")
    assert out["mode"] == "global"
    assert 0 < out["steps_any_rank_scaled_down"] < STEPS
    assert out["steps_any_rank_scaled_down"] >= 5
    norms = [n[0] for n in out["norms_used"]]
    assert all(len(set(n)) == 1 for n in out["norms_used"])  # one global norm, used by every rank
    assert norms == pytest.approx(out["true_global_norms"], rel=1e-12)
    assert norms[0] > 0.1  # the first step clips...
    applied = out["update_norms"]
    assert applied[0] == pytest.approx(0.1, rel=1e-12)  # ...down to max_norm exactly
    assert max(applied) <= 0.1 * (1 + 1e-12)  # and never lets more through
    assert sum(g > 0.1 for g in norms) == out["steps_any_rank_scaled_down"]
    assert out["steps_above_limit"] == 0
    assert out["ranks_scaled"] == [2 if g > 0.1 else 0 for g in norms]  # both ranks or none


@slow
def test_loss_decreases():
    losses = run_json(2, "--reproducible")["losses"]
    assert losses[-1] < 0.5 * losses[0]
    assert run_json(2, "--reproducible")["final_loss"] < losses[-1]


@slow
def test_per_rank_bug_departs_from_the_correct_run():
    correct = run_json(4, "--reproducible")
    buggy = run_json(4, "--reproducible", "--buggy")
    assert buggy["mode"] == "per-rank"
    assert buggy["losses"] != correct["losses"]
    assert buggy["losses"][0] == correct["losses"][0]  # same start
    assert buggy["departs_at"] == 1
    assert buggy["correct"]["losses"] == correct["losses"]  # its reference run is the correct run
    # four shards, each clipped to 0.1 alone: the whole update reaches sqrt(4) x 0.1
    assert max(buggy["update_norms"]) > 1.5 * 0.1
    assert min(buggy["cosines"]) < 0.999  # and its direction is no longer the gradient's
    assert min(correct["cosines"]) > 1 - 1e-9


@slow
def test_per_rank_on_one_rank_is_the_correct_clip():
    out = run_json(1, "--reproducible", "--buggy", "per-rank")
    assert out["departs_at"] is None
    assert out["losses"] == out["correct"]["losses"]


@slow
def test_sharded_run_matches_a_plain_single_process_loop():
    """An independent loop: the full gradient, its norm by numpy, the same update."""
    out = run_json(2)
    x, y = train.make_data(0)
    flat, b2 = train.init_params(0)
    losses = []
    for _ in range(STEPS):
        loss, g, gb2 = train.loss_and_grad(flat, b2, x, y)
        norm = math.sqrt(float(g @ g + gb2 @ gb2))
        scale = min(1.0, 0.1 / norm)
        flat, b2 = flat - 1.0 * scale * g, b2 - 1.0 * scale * gb2
        losses.append(loss)
    assert out["losses"] == pytest.approx(losses, rel=1e-10)


def test_gradient_matches_finite_differences():
    x, y = train.make_data(3, per_class=20)
    flat, b2 = train.init_params(3)
    _, g, gb2 = train.loss_and_grad(flat, b2, x, y)
    params = np.concatenate([flat, b2])
    analytic = np.concatenate([g, gb2])
    h = 1e-6
    numeric = np.empty_like(params)
    for i in range(params.size):
        up, down = params.copy(), params.copy()
        up[i] += h
        down[i] -= h
        k = flat.size
        numeric[i] = (
            train.loss_and_grad(up[:k], up[k:], x, y)[0] - train.loss_and_grad(down[:k], down[k:], x, y)[0]
        ) / (2 * h)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("n,ranks", [(99, 4), (8, 3), (3, 5), (10, 1)])
def test_shard_bounds_cover_the_vector_once(n, ranks):
    counts, displs = train.shard_bounds(n, ranks)
    assert sum(counts) == n and len(counts) == ranks
    assert max(counts) - min(counts) <= 1
    assert displs == [sum(counts[:r]) for r in range(ranks)]


@slow
def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "train.png"
    proc = mpirun(2, sys.executable, "-m", "gclip.train", *BASE, "--buggy", "--plot", str(png), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000
    assert "per-rank run departs" in proc.stdout


@slow
def test_plot_without_matplotlib_is_a_usage_error_on_every_rank(tmp_path):
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('matplotlib is hidden by the test')\n")
    env = {"PYTHONPATH": str(tmp_path / "fake")}
    png = tmp_path / "x.png"
    proc = mpirun(
        2, sys.executable, "-m", "gclip.train", "--steps", "3", "--plot", str(png), env=env, timeout=60
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "matplotlib" in proc.stderr and "Traceback" not in proc.stderr
    assert not png.exists()


@slow
@pytest.mark.parametrize(
    "args",
    [
        ["--steps", "0"],
        ["--steps", "ten"],
        ["--lr", "-1"],
        ["--lr", "nan"],
        ["--max-norm", "-0.5"],
        ["--max-norm", "inf"],
        ["--seed", "-3"],
        ["--buggy", "no-such-bug"],
        ["--buggy", "global"],
        ["--plot", "curves.txt"],
        ["--plot", "no/such/folder/x.png"],
        ["--bogus"],
    ],
)
def test_bad_input_exits_2_with_one_line(args):
    proc = mpirun(2, sys.executable, "-m", "gclip.train", *args, timeout=60)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # rank 0 alone says it, once
    assert lines[0].startswith("gclip.train: error:")
    assert proc.stdout == ""
