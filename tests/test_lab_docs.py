"""The lab pack: every command of docs/lab.md, the worksheet and the answer key runs, and every answer
the key states is right.

- Every line of every ``bash`` block of the lab's documents is run: ``mpirun -n R`` ones through
  conftest.mpirun (under a timeout), the others as a plain process, from the repository's folder;
  the judge on a failing file must exit 1, everything else 0. Each ``mpirun`` command is run again
  the way the troubleshooting table says, ``--ranks R`` instead of mpirun, and must give the same
  answers. The install line is the README's (it is not run: it would install the package).
- Every ``text`` block that starts with ``$ COMMAND`` is an excerpt of that command's output: its
  lines must appear in the output, in order (``...`` skips).
- Every answer of the key (``| ID | question | answer |`` rows, and the table of mysteries) is
  checked against an oracle computed here (hand arithmetic, math.fsum, numpy, a numpy replay of the
  training) and against the output of the command that shows it. The worksheet asks exactly the
  questions the key answers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gclip
import train_replay
from conftest import ROOT, OneRankComm, mpirun, venv_env
from gclip import demo
from gclip.demo import command as demo_command

LAB = ROOT / "docs" / "lab.md"
KEY = ROOT / "docs" / "lab-answers.md"
SHEET = ROOT / "lab" / "worksheet.md"
FILES = ROOT / "lab" / "README.md"
DOCS = [LAB, KEY, SHEET, FILES]
TIMEOUT = 240
INSTALL = "python3 -m venv .venv && . .venv/bin/activate && pip install"
SEED = 43  # the documents' example seed: no student's (they are handed 1 to 40)
HANDED_OUT = range(1, 41)


def blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def doc_commands(path: Path) -> list[str]:
    out = []
    for block in blocks(path, "bash"):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


ALL = list(dict.fromkeys(c for p in DOCS for c in doc_commands(p)))
RUNNABLE = [c for c in ALL if not c.startswith(INSTALL)]


# ---------------------------------------------------------------------------
# running a documented command (once per session)

_RUNS: dict[str, subprocess.CompletedProcess] = {}


def simulated(cmd: str) -> str | None:
    """The troubleshooting table's replacement: mpirun -n R python -m X ... -> python -m X ... --ranks R."""
    words = shlex.split(cmd)
    if words[0] != "mpirun" or words[4:6] not in (["-m", "gclip.demo"], ["-m", "gclip.train"]):
        return None
    return shlex.join([*words[3:], "--ranks", words[2]])


def run(cmd: str, out_dir: Path) -> subprocess.CompletedProcess:
    """The command as a student types it, from the repository's folder (plots go to out_dir)."""
    if cmd in _RUNS:
        return _RUNS[cmd]
    words = shlex.split(cmd)
    if "--plot" in words:
        i = words.index("--plot") + 1
        words[i] = str(out_dir / words[i])
    env = {**venv_env(), "NO_COLOR": "1"}
    if words[0] == "mpirun":
        assert words[1] == "-n" and words[3] == "python", cmd
        with _cwd(ROOT):  # conftest.mpirun runs in the current folder
            proc = mpirun(int(words[2]), sys.executable, *words[4:], timeout=TIMEOUT, env=env)
    else:
        assert words[0] == "python", cmd
        proc = subprocess.run(
            [sys.executable, *words[1:]], capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=ROOT
        )
    _RUNS[cmd] = proc
    return proc


