"""Usage bugs: a correct clip, called at the wrong moment or on the wrong input.

Part of the gallery (re-exported by ``gclip.gallery.bugs``): the norm and the scale are right,
but the gradients they see are not the ones the step uses.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["USAGE_BUGS", "USAGE_BUG_NAMES", "UsageBug"]


@dataclass(frozen=True)
class UsageBug:
    """A bug in how a training loop calls the clip: the norm and the scale are
    right, but the gradients they see are not the ones the step uses (still
    multiplied by the loss scale), are gone (a generator already read), or are not the
    ones scaled (copies, or gradients passed where parameters are expected).
    tests/test_torch_usage_bugs.py shows each with plain torch and with gclip.torch;
    ``gclip.audit`` names the last two ``never-scaled`` in a real step.
    """

    name: str
    summary: str
    incident: str
    explanation: str


USAGE_BUGS: tuple[UsageBug, ...] = (
    UsageBug(
        "clip-before-unscale",
        "gradients clipped while still multiplied by the mixed-precision loss scale",
        "pytorch/examples #1196 (add scaler.unscale_(optimizer) before clip_grad_norm_: the minGPT-DDP "
        "trainer clips the scaled gradients)",
        "GradScaler multiplies the loss, so every gradient, by a large factor (65536 at first). Clipped "
        "before unscale_, a norm that many times too large is compared with max_norm: the clip fires on "
        "every step, and once the scaler divides the factor out the update is max_norm / scale long. "
        "Call scaler.unscale_(optimizer) before the clip.",
    ),
    UsageBug(
        "generator-consumed",
        "a generator of parameters read to compute the norm, then empty when the gradients are scaled",
        "pytorch/torchtitan PR #1258 (fix: clip_grad_norm_ general usage: its clip_grad_norm_ given "
        "model.parameters() left the gradients unscaled)",
        "model.parameters() is a generator: the pass that computes the norm exhausts it, so the pass "
        "that scales finds no parameter and silently does nothing. Read the parameters into a list once.",
    ),
    UsageBug(
        "never-scaled",
        "the norm computed, but no gradient scaled: the scale goes to tensors the optimizer never reads",
        "huggingface/transformers PR #46113 (its DTensor clip_grad_norm passes the gradients to "
        "clip_grads_with_norm_, which expects parameters: the reported norm is right, no gradient is "
        "ever scaled)",
        "clip_grads_with_norm_ (and clip_grad_norm_) take parameters and scale each one's .grad. Given "
        "the gradients themselves, or copies of them, it finds no .grad and returns silently: the norm "
        "is logged, every step above max_norm goes out unclipped, as if clipping were off. Pass the "
        "parameters.",
    ),
)

USAGE_BUG_NAMES: dict[str, UsageBug] = {b.name: b for b in USAGE_BUGS}
