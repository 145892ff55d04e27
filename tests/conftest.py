"""Test-session setup that must precede every import of triton: its
interpreter (kernels on CPU tensors, tests/test_tq_triton.py) is chosen by
TRITON_INTERPRET when triton reads its settings, and other suites' imports
(torch, transformers) can load triton first."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
