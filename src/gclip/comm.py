"""What gclip needs of a communicator: the ``Comm`` protocol.

mpi4py's ``MPI.Comm`` is one; so is any object with these four methods (a test's
fake, a simulated group). The library asks nothing else of it: its rank and size,
one buffer all-reduce (SUM or MAX) per collective, and a small object all-gather
on the error path.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["Comm"]


@runtime_checkable
class Comm(Protocol):
    """A communicator, as the core uses one (mpi4py's names)."""

    def Get_rank(self) -> int: ...

    def Get_size(self) -> int: ...

    def Allreduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: Any = ...) -> Any: ...

    def allgather(self, sendobj: Any) -> list[Any]: ...
