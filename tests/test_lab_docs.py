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
import gclip.gallery
import train_replay
from conftest import ROOT, OneRankComm, mpirun, venv_env
from gclip import demo
from gclip._lab import layout_run, transformer
from gclip.demo import command as demo_command
from gclip.layout import Mesh

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
            if "..." in code or re.search(r"\b(R|X|NAME|K|S|DIR)\b", code) or len(code.split()) <= 3:
                continue
            assert code in RUNNABLE or code in windows_commands(), (path.name, code)
    # the sheet's commands are the guide's: a student's sheet never shows a command the guide lacks
    assert set(doc_commands(SHEET)) <= set(doc_commands(LAB))


def test_the_install_line_is_the_readmes():
    readme = (ROOT / "README.md").read_text()
    install = [c for c in ALL if c.startswith(INSTALL)]
    assert install == [f"{INSTALL} '.[mpi]'"]
    assert f"{INSTALL} '.[mpi]' " in readme  # the README's line, which goes on to run the demo
    # the plot extra, which Exercise 5's --plot needs, is named where the guide says so
    assert "--plot" in CMD_TRAIN and '`pip install ".[plot]"`' in LAB.read_text()
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


CMD_2 = 'mpirun -n 2 python -m gclip.demo --shards "[[3,0],[0,4]]" --max-norm 2 --buggy'
CMD_3 = 'mpirun -n 3 python -m gclip.demo --shards "[[2,0],[0,3],[6]]" --max-norm 3.5 --buggy'
CMD_TRAIN = "mpirun -n 4 python -m gclip.train --buggy --plot train.png"


def sqrt_r(n: int) -> str:
    return f'mpirun -n {n} python -m gclip.demo --seed {SEED} --buggy --replicated "[]"'


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
    parts = [np.full(3, 10.0 * (r + 1)) for r in range(8)]  # 8 disjoint parts, each far above 1
    clipped = [x / np.linalg.norm(x) for x in parts]  # each by its own norm: each ends at 1
    assert math.sqrt(math.fsum(float(x @ x) for x in clipped)) == pytest.approx(math.sqrt(8), rel=1e-12)
    sheet = flat(SHEET.read_text())
    assert "each hold a different part of the gradient" in sheet and "no rank holds the whole" in sheet


def check_6b(a, out):
    """Under DDP every rank holds the same whole gradient: per-rank clipping is the global clip."""
    assert a.startswith("right") and "at most 1" in a
    whole_grad = np.random.default_rng(6).standard_normal(50) * 3
    per_rank = gclip.gallery.clip_simulated([[whole_grad.copy()] for _ in range(8)], 1.0, mode="per-rank",
                                    replicated=[True])  # fmt: skip
    want = whole_grad * min(
        1.0, 1.0 / float(np.sqrt(np.sum(whole_grad**2)))
    )  # the clip of the whole, by hand
    for res in per_rank:
        np.testing.assert_allclose(res.grads[0], want, rtol=1e-15)
    assert float(np.linalg.norm(want)) == pytest.approx(1.0, rel=1e-12)
    assert "DDP" in SHEET.read_text() and "DDP" in LAB.read_text()


# the extension: the lab's transformer under --model incidents, the oracle from its definition
LAYOUT = "pp=2,dp=2,tp=2"
CMD_EXPLAIN = f"python -m gclip.demo --layout {LAYOUT} --model incidents --explain --ranks 8"
CMD_TIED = (
    f"python -m gclip.demo --layout {LAYOUT} --model incidents --buggy tied-counted-twice --plot layout.png "
    "--ranks 8"
)


def layout_mystery_cmd(k: int, seed: int = SEED) -> str:
    return f"python -m gclip.demo --layout {LAYOUT} --model incidents --seed {seed} --mystery {k} --ranks 8"


def _sumsq(seed: int = 0, names=None) -> float:
    """The model's sum of squares from its definition (each tensor whole, once), or of some tensors."""
    model = transformer.Model("incidents", seed)
    shapes = transformer.model_shapes(ep=False)
    return math.fsum(
        float(v) ** 2
        for n, s in shapes.items()
        if names is None or n in names
        for v in transformer.full_tensor(n, s, model=model).ravel()
    )


