"""What a loaded model is, before any nn.Module exists: its config, tokenizer,
chat template, stop ids, and a lazy stream of Hugging Face-named weights.

Both loaders (GGUF and HF directory) produce this one shape, so the model
definitions only ever see HF names and HF config keys.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch

if TYPE_CHECKING:
    from model_zoo.tokenizer import Tokenizer


class ModelLoadError(Exception):
    """A model could not be loaded; the message names the file/tensor/type at fault."""


@dataclass
class ModelSource:
    path: Path
    format: str  # "gguf" | "hf"
    config: dict
    tokenizer: "Tokenizer | None" = None
    chat_template: str | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # The authors' recommended sampling settings (model_zoo/generation_config.py)
    # and embedding pooling (model_zoo/pooler_config.py).
    generation_config: dict = field(default_factory=dict)
    pooler_config: dict = field(default_factory=dict)
    # Set by the loader: yields (hf_name, float32 tensor) one at a time. Kept a
    # plain callable so that ModelSource stays a dataclass with no loader state.
    _weights_fn: Callable[[], Iterator[tuple[str, torch.Tensor]]] | None = field(default=None, repr=False)
    num_tensors: int = 0
    # {hf_name: format} of the weights that can stay in their stored format
    # (GGUF blocks, FP8 / FP4: --quantization), and the stream that yields
    # those as parallel.quant.base.QuantizedTensor (the others as floats).
    stored: dict[str, str] = field(default_factory=dict)
    # Whether the layers can cut those across tensor-parallel ranks (False:
    # a file layout the layers take whole only).
    stored_splits: bool = True
    _stored_fn: Callable[[], Iterator[tuple[str, object]]] | None = field(default=None, repr=False)
    # The same stream with the stored tensors as empty meta tensors (GGUF).
    _stored_meta_fn: Callable[[], Iterator[tuple[str, object]]] | None = field(default=None, repr=False)
    # False: a checkpoint without a language-model head (an embedding model): embeddings only.
    generates: bool = True

    def weights(self, stored: bool = False, meta: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named float32 tensors, read and converted lazily, with progress
        on stderr; stored: the tensors of self.stored in their stored format;
        meta (with stored): those as meta tensors, not read."""
        fn = self._stored_meta_fn if meta else self._stored_fn if stored else self._weights_fn
        if fn is None:
            raise ModelLoadError(f"{self.path}: this ModelSource has no weights to load"
                                 + (" in their stored format" if stored else "") + (" on meta" if meta else ""))
        progress = Progress(f"loading {self.path.name}", self.num_tensors)
        for name, tensor in fn():
            yield name, tensor
            progress.step()
        progress.done()


def optional_config(what: str, read: Callable[..., dict], *args) -> dict:
    """read(*args), or {} with a warning when the file is broken: it costs the
    model's recommended settings, not the model."""
    try:
        return read(*args)
    except ValueError as e:
        logging.getLogger("tqserve.loader").warning("ignoring the %s: %s", what, e)
        return {}


class Progress:
    """One-line progress on stderr: a live \\r-updated percentage on a terminal,
    only a start and an end line otherwise (logs stay readable)."""

    def __init__(self, label: str, total: int, stream=None):
        self.label = label
        self.total = max(total, 0)
        self.count = 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self._last_pct = -1
        self._write(f"{label}: {self.total} tensors ...", final=not self.tty)

    def _write(self, text: str, final: bool) -> None:
        try:
            if self.tty:
                self.stream.write("\r" + text + ("\n" if final else ""))
            else:
                self.stream.write(text + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # closed stream: progress is never worth failing a load
            pass

    def step(self) -> None:
        self.count += 1
        if not self.tty or not self.total:
            return
        pct = 100 * self.count // self.total
        if pct != self._last_pct:
            self._last_pct = pct
            self._write(f"{self.label}: {pct:3d}% ({self.count}/{self.total})", final=False)

    def done(self) -> None:
        secs = time.monotonic() - self.start
        self._write(f"{self.label}: done, {self.count} tensors in {secs:.1f}s", final=True)
