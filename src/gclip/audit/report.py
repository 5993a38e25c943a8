"""What the command prints and writes: each step's report on rank 0, the summary, the JSON lines."""

from __future__ import annotations

import collections
import os
import sys

import torch.distributed as dist

from .._lab.jsonout import dumps
from .verdict import StepReport

__all__ = ["Summary"]


class Summary:
    """Collects the steps' reports (the same on every rank); rank 0 prints and writes them."""

    def __init__(self, json_path: str | None, *, quiet: bool = False) -> None:
        self.json_path = json_path
        self.quiet = quiet
        self.reports: list[StepReport] = []
        self.rank = 0
        if json_path is not None:
            open(json_path, "w").close()  # a fresh file, whatever the run audits

    def add(self, report: StepReport) -> None:
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.reports.append(report)
        if self.rank != 0:
            return
        if not self.quiet:
            print(report, flush=True)
        if self.json_path is not None:
            with open(self.json_path, "a") as out:
                out.write(dumps(report.as_json()) + "\n")

    def close(self) -> int:
        """The summary line on rank 0; the exit status: 0 when no audited step failed (a near
        miss, the correct norm through torch's epsilon or float32 rounding, is not a failure)."""
        grades = collections.Counter(r.grade for r in self.reports)
        bugs = collections.Counter(r.fingerprint for r in self.reports if r.fingerprint)
        clipped = sum(r.clipped for r in self.reports)
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank()
        elif not self.reports:  # the script ended its process group: the launcher's word
            self.rank = int(os.environ.get("RANK", "0"))
        if self.rank == 0:
            if not self.reports:
                print("gclip.audit: no optimizer step was audited (no backward, or no optimizer stepped)")
            else:
                counts = ", ".join(f"{n} {g}" for g, n in grades.items())
                line = f"gclip.audit: {len(self.reports)} steps audited ({clipped} clipped): {counts}"
                if bugs:
                    line += "; " + ", ".join(f"{b} on {n}" for b, n in bugs.most_common())
                print(line, flush=True)
            sys.stdout.flush()
        if not self.reports:
            return 1
        return 1 if "fail" in grades else 0
