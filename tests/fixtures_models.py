"""Shared helpers for the loader/tokenizer/chat-template tests: the two real
GGUF models, their transformers references, a varied text corpus, and tiny
Hugging Face directories written by transformers itself.

Not a conftest (others own that): test modules import from here and wrap
what they need in module-scoped fixtures, so each heavy load happens once.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from model_zoo.resolve import resolve_path

REAL_MODELS = ["smollm2-135m", "gemma3-270m"]
REPO = Path(__file__).resolve().parents[1]


SHAKESPEARE = REPO / "tests" / "data" / "tinyshakespeare.txt"


def shakespeare_text() -> str:
    return SHAKESPEARE.read_text(encoding="utf-8")


VARIED_TEXTS = [
    "Hello world",
    " Hello world",
    "Hello, world! How are you today?",
    "",
    " ",
    "   leading and trailing spaces   ",
    "tabs\tand\t\ttabs",
    "line one\nline two\n\nline four\n\n\n",
    "\n\nstarts with newlines",
    "multiple     spaces      between",
    "digits 0 12 345 6789 1234567890 3.14159 1,000,000",
    "ünïcödé àccénts: café, naïve, Straße, Ærøskøbing",
    "emoji 🤖🎉👍🏽 and family 👨‍👩‍👧‍👦 and flags 🇫🇷",
    "中文测试：你好，世界！日本語のテキスト、한국어 텍스트",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी",
    "code: def f(x):\n    return x ** 2  # comment\n",
    "JSON {\"a\": [1, 2, 3], \"b\": null}",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after bos <eos> <pad> <unk>",
    "<|endoftext|>after endoftext",
    "a<|im_start|>b<start_of_turn>c",
    "zero\u200bwidth and nbsp\u00a0here",
    "don't won't it's I'm we'll they've she'd",
    "URL https://example.com/path?q=1&r=2#frag",
    "   \n   \n\t\t\n",
    "▁ literal metaspace ▁▁ chars",
    "ALL CAPS SHOUTING AND MiXeD cAsE",
]


@functools.lru_cache(maxsize=None)
def corpus() -> tuple[str, ...]:
    """Varied texts plus Shakespeare: single lines, a multi-line chunk, a long passage."""
    text = shakespeare_text()
    lines = [line for line in text.splitlines() if line.strip()]
    picks = [lines[i] for i in range(0, len(lines), max(1, len(lines) // 40))][:40]
    return tuple(VARIED_TEXTS + picks + [text[5000:6500], text[100000:104000]])


def gguf_path(name: str) -> Path:
    return resolve_path(name)


@functools.lru_cache(maxsize=None)
def hf_tokenizer(name: str):
    from transformers import AutoTokenizer

    p = gguf_path(name)
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


def hf_gguf_config(name: str):
    from transformers import AutoConfig

    p = gguf_path(name)
    return AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)


@functools.lru_cache(maxsize=None)
def hf_gguf_model(name: str):
    """transformers' fp32 model of a real GGUF, loaded once per test session
    (~60 s for Gemma3 on 2 cores): test_loaders and test_real_models share it.
    Callers must not change its weights."""
    import torch
    from transformers import AutoModelForCausalLM

    p = gguf_path(name)
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)


def tiny_llama_config(vocab_size: int = 49152, tie: bool = True):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        rope_theta=50000.0, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )


def write_tiny_llama(folder: Path, sharded: bool, with_tokenizer: bool, tie: bool = True):
    """save_pretrained of a tiny random LlamaForCausalLM (+ SmolLM2's tokenizer); returns the model."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tie=tie)).eval()
    # eos as a list in generation_config, a scalar in config: the loader must merge both
    model.generation_config.eos_token_id = [2, 0]
    model.save_pretrained(folder, max_shard_size="100KB" if sharded else "10GB")
    if with_tokenizer:
        hf_tokenizer("smollm2-135m").save_pretrained(folder)
    return model


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (what the loader must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_row_order(rows: int, n_head: int) -> np.ndarray:
    """Row i of a permuted GGUF q/k tensor is original row order[i] (index form of the permute)."""
    return llama_cpp_permute(np.arange(rows)[:, None], n_head)[:, 0]


QUANTIZABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def write_tiny_gguf(path: Path, arch: str = "llama", qtype: str = "F32", extra_tensors=None,
                    drop: tuple[str, ...] = (), seed: int = 0, tokenizer: str = "gpt2", sampling=None):
    """A tiny llama-layout GGUF written with gguf.GGUFWriter.

    Matrices are stored as `qtype` (norms stay F32, as llama.cpp does); q/k rows
    are permuted the way llama.cpp's converter does. Types numpy can quantize
    are quantized from random floats; other types (k-quants) get random block
    bytes. Returns (expected, originals): HF name -> the float32 values a
    correct loader must produce, computed independently of the loader (the
    un-permute by index), and the float originals before quantization.
    sampling: general.sampling.* keys, by gguf-py's add_sampling_<name> (temp, top_k, ...).
    """
    import gguf

    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(seed)
    hidden, heads, kv_heads, layers, ffn, vocab = 256, 4, 2, 1, 512, 36
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    if tokenizer == "gpt2":
        # <|endoftext|> is in the vocab as in real byte-level files: transformers' GPT2Tokenizer
        # builder adds it as special whatever the file says (we only when the vocab has it)
        tokens = ["<s>", "</s>", "<|end|>"] + [chr(ord("a") + i) for i in range(26)] + [
            "ab", "abc", "\u0120", "\u0120a", "xy", "<|endoftext|>", "z!"]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 5) + [3, 1])
        w.add_token_merges(["a b", "ab c", "\u0120 a"])
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
    else:  # llama-style sentencepiece: byte-fallback tokens, scores, no merges in the file
        pieces = ["\u2581", "a", "b", "c", "h", "e", "l", "o", "w", "r", "d", "ab", "\u2581a", "\u2581ab", "\u2581abc",
                  "he", "ll", "llo", "hello", "\u2581hello", "or", "\u2581w", "\u2581wor", "\u2581world", "\u2581\u2581"]
        tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
        vocab = len(tokens)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores([0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))])
        w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
    w.add_vocab_size(vocab)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for name, v in (sampling or {}).items():
        getattr(w, f"add_sampling_{name}")(v)

    expected: dict[str, np.ndarray] = {}
    originals: dict[str, np.ndarray] = {}
    qt = Q[qtype]

    def put(hf_name, gguf_name, shape, permute_heads=None):
        if gguf_name in drop:
            return
        value = rng.standard_normal(shape).astype(np.float32)
        originals[hf_name] = value
        stored = llama_cpp_permute(value, permute_heads) if permute_heads else value
        t = Q.F32 if len(shape) == 1 else qt
        if t == Q.F32:
            w.add_tensor(gguf_name, stored)
            back = stored
        elif t == Q.F16:
            w.add_tensor(gguf_name, stored.astype(np.float16))
            back = stored.astype(np.float16).astype(np.float32)
        elif qtype in QUANTIZABLE:
            data = gguf.quants.quantize(stored, t)
            w.add_tensor(gguf_name, data, raw_dtype=t)
            back = gguf.quants.dequantize(data, t)
        else:
            block, type_size = gguf.GGML_QUANT_SIZES[t]
            data = rng.integers(0, 256, size=(shape[0], shape[1] // block * type_size), dtype=np.uint8)
            w.add_tensor(gguf_name, data, raw_dtype=t)
            with np.errstate(all="ignore"):  # random bytes: some scales are inf/nan
                back = gguf.quants.dequantize(data, t)
        if permute_heads:
            unpermuted = np.empty_like(back)
            unpermuted[llama_cpp_row_order(shape[0], permute_heads)] = back
            back = unpermuted
        expected[hf_name] = np.asarray(back, dtype=np.float32)

    put("model.embed_tokens.weight", "token_embd.weight", (vocab, hidden))
    put("model.norm.weight", "output_norm.weight", (hidden,))
    put("lm_head.weight", "output.weight", (vocab, hidden))
    for i in range(layers):
        p = f"model.layers.{i}."
        put(p + "input_layernorm.weight", f"blk.{i}.attn_norm.weight", (hidden,))
        put(p + "post_attention_layernorm.weight", f"blk.{i}.ffn_norm.weight", (hidden,))
        put(p + "self_attn.q_proj.weight", f"blk.{i}.attn_q.weight", (hidden, hidden), heads)
        put(p + "self_attn.k_proj.weight", f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden), kv_heads)
        put(p + "self_attn.v_proj.weight", f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden))
        put(p + "self_attn.o_proj.weight", f"blk.{i}.attn_output.weight", (hidden, hidden))
        put(p + "mlp.gate_proj.weight", f"blk.{i}.ffn_gate.weight", (ffn, hidden))
        put(p + "mlp.up_proj.weight", f"blk.{i}.ffn_up.weight", (ffn, hidden))
        put(p + "mlp.down_proj.weight", f"blk.{i}.ffn_down.weight", (hidden, ffn))
    for name, (value, raw_dtype) in (extra_tensors or {}).items():
        w.add_tensor(name, value, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected, originals


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
