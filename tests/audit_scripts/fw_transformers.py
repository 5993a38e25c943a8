"""HF transformers' ``Trainer`` with ``max_grad_norm``; gclip.audit runs this unmodified.

    torchrun --nproc-per-node 4 fw_transformers.py OUT_DIR [--tp] [--clip trainer|gclip]

A tiny Llama made from its config (no download), trained 2 steps on random tokens, each rank
its own batch. Without --tp: the Trainer under torchrun on the CPU (DDP over gloo). --tp: the
model saved and loaded back with ``tp_plan="auto"`` (transformers' own tensor parallelism over
the 4 ranks: DTensor gradients beside plain ones, the path of transformers #46113). The
Trainer refuses that on the CPU ("ParallelismConfig is only compatible DistributedType.FSDP
(version 2) or DistributedType.Multi{Device} or DistributedType.DEEPSPEED, but got
DistributedType.MULTI_CPU"), so --tp trains the TP model in a loop of its own and clips with
the Trainer's own mixed-mesh clip, ``Trainer._mixed_mesh_grad_norm``, the function its
``_clip_grad_norm`` calls on such a model. --clip gclip: a Trainer subclass whose
``_clip_grad_norm`` calls ``gclip.torch.clip_grad_norm_`` (docs/frameworks.md).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

MAX_NORM = 0.2


class GclipTrainer(Trainer):
    """The Trainer with gclip's clip: the global norm over every rank, DTensors read from their
    placements, the plain gradients declared as what they are (DDP's and TP's: copies)."""

    def _clip_grad_norm(self, model):
        from gclip.torch import clip_grad_norm_

        return clip_grad_norm_(model.parameters(), self.args.max_grad_norm, replicated=True)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (16, 12), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tp_loop(model: LlamaForCausalLM, clip: str) -> None:
    """The Trainer's step, without the Trainer: forward, backward, its clip, SGD."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    batch = Tokens(0).ids[:4]  # one batch for the whole TP group
    for _ in range(2):
        optimizer.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        if clip == "trainer":
            Trainer._mixed_mesh_grad_norm(None, model, MAX_NORM)  # uses nothing of the Trainer
        else:
            from gclip.torch import clip_grad_norm_

            clip_grad_norm_(model.parameters(), MAX_NORM, replicated=True)
        optimizer.step()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--tp", action="store_true")
    parser.add_argument("--clip", default="trainer", choices=["trainer", "gclip"])
    args = parser.parse_args()
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    if args.tp:
        dist.init_process_group("gloo")
        path = os.path.join(args.out, "tiny-llama")
        if dist.get_rank() == 0:
            LlamaForCausalLM(config).save_pretrained(path)
        dist.barrier()
        model = LlamaForCausalLM.from_pretrained(path, tp_plan="auto", device_map=None)
    else:
        model = LlamaForCausalLM(config)
    training = TrainingArguments(
        output_dir=os.path.join(args.out, "trainer"),
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        max_grad_norm=MAX_NORM,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    rank = int(os.environ.get("RANK", "0"))
    if args.tp:
        tp_loop(model, args.clip)
        return
    trainer_class = GclipTrainer if args.clip == "gclip" else Trainer
    trainer = trainer_class(model=model, args=training, train_dataset=Tokens(rank if not args.tp else 0))
    trainer.train()
    dist.barrier()  # every rank done before any tears its group down (gloo may abort otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
