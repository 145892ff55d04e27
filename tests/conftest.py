"""Test-session setup that must precede every import of triton: its
interpreter (kernels on CPU tensors, tests/test_tq_triton.py) is chosen by
TRITON_INTERPRET when triton reads its settings, and other suites' imports
(torch, transformers) can load triton first.

The engine's "auto" dtype follows the CPU's features (engine/auto_defaults.py);
CI machines of the same kind differ in them (AVX512-BF16 or AVX2 only), so the
suite pins the features to AVX2 + FMA (no bf16: dtype auto is float32) for
every engine it starts, in this process and in the servers it launches.
tests/test_auto_defaults.py checks the rule for each kind of CPU."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TQSERVE_CPU_FEATURES", "avx2")


def _share_gguf_readers() -> None:
    """gguf-py's GGUFReader takes ~20 s on Gemma3's file (one numpy view per
    vocabulary entry, 5 s on SmolLM2's), and transformers builds a new one
    for each config, weights and tokenizer load of the suite's references
    (test_loaders, test_real_models, test_tokenizer, test_server_openai) and
    test_gguf_file reads with one too: one reader per real file is shared
    instead. A reader is a read-only memmap and its views: sharing changes
    no value. Small files (the tests' own tiny ones, rewritten in place by
    some) get a new reader each time. Not on a machine without gguf-py
    (tests/gpu/ on a bare GPU box)."""
    try:
        import gguf
    except ImportError:
        return
    import functools

    reader = gguf.GGUFReader

    @functools.lru_cache(maxsize=2)
    def shared(path: str, mtime_ns: int, size: int):
        return reader(path)

    def make(path, mode="r"):
        st = os.stat(path)
        if mode != "r" or st.st_size < 32 << 20:
            return reader(path, mode)
        return shared(os.path.realpath(path), st.st_mtime_ns, st.st_size)

    gguf.GGUFReader = make


_share_gguf_readers()
