"""docs/judge.md is true: every file it names exists, every command it shows runs as it says.

Commands come from its ``bash`` blocks (a trailing ``# exit N`` is the exit
status it promises) and from its ``text`` blocks (``$ command`` then the
output shown, ``...`` marking lines left out: every line shown must appear in
the real output, in order). Each runs once, from the repository's root, under
a timeout that ends its whole MPI job.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gclip._lab import mpirun

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "judge.md"
TEXT = DOC.read_text()
TIMEOUT = 600


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", TEXT, flags=re.S)


def _commands() -> dict[str, dict]:
    """command -> {"exit": int | None, "shown": [lines]}."""
    found: dict[str, dict] = {}
    for block in _blocks("bash"):
        for line in block.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            command, _, comment = line.partition("  #")
            exit_ = re.search(r"exit (\d)", comment)
            entry = found.setdefault(command.strip(), {"exit": None, "shown": []})
            entry["exit"] = int(exit_.group(1)) if exit_ else entry["exit"]
    for block in _blocks("text"):
        lines = block.splitlines()
        if lines and lines[0].startswith("$ "):
            entry = found.setdefault(lines[0][2:].strip(), {"exit": None, "shown": []})
            entry["shown"] = [x for x in lines[1:] if x.strip() != "..."]
    return found


COMMANDS = _commands()


def test_the_doc_shows_every_kind_of_command():
    joined = "\n".join(COMMANDS)
    for needle in ("--ranks 3", "--torch", "--layout", "--json", "pytest --with-mpi", "diagnose_step.py"):
        assert needle in joined, needle
    assert len(COMMANDS) >= 15


def test_every_file_the_doc_names_exists():
    names = set(re.findall(r"[\w./-]+\.(?:py|md)\b", TEXT))
    names = {n for n in names if "/" in n or n.endswith(".md")}
    assert names, "no file named?"
    missing = [n for n in sorted(names) if not (ROOT / n).exists() and not (ROOT / "docs" / n).exists()]
    assert not missing, missing
    for bare in re.findall(r"`([a-z_]\w*\.py)`", TEXT):  # a bare file name (not FILE.py): an example
        assert (ROOT / "examples" / "judge" / bare).exists(), bare


def test_the_test_file_to_copy_is_the_one_in_the_repository():
    shown = [b for b in _blocks("python") if b.startswith('"""Check your own distributed clip')]
    assert shown == [(ROOT / "examples" / "judge" / "test_my_clip.py").read_text()]


def _run(command: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_"))}
    env["NO_COLOR"] = "1"
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    words = shlex.split(command)
    if words[0] == "mpirun":
        assert words[1] == "-n"
        args = [sys.executable if w == "python" else w for w in words[3:]]
        old = os.getcwd()
        os.chdir(ROOT)
        try:
            return mpirun.run(int(words[2]), *args, timeout=TIMEOUT, env={"NO_COLOR": "1"})
        finally:
            os.chdir(old)
    command = re.sub(r"(^|[(&] *)python ", rf"\1{shlex.quote(sys.executable)} ", command)
    return subprocess.run(
        ["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT, env=env
    )


def _params() -> list:
    """The doc's commands; those that judge with PyTorch (--torch) need it."""
    return [
        pytest.param(c, marks=pytest.mark.torch) if "--torch" in c.split() else c for c in sorted(COMMANDS)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("command", _params())
def test_every_command_of_the_doc_runs_as_shown(command):
    want = COMMANDS[command]
    proc = _run(command)
    if want["exit"] is not None:
        assert proc.returncode == want["exit"], (proc.stdout[-3000:], proc.stderr[-3000:])
    else:
        assert proc.returncode in (0, 1), (proc.stdout[-3000:], proc.stderr[-3000:])
    out = proc.stdout.splitlines()
    at = 0
    for line in want["shown"]:
        try:
            at = out.index(line, at) + 1
        except ValueError:
            pytest.fail(f"{command}: the doc shows\n{line}\nbut the output is\n{proc.stdout[-4000:]}")
    if "--json" in command:
        import json

        json.loads(proc.stdout)
