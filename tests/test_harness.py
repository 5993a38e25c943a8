"""The test harness itself: one Hypothesis profile for CI and users, per-test time limits that
name the test, conftest.mpirun ending whole process groups, scripts/test's one-line failures.

Each check runs pytest (or scripts/test) in a subprocess on a small test file written here,
with tests/conftest.py loaded as a plugin, the project's pytest options and a short limit.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import ROOT, mpirun

TESTS = Path(__file__).resolve().parent


def run_pytest(tmp_path: Path, source: str, *args: str, env: dict | None = None, timeout: float = 120):
    """pytest on one test file, with conftest.py as a plugin and pyproject.toml's options
    (``env``: variables to set, or to unset with None)."""
    test = tmp_path / "test_sample.py"
    test.write_text(textwrap.dedent(source))
    full_env = {**os.environ, **(env or {})}
    for key in [k for k, v in full_env.items() if v is None]:  # None: not set
        del full_env[key]
    full_env["PYTHONPATH"] = os.pathsep.join([str(TESTS), full_env.get("PYTHONPATH", "")])
    full_env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider"]
    cmd += ["-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), *args, str(test)]
    start = time.monotonic()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=full_env, timeout=timeout, stdin=subprocess.DEVNULL
    )
    return proc, time.monotonic() - start


# --------------------------------------------------------------------------- Hypothesis

PROFILE_PROBE = """
    import json, os
    from hypothesis import given, settings, strategies as st

    @given(st.integers(), st.floats())
    def test_profile_and_examples(i, f):
        s = settings.default
        assert settings.get_current_profile_name() == "gclip"
        assert s.derandomize is False and s.database is None and s.deadline is None
        with open(os.environ["EXAMPLES"], "a") as out:
            out.write(json.dumps([i, repr(f)]) + "\\n")
"""


@pytest.mark.parametrize("ci", ["true", None], ids=["CI=true", "no-CI"])
def test_one_hypothesis_profile_with_or_without_ci(tmp_path, ci):
    env = {"EXAMPLES": str(tmp_path / "examples"), "CI": ci}
    proc, _ = run_pytest(tmp_path, PROFILE_PROBE, "-q", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(
        r"hypothesis: seed \d+ \(replay this run's examples: --hypothesis-seed=\d+\)", proc.stdout
    )


def test_ci_and_users_draw_the_same_examples_from_a_seed(tmp_path):
    """Same seed, CI=true or not: the very same examples (no derandomized CI profile)."""
    drawn = {}
    for ci in ("true", None):
        out = tmp_path / f"examples-{ci or 'user'}"
        env = {"EXAMPLES": str(out), "CI": ci}
        proc, _ = run_pytest(tmp_path, PROFILE_PROBE, "-q", "--hypothesis-seed=12345", env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "hypothesis: seed 12345 " in proc.stdout
        drawn[ci] = out.read_text()
    assert drawn["true"] == drawn[None] and drawn[None].count("\n") > 10


def test_runs_draw_different_examples_without_a_seed(tmp_path):
    seen = []
    for k in range(2):
        out = tmp_path / f"examples-{k}"
        proc, _ = run_pytest(tmp_path, PROFILE_PROBE, "-q", env={"EXAMPLES": str(out), "CI": "true"})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        seen.append(out.read_text())
    assert seen[0] != seen[1], "two CI runs drew the same examples: derandomized"


# --------------------------------------------------------------------------- time limits


def test_the_suite_has_a_per_test_time_limit(request):
    assert float(request.config.getini("timeout")) == 300
    assert request.config.getini("timeout_method") == "signal"


def test_a_test_over_its_limit_fails_by_name(tmp_path):
    source = """
        import time

        def test_sleeps_too_long():
            time.sleep(60)
    """
    proc, elapsed = run_pytest(tmp_path, source, "-q", "--timeout=2")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1, log
    assert elapsed < 40, f"took {elapsed:.0f} s"
    assert re.search(r"FAILED \S*test_sample\.py::test_sleeps_too_long\b", log), log
    assert "Failed: Timeout (>2.0s) from pytest-timeout" in log, log


def test_a_hang_out_of_sigalrms_reach_is_named_by_the_backstop(tmp_path):
    # SIGALRM blocked in the main thread stands for a rank stuck inside an MPI collective
    source = """
        import signal, time

        def test_stuck_where_no_signal_reaches():
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(60)
    """
    proc, elapsed = run_pytest(tmp_path, source, "-q", "--timeout=1", env={"GCLIP_TEST_TIMEOUT_GRACE": "2"})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1, log
    assert elapsed < 40, f"took {elapsed:.0f} s"
    assert re.search(r"TIMEOUT: \S*test_sample\.py::test_stuck_where_no_signal_reaches still running", log), (
        log
    )
    assert "in test_stuck_where_no_signal_reaches" in log, log  # the stack of the main thread


def test_a_quick_test_is_left_alone_by_the_backstop(tmp_path):
    source = """
        import time

        def test_quick():
            time.sleep(0.5)

        def test_quick_again():
            time.sleep(2)  # beyond the first test's backstop: it must have been cancelled
    """
    proc, _ = run_pytest(tmp_path, source, "-q", "--timeout=1", env={"GCLIP_TEST_TIMEOUT_GRACE": "0.5"})
    log = proc.stdout + proc.stderr
    assert "TIMEOUT:" not in log, log
    assert "1 passed, 1 failed" in log or "1 failed, 1 passed" in log, log  # the second: over 1 s


# --------------------------------------------------------------------------- conftest.mpirun

IGNORES_SIGTERM = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()  # a file: the kill may cut stdout
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead but not yet reaped: not alive for this purpose
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return True
    return state != "Z"


@pytest.mark.slow
def test_mpirun_helper_ends_the_whole_process_group_on_timeout(tmp_path):
    # ranks that ignore SIGTERM and Hydra's watchdog set far away: only the group kill ends them
    start = time.monotonic()
    proc = mpirun(
        2, sys.executable, "-c", IGNORES_SIGTERM, str(tmp_path), timeout=5, env={"MPIEXEC_TIMEOUT": "600"}
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 124, proc.stdout + proc.stderr
    assert "ended its whole process group" in proc.stderr
    assert elapsed < 60, f"took {elapsed:.0f} s"
    pids = [int(f.name) for f in tmp_path.iterdir()]
    assert len(pids) == 2, pids
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], f"ranks left running: {pids}"


def test_mpirun_helper_keeps_its_interface():
    # stdin goes to rank 0 (Hydra's rule), so one rank reads it
    reader = "import sys; print(sys.stdin.read().upper())"
    proc = mpirun(1, sys.executable, "-c", reader, input="hi\n", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "HI" in proc.stdout


# --------------------------------------------------------------------------- scripts/test

SCRIPTS_TEST = ROOT / "scripts" / "test"


def test_scripts_test_is_python_without_gnu_timeout():
    text = SCRIPTS_TEST.read_text()
    assert text.startswith("#!/usr/bin/env python3\n")
    assert os.access(SCRIPTS_TEST, os.X_OK)
    assert not re.search(r"\btimeout --|\[\"timeout\"", text), "scripts/test must not need GNU timeout"


def test_scripts_test_fails_in_one_line():
    env = {**os.environ, "PYTHON": "no-such-python-here"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS_TEST)], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["scripts/test: FAILED: PYTHON=no-such-python-here not found"]


# --------------------------------------------------------------------------- CI = the README


def readme_test_command() -> str:
    """The README's one-line test command (the code block after 'Install and run the tests')."""
    text = (ROOT / "README.md").read_text()
    after = text[text.index("Install and run the tests") :]
    block = re.search(r"```bash\n(.+?)\n```", after, re.S)
    assert block, "no test command in the README"
    return block.group(1).strip()


