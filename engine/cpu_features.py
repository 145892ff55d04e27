"""The host CPU: its model name and the instruction sets that decide which
dtype is fast on it (engine/auto_defaults.py), recorded by every benchmark.

torch's own probes (torch.cpu._is_*_supported, what its kernels dispatch on)
where it has them; /proc/cpuinfo for the model name and the aarch64 features.
TQSERVE_CPU_FEATURES (a comma list of CpuInfo's flags, or "none") replaces the
probes: another machine's defaults reproduced here, and the test suite's
defaults the same on every CI machine (tests/conftest.py).
"""
from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass
from functools import lru_cache

import torch


FLAGS = ("avx2", "avx512", "avx512_bf16", "amx", "vnni", "arm_bf16")


@dataclass(frozen=True)
class CpuInfo:
    model: str
    arch: str                   # platform.machine(): x86_64, aarch64
    capability: str             # torch's ATen CPU kernel level: AVX512, AVX2, SVE256, DEFAULT ...
    avx2: bool = False
    avx512: bool = False
    avx512_bf16: bool = False   # vdpbf16ps: bf16 dot products at twice fp32's rate
    amx: bool = False           # AMX tiles (bf16 / int8 matrix units)
    vnni: bool = False
    arm_bf16: bool = False      # aarch64 BFMMLA / BFDOT (Neoverse V1/V2: Grace)
    cpus: int = 1

    @property
    def fast_bf16(self) -> bool:
        """bf16 matmuls run in hardware: on a CPU without this, torch emulates
        bf16 in fp32 and pays for the conversions (2.3x slower measured on an
        AVX2-only EPYC)."""
        return self.avx512_bf16 or self.amx or self.arm_bf16

    def flags(self) -> list[str]:
        return [f for f in FLAGS if getattr(self, f)]

    def line(self) -> str:
        return (f"{self.model} ({self.arch}; {', '.join(self.flags()) or 'no avx2 / avx512 / amx / bf16'}; "
                f"torch kernels {self.capability}; {self.cpus} CPUs)")

    def as_dict(self) -> dict:
        return dict(model=self.model, arch=self.arch, capability=self.capability, flags=self.flags(),
                    fast_bf16=self.fast_bf16, cpus=self.cpus)


def _probe(name: str) -> bool:
    fn = getattr(torch.cpu, f"_is_{name}_supported", None)
    try:
        return bool(fn()) if fn else False
    except Exception:       # a probe torch has but cannot run here
        return False


@lru_cache(maxsize=None)
def cpu_info() -> CpuInfo:
    text = ""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        pass
    m = re.search(r"^(?:model name|Model|Hardware|CPU part)\s*:\s*(.+)$", text, re.M)
    model = m.group(1).strip() if m else (platform.processor() or "unknown CPU")
    # x86 family / model / stepping: a virtual machine's name ("AMD EPYC") does
    # not tell Zen 2, 3 and 4 apart, and their GEMV vs matmul crossovers differ.
    ids = [re.search(rf"^{k}\s*:\s*(\d+)$", text, re.M) for k in ("cpu family", "model", "stepping")]
    if all(ids):
        model += " [family {} model {} stepping {}]".format(*(i.group(1) for i in ids))
    feats = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", text, re.M)
    flags = set(feats.group(1).split()) if feats else set()
    arch = platform.machine()
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:
        capability = "unknown"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    forced = os.environ.get("TQSERVE_CPU_FEATURES")
    if forced is not None:
        names = {f.strip() for f in forced.split(",") if f.strip() and f.strip() != "none"}
        known = set(FLAGS)
        if names - known:
            raise ValueError(f"TQSERVE_CPU_FEATURES: unknown {', '.join(sorted(names - known))}; "
                             f"known: {', '.join(FLAGS)}, none")
        return CpuInfo(model=model + " [features from TQSERVE_CPU_FEATURES]", arch=arch, capability=capability,
                       cpus=cpus, **{f: f in names for f in FLAGS})
    return CpuInfo(model=model, arch=arch, capability=capability,
                   avx2=_probe("avx2"), avx512=_probe("avx512"), avx512_bf16=_probe("avx512_bf16"),
                   amx=_probe("amx_tile"), vnni=_probe("vnni") or "avx512_vnni" in flags,
                   arm_bf16=arch in ("aarch64", "arm64") and "bf16" in flags, cpus=cpus)