@contextlib.contextmanager
def _cwd(path: Path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


@pytest.fixture(scope="session")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lab")


def output(cmd: str, out_dir: Path) -> str:
    proc = run(cmd, out_dir)
    return proc.stdout


def expected_status(cmd: str) -> int:
    """The judge exits 1 on a failing file; every other command of the lab exits 0."""
    if "gclip.conformance" in cmd and "answers/" not in cmd:
        return 1
    return 0


# ---------------------------------------------------------------------------
# every command


def test_the_documents_have_the_lab_commands():
    assert len(RUNNABLE) >= 15
    for path in (LAB, SHEET, FILES):
        assert doc_commands(path), path


def test_every_complete_command_in_the_prose_is_one_the_lab_runs():
    """Commands quoted inline (`...`) are run too: each complete one is a command of a bash block.
    Patterns (`mpirun -n R python -m gclip.X ...`) and bare program names are not commands."""
    for path in DOCS:
        for code in re.findall(r"`([^`]*)`", path.read_text()):
            if not re.match(r"(python -m gclip\.\w+|mpirun -n \d+ python) ", code + " "):
                continue
            if "..." in code or re.search(r"\b(R|X|NAME|K|S)\b", code) or len(code.split()) <= 3:
                continue
            assert code in RUNNABLE, (path.name, code)
    # the sheet's commands are the guide's: a student's sheet never shows a command the guide lacks
    assert set(doc_commands(SHEET)) <= set(doc_commands(LAB))


def test_the_install_line_is_the_readmes():
    readme = (ROOT / "README.md").read_text()
    install = [c for c in ALL if c.startswith(INSTALL)]
    assert install == [f"{INSTALL} ."]
    assert f"{INSTALL} . " in readme  # the README's line, which goes on to run the demo
    # the plot extra, which Exercise 5's --plot needs, is named where the guide says so
    assert "--plot" in CMD_TRAIN and "`pip install '.[plot]'`" in LAB.read_text()
    assert "'.[plot]'" in readme
    assert re.search(r"^plot = \[", (ROOT / "pyproject.toml").read_text(), flags=re.M)


@pytest.mark.slow
@pytest.mark.parametrize("cmd", RUNNABLE)
def test_every_documented_command_runs(cmd, out_dir):
    proc = run(cmd, out_dir)
    assert proc.returncode == expected_status(cmd), (cmd, proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.stdout.strip(), cmd
    assert "Traceback" not in proc.stderr
    if "--plot" in cmd:
        png = out_dir / shlex.split(cmd)[shlex.split(cmd).index("--plot") + 1]
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    alt = simulated(cmd)
    if alt is not None:  # the troubleshooting table's promise: --ranks R instead of mpirun
        proc = run(alt, out_dir)
        assert proc.returncode == 0, (alt, proc.stderr)
        assert "simulated in this one process" in proc.stdout


@pytest.mark.slow
def test_every_output_excerpt_is_what_its_command_prints(out_dir):
    excerpts = [b for p in DOCS for b in blocks(p, "text") if b.startswith("$ ")]
    assert len(excerpts) >= 2
    for block in excerpts:
        first, *lines = block.splitlines()
        cmd = first[2:]
        assert cmd in RUNNABLE, cmd  # the excerpt's command is one the lab runs
        printed = [line.rstrip() for line in output(cmd, out_dir).splitlines()]
        at = 0
        for line in lines:
            if line.strip() == "...":
                continue
            assert line.rstrip() in printed[at:], (cmd, line)
            at = printed.index(line.rstrip(), at) + 1


@pytest.mark.slow
def test_the_judge_under_mpirun_advises_the_command_that_judges_the_file():
    """A student who starts Exercise 4's judge under mpirun is refused, and the command the refusal
    gives judges the file (the per-rank starter: FAIL, fingerprint per-rank), not a wrong call of it."""
    with _cwd(ROOT):
        proc = mpirun(
            2,
            sys.executable,
            "-m",
            "gclip.conformance",
            "lab/my_clip.py:clip_shards",
            timeout=TIMEOUT,
            env=venv_env(),
        )
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1
    advised = line.split("without mpirun: ")[1]
    assert advised == "python -m gclip.conformance lab/my_clip.py:clip_shards" and advised in RUNNABLE
    judged = subprocess.run(
        [sys.executable, *shlex.split(advised)[1:], "--json", "--random", "20"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=venv_env(),
        cwd=ROOT,
    )
    assert judged.returncode == 1 and json.loads(judged.stdout)["fingerprint"] == "per-rank"


# ---------------------------------------------------------------------------
# the answers


def answers(path: Path) -> dict[str, str]:
    rows = re.findall(r"^\| (\d[a-z]) \| [^|]* \| ([^|]*) \|", path.read_text(), flags=re.M)
    return dict(rows)


def mystery_rows() -> dict[int, tuple[str, str]]:
    rows = re.findall(r"^\| (\d+) \| ([a-z0-9-]+) \| [^|]* \| ([^|]*) \|$", KEY.read_text(), flags=re.M)
    return {int(k): (name, value.strip()) for k, name, value in rows}


def test_the_worksheet_asks_what_the_key_answers():
    sheet = re.findall(r"^\| (\d[a-z]) \|", SHEET.read_text(), flags=re.M)
    assert sheet and len(sheet) == len(set(sheet))
    assert set(sheet) == set(answers(KEY)) == set(CHECKS)


def numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e-?\d+)?", text)]


def has(text: str, *values: float, digits: int = 4) -> bool:
    """Every value appears among text's numbers, as printed to ``digits`` significant digits
    (within one unit of the last of them, so that rounding either way counts)."""
    found = numbers(text)
    return all(any(abs(x - v) <= abs(v) * 10.0 ** (1 - digits) for x in found) for v in values)


def flat(text: str) -> str:
    return " ".join(text.split())


CMD_2 = "mpirun -n 2 python -m gclip.demo --shards '[[3,0],[0,4]]' --max-norm 2 --buggy"
CMD_3 = "mpirun -n 3 python -m gclip.demo --shards '[[2,0],[0,3],[6]]' --max-norm 3.5 --buggy"
CMD_TRAIN = "mpirun -n 4 python -m gclip.train --buggy --plot train.png"


def sqrt_r(n: int) -> str:
    return f"mpirun -n {n} python -m gclip.demo --seed {SEED} --buggy --replicated '[]'"


def bug_side(text: str) -> str:
    """The bug's column of the "clipped global norm" row: its clipped norm."""
    row = next(line for line in text.splitlines() if line.strip().startswith("clipped global norm"))
    return row.split(")")[1]


def seed_norms(seed: int, ranks: int = 4) -> list[float]:
    return [float(np.linalg.norm(demo.random_shard(seed, r, 1000))) for r in range(ranks)]


def true_norm(seed: int, ranks: int = 4, bias: float = 2500.0) -> float:
    return math.sqrt(math.fsum(n * n for n in seed_norms(seed, ranks)) + bias)


def check_1a(a, out):
    assert float(a) == 3**2 + 0**2
    assert re.search(r"^\s+0\s+\S+\s+2\s+9\s+3$", out(CMD_2), flags=re.M)


def check_1b(a, out):
    assert float(a) == 0**2 + 4**2
    assert re.search(r"^\s+1\s+\S+\s+2\s+16\s+4$", out(CMD_2), flags=re.M)


def check_1c(a, out):
    assert numbers(a)[0] == math.sqrt(9 + 16) == 5
    assert "the true global norm is 5:" in out(CMD_2)


def check_1d(a, out):
    assert numbers(a)[0] == 2 / 5
    assert "5 -> 0.4" in out(CMD_2)


def check_1e(a, out):
    assert numbers(a) == pytest.approx([3 * 0.4, 0, 0, 4 * 0.4], rel=1e-12)
    assert "correct [1.2, 0]" in out(CMD_2) and "correct [0, 1.6]" in out(CMD_2)


def check_1f(a, out):
    assert numbers(a)[:4] == pytest.approx([3 * 2 / 3, 0, 0, 4 * 2 / 4], rel=1e-12)
    assert "bug [2, 0]" in out(CMD_2) and "bug [0, 2]" in out(CMD_2)


def check_1g(a, out):
    assert has(a, 2 * math.sqrt(2)) and has(a, math.sqrt(2))
    assert has(bug_side(out(CMD_2)), 2 * math.sqrt(2))


def check_1h(a, out):
    cos = (3 * 2 + 4 * 2) / (5 * math.hypot(2, 2))
    assert has(a, cos, digits=3) and has(a, cos, digits=6)
    assert has(out(CMD_2), cos, digits=6)


def check_1i(a, out):
    scale = 3.5 / math.sqrt(4 + 9 + 36)
    assert numbers(a)[:5] == pytest.approx([2 * scale, 0, 0, 3 * scale, 6 * scale], rel=1e-12)
    text = out(CMD_3)
    assert "correct [1, 0]" in text and "correct [0, 1.5]" in text and "correct [3]" in text


def check_1j(a, out):
    clipped = [2, 0, 0, 3, 3.5]  # ranks 0 and 1 below the limit: untouched
    norm = math.sqrt(math.fsum(v * v for v in clipped))
    cos = np.dot(clipped, [2, 0, 0, 3, 6]) / (norm * 7)
    assert has(a, norm) and has(a, cos, digits=3)
    text = out(CMD_3)
    assert has(bug_side(text), norm, digits=10) and has(text, cos, digits=6)


def check_2a(a, out):
    assert "sqrt(R) x c" in a


def _check_sqrt_r(n, a, out):
    assert numbers(a)[0] == round(math.sqrt(n), 3)
    assert has(bug_side(out(sqrt_r(n))), math.sqrt(n), digits=9)
    for seed in (1, 2, 3):  # "on every seed"
        report = demo_json("--seed", str(seed), "--buggy", "--replicated", "[]", "--ranks", str(n))
        assert report["clipped_norm"] == pytest.approx(math.sqrt(n), rel=1e-12)


def check_2b(a, out):
    _check_sqrt_r(2, a, out)


def check_2c(a, out):
    _check_sqrt_r(4, a, out)


def check_2d(a, out):
    _check_sqrt_r(8, a, out)


def _with_bias(seed: int) -> float:
    """Per-rank clipping of shards + bias copies: rank 0's part ends at 1, rank r's shard at
    |s_r| / sqrt(|s_r|^2 + 50^2); one copy of the bias counts."""
    s = seed_norms(seed)
    return math.sqrt(1 + math.fsum(x * x / (x * x + 2500) for x in s[1:]))


def check_2e(a, out):
    assert has(a, _with_bias(SEED), digits=3) and has(a, _with_bias(0), digits=4)
    assert has(
        bug_side(out(f"mpirun -n 4 python -m gclip.demo --seed {SEED} --buggy")), _with_bias(SEED), digits=8
    )
    for seed in range(1, 11):
        assert _with_bias(seed) < 2


def _local(seed: int) -> list[float]:
    s = seed_norms(seed)
    return [math.sqrt(s[0] ** 2 + 2500), *s[1:]]


def check_3a(a, out):
    assert demo.mysteries(SEED)[0] == "rms" and a.startswith("rms")
    g = true_norm(SEED)
    assert has(a, g / math.sqrt(4002), digits=6) and has(a, g, digits=6) and "sqrt(4002)" in a
    assert f"{g / math.sqrt(4002):.6g} ->" in out(
        f"mpirun -n 4 python -m gclip.demo --seed {SEED} --mystery 1"
    )
    assert f"{g / math.sqrt(4002):.6g} ->" in out(
        f"mpirun -n 4 python -m gclip.demo --seed {SEED} --buggy rms"
    )


def check_3b(a, out):
    assert demo.mysteries(SEED)[1] == "double-count" and a.startswith("double-count")
    used = math.sqrt(true_norm(SEED) ** 2 + 3 * 2500)
    assert has(a, used, digits=6)
    for cmd in ("--mystery 2", "--buggy double-count"):
        assert f"{used:.6g} ->" in out(f"mpirun -n 4 python -m gclip.demo --seed {SEED} {cmd}")


def _judge(path: str, out, ranks: int | None = None) -> dict:
    """The judge's JSON verdict on a lab file (fewer random cases), and the documented run's agreement."""
    target = f"{path}:clip" if ranks else f"{path}:clip_shards"
    extra = ["--ranks", str(ranks)] if ranks else []
    proc = subprocess.run(
        [sys.executable, "-m", "gclip.conformance", target, *extra, "--json", "--random", "60"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=venv_env(),
        cwd=ROOT,
    )
    assert proc.returncode in (0, 1), proc.stderr
    verdict = json.loads(proc.stdout)
    assert verdict["passed"] == (proc.returncode == 0)
    text = out(shlex.join(["python", "-m", "gclip.conformance", target, *extra]))  # the documented run
    assert ("PASS" in text) == verdict["passed"]
    return verdict


def _lab_function(path: str):
    spec = importlib.util.spec_from_file_location("lab_file", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.clip_shards


def check_4a(a, out):
    assert a.startswith("per-rank")
    assert _judge("lab/my_clip.py", out)["fingerprint"] == "per-rank"
    assert _lab_function("lab/my_clip.py")([[3, 0], [0, 4]], 2) == [[2.0, 0.0], [0.0, 2.0]]  # by hand


def check_4b(a, out):
    assert "fails `[[3, 0], [0, 4]]`" in a and "passes the single-shard check" in a
    failures = _judge("lab/my_clip.py", out)["failures"]
    assert any(f["shards"] == [[3, 0], [0, 4]] and f["limit"] == 2 for f in failures)
    assert not any(len(f["shards"]) == 1 for f in failures)  # one shard's norm is the global norm
    clip = _lab_function("lab/my_clip.py")
    for n in range(1, 6):  # the contract's single-shard check, by hand: [3n, 4n] has norm 5n, limit 3n
        assert clip([[3 * n, 4 * n]], 3 * n) == [[round(1.8 * n, 12), round(2.4 * n, 12)]]
    text = out("python -m gclip.conformance lab/my_clip.py:clip_shards")  # what the student reads
    assert re.search(r"^    norm spans two shards +5 run +5 failed$", text, flags=re.M)
    assert re.search(r"^    single shard same global rule +5 run +0 failed$", text, flags=re.M)
    assert "5 failed of 5" in a and "0 failed of 5" in a


def check_4c(a, out):
    assert a.startswith("PASS")
    assert _judge("lab/answers/good_clip.py", out)["passed"] is True
    fixed = _lab_function("lab/answers/good_clip.py")
    assert fixed([[3, 0], [0, 4]], 2) == [[1.2, 0.0], [0.0, 1.6]]
    assert fixed([[2, 0], [0, 3], [6]], 3.5) == [[1.0, 0.0], [0.0, 1.5], [3.0]]


def _check_mystery_file(letter: str, name: str, a, out):
    assert a.startswith(name)
    verdict = _judge(f"lab/mystery_{letter}.py", out)
    assert verdict["passed"] is False and verdict["fingerprint"] == name
    return verdict


def check_4d(a, out):
    _check_mystery_file("a", "sum-of-norms", a, out)
    assert _lab_function("lab/mystery_a.py")([[3, 0], [0, 4]], 2) == [
        [round(6 / 7, 12), 0.0],
        [0.0, round(8 / 7, 12)],
    ]


def check_4e(a, out):
    verdict = _check_mystery_file("b", "epsilon", a, out)
    assert verdict["grade"] == "near miss" and "NEAR MISS" in a and "exit status 1" in a
    text = flat(out("python -m gclip.conformance lab/mystery_b.py:clip_shards"))
    near = re.search(r"verdict: NEAR MISS \(epsilon, \d+ of \d+ checks off by at most (\S+) relative", text)
    assert near and float(near.group(1)) <= 1e-4 and has(a, 1e-4)
    assert "NEAR MISS" in LAB.read_text()  # the guide says what exit 1 covers
    assert _lab_function("lab/mystery_b.py")([[3, 0], [0, 4]], 2)[0][0] == round(3 * 2 / (5 + 1e-6), 12)


def check_4f(a, out):
    _check_mystery_file("c", "rms", a, out)
    assert _lab_function("lab/mystery_c.py")([[3, 0], [0, 4]], 2) == [[2.4, 0.0], [0.0, 3.2]]  # rms 2.5


def check_4g(a, out):
    verdict = _check_mystery_file("d", "unknown", a, out)
    for f in verdict["failures"]:  # each reason states the difference measured, not a fixed one
        diffs = [abs(a - b) for ra, rb in zip(f["actual"], f["expected"]) for a, b in zip(ra, rb)]
        assert 0 < max(diffs) < 1e-12 and "round" in f["reason"], f
        if f["check"].startswith("contract"):
            assert f["reason"].startswith(f"off by {max(diffs):.2g} ("), f
    text = flat(out("python -m gclip.conformance lab/mystery_d.py:clip_shards"))
    assert "off by 2.2e-16 (shard 0 item 0 is 1.2000000000000002, expected 1.2)" in text
    assert "1e-11" not in text
    got = _lab_function("lab/mystery_d.py")([[3, 0], [0, 4]], 2)
    assert got == [[3 * (2 / 5), 0.0], [0.0, 4 * (2 / 5)]] and got[0][0] != 1.2  # 1.2000000000000002


# the distributed files on 2 real ranks, [3, 0] and [0, 4] with max_norm 2: what each rank returns
ON_RANKS = r"""
import importlib.util, json, sys
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
spec = importlib.util.spec_from_file_location("lab_file", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
mine = [np.array([[3.0, 0.0], [0.0, 4.0]][comm.Get_rank()])]
got = module.clip(mine, 2.0, comm)
got = mine if got is None else got
rows = comm.gather([float(v) for v in got[0]], root=0)
if comm.Get_rank() == 0:
    print(json.dumps(rows))
"""


def _on_ranks(path: str) -> list[list[float]]:
    proc = mpirun(2, sys.executable, "-c", ON_RANKS, str(ROOT / path), timeout=TIMEOUT, env=venv_env())
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def check_4h(a, out):
    assert a.startswith("per-rank") and "no collective" in a
    assert _judge("lab/distributed/my_clip.py", out, ranks=4)["fingerprint"] == "per-rank"
    text = flat(out("python -m gclip.conformance lab/distributed/my_clip.py:clip --ranks 4"))
    assert "entered no collective" in text and "its own norm" in text
    assert _on_ranks("lab/distributed/my_clip.py") == [[3 * 2 / 3, 0.0], [0.0, 4 * 2 / 4]]  # own norms 3, 4


def check_4i(a, out):
    assert a.startswith("PASS") and "comm.allreduce" in a
    assert _judge("lab/distributed/answers/good_clip.py", out, ranks=4)["passed"] is True
    got = _on_ranks("lab/distributed/answers/good_clip.py")
    np.testing.assert_allclose(got, [[3 * 2 / 5, 0.0], [0.0, 4 * 2 / 5]], rtol=1e-15)


def check_4j(a, out):
    assert a.startswith("sum-of-norms")
    assert _judge("lab/distributed/mystery_a.py", out, ranks=4)["fingerprint"] == "sum-of-norms"
    want = [[3 * 2 / 7, 0.0], [0.0, 4 * 2 / 7]]  # 3 + 4 = 7 instead of 5
    np.testing.assert_allclose(_on_ranks("lab/distributed/mystery_a.py"), want, rtol=1e-15)


def check_4k(a, out):
    assert a.startswith("rank0-norm") and "comm.bcast" in a
    assert _judge("lab/distributed/mystery_b.py", out, ranks=4)["fingerprint"] == "rank0-norm"
    want = [[3 * 2 / 3, 0.0], [0.0, 4 * 2 / 3]]  # rank 0's norm, 3, on both ranks
    np.testing.assert_allclose(_on_ranks("lab/distributed/mystery_b.py"), want, rtol=1e-15)


def _train_text(out) -> str:
    return flat(out(CMD_TRAIN))


def _replay(mode: str = "per-rank") -> dict:
    return train_replay.replay(4, mode, 200, 0.05)


def check_5a(a, out):
    bug, good = _replay()["final"], _replay("global")["final"]
    assert bug < good
    assert a.startswith("per-rank") and has(a, bug, good)
    assert f"why the per-rank run ends lower ({bug:.4g} against {good:.4g})" in _train_text(out)


def check_5b(a, out):
    above = sum(u > 0.05 * (1 + 1e-9) for u in _replay()["update"])
    assert numbers(a)[:2] == [above, 200]
    assert sum(u > 0.05 * (1 + 1e-9) for u in _replay("global")["update"]) == 0
    assert f"update applied above max_norm 0.05: {above} of 200 steps" in _train_text(out)


def check_5c(a, out):
    largest = max(_replay()["update"])
    assert f"{largest:.4g}" == "0.1" and numbers(a)[0] == 0.1 == math.sqrt(4) * 0.05
    assert "largest update applied: per-rank 0.1," in _train_text(out)


def check_5d(a, out):
    smallest = min(_replay()["cosine"])
    assert numbers(a)[0] == float(f"{smallest:.4f}")
    assert f"smallest cos(update, gradient): per-rank {smallest:.4f}" in _train_text(out)


def check_5e(a, out):
    r = _replay()
    step = 20
    assert r["scaled"][step] == 0 and r["update"][step] > 0.05
    assert r["update"][step] == pytest.approx(r["true"][step], rel=1e-12)  # nothing scaled
    assert a.startswith(f"step {step}") and has(a, r["used"][step][0], r["true"][step])
    row = f"{step} 0.785380 {r['used'][step][0]:.4g} {r['true'][step]:.4g} {r['update'][step]:.4g} 0/4 yes"
    assert row in _train_text(out)


def check_6a(a, out):
    assert numbers(a)[0] == round(math.sqrt(8), 3)


CHECKS = {name[len("check_") :]: fn for name, fn in list(globals().items()) if name.startswith("check_")}


def demo_json(*argv: str) -> dict:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert demo_command._main(["--json", *argv], OneRankComm()) == 0
    return json.loads(buf.getvalue())


@pytest.mark.slow
@pytest.mark.parametrize("qid", sorted(CHECKS))
def test_every_answer_of_the_key(qid, out_dir):
    answer = answers(KEY)[qid].strip()

    def out(cmd: str) -> str:
        assert cmd in RUNNABLE, f"{cmd!r} is not a command of the lab"
        proc = run(cmd, out_dir)
        assert proc.returncode == expected_status(cmd), proc.stderr
        alt = simulated(cmd)
        if alt is None:
            return proc.stdout
        sim = run(alt, out_dir).stdout  # the --ranks run must show the same answer
        return proc.stdout if _same_answer_lines(proc.stdout, sim) else pytest.fail(f"{alt} differs")

    CHECKS[qid](answer, out)


def _same_answer_lines(real: str, sim: str) -> bool:
    """The two runs print the same numbers, but for the lines that name the ranks or hosts."""

    def keep(text: str) -> list[list[str]]:
        rows = []
        for line in text.splitlines():
            if re.match(r"^\s+\d+\s+\S+\s+\d+(\+\d+)?\s", line):  # table 1: drop the host column
                line = " ".join(w for i, w in enumerate(line.split()) if i != 1)
            rows.append(re.findall(r"-?\d+\.\d+(?:e-?\d+)?", line))
        return [r for r in rows if r]

    return keep(real) == keep(sim)


# ---------------------------------------------------------------------------
# the mysteries' table: every K of the key, against --mystery K on seed 7


def test_the_key_names_every_mystery():
    rows = mystery_rows()
    assert sorted(rows) == list(range(1, 10))
    assert [rows[k][0] for k in range(1, 10)] == list(demo.mysteries(SEED))
    assert sorted(demo.MYSTERY_POOL) == sorted(b.name for b in gclip.BUGS if b.name != "inf-pow")


def grading_pairs() -> dict[int, tuple[str, str]]:
    cells = re.findall(r"\| (\d+) \| ([a-z0-9-]+), ([a-z0-9-]+) (?=\|)", KEY.read_text())
    return {int(seed): (a, b) for seed, a, b in cells}


def test_the_keys_grading_table_is_every_seeds_pair():
    """The key's seed -> (mystery 1, mystery 2) table is what the demo runs, for a class of 40; and
    the guide's promises about it hold: 36 different pairs for seeds 1..36, no bug shared by
    consecutive seeds."""
    pairs = grading_pairs()
    assert sorted(pairs) == list(range(1, 41))
    for seed, pair in pairs.items():
        assert demo.mysteries(seed)[:2] == pair, seed
        for k, name in enumerate(pair, start=1):  # and the hidden run is that bug's, number for number
            hidden = demo_json("--ranks", "4", "--seed", str(seed), "--mystery", str(k))
            named = demo_json("--ranks", "4", "--seed", str(seed), "--buggy", name)
            assert hidden["norms_used"] == named["norms_used"] and hidden["scales"] == named["scales"]
    assert len({frozenset(pairs[s]) for s in range(1, 37)}) == 36
    assert all(not set(pairs[s]) & set(pairs[s + 1]) for s in range(1, 40))
    guide = flat(LAB.read_text())
    assert "seeds 1 to 36 each a different pair of bugs" in guide and "never share a bug" in guide


def test_the_guide_says_which_bugs_list_bugs_places_in_a_real_system():
    """--list-bugs gives a real system for every mystery bug but two, which it calls teaching
    examples: the guide names those two and claims no more."""
    gallery = json.loads(output("python -m gclip.demo --list-bugs --json", None))
    mysteries = [d for d in gallery if d["name"] in demo.MYSTERY_POOL]
    assert len(mysteries) == len(demo.MYSTERY_POOL)
    teaching = sorted(d["name"] for d in mysteries if not d.get("incident"))
    assert teaching == ["max-of-norms", "rank0-norm"]
    listed = output("python -m gclip.demo --list-bugs", None)
    assert listed.count("a teaching example") >= 2
    guide = flat(LAB.read_text())
    assert (
        '"a teaching example" for the two with no public incident confirmed (rank0-norm and max-of-norms)'
        in guide
    )
    assert "Each bug happened in a real system" not in guide


def test_the_direction_rule_of_the_key_is_what_each_mystery_does():
    """Every mystery keeps the direction (cosine 1) but per-rank (below 1) and fp16-sumsq (a zero
    step: no direction, the cosine undefined), as the guide's Discuss and the key say."""
    for name in demo.MYSTERY_POOL:
        cos = demo_json("--ranks", "4", "--seed", str(SEED), "--buggy", name)["cosine"]
        if name == "per-rank":
            assert cos < 0.999
        elif name == "fp16-sumsq":
            assert cos is None
            k = demo.mysteries(SEED).index("fp16-sumsq") + 1
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                demo_command._main(["--ranks", "4", "--seed", str(SEED), "--mystery", str(k)], OneRankComm())
            text = buf.getvalue()
            assert re.search(r"cosine with the original +1\.000000 +undefined", text)
        else:
            assert cos == pytest.approx(1.0, abs=1e-12), name
    key, guide = flat(KEY.read_text()), flat(LAB.read_text())
    assert "fp16-sumsq (a scale of 0 on every rank: no step at all, so no direction;" in key
    assert 'the demo prints the cosine as "undefined")' in key
    assert "fp16-sumsq leaves none" in guide and "every bug but per-rank" not in guide


def test_the_keys_seed_7_numbers_are_what_each_mystery_uses():
    local = _local(SEED)
    g = true_norm(SEED)
    own = [math.sqrt(n * n + 2500) for n in seed_norms(SEED)]
    oracle = {
        "mean-of-norms": [math.fsum(local) / 4],
        "rank0-norm": [local[0]],
        "double-count": [math.sqrt(g * g + 3 * 2500)],
        "per-rank": own,
        "sum-of-norms": [math.fsum(local)],
        "fp16-sumsq": [math.inf],  # the largest sum of squares is past 65504
        "max-of-norms": [max(local)],
        "rms": [g / math.sqrt(4002)],
        "epsilon": [g],
    }
    assert max(n * n for n in seed_norms(SEED)) > 65504
    for k, (name, value) in mystery_rows().items():
        want = oracle[name]
        stated = [math.inf] if value == "inf" else numbers(value)
        assert [f"{x:.6g}" for x in stated] == [f"{x:.6g}" for x in want], name
        used = demo_json("--ranks", "4", "--seed", str(SEED), "--mystery", str(k))["norms_used"]
        shown = [math.inf if u == "inf" else u for u in used]
        assert [f"{x:.6g}" for x in shown[: len(want)]] == [f"{x:.6g}" for x in want], name


# ---------------------------------------------------------------------------
# no student's answer on the page


def _demo_argv(cmd: str) -> tuple[list[str], int] | None:
    """A demo command of the documents as (argv without --ranks, rank count), or None."""
    words = shlex.split(cmd)
    ranks = 1
    if words[0] == "mpirun":
        ranks, words = int(words[2]), words[3:]
    if words[1:3] != ["-m", "gclip.demo"]:
        return None
    argv = words[3:]
    if "--ranks" in argv:
        i = argv.index("--ranks")
        ranks = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2 :]
    return argv, ranks


def _what_the_bug_printed(argv: list[str], ranks: int) -> tuple | None:
    """The numbers a bug's run shows (its data, the norms used, the scales), or None: no bug ran."""
    if "--list-bugs" in argv:
        return None
    report = demo_json(*argv, "--ranks", str(ranks))
    if "bug_run" in report:  # a layout
        b = report["bug_run"]
        return ("layout", report["layout"], report.get("model_norm"), repr(b["norms"]), repr(b["scales"]))
    if report["mode"] == "global":
        return None
    return (ranks, report["true_global_norm"], repr(report["norms_used"]), repr(report["scales"]))


def _handed_out_mysteries(ranks: int, layouts: set[str]) -> dict[tuple, str]:
    shown = {}
    for seed in HANDED_OUT:
        for k in range(1, len(demo.MYSTERY_POOL) + 1):
            argv = ["--seed", str(seed), "--mystery", str(k)]
            shown[_what_the_bug_printed(argv, ranks)] = f"seed {seed} mystery {k}"
        for layout in sorted(layouts):
            for k in range(1, len(demo.LAYOUT_MYSTERY_POOL) + 1):
                argv = ["--seed", str(seed), "--mystery", str(k), "--layout", layout]
                shown[_what_the_bug_printed(argv, ranks)] = f"seed {seed} layout mystery {k}"
    return shown


def test_no_command_of_the_guide_or_the_sheet_prints_a_handed_out_seeds_mystery():
    """Every bug run of lab.md and the worksheet, against every mystery of seeds 1 to 40 (run here
    on the same ranks): none prints the same numbers, so no student finds an answer on the page.
    The check itself catches the old worksheet's line (seed 7 is handed out; rms is its mystery 1)."""
    runs = [_demo_argv(c) for c in dict.fromkeys(doc_commands(LAB) + doc_commands(SHEET))]
    runs = [r for r in runs if r is not None]
    printed = {}
    for argv, ranks in runs:
        what = _what_the_bug_printed(argv, ranks)
        if what is not None:
            printed[shlex.join(argv)] = (what, ranks)
    assert len(printed) >= 4  # the bug runs of Exercises 1 to 3 at least
    by_ranks: dict[int, dict] = {}
    for _, ranks in printed.values():
        layouts = {w[1] for w, r in printed.values() if r == ranks and w[0] == "layout"}
        if ranks not in by_ranks:
            by_ranks[ranks] = _handed_out_mysteries(ranks, layouts)
    for cmd, (what, ranks) in printed.items():
        assert what not in by_ranks[ranks], (cmd, by_ranks[ranks].get(what))
    old_line = _what_the_bug_printed(["--seed", "7", "--buggy", "rms"], 4)
    assert by_ranks[4][old_line] == "seed 7 mystery 1"
    for path in (LAB, SHEET):  # and no self-check names a bug: it says NAME
        for cmd in doc_commands(path):
            if "--buggy" in shlex.split(cmd):
                after = shlex.split(cmd)[shlex.split(cmd).index("--buggy") + 1 :]
                assert not after or after[0] not in demo.MYSTERY_POOL, (path.name, cmd)
