"""How a model's authors pool its hidden states into an embedding, read from
its files: a sentence-transformers layout (modules.json naming a Pooling
module, 1_Pooling/config.json, and a Normalize module or not), or a GGUF
file's {arch}.pooling_type (llama.cpp's LLAMA_POOLING_TYPE_*). Comes out as
engine.pooling_params.PoolingParams fields ({} when the files say nothing).
"""
from __future__ import annotations

import json
from pathlib import Path

# sentence-transformers' Pooling config flags, in its order of precedence.
ST_MODES = (("pooling_mode_cls_token", "cls"), ("pooling_mode_lasttoken", "last"),
            ("pooling_mode_mean_tokens", "mean"))
# llama.cpp: 0 none, 1 mean, 2 cls, 3 last, 4 rank (a reranker's head: not an embedding).
GGUF_TYPES = {1: "mean", 2: "cls", 3: "last"}


class PoolerConfigError(ValueError):
    """A pooling config that cannot be used; the message names the file."""


def _json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PoolerConfigError(f"{path}: not a readable JSON file ({e})") from None


def from_hf_folder(folder: Path) -> dict:
    modules_path = Path(folder) / "modules.json"
    if not modules_path.is_file():
        return {}
    modules = _json(modules_path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise PoolerConfigError(f"{modules_path}: expected a list of modules")
    types = [str(m.get("type", "")) for m in modules]
    out = {"normalize": any(t.endswith(".Normalize") for t in types)}
    pooling = next((m for m, t in zip(modules, types) if t.endswith(".Pooling")), None)
    if pooling is not None:
        cfg_path = Path(folder) / str(pooling.get("path", "")) / "config.json"
        cfg = _json(cfg_path) if cfg_path.is_file() else {}
        if not isinstance(cfg, dict):
            raise PoolerConfigError(f"{cfg_path}: expected a JSON object")
        mode = next((name for key, name in ST_MODES if cfg.get(key)), None)
        if mode is None and cfg:
            on = sorted(k for k, v in cfg.items() if k.startswith("pooling_mode") and v)
            raise PoolerConfigError(f"{cfg_path}: pooling {', '.join(on) or 'none'} is not supported "
                                    f"(supported: cls, mean, last token)")
        if mode is not None:
            out["pooling_type"] = mode
    return out


def from_gguf(meta: dict, arch: str) -> dict:
    t = meta.get(f"{arch}.pooling_type")
    return {"pooling_type": GGUF_TYPES[t], "normalize": True} if t in GGUF_TYPES else {}
