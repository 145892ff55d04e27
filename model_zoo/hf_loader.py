"""Open a Hugging Face model directory as a ModelSource.

Reads config.json, safetensors weights (one file or sharded through
model.safetensors.index.json), and when present tokenizer.json +
tokenizer_config.json (+ chat_template.jinja, which transformers 5 writes
beside it) and generation_config.json (stop ids). A directory without
tokenizer files loads with tokenizer=None; with weights=False (load_format
dummy) one with no weight files loads too.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Iterator

import torch

from model_zoo import generation_config as gen_config, pooler_config as pool_config
from model_zoo.chat_template import FALLBACK_TEMPLATES
from model_zoo.source import ModelLoadError, ModelSource, optional_config
from parallel.quant.base import QuantizedTensor
from model_zoo.tokenizer import Tokenizer, load_tokenizer_config

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

try:
    from safetensors import SafetensorError, safe_open
except ImportError:  # older safetensors: no exported error type
    from safetensors import safe_open

    SafetensorError = Exception

# Buffers some older checkpoints saved; derived from the config, never weights.
_SKIP_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ModelLoadError(f"{what} {path} does not exist") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{what} {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{what} {path} is not a JSON object")
    return data


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model directory, in shard order."""
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"safetensors index {index} has no weight_map")
        files = [folder / name for name in sorted(set(weight_map.values()))]
    elif single.exists():
        files = [single]
    else:
        raise ModelLoadError(
            f"no weights in {folder}: expected model.safetensors or model.safetensors.index.json"
        )
    for f in files:
        if not f.exists():
            raise ModelLoadError(f"safetensors shard {f} does not exist")
    return files


def _tensor_names(files: list[Path]) -> list[tuple[Path, str]]:
    """(file, tensor name) for every tensor, reading only the headers."""
    out = []
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                out += [(f, k) for k in st.keys() if not k.endswith(_SKIP_SUFFIXES)]
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"safetensors file {f} is unreadable (truncated or corrupt?): {e}") from e
    return out


def _header(files: list[Path]) -> dict[str, tuple[Path, str, list[int]]]:
    """{tensor name: (file, safetensors dtype, shape)}, from the headers only."""
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    sl = st.get_slice(k)
                    out[k] = (f, sl.get_dtype(), list(sl.get_shape()))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"safetensors file {f} is unreadable (truncated or corrupt?): {e}") from e
    return out


_E8M0_OR_FLOAT = ("U8", "F8_E8M0", "F32", "BF16", "F16")


