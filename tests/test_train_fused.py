"""gclip.train's --fused loop (global_norm + clip_scale, the scale applied by the update itself)
against the loop that clips in place with clip_by_global_norm, on real ranks."""

from __future__ import annotations

import pytest

from conftest import agree
from gclip.train.loop import Config, train

pytestmark = pytest.mark.mpi


@pytest.mark.mpi(min_size=1)
def test_fused_update_follows_the_in_place_clip(comm):
    config = Config(steps=40, seed=3, lr=1.0, max_norm=0.05, reproducible=False, norm_type=2.0)
    plain = train(config, "global", comm)
    fused = train(config._replace(fused=True), "global", comm)
    worst = max(abs(a - b) / abs(a) for a, b in zip(plain.losses, fused.losses))
    ok = (
        worst <= 1e-12  # lr * (scale * g) against (lr * scale) * g: an ulp a step
        and fused.clipped == plain.clipped
        and sum(fused.clipped) > 10  # the clip is active on most steps: the comparison means something
        and fused.steps_above(config.max_norm) == 0
        and fused.same_norm_on_all_ranks
    )
    agree(comm, ok, f"worst loss difference {worst:.3g}, clipped {sum(fused.clipped)}/{config.steps}")
