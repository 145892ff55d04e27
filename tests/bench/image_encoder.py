"""What an image costs before its tokens reach the language model, at
Gemma 3 4B-27B's vision shape (SigLIP-So400m: 27 layers, width 1152, 896 x
896 pixels in 14 x 14 patches = 4,096 patch tokens, pooled to 256 image
tokens of width 2,560), dummy weights:

  1. preprocessing one 1024 x 768 photo-sized image: model_zoo/gemma3_vision.py
     next to transformers' Gemma3ImageProcessorPil (the same output, checked);
  2. encoding one image (tower + projector): tqserve's Gemma3VisionEncoder next
     to transformers' SiglipVisionModel + Gemma3MultiModalProjector with the
     same weights, in one run (their outputs compared), and the encoder's
     FLOP rate (2 x parameters x patches + attention).

    .venv/bin/python tests/bench/image_encoder.py [--device cpu|cuda] [--dtype bfloat16|float32] [--repeat 3]
        [--layers 27] [--out DIR/stem]

Writes tests/bench/results/image_encoder_<device>.{json,md}. On a 2-core CPU
one image takes tens of seconds (--layers cuts the tower for a quick look;
the table says so); on a GPU, milliseconds.
"""
import argparse
import time
from pathlib import Path

import numpy as np
import torch
from bench_paths import log, machine, write_results  # puts the repo on sys.path

VISION = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
          "image_size": 896, "patch_size": 14, "layer_norm_eps": 1e-6, "vision_use_head": False}
TEXT_HIDDEN = 2560      # gemma-3-4b-it


def timed(fn, device, repeat):
    fn()                                    # warm-up (and the CUDA kernels' first launch)
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=3, help="timed encodes (median); preprocessing runs >= 10")
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from PIL import Image
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector
    from transformers.models.siglip.modeling_siglip import SiglipVisionModel

    from model_zoo.gemma3_vision import Gemma3VisionEncoder, preprocess
    dev, dtype = args.device, getattr(torch, args.dtype)
    vision = {**VISION, "num_hidden_layers": args.layers}
    cfg = {"vision_config": vision, "mm_tokens_per_image": 256, "text_config": {"hidden_size": TEXT_HIDDEN}}

    # 1. preprocessing
    rng = np.random.default_rng(0)
    photo = Image.fromarray(rng.integers(0, 256, (768, 1024, 3), dtype=np.uint8))
    hf_proc = Gemma3ImageProcessorPil(size={"height": 896, "width": 896})
    ours_px = preprocess(photo, cfg)
    hf_px = hf_proc(images=[photo], return_tensors="pt")["pixel_values"][0]
    assert torch.equal(ours_px, hf_px), "preprocessing differs from transformers'"
    n = max(args.repeat, 10)        # (cheap: always enough runs for a stable median)
    pre = {"tqserve_ms": 1e3 * timed(lambda: preprocess(photo, cfg), "cpu", n),
           "transformers_ms": 1e3 * timed(lambda: hf_proc(images=[photo], return_tensors="pt"), "cpu", n)}
    log(f"preprocess: tqserve {pre['tqserve_ms']:.1f} ms, transformers {pre['transformers_ms']:.1f} ms")

    # 2. the encoder, same weights both sides
    torch.manual_seed(0)
    with torch.device(dev):
        ours = Gemma3VisionEncoder(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.02)
    hf_cfg = Gemma3Config(vision_config=SiglipVisionConfig(**vision),
                          text_config=Gemma3TextConfig(hidden_size=TEXT_HIDDEN), mm_tokens_per_image=256)
    tower = SiglipVisionModel(hf_cfg.vision_config).to(dev, dtype).eval()
    proj = Gemma3MultiModalProjector(hf_cfg).to(dev, dtype).eval()
    sd = ours.state_dict()
    # (transformers 5 has no vision_model level in SiglipVisionModel)
    tower.load_state_dict({k.removeprefix("vision_tower.vision_model."): v for k, v in sd.items()
                           if k.startswith("vision_tower.")})
    proj.load_state_dict({k.removeprefix("multi_modal_projector."): v for k, v in sd.items()
                          if k.startswith("multi_modal_projector.")})
    x = ours_px[None].to(dev, dtype)

    def run_ours():
        with torch.inference_mode():
            return ours(x)

    def run_hf():
        with torch.inference_mode():
            return proj(tower(pixel_values=x).last_hidden_state)
    diff = (run_ours().float() - run_hf().float()).abs().max().item()
    log(f"encoder outputs differ by {diff:.3g} at most")
    t_ours = timed(run_ours, dev, args.repeat)
    t_hf = timed(run_hf, dev, args.repeat)
    params = sum(p.numel() for p in ours.parameters())
    patches = (896 // 14) ** 2
    flops = 2 * params * patches + 4 * patches * patches * vision["hidden_size"] * args.layers
    enc = {"tqserve_ms": 1e3 * t_ours, "transformers_ms": 1e3 * t_hf, "max_abs_diff": diff,
           "params_millions": params / 1e6, "tflops_per_image": flops / 1e12, "tqserve_tflops": flops / t_ours / 1e12}
    log(f"encode: tqserve {enc['tqserve_ms']:.0f} ms, transformers {enc['transformers_ms']:.0f} ms")
    m = machine()
    if dev == "cuda":
        m["gpu"] = torch.cuda.get_device_name(0)
    res = {"machine": m, "device": dev, "dtype": args.dtype, "layers": args.layers, "preprocess": pre, "encode": enc}
    where = m.get("gpu") or m.get("cpu_line")
    lines = [f"# Image cost at Gemma 3's vision shape ({where}, {args.dtype}, commit {m.get('commit')})", "",
             f"`.venv/bin/python tests/bench/image_encoder.py --device {dev} --dtype {args.dtype} "
             f"--layers {args.layers}`" + ("" if args.layers == 27 else f" (the tower cut to {args.layers} of 27 "
                                           "layers: scale the encode times by about 27 / layers)"), "",
             "| step | tqserve | transformers | ratio |", "|---|---|---|---|",
             f"| preprocess a 1024 x 768 image (ms, CPU) | {pre['tqserve_ms']:.1f} | {pre['transformers_ms']:.1f} | "
             f"{pre['transformers_ms'] / pre['tqserve_ms']:.2f}x |",
             f"| encode one image, {params / 1e6:.0f}M parameters, {flops / 1e12:.2f} TFLOP (ms) | "
             f"{enc['tqserve_ms']:.0f} | {enc['transformers_ms']:.0f} | {t_hf / t_ours:.2f}x |", "",
             f"tqserve's encoder runs at {enc['tqserve_tflops']:.2f} TFLOP/s; its output equals transformers' within "
             f"{diff:.2g} (max abs, {args.dtype}). Preprocessing is bitwise transformers'."]
    write_results(f"image_encoder_{dev}", res, lines, None if args.out is None else Path(args.out))


if __name__ == "__main__":
    main()
