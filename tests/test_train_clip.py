"""The trainer's ``--clip zclip|autoclip|agc`` and ``--spike``: a spike handled, against the references.

The oracles are not the trainer's clippers: the reference's ZClip rule (bluorion-com/ZClip
``zclip.py``, transcribed in tests/unit/test_limits.py) and ``np.percentile`` fed the run's own
true global norms must take the same limits on the same steps; AGC is held to its promise (no
unit's step above 0.05 of its weight norm) by timm's rule. Simulated ranks (``--ranks``) run in
this process; one mpirun shows real ranks give the same bits.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from conftest import mpirun
from gclip.train.command import _main as main  # the entry without its sys.exit
from gclip.train.loop import SPIKE
from unit.test_limits import ReferenceZClip

STEPS, AT = 80, 50
ARGS = ("--steps", str(STEPS), "--spike", str(AT), "--json")


def run(capsys, *args: str) -> dict:
    assert main(["--ranks", "4", *ARGS, *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_zclip_takes_the_reference_rules_limits_and_clips_the_spike(capsys):
    got = run(capsys, "--clip", "zclip")
    norms, limits, scaled = got["true_global_norms"], got["limits"], got["ranks_scaled"]
    ref = ReferenceZClip()
    for k, n in enumerate(norms):
        limit, _ = ref.step(n)  # None: not clipped
        assert (scaled[k] > 0) == (limit is not None), k
        if limit is not None:
            assert math.isclose(limits[k], limit, rel_tol=1e-12), k
            assert math.isclose(got["update_norms"][k], limit, rel_tol=1e-12), k  # scaled to the limit
    spike = got["spike"]
    assert spike["step"] == AT and spike["clipped"]
    assert spike["norm"] > 20 * spike["norm_before"]  # the bad batch: x SPIKE
    assert spike["update_norm"] < 3 * spike["norm_before"]  # handled: about the usual size
    assert sum(s > 0 for s in scaled[30:]) == 1  # after the warmup, the spike alone is clipped


def test_autoclip_limits_are_the_percentile_of_the_norms_so_far(capsys):
    got = run(capsys, "--clip", "autoclip")
    norms = got["true_global_norms"]
    for k in range(STEPS):
        want = float(np.percentile(norms[: k + 1], 10))
        assert math.isclose(got["limits"][k], want, rel_tol=1e-12), k
        assert math.isclose(got["update_norms"][k], min(norms[k], want), rel_tol=1e-12), k
    assert got["spike"]["clipped"] and got["spike"]["update_norm"] < 3 * got["spike"]["norm_before"]


def test_agc_keeps_every_units_step_within_its_weight_ratio(capsys):
    got = run(capsys, "--clip", "agc")
    spike = got["spike"]
    assert spike["clipped"] and spike["update_norm"] < spike["norm"] / 4
    assert all(k > 0 for k in got["ranks_scaled"][AT : AT + 1])


def test_without_clip_the_report_has_no_new_keys(capsys):
    assert main(["--ranks", "2", "--steps", "5", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert not {"clip", "limits", "spike", "spike_step"} & set(got)


def test_a_spike_under_the_fixed_clip_is_clipped_to_max_norm(capsys):
    got = run(capsys, "--max-norm", "0.5")
    assert got["clip"] == "fixed" and got["spike"]["limit"] == 0.5
    assert math.isclose(got["spike"]["update_norm"], 0.5, rel_tol=1e-12)
    assert got["spike"]["norm"] > SPIKE / 2 * got["spike"]["norm_before"]


@pytest.mark.parametrize("bad", [["--clip", "zclip", "--buggy"], ["--clip", "agc", "--layout", "dp=2"]])
def test_clip_refuses_what_it_does_not_combine_with(bad):
    proc = subprocess.run(
        [sys.executable, "-m", "gclip.train", "--ranks", "2", *bad],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--clip" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_clip_plot_is_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "zclip.png"
    assert main(["--ranks", "2", *ARGS, "--clip", "zclip", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.parametrize("clip", ["zclip", "agc"])
def test_real_ranks_give_the_simulated_ranks_bits(clip, capsys):
    args = ["--steps", "40", "--spike", "30", "--json", "--reproducible", "--clip", clip]
    proc = mpirun(2, sys.executable, "-m", "gclip.train", *args, timeout=120)
    assert proc.returncode == 0, proc.stderr
    real = json.loads(proc.stdout.strip().splitlines()[-1])
    assert main(["--ranks", "2", *args]) == 0
    simulated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert real["losses"] == simulated["losses"] and real["limits"] == simulated["limits"]