def stored_formats(header: dict[str, tuple[Path, str, list[int]]]) -> dict[str, tuple[str, str]]:
    """{weight name: (format, its scale's name)} of the weights a layer can keep
    as stored, told by the dtypes and shapes in the headers (DeepSeek-V4):
      "fp8"    float8_e4m3fn [N, K] + scale [ceil(N/128), ceil(K/128)]
      "mxfp4"  e2m1 codes two per byte (int8 / uint8 [N, K/2], or F4 [N, K]) + scale [N, K/32]
    the scale named `<module>.scale` or `<module>.weight_scale_inv`."""
    out = {}
    for name, (_, dtype, shape) in header.items():
        if not name.endswith(".weight") or len(shape) != 2:
            continue
        base = name[:-len(".weight")]
        sname = next((n for n in (base + ".scale", base + ".weight_scale_inv") if n in header), None)
        if sname is None:
            continue
        _, sdtype, sshape = header[sname]
        if len(sshape) != 2 or sdtype not in _E8M0_OR_FLOAT:
            continue
        n, k = shape
        if dtype == "F8_E4M3" and sshape == [-(-n // 128), -(-k // 128)]:
            out[name] = ("fp8", sname)
        elif dtype in ("I8", "U8", "F4"):
            cols = k if dtype == "F4" else 2 * k
            if sshape == [n, cols // 32] and cols % 32 == 0:
                out[name] = ("mxfp4", sname)
    return out


def _chat_template(folder: Path, tokenizer_config: dict) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if template is None and (folder / "chat_template.json").exists():
        template = _read_json(folder / "chat_template.json", "chat template").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def fill_derived_config(config: dict) -> dict:
    """Add the keys model code reads that config.json may leave to class defaults.

    Only fills what is absent: head_dim, flat rope_theta (from rope_parameters
    when that is how transformers 5 wrote it), and for gemma3 the local rope
    base.
    """
    config = dict(config)
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        # A multimodal checkpoint (e.g. Qwen3_5ForConditionalGeneration): its language model,
        # named by the outer architectures (models.ARCHITECTURES maps them to the text model).
        # The outer file's stop / start ids win (Gemma's multimodal configs state them there).
        ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
        # The rest of the outer file (vision tower, image token ids) stays for the towers' code.
        outer = {k: v for k, v in config.items() if k != "text_config"}
        config = {**config["text_config"], **ids, "architectures": config.get("architectures") or [],
                  "multimodal_config": outer}
    if "head_dim" not in config and config.get("hidden_size") and config.get("num_attention_heads"):
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    rope = config.get("rope_parameters")
    if isinstance(rope, dict):
        if config.get("model_type") == "gemma3_text":
            full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
            if "rope_theta" not in config and "rope_theta" in full:
                config["rope_theta"] = full["rope_theta"]
            if "rope_local_base_freq" not in config and "rope_theta" in local:
                config["rope_local_base_freq"] = local["rope_theta"]
        elif "rope_theta" not in config and "rope_theta" in rope:
            config["rope_theta"] = rope["rope_theta"]
    return config


def read_tokenizer(folder: Path) -> tuple[Tokenizer | None, dict]:
    """A directory's tokenizer.json (None without one) and tokenizer_config.json."""
    tokenizer = None
    tokenizer_config: dict = {}
    try:
        tokenizer_config = load_tokenizer_config(folder)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"tokenizer config in {folder} is not valid JSON: {e}") from e
    tokenizer_json = folder / "tokenizer.json"
    if tokenizer_json.exists():
        try:
            tokenizer = Tokenizer.from_file(tokenizer_json, tokenizer_config)
        except Exception as e:  # tokenizers raises plain Exception subclasses on bad JSON
            raise ModelLoadError(f"tokenizer {tokenizer_json} cannot be loaded: {e}") from e
    return tokenizer, tokenizer_config


def use_tokenizer(source: ModelSource, folder: str | Path) -> None:
    """vLLM's --tokenizer: another directory's tokenizer and its chat template
    (if it has one) serve the model."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(f"tokenizer directory {folder} does not exist")
    tokenizer, tokenizer_config = read_tokenizer(folder)
    if tokenizer is None:
        raise ModelLoadError(f"tokenizer directory {folder} has no tokenizer.json")
    source.tokenizer = tokenizer
    source.chat_template = _chat_template(folder, tokenizer_config) or source.chat_template


def open_hf_dir(folder: str | Path, weights: bool = True) -> ModelSource:
    """weights False: config, tokenizer and stop ids only; the source has no
    weights to load (and the directory needs none)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"model directory {folder} does not exist")
    config = fill_derived_config(_read_json(folder / "config.json", "model config"))
    files = weight_files(folder) if weights else []
    entries = _tensor_names(files)
    rename = backbone_names([n for _, n in entries])
    generates = _has_head(config, {rename.get(n, n) for _, n in entries}) if entries else True
    if not generates:
        # The head reads the embedding matrix: its logits mean nothing, and the
        # engine refuses generation (ModelInfo.generates); embeddings are right.
        config["tie_word_embeddings"] = True
    header = _header(files)
    stored = stored_formats(header)

    tokenizer, tokenizer_config = read_tokenizer(folder)

    generation_config = {}
    if (folder / "generation_config.json").exists():
        generation_config = _read_json(folder / "generation_config.json", "generation config")
    eos: list[int] = []
    for value in (generation_config.get("eos_token_id"), config.get("eos_token_id")):
        eos += [i for i in _ids(value) if i not in eos]
    if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.append(tokenizer.eos_token_id)

    by_file: dict[Path, list[str]] = {}
    for f, name in entries:
        by_file.setdefault(f, []).append(name)

    def read_weights() -> Iterator[tuple[str, torch.Tensor]]:
        for f, names in by_file.items():
            with safe_open(str(f), framework="pt") as st:
                for name in names:
                    try:
                        tensor = st.get_tensor(name)
                    except (SafetensorError, OSError, ValueError) as e:
                        raise ModelLoadError(f"cannot read tensor {name} from {f}: {e}") from e
                    # Floating weights become fp32; quantized payloads (FP8 e4m3,
                    # packed FP4/int bytes, E8M0 scales) keep their dtype for
                    # the model's own dequantization.
                    yield rename.get(name, name), tensor.to(torch.float32) if tensor.dtype in _FLOATS else tensor

    scales = {sname for _, sname in stored.values()}

    def read_stored() -> Iterator[tuple[str, object]]:
        """As read_weights, except that the weights of `stored` come as
        QuantizedTensor (their scale, from whichever file holds it, paired)."""
        with ExitStack() as stack:
            handles = {}

            def get(f: Path, name: str) -> torch.Tensor:
                if f not in handles:
                    handles[f] = stack.enter_context(safe_open(str(f), framework="pt"))
                try:
                    return handles[f].get_tensor(name)
                except (SafetensorError, OSError, ValueError) as e:
                    raise ModelLoadError(f"cannot read tensor {name} from {f}: {e}") from e

            for f, names in by_file.items():
                for name in names:
                    if name in scales:
                        continue
                    t = get(f, name)
                    if name in stored:
                        fmt, sname = stored[name]
                        n, k = header[name][2]
                        if fmt == "mxfp4" and header[name][1] != "F4":
                            k *= 2
                        yield rename.get(name, name), QuantizedTensor(fmt, t, (n, k), get(header[sname][0], sname))
                    else:
                        yield rename.get(name, name), t.to(torch.float32) if t.dtype in _FLOATS else t

    return ModelSource(
        path=folder,
        format="hf",
        config=config,
        tokenizer=tokenizer,
        chat_template=_chat_template(folder, tokenizer_config) or FALLBACK_TEMPLATES.get(config.get("model_type")),
        eos_token_ids=eos,
        generation_config=optional_config("generation config", gen_config.from_hf_folder, folder),
        pooler_config=optional_config("pooling config", pool_config.from_hf_folder, folder),
        _weights_fn=read_weights if weights else None,
        num_tensors=len(entries),
        stored={rename.get(name, name): fmt for name, (fmt, _) in stored.items()},
        _stored_fn=read_stored if stored else None,
        generates=generates,
    )


# Families whose model ties the head to the embedding when config.json does not say.
_TIED_BY_DEFAULT = ("gemma3", "gemma3_text", "gemma4", "gemma4_text")


def backbone_names(names: list[str]) -> dict[str, str]:
    """{stored name: HF name} for a checkpoint saved from the bare backbone
    (transformers' AutoModel, as sentence-transformers saves embedding models
    such as Qwen3-Embedding): embed_tokens.weight, layers.N..., norm.weight,
    which the CausalLM classes name model.embed_tokens.weight, ...; {} otherwise."""
    # (DeepSeek-V4's own layout is flat too, with embed.weight: dsv4_checkpoint names it.)
    if "embed_tokens.weight" not in names or any(n.startswith("model.") for n in names):
        return {}
    return {n: "model." + n for n in names if not n.startswith("lm_head.")}


def _has_head(config: dict, names: set[str]) -> bool:
    """Whether the checkpoint can generate: its head is stored or tied. An
    embedding checkpoint may be untied and headless (Qwen3-Embedding-8B)."""
    tied = config.get("tie_word_embeddings", config.get("model_type") in _TIED_BY_DEFAULT)
    return bool(tied) or "lm_head.weight" in names or config.get("model_type") == "deepseek_v4"
