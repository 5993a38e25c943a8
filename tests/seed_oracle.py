"""Run the seed record's own implementations (broken, failed fix) as an oracle.

The record's sources hard-code ``N = 1``; the record says N is supplied as 1..5,
so we substitute that one line and run the source as it is, in a subprocess,
reading the observations it prints.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path

RECORD = Path(__file__).resolve().parent / "data" / "seed_000_adec46095326f7b8.json"


@cache
def observations(implementation: str, n: int) -> tuple:
    """The (label, actual, expected) triples the seed's implementation prints for N = n."""
    source = json.loads(RECORD.read_text())["implementations"][implementation]["source"]
    assert "\nN = 1\n" in source
    source = source.replace("\nN = 1\n", f"\nN = {n}\n", 1)
    proc = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=60)
    data = json.loads(proc.stdout)
    return tuple((o["check"], o["actual"], o["expected"]) for o in data["observations"])


def solve_source(implementation: str) -> str:
    """The source of the record's ``solve`` function alone (for the judge)."""
    source = json.loads(RECORD.read_text())["implementations"][implementation]["source"]
    start = source.index("def solve(")
    end = source.index("def check(")
    return source[start:end]
