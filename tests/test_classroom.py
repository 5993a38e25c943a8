"""The teacher's summary (python -m gclip.classroom DIR), on verdicts the judge really wrote.

A class folder is made by running the judge with --json on the lab's files, one file per
"student" (the starter, three mysteries, the fixed file, a file that raises when loaded, a refused
command's empty output, a file that is no verdict, and one distributed verdict on 2 real ranks).
The expected summary is computed here from those JSON files alone: who passed, the fingerprints
counted, the checks failed by most students, and what the ranks did.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from conftest import ROOT, venv_env

JUDGED = {  # student -> the judge's command line (its target and flags)
    "ada": ["lab/my_clip.py:clip_shards"],
    "bo": ["lab/mystery_a.py:clip_shards"],
    "cy": ["lab/mystery_b.py:clip_shards"],
    "di": ["lab/answers/good_clip.py:clip_shards"],
    "ed": ["lab/mystery_d.py:clip_shards"],
    "fay": ["lab/mystery_c.py:clip_shards"],
}


def _judge(argv: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gclip.conformance", *argv, "--json", "--random", "5"],
        capture_output=True, text=True, timeout=300, env=venv_env(), cwd=cwd,
    )  # fmt: skip


@pytest.fixture(scope="module")
def klass(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("class")
    for student, argv in JUDGED.items():
        (folder / f"{student}.json").write_text(_judge(argv).stdout)
    broken = folder.parent / "broken.py"
    broken.write_text("raise RuntimeError('a typo at import')\n")
    (folder / "gus.json").write_text(_judge([f"{broken}:clip_shards"]).stdout)  # did not load
    (folder / "hal.json").write_text(_judge(["lab/no_such_file.py:clip_shards"]).stdout)  # refused: empty
    (folder / "ivy.json").write_text('{"hello": "world"}\n')  # not a verdict
    (folder / "notes.txt").write_text("not read: only .json files are")
    dist = _judge(["lab/distributed/my_clip.py:clip", "--ranks", "2"])
    assert dist.returncode == 1, dist.stderr
    (folder / "jo.json").write_text(dist.stdout)
    return folder


def _summary(folder: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gclip.classroom", str(folder), *extra],
        capture_output=True, text=True, timeout=60, env=venv_env(),
    )  # fmt: skip


def _verdicts(folder: Path) -> dict[str, dict]:
    out = {}
    for path in sorted(folder.glob("*.json")):
        text = path.read_text()
        try:
            data = json.loads(text)
        except ValueError:
            continue
        if isinstance(data, dict) and "target" in data and "passed" in data:
            out[path.stem] = data
    return out


def test_the_summary_says_who_passed_and_the_bugs_found(klass):
    proc = _summary(klass, "--json")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    verdicts = _verdicts(klass)
    assert got["students"] == 10  # every .json file, verdict or not
    assert got["passed"] == sorted(s for s, v in verdicts.items() if v["passed"]) == ["di"]
    failing = {s: v for s, v in verdicts.items() if not v["passed"] and "error" not in v}
    want = Counter(v["fingerprint"] for v in failing.values())
    assert {b["bug"]: len(b["students"]) for b in got["bugs_found"]} == dict(want)
    assert want["per-rank"] == 2 and want["sum-of-norms"] == 1  # ada and jo; bo: the lab's key
    by_student = {r["student"]: r for r in got["rows"]}
    assert by_student["cy"]["grade"] == "near miss" and by_student["gus"]["grade"] == "did not load"
    assert "a typo at import" in by_student["gus"]["problem"]
    assert by_student["hal"]["grade"] == "no verdict" and "empty" in by_student["hal"]["problem"]
    assert by_student["ivy"]["grade"] == "no verdict" and "notes" not in by_student
    for s, v in failing.items():
        assert by_student[s]["failed"] == v["failed"] and by_student[s]["fingerprint"] == v["fingerprint"]


def test_the_common_mistakes_are_the_checks_most_students_failed(klass):
    got = json.loads(_summary(klass, "--json").stdout)
    counts: Counter[str] = Counter()
    for v in _verdicts(klass).values():
        if v["passed"] or "error" in v:
            continue
        labels = {f["check"] for f in v["failures"] if not f["check"].startswith("random")}
        counts.update({label.split(": ", 1)[-1] for label in labels})
    listed = got["common_mistakes"]
    assert listed and len(listed) <= 5
    top = max(counts.values())
    assert listed[0]["students"] == top and counts[listed[0]["check"]] == top
    assert all(counts[m["check"]] == m["students"] for m in listed)
    assert [m["students"] for m in listed] == sorted((m["students"] for m in listed), reverse=True)
    # on real ranks: jo's per-rank clip entered no collective, as its verdict's ranks say
    jo = _verdicts(klass)["jo"]
    assert any(r["collectives"] == [] for f in jo["failures"] for r in f["ranks"])
    assert {"what": "a rank entered no collective (it clipped by its own numbers)", "students": 1} in got[
        "on_ranks"
    ]


def test_the_text_names_each_student_and_each_bug(klass):
    proc = _summary(klass)
    assert proc.returncode == 0 and proc.stderr == ""
    text = proc.stdout
    assert text.startswith("gclip classroom: 10 students: ")
    assert "Passed (1): di" in text
    for student in [*JUDGED, "gus", "hal", "ivy", "jo"]:
        assert f"\n  {student} " in text, student
    assert "per-rank (2): each rank clips its shard by its own local norm" in text
    assert "unknown (1): fails like no bug of the gallery" in text
    assert "On real ranks:" in text


def test_a_folder_with_no_verdict_or_none_at_all_is_one_line_and_exit_2(tmp_path):
    for folder, said in ((tmp_path / "missing", "no such folder"), (tmp_path, "no .json file in")):
        proc = _summary(folder)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and said in proc.stderr, proc.stderr


def test_a_closed_pipe_ends_the_summary_quietly(klass):
    """``python -m gclip.classroom DIR | head``: no BrokenPipeError once head has its lines."""
    from test_entry_points import CLOSED_PIPE, closed_stdout

    proc = closed_stdout("gclip.classroom", str(klass))
    assert (proc.returncode, proc.stderr) == (CLOSED_PIPE, ""), proc
