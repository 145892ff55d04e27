"""Engine configuration, shared by the offline LLM, the async client and the CLI."""
import json
import re
from dataclasses import asdict, dataclass, field, replace

DEVICES = ("auto", "cuda", "cpu")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
SCHEDULING_POLICIES = ("fcfs", "priority")      # engine/request_queue.py
QUANTIZATIONS = ("auto", "none", "int4", "gguf", "fp8")


def parse_memory(s: str) -> int | float:
    """'0.3' -> 0.3 (a fraction of free memory); '2000000', '512MiB', '2G', '1.5GB' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGT]?)(i?)(B?)\s*", s, re.IGNORECASE)
    if not m:
        raise ValueError(f"expected bytes (e.g. 2000000, 512MiB, 2GB) or a fraction < 1, got {s!r}")
    value, unit, binary, b = m.groups()
    v = float(value)
    if not unit:
        if v < 1:
            if v <= 0:
                raise ValueError(f"must be > 0, got {s!r}")
            return v
        return int(v)
    # K/M/G/T alone or with iB are binary (as `free -h` shows them); with B alone, decimal.
    base = 1000 if (not binary and b) else 1024
    return int(v * base ** ("KMGT".index(unit.upper()) + 1))


def parse_json_object(s: str) -> dict:
    """A JSON object given on the command line ('{"method": "ngram", ...}')."""
    try:
        v = json.loads(s)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e}): {s!r}") from None
    if not isinstance(v, dict):
        raise ValueError(f"expected a JSON object, got {s!r}")
    return v


def arg(default, help: str, **cli):
    """A field with its command-line help; server.cli makes `--field-name` of
    every field that has one (cli: argparse extras such as choices, type)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineArgs:
    model: str = "smollm2-135m"
    max_model_len: int | None = arg(None, "context length (default: the model's, capped by the KV cache)")
    max_num_seqs: int = arg(64, "requests running at once")
    max_num_batched_tokens: int = arg(2048, "token budget per engine step (decodes and prefill chunks)")
    long_prefill_token_threshold: int = arg(0, "cap on one request's prefill chunk per step (0: the budget only)")
    scheduling_policy: str = arg("fcfs", "fcfs: requests in arrival order; priority: by each request's "
                                 "'priority' (lower first), then arrival", choices=list(SCHEDULING_POLICIES))
    kv_cache_memory: int | float | None = arg(
        None, "KV pool size: bytes (2000000, 512MiB, 2GB) or a fraction < 1 of free memory "
              "(default: CPU min(2 GiB, a quarter of available memory); CUDA from --gpu-memory-utilization)",
        type=parse_memory)
    gpu_memory_utilization: float = arg(0.9, "CUDA: fraction of the card's total memory the engine may use "
                                             "(weights + activation peak + KV cache)")
    block_size: int = arg(16, "tokens per KV block")
    enable_prefix_caching: bool = arg(True, "reuse the KV blocks of prompts' shared prefixes")
    mamba_block_size: int | None = arg(
        None, "models with per-sequence state (linear attention, DeepSeek-V4's window and compressors): tokens "
              "between the state snapshots a prefix-cache hit resumes from (vLLM's name); default: 512 rounded up "
              "to the KV blocks' span")
    kv_cache_dtype: str = arg("auto", "auto (model dtype) | f32 | f16 | bf16 | tq4 | tq3 | tq2 | k8v4 | k4v3 | "
                                      "k4v2 | k3v3 | ... (kvcache/kv_formats.py)")
    kv_cache_dtype_k: str | None = arg(None, "K format override: f16 | q8 | tq5 | tq4 | tq3 | tq2")
    kv_cache_dtype_v: str | None = arg(None, "V format override: f16 | q8 | tq5 | tq4 | tq3 | tq2")
    kv_protect_layers: int = arg(0, "keep the first and last N layers' KV in f16")
    kv_hot: str = arg("k", "TurboQuant layers: also hold each sequence's first and newest block int8 "
                           "(keys, or keys and values) and read those from there", choices=["off", "k", "kv"])
    dtype: str = arg("auto", "weights and activations; auto: bfloat16 on CUDA and on CPUs that compute in bf16 "
                             "(AVX512-BF16, AMX, aarch64 BF16), else float32 (engine/auto_defaults.py)",
                     choices=list(DTYPES))
    device: str = arg("auto", "auto: cuda when torch.cuda.is_available(), else cpu", choices=list(DEVICES))
    load_format: str = arg("auto", "auto: the checkpoint's weights; dummy: small random weights on the device, "
                                   "nothing read but config.json (benchmark shapes without weights)",
                           choices=list(LOAD_FORMATS))
    enforce_eager: bool = arg(False, "CUDA: never capture CUDA graphs")
    async_scheduling: bool = arg(False, "schedule and launch each step while the device runs the one before "
                                        "(hides the host's per-step work; off with speculative decoding)")
    quantization: str | None = arg("auto", "auto: gguf for a .gguf file's quantized weights on the CPU, else "
                                           "none (engine/auto_defaults.py); none: weights dequantized to dtype at "
                                           "load; int4: run the checkpoint's 4-bit weights (GGUF Q4_1) with "
                                           "torch's int4 CPU kernel, needs dtype bfloat16; gguf: keep a .gguf "
                                           "file's quantized linear weights as stored (Q8_0, Q4_0, Q4_1, Q4_K, "
                                           "Q5_K, Q6_K; CPU: compiled kernels, CUDA: Triton kernels); fp8: keep "
                                           "a DeepSeek-V4 checkpoint's FP8 and FP4 weights as stored",
                                   choices=list(QUANTIZATIONS))
    seed: int = arg(0, "random seed of the engine (requests without a seed)")
    generation_config: str = arg(
        "auto", "sampling defaults for what a request leaves unset (vLLM's flag): auto: the model's recommended "
                "ones (generation_config.json; a GGUF's general.sampling.* keys); vllm: none (temperature 1, no "
                "top-k / top-p); a folder: its generation_config.json")
    override_generation_config: dict | None = arg(
        None, 'defaults over those, in generation_config.json\'s names: {"temperature": 0.6, "top_p": 0.95, '
              '"top_k": 20, "min_p": 0, "repetition_penalty": 1.05, "max_new_tokens": 4096}', type=parse_json_object)
    pooler_config: dict | None = arg(
        None, 'how /v1/embeddings pools the final hidden states, over the model\'s own (sentence-transformers '
              'modules.json, a GGUF\'s pooling_type; else last token, normalized): {"pooling_type": "last" | '
              '"mean" | "cls", "normalize": true}', type=parse_json_object)
    hf_overrides: dict | None = arg(
        None, 'keys set over the model\'s config.json (vLLM\'s flag), e.g. a yes/no reranker: '
              '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
              '"is_original_qwen3_reranker": true}', type=parse_json_object)
    max_logprobs: int = arg(20, "the most logprobs (per token, and per prompt token) a request may ask for "
                                "(vLLM's flag; -1: no cap)")
    stream_interval: int = arg(1, "tokens a streamed request's output gathers before it is sent (vLLM's flag: "
                                  "the first token and the last always go at once; larger: fewer, bigger "
                                  "stream chunks, less host work per token under many streams)")
    prefix_cache_file: str | None = arg(None, "keep the prefix cache across restarts: read from this file at start "
                                              "(if it exists and matches the model), written at shutdown")
    tokenizer: str | None = arg(None, "a directory whose tokenizer.json (and chat template) serve instead of "
                                      "the model's (vLLM's flag)")
    enable_sleep_mode: bool = arg(False, "allow sleep / wake_up (vLLM's): an idle engine gives back its KV pool "
                                         "and weights (level 1: weights to host memory; 2: discarded, read "
                                         "again on waking)")
    enable_lora: bool = arg(False, "serve LoRA adapters (PEFT format) over the model, several per batch")
    max_loras: int = arg(1, "LoRA adapters one step may run at once (each a slot on the device)")
    max_lora_rank: int = arg(16, "the highest LoRA rank an adapter may have (sizes the slots)")
    max_cpu_loras: int | None = arg(None, "LoRA adapters kept read in host memory (default: max_loras)")
    max_rollback_tokens: int = arg(0, "how far a step may roll a sequence back (speculative decoding); sizes "
                                      "ring-buffered state (DeepSeek-V4 window / carry)")
    num_threads: int | None = arg(None, "torch threads in the engine core (default: torch's)")
    tensor_parallel_size: int = arg(1, "ranks the model is split over (attention heads, MLP features, experts, "
                                          "vocabulary); one process per rank")
    nnodes: int = arg(1, "nodes the ranks run on (tensor_parallel_size / nnodes ranks per node)")
    node_rank: int = arg(0, "this node's index: 0 serves HTTP and schedules, others run with --headless")
    master_addr: str = arg("127.0.0.1", "node 0's address on the link between the nodes (rendezvous)")
    master_port: int = arg(29500, "node 0's rendezvous port")
    distributed_timeout: float = arg(20.0, "seconds a rank waits on another before failing: a dead or hung "
                                           "rank ends the others (exit non-zero) within about this long")
    speculative_config: dict | None = arg(
        None, 'speculative decoding, as vLLM spells it: {"method": "ngram" | "mtp" | "draft_model", '
              '"num_speculative_tokens": k, "prompt_lookup_min": n, "prompt_lookup_max": n, "model": draft model '
              '(draft_model), "disable_by_batch_size": b}', type=parse_json_object)
    mmproj: str | None = arg(None, "llama.cpp's --mmproj: the vision tower's GGUF (clip) beside a Gemma 3 GGUF "
                                   "model, which then takes images", metavar="FILE")
    limit_mm_per_prompt: dict | None = arg(
        None, 'the most images one prompt may carry (vLLM\'s flag), e.g. {"image": 4}; default: no limit. '
              'Images only: there are no audio or video inputs', type=parse_json_object)

    # Why each "auto" resolved as it did (resolved() fills it; not a flag).
    auto_reasons: dict = field(default_factory=dict, repr=False, compare=False)

    def image_limit(self) -> int | None:
        """Images per prompt from limit_mm_per_prompt (vLLM's forms: a count
        or {"count": n}); None: no limit."""
        limits = {}
        for k, v in (self.limit_mm_per_prompt or {}).items():
            n = v.get("count") if isinstance(v, dict) else v
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"limit_mm_per_prompt[{k!r}] must be a count >= 0, got {v!r}")
            if k != "image" and n:
                raise ValueError(f"limit_mm_per_prompt: there are no {k} inputs (images only)")
            limits[k] = n
        return limits.get("image")

    def validate(self) -> None:
        import torch     # here, not at import: the protocol layer imports this module
        if self.device not in DEVICES:
            raise ValueError(f"unknown device {self.device!r}; supported: {', '.join(DEVICES)}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device cuda requested but torch.cuda.is_available() is False "
                             f"(torch {torch.__version__} built without CUDA?)")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; supported: {', '.join(DTYPES)}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling_policy {self.scheduling_policy!r}; supported: "
                             f"{', '.join(SCHEDULING_POLICIES)}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load_format {self.load_format!r}; supported: {', '.join(LOAD_FORMATS)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("enforce_eager", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.quantization!r}; supported: {', '.join(QUANTIZATIONS)}")
        if self.quantization in ("gguf", "fp8") and self.load_format == "dummy":
            raise ValueError(f"quantization {self.quantization} keeps the checkpoint's weights as stored; "
                             f"load_format dummy has none")
        if self.quantization == "int4" and self.resolved_device() == "cuda":
            raise ValueError("quantization int4 is not supported on CUDA yet (it runs torch's int4 CPU "
                             "kernel): add device cpu, or drop quantization")
        if self.quantization == "int4" and self.load_format == "dummy":
            raise ValueError("quantization int4 packs the checkpoint's 4-bit weights; load_format dummy has none")
        if self.quantization == "int4" and self.dtype not in ("bfloat16", "auto"):
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
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        self.topology()          # (raises on a bad layout)
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout must be > 0, got {self.distributed_timeout}")
        spec = self.speculative()
        if spec is not None and spec.method == "draft_model" and self.tensor_parallel_size > 1:
            raise ValueError("a speculative draft model does not run with tensor parallelism "
                             "(tensor_parallel_size 1, or method ngram / mtp)")
        self.image_limit()               # (raises on a bad limit_mm_per_prompt)
        self.sampling_defaults(None)     # (raises on a bad generation config)
        self.pooling_defaults(None)

    def pooling_defaults(self, source):
        """The PoolingParams an embedding request starts from: the model's
        (source: ModelSource, or None), then pooler_config over it."""
        from engine.pooling_params import PoolingParams
        over = dict(self.pooler_config or {})
        unknown = sorted(set(over) - {"pooling_type", "normalize"})
        if unknown:
            raise ValueError(f"pooler_config: unknown key {unknown[0]!r}; supported: pooling_type, normalize")
        return PoolingParams(**{**(source.pooler_config if source is not None else {}), **over})

    def sampling_defaults(self, source) -> dict:
        """{temperature, top_p, top_k, min_p, repetition_penalty, max_tokens}: what
        requests that leave them unset get (generation_config, then its override
        on top); source: the opened model (ModelSource; None: the model's own
        settings not known yet)."""
        from pathlib import Path

        from model_zoo import generation_config as gc
        choice = self.generation_config
        if choice == "auto":
            out = dict(source.generation_config) if source is not None else {}
        elif choice == "vllm":
            out = {}
        elif Path(choice).is_dir():
            out = gc.from_hf_folder(Path(choice))
        else:
            raise ValueError(f"generation_config must be auto, vllm or a folder, got {choice!r}")
        override = self.override_generation_config or {}
        unknown = sorted(set(override) - set(gc.HF_KEYS))
        if unknown:
            raise ValueError(f"override_generation_config: unknown key {unknown[0]!r}; supported: "
                             f"{', '.join(gc.HF_KEYS)}")
        for key, v in override.items():
            out[gc.HF_KEYS[key]] = gc.checked("override_generation_config", key, gc.HF_KEYS[key], v)
        return out

    def topology(self):
        """Where the ranks run (parallel.distributed.Topology); raises ValueError on a bad layout."""
        from parallel.distributed import Topology
        return Topology(self.tensor_parallel_size, self.nnodes, self.node_rank, self.master_addr,
                        self.master_port)

    def speculative(self):
        """The parsed speculative_config (engine.speculative.SpeculativeConfig) or None."""
        from engine.speculative import SpeculativeConfig
        return SpeculativeConfig.parse(self.speculative_config)

    def resolved_device(self) -> str:
        import torch
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def resolved(self, stored: dict[str, str] | None = None, stored_splits: bool = True) -> "EngineArgs":
        """A validated copy with every "auto" that depends on the machine or
        the checkpoint made concrete (device, dtype, quantization: see
        engine/auto_defaults.py), so that nothing downstream decides again;
        `auto_reasons` says why, per setting. stored: the opened checkpoint's
        {tensor: format} kept-as-stored candidates (ModelSource.stored); None:
        not known, quantization auto is none. stored_splits: whether they can
        be cut across tensor-parallel ranks (ModelSource.stored_splits)."""
        from engine import auto_defaults
        from parallel.quant.gguf import QTYPES
        self.validate()
        device = self.resolved_device()
        reasons = {}
        dtype = self.dtype
        if dtype == "auto":
            c = auto_defaults.choose_dtype(device)
            dtype, reasons["dtype"] = c.value, c.reason
        quant = None if self.quantization == "none" else self.quantization
        if quant == "auto":
            c = auto_defaults.choose_quantization(device, stored or {}, QTYPES, self.tensor_parallel_size,
                                                  self.load_format, stored_splits) \
                if stored is not None else auto_defaults.Choice(None, "checkpoint not opened")
            quant, reasons["quantization"] = c.value, c.reason
        if quant == "int4" and dtype != "bfloat16":
            raise ValueError("quantization int4 runs with bf16 activations: add dtype bfloat16")
        spec = self.speculative()
        # Rejected drafts are rolled back: ring-buffered state must keep that many positions.
        rollback = max(self.max_rollback_tokens, spec.num_speculative_tokens if spec else 0)
        return replace(self, device=device, dtype=dtype, quantization=quant, max_rollback_tokens=rollback,
                       auto_reasons=reasons)

    def to_dict(self) -> dict:
        return asdict(self)
