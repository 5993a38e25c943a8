"""The layout form's adapter: each array as a framework's parameter, and the layout's groups.

Megatron-LM and DeepSpeed do not take a ``replicated=`` list: they decide what
to count from attributes their layers set on each parameter, and from the
process groups of their parallel state. Under ``--layout`` every array the
judge hands over carries those attributes, as Megatron-LM's and DeepSpeed's
layers set them (read from NVIDIA/Megatron-LM megatron/core/tensor_parallel/
layers.py ``set_tensor_model_parallel_attributes`` and ``_MODEL_PARALLEL_
ATTRIBUTE_DEFAULTS``, language_module.py's tied embedding, and
deepspeedai/DeepSpeed deepspeed/moe/experts.py):

``name``                  the tensor's name in the lab's model (``layers.3.attn.qkv``);
``tensor_model_parallel`` True for a tensor sharded over tp (attention, MLP, the vocab-parallel
                          embedding, an expert's shards), False for one duplicated on every
                          tp rank (layer norms, the router): what Megatron-LM's
                          ``param_is_not_tensor_parallel_duplicate`` and DeepSpeed's
                          ``is_model_parallel_parameter`` read;
``partition_dim``         the axis it is sharded along (-1 when not sharded);
``partition_stride``      1;
``shared``                True on the copy of the tied embedding held by the last pipeline
                          stage (pp > 1), as Megatron-LM marks it (``param_is_not_shared``);
``shared_embedding``      True on both stages' copies of the tied embedding (pp > 1);
``ds_pipe_replicated``    True on that last stage's copy, False on every other array, as
                          DeepSpeed's PipelineModule marks tied copies (deepspeed/runtime/pipe/
                          module.py; read by deepspeed/runtime/utils.py's norms);
``allreduce``             False on an expert's arrays, True on the others (Megatron-LM's and
                          DeepSpeed's ``is_moe_param``: ``not param.allreduce``);
``group_name``            an expert's expert-parallel group, ``ep_size_<ep>`` (DeepSpeed).

With numpy (``--layout``) the arrays are :class:`LayoutArray` (an ``ndarray``
with these attributes); with ``--torch`` they are ``torch.nn.Parameter`` whose
``.grad`` holds the values, the attributes set on the parameter as the
frameworks set them (the name as ``param_name``, since a tensor's ``name`` is
torch's own; ``layout.named_parameters()`` gives the ``(name, parameter)``
pairs, as a module does), and the function's third argument is a
:class:`TorchLayout`: the layout's torch.distributed groups, with Megatron-LM's
``parallel_state`` names (so it can stand for DeepSpeed's ``mpu`` too).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["ATTRIBUTES", "LayoutArray", "TorchLayout", "attributes", "coords_of", "with_attributes"]

ATTRIBUTES = (
    "name",
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "shared",
    "shared_embedding",
    "ds_pipe_replicated",
    "allreduce",
    "group_name",
)


def coords_of(shape: dict[str, int], rank: int) -> dict[str, int]:
    """A rank's coordinates on the mesh, as ``gclip.Mesh`` places it."""
    from ..layout import Mesh

    return dict(Mesh((rank, math.prod(shape.values())), **shape).coords)


def attributes(piece: Any, shape: dict[str, int], coords: dict[str, int]) -> dict[str, Any]:
    """The attributes of one of the lab's arrays (a ``transformer.Piece``) on the rank at
    ``coords``, as Megatron-LM's and DeepSpeed's layers set them on the parameter."""
    axis, _, _ = piece.part
    sharded = piece.kind not in ("tp-duplicate",)
    out: dict[str, Any] = {
        "name": piece.name,
        "tensor_model_parallel": sharded,
        "partition_dim": axis if sharded else -1,
        "partition_stride": 1,
    }
    pp = shape.get("pp", 1)
    copy = piece.name == "embed" and pp > 1 and coords.get("pp", 0) == pp - 1  # the last stage's
    if piece.name == "embed" and pp > 1:
        out["shared_embedding"] = True
        out["shared"] = copy
    out["ds_pipe_replicated"] = copy  # DeepSpeed: a tied copy not on the first of its ranks
    expert = piece.kind == "expert"
    out["allreduce"] = not expert
    if expert:
        out["group_name"] = f"ep_size_{shape.get('ep', 1)}"
    return out


class LayoutArray(np.ndarray):
    """A numpy array with a parameter's attributes (``name``, ``tensor_model_parallel``, ...)."""

    def __array_finalize__(self, obj: Any) -> None:
        for key in ATTRIBUTES:
            if hasattr(obj, key):
                setattr(self, key, getattr(obj, key))


