"""The conformance judge: does a third-party ``(shards, limit) -> shards`` keep the seed contract?

usage:: python -m gclip.conformance FILE.py:FUNC [--random 200] [--seed 0] [--timeout 5] [--json]
        python -m gclip.conformance package.module:func ...

It runs the seed record's seven checks for N = 1..5, a few edge cases and many
seeded random layouts (empty shards, uneven widths, zero limits, gradients
below and above the limit, 0 to 8 shards) against gclip's reference
``gclip.clip_shards``, and prints a verdict. When the implementation fails,
the judge names the gallery bug whose outputs it reproduces (its
*fingerprint*), by running every bug of ``gclip.strategies`` on the same
cases with one simulated rank per shard.

The implementation runs in a worker process, one call at a time, each under
``--timeout``: a call that raises, hangs, crashes the process or calls
``sys.exit`` is judged as a failure, never taken for the judge's own. The
judge is a single process and needs no MPI. It has its own small entry point
rather than ``_cli.entry``: its exit 1 means "fails the contract", so its own
faults exit 3 instead of aborting an MPI job.

Exit status: 0 pass, 1 fail, 2 usage error (bad spec, missing file or
function, a file that cannot be loaded), 3 an internal error of the judge.
"""

from __future__ import annotations

import json
import math
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from ._lab import cli as _cli

__all__ = ["Case", "Outcome", "Verdict", "judge", "main", "make_cases", "parse_target"]

ABS_TOL = 1e-11  # the contract rounds to 12 decimals: one flip of the last digit is 1e-12
REL_TOL = 1e-12  # sums in another order differ by a few ulps, ~1e-15 relative
MATCH_SHARE = 0.95  # a bug must reproduce this share of the outputs (and of the failures)
MAX_LOST = 3  # calls that hang or crash the worker before the judge stops calling


# ---------------------------------------------------------------------------
# the cases


class Case(NamedTuple):
    label: str
    shards: list[list[float]]
    limit: float
    exact: bool  # the seed's checks compare with ==, as the record does


def make_cases(count: int, seed: int) -> list[Case]:
    """The seed's checks for N = 1..5, the edge cases, then ``count`` random layouts."""
    from .contract import seed_checks

    cases = [
        Case(f"seed N={n}: {c.label}", c.shards, c.limit, True) for n in range(1, 6) for c in seed_checks(n)
    ]
    cases += _edge_cases()
    rng = random.Random(seed)
    cases += [_random_case(rng, i) for i in range(count)]
    return cases


def _edge_cases() -> list[Case]:
    return [
        Case("edge: limit equals the norm", [[3, 0], [4]], 5, False),
        Case("edge: negative values", [[-3.0, 1.5], [], [-4.0]], 2.5, False),
        Case("edge: one element on each of 8 shards", [[1.0]] * 8, 2.0, False),
        Case("edge: tiny values", [[3e-9, -4e-9], [1e-9]], 1e-9, False),
        Case("edge: large values", [[300.0, -400.0], [1200.0]], 100.0, False),
        Case("edge: only empty shards", [[], [], []], 1.0, False),
        Case("edge: zero limit, several shards", [[1.0, -2.0], [3.0]], 0, False),
    ]


def _random_case(rng: random.Random, i: int) -> Case:
    """One random layout: every knob the contract has, drawn from a seeded stream."""
    ranks = rng.choice([0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 6, 8])
    widths = [rng.choice([0, 1, 1, 2, 3, 4, 5, 7]) for _ in range(ranks)]
    kind = rng.random()
    if kind < 0.1:
        shards: list[list[float]] = [[0] * w for w in widths]
    elif kind < 0.35:
        shards = [[rng.randint(-9, 9) for _ in range(w)] for w in widths]
    else:
        mag = 10 ** rng.uniform(-2.0, 2.5)
        shards = [[float(f"{rng.uniform(-1, 1) * mag:.6g}") for _ in range(w)] for w in widths]
    norm = math.sqrt(math.fsum(v * v for s in shards for v in s))
    pick = rng.random()
    if pick < 0.1:
        limit: float = 0.0
    elif norm == 0.0:
        limit = float(f"{rng.uniform(0.1, 5):.6g}")
    elif pick < 0.35:  # above the norm: unchanged
        limit = float(f"{norm * rng.uniform(1.05, 3.0):.6g}")
    else:  # below: clipped
        limit = float(f"{norm * rng.uniform(0.05, 0.95):.6g}")
    return Case(f"random #{i} ({ranks} shards)", shards, limit, False)


