"""scripts/cluster-sim: MPI jobs across simulated hosts (Linux network namespaces).

Plain pytest (not under mpirun). cluster-sim needs root and network namespaces;
where it cannot have them it exits 77 and these tests skip, saying why. Every
subprocess runs under a timeout, and cluster-sim itself runs every job under a
watchdog (MPIEXEC_TIMEOUT plus `timeout`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import venv_env

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_SIM = ROOT / "scripts" / "cluster-sim"
SKIP_EXIT = 77

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="cluster-sim needs Linux namespaces"),
    pytest.mark.skipif(
        "--with-mpi" in sys.argv or "PMI_RANK" in os.environ or "OMPI_COMM_WORLD_SIZE" in os.environ,
        reason="cluster-sim tests start their own mpiexec; run them with plain pytest, not under mpirun",
    ),
]

# One JSON line per rank (printed by rank 0): its host, the Allreduce result, and
# how many bytes its host's eth0 sent during a 1 MB Allreduce (proof that the traffic
# between hosts crossed the simulated network instead of shared memory).
ALLREDUCE = r"""
import json, numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
def tx():
    try:
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return -1
out = np.empty(1)
comm.Allreduce(np.array([comm.rank + 1.0]), out)
big = np.ones(1 << 17)
res = np.empty_like(big)
before = tx()
comm.Allreduce(big, res)
comm.Barrier()
sent = tx() - before
mine = {"rank": comm.rank, "size": comm.size, "host": MPI.Get_processor_name(),
        "sum": float(out[0]), "big_ok": bool((res == comm.size).all()), "tx_bytes": sent}
every = comm.gather(mine, root=0)  # rank 0 prints all: output of ranks is not interleaved
if comm.rank == 0:
    print("\n".join(json.dumps(r) for r in every), flush=True)
"""

# Rank 0 says when the loop runs; then every rank does Allreduce for up to 120 s.
LONG_LOOP = r"""
import time, numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
a = np.ones(1024)
b = np.empty_like(a)
comm.Allreduce(a, b)
if comm.rank == 0:
    print("loop started", flush=True)
t0 = time.monotonic()
while time.monotonic() - t0 < 120:
    comm.Allreduce(a, b)
if comm.rank == 0:
    print("loop finished", flush=True)
"""


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run with a timeout; on expiry send SIGTERM first so cluster-sim's trap can clean up."""
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=venv_env(),
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"{' '.join(args)} did not finish within {timeout}s\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _skip_if_unavailable(res: subprocess.CompletedProcess) -> None:
    if res.returncode == SKIP_EXIT:
        msg = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "exit 77"
        pytest.skip(msg.removeprefix("cluster-sim: "))


