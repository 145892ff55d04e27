"""`vllm serve` flags that tqserve has no flag of its own for, so that a vLLM
command line (a systemd unit, a docker CMD, a `--config` YAML file) starts
as it is, or stops at once with a one-line reason. The flags whose meaning
is built here (--uvicorn-log-level, --disable-log-requests, --uds, ...) are
ordinary flags in server/cli.py; this table holds the rest, each with the
values that ask for nothing tqserve does not already do:

- what tqserve always does (chunked prefill, prompt_tokens_details, no docs
  routes) or that changes nothing here (vLLM V1's own ignored --swap-space,
  hub download options for a model that is loaded from disk) is accepted;
- anything else (pipeline or data parallelism, Ray, KV transfer, another
  logprobs mode) is refused, naming the flag and what to use instead.

`--config FILE` (vLLM's: a YAML mapping of flag names to values) becomes
command-line flags ahead of the given ones, so those given win.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass

ANY = object()          # every value is accepted


@dataclass(frozen=True)
class Flag:
    name: str                       # without the leading dashes
    kind: type                      # bool (a switch, --no-... too), int, float, str, or dict (JSON)
    ok: object                      # accepted values: ANY, a tuple of values, or a predicate
    why: str                        # what a refused value is told (also the flag's help)

    def accepts(self, value) -> bool:
        if value is None or self.ok is ANY:
            return True
        if callable(self.ok):
            return bool(self.ok(value))
        return value in self.ok


def _json(s: str):
    try:
        return json.loads(s)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {s!r}") from None


FLAGS = (
    # What tqserve always does.
    Flag("enable-chunked-prefill", bool, (True,), "chunked prefill is always on here"),
    Flag("enable-prompt-tokens-details", bool, ANY, "usage always has prompt_tokens_details.cached_tokens"),
    Flag("disable-fastapi-docs", bool, ANY, "no docs routes are served"),
    Flag("disable-frontend-multiprocessing", bool, ANY, "the HTTP server and the engine core run as tqserve "
                                                        "lays them out"),
    Flag("disable-uvicorn-access-log", bool, ANY, "uvicorn's access log is off; tqserve logs one line per "
                                                  "request (--disable-log-requests)"),
    Flag("enable-log-requests", bool, ANY, "one line per request is logged unless --disable-log-requests"),
    Flag("disable-cascade-attn", bool, ANY, "there is no cascade attention here"),
    Flag("disable-custom-all-reduce", bool, ANY, "tensor parallelism uses NCCL's (or gloo's) all-reduce"),
    Flag("guided-decoding-backend", str, ANY, "structured outputs are compiled by llguidance"),
    Flag("prefix-caching-hash-algo", str, ANY, "prefix-cache blocks are keyed by their tokens here"),
    Flag("safetensors-load-strategy", str, ANY, "weights are read one tensor at a time"),
    Flag("max-parallel-loading-workers", int, ANY, "weights are read one tensor at a time"),
    Flag("max-log-len", int, ANY, "prompts are not logged"),
    Flag("log-error-stack", bool, ANY, "errors are logged with their stack"),
    Flag("enable-server-load-tracking", bool, ANY, "GET /load always says how many requests are being handled"),
    # Changes nothing here (vLLM's V1 engine ignores swap space too; nothing is downloaded).
    Flag("swap-space", float, ANY, "a preempted request is recomputed, not swapped"),
    Flag("download-dir", str, ANY, "nothing is downloaded: --model is a directory, a .gguf file or a "
                                   "packaged model"),
    Flag("hf-token", str, ANY, "nothing is downloaded"),
    Flag("ignore-patterns", str, ANY, "nothing is downloaded"),
    # Neutral values only.
    Flag("revision", str, (), "a hub revision needs a download: give --model a local directory"),
    Flag("code-revision", str, (), "no code from a checkpoint runs here"),
    Flag("tokenizer-revision", str, (), "a hub revision needs a download: give --tokenizer a local directory"),
    Flag("tokenizer-mode", str, ("auto", "hf", "slow"), "the model's tokenizer.json (or GGUF vocabulary) is "
                                                        "used as it is (no mistral mode)"),
    Flag("config-format", str, ("auto", "hf"), "config.json (or the GGUF's metadata) is read"),
    Flag("model-impl", str, ("auto", "vllm"), "tqserve runs its own model code"),
    Flag("runner", str, ("auto", "generate", "pooling"), "one engine serves generation and pooling"),
    Flag("convert", str, ("auto", "none", "embed"), "any model serves embeddings of its last hidden states; "
                                                    "classifiers come from --hf-overrides"),
    Flag("task", str, ("auto", "generate", "embed", "embedding", "classify", "score"),
         "reward models are not served"),
    Flag("logprobs-mode", str, ("raw_logprobs",), "logprobs are the model's, before any sampling processor"),
    Flag("mamba-cache-dtype", str, ("auto", "float32"), "linear-attention state is kept in float32"),
    Flag("mamba-ssm-cache-dtype", str, ("auto", "float32"), "linear-attention state is kept in float32"),
    Flag("lora-dtype", str, ("auto",), "LoRA slots are in the model's dtype"),
    Flag("calculate-kv-scales", bool, (False,), "KV formats carry their own scales (--kv-cache-dtype)"),
    Flag("fully-sharded-loras", bool, (False,), "LoRA B is sharded with its layer, A is whole on every rank"),
    Flag("enable-expert-parallel", bool, (False,), "experts are split by --tensor-parallel-size"),
    Flag("enable-prompt-embeds", bool, (False,), "prompts are text or token ids"),
    Flag("skip-tokenizer-init", bool, (False,), "the tokenizer is always loaded"),
    Flag("disable-sliding-window", bool, (False,), "sliding-window layers keep their window"),
    Flag("enable-log-outputs", bool, (False,), "outputs are not logged"),
    Flag("enable-tokenizer-info-endpoint", bool, (False,), "there is no /get_tokenizer_info route"),
    Flag("enable-ssl-refresh", bool, (False,), "restart the server to take new TLS files"),
    Flag("distributed-executor-backend", str, ("mp", "uni"), "ranks are processes started by tqserve "
                                                             "(--tensor-parallel-size, --nnodes, --headless)"),
    Flag("pipeline-parallel-size", int, (1,), "pipeline parallelism is not supported: use "
                                              "--tensor-parallel-size"),
    Flag("data-parallel-size", int, (1,), "data parallelism is not supported: run one server per replica"),
    Flag("api-server-count", int, (1,), "one API server process serves each engine"),
    Flag("cpu-offload-gb", float, (0, 0.0), "weights stay on the device (sleep mode frees them when idle)"),
    Flag("num-gpu-blocks-override", int, (), "size the KV pool with --kv-cache-memory or "
                                             "--gpu-memory-utilization"),
    Flag("cuda-graph-sizes", str, (), "decode steps are captured at batch sizes set by --max-num-seqs"),
    Flag("compilation-config", dict, ({},), "there is no torch.compile step; CUDA graphs: --enforce-eager"),
    Flag("kv-transfer-config", dict, (), "KV transfer between instances is not supported"),
    Flag("structured-outputs-config", dict, lambda v: isinstance(v, dict) and set(v) <= {"backend"},
         "structured outputs are compiled by llguidance, with its defaults"),
    Flag("otlp-traces-endpoint", str, (), "tracing is not supported; scrape /metrics"),
    Flag("tool-parser-plugin", str, (), "tool parsers are built in (--tool-call-parser)"),
    Flag("tool-server", str, (), "hosted tools are not supported"),
    Flag("logits-processors", str, (), "custom logits processors are not supported"),
    Flag("hf-config-path", str, (), "config.json is read from --model"),
    Flag("middleware", str, (), "ASGI middleware is not loaded from the command line"),
)


def add_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("vLLM flags accepted for vLLM command lines (server/vllm_flags.py)")
    for f in FLAGS:
        dest = "vllm_" + f.name.replace("-", "_")
        if f.kind is bool:
            group.add_argument("--" + f.name, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                               help=f.why)
        else:
            group.add_argument("--" + f.name, dest=dest, default=None, help=f.why,
                               type=_json if f.kind is dict else f.kind)


def refused(args: argparse.Namespace) -> str | None:
    """The first flag given with a value tqserve cannot honour, as a one-line reason."""
    for f in FLAGS:
        value = getattr(args, "vllm_" + f.name.replace("-", "_"), None)
        if not f.accepts(value):
            return f"--{f.name} {_show(value)}: {f.why}"
    return None


def _show(v) -> str:
    return json.dumps(v) if isinstance(v, (dict, list)) else str(v).lower() if isinstance(v, bool) else str(v)


# --------------------------------------------------------------------------
# --config FILE
# --------------------------------------------------------------------------
def expand_config(argv: list[str], switch: Callable[[str], str | None]) -> list[str]:
    """argv with each `--config FILE` replaced by the flags its YAML mapping
    holds ({flag-name: value}), put first so that flags given on the command
    line win; switch(flag): "both" for a --flag / --no-flag switch, "on" for
    a --flag only one (false leaves it out), None for a flag with a value.
    Raises ValueError naming the file's fault."""
    out, front = [], []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--config" or a.startswith("--config="):
            path = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else None)
            if path is None:
                raise ValueError("--config needs a YAML file")
            front += _config_flags(path, switch)
            i += 1 if "=" in a else 2
            continue
        out.append(a)
        i += 1
    if not front:
        return argv
    # after the subcommand (and a positional model tag), before the given flags
    head = 1 if out and not out[0].startswith("-") else 0
    if head and len(out) > 1 and not out[1].startswith("-"):
        head = 2
    return out[:head] + front + out[head:]


def _config_flags(path: str, switch: Callable[[str], str | None]) -> list[str]:
    import yaml
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    flags: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        kind = switch(flag)
        if kind is not None:
            if not isinstance(value, bool):
                raise ValueError(f"--config {path}: {key} is a switch: give it true or false, not {value!r}")
            if value or kind == "both":
                flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            flags += [flag, *(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value)]
        else:
            flags += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return flags
