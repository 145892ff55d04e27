"""model_zoo/gemma3_vision.py against transformers' Gemma 3 vision path: a tiny
random Gemma3ForConditionalGeneration's get_image_features, the PIL image
processor, and Gemma3Processor's prompt expansion (all built offline)."""
import copy
import re

import numpy as np
import pytest
import torch

from model_zoo.gemma3_vision import Gemma3VisionEncoder, expand_image_tokens, is_vision_weight, preprocess

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

VISION = dict(image_size=32, patch_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2, vision_use_head=False)
TEXT = dict(vocab_size=300, hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=24)
MM_TOKENS = 16          # 8x8 patches pooled 2x2 -> 4x4 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(hf model, config.json dict, the saved safetensors' tensors)."""
    import json

    from safetensors.torch import load_file
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    cfg = Gemma3Config(vision_config=VISION, text_config=TEXT, mm_tokens_per_image=MM_TOKENS,
                       boi_token_index=290, eoi_token_index=291, image_token_index=292)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        # transformers zero-initialises the projector and biases, ones the norms: randomise
        # every vision tensor so that each one matters.
        for name, p in model.named_parameters():
            if not ("vision_tower" in name or "multi_modal_projector" in name):
                continue
            if re.search(r"(layer_norm\d|post_layernorm)\.weight$", name):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias") or "mm_soft_emb_norm" in name:     # RMSNorm scales by 1 + w
                p.normal_(0, 0.3)
            elif "mm_input_projection_weight" in name:
                p.normal_(0, 0.3)
    folder = tmp_path_factory.mktemp("gemma3mm")
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    return model, config, load_file(folder / "model.safetensors")


def _vision_only(sd):
    return [(k, v) for k, v in sd.items() if is_vision_weight(k)]


def _hub_name(k: str) -> str:
    # The hub checkpoints' spelling: no "model.", a "vision_model." level in the tower.
    k = k.removeprefix("model.")
    return re.sub(r"^vision_tower\.(?!vision_model\.)", "vision_tower.vision_model.", k)


def test_saved_names_and_routing(tiny):
    _, _, sd = tiny
    vis = _vision_only(sd)
    assert len(vis) == 2 + 3 + 16 * VISION["num_hidden_layers"] + 2
    assert not any(is_vision_weight(k) for k in ("model.language_model.layers.0.mlp.up_proj.weight",
                                                 "language_model.model.embed_tokens.weight", "lm_head.weight"))
    for k in ("vision_tower.vision_model.post_layernorm.weight",
              "model.vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
              "model.vision_tower.embeddings.patch_embedding.weight",
              "multi_modal_projector.mm_input_projection_weight",
              "model.multi_modal_projector.mm_soft_emb_norm.weight"):
        assert is_vision_weight(k), k