def _stage(stage: int) -> list[str]:
    """The tensors of pipeline stage ``stage`` of 2: the embedding on both, half the layers each."""
    names = ["embed"] + [n for n in transformer.model_shapes(ep=False) if n.startswith("layers.")]
    half = transformer.LAYERS // 2
    keep = [n for n in names if n == "embed" or stage * half <= int(n.split(".")[1]) < (stage + 1) * half]
    return keep + (["final_ln"] if stage == 1 else [])


def check_7a(a, out):
    holders: dict[tuple, list[int]] = {}
    for r in range(8):
        for piece in transformer.pieces(Mesh((r, 8), pp=2, dp=2, tp=2)):
            if piece.name == "embed":
                holders.setdefault(piece.part, []).append(r)
    assert len(holders) == 2 and all(len(rs) == 4 for rs in holders.values())
    counted = sorted(min(rs) for rs in holders.values())  # a group counts on its first member
    assert counted == [0, 1] and "2 pieces" in a and "4 ranks" in a and "ranks 0 and 1" in a
    line = (
        "tied embedding: 2 pieces, each held by 4 ranks (identical copies), counted on one of them: ranks 0-1"
    )
    assert line in out(CMD_EXPLAIN)


def check_7b(a, out):
    total, embed = _sumsq(), _sumsq(names={"embed"})
    assert embed / total == pytest.approx(0.5, rel=1e-12)
    factor = math.sqrt(1 + embed / total)
    assert has(a, factor, digits=4) and has(a, 0.5 * 100, digits=3)
    bug, true = math.sqrt(total + embed), math.sqrt(total)
    assert has(a, bug, true, digits=6)
    text = out(CMD_TIED)
    assert f"{bug:.6g} -> " in text and f"global norm {true:.6g}" in text
    assert f"{factor:.4g} x the true one" in text


def check_7c(a, out):
    name = demo.layout_mysteries(SEED, {"pp": 2, "dp": 2, "tp": 2})[0]
    assert name == "pp-stages-apart" and a.startswith(name)
    stages = [math.sqrt(_sumsq(SEED, set(_stage(s)))) for s in (0, 1)]
    true = math.sqrt(_sumsq(SEED))
    assert has(a, *stages, true, digits=6) and "0-3" in a and "4-7" in a
    text = out(layout_mystery_cmd(1))
    assert f"{stages[0]:.6g} -> " in text and f"{stages[1]:.6g} -> " in text and name not in text


def check_7d(a, out):
    name = demo.layout_mysteries(SEED, {"pp": 2, "dp": 2, "tp": 2})[1]
    assert name == "dp-replicas-summed" and a.startswith(name)
    true = math.sqrt(_sumsq(SEED))
    assert has(a, math.sqrt(2) * true, true, digits=6)
    text = out(layout_mystery_cmd(2))
    assert f"{math.sqrt(2) * true:.6g} -> " in text and name not in text


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
    added = gclip.demo.options.ADDED  # added to the gallery after the seeds were handed out
    assert sorted(demo.MYSTERY_POOL) == sorted(
        b.name for b in gclip.gallery.BUGS if b.name != "inf-pow" and b.name not in added
    )


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
    if "--plot" in argv:  # the figure is not the question here (nor written into the repository)
        i = argv.index("--plot")
        argv = argv[:i] + argv[i + 2 :]
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
        model = report["model"]["proportions"]
        return ("layout", report["layout"], model, report["model_norm"], repr(b["norms"]), repr(b["scales"]))
    if report["mode"] == "global":
        return None
    return (ranks, report["true_global_norm"], repr(report["norms_used"]), repr(report["scales"]))