# ---------------------------------------------------------------------------
# the worker: the implementation runs here, never in the judge's process


def _serve() -> None:
    """Worker main: load the target, then answer one JSON call per line."""
    import importlib
    import importlib.util
    import numbers

    proto_in = os.fdopen(os.dup(0), "r")
    proto_out = os.fdopen(os.dup(1), "w")
    quiet = os.open(os.devnull, os.O_RDWR)
    os.dup2(quiet, 0)  # the implementation's input() and print() reach /dev/null,
    os.dup2(quiet, 1)  # not the judge's protocol

    def send(obj: dict) -> None:
        proto_out.write(json.dumps(obj) + "\n")
        proto_out.flush()

    kind, target, func = sys.argv[1:4]
    note = None
    try:
        if kind == "file":
            folder = os.path.dirname(os.path.abspath(target))
            sys.path.insert(0, folder)
            spec = importlib.util.spec_from_file_location("__judged__", target)
            if spec is None or spec.loader is None:
                raise ImportError(f"not a Python file: {target}")
            module = importlib.util.module_from_spec(spec)
            sys.modules["__judged__"] = module
            try:
                spec.loader.exec_module(module)
            except SystemExit as exc:  # e.g. the seed's scripts: checks, then exit
                note = f"the file called sys.exit({exc.code!r}) while loading; judging what it defined"
        else:
            module = importlib.import_module(target)
        fn: Any = module
        for part in func.split("."):
            if not hasattr(fn, part):
                raise LookupError(f"no function {func!r} in {target}")
            fn = getattr(fn, part)
        if not callable(fn):
            raise LookupError(f"{func!r} in {target} is not callable (type {type(fn).__name__})")
    except LookupError as exc:
        send({"usage": str(exc)})
        return
    except BaseException as exc:  # noqa: BLE001 - anything the file does while loading
        send({"usage": f"cannot load {target}: {_exc_text(exc)}"})
        return
    send({"loaded": True, "note": note})

    def shape(value: Any) -> tuple[list | None, str | None]:
        if not isinstance(value, (list, tuple)):
            return None, f"returned {type(value).__name__}, not a list of lists of numbers"
        rows = []
        for i, shard in enumerate(value):
            if not isinstance(shard, (list, tuple)):
                return None, f"returned shard {i} as {type(shard).__name__}, not a list of numbers"
            row = []
            for j, v in enumerate(shard):
                if isinstance(v, bool) or not isinstance(v, numbers.Real):
                    return None, f"returned shard {i} item {j} as {type(v).__name__}, not a number"
                try:
                    row.append(float(v))
                except (OverflowError, ValueError) as exc:
                    return None, f"shard {i} item {j}: {exc}"
            rows.append(row)
        return rows, None

    for line in proto_in:
        request = json.loads(line)
        try:
            value = fn(request["shards"], request["limit"])
        except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt too
            send({"raised": _exc_text(exc)})
            continue
        rows, why = shape(value)
        send({"value": _jsonable(rows)} if why is None else {"bad": why})


def _exc_text(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


class Outcome(NamedTuple):
    """What one call gave: a value, or why there is none."""

    value: list[list[float]] | None
    problem: str | None  # "raised ...", "returned ...", "timed out ...", "crashed ..."
    lost: bool = False  # the worker had to be killed or died


class _Worker:
    """The implementation in a subprocess; replies are read with a deadline (select)."""

    def __init__(self, kind: str, target: str, func: str, timeout: float) -> None:
        self.timeout = timeout
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from gclip.conformance import _serve; _serve()", kind, target, func],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # so close() ends whatever the implementation started too
        )
        self.buffer = b""
        self.eof = False

    def receive(self, timeout: float) -> dict | None:
        """The next message; None if the worker did not answer in time or closed its end."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if self.eof or left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            self.eof = not chunk
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def exit_status(self) -> int | None:
        """The worker's exit status once its end is closed (None: still running)."""
        if not self.eof:
            return self.proc.poll()
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # closed its output but lives on: treat as a hang
            return None

    def call(self, shards: list, limit: float) -> Outcome:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"shards": shards, "limit": limit}).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:  # the worker is gone (or closed its input): lost either way
            self.eof = True
            status = self.exit_status()
            return Outcome(None, f"crashed the process (exit status {status})", True)
        reply = self.receive(self.timeout)
        if reply is None:
            status = self.exit_status()
            if status is None:
                return Outcome(None, f"timed out: no answer within {self.timeout:g} s", True)
            return Outcome(None, f"crashed the process (exit status {status})", True)
        if "raised" in reply:
            return Outcome(None, f"raised {reply['raised']}")
        if "bad" in reply:
            return Outcome(None, reply["bad"])
        return Outcome(_from_json(reply["value"]), None)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass


def _jsonable(rows: Any) -> Any:
    """Non-finite floats as strings, so the JSON stays standard."""
    if isinstance(rows, list):
        return [_jsonable(r) for r in rows]
    if isinstance(rows, float) and not math.isfinite(rows):
        return str(rows)
    return rows


def _from_json(rows: Any) -> Any:
    if isinstance(rows, list):
        return [_from_json(r) for r in rows]
    return float(rows) if isinstance(rows, str) else rows


# ---------------------------------------------------------------------------
# judging


class Target(NamedTuple):
    kind: str  # "file" or "module"
    where: str
    func: str

    def __str__(self) -> str:
        return f"{self.where}:{self.func}"


def parse_target(spec: str) -> Target:
    """``FILE.py:FUNC`` or ``package.module:func`` (``FILE.py`` alone means ``solve``)."""
    where, sep, func = spec.rpartition(":")
    if not sep:
        where, func = spec, "solve" if spec.endswith(".py") else ""
    if not where or not func:
        raise _cli.UsageError(f"bad target {spec!r}: give FILE.py:FUNC or module:func")
    if not all(part.isidentifier() for part in func.split(".")):
        raise _cli.UsageError(f"bad target {spec!r}: {func!r} is not a function name")
    if where.endswith(".py") or os.sep in where or "/" in where:
        if not os.path.isfile(where):
            raise _cli.UsageError(f"no such file: {where}")
        return Target("file", where, func)
    if not all(part.isidentifier() for part in where.split(".")):
        raise _cli.UsageError(f"bad target {spec!r}: {where!r} is neither a .py file nor a module name")
    return Target("module", where, func)


class Verdict(NamedTuple):
    target: str
    cases: list[Case]
    outcomes: list[Outcome]
    expected: list[list[list[float]]]
    failed: list[int]  # indices into cases
    reasons: dict[int, str]
    fingerprint: str | None
    scores: dict[str, float]
    stopped: str | None
    note: str | None

    @property
    def passed(self) -> bool:
        return not self.failed and self.stopped is None


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= ABS_TOL + REL_TOL * abs(b)


def _same(actual: list, expected: list) -> bool:
    """Same layout, and every value within the tolerance."""
    return _layout(actual) == _layout(expected) and all(
        _close(a, b) for ra, rb in zip(actual, expected) for a, b in zip(ra, rb)
    )


def _layout(rows: list) -> list[int]:
    return [len(r) for r in rows]


def check(case: Case, expected: list, outcome: Outcome) -> str | None:
    """Why the outcome fails the case, or None when it passes."""
    if outcome.value is None:
        return outcome.problem
    actual = outcome.value
    if _layout(actual) != _layout(expected):
        return f"wrong layout: {len(actual)} shards of widths {_layout(actual)}, expected {_layout(expected)}"
    pairs = [
        (a, b, i, j)
        for i, (ra, rb) in enumerate(zip(actual, expected))
        for j, (a, b) in enumerate(zip(ra, rb))
    ]
    wrong = [(abs(a - b) if math.isfinite(a) else math.inf, i, j) for a, b, i, j in pairs if not _close(a, b)]
    if wrong:
        gap, i, j = max(wrong)
        return f"wrong values: {len(wrong)} of {len(pairs)} differ, most at shard {i} item {j} (by {gap:.6g})"
    if case.exact and actual != expected:
        return "equal only to ~1e-11: the seed's checks compare exactly (round to 12 decimals)"
    loose = [(a, i, j) for a, _, i, j in pairs if a != round(a, 12)]
    if loose:
        a, i, j = loose[0]
        return f"not rounded to 12 decimals (shard {i} item {j} is {a!r})"
    return None


def _bug_outputs(cases: Sequence[Case]) -> dict[str, list[list | None]]:
    """Each gallery bug's rounded outputs on the cases, one simulated rank per shard."""
    import numpy as np

    from .clip import clip_simulated
    from .contract import rounded
    from .strategies import BUGS

    out: dict[str, list[list | None]] = {}
    for bug in BUGS:
        rows: list[list | None] = []
        for case in cases:
            if not case.shards:
                rows.append([])
                continue
            try:
                ranks = [[np.asarray(s, dtype=np.float64)] for s in case.shards]
                results = clip_simulated(ranks, case.limit, mode=bug.name)
                rows.append([rounded(r.grads[0]) for r in results])
            except Exception:  # noqa: BLE001 - a bug that cannot run on this data never matches
                rows.append(None)
        out[bug.name] = rows
    return out


