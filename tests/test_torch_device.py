"""gclip.torch's sync-free path (``gclip.torch._device``): the same norm and scale as the host
path, one compiled graph, no host read, work that grows with groups and not with tensors.

Oracles: math.fsum over the float64 values (tests/torch_oracle.py), the host path's scaled
gradients bit for bit, torch.compile's results against eager, and counts of dispatched ops.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="gclip.torch needs PyTorch (pip install 'gclip[torch]')")

import gclip.torch as gt  # noqa: E402
import gclip.torch._device as device_path  # noqa: E402
from gclip import engine  # noqa: E402
from gclip.errors import GclipValueError  # noqa: E402
from gclip.torch import _compile  # noqa: E402
from torch_jobs import ROOT, assert_finished, job_env, run_job, torchrun_cmd  # noqa: E402
from torch_oracle import float64, fsum_norm  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def params(sizes=(5, 300, 7, 9), seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(sizes):
        p = torch.nn.Parameter(torch.zeros(n, dtype=DTYPES[i % len(DTYPES)]))
        p.grad = (torch.randn(n, generator=g) * 10).to(p.dtype)
        out.append(p)
    return out


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(device_path, "FORCE", True)


def test_the_device_path_gives_the_host_paths_norm_and_scale(forced):
    host_params, dev_params = params(), params()
    device_path.FORCE = False
    host = gt.clip_grad_norm_(host_params, 1.0)
    device_path.FORCE = True
    dev = gt.clip_grad_norm_(dev_params, 1.0)
    oracle = fsum_norm([float64(p.grad) for p in params()])
    assert abs(dev.item() - oracle) <= 4e-16 * oracle and abs(host.item() - oracle) <= 4e-16 * oracle
    assert dev.dtype == torch.float64 and dev.device == dev_params[0].grad.device
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(host_params, dev_params))


def test_max_norm_inf_and_a_norm_alone_scale_nothing(forced):
    ps = params()
    before = [p.grad.clone() for p in ps]
    oracle = fsum_norm([float64(g) for g in before])
    assert abs(gt.clip_grad_norm_(ps, math.inf).item() - oracle) <= 4e-16 * oracle
    assert abs(gt.get_total_norm([p.grad for p in ps]).item() - oracle) <= 4e-16 * oracle
    assert all(torch.equal(a, p.grad) for a, p in zip(before, ps))


def test_a_bad_argument_is_raised_with_the_gradients_untouched(forced):
    ps = params()
    before = [p.grad.clone() for p in ps]
    with pytest.raises(GclipValueError, match="rank 0 of 1: max_norm"):
        gt.clip_grad_norm_(ps, -1.0)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, ps))


def test_the_compile_time_fingerprint_is_the_engines():
    spec = engine.check([], 1.0, rank=0, size=1).spec
    assert device_path._crc_halves(spec.describe()) == spec.fingerprint


def test_the_constant_mark_is_the_one_torchs_marker_sets():
    def by_torch() -> int:
        return 1

    def by_gclip() -> int:
        return 1

    assert torch.compiler.assume_constant_result(by_torch) is by_torch
    assert _compile.constant_result(by_gclip) is by_gclip
    assert vars(by_gclip) == vars(by_torch) == {"_dynamo_marked_constant": True}


def test_importing_gclip_torch_leaves_dynamo_unloaded():
    """torch.compile's tracer (1.7 s of CPU per process) loads only when a job compiles."""
    ask = "import sys, gclip.torch; print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    got = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, timeout=120, check=True)
    assert got.stdout.strip() == "[]", got.stdout


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_with_fullgraph_no_break_and_bitwise_the_eager_result(forced, backend):
    eager_params, compiled_params = params(), params()
    eager = gt.clip_grad_norm_(eager_params, 1.0)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda: gt.clip_grad_norm_(compiled_params, 1.0), backend=backend, fullgraph=True
    )
    got = compiled()
    assert got.item() == eager.item()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager_params, compiled_params))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda: gt.clip_grad_norm_(params(), 1.0))()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_ops_dispatched_grow_with_dtype_groups_not_with_tensors(forced):
    def ops(n: int) -> list[str]:
        ps = [torch.nn.Parameter(torch.zeros(64)) for _ in range(n)]
        for p in ps:
            p.grad = torch.full((64,), 3.0)
        with _Ops() as seen:
            gt.clip_grad_norm_(ps, 1.0)
        return seen.ops

    assert ops(10) == ops(2000)  # each foreach op is one dispatch for the whole group
    assert ops(10).count("aten._foreach_norm.Scalar") == 1 and ops(10).count("aten._foreach_mul_.Tensor") == 1


def test_the_device_path_reads_nothing_on_the_host():
    """FakeTensors over torch's fake process group of 4 ranks, any host read raising."""
    job = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "torch_no_host_read.py")],
        capture_output=True,
        text=True,
        env=job_env(),
        timeout=300,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    out = json.loads(job.stdout.strip().splitlines()[-1])
    assert "aten._local_scalar_dense.default" not in out["ops"]
    for op in ("aten._foreach_norm.Scalar", "aten._foreach_mul_.Tensor", "c10d.allreduce_.default"):
        assert op in out["ops"]
    assert out["all_reduces"] == 1


@pytest.mark.slow
def test_compiled_in_a_two_rank_fsdp2_job(tmp_path):
    job = run_job(
        torchrun_cmd(2, str(ROOT / "tests" / "torch_compile_check.py"), str(tmp_path)), env=job_env()
    )
    assert_finished(job, [tmp_path / f"rank{r}.json" for r in range(2)])
    every = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in every:
        assert abs(r["eager"] - r["oracle"]) <= 1e-12 * r["oracle"]
        assert abs(r["eager"] - r["host"]) <= 4e-16 * r["host"]
        for backend in ("aot_eager", "inductor"):
            assert r[backend] == r["eager"], r[backend]
            assert r[f"{backend}_same_grads"]
        assert (r["graphs"], r["breaks"]) == (1, 0), r["reasons"]