def cluster_sim(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run scripts/cluster-sim -v ARGS; skips the test when it exits 77."""
    res = _run([str(CLUSTER_SIM), "-v", *args], timeout)
    _skip_if_unavailable(res)
    return res


def run_prefix(res: subprocess.CompletedProcess) -> str:
    m = re.search(r"run (gcsim[0-9a-f]{6})", res.stderr)
    assert m, f"cluster-sim -v did not name its run:\n{res.stderr}"
    return m.group(1)


def assert_nothing_left(prefix: str) -> None:
    """No namespace, link (in this namespace) or temp entry with the run's prefix survives."""
    ip = shutil.which("ip", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
    assert ip, "ip(8) is needed to check for leftovers"
    netns = subprocess.run([ip, "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    links = subprocess.run([ip, "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
    temps = [p for p in os.listdir(tempfile.gettempdir()) if p.startswith(prefix)]
    assert prefix not in netns, f"namespaces left behind:\n{netns}"
    assert prefix not in links, f"links left behind:\n{links}"
    assert not temps, f"temp files left behind: {temps}"
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, timeout=30).stdout
    assert prefix not in ps, f"processes left behind:\n{ps}"


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_usage_error_exits_2():
    res = _run([str(CLUSTER_SIM), "--hosts", "0", "--ranks-per-host", "1", "--", "true"], timeout=30)
    assert res.returncode == 2, res.stderr
    assert "--hosts" in res.stderr


def test_allreduce_across_two_hosts():
    t0 = time.monotonic()
    args = "--hosts 2 --ranks-per-host 2 --timeout 60 --".split()
    res = cluster_sim(*args, sys.executable, "-c", ALLREDUCE, timeout=120)
    elapsed = time.monotonic() - t0
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout}\n{res.stderr}"
    ranks = sorted(json_lines(res.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3], res.stdout
    assert all(r["size"] == 4 and r["sum"] == 10.0 and r["big_ok"] for r in ranks), ranks
    # K consecutive ranks per host, each host with its own name
    assert [r["host"] for r in ranks] == ["gclip-host0"] * 2 + ["gclip-host1"] * 2, ranks
    # the 1 MB Allreduce left each host through its eth0 (TCP over the veth link)
    assert all(r["tx_bytes"] >= (1 << 17) * 8 // 2 for r in ranks), ranks
    assert_nothing_left(run_prefix(res))
    print(f"2 hosts x 2 ranks: {elapsed:.1f}s")


def _demo_available() -> bool:
    probe = "import importlib.util as u, sys; sys.exit(0 if u.find_spec('gclip.demo') else 1)"
    try:
        return subprocess.run([sys.executable, "-c", probe], env=venv_env(), timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def test_demo_on_two_hosts_matches_one_host():
    if not _demo_available():
        pytest.skip("gclip.demo is not importable yet")
    args = "--hosts 2 --ranks-per-host 2 --timeout 120 --".split()
    res = cluster_sim(*args, sys.executable, "-m", "gclip.demo", "--json", timeout=180)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout}\n{res.stderr}"
    lines = json_lines(res.stdout)
    assert len(lines) == 1, f"expected one JSON line from rank 0:\n{res.stdout}"
    multi = lines[0]
    hosts = {r["host"] for r in multi["per_rank"]}
    assert hosts == {"gclip-host0", "gclip-host1"}, multi["per_rank"]
    assert sorted(r["rank"] for r in multi["per_rank"]) == [0, 1, 2, 3]
    assert_nothing_left(run_prefix(res))

    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    assert mpirun, "mpirun not found"
    one = _run(["timeout", "60", mpirun, "-n", "4", sys.executable, "-m", "gclip.demo", "--json"], timeout=90)
    assert one.returncode == 0, f"exit {one.returncode}\n{one.stdout}\n{one.stderr}"
    single = json_lines(one.stdout)
    assert len(single) == 1, one.stdout
    assert len({r["host"] for r in single[0]["per_rank"]}) == 1
    assert multi["global_norm"] == pytest.approx(single[0]["global_norm"], rel=1e-12, abs=0.0)


def test_cut_link_ends_job_within_watchdog():
    """A host lost mid-job: the job ends non-zero with a clear message, not a hang."""
    watchdog, cut_after = 20, 3  # the job starts within ~0.5 s; the cut comes while it loops
    t0 = time.monotonic()
    args = f"--hosts 2 --ranks-per-host 1 --timeout {watchdog} --cut-link-after {cut_after} 1 --".split()
    res = cluster_sim(*args, sys.executable, "-c", LONG_LOOP, timeout=watchdog + 60)
    elapsed = time.monotonic() - t0
    assert "loop started" in res.stdout, f"job never ran:\n{res.stdout}\n{res.stderr}"
    assert "loop finished" not in res.stdout
    assert res.returncode != 0
    assert res.returncode == 124, res.stderr
    assert "cut the link of gclip-host1" in res.stderr
    assert re.search(rf"cluster-sim: job timed out after [0-9.]+s \(watchdog {watchdog}s\)", res.stderr), (
        res.stderr
    )
    assert elapsed < watchdog + 25, f"took {elapsed:.1f}s"
    # ranks stuck behind the cut link must not survive the run
    assert_nothing_left(run_prefix(res))


# Starts a command with SIGINT's default disposition: a shell ignores SIGINT in the commands it
# starts with `&` (no job control), and a bash script cannot trap a signal ignored on entry, so
# a suite run in the background would otherwise test nothing but that.
WITH_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def test_interrupt_cleans_up():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            WITH_SIGINT,
            str(CLUSTER_SIM),
            "-v",
            "--hosts",
            "2",
            "--ranks-per-host",
            "1",
            "--timeout",
            "60",
            "--",
            sys.executable,
            "-c",
            LONG_LOOP,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=venv_env(),
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )
    try:
        line = proc.stdout.readline()  # blocks until the job runs (or cluster-sim exits)
        if not line:
            out, err = proc.communicate(timeout=30)
            _skip_if_unavailable(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
            pytest.fail(f"job did not start:\n{err}")
        assert "loop started" in line
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "interrupted by SIGINT" in err
    assert_nothing_left(run_prefix(subprocess.CompletedProcess(proc.args, proc.returncode, out, err)))


def test_exits_77_without_namespace_privileges():
    """The skip contract: no permission for namespaces -> exit 77 and a one-line reason."""
    if os.geteuid() != 0:
        res = _run([str(CLUSTER_SIM), "--hosts", "2", "--ranks-per-host", "1", "--", "true"], timeout=30)
    else:
        unshare = shutil.which("unshare")
        if unshare is None:
            pytest.skip("unshare(1) not available to drop privileges")
        # a fresh user namespace: still uid 0 inside, but no rights over the host's network
        if subprocess.run([unshare, "--user", "--map-root-user", "true"], timeout=30).returncode != 0:
            pytest.skip("user namespaces are not permitted here")
        res = _run(
            [
                unshare,
                "--user",
                "--map-root-user",
                str(CLUSTER_SIM),
                "--hosts",
                "2",
                "--ranks-per-host",
                "1",
                "--",
                "true",
            ],
            timeout=30,
        )
    assert res.returncode == SKIP_EXIT, f"exit {res.returncode}\n{res.stderr}"
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot simulate hosts" in lines[0], res.stderr
