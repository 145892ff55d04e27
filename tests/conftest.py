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
