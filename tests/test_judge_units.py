"""The distributed judge's parts, in one process: cases, implied scales, hang reasons, returns.

Oracles are written here: norms by math.fsum over Python floats, scales by
hand, traces of hangs built event by event as a rank would send them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import ROOT
from gclip.conformance import hangs, implied
from gclip.conformance.layout_cases import frozen_ranks, make_layout_cases, parse_layout, simulate
from gclip.conformance.outcome import decode, encode, returned_arrays
from gclip.conformance.spread import make_rank_cases, norm_of


def _fsum_norm(ranks) -> float:
    return math.sqrt(math.fsum(float(v) ** 2 for arrays in ranks for a in arrays for v in a.ravel()))


# ---------------------------------------------------------------------------
# the cases


@pytest.mark.parametrize("size", [2, 3, 4])
def test_cases_cover_what_the_issue_asks_on_every_rank_count(size):
    cases = make_rank_cases(size, 120, seed=5)
    assert all(len(c.ranks) == size for c in cases)
    labels = [c.label for c in cases]
    assert sum(label.startswith("contract") for label in labels) == 35

    def holds(case, r):
        return sum(a.size for a in case.ranks[r])

    assert any(len(c.ranks[r]) >= 3 for c in cases for r in range(size))  # several arrays
    assert any(len(c.ranks[r]) == 0 for c in cases for r in range(size))  # no arrays
    assert any(c.ranks[r] and holds(c, r) == 0 for c in cases for r in range(size))  # only empty ones
    sizes = {a.size for c in cases for arrays in c.ranks for a in arrays}
    assert min(sizes) == 0 and max(sizes) >= 1000  # uneven sizes
    dtypes = {a.dtype.name for c in cases for arrays in c.ranks for a in arrays}
    assert dtypes == {"float32", "float64"}
    assert any(a.ndim >= 2 for c in cases for arrays in c.ranks for a in arrays)
    assert any(_fsum_norm(c.ranks) == 0 and any(holds(c, r) for r in range(size)) for c in cases)
    assert any(c.max_norm == 0 and _fsum_norm(c.ranks) > 0 for c in cases)
    assert any(0 < c.max_norm < _fsum_norm(c.ranks) for c in cases)  # clipped
    assert any(c.max_norm > _fsum_norm(c.ranks) > 0 for c in cases)  # unchanged


def test_the_contracts_checks_keep_their_shards_spread_over_the_ranks():
    cases = make_rank_cases(3, 0, seed=0)
    first = cases[0]  # contract N=1: [[3, 0], [0, 4]], limit 2
    assert first.label == "contract N=1: norm spans two shards"
    assert [[a.tolist() for a in r] for r in first.ranks] == [[[3.0, 0.0]], [[0.0, 4.0]], []]
    assert first.max_norm == 2.0


def test_cases_are_seeded_and_norm_of_agrees_with_fsum():
    a, b = make_rank_cases(3, 30, seed=2), make_rank_cases(3, 30, seed=2)
    assert [c.label for c in a] == [c.label for c in b]
    assert all(
        np.array_equal(x, y)
        for ca, cb in zip(a, b)
        for ra, rb in zip(ca.ranks, cb.ranks)
        for x, y in zip(ra, rb)
    )
    assert [c.max_norm for c in a] != [c.max_norm for c in make_rank_cases(3, 30, seed=3)]
    for c in a:
        assert norm_of(c) == pytest.approx(_fsum_norm(c.ranks), rel=1e-12)


# ---------------------------------------------------------------------------
# the scale a clip applied, the norm it implies


def test_applied_recovers_one_scale_and_flags_two():
    before = [np.array([3.0, -4.0]), np.array([12.0])]
    after = [b * 0.25 for b in before]
    got = implied.applied(before, after, 1e-12)
    assert got.scale == pytest.approx(0.25, rel=1e-15) and got.uniform
    mixed = implied.applied(before, [before[0] * 0.25, before[1] * 0.5], 1e-12)
    assert not mixed.uniform
    assert implied.applied([np.zeros(3)], [np.zeros(3)], 1e-12).scale is None


def test_implied_norm_and_its_hints():
    # shards of norms 3, 4 and 12: global 13
    sumsq, counts = [9.0, 16.0, 144.0], [1, 1, 1]
    assert implied.implied_norm(0.5, 2.0) == 4.0
    assert implied.implied_norm(1.0, 2.0) is None  # unclipped: any norm <= 2
    assert implied.norm_hints(13.0, sumsq, counts, "rank") == ["the global norm"]
    assert "the norm without rank 2" in implied.norm_hints(5.0, sumsq, counts, "rank")[0]  # sqrt(9 + 16)
    assert implied.norm_hints(19.0, sumsq, counts, "rank")[0].startswith("the sum of the local norms")
    assert implied.norm_hints(13.0 + 1e-6, sumsq, counts, "rank")[0].startswith("the global norm + 1e-6")
    assert "float32" in implied.norm_hints(13.0 * (1 + 3e-8), sumsq, counts, "rank")[0]
    assert "times the global norm" in implied.norm_hints(40.0, sumsq, counts, "rank")[0]


def test_each_ranks_first_or_last_array_left_out_is_a_hint():
    # rank 0 holds arrays of norms 3 and 4, rank 1 one of norm 12, rank 2 none: global norm 13
    parts = [[9.0, 16.0], [144.0], []]
    sumsq, counts = [25.0, 144.0, 0.0], [2, 1, 0]
    assert implied.norm_hints(3.0, sumsq, counts, "rank", parts=parts) == [
        "the norm without each rank's last array"  # sqrt(9): rank 0's 4 and rank 1's 12 left out
    ]
    assert implied.norm_hints(4.0, sumsq, counts, "rank", parts=parts) == [
        "the norm without each rank's first array"
    ]
    assert "each rank" not in " ".join(implied.norm_hints(3.0, sumsq, counts, "rank"))  # without parts
    # copies counted (a layout's global norm is below the sum): no such hint
    assert "each rank" not in " ".join(implied.norm_hints(3.0, sumsq, counts, "rank", 1e-9, 12.0, parts))


def test_unit_lines_name_the_ranks_own_norms():
    before = [[np.array([3.0])], [np.array([4.0])]]
    after = [[np.array([3.0 * 2 / 3])], [np.array([4.0 * 0.5])]]  # each clipped to 2 by its own norm
    units = [implied.applied(b, a, 1e-12) for b, a in zip(before, after)]
    lines = implied.unit_lines("rank", units, [9.0, 16.0], [1, 1], 2.0, 0.4, 5.0)
    assert lines[0] == "expected: scale 0.4 on every rank (global norm 5, max_norm 2)"
    assert "different scales" in lines[1]
    assert lines[2] == "  rank 0: scale 0.666667 (implies norm 3): its own norm"
    assert lines[3] == "  rank 1: scale 0.5 (implies norm 4): its own norm"


def test_a_scale_off_by_a_rounding_is_said_so_not_as_expected():
    # rank 0 holds float64 values (its scale known to ~1e-11), rank 1 float32 ones (to ~2e-6);
    # both applied 0.4 * (1 + 5e-8): a norm summed in float32, off by that much
    off = 0.4 * (1 + 5e-8)
    before = [[np.array([3.0])], [np.array([4.0], dtype=np.float32)]]
    after = [[b[0] * off] for b in before]
    units = [implied.applied(b, a, t) for b, a, t in zip(before, after, (1e-11, 2e-6))]
    lines = implied.unit_lines(
        "rank", units, [9.0, 16.0], [1, 1], 2.0, 0.4, 5.0, 2e-6, precision=[1e-11, 2e-6]
    )
    assert "as expected" not in lines[1]
    assert lines[1].endswith("on every rank, +5e-08 relative off the expected")
    assert lines[2].endswith("is the global norm off by -5e-08 relative (rounding, e.g. float32 arithmetic)")
    # known only as precisely as float32 allows, the same scale is the expected one
    loose = implied.unit_lines("rank", units, [9.0, 16.0], [1, 1], 2.0, 0.4, 5.0, 2e-6, precision=[2e-6] * 2)
    assert loose[1].endswith("as expected")


def test_unchanged_values_are_blamed_only_where_the_norm_is_above_max_norm():
    before = [[np.array([3.0])], [np.array([4.0])]]  # global norm 5
    kept = [implied.applied(b, b, 1e-11) for b in before]
    above = implied.unit_lines("rank", kept, [9.0, 16.0], [1, 1], 2.0, 0.4, 5.0, precision=[1e-11] * 2)
    assert above[1] == "applied: the same left unchanged (scale 1) on every rank"
    assert above[2] == "  left unchanged although the global norm 5 is above max_norm"
    # within max_norm the expected scale is 1: values nudged by 1e-9 (float64, told to 1e-11) are
    # no clip, but not "left unchanged although ... above max_norm" either
    nudged = [implied.applied(b, [b[0] * (1 - 1e-9)], 1e-11) for b in before]
    within = implied.unit_lines("rank", nudged, [9.0, 16.0], [1, 1], 10.0, 1.0, 5.0, precision=[1e-11] * 2)
    assert not any("above max_norm" in line for line in within)
    assert within[-1] == (
        "  the global norm 5 is within max_norm: a clip leaves the values as they are, "
        "and these were scaled by -1e-09 relative"
    )


def test_norms_equal_to_the_global_one_are_no_hint():
    # only rank 0 holds values: its own norm, the sum and the largest of the local norms are the global
    # norm, so a norm off by 6e-8 is a rounding, not one of them
    hints = implied.norm_hints(5.0 * (1 - 6e-8), [25.0, 0.0, 0.0], [2, 0, 0], "rank", implied.SAME)
    assert hints == ["the global norm off by -6e-08 relative (rounding, e.g. float32 arithmetic)"]


def test_an_overflowed_norm_is_said_so():
    before = [[np.array([3e100, 4e100])]]
    units = [implied.applied(before[0], [np.zeros(2)], 1e-11)]
    lines = implied.unit_lines("rank", units, [25e200], [2], 1e100, 0.2, 5e100)
    assert lines[1] == "applied: the same scale 0 (implies norm inf) on every rank"
    assert lines[2] == (
        "  the implied norm is inf, the global norm 5e+100: its sum of squares overflowed "
        "(in float32 it does above a norm of 1.8e+19)"
    )


def test_grade_counts_norms_beyond_float32_apart_only_beside_near_misses():
    from gclip.conformance.verdict import grade

    norms, errors = [1.0, 2.0, 1e100, 3.0], [1e-7, 2e-7, 1.0, 0.0]
    level, how = grade(norms, errors, [0, 1, 2], None, None)
    assert level == "near miss"
    assert how == (
        "off by at most 2e-07 relative; on 1 check with a norm above 1.8e+19 (float32 overflows) by up to 1"
    )
    assert grade(norms, [1e-7, 1e-3, 1.0, 0.0], [0, 1, 2], None, None)[0] == "fail"  # far off in range
    assert grade(norms, [0.0, 0.0, 1.0, 0.0], [2], None, None)[0] == "fail"  # only the overflow fails


def test_torchs_clip_on_each_shard_is_labelled_its_own_norm_plus_the_epsilon():
    before = [[np.array([3.0])], [np.array([4.0])]]
    after = [[np.array([3.0 * 2 / (3 + 1e-6)])], [np.array([4.0 * 2 / (4 + 1e-6)])]]
    units = [implied.applied(b, a, 1e-11) for b, a in zip(before, after)]
    lines = implied.unit_lines("rank", units, [9.0, 16.0], [1, 1], 2.0, 0.4, 5.0, 1e-11)
    assert lines[2] == "  rank 0: scale 0.666666 (implies norm 3): its own norm + 1e-6 (torch's epsilon)"
    assert lines[3] == "  rank 1: scale 0.5 (implies norm 4): its own norm + 1e-6 (torch's epsilon)"
    exact = [implied.applied(b, [b[0] * (2 / n)], 1e-11) for b, n in zip(before, (3.0, 4.0))]
    assert implied.unit_lines("rank", exact, [9.0, 16.0], [1, 1], 2.0, 0.4, 5.0, 1e-11)[2].endswith(
        "(implies norm 3): its own norm"
    )


# ---------------------------------------------------------------------------
# hangs: the reason, from each rank's events


def _events(*spec):
    """('enter', 'Allreduce'), ('leave', ...), ('returned',), ('raised', 'ValueError: x')."""
    out, n = [{"e": "start", "c": 0}], 0
    for item in spec:
        if item[0] == "enter":
            n += 1
            out.append({"e": "enter", "c": 0, "op": item[1], "n": n})
        elif item[0] == "leave":
            out.append(
                {"e": "leave", "c": 0, "op": item[1], "n": n, **({"raised": True} if item[2:] else {})}
            )
        elif item[0] == "returned":
            out.append({"e": "outcome", "c": 0, "kind": "value"})
        else:
            out.append({"e": "outcome", "c": 0, "kind": "raised", "msg": item[1]})
    return hangs.trace_of(out)


def test_a_rank_that_skips_the_collective_is_named():
    waiting = _events(("enter", "Allreduce"))
    skipped = _events(("returned",))
    stuck = hangs.explain([waiting, waiting, skipped], 2.0)
    assert stuck.reason == (
        "rank 2 returned without entering the collective; ranks 0, 1 waited in Allreduce (ended after 2 s)"
    )
    assert stuck.kind == "skipped" and stuck.culprits == (2,)


def test_an_exception_on_one_rank_is_named_with_where_it_came_from():
    waiting = _events(("enter", "Allreduce"))
    before = _events(("raised", "ValueError: boom"))
    inside = _events(("enter", "Allreduce"), ("leave", "Allreduce", "raised"), ("raised", "TypeError: dtype"))
    assert hangs.explain([before, waiting, waiting]).reason == (
        "rank 0 raised ValueError: boom without entering the collective; ranks 1, 2 waited in Allreduce"
    )
    assert (
        "raised TypeError: dtype inside Allreduce (its 1st collective)"
        in hangs.explain([waiting, inside]).reason
    )


def test_deadlocks_deaths_and_busy_ranks():
    recv, reduce = _events(("enter", "recv")), _events(("enter", "Allreduce"))
    stuck = hangs.explain([recv, reduce, reduce])
    assert stuck.kind == "deadlock"
    assert stuck.reason.startswith("deadlock: rank 0 waited in recv, ranks 1, 2 waited in Allreduce")
    dead = _events()._replace(died="its process ended")
    stuck = hangs.explain([reduce, reduce, dead])
    assert stuck.kind == "died" and stuck.culprits == (2,)
    assert stuck.reason.startswith("rank 2 died during the call (its process ended), without entering")
    busy = _events()
    stuck = hangs.explain([reduce, busy, reduce])
    assert stuck.kind == "busy" and stuck.reason.startswith("rank 1 did not return")
    later = _events(("enter", "Allreduce"), ("leave", "Allreduce"), ("returned",))
    two = _events(("enter", "Allreduce"), ("leave", "Allreduce"), ("enter", "Allreduce"))
    assert (
        "rank 2 returned after 1 collective, without entering the 2nd"
        in hangs.explain([two, two, later]).reason
    )


def test_rank_lists_stay_plain_for_few_ranks():
    assert hangs.rank_list([1, 0]) == "0, 1"
    assert hangs.rank_list([0, 1, 2, 3, 7]) == "0-3, 7"


# ---------------------------------------------------------------------------
# what a call returned


def test_every_return_of_the_same_layout_is_accepted():
    given = [np.arange(3.0), np.ones((2, 2), dtype=np.float32)]
    halves = [g * 0.5 for g in given]

    class ClipResultLike:
        grads = halves
        total_norm = 1.0

    for value in (
        halves,
        tuple(halves),
        iter(halves),
        (halves, 2.0),
        ClipResultLike(),
        [h.tolist() for h in halves],
    ):
        arrays, why = returned_arrays(value, given)
        assert why is None, why
        assert [a.shape for a in arrays] == [(3,), (2, 2)]
        assert np.allclose(arrays[0], halves[0]) and np.allclose(arrays[1], halves[1])
    arrays, why = returned_arrays(None, given)  # in place
    assert why is None and np.array_equal(arrays[0], given[0])


@pytest.mark.parametrize(
    "value,reason",
    [
        (np.zeros(3), "not a list of arrays"),
        (3.0, "not a list of arrays"),
        ([np.zeros(3)], "returned 1 arrays for the 2"),
        ([np.zeros(3), np.zeros(3)], "array 1 with 3 values, given 4"),
        ([np.zeros(3), np.array(["a"] * 4)], "not numbers"),
        # the values all there, in another shape: an optimizer would break
        ([np.zeros(3), np.zeros(4)], "returned array 1 of shape (4,) for one of shape (2, 2)"),
        ([np.zeros(3), [0.0, 0.0, 0.0, 0.0]], "returned array 1 of shape (4,) for one of shape (2, 2)"),
        ([np.zeros((3, 1)), np.zeros((2, 2))], "returned array 0 of shape (3, 1) for one of shape (3,)"),
    ],
)
def test_returns_that_are_no_clip_say_why(value, reason):
    arrays, why = returned_arrays(value, [np.zeros(3), np.zeros((2, 2))])
    assert arrays is None and reason in why


def test_a_transposed_return_is_no_clip_but_an_empty_list_is_any_empty_array():
    given = [np.ones((3, 4)), np.ones((2, 3, 2)), np.zeros((0, 3))]
    arrays, why = returned_arrays([given[0].T, given[1], given[2]], given)
    assert arrays is None and why == "returned array 0 of shape (4, 3) for one of shape (3, 4)"
    arrays, why = returned_arrays([given[0], given[1].reshape(2, 2, 3), []], given)
    assert arrays is None and why == "returned array 1 of shape (2, 2, 3) for one of shape (2, 3, 2)"
    arrays, why = returned_arrays([g.tolist() for g in given], given)  # [] for the (0, 3) array
    assert why is None and [a.shape for a in arrays] == [(3, 4), (2, 3, 2), (0, 3)]
    arrays, why = returned_arrays([given[0], given[1], np.zeros(0)], given)  # an array keeps its shape
    assert arrays is None and why == "returned array 2 of shape (0,) for one of shape (0, 3)"


def test_arrays_travel_exactly():
    arrays = [np.array([0.1, -1e-300, np.inf]), np.array([[1.5, 2.25]], dtype=np.float32), np.zeros(0)]
    back = decode(encode(arrays))
    for a, b in zip(arrays, back):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


# ---------------------------------------------------------------------------
# layouts


def test_layout_cases_and_the_bugs_that_show_on_them():
    shape = parse_layout("pp=2,tp=2")
    assert frozen_ranks(shape) == [2, 3]
    cases = make_layout_cases(shape, 2, seed=0)
    assert any(c.frozen for c in cases) and {c.dtype for c in cases} == {"float32", "float64"}
    clipped = cases[0]
    correct = simulate(clipped, shape)
    # the oracle: the clipped model's norm is the limit (every tensor whole, once)
    from gclip._lab.layout_run import true_norm

    assert clipped.max_norm == pytest.approx(true_norm(False) / 2, rel=1e-12)
    for name in ("tp-duplicates-summed", "pp-stages-apart", "tied-counted-twice", "double-count"):
        out = simulate(clipped, shape, name)
        variants = out if isinstance(out, tuple) else (out,)
        assert all(
            any(
                not np.allclose(x, y, rtol=1e-9, atol=0) for rx, ry in zip(v, correct) for x, y in zip(rx, ry)
            )
            for v in variants
        ), name
    assert simulate(clipped, shape, "skip-collective") is None


@pytest.mark.parametrize("text", ["pp=5", "dp=2,dp=2", "xx=2", "tp=7"])
def test_bad_layouts_are_refused(text):
    from gclip.errors import GclipError

    with pytest.raises(GclipError):
        parse_layout(text)


# ---------------------------------------------------------------------------
# started under mpirun: the judge refuses, and its advice is the command that judges the function


def _refusal(monkeypatch, *argv: str) -> str:
    from gclip._lab.cli import UsageError
    from gclip.conformance import command

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PMI_SIZE", "3")  # what mpirun -n 3 (Hydra) tells each process
    with pytest.raises(UsageError) as info:
        command._main(list(argv))
    message = str(info.value)
    assert message.startswith("started as one of 3 processes (PMI_SIZE=3)") and "\n" not in message
    return message


def test_under_mpirun_a_shards_function_is_sent_to_one_process(monkeypatch):
    # lab/my_clip.py defines clip_shards(shards, limit): judged without --ranks
    message = _refusal(monkeypatch, "lab/my_clip.py:clip_shards")
    assert message.endswith("without mpirun: python -m gclip.conformance lab/my_clip.py:clip_shards")
    assert "--ranks" not in message
    message = _refusal(monkeypatch, "lab/mystery_b.py:clip_shards", "--random", "5")
    assert message.endswith("python -m gclip.conformance lab/mystery_b.py:clip_shards --random 5")


def test_under_mpirun_a_comm_function_is_sent_to_ranks_of_mpiruns_size(monkeypatch):
    # lab/distributed/my_clip.py defines clip(grads, max_norm, comm): judged with --ranks
    message = _refusal(monkeypatch, "lab/distributed/my_clip.py:clip")
    assert message.endswith("python -m gclip.conformance lab/distributed/my_clip.py:clip --ranks 3")


def test_under_mpirun_the_users_ranks_are_kept(monkeypatch):
    message = _refusal(monkeypatch, "lab/distributed/my_clip.py:clip", "--ranks", "4")
    assert message.endswith("python -m gclip.conformance lab/distributed/my_clip.py:clip --ranks 4")
    assert "--ranks 3" not in message


def test_under_mpirun_an_unknown_signature_gets_both_forms(monkeypatch, tmp_path):
    path = tmp_path / "f.py"
    path.write_text("def clip(*args):\n    return args[0]\n")
    message = _refusal(monkeypatch, f"{path}:clip")
    assert f"python -m gclip.conformance {path}:clip for a (shards, limit) function" in message
    assert f"python -m gclip.conformance {path}:clip --ranks 3 for a distributed" in message
