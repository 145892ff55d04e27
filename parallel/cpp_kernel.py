"""Compiling a C++ CPU kernel at first use (kvcache/tq_cpu.py,
parallel/quant/gguf_cpu.py): g++ on the source shipped in the wheel, cached
by source, flags, compiler and CPU, loaded with ctypes."""
import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path


def _cpu_id() -> str:
    try:
        flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def build_shared_library(src: Path, cxx: str, flags: list[str], what: str, fallback: str) -> ctypes.CDLL:
    """The compiled `src` (cached under $TQSERVE_KERNEL_CACHE, default
    ~/.cache/tqserve/kernels). what: the kernel's name in errors; fallback:
    how the user selects the slower path instead (an env setting)."""
    code = src.read_bytes()
    try:
        ver = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    except OSError as e:
        raise RuntimeError(f"{what}: no C++ compiler ({cxx}: {e}); install g++ or set {fallback} "
                           f"to use the slower torch path") from None
    key = hashlib.sha256(code + " ".join([cxx] + flags).encode() + ver.encode() + _cpu_id().encode())
    cache = Path(os.environ.get("TQSERVE_KERNEL_CACHE", Path.home() / ".cache" / "tqserve" / "kernels"))
    so = cache / f"{src.stem}-{key.hexdigest()[:16]}.so"
    if not so.exists():
        cache.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: concurrent first uses never load a partial file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        r = subprocess.run([cxx, *flags, str(src), "-o", tmp], capture_output=True, text=True)
        if r.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(f"building the {what} failed ({cxx} {' '.join(flags)} {src}):\n"
                               f"{r.stderr[-4000:]}\nInstall g++ with OpenMP, or set {fallback} to use "
                               f"the slower torch path.")
        os.replace(tmp, so)
    return ctypes.CDLL(str(so))
