"""The "auto" defaults (engine/auto_defaults.py): the rule for each kind of
CPU, the checkpoint rule for --quantization, the one startup line that says
why, and the env override the test suite pins (tests/conftest.py)."""
import logging

import pytest

from engine import LLM, EngineArgs
from engine import auto_defaults as auto
from engine import cpu_features
from engine.cpu_features import CpuInfo
from parallel.quant.gguf import QTYPES

AVX2 = CpuInfo("EPYC (AVX2 only)", "x86_64", "AVX2", avx2=True)
ZEN4 = CpuInfo("EPYC (Zen 4)", "x86_64", "AVX512", avx2=True, avx512=True, avx512_bf16=True, vnni=True)
SPR = CpuInfo("Xeon (Sapphire Rapids)", "x86_64", "AVX512", avx2=True, avx512=True, amx=True)
GRACE = CpuInfo("Neoverse-V2", "aarch64", "SVE256", arm_bf16=True)


@pytest.mark.parametrize("cpu, want", [(AVX2, "float32"), (ZEN4, "bfloat16"), (SPR, "bfloat16"),
                                       (GRACE, "bfloat16"), (CpuInfo("old", "x86_64", "DEFAULT"), "float32")])
def test_dtype_follows_the_cpus_bf16_arithmetic(cpu, want):
    c = auto.choose_dtype("cpu", cpu)
    assert c.value == want and c.reason
    assert auto.choose_dtype("cuda", cpu).value == "bfloat16"


@pytest.mark.parametrize("device, stored, tp, splits, fmt, want", [
    ("cpu", {"blk.0.attn_q.weight": "Q4_K", "blk.0.ffn_down.weight": "Q6_K"}, 1, True, "auto", "gguf"),
    ("cuda", {"w": "Q4_K"}, 1, True, "auto", None),
    ("cpu", {"w": "Q4_K", "v": "Q6_K"}, 2, True, "auto", "gguf"),      # each rank keeps its part
    ("cpu", {"w": "Q4_K"}, 2, False, "auto", None),    # Qwen3-Next / Qwen3.5 files: taken whole only
    ("cpu", {"w": "Q4_K"}, 1, False, "auto", "gguf"),
    ("cpu", {"w": "Q4_K"}, 1, True, "dummy", None),
    ("cpu", {}, 1, True, "auto", None),                # safetensors, F32 / F16 GGUF
    ("cpu", {"w": "fp8"}, 1, True, "auto", None),      # DeepSeek-V4: --quantization fp8 stays explicit
])
def test_quantization_keeps_gguf_blocks_on_the_cpu(device, stored, tp, splits, fmt, want):
    c = auto.choose_quantization(device, stored, QTYPES, tp, fmt, splits)
    assert c.value == want and c.reason
    if want:
        assert " / ".join(sorted(set(stored.values()))) in c.reason


def test_engine_args_resolve_auto_with_reasons():
    r = EngineArgs(device="cpu").resolved({"w": "Q4_1"})
    assert (r.dtype, r.quantization) == ("float32", "gguf")        # conftest: AVX2 features
    assert set(r.auto_reasons) == {"dtype", "quantization"}
    assert EngineArgs(device="cpu").resolved().quantization is None            # checkpoint unknown
    assert EngineArgs(device="cpu", quantization="none").resolved({"w": "Q4_1"}).quantization is None
    explicit = EngineArgs(device="cpu", dtype="float32", quantization="gguf").resolved({"w": "Q4_1"})
    assert explicit.auto_reasons == {}
    with pytest.raises(ValueError, match="unknown quantization 'q2'; supported: auto, none, int4, gguf, fp8"):
        EngineArgs(quantization="q2").resolved()


def test_cpu_features_override(monkeypatch):
    monkeypatch.setenv("TQSERVE_CPU_FEATURES", "avx2,avx512,avx512_bf16")
    cpu_features.cpu_info.cache_clear()
    try:
        info = cpu_features.cpu_info()
        assert info.flags() == ["avx2", "avx512", "avx512_bf16"] and info.fast_bf16
        assert "TQSERVE_CPU_FEATURES" in info.line()
        monkeypatch.setenv("TQSERVE_CPU_FEATURES", "none")
        cpu_features.cpu_info.cache_clear()
        assert cpu_features.cpu_info().flags() == []
        monkeypatch.setenv("TQSERVE_CPU_FEATURES", "avx2,sse9")
        cpu_features.cpu_info.cache_clear()
        with pytest.raises(ValueError, match="TQSERVE_CPU_FEATURES: unknown sse9"):
            cpu_features.cpu_info()
    finally:
        monkeypatch.undo()
        cpu_features.cpu_info.cache_clear()


def test_default_engine_keeps_the_gguf_blocks_and_says_why(caplog):
    caplog.set_level(logging.INFO, logger="tqserve.engine")
    llm = LLM("smollm2-135m", kv_cache_memory=64 << 20, max_model_len=256)
    try:
        a = llm.core.args
        assert (a.dtype, a.quantization) == ("float32", "gguf")
        assert llm.core.resident_bytes < 100 * 2**20          # Q4_1 blocks (~92 MiB), not 513 MiB of fp32
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("auto settings:")]
        assert len(lines) == 1 and "quantization gguf (the file's" in lines[0] and "dtype float32 (" in lines[0]
    finally:
        llm.close()