def _handed_out_mysteries(ranks: int, layouts: set[tuple[str, str]]) -> dict[tuple, str]:
    """What every mystery of seeds 1 to 40 prints on ``ranks`` ranks (and on each (layout, model))."""
    shown = {}
    for seed in HANDED_OUT:
        for k in range(1, len(demo.MYSTERY_POOL) + 1):
            argv = ["--seed", str(seed), "--mystery", str(k)]
            shown[_what_the_bug_printed(argv, ranks)] = f"seed {seed} mystery {k}"
        for layout, model in sorted(layouts):  # every layout run prints its model's norm: the seed's
            norm = layout_run.true_norm("ep" in layout, 2.0, transformer.Model(model, seed))
            shown[("layout", layout, model, norm)] = f"seed {seed}'s layout mysteries"
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
        layouts = {(w[1], w[2]) for w, r in printed.values() if r == ranks and w[0] == "layout"}
        if ranks not in by_ranks:
            by_ranks[ranks] = _handed_out_mysteries(ranks, layouts)
    for cmd, (what, ranks) in printed.items():
        key = what[:4] if what[0] == "layout" else what  # a layout's: its model's norm, from the seed
        assert key not in by_ranks[ranks], (cmd, by_ranks[ranks].get(key))
    old_line = _what_the_bug_printed(["--seed", "7", "--buggy", "rms"], 4)
    assert by_ranks[4][old_line] == "seed 7 mystery 1"  # the check catches the old worksheet's line
    layout = ["--layout", LAYOUT, "--model", "incidents", "--seed", "7", "--mystery", "1"]
    assert _what_the_bug_printed(layout, 8)[:4] in by_ranks[8]  # and a handed-out layout mystery
    for path in (LAB, SHEET):  # and no self-check names a bug: it says NAME
        for cmd in doc_commands(path):
            if "--buggy" in shlex.split(cmd):
                after = shlex.split(cmd)[shlex.split(cmd).index("--buggy") + 1 :]
                assert not after or after[0] not in demo.MYSTERY_POOL, (path.name, cmd)


def test_the_keys_layout_grading_table_is_every_seeds_pair():
    """The key's seeds -> (layout mystery 1, 2) rows are what the demo runs for seeds 1 to 40; side
    by side seeds share no bug; a hidden run prints its bug's numbers (a sample of seeds, simulated)."""
    rows = re.findall(r"^\| ((?:\d+, )+\d+) \| ([a-z0-9-]+), ([a-z0-9-]+) \|$", KEY.read_text(), flags=re.M)
    table = {int(s): (a, b) for seeds, a, b in rows for s in seeds.split(", ")}
    axes = {"pp": 2, "dp": 2, "tp": 2}
    assert sorted(table) == list(HANDED_OUT)
    for seed, pair in table.items():
        assert demo.layout_mysteries(seed, axes)[:2] == pair, seed
        assert not set(pair) & set(demo.layout_mysteries(seed + 1, axes)[:2]), seed
    pool = {n for pair in table.values() for n in pair}
    assert pool == {n for n in demo.LAYOUT_MYSTERY_POOL if n not in ("ep-groups-apart", "experts-left-out")}
    for seed in (1, 2, 3):
        for k, name in enumerate(table[seed], start=1):
            common = ["--layout", LAYOUT, "--model", "incidents", "--seed", str(seed), "--ranks", "8"]
            hidden, named = demo_json(*common, "--mystery", str(k)), demo_json(*common, "--buggy", name)
            assert hidden["bug_run"]["norms"] == named["bug_run"]["norms"]
            assert "bug" not in hidden and hidden["mode"] == f"mystery-{k}"


# ---------------------------------------------------------------------------
# Windows: the guide's block for cmd.exe and PowerShell


WINDOWS_INSTALL = ["python -m venv .venv", ".venv\\Scripts\\activate", "pip install ."]


def windows_commands() -> list[str]:
    block = blocks(LAB, "bat")[1]
    return [line.strip() for line in block.splitlines() if line.strip()]


def test_the_windows_install_is_the_venv_activate_line_and_pyprojects_platforms():
    (install,) = blocks(LAB, "bat")[:1]
    assert install.splitlines() == WINDOWS_INSTALL  # the activate line of a venv on Windows
    pyproject = (ROOT / "pyproject.toml").read_text()
    # what the guide says: the mpich wheel (mpirun) is installed on Linux and macOS only
    assert re.search(r"\"mpich[^\"]*; sys_platform == 'linux' or sys_platform == 'darwin'\"", pyproject)
    guide = flat(LAB.read_text())
    assert "the `mpich` wheel on Linux and macOS only" in guide


@pytest.mark.slow
def test_every_windows_command_runs_without_mpirun_or_single_quotes(out_dir):
    """Each command of the Windows block has no mpirun and no single quote (cmd.exe passes them on),
    and runs as typed, each demo or trainer one on simulated ranks; each is one of the lab's, but
    with --ranks where the lab says mpirun."""
    cmds = windows_commands()
    assert len(cmds) >= 6
    lab = {tuple(shlex.split(simulated(c) or c)) for c in RUNNABLE}
    for cmd in cmds:
        assert "mpirun" not in cmd and "'" not in cmd, cmd
        words = shlex.split(cmd)
        assert words[:2] == ["python", "-m"], cmd
        if words[2] != "gclip.conformance":
            assert "--ranks" in words, cmd
        proc = run(cmd, out_dir)
        assert proc.returncode == expected_status(cmd), (cmd, proc.stderr)
        assert "Traceback" not in proc.stderr
    others = [c for c in cmds if tuple(shlex.split(c)) not in lab]
    assert others == ["python -m gclip.train --buggy --ranks 4"], others  # the lab's, without --plot


