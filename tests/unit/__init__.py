"""Unit tests, one file per core module: single process, no mpirun, fast (``scripts/test --fast``)."""
