"""What every benchmark script starts with: the repo on sys.path, the data
and results locations, and a timestamped progress line on stderr. Scripts run
as files, so their own folder (this one) is importable."""
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
DATA = ROOT / "tests" / "data" / "tinyshakespeare.txt"
OUT = ROOT / "tests" / "bench" / "results"


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_results(stem: str, res: dict, lines: list[str], out: Path | None = None) -> None:
    """results/<stem>.json (res) and .md (lines), or out.{json,md} when given
    (a check's or a GPU run's copy), and the table on stdout."""
    import json
    base = out if out is not None else OUT / stem
    base.parent.mkdir(parents=True, exist_ok=True)
    base.with_suffix(".json").write_text(json.dumps(res, indent=1))
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def kv_args(preset: str) -> dict:
    """Engine arguments for 'tq4' or 'tq4:off' / 'tq4:kv': a KV preset and,
    after a colon, its hot tokens (kv_hot; the engine's default otherwise)."""
    name, _, hot = preset.partition(":")
    return {"kv_cache_dtype": name, **({"kv_hot": hot} if hot else {})}


def variant_args(config: str) -> dict:
    """Engine arguments for a variant "DTYPE[:QUANTIZATION][/KV]" ("float32",
    "bfloat16:gguf", "bfloat16:gguf/f16"); no quantization is "none" (dense),
    and "auto" is the engine's defaults on this machine."""
    if config == "auto":
        return {}
    head, _, kv = config.partition("/")
    dtype, _, quant = head.partition(":")
    return {"dtype": dtype, "quantization": quant or "none", **({"kv_cache_dtype": kv} if kv else {})}


def make_prompts(tok, n, lo, hi, seed):
    """n token-id prompts of lo..hi tokens, random slices of the data text."""
    text = DATA.read_text()
    ids = tok.encode(text[:400_000], add_special_tokens=False)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        L = rng.randrange(lo, hi + 1)
        s = rng.randrange(0, len(ids) - L)
        out.append(ids[s:s + L])
    return out


def machine() -> dict:
    """What a result ran on: the CPU's model and flags (engine.cpu_features),
    torch, the commit, and the load average (another process on a 2-core
    machine distorts a run)."""
    import os
    import subprocess

    import torch

    from engine.cpu_features import cpu_info
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"cpu": cpu_info().as_dict(), "cpu_line": cpu_info().line(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "commit": commit, "loadavg": list(os.getloadavg())}
