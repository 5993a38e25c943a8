"""The machine a bench ran on: the CPU and its vector extensions, numba's code generation target,
and the BLAS numpy calls with its threads. Every table the bench prints names it, and the JSON
keeps it, so a number can be traced to the CPU that gave it."""

from __future__ import annotations

import ctypes
import glob
import os
import platform
from pathlib import Path
from typing import Any

__all__ = ["VECTOR_FLAGS", "blas_info", "cpu_info", "describe_machine", "machine_line", "numba_target"]

# the extensions that decide the kernels' and the BLAS's code, as /proc/cpuinfo spells them
VECTOR_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512dq",
    "avx512bw",
    "avx512vl",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "asimd",
    "sve",
)


def cpu_info(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU's model name and its vector extensions (Linux: /proc/cpuinfo; elsewhere the
    platform's processor string, and LLVM's host features if numba is installed)."""
    text = cpuinfo
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            text = ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:  # the first processor's fields
            fields[key.strip()] = value.strip()
    model = fields.get("model name") or fields.get("Model") or platform.processor() or platform.machine()
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    if not flags:
        flags = {f.lstrip("+").replace("avx512bf16", "avx512_bf16") for f in _llvm_host_features()}
    family = ", ".join(f"{k} {fields[k]}" for k in ("cpu family", "model") if fields.get(k, "").isdigit())
    return {
        "model": model,
        "family": family or None,  # x86: which generation a bare "AMD EPYC" of a VM is
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "vector": [f for f in VECTOR_FLAGS if f in flags],
    }


def _llvm_host_features() -> list[str]:
    try:
        from llvmlite import binding

        return [f for f, on in binding.get_host_cpu_features().items() if on]
    except Exception:  # noqa: BLE001 - no llvmlite, or no answer: no features named
        return []


def numba_target() -> dict[str, Any]:
    """The CPU numba compiles gclip's kernels for: NUMBA_CPU_NAME (and NUMBA_CPU_FEATURES) or the
    host, and the widest vectors that target allows. numba keeps the host's features when only
    NUMBA_CPU_NAME is set: an AVX2 code generation on an AVX-512 machine needs both variables."""
    name = os.environ.get("NUMBA_CPU_NAME")
    features = os.environ.get("NUMBA_CPU_FEATURES")
    out: dict[str, Any] = {
        "cpu_name": name or "host",
        "cpu_features": "host" if features is None else features,
    }
    try:
        from llvmlite import binding
    except Exception:  # noqa: BLE001 - numba absent: numpy does the work
        out["kernels"] = False
        return out
    host = binding.get_host_cpu_name()
    if name in (None, "host"):
        out["cpu_name"] = f"host ({host})"
    if features is None:
        on = set(_llvm_host_features())
    else:  # given features, or (empty) the named CPU's own: read from LLVM's target for it
        on = {f.lstrip("+") for f in features.split(",") if f.startswith("+")}
        if not on and name:
            on = _cpu_defaults(binding, name)
    out["vector_bits"] = 512 if "avx512f" in on else 256 if "avx2" in on or "avx" in on else 128
    from .. import _kernels

    out["kernels"] = _kernels.get() is not None
    if out["kernels"]:
        out["vector_bits_used"] = vector_bits_used()
    return out


def vector_bits_used() -> int | None:
    """The widest vector register in the code numba makes here for the float32 sum of squares
    (``gclip._jit.sumsq``): LLVM's tuning for a CPU may use narrower vectors
    than the CPU has (256-bit on Intel's AVX-512 server cores). None where it cannot be read."""
    try:
        import numba
        import numpy as np

        from .. import _jit

        # the kernel's own loop and flags, compiled afresh: cached code has no assembly
        flags = {k: v for k, v in _jit.sumsq.targetoptions.items() if k != "nopython"}  # njit's own
        probe = numba.njit(**flags, cache=False)(_jit.sumsq.py_func)
        probe(np.zeros(1, np.float32))
        asm = "\n".join(probe.inspect_asm().values())
    except Exception:  # noqa: BLE001 - an unknown answer, not a failed bench
        return None
    return next((bits for bits, reg in ((512, "%zmm"), (256, "%ymm"), (128, "%xmm")) if reg in asm), None)


_AVX2_CPUS = ("haswell", "broadwell", "skylake", "alderlake", "znver1", "znver2", "znver3")
_AVX512_CPUS = (
    "skylake-avx512",
    "cascadelake",
    "cooperlake",
    "icelake",
    "tigerlake",
    "sapphirerapids",
    "graniterapids",
    "znver4",
    "znver5",
)


def _cpu_defaults(binding: Any, name: str) -> set[str]:
    # a named CPU's own features live inside LLVM's target machine, out of llvmlite's reach; the
    # bench reports only the vector width, so the common names are enough (others read as 128)
    if name.startswith(_AVX512_CPUS):
        return {"avx512f"}
    return {"avx2"} if name.startswith(_AVX2_CPUS) else set()


def blas_info() -> list[dict[str, Any]]:
    """numpy's BLAS and its threads: threadpoolctl's view where it is installed, else OpenBLAS's
    own answers from the library numpy loaded (its core: the kernels it runs), else numpy's
    build record."""
    try:
        from threadpoolctl import threadpool_info

        pools = [
            {
                k: p.get(k)
                for k in ("internal_api", "version", "num_threads", "architecture", "threading_layer")
            }
            for p in threadpool_info()
            if p.get("user_api") == "blas"
        ]
        if pools:
            return [dict(p, source="threadpoolctl") for p in pools]
    except Exception:  # noqa: BLE001 - not installed, or no answer: ask OpenBLAS itself
        pass
    own = _openblas_itself()
    if own is not None:
        return [own]
    return [_numpy_config()]


def _openblas_itself() -> dict[str, Any] | None:
    import numpy as np

    root = Path(np.__file__).parent
    for path in sorted(glob.glob(str(root.parent / "numpy.libs" / "*openblas*"))) + sorted(
        glob.glob(str(root / ".libs" / "*openblas*"))
    ):
        try:
            lib = ctypes.CDLL(path)  # numpy has loaded it already: the same library, its state
        except OSError:
            continue
        for prefix, suffix in (
            ("scipy_openblas", "64_"),
            ("scipy_openblas", ""),
            ("openblas", "64_"),
            ("openblas", ""),
        ):
            core = getattr(lib, f"{prefix}_get_corename{suffix}", None)
            threads = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
            config = getattr(lib, f"{prefix}_get_config{suffix}", None)
            if core is None or threads is None:
                continue
            core.restype = config.restype = ctypes.c_char_p  # type: ignore[union-attr]
            return {
                "internal_api": "openblas",
                "version": (config().decode().split() or ["?", "?"])[1] if config else None,
                "num_threads": int(threads()),
                "architecture": core().decode(),
                "source": "the OpenBLAS numpy loaded",
            }
    return None


def _numpy_config() -> dict[str, Any]:
    import numpy as np

    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return {
            "internal_api": blas.get("name"),
            "version": blas.get("version"),
            "source": "numpy.show_config",
        }
    except Exception:  # noqa: BLE001 - an older numpy: no dicts
        return {"internal_api": "unknown", "source": "numpy.show_config"}


def describe_machine() -> dict[str, Any]:
    """The JSON's ``machine``: cpu, numba target, BLAS."""
    return {"cpu": cpu_info(), "numba": numba_target(), "blas": blas_info()}


def machine_line(machine: dict[str, Any] | None) -> str:
    """One line naming the machine, printed beside every table."""
    if not machine:
        return "machine: not recorded"
    cpu, target = machine["cpu"], machine["numba"]
    vector = " ".join(cpu["vector"]) or "none named"
    code = f"numba target {target['cpu_name']}"
    if target.get("cpu_features") not in (None, "host"):
        code += f" features={target['cpu_features'] or 'its own'}"
    if "vector_bits" in target:
        used = target.get("vector_bits_used")
        code += f", {target['vector_bits']}-bit vectors"
        if used is not None and used != target["vector_bits"]:
            code += f" allowed, {used}-bit used (LLVM's tuning for this CPU)"
    if not target.get("kernels", False):
        code += ", kernels off (numpy alone)"
    blas = "; ".join(
        f"{b.get('internal_api')} {b.get('version') or ''}".rstrip()
        + (f" core {b['architecture']}" if b.get("architecture") else "")
        + (f", {b['num_threads']} thread(s)" if b.get("num_threads") is not None else "")
        for b in machine["blas"]
    )
    family = f", {cpu['family']}" if cpu.get("family") else ""
    return f"machine: {cpu['model']}{family} ({cpu['cpus']} CPUs; {vector}); {code}; BLAS {blas}"