@pytest.mark.parametrize("spelling", ["saved", "hub", "tf4", "in_memory"])
def test_forward_matches_transformers_fp32(tiny, spelling):
    model, config, sd = tiny
    if spelling == "saved":            # transformers 5.23 save_pretrained: vision_tower.embeddings...
        weights = _vision_only(sd)
    elif spelling == "hub":            # google/gemma-3-*-it: vision_tower.vision_model.embeddings...
        weights = [(_hub_name(k), v) for k, v in _vision_only(sd)]
    elif spelling == "tf4":            # transformers 4.52+ saves: model.vision_tower.vision_model...
        weights = [("model." + _hub_name(k), v) for k, v in _vision_only(sd)]
    else:                              # transformers 5's own state_dict: model.vision_tower.embeddings...
        weights = [(k, v) for k, v in model.state_dict().items() if is_vision_weight(k)]
    enc = Gemma3VisionEncoder(config).eval()
    enc.load_weights(weights)
    assert enc.num_image_tokens == MM_TOKENS and enc.image_size == VISION["image_size"]
    torch.manual_seed(1)
    pixels = torch.rand(3, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        want = model.model.get_image_features(pixel_values=pixels).pooler_output
        got = enc(pixels)
    assert got.shape == (3, MM_TOKENS, TEXT["hidden_size"]) and got.dtype == torch.float32
    assert want.abs().max() > 0.1               # not a vacuous comparison
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_forward_matches_transformers_bf16(tiny):
    model, config, sd = tiny
    enc = Gemma3VisionEncoder(config)
    enc.load_weights(_vision_only(sd))
    enc = enc.to(torch.bfloat16).eval()
    hf = copy.deepcopy(model).to(torch.bfloat16)
    torch.manual_seed(2)
    pixels = torch.rand(2, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        want = hf.model.get_image_features(pixel_values=pixels.to(torch.bfloat16)).pooler_output
        got = enc(pixels)           # float32 pixels: the encoder casts them, as transformers' patch embedding
    assert got.dtype == torch.bfloat16
    # Same ops in the same order on both sides; observed identical on CPU. Allow a couple of
    # bf16 ulps (2**-7 relative) in case a kernel differs on another build.
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_load_errors(tiny):
    _, config, sd = tiny
    weights = _vision_only(sd)
    enc = Gemma3VisionEncoder(config)
    with pytest.raises(ValueError, match=r"missing vision weights: .*encoder\.layers\.1\.mlp\.fc2\.bias"):
        enc.load_weights([(k, v) for k, v in weights if k != "vision_tower.encoder.layers.1.mlp.fc2.bias"])
    with pytest.raises(ValueError, match=r"unknown vision weight 'vision_tower\.encoder\.layers\.2\.mlp\.fc2\.bias'"):
        enc.load_weights(weights + [("vision_tower.encoder.layers.2.mlp.fc2.bias", torch.zeros(32))])
    with pytest.raises(ValueError, match=r"unknown vision weight 'vision_tower\.vision_model\.head\.probe'"):
        enc.load_weights(weights + [("vision_tower.vision_model.head.probe", torch.zeros(1, 1, 32))])
    with pytest.raises(ValueError, match=r"'multi_modal_projector\.mm_input_projection_weight' has shape \[48, 32\]"):
        enc.load_weights([(k, v.t() if k.endswith("mm_input_projection_weight") else v) for k, v in weights])
    with pytest.raises(ValueError, match="given twice"):
        enc.load_weights(weights + [("model." + weights[0][0], weights[0][1])])
    # vision_use_head true (SiglipVisionConfig's default): the unused pooling head's tensors are skipped.
    head_cfg = {**config, "vision_config": {**config["vision_config"], "vision_use_head": True}}
    Gemma3VisionEncoder(head_cfg).load_weights(weights + [("vision_tower.vision_model.head.probe",
                                                           torch.zeros(1, 1, 32))])


def test_config_defaults():
    # Keys a config.json leaves out take transformers' defaults: SigLIP's 768 hidden / 12 heads /
    # 3072 MLP, text hidden 2304, 256 tokens per image.
    enc = Gemma3VisionEncoder({"vision_config": {"num_hidden_layers": 1, "image_size": 896, "patch_size": 14},
                               "text_config": {}}).to("meta")
    assert enc.image_size == 896 and enc.num_image_tokens == 256
    assert enc.multi_modal_projector.mm_input_projection_weight.shape == (768, 2304)
    assert enc.vision_tower.vision_model.encoder.layers[0].mlp.fc1.weight.shape == (3072, 768)
    # SigLIP's default 224/16 grid (14x14) cannot pool to 256 tokens: transformers' projector
    # would build AvgPool2d(kernel_size=0); refused here at construction.
    for bad in ({"vision_config": {}}, {"vision_config": VISION, "text_config": TEXT, "mm_tokens_per_image": 15}):
        with pytest.raises(ValueError, match="mm_tokens_per_image"):
            Gemma3VisionEncoder(bad)


def _random_image(mode: str, w: int = 37, h: int = 23, seed: int = 0) -> "Image.Image":
    rng = np.random.default_rng(seed)
    if mode == "P":
        img = Image.fromarray(rng.integers(0, 16, (h, w), dtype=np.uint8), "L").convert("P")
        img.info["transparency"] = 3
        return img
    bands = len(Image.new(mode, (1, 1)).getbands())
    arr = rng.integers(0, 256, (h, w, bands) if bands > 1 else (h, w), dtype=np.uint8)
    return Image.fromarray(arr, mode)


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "P"])
@pytest.mark.parametrize("proc_cfg", [None, {"resample": 3, "image_mean": [0.48, 0.45, 0.4],
                                             "image_std": [0.26, 0.26, 0.27], "do_convert_rgb": None}])
def test_preprocess_matches_transformers(tiny, mode, proc_cfg):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    _, config, _ = tiny
    img = _random_image(mode)
    kwargs = {k: v for k, v in (proc_cfg or {}).items() if v is not None}
    hf = Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, **kwargs)
    want = torch.from_numpy(np.asarray(hf(img, return_tensors="np")["pixel_values"][0]))
    got = preprocess(img, config, proc_cfg)
    assert got.shape == (3, 32, 32) and got.dtype == torch.float32
    assert torch.equal(got, want)                        # bit-exact: same PIL resize, same float ops


def test_preprocess_hub_preprocessor_config():
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    # google/gemma-3-4b-it's preprocessor_config.json (nulls stand for the processor's defaults).
    pc = {"do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True,
          "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2,
          "rescale_factor": 0.00392156862745098, "size": {"height": 896, "width": 896}}
    img = _random_image("RGB", 301, 157, seed=3)
    hf = Gemma3ImageProcessorPil(**{k: v for k, v in pc.items() if v is not None})
    want = torch.from_numpy(np.asarray(hf(img, return_tensors="np")["pixel_values"][0]))
    got = preprocess(img, {"vision_config": {"image_size": 896, "patch_size": 14}}, pc)
    assert got.shape == (3, 896, 896) and torch.equal(got, want)
    assert torch.equal(preprocess(img, {"vision_config": {"image_size": 896}}), want)   # the defaults


def _byte_tokenizer():
    """A lossless byte-level tokenizer with Gemma 3's image special tokens, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})


def test_expand_image_tokens_matches_processor():
    from transformers.models.gemma3 import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = _byte_tokenizer()
    proc = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
                           tokenizer=tok, image_seq_length=5)
    text = "<bos><start_of_turn>user\nCompare <start_of_image> with<start_of_image>.<end_of_turn>\n"
    img = _random_image("RGB")
    ids = proc(text=[text], images=[[img, img]])["input_ids"][0]
    expanded = expand_image_tokens(text, 5)
    assert list(ids) == tok(expanded)["input_ids"]
    assert tok.decode(ids) == expanded
    assert expanded.count("<image_soft_token>") == 10
    assert ("Compare \n\n<start_of_image>" + "<image_soft_token>" * 5 + "<end_of_image>\n\n with") in expanded
