"""The layout form's adapter (gclip.conformance.params): each array's name and the attributes
Megatron-LM and DeepSpeed read, checked on simulated ranks against the lab's model itself."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gclip._lab import transformer
from gclip.conformance.params import LayoutArray, attributes, coords_of, with_attributes
from gclip.layout import Mesh

SHAPE = {"pp": 2, "ep": 2, "tp": 2}  # 8 simulated ranks: stages, experts and tp shards at once


def _ranks(shape):
    size = math.prod(shape.values())
    for r in range(size):
        mesh = Mesh((r, size), **shape)
        yield mesh, transformer.pieces(mesh)


def test_coords_are_the_mesh_coords():
    for mesh, _ in _ranks(SHAPE):
        assert coords_of(SHAPE, mesh.rank) == mesh.coords


def test_the_attributes_say_what_megatron_and_deepspeed_layers_set():
    seen = set()
    for mesh, pieces in _ranks(SHAPE):
        for piece in pieces:
            a = attributes(piece, SHAPE, mesh.coords)
            name = a["name"]
            seen.add(name)
            assert name == piece.name
            duplicate = name.endswith(("ln1", "ln2", "final_ln", "mlp.router"))
            assert a["tensor_model_parallel"] is not duplicate, name
            row_parallel = name.endswith(("attn.proj", "fc2"))
            assert a["partition_dim"] == (-1 if duplicate else 1 if row_parallel else 0), name
            assert a["partition_stride"] == 1
            expert = ".experts." in name
            assert a["allreduce"] is not expert and (a.get("group_name") == "ep_size_2") is expert, name
            last_copy = name == "embed" and mesh.coords["pp"] == 1
            assert a["ds_pipe_replicated"] is last_copy, name
            if name == "embed":
                assert a["shared_embedding"] is True and a["shared"] is last_copy
            else:
                assert "shared" not in a
    assert seen == set(transformer.model_shapes(ep=True))  # every tensor of the model, by name


def test_counting_by_the_attributes_gives_the_model_norm():
    # Megatron-LM's choice (not shared; sharded over tp, or on tp rank 0), the dense tensors on
    # one ep rank (their copies), the experts on every one: the norm of the whole model
    total = 0.0
    for mesh, pieces in _ranks(SHAPE):
        for piece in pieces:
            a = attributes(piece, SHAPE, mesh.coords)
            counted = not a.get("shared", False) and (a["tensor_model_parallel"] or mesh.coords["tp"] == 0)
            if counted and (not a["allreduce"] or mesh.coords["ep"] == 0):
                total += float(np.sum(np.square(piece.array)))
    want = math.fsum(
        float(np.sum(np.square(transformer.full_tensor(n, s, ep=True))))
        for n, s in transformer.model_shapes(ep=True).items()
    )
    assert total == pytest.approx(want, rel=1e-12)


def test_a_layout_array_is_the_same_memory_and_keeps_its_attributes():
    base = np.arange(6.0).reshape(2, 3)
    g = with_attributes(base, {"name": "layers.0.ln1", "tensor_model_parallel": False})
    assert isinstance(g, LayoutArray) and g.name == "layers.0.ln1" and g.tensor_model_parallel is False
    g *= 0.5
    assert base[1, 2] == 2.5 and g.shape == (2, 3) and g.dtype == np.float64
    assert float(np.sum(np.square(g))) == float(np.sum(np.square(base)))
