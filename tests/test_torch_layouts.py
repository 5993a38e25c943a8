"""gclip.torch on PyTorch's layouts under torchrun, 4 CPU processes (gloo): FSDP2, HSDP,
tensor parallel, FSDP x TP, two pipeline stages x FSDP, DDP (tests/torch_layouts_check.py),
the AMP recipes (tests/torch_amp_check.py) and DeviceMesh as comm (tests/torch_mesh_check.py),
every case in one torchrun job (tests/torch_batch.py), which the tests share.

The oracle: math.fsum over the squares of every full gradient (``full_tensor()``),
each tensor counted once. The clipped full gradient's norm must be min(max_norm, norm)
and every full gradient its old value times one scale.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch", reason="gclip.torch needs PyTorch (pip install 'gclip[torch]')")

from torch_jobs import ROOT, Batch, assert_finished, job_env, run_job, torchrun_cmd

pytestmark = pytest.mark.slow

RANKS = 4
LAYOUTS = ["fsdp", "hsdp", "tp", "fsdp_tp", "pp_fsdp", "ddp", "fsdp_2d"]
CASES = {
    **{layout: ("torch_layouts_check", layout) for layout in LAYOUTS},
    "amp-agreed": ("torch_amp_check", "agreed", "hsdp"),
    "amp-standard-hsdp": ("torch_amp_check", "standard", "hsdp"),
    "amp-standard-fsdp": ("torch_amp_check", "standard", "fsdp"),
    "amp-local": ("torch_amp_check", "local", "hsdp"),
    "mesh": ("torch_mesh_check",),
}


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Batch:
    return Batch(RANKS, CASES, tmp_path_factory.mktemp("layouts"))


def test_the_job_of_every_case_ends_cleanly(job):
    job.assert_finished()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_whole_models_norm_counted_once_and_the_full_gradient_clipped(layout, job):
    every = job.reports(layout)
    oracle = every[0]["oracle"]
    assert oracle > 0
    for r in every:
        assert r["oracle"] == oracle
        assert abs(r["norm"] - oracle) <= 1e-12 * oracle, (r["rank"], r["norm"], oracle)
        assert r["limit"] < r["norm"]  # the clip is at work
        assert abs(r["clipped"] - r["limit"]) <= 1e-6 * r["limit"]  # float32 gradients: rounded once each
        assert r["scaled_once"]
        assert abs(r["explain_norm"] - oracle) <= 1e-12 * oracle  # explain's rows: each value once
        assert abs(r["explain_shares"] - 1.0) <= 1e-12
    if layout in ("ddp", "tp", "fsdp_2d", "pp_fsdp"):  # undeclared: one line naming the declaration
        for r in every:
            assert r["undeclared"] == every[0]["undeclared"]
            assert r["undeclared"].startswith("GclipValueError: ranks 0, 1, 2, 3 of 4: parameters[0].grad")
            assert ("comm=" if layout == "pp_fsdp" else "replicated=") in r["undeclared"]
    # torch's own get_total_norm on this rank (measured for docs/torch.md)
    if layout in ("fsdp", "hsdp", "ddp", "fsdp_2d"):  # right (float32)
        assert all(abs(r["torch"] - oracle) <= 1e-6 * oracle for r in every)
    elif layout == "fsdp_tp":
        assert all("must have the same mesh" in r["torch"] for r in every)
    elif layout == "tp":  # the parameters TP leaves plain
        assert all("mixed torch.Tensor and DTensor" in r["torch"] for r in every)
    else:  # pp_fsdp, mesh (pp, dp): ranks 0-1 are stage 0, 2-3 stage 1; each clips by its own stage's norm
        stage0, stage1 = every[0]["torch"], every[2]["torch"]
        assert abs(stage0 - oracle) > 1e-3 * oracle and abs(stage1 - oracle) > 1e-3 * oracle
        assert abs(stage0**2 + stage1**2 - oracle**2) <= 1e-5 * oracle**2
    if layout == "fsdp":  # width 6 over 4 ranks: uneven shards, and rank 3's are empty
        assert 0 in every[3]["local_counts"] and every[0]["local_counts"] != every[3]["local_counts"]


def test_the_amp_recipe_skips_the_step_on_every_rank_when_one_shard_holds_an_inf(job):
    every = job.reports("amp-agreed")
    assert all(r["norm"] == float("inf") for r in every)
    assert not any(r["stepped"] for r in every)
    assert {r["scale"] for r in every} == {32768.0}  # backed off once, alike
    assert all(r["same_as_replica"] for r in every)
    assert all(r["check_replicas"] == "" for r in every)


@pytest.mark.parametrize("layout", ["hsdp", "fsdp"])
def test_the_standard_amp_loop_with_the_scaler_given_skips_on_every_rank_together(layout, job):
    """unscale_, gclip's clip (scaler=scaler), scaler.step, scaler.update: torch's loop."""
    every = job.reports(f"amp-standard-{layout}")
    assert all(r["norm"] == float("inf") for r in every)
    assert not any(r["stepped"] for r in every)
    assert {r["scale"] for r in every} == {32768.0}  # backed off once, alike
    assert all(r["same_as_replica"] for r in every)
    assert all(r["check_replicas"] == "" for r in every)


def test_scaler_step_alone_decides_per_rank_and_the_replicas_part(job):
    """The case the recipe is for: GradScaler's own found_inf is not agreed across replicas."""
    every = job.reports("amp-local")
    assert len({r["stepped"] for r in every}) == 2 and len({r["scale"] for r in every}) == 2
    assert not all(r["same_as_replica"] for r in every)
    # and check_replicas finds it, with the same one line on every rank
    found = {r["check_replicas"] for r in every}
    assert len(found) == 1
    (line,) = found
    assert line.startswith("GclipValueError: replicas of ") and "differ" in line and "group 0, 2" in line