def fingerprint(
    cases: Sequence[Case], expected: Sequence[list], outcomes: Sequence[Outcome], failed: Sequence[int]
) -> tuple[str | None, dict[str, float]]:
    """The gallery bug that reproduces the implementation's outputs, or "unknown".

    A bug matches when its outputs equal the implementation's on at least
    MATCH_SHARE of the cases that returned a value, and it explains at least
    MATCH_SHARE of the wrong values: on those cases the bug itself is wrong,
    in the same way. Results wrong only in their rounding are no wrong values:
    an unrounded per-rank clip is still per-rank. Bugs that need inf-norms, replicated tensors or float16
    overflow give the correct result on most contract data: they explain no
    failure and so never match by accident.
    """
    if not failed:
        return None, {}
    valid = [i for i, o in enumerate(outcomes) if o.value is not None]
    # wrong values only: a result right but for its rounding says nothing of the norm
    wrong = [i for i in failed if outcomes[i].value is not None and not _same(outcomes[i].value, expected[i])]
    if not wrong:
        return "unknown", {}
    scores: dict[str, float] = {}
    best: tuple[int, int, str] | None = None
    for name, rows in _bug_outputs(cases).items():
        hits = {i for i in valid if rows[i] is not None and _same(outcomes[i].value, rows[i])}
        explained = sum(i in hits and not _same(rows[i], expected[i]) for i in wrong)
        scores[name] = round(len(hits) / len(valid), 4)
        if explained and explained >= MATCH_SHARE * len(wrong) and len(hits) >= MATCH_SHARE * len(valid):
            if best is None or (len(hits), explained) > best[:2]:
                best = (len(hits), explained, name)
    return (best[2] if best else "unknown"), scores


def judge(target: Target, count: int = 200, seed: int = 0, timeout: float = 5.0) -> Verdict:
    """Run every case through the implementation and compare with ``gclip.clip_shards``."""
    from .contract import clip_shards

    cases = make_cases(count, seed)
    expected = [clip_shards(c.shards, c.limit) for c in cases]
    worker, note = _start(target, timeout)
    outcomes: list[Outcome] = []
    lost = 0
    stopped = None
    try:
        for case in cases:
            outcome = worker.call(case.shards, case.limit)
            outcomes.append(outcome)
            if outcome.lost:
                lost += 1
                worker.close()
                if lost >= MAX_LOST:
                    left = len(cases) - len(outcomes)
                    stopped = f"{lost} calls hung or crashed; the other {left} cases were not run"
                    break
                worker, _ = _start(target, timeout)
    finally:
        worker.close()
    cases, expected = cases[: len(outcomes)], expected[: len(outcomes)]
    reasons = {}
    for i, (case, exp, outcome) in enumerate(zip(cases, expected, outcomes)):
        why = check(case, exp, outcome)
        if why is not None:
            reasons[i] = why
    failed = sorted(reasons)
    name, scores = fingerprint(cases, expected, outcomes, failed)
    if stopped and name is None:
        name = "unknown"
    return Verdict(str(target), cases, outcomes, expected, failed, reasons, name, scores, stopped, note)


def _start(target: Target, timeout: float) -> tuple[_Worker, str | None]:
    """A loaded worker, or a usage error when the target cannot be loaded."""
    worker = _Worker(target.kind, target.where, target.func, timeout)
    hello = worker.receive(max(10.0, timeout))
    if hello is None or "usage" in hello:
        alive = worker.exit_status() is None
        worker.close()
        if hello is not None:
            raise _cli.UsageError(hello["usage"])
        why = "timed out while loading" if alive else "the worker process died while loading"
        raise _cli.UsageError(f"cannot load {target}: {why}")
    return worker, hello.get("note")


# ---------------------------------------------------------------------------
# reporting


def as_json(v: Verdict, count: int, seed: int, timeout: float) -> dict:
    return {
        "target": v.target,
        "passed": v.passed,
        "checks": len(v.cases),
        "failed": len(v.failed),
        "fingerprint": v.fingerprint,
        "fingerprint_scores": v.scores,
        "stopped": v.stopped,
        "note": v.note,
        "random": count,
        "seed": seed,
        "timeout": timeout,
        "failures": [
            {
                "check": v.cases[i].label,
                "shards": v.cases[i].shards,
                "limit": v.cases[i].limit,
                "expected": v.expected[i],
                "actual": _jsonable(v.outcomes[i].value),
                "reason": v.reasons[i],
            }
            for i in v.failed
        ],
    }


