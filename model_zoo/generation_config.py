"""The sampling settings a model's authors recommend, read from its files.

A Hugging Face directory has them in generation_config.json (Qwen3: temperature
0.6, top_k 20, top_p 0.95); a GGUF file in its general.sampling.* keys
(llama.cpp's names). Both come out in vLLM's sampling-parameter names, and
only the keys vLLM takes from a generation config (`--generation-config auto`):
the engine uses them for what a request leaves unset.
"""
from __future__ import annotations

import json
from pathlib import Path

# generation_config.json key -> sampling parameter (vLLM's list).
HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# transformers' GenerationConfig defaults: vLLM reads the file through
# GenerationConfig.to_diff_dict(), which drops a value equal to these.
HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
# GGUF key (llama.cpp's LLAMA_MODEL_META_KEY_SAMPLING_*) -> sampling parameter.
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}
INTS = ("top_k", "max_tokens")
# What each may be (SamplingParams' own ranges).
RANGES = {"temperature": (lambda v: v >= 0, ">= 0"), "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
          "top_k": (lambda v: v >= -1, ">= -1"), "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
          "repetition_penalty": (lambda v: v > 0, "> 0"), "max_tokens": (lambda v: v >= 1, ">= 1")}


class GenerationConfigError(ValueError):
    """A generation config that cannot be used; the message names the file and key."""


def checked(where: str, key: str, name: str, v) -> int | float:
    """v as sampling parameter `name` takes it (key: its name in `where`)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise GenerationConfigError(f"{where}: {key} must be a number, got {v!r}")
    if name in INTS and v != int(v):
        raise GenerationConfigError(f"{where}: {key} must be an integer, got {v!r}")
    ok, what = RANGES[name]
    if not ok(v):
        raise GenerationConfigError(f"{where}: {key} must be {what}, got {v!r}")
    return int(v) if name in INTS else float(v)


def from_hf_folder(folder: Path) -> dict:
    """The recommended sampling settings in folder/generation_config.json
    ({} when there is no such file)."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GenerationConfigError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(cfg, dict):
        raise GenerationConfigError(f"{path}: expected a JSON object")
    out = {}
    for key, name in HF_KEYS.items():
        if cfg.get(key) is None:
            continue
        v = checked(str(path), key, name, cfg[key])
        if key not in HF_DEFAULTS or v != HF_DEFAULTS[key]:
            out[name] = v
    return out


def from_gguf(meta: dict, where: str = "GGUF") -> dict:
    """The recommended sampling settings in a GGUF file's metadata."""
    return {name: checked(where, key, name, meta[key]) for key, name in GGUF_KEYS.items() if key in meta}
