"""PyTorch Lightning's clip (``Trainer(gradient_clip_val=...)``); gclip.audit runs this unmodified.

    torchrun --nproc-per-node 4 fw_lightning.py --strategy ddp|fsdp|model-parallel [--clip lightning|gclip]

Lightning runs forward, backward and its clip inside ``optimizer.step(closure)``: the audit
reads the step when the closure returns. --clip gclip: a ``configure_gradient_clipping``
override that calls ``gclip.torch.clip_grad_norm_`` instead (docs/frameworks.md).
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from layouts import MAX_NORM, Net
from torch import nn


class Module(L.LightningModule):
    def __init__(self, strategy: str, clip: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.strategy_name = strategy
        self.clip = clip
        self.net = Net()

    def configure_model(self) -> None:
        if not self.strategy_name.startswith("model-parallel"):
            return
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.device_mesh["data_parallel"]
        for block in self.net.blocks:
            if self.strategy_name == "model-parallel-tp":
                plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
                parallelize_module(block, self.device_mesh["tensor_parallel"], plan)
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.clip == "lightning":
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        from gclip.torch import clip_grad_norm_

        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_(params, gradient_clip_val, replicated=True if self.strategy_name == "ddp" else None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--strategy", default="ddp", choices=["ddp", "fsdp", "model-parallel", "model-parallel-tp"]
    )
    parser.add_argument("--clip", default="lightning", choices=["lightning", "gclip"])
    args = parser.parse_args()
    strategy = args.strategy
    if strategy.startswith("model-parallel"):
        from lightning.pytorch.strategies import ModelParallelStrategy

        tp = 2 if strategy == "model-parallel-tp" else 1
        strategy = ModelParallelStrategy(data_parallel_size=4 // tp, tensor_parallel_size=tp)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        gradient_clip_val=MAX_NORM,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(args.strategy, args.clip), _loader(trainer, args.strategy))


def _loader(trainer, strategy: str):
    """Each rank's own batch, the same at every step; under TP, its TP group's (the mesh is
    (data_parallel, tensor_parallel): ranks 2k and 2k + 1 share one)."""
    rank = trainer.global_rank
    torch.manual_seed(1 + (rank // 2 if strategy == "model-parallel-tp" else rank))
    x, y = torch.randn(8, 5) * 4, torch.randn(8, 3)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False, sampler=_Same(8)
    )


class _Same(torch.utils.data.Sampler):
    """The whole local dataset in order: Lightning does not swap it for a DistributedSampler."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


if __name__ == "__main__":
    main()
