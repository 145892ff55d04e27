"""DeepSeek-V4 checkpoints: official names -> transformers' names, and
dequantisation of FP8 / FP4 weights at load.

Official checkpoints (deepseek-ai/DeepSeek-V4-*) name tensors `embed.weight`,
`layers.N.attn.wq_a.weight`, `layers.N.ffn.experts.E.w1.weight`, `mtp.0.*`...;
the renames below are transformers' conversion_mapping for deepseek_v4, plus
the MTP head's own tensors (which transformers drops). Names already in
transformers' form (`model.layers.N.self_attn.q_a_proj.weight`) pass through.

Quantised weights come with a companion scale (`<module>.scale`, or
`<module>.weight_scale_inv` in HF-FP8 style):
  FP8  float8_e4m3fn weight [out, in], scale [ceil(out/128), ceil(in/128)]:
       w = w8 * scale[i // 128, j // 128]
  FP4  e2m1 codes packed two per byte (int8/uint8 [out, in/2], low nibble is
       the even column; or torch.float4_e2m1fn_x2), MXFP4-style scale
       [out, in/32] (float8_e8m0fnu, raw E8M0 bytes as uint8 = 2^(s-127), or any float):
       w = e2m1(code) * scale[i, j // 32]
"""
import re
from collections.abc import Iterable, Iterator

import torch

from parallel.quant.base import DENSE, QuantizedTensor