def _short(value: Any, width: int = 90) -> str:
    text = json.dumps(_jsonable(value))
    return text if len(text) <= width else text[: width - 3] + "..."


def report(v: Verdict, count: int, seed: int, shown: int = 5) -> list[str]:
    """The readable verdict, line by line."""
    from .strategies import STRATEGIES

    groups = [
        ("seed checks (N = 1..5)", "seed"),
        ("edge cases", "edge"),
        (f"random layouts (seed {seed})", "random"),
    ]
    lines = [f"gclip.conformance: judging {v.target} against the seed contract"]
    if v.note:
        lines.append(f"  note: {v.note}")
    for title, prefix in groups:
        run = [i for i, c in enumerate(v.cases) if c.label.startswith(prefix)]
        bad = sum(i in v.reasons for i in run)
        lines.append(f"  {title:<26} {len(run):>4} run  {bad:>4} failed")
    if v.stopped:
        lines.append(f"  stopped: {v.stopped}")
    if v.passed:
        lines.append(_cli.color(f"verdict: PASS ({len(v.cases)} checks)", "32"))
        return lines
    lines.append(_cli.color(f"verdict: FAIL ({len(v.failed)} of {len(v.cases)} checks failed)", "31"))
    if v.fingerprint in STRATEGIES:
        bug = STRATEGIES[v.fingerprint]
        lines.append(f"fingerprint: {bug.name}: {bug.summary}")
        lines.append(f"  seen in: {bug.incident}")
        lines.append(f"  why it is wrong: {bug.explanation}")
        lines.append(
            f"  its outputs match this implementation on {v.scores[bug.name]:.0%} of the answered cases"
        )
    else:
        lines.append("fingerprint: unknown (it fails like no bug of the gallery)")
    lines.append(f"first {min(shown, len(v.failed))} failures:")
    for i in v.failed[:shown]:
        case, outcome = v.cases[i], v.outcomes[i]
        lines.append(f"  {case.label}")
        lines.append(f"    shards   {_short(case.shards)}  limit {case.limit!r}")
        lines.append(f"    expected {_short(v.expected[i])}")
        if outcome.value is not None:
            lines.append(f"    actual   {_short(outcome.value)}")
        lines.append(f"    reason   {v.reasons[i]}")
    return lines


# ---------------------------------------------------------------------------
# command line


def _nonneg_int(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 100_000:
        raise ValueError(text)
    return value


_nonneg_int.__name__ = "count (0..100000)"


def _timeout(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and 0 < value <= 3600):
        raise ValueError(text)
    return value


_timeout.__name__ = "timeout (seconds, > 0)"


def _parser() -> _cli.ArgParser:
    p = _cli.ArgParser(prog="gclip.conformance", description=__doc__.split("\n\n")[0])
    p.add_argument("target", help="FILE.py:FUNC or package.module:func, a function (shards, limit) -> shards")
    p.add_argument("--random", type=_nonneg_int, default=200, help="random layouts to try (default 200)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random layouts (default 0)")
    p.add_argument("--timeout", type=_timeout, default=5.0, help="seconds per call (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text verdict")
    return p


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    target = parse_target(args.target)
    verdict = judge(target, args.random, args.seed, args.timeout)
    if args.json:
        text = json.dumps(as_json(verdict, args.random, args.seed, args.timeout), allow_nan=False)
    else:
        text = "\n".join(report(verdict, args.random, args.seed))
    try:
        print(text, flush=True)
    except BrokenPipeError:  # e.g. piped into `head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if verdict.passed else 1


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: exit 0 pass, 1 fail, 2 usage error, 3 the judge's own fault (one line each)."""
    from .errors import GclipError

    code = 3
    try:
        code = _main(argv)
    except (_cli.UsageError, GclipError) as exc:
        print(f"gclip.conformance: error: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
        code = 2
    except SystemExit as exc:  # --help
        code = exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:
        print("gclip.conformance: interrupted", file=sys.stderr, flush=True)
        code = 130
    except Exception as exc:  # noqa: BLE001 - the judge's own fault: one line, not a traceback
        print(f"gclip.conformance: internal error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
