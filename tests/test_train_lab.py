"""The trainer's report says what it means: the norms named per mode, the true global norm beside the
norm a bug used, the steps above the limit counted, and why a buggy run can end lower; --ranks R.

The oracle is a plain numpy replay of the training (train_replay: the model's
loss and gradient, sliced by hand, each rank's own copy of the bias), never
the trainer's loop or report.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from functools import cache

import numpy as np
import pytest

import train_replay
from conftest import mpirun, venv_env

STEPS = 60
LIMIT = 0.05
ARGS = ("--steps", str(STEPS), "--max-norm", str(LIMIT))


def here(*args: str) -> subprocess.CompletedProcess:
    """The trainer in one process (no mpirun)."""
    return subprocess.run(
        [sys.executable, "-m", "gclip.train", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**venv_env(), "NO_COLOR": "1"},
    )


@cache
def sim_json(*args: str) -> dict:
    proc = here(*ARGS, "--json", *args)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def replay(ranks: int, mode: str) -> dict:
    return train_replay.replay(ranks, mode, STEPS, LIMIT)


@pytest.mark.parametrize("mode", ["global", "per-rank"])
def test_json_names_every_norm_for_what_it_is(mode):
    args = ("--ranks", "4") + (("--buggy", mode) if mode != "global" else ())
    out = sim_json(*args)
    want = replay(4, mode)
    assert out["simulated"] is True and out["ranks"] == 4
    assert out["losses"] == pytest.approx(want["losses"], rel=1e-10)
    np.testing.assert_allclose(np.array(out["norms_used"]), np.array(want["used"]), rtol=1e-10)
    assert out["true_global_norms"] == pytest.approx(want["true"], rel=1e-10)
    assert out["update_norms"] == pytest.approx(want["update"], rel=1e-10)
    assert out["ranks_scaled"] == want["scaled"]
    above = sum(u > LIMIT * (1 + 1e-9) for u in want["update"])
    assert out["steps_above_limit"] == above
    assert out["steps_any_rank_scaled_down"] == sum(k > 0 for k in want["scaled"])
    assert out["steps_scaled_on_every_rank"] == sum(k == 4 for k in want["scaled"])
    assert "grad_norms" not in out  # the old name that hid rank 0's local norm
    assert "clipped_steps" not in out  # the old name, read as "steps the clip limited", which it is not
    if mode == "per-rank":
        assert out["same_norm_on_all_ranks"] is False
        # step 0: the same gradient, the true norm 1.305 beside rank 0's own 0.2261
        assert f"{out['true_global_norms'][0]:.4g}" == "1.305"
        assert f"{out['norms_used'][0][0]:.4g}" == "0.2261"
        assert above > STEPS // 3  # the update goes past the limit on many steps...
        unscaled = [k == 0 and u > LIMIT for k, u in zip(out["ranks_scaled"], out["update_norms"])]
        assert any(unscaled)  # ...some of them with no rank scaling down at all
        assert out["correct"]["steps_above_limit"] == 0
        assert out["correct"]["true_global_norms"] == pytest.approx(replay(4, "global")["true"], rel=1e-10)
    else:
        assert out["same_norm_on_all_ranks"] is True and above == 0


def _rows(text: str) -> dict[int, list[str]]:
    return {
        int(m.group(1)): m.group(0).split()[1:] for m in re.finditer(r"^\s+(\d+)\s+\d\.\d{6}.*$", text, re.M)
    }


def test_the_per_rank_table_cannot_be_misread():
    proc = here("--ranks", "4", "--buggy", "--steps", "200")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    head = text.splitlines()[2:4]
    assert re.search(r"norm used\s+true global\s+update\s+ranks that\s+update above", head[0]), head
    assert re.search(r"\(rank 0\)\s+norm\s+applied\s+scaled down\s+max_norm", head[1]), head
    rows = _rows(text)
    # step 0: the same gradient as the correct run; its true norm stands beside rank 0's
    assert rows[0][:3] == ["1.620677", "0.2261", "1.305"]
    # step 20: rank 0 used 0.04649, the true norm is 0.08664: no rank scaled down, yet the
    # update applied (0.08664) is above max_norm, and the row says so
    assert rows[20] == ["0.785380", "0.04649", "0.08664", "0.08664", "0/4", "yes"]
    words = " ".join(text.split())
    assert "scaled down on at least one rank: 52 of 200 steps (on every rank: 11)" in words
    assert "update applied above max_norm 0.05: 108 of 200 steps" in words
    assert "why the per-rank run ends lower (0.1065 against 0.1763), though it has the bug" in words
    assert "It took larger steps than the limit allows, so it is a different experiment" in words


def test_the_correct_table_and_a_same_norm_bug_label_their_column():
    correct = here(*ARGS, "--ranks", "2").stdout
    assert re.search(r"global norm\s+update", correct) and "(all ranks)" in correct
    assert "true global" not in correct and "why the" not in correct
    same = here(*ARGS, "--ranks", "2", "--buggy", "sum-of-norms").stdout
    assert re.search(r"norm used\s+true global", same) and "(all ranks)" in same and "(rank 0)" not in same
    assert "why the" not in same  # it clips too hard and ends higher: nothing to explain


def test_one_rank_prints_how_to_start_more():
    text = here("--steps", "3").stdout
    assert (
        "this ran on 1 rank" in text and "--ranks 4" in text and "mpirun -n 4 python -m gclip.train" in text
    )
    assert "1 rank +" in text and "rank(s)" not in text
    assert "this ran on 1 rank" not in here("--steps", "3", "--ranks", "2").stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--ranks", "0"], "invalid rank count"),
        (["--ranks", "3", "--layout", "dp=2"], "dp=2 = 2 ranks, but the world has 3"),
        (["--ranks", "3", "--layout", "pp=3"], "pp must be 1 or 2"),
    ],
)
def test_ranks_refuses_what_it_cannot_do(args, message):
    proc = here("--steps", "2", *args)
    assert proc.returncode == 2 and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_ranks_under_mpirun_is_refused_in_one_line():
    proc = mpirun(2, sys.executable, "-m", "gclip.train", "--ranks", "2", timeout=120, env=venv_env())
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--ranks simulates ranks in one process" in lines[0], proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("bug", [None, "per-rank"])
def test_simulated_ranks_train_as_real_ranks(bug):
    extra = ("--reproducible",) + (("--buggy", bug) if bug else ())
    proc = mpirun(
        4, sys.executable, "-m", "gclip.train", *ARGS, "--json", *extra, timeout=120, env=venv_env()
    )
    assert proc.returncode == 0, proc.stderr
    real = json.loads(proc.stdout)
    sim = sim_json("--ranks", "4", *extra)
    assert real["simulated"] is False
    assert sim["losses"] == real["losses"]  # == on floats from JSON: the same bits
    assert sim["norms_used"] == real["norms_used"]
    assert sim["update_norms"] == pytest.approx(real["update_norms"], rel=1e-12)
    assert sim["steps_above_limit"] == real["steps_above_limit"]


def test_plot_legend_counts_the_steps_above_the_limit(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from gclip.train import figure
    from gclip.train.loop import Config, train_simulated

    config = Config(STEPS, 0, 1.0, LIMIT, False, 2.0, simulated=True)
    runs = [train_simulated(config, "per-rank", 4), train_simulated(config, "global", 4)]
    labels = []
    import matplotlib.axes

    original = matplotlib.axes.Axes.plot

    def spy(self, *args, **kwargs):
        labels.append(kwargs.get("label"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    figure.plot(str(tmp_path / "t.png"), runs, config, 4)
    above = sum(u > LIMIT * (1 + 1e-9) for u in replay(4, "per-rank")["update"])
    assert f"per-rank: update above max_norm on {above}/{STEPS} steps, final loss" in " ".join(
        str(label) for label in labels
    )
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