def with_attributes(array: np.ndarray, attrs: dict[str, Any]) -> LayoutArray:
    """``array`` (the same memory) as a LayoutArray carrying ``attrs``."""
    out = array.view(LayoutArray)
    for key, value in attrs.items():
        setattr(out, key, value)
    return out


class TorchLayout:
    """The layout's torch.distributed groups (gloo), one per slice of the mesh, made by every rank
    in one order; what Megatron-LM's ``parallel_state`` (and DeepSpeed's ``mpu``) return.

    ``shape`` and ``coords``: the mesh (``{'pp': 2, 'tp': 2}``) and this rank's place on it;
    ``tp``, ``pp``, ``dp``, ``ep``: the group along each axis (this rank alone when the mesh has
    no such axis); ``world``: every rank. Megatron-LM's names: the model-parallel group is tp x pp
    (each dense tensor counted once there), the data-parallel group dp x ep (the dense copies),
    the expert groups ep, dp (the experts' copies) and tp x ep x pp, and the embedding group the
    first and last stage."""

    def __init__(self, shape: dict[str, int], rank: int) -> None:
        import torch.distributed as dist

        self.shape = dict(shape)
        self.rank = rank
        self.coords = coords_of(self.shape, rank)
        self.world = dist.group.WORLD
        self.named: list[tuple[str, Any]] = []  # the case's (name, parameter) pairs
        size = math.prod(self.shape.values())
        every = [coords_of(self.shape, r) for r in range(size)]
        made: dict[tuple[int, ...], Any] = {}

        def along(axes: Sequence[str], keep: Any = None) -> Any:
            """The group of the ranks that differ from this one along ``axes`` only (every rank
            makes every such group, in the same order)."""
            fixed = [a for a in self.shape if a not in axes]
            slices: dict[tuple[int, ...], list[int]] = {}
            for r, c in enumerate(every):
                if keep is None or keep(c):
                    slices.setdefault(tuple(c[a] for a in fixed), []).append(r)
            mine = None
            for members in slices.values():
                key = tuple(members)
                if key not in made:
                    made[key] = dist.new_group(list(members))
                if rank in members:
                    mine = made[key]
            return mine

        self.tp, self.pp, self.dp, self.ep = (along((a,)) for a in ("tp", "pp", "dp", "ep"))
        self.model_parallel = along(("tp", "pp"))
        self.data_parallel = along(("dp", "ep"))
        self.expert_model_parallel = along(("tp", "ep", "pp"))
        last = self.shape.get("pp", 1) - 1
        self.embedding = along(("pp",), keep=lambda c: c.get("pp", 0) in (0, last))

    def _rank(self, group: Any) -> int:
        import torch.distributed as dist

        return int(dist.get_rank(group))

    def _size(self, group: Any) -> int:
        import torch.distributed as dist

        return int(dist.get_world_size(group))

    def named_parameters(self) -> list[tuple[str, Any]]:
        """This case's ``(name, parameter)`` pairs, in the order given, as ``Module.named_parameters()``."""
        return list(self.named)

    # Megatron-LM's parallel_state, and DeepSpeed's mpu
    def get_tensor_model_parallel_group(self) -> Any:
        return self.tp

    def get_tensor_model_parallel_rank(self) -> int:
        return self._rank(self.tp)

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._size(self.tp)

    def get_pipeline_model_parallel_group(self) -> Any:
        return self.pp

    def get_pipeline_model_parallel_rank(self) -> int:
        return self._rank(self.pp)

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self._size(self.pp)

    def is_pipeline_first_stage(self) -> bool:
        return self.coords.get("pp", 0) == 0

    def is_pipeline_last_stage(self) -> bool:
        return self.coords.get("pp", 0) == self.shape.get("pp", 1) - 1

    def get_data_parallel_group(self) -> Any:
        return self.data_parallel

    def get_data_parallel_rank(self) -> int:
        return self._rank(self.data_parallel)

    def get_data_parallel_world_size(self) -> int:
        return self._size(self.data_parallel)

    def get_model_parallel_group(self) -> Any:
        return self.model_parallel

    def get_model_parallel_rank(self) -> int:
        return self._rank(self.model_parallel)

    def get_model_parallel_world_size(self) -> int:
        return self._size(self.model_parallel)

    def get_expert_model_parallel_group(self) -> Any:
        return self.ep

    def get_expert_model_parallel_rank(self) -> int:
        return self._rank(self.ep)

    def get_expert_data_parallel_group(self) -> Any:
        return self.dp

    def get_expert_tensor_model_pipeline_parallel_group(self) -> Any:
        return self.expert_model_parallel

    def get_embedding_group(self) -> Any:
        return self.embedding

    def __repr__(self) -> str:
        mesh = ",".join(f"{k}={v}" for k, v in self.shape.items())
        return f"TorchLayout({mesh}, rank {self.rank} at {self.coords})"