def test_the_fsdp_tp_example_matches_the_single_process_reference():
    """examples/torch_fsdp_tp.py: 20 steps on mesh (dp=2, tp=2), torch's clip call unchanged."""
    import sys

    example = str(ROOT / "examples" / "torch_fsdp_tp.py")

    def run(cmd: list[str]) -> dict:
        job = run_job(cmd, env=job_env())
        assert_finished(job, stdout_verdict=True)
        (line,) = [x for x in job.stdout.splitlines() if x.startswith("{")]  # rank 0 reports
        return json.loads(line)

    ref = run([sys.executable, example, "--reference", "--json", "--steps", "20"])
    got = run(torchrun_cmd(RANKS, example, "--json", "--steps", "20"))
    assert got["ranks"] == RANKS and len(got["losses"]) == len(ref["losses"]) == 20
    assert max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])) <= 1e-5
    assert sum(n > 0.5 for n in ref["norms"]) >= 10  # the clip is at work (MAX_NORM 0.5)


def test_the_fsdp2_bench_times_both_clips_and_finds_the_same_norm():
    """gclip.bench.fsdp (launched by torchrun): its own output, 2 ranks, GPT-2's embeddings alone."""
    cmd = torchrun_cmd(2, "-m", "gclip.bench.fsdp", "--layers", "0", "--repeat", "2", "--json")
    job = run_job(cmd, env=job_env())
    assert_finished(job, stdout_verdict=True)
    (line,) = [x for x in job.stdout.splitlines() if x.startswith("{")]
    out = json.loads(line)
    assert out["ranks"] == 2 and out["values"] == (50257 + 1024) * 768 + 2 * 768
    assert out["gclip_vs_torch"] == out["gclip_median_s"] / out["torch_median_s"]
    assert abs(out["norm_gclip"] - out["norm_torch"]) <= 1e-3 * out["norm_gclip"]  # torch sums in float32


def test_device_mesh_as_comm_dimension_names_and_the_refusals(job):
    every = job.reports("mesh")
    oracle = every[0]["oracle"]
    for r in every:
        assert abs(r["alone"] - oracle) <= 1e-12 * oracle and r["listed"] == r["alone"]
        assert "'pp' is not a dimension of the mesh (its dimensions: dp, tp)" in r["unknown_name"]
        assert r["partial"].startswith(
            "GclipValueError: ranks 0, 1, 2, 3 of 4: tensors[0] is a Partial(max) DTensor"
        )
        assert r["nonfinite"].startswith("NonFiniteNormError:") and "rank 3" in r["nonfinite"]
    assert every[0]["outside"] == every[1]["outside"] == ""
    assert every[2]["outside"] == every[3]["outside"] != ""
    assert "not in that process group" in every[2]["outside"]
