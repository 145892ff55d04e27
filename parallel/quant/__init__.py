"""Weights kept quantized in memory: formats, dequantisation and the matmuls that read them."""
