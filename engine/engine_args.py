"""Engine configuration, shared by the offline LLM, the async client and the CLI."""
from dataclasses import asdict, dataclass


@dataclass
class EngineArgs:
    model: str = "smollm2-135m"
    max_model_len: int | None = None              # None = the model's own, capped by KV capacity
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0         # cap on one request's chunk per step (0 = budget only)
    kv_cache_memory: int | float | None = None    # bytes, or a fraction (< 1) of available memory
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"                  # auto (model dtype) | f32 | f16 | bf16 | tq4 | k8v4 | ...
    kv_cache_dtype_k: str | None = None           # K format override: f16 | q8 | tq4 | tq3 | tq2
    kv_cache_dtype_v: str | None = None           # V format override
    kv_protect_layers: int = 0                    # first/last N layers keep f16 KV
    kv_hot: str = "k"                             # off | k | kv: int8 sink + newest blocks (kv_formats.py)
    dtype: str = "float32"
    # "int4": 4-bit weights of the checkpoint (GGUF Q4_1) run by torch's int4
    # CPU kernel instead of being dequantized; needs dtype bfloat16.
    quantization: str | None = None
    seed: int = 0
    max_rollback_tokens: int = 0                  # how far a step may roll a sequence back (spec decode);
                                                  # sizes ring-buffered state (DeepSeek-V4 window / carry)
    num_threads: int | None = None                # torch intra-op threads in the engine core

    def validate(self) -> None:
        if self.quantization not in (None, "int4"):
            raise ValueError(f"unknown quantization {self.quantization!r}; supported: int4")
        if self.quantization == "int4" and self.dtype != "bfloat16":
            raise ValueError("quantization int4 runs with bf16 activations: add dtype bfloat16")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.kv_cache_memory is not None and not self.kv_cache_memory > 0:
            raise ValueError(f"kv_cache_memory must be > 0, got {self.kv_cache_memory}")

    def to_dict(self) -> dict:
        return asdict(self)