def ci_steps() -> list[str]:
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_ci_runs_exactly_the_readme_test_command_before_any_torch():
    """The README's promise: its command passes on a bare machine, without PyTorch. CI runs
    it verbatim (a failure ends CI), with nothing installed before it; the torch extra comes
    after, and then only the tests that need torch run."""
    command = readme_test_command()
    install, _, test = command.rpartition(" && ")
    assert test == "scripts/test" and "pip install '.[test]'" in install, command
    steps = ci_steps()
    readme = [i for i, s in enumerate(steps) if s in (command, command + " || exit 1")]
    assert readme, f".ci/run does not run the README's test command: {command}"
    before = " ".join(steps[: readme[0]])
    assert not re.search(r"\bpip\b|\btorch\b", before), f"installed before the README's command: {before}"
    after = steps[readme[0] + 1 :]
    assert "scripts/test --torch" in after, "the torch extra's tests do not run"
    assert "GCLIP_DOCKER_REHEARSE" not in " ".join(steps)
    # nothing else installed but the torch extra
    others = [s for s in after if re.search(r"\bpip\b.*\binstall\b", s)]
    assert all("torch" in s for s in others), others


def test_the_torch_mark_is_derived_from_the_tests_code(tmp_path):
    """scripts/test --torch selects -m torch; conftest sets the mark on a test whose module
    imports torch (or asks for it at its top) and on a function that asks for it, so no list
    is kept by hand. Without torch, those tests skip with the reason."""
    import conftest

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--collect-only",
            "-m",
            "torch",
            "tests/test_numerics.py",
            "tests/test_torch.py",
            "tests/test_judge_docs.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    selected = {line.split("[")[0] for line in proc.stdout.splitlines() if "::" in line}
    # a function asking for torch inside a module that does not
    assert "tests/test_numerics.py::test_p_norms_match_torch_on_any_layout" in selected, proc.stdout[-2000:]
    assert "tests/test_numerics.py::test_no_overflow_no_underflow" not in selected
    # a command of docs/judge.md that needs torch (marked by hand: it is a subprocess)
    assert "tests/test_judge_docs.py::test_every_command_of_the_doc_runs_as_shown" in selected
    # a module that asks for torch at its top: every test of it (collected only with torch)
    assert any(n.startswith("tests/test_torch.py::") for n in selected) == conftest.HAS_TORCH
