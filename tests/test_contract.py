"""The seed contract, single process: 7 checks x N = 1..5, and the two faulty modes."""

from __future__ import annotations

import math

import numpy as np
import pytest

import gclip
import gclip.gallery
import seed_oracle
from gclip.gallery.contract import seed_checks

NS = range(1, 6)
CASES = [(n, c) for n in NS for c in seed_checks(n)]


def test_there_are_35_checks():
    assert len(CASES) == 35
    assert len({(n, c.label) for n, c in CASES}) == 35


@pytest.mark.parametrize(("n", "check"), CASES, ids=[f"N{n}-{c.label}" for n, c in CASES])
def test_seed_check(n, check):
    assert gclip.clip_shards(check.shards, check.limit) == check.expected


@pytest.mark.parametrize("n", NS)
def test_seed_checks_match_the_record_expectations(n):
    """Our transcription of the checks equals what the record's own code expects."""
    recorded = seed_oracle.observations("broken", n)
    ours = seed_checks(n)
    assert [(c.label, c.expected) for c in ours] == [(label, exp) for label, _, exp in recorded]


def _simulated(check, mode):
    if not check.shards:
        return []
    results = gclip.gallery.clip_simulated(
        [np.asarray(s, dtype=float) for s in check.shards], check.limit, mode=mode
    )
    return [gclip.contract.rounded(r.grads) for r in results]


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize(("mode", "implementation"), [("per-rank", "broken"), ("rms", "attempt")])
def test_faulty_modes_reproduce_the_record(n, mode, implementation):
    recorded = seed_oracle.observations(implementation, n)
    for check, (label, actual, _) in zip(seed_checks(n), recorded):
        assert check.label == label
        assert _simulated(check, mode) == actual, label


def test_the_recorded_verification_is_what_the_oracle_prints(seed_record):
    """The oracle runs the record's code faithfully: N = 1 gives the recorded observations."""
    for impl in ("broken", "attempt"):
        recorded = seed_record["verification"][impl]["observations"]
        assert [o["actual"] for o in recorded] == [a for _, a, _ in seed_oracle.observations(impl, 1)]


def test_global_mode_passes_where_the_faulty_ones_fail():
    check = seed_checks(1)[0]  # norm spans two shards
    assert _simulated(check, "global") == check.expected
    assert _simulated(check, "per-rank") != check.expected
    assert _simulated(check, "rms") != check.expected


@pytest.mark.parametrize(
    ("shards", "limit", "error"),
    [
        ([[1.0]], -1.0, gclip.GclipValueError),
        ([[1.0]], math.nan, gclip.GclipValueError),
        ([[1.0]], math.inf, gclip.GclipValueError),
        ([[1.0]], "2", gclip.GclipTypeError),
        ([[1.0]], True, gclip.GclipTypeError),
        ([["a"]], 1.0, gclip.GclipTypeError),
        ([[[1.0]]], 1.0, gclip.GclipTypeError),
        ([1.0], 1.0, gclip.GclipTypeError),
        ("x", 1.0, gclip.GclipTypeError),
        ([[True]], 1.0, gclip.GclipTypeError),
    ],
)
def test_bad_input_is_a_clear_error(shards, limit, error):
    with pytest.raises(error) as info:
        gclip.clip_shards(shards, limit)
    assert "\n" not in str(info.value)


def test_layout_is_kept_and_ints_accepted():
    out = gclip.clip_shards([[3, 0], [], [0, 4]], 10)
    assert out == [[3.0, 0.0], [], [0.0, 4.0]]
    out = gclip.clip_shards([[3, 0], [], [0, 4]], 1)
    assert [len(s) for s in out] == [2, 0, 2]
    assert out[0][0] == round(0.6, 12) and out[2][1] == round(0.8, 12)