# transformers/conversion_mapping.py "deepseek_v4", in order.
RENAMES = [(re.compile(a), b) for a, b in [
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"),
    (r"\.hc_attn_base", ".attn_hc.base"),
    (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"),
    (r"\.hc_ffn_base", ".ffn_hc.base"),
    (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"),
    (r"(?<!\.compressor)\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]]
TOP_LEVEL = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
             "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
             "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}
MTP_OWN = {"norm.weight": "norm.weight", "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
           "e_proj.weight": "e_proj.weight", "h_proj.weight": "h_proj.weight",
           "hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}
_MTP = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.*)$")


def hf_name(name: str) -> str:
    """transformers' name for an official (or already-transformers) tensor name.
    MTP tensors come out as `mtp.K.<transformers-style decoder-layer name>`."""
    if name.startswith("lm_head.") and not _MTP.match(name):
        return name
    if name.startswith("model.") and not _MTP.match(name):
        # transformers' save_pretrained writes official names under "model."
        # (layers.N.attn.wq_a ...); its own names map to themselves here.
        return hf_name(name[len("model."):])
    m = _MTP.match(name)
    if m:
        k, rest = m.groups()
        if rest in MTP_OWN:
            return f"mtp.{k}.{MTP_OWN[rest]}"
        if rest.startswith(("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.", "attn_hc.",
                            "ffn_hc.", "hc_head.")):
            return f"mtp.{k}.{rest}"
        out = "." + rest
        for pat, rep in RENAMES:
            out = pat.sub(rep, out)
        return f"mtp.{k}{out}"
    if name in TOP_LEVEL:
        return TOP_LEVEL[name]
    out = name
    for pat, rep in RENAMES:
        out = pat.sub(rep, out)
    return "model." + out


def model_name(name: str) -> str:
    """Our parameter name for a checkpoint tensor name (hf_name, and the
    indexer's weights_proj, which transformers keeps under a `scorer`)."""
    return hf_name(name).replace(".compressor.indexer.scorer.weights_proj.", ".compressor.indexer.weights_proj.")


# ---------------------------------------------------------------- dequantisation

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """fp32 scales from float scales, float8_e8m0fnu, or raw E8M0 bytes (uint8: 2^(s - 127))."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def dequant_fp8(w: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    out, inp = w.shape
    s = scale_values(scale).repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :inp]
    return w.float() * s


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[out, in/2] packed e2m1 (low nibble = even column) -> [out, in] fp32."""
    b = packed.view(torch.uint8).to(torch.long)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
    return E2M1[codes]


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    w = unpack_fp4(packed)
    block = w.shape[1] // scale.shape[1]
    return w * scale_values(scale).repeat_interleave(block, 1)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] e2m1 codes 0..15 -> [out, in/2] uint8 (the inverse of unpack_fp4's layout)."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def _is_quantised(t: torch.Tensor) -> bool:
    fp4x2 = getattr(torch, "float4_e2m1fn_x2", None)
    return t.dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8) or (fp4x2 is not None and t.dtype == fp4x2)


def _dequant(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if w.dtype == torch.float8_e4m3fn:
        return dequant_fp8(w, scale)
    return dequant_fp4(w, scale)


def dequantised(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Pair each quantised weight with its scale (in any order) and yield the
    fp32 weight under its original name; other tensors pass through (and so
    do weights the loader already paired: parallel.quant.base.QuantizedTensor)."""
    held_w: dict[str, torch.Tensor] = {}
    held_s: dict[str, torch.Tensor] = {}
    for name, t in weights:
        if isinstance(t, QuantizedTensor):
            yield name, t
        elif name.endswith((".scale", ".weight_scale_inv")) and t.dim() == 2:
            base = name.rsplit(".", 1)[0]
            if base + ".weight" in held_w:
                yield base + ".weight", _dequant(held_w.pop(base + ".weight"), t)
            else:
                held_s[base] = t
        elif name.endswith(".weight") and _is_quantised(t):
            base = name[:-len(".weight")]
            if base in held_s:
                yield name, _dequant(t, held_s.pop(base))
            else:
                held_w[name] = t
        else:
            yield name, t
    if held_w or held_s:
        raise ValueError(f"quantised weights without scales: {sorted(held_w)[:4]}; "
                         f"scales without weights: {sorted(held_s)[:4]}")


# ---------------------------------------------------------------- loading

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
# expert tensor kind -> (fused tensor, first row in it as a fraction of its halves: 0 gate / down, 1 up)
_KIND = {"w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
         "up_proj": ("gate_up_proj", 1), "w2": ("down_proj", 0), "down_proj": ("down_proj", 0)}


def use_stored(model: torch.nn.Module, fmts: dict[str, str]) -> int:
    """On the meta-built model: the layers fed by the checkpoint tensors
    `fmts` ({checkpoint name: "fp8" | "mxfp4"}) keep them as stored. FP8
    linear layers (parallel.linear) get parallel.quant.fp_methods.Fp8Block;
    an MoE layer whose routed experts all come in one stored format gets
    ExpertWeights. A stored tensor no layer takes (a router, an expert set
    the kernels cannot hold) is dequantized at load, as without
    --quantization. Returns how many layers keep their weights as stored."""
    from parallel.linear import LinearBase
    from parallel.quant.fp_methods import ExpertWeights, Fp8Block
    modules = dict(model.named_modules())
    linears: dict[str, torch.nn.Module] = {}
    experts: dict[str, dict[tuple[int, str], str]] = {}
    for name, fmt in fmts.items():
        ours = model_name(name)
        m = _EXPERT.match(ours)
        if m:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = fmt
            continue
        mod, _, leaf = ours.rpartition(".")
        layer = modules.get(mod)
        if fmt == "fp8" and leaf == "weight" and isinstance(layer, LinearBase):
            linears[mod] = layer
    for mod, layer in linears.items():
        layer.use_quant(Fp8Block.for_layer(layer, mod))
    n = len(linears)
    for prefix, got in experts.items():
        ex = modules.get(prefix)
        if ex is None or not hasattr(ex, "use_stored"):
            continue            # load_weights names the unknown tensor
        kinds = {(e, _KIND[k][0], _KIND[k][1]) for e, k in got}
        kinds_fmts = set(got.values())
        if len(kinds) != 3 * ex.num_experts or len(kinds_fmts) != 1:
            continue            # not every expert stored, or in two formats: dequantized
        (fmt,) = kinds_fmts
        if ExpertWeights.unsupported(fmt, ex.hidden, ex.inter) is None:
            ex.use_stored(fmt)
            n += 1
    return n


def official_formats(model: torch.nn.Module) -> dict[str, str]:
    """{tensor: format} of what the official DeepSeek-V4 checkpoints store
    quantized, for a built model_zoo model (names in our form, which
    model_name passes through): every expert's w1 / w2 / w3 in "mxfp4", the
    other linear projections in "fp8", except the compressors' own kv / gate
    and the indexer's weights projections (bf16). For `tqserve plan`, which
    has a config but no checkpoint."""
    from parallel.linear import LinearBase
    fmts = {}
    for name, m in model.named_modules():
        if isinstance(m, LinearBase):
            if ".compressor." not in name or name.endswith(".indexer.q_b_proj"):
                fmts[name + ".weight"] = "fp8"
        elif hasattr(m, "use_stored") and hasattr(m, "num_experts"):
            fmts.update({f"{name}.{e}.{k}.weight": "mxfp4" for e in range(m.num_experts) for k in ("w1", "w2", "w3")})
    return fmts


def meta_checkpoint(model: torch.nn.Module, fmts: dict[str, str]) -> Iterator[tuple[str, QuantizedTensor]]:
    """The stored tensors `fmts` names, at their checkpoint shapes, as empty
    meta-device QuantizedTensors (scales: fp32 for fp8, E8M0 bytes for
    mxfp4): load_into(..., partial=True) then allocates on the meta device
    what a real load would, so the plan counts the layers' own storage."""
    modules = dict(model.named_modules())
    meta = dict(device="meta")
    for name, fmt in fmts.items():
        ours = model_name(name)
        m = _EXPERT.match(ours)
        if m:
            ex = modules[m.group(1)]
            rows, cols = (ex.hidden, ex.inter) if _KIND[m.group(3)][0] == "down_proj" else (ex.inter, ex.hidden)
        else:
            layer = modules[ours.rpartition(".")[0]]
            rows, cols = layer.quant.full_shape if layer.quant is not DENSE else tuple(layer.weight.shape)
        if fmt == "mxfp4":
            data = torch.empty(rows, cols // 2, dtype=torch.uint8, **meta)
            scale = torch.empty(rows, cols // 32, dtype=torch.uint8, **meta)
        else:
            data = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, **meta)
            scale = torch.empty(-(-rows // 128), -(-cols // 128), dtype=torch.float32, **meta)
        yield name, QuantizedTensor(fmt, data, (rows, cols), scale)


def dense(t):
    """A checkpoint tensor as a float tensor: a QuantizedTensor dequantized to fp32."""
    return _dequant(t.data, t.scale) if isinstance(t, QuantizedTensor) else t


def load_into(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> None:
    """Load official- or transformers-named tensors (quantised or not) into a
    model_zoo DeepseekV4ForCausalLM. Unknown names and wrong shapes raise; a
    missing tensor raises, except that a checkpoint without any `mtp.*` leaves
    the MTP head unloaded (zeros, model.mtp_loaded False). Tensors that come
    paired with their scale (QuantizedTensor: `--quantization fp8`) go to the
    layers that keep them as stored (use_stored), or are dequantized here.
    partial: load what comes and allow the rest missing (meta_checkpoint)."""
    targets = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    seen: set[str] = set()
    parts: dict[str, set] = {}   # fused expert tensor -> the (expert, half) pieces loaded
    for name, t in dequantised(weights):
        hf = model_name(name)
        m = _EXPERT.match(hf)
        with torch.no_grad():
            if m:
                prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
                fused_leaf, half_id = _KIND[kind]
                fused = f"{prefix}.{fused_leaf}"
                if fused not in targets:
                    raise ValueError(f"unknown checkpoint tensor {name!r} (as {hf!r}) for DeepseekV4ForCausalLM")
                experts = model.get_submodule(prefix)
                if not 0 <= e < experts.num_experts:
                    raise ValueError(f"{name}: expert {e} out of range ({experts.num_experts})")
                local = e - experts.first
                if 0 <= local < experts.num_local:      # another rank's expert otherwise
                    if experts.quant is not DENSE:
                        which = "w13" if fused_leaf == "gate_up_proj" else "w2"
                        try:
                            experts.quant.load((local, which), half_id * experts.inter, t,
                                               targets[fused].device, targets[fused].dtype)
                        except ValueError as err:
                            raise ValueError(f"{name}: {err}") from err
                    else:
                        full = targets[fused][local]
                        if fused_leaf == "gate_up_proj":
                            half = full.shape[0] // 2
                            dst = full[:half] if half_id == 0 else full[half:]
                        else:
                            dst = full
                        _copy(dst, dense(t), name)
                got = parts.setdefault(fused, set())
                got.add((e, half_id))
                if len(got) == experts.num_experts * (2 if fused_leaf == "gate_up_proj" else 1):
                    seen.add(fused)
                continue
            if hf not in targets:
                raise ValueError(f"unknown checkpoint tensor {name!r} (as {hf!r}) for DeepseekV4ForCausalLM")
            param = targets[hf]
            if isinstance(t, QuantizedTensor):
                owner = model.get_submodule(hf.rpartition(".")[0]) if "." in hf else model
                if getattr(owner, "quant", DENSE) is DENSE or param is not getattr(owner, "weight", None):
                    t = dense(t)        # no layer keeps this one as stored
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                _copy(param, dense(t), name)
            else:
                try:
                    loader(param, t if isinstance(t, QuantizedTensor) else t.to(param.dtype))
                except ValueError as err:
                    raise ValueError(f"{name}: {err}") from err
            seen.add(hf)
    if partial:
        return
    expected = {n for n in targets if not n.endswith("inv_freq")}
    missing = sorted(expected - seen)
    mtp_expected = [n for n in expected if n.startswith("mtp.")]
    mtp_missing = [n for n in missing if n.startswith("mtp.")]
    model.mtp_loaded = bool(mtp_expected) and not mtp_missing
    if mtp_missing and len(mtp_missing) == len(mtp_expected):
        missing = [n for n in missing if not n.startswith("mtp.")]
        with torch.no_grad():   # unused, but zeros rather than whatever the memory held
            for n in mtp_expected:
                targets[n].zero_()
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s) for DeepseekV4ForCausalLM: "
                         f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{name}: shape mismatch: expected {tuple(dst.shape)}, got {tuple(src.shape)}")
    dst.copy_(src.to(dst.dtype))
