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


def kv_args(preset: str) -> dict:
    """Engine arguments for 'tq4' or 'tq4:off' / 'tq4:kv': a KV preset and,
    after a colon, its hot tokens (kv_hot; the engine's default otherwise)."""
    name, _, hot = preset.partition(":")
    return {"kv_cache_dtype": name, **({"kv_hot": hot} if hot else {})}


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
