"""docs/tutorial.md quotes the demo on the default data (--seed 0): its excerpts and its gallery table
must be what the demo prints today, so that the tutorial's numbers stay reproducible.

- each ``text`` block that starts with ``$ mpirun -n R ...`` is run through conftest.mpirun (R <= 4),
  or for the 8-rank layout runs with ``--ranks R`` instead (simulated ranks: the same report, as
  test_demo_layout.py checks against mpirun -n 8); its lines must appear in the output in order
  (``...`` skips; the host column of table 1 is the machine's own name, so it is left out);
- the gallery table's numbers are checked against ``--buggy NAME --json`` on 4 simulated ranks, and
  its norms against hand arithmetic on the shards' norms 100, 400, 50, 200 and the bias' 50.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT, OneRankComm, mpirun, venv_env
from gclip.demo import command

TUTORIAL = ROOT / "docs" / "tutorial.md"
HOST_ROW = re.compile(r"^(\s+\d+)  (\S+)(\s+\d+(?:\+\d+)?\s)")


def excerpts() -> list[tuple[str, list[str]]]:
    out = []
    for block in re.findall(r"^```text\n(.*?)^```", TUTORIAL.read_text(), flags=re.S | re.M):
        first, *lines = block.splitlines()
        if first.startswith("$ mpirun -n ") and (int(first.split()[3]) <= 4 or "--layout" in first):
            out.append((first[2:], lines))
    return out


def no_host(line: str) -> str:
    return HOST_ROW.sub(lambda m: f"{m.group(1)}  HOST{m.group(3)}", line.rstrip())


def test_the_tutorial_has_excerpts_to_check():
    assert len(excerpts()) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("cmd,lines", excerpts(), ids=[c for c, _ in excerpts()])
def test_every_excerpt_is_what_the_demo_prints(cmd, lines):
    words = shlex.split(cmd)
    assert words[3] == "python"
    env = {**venv_env(), "NO_COLOR": "1"}
    if int(words[2]) > 4:  # a layout on 8 ranks: simulated
        proc = subprocess.run(
            [sys.executable, *words[4:], "--ranks", words[2]],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
    else:
        proc = mpirun(int(words[2]), sys.executable, *words[4:], timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    printed = [no_host(line) for line in proc.stdout.splitlines()]
    at = 0
    for line in lines:
        if line.strip() == "...":
            continue
        want = no_host(line)
        assert want in printed[at:], (cmd, line)
        at = printed.index(want, at) + 1


def demo_json(*argv: str) -> dict:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert command._main(["--json", "--ranks", "4", *argv], OneRankComm()) == 0
    return json.loads(buf.getvalue())


def table() -> dict[str, list[str]]:
    """bug -> [its note, the norm used, the clipped norm, the cosine, the max error]."""
    rows = re.findall(r"^\| `([a-z0-9-]+)`([^|]*)\| (.*) \|$", TUTORIAL.read_text(), flags=re.M)
    return {name: [note.strip()] + [c.strip() for c in cells.split(" | ")] for name, note, cells in rows}


def test_the_gallery_table_is_the_demos_default_data():
    rows = table()
    assert len(rows) == 10
    local = [math.sqrt(100**2 + 50**2), 400.0, 50.0, 200.0]  # rank 0 counts the bias
    g = math.sqrt(100**2 + 400**2 + 50**2 + 200**2 + 50**2)
    by_hand = {
        "rms": g / math.sqrt(4002),
        "sum-of-norms": sum(local),
        "mean-of-norms": sum(local) / 4,
        "rank0-norm": local[0],
        "max-of-norms": 400.0,
        "epsilon": g,
        "double-count": math.sqrt(g * g + 3 * 50**2),
    }
    for name, (note, used, clipped, cos, err) in rows.items():
        out = demo_json("--buggy", name)
        if name == "per-rank":
            own = [math.sqrt(n * n + 50**2) for n in (100, 400, 50, 200)]
            assert used == "own: " + ", ".join(f"{x:.1f}" for x in own)
            assert [f"{x:.1f}" for x in out["norms_used"]] == [f"{x:.1f}" for x in own]
        elif name == "inf-pow":
            assert used == "1" and out["norms_used"] == [1.0] * 4
            assert "correct: 40" in note and out["correct"]["global_norm"] == 40.0  # the bias' -40
        elif name == "fp16-sumsq":
            assert used == "inf" and out["norms_used"] == ["inf"] * 4
        else:
            assert used == f"{by_hand[name]:.6g}", name
            assert f"{out['norms_used'][0]:.6g}" == used, name
        assert clipped.split(" ")[0] == f"{out['clipped_norm']:.10g}", name
        assert cos == ("undefined" if out["cosine"] is None else f"{out['cosine']:.6f}"), name
        assert err == f"{out['max_abs_error']:.3g}", name