def test_single_quoted_json_as_cmd_exe_passes_it_is_refused_with_the_double_quoted_form():
    with pytest.raises(demo_command_usage_error(), match=re.escape('--shards "[[3,0],[0,4]]"')):
        demo.parse_args(["--shards", "'[[3,0],[0,4]]'", "--ranks", "2"], None)
    assert demo.parse_args(["--shards", "[[3,0],[0,4]]", "--ranks", "2"], None).shards == [[3, 0], [0, 4]]


def demo_command_usage_error():
    from gclip._lab.cli import UsageError

    return UsageError


# ---------------------------------------------------------------------------
# the troubleshooting table: each message it quotes is one a tool prints


SHELL_MESSAGES = {"mpirun: command not found"}  # the shell's, not a tool's


def _stub_env(tmp_path: Path, module: str, code: str) -> dict:
    stub = tmp_path / f"stub-{module}" / module
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(code)
    env = {**venv_env(), "NO_COLOR": "1"}
    env["PYTHONPATH"] = str(stub.parent) + os.pathsep + env["PYTHONPATH"]
    return env


def _tool(argv: list[str], env: dict | None = None, cwd: Path = ROOT) -> str:
    proc = subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env or venv_env(),
        cwd=cwd,
    )
    return proc.stdout + proc.stderr


NO_LAUNCHER = (
    "import sys, gclip._lab.mpirun as m; m.shutil.which = lambda *a, **k: None; "
    "from gclip.conformance.command import main; main(sys.argv[1:])"
)


def _what_prints(message: str, tmp_path: Path) -> str:
    """The output of the tool run that the table's row is about."""
    if message == "MPI cannot be loaded":
        env = _stub_env(
            tmp_path, "mpi4py", "raise ImportError('libmpi.so.12: cannot open shared object file')\n"
        )
        return _tool(["-m", "gclip.demo"], env)
    if message.startswith("--ranks simulates"):  # started as one of 4 ranks (the launcher's environment)
        return _tool(["-m", "gclip.demo", "--ranks", "4"], {**venv_env(), "PMI_RANK": "0", "PMI_SIZE": "4"})
    if message == "this ran on 1 rank":
        return _tool(["-m", "gclip.demo"])
    if message.startswith("not valid JSON"):
        return _tool(["-m", "gclip.demo", "--shards", "'[[3,0],[0,4]]'", "--ranks", "2"])
    if message.startswith("plots need matplotlib"):
        env = _stub_env(tmp_path, "matplotlib", "raise ImportError('no matplotlib')\n")
        return _tool(["-m", "gclip.demo", "--ranks", "2", "--plot", str(tmp_path / "x.png")], env)
    if message.startswith("error: no such file"):
        return _tool(["-m", "gclip.conformance", "lab/my_clip.py:clip_shards"], cwd=tmp_path)
    if message.startswith("started as one of"):
        env = {**venv_env(), "PMI_RANK": "0", "PMI_SIZE": "4"}
        return _tool(["-m", "gclip.conformance", "lab/my_clip.py:clip_shards"], env)
    if message.startswith("no mpirun next to"):
        return _tool(["-c", NO_LAUNCHER, "lab/distributed/my_clip.py:clip", "--ranks", "4"])
    raise AssertionError(f"the troubleshooting table quotes {message!r}: add how to make a tool print it")


def test_the_troubleshooting_tables_messages_are_the_tools_own(tmp_path):
    text = LAB.read_text()
    table = text[text.index("## Troubleshooting") :].split("\n\n")[1]
    quoted = []
    for row in table.splitlines()[2:]:
        symptom = row.split(" | ")[0]
        quoted += [q for q in re.findall(r"`([^`]+)`", symptom) if " " in q and not q.startswith("mpirun -n")]
    assert len(quoted) >= 8
    for message in quoted:
        if message in SHELL_MESSAGES:
            continue
        printed = flat(_what_prints(message, tmp_path))
        assert message in printed, (message, printed[-500:])
        assert "Traceback" not in printed
