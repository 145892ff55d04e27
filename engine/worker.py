"""One rank's model and KV caches: the startup phases every rank runs.

vLLM's split: the engine core (engine_core.py, rank 0 only) owns the
scheduler and the sampler; a worker owns the model shard and its KV pool.
Under tensor parallelism (--tensor-parallel-size) every rank is a Worker;
rank 0's is also the EngineCore, the others run engine/follower.py's loop.
The phases run in the same order on every rank, since the model's forward
(KV calibration, the activation profile) is collective.
"""
import logging
import time
from collections import Counter

import torch

from engine import sleep_mode
from engine.cuda_graph import DecodeGraphs, why_not_capturable
from engine.engine_args import EngineArgs
from engine.kv_calibration import calibrate, set_key_means
from kvcache.kv_formats import KVPolicy
from kvcache.pool_plan import (allocate_kv_caches, cache_objects, device_kv_budget, kv_budget, kv_dtype,
                               plan_kv_pool)
from model_zoo.models import build_model, create_model, resident_bytes
from model_zoo.resolve import open_model
from parallel import distributed
from parallel.quant.gguf import QTYPES
from parallel.state import assume_tp

log = logging.getLogger("tqserve.engine")


# --quantization values that keep the checkpoint's own format resident, and the formats each takes.
STORED = {"gguf": tuple(QTYPES), "fp8": ("fp8", "mxfp4")}


def stored_weights(source, quantization: str | None) -> dict[str, str]:
    """{checkpoint tensor: format} that stay in their stored format."""
    if quantization not in STORED:
        return {}
    fmts = STORED[quantization]
    kept = {n: f for n, f in source.stored.items() if f in fmts}
    if not kept:
        raise ValueError(f"quantization {quantization} keeps the checkpoint's {' / '.join(fmts)} weights as "
                         f"stored; {source.path} has none")
    return kept


class Worker:
    """Startup in phases (vLLM's EngineCore shape): join the other ranks,
    load the model (this rank's shard) onto the device, set up the KV caches
    (calibrate, measure the budget, plan, allocate), capture CUDA graphs of
    decode steps."""

    def __init__(self, args: EngineArgs, source=None, rank: int = 0, start_local_ranks: bool = True):
        args.validate()
        self.source = source or open_model(args.model, weights=args.load_format != "dummy", tokenizer=args.tokenizer,
                                            mmproj=args.mmproj)
        if args.hf_overrides:
            self.source.config.update(args.hf_overrides)
        self.args = args = args.resolved(self.source.stored, self.source.stored_splits)
        if args.auto_reasons and rank == 0:
            log.info("auto settings: %s", "; ".join(f"{k} {getattr(args, k) or 'none'} ({why})"
                                                    for k, why in args.auto_reasons.items()))
        self.rank = rank
        self.local_followers = []     # processes of this node's other ranks, when this one started them
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        torch.manual_seed(args.seed)
        self.t0 = time.monotonic()
        self.device = torch.device(args.device)
        self.spec = args.speculative()
        self._init_distributed(start_local_ranks)
        self.model = self._load_model()
        self.draft = self._load_draft()
        self.lora = self._init_lora()
        self.caches = self._init_kv_caches()
        self._init_graphs()
        self.asleep: sleep_mode.Asleep | None = None      # what sleep() gave back (None: awake)

    @property
    def tp(self) -> int:
        return self.args.tensor_parallel_size

    # -- startup phases ---------------------------------------------------------
    def _init_distributed(self, start_local_ranks: bool) -> None:
        if self.tp == 1:
            return
        # Shapes that do not shard (heads, quantized blocks) fail here, on every
        # rank, before any rank waits.
        with assume_tp(self.tp), torch.device("meta"):
            model = build_model(self.source.config)
            stored = stored_weights(self.source, self.args.quantization)
            if stored:
                model.use_stored(stored)
        if self.rank == 0 and start_local_ranks:
            # One node's other ranks; a served engine core is a daemon process,
            # which may not have children: its client starts them instead.
            from engine.follower import start_local_ranks as start
            self.local_followers = start(self.args, self.args.topology().node_ranks[1:])
        distributed.init_distributed(self.args.topology(), self.rank, self.device, self.args.distributed_timeout)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())

    def _load_model(self) -> torch.nn.Module:
        args = self.args
        dummy = args.load_format == "dummy"
        if self.device.type == "cuda":
            # What this process has yet to allocate: the baseline of the KV budget.
            torch.cuda.empty_cache()
            self._cuda_free_at_start = torch.cuda.mem_get_info(self.device)[0]
        dtype = getattr(torch, args.dtype)
        # int4 packing must see the checkpoint's fp32 values: build in fp32,
        # pack, then cast what stays dense.
        build_dtype = torch.float32 if args.quantization == "int4" else dtype
        blocks = stored_weights(self.source, args.quantization)
        model = create_model(self.source.config, build_dtype, self.device,
                             None if dummy else self.source.weights(stored=bool(blocks)), args.seed,
                             stored=blocks)
        if self.mtp_drafts:
            if not getattr(model, "has_mtp", False):
                raise ValueError("speculative method 'mtp' needs a model with an MTP head (DeepSeek-V4 with "
                                 "num_nextn_predict_layers > 0, Qwen3-Next / Qwen3.5 with mtp_num_hidden_layers 1)")
            if not dummy and not model.mtp_loaded:
                raise ValueError("speculative method 'mtp': the checkpoint has no MTP weights (mtp.*)")
        if args.quantization == "int4":
            linears = [m for m in model.modules() if hasattr(m, "pack_int4")]
            packed = sum(m.pack_int4(dtype) for m in linears)
            model.to(dtype)
            log.info("int4: %d of %d linear layers hold exact 4-bit groups and run packed", packed,
                     len(linears))
        self.resident_bytes = resident_bytes(model)
        log.info("weights: %.1f MiB resident on %s%s", self.resident_bytes / 2**20, self.device,
                 f" ({len(blocks)} weights in their stored format: {', '.join(sorted(set(blocks.values())))})"
                 if blocks else "")
        return model

    def _load_draft(self):
        """speculative_config's draft model (engine/draft_model.py), or None."""
        if self.spec is None or self.spec.method != "draft_model":
            return None     # (EngineArgs.validate refused one with tensor parallelism)
        from engine.draft_model import DraftModel
        src = open_model(self.spec.model)
        tok, mine = src.tokenizer, self.source.tokenizer
        probe = "Hello world, 123! The quick brown fox."
        if tok is not None and mine is not None and tok.encode(probe, add_special_tokens=False) != \
                mine.encode(probe, add_special_tokens=False):
            raise ValueError(f"speculative draft model {self.spec.model}: its tokenizer is not the target's "
                             f"(the drafts would be other tokens)")
        dtype = getattr(torch, self.args.dtype)
        fmts = STORED.get(self.args.quantization, ())
        blocks = {n: f for n, f in src.stored.items() if f in fmts}
        model = create_model(src.config, dtype, self.device, src.weights(stored=bool(blocks)), self.args.seed,
                             stored=blocks)
        draft = DraftModel(model, src.config, dtype, self.args.block_size, self.device)
        log.info("speculative draft model %s: %.1f MiB resident", self.spec.model, resident_bytes(model) / 2**20)
        return draft

    def _init_lora(self):
        """Adapter slots on every linear layer (before the KV budget, which they come out of)."""
        args = self.args
        if not args.enable_lora:
            return None
        from model_zoo.lora import ModelLoRA
        lora = ModelLoRA(self.model, args.max_loras, args.max_lora_rank, args.max_cpu_loras or args.max_loras,
                         getattr(torch, args.dtype), self.device)
        if self.rank == 0:
            log.info("LoRA: %d slots of rank up to %d on %d linear layers, %.1f MiB", args.max_loras,
                     args.max_lora_rank, len(lora.layers), lora.nbytes / 2**20)
        return lora

    def _init_kv_caches(self):
        """Calibrate compressed formats, size the pool from the budget, allocate it on the device."""
        args = self.args
        specs = self.model.kv_cache_spec()
        cdtype = kv_dtype(args.kv_cache_dtype, getattr(torch, args.dtype), args.kv_cache_dtype_k,
                          args.kv_cache_dtype_v, args.kv_protect_layers, args.kv_hot)
        cdtype, key_means = calibrate(self.model, self.source.tokenizer,
                                      int(self.source.config.get("vocab_size", 0)), specs, cdtype)
        budget = self._kv_budget()
        if self.draft is not None:
            budget = self._share_with_draft(specs, budget, cdtype)
        if self.tp > 1:
            # Every rank holds the same blocks (the scheduler's, on rank 0) in
            # the same formats: rank 0's bit split, the smallest budget.
            cdtype = distributed.agree(cdtype)
            budget = distributed.min_over_ranks(budget)
        model_len = int(self.source.config.get("max_position_embeddings") or 4096)
        self.plan = plan_kv_pool(specs, budget, args.block_size, cdtype,
                                 args.max_num_seqs, args.max_num_batched_tokens,
                                 max_model_len=args.max_model_len or model_len,
                                 max_rollback=args.max_rollback_tokens, mtp_specs=self._mtp_specs(),
                                 snapshots=args.enable_prefix_caching,
                                 snapshot_tokens=args.mamba_block_size)
        if self.tp > 1 and distributed.agree(list(self.plan.num_blocks)) != list(self.plan.num_blocks):
            raise RuntimeError(f"rank {self.rank} planned {list(self.plan.num_blocks)} KV blocks, rank 0 "
                               f"another number: the ranks' shards differ")
        caches = allocate_kv_caches(specs, self.plan, cdtype, self.device)
        if isinstance(cdtype, KVPolicy) and isinstance(caches, list):
            log.info("KV formats by layer: %s", cdtype.describe([s for s in specs if not s.per_seq],
                                                                 self.plan.layer_bytes_per_token))
        set_key_means(caches, key_means)
        names = Counter(n for c in cache_objects(caches) for n in c.attention_backends)
        log.info("attention (layers): %s", ", ".join(f"{n} x {k}" for n, k in names.items()))
        if args.max_model_len is not None:
            if args.max_model_len > self.plan.capacity_tokens:
                raise ValueError(f"max_model_len {args.max_model_len} exceeds the KV cache capacity of "
                                 f"{self.plan.capacity_tokens} tokens; raise kv_cache_memory")
            self.max_model_len = args.max_model_len
        else:
            self.max_model_len = min(model_len, self.plan.capacity_tokens)
        return caches

    def _share_with_draft(self, specs, budget: int, cdtype) -> int:
        """The draft model's KV share of the budget, allocated now (its bytes
        per token over both models': it holds as many tokens as the target's
        pool); returns the target's share."""
        args = self.args
        target = plan_kv_pool(specs, budget, args.block_size, cdtype, args.max_num_seqs,
                              args.max_num_batched_tokens).bytes_per_token
        d = self.draft.bytes_per_token
        share = int(budget * d / (target + d))
        self.draft.allocate(share)
        log.info("speculative draft model KV: %d blocks of %d tokens, %.1f MiB", self.draft.num_blocks,
                 args.block_size, share / 2**20)
        return budget - share

    def _init_graphs(self) -> None:
        capture = self.device.type == "cuda" and not self.args.enforce_eager
        self.graphs = self._capture_graphs() if capture else None
        self.head_graphs = self._capture_head_graphs() if self.graphs is not None else None

    def _capture_graphs(self, emulate: bool = False) -> DecodeGraphs | None:
        """One CUDA graph per padded decode batch size (engine/cuda_graph.py),
        and with speculative decoding one per size for verification steps,
        or None, said in one line, when this model's decode cannot be
        captured. emulate: the same static buffers and frozen metadata, with
        replay re-running the forward (tests, on CPU)."""
        why = why_not_capturable(self.caches)
        if why:
            log.info("CUDA graphs off: %s", why)
            return None
        args, t0 = self.args, time.monotonic()
        query_lens = (1,)
        if self.spec is not None:     # verification steps: 1 + k rows per sequence
            why = why_not_capturable(self.caches, 1 + self.spec.num_speculative_tokens)
            if why:
                log.info("CUDA graphs for verification steps off: %s", why)
            else:
                query_lens = (1, 1 + self.spec.num_speculative_tokens)
        graphs = DecodeGraphs(self.model, self.caches, self._graph_widths(), self.max_model_len, args.max_num_seqs,
                              self.device, emulate=emulate, query_lens=query_lens,
                              max_num_tokens=args.max_num_batched_tokens, streams=self.mtp_drafts,
                              lora=self.lora.ctx if self.lora is not None else None)
        used = torch.cuda.memory_allocated(self.device) if not emulate else 0
        try:
            graphs.capture()
        except Exception as e:   # stay correct and say so: eager steps still work
            log.warning("CUDA graphs off: capturing a decode step failed: %s: %s", type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "")
            graphs = None
        if self.tp > 1 and not distributed.min_over_ranks(int(graphs is not None)):
            graphs = None        # a padded plan needs every rank's graphs: all replay or none
        if graphs is None:
            return None
        log.info("CUDA graphs: decode batch sizes %s, rows per sequence %s, captured in %.1fs%s",
                 ",".join(map(str, graphs.sizes)), ",".join(map(str, graphs.query_lens)),
                 time.monotonic() - t0, "" if emulate else
                 f" ({(torch.cuda.memory_allocated(self.device) - used) / 2**20:.0f} MiB)")
        return graphs

    def _graph_widths(self) -> list[int]:
        """The widest block table of each group: one slot per sequence, or the
        blocks of max_model_len tokens (r tokens per row in a compressed-entry group)."""
        return [1 if g.per_seq else -(-(self.max_model_len // g.ratio) // self.args.block_size)
                for g in self.plan.groups]

    def _capture_head_graphs(self, emulate: bool = False) -> DecodeGraphs | None:
        """With MTP drafts of k > 1: the head's chained passes (one row per
        sequence, the previous pass's streams in) as CUDA graphs per padded
        batch size, or None (said in one line when a capture fails)."""
        if not self.mtp_drafts or self.spec.num_speculative_tokens < 2:
            return None
        graphs = DecodeGraphs(self.model, self.caches, self._graph_widths(), self.max_model_len,
                              self.args.max_num_seqs, self.device, emulate=emulate, head=True)
        try:
            graphs.capture()
        except Exception as e:
            log.warning("CUDA graphs of the MTP head off: capturing a chained pass failed: %s: %s",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return None
        log.info("CUDA graphs: the MTP head's chained passes, batch sizes %s", ",".join(map(str, graphs.sizes)))
        return graphs

    @property
    def mtp_drafts(self) -> bool:
        return self.spec is not None and self.spec.method == "mtp"

    def _mtp_specs(self):
        """The MTP head's cache, planned into the pool when it drafts."""
        return self.model.mtp_cache_spec() if self.mtp_drafts else None

    def _kv_budget(self) -> int:
        """Bytes for the KV pool: kv_cache_memory when given (a fraction: of the
        memory free now), else on CPU today's share of MemAvailable, on CUDA
        what gpu_memory_utilization leaves after weights and activations."""
        setting = self.args.kv_cache_memory
        if self.device.type != "cuda":
            return kv_budget(setting)
        if setting is not None:
            return kv_budget(setting, torch.cuda.mem_get_info(self.device)[0])
        peak = self._profile_activation_peak()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        non_kv = self._cuda_free_at_start - free
        util = self.args.gpu_memory_utilization
        budget = device_kv_budget(total, util, self._cuda_free_at_start, non_kv, peak)
        log.info("KV budget %.2f GiB = %g x %.2f GiB total - %.2f GiB weights and other allocations - "
                 "%.2f GiB activation peak (%d tokens)", budget / 2**30, util, total / 2**30, non_kv / 2**30,
                 peak / 2**30, self.args.max_num_batched_tokens)
        return budget

    @torch.inference_mode()
    def _profile_activation_peak(self) -> int:
        """Device bytes one step of max_num_batched_tokens tokens allocates on
        top of the weights: one sequence that long without a cache (the largest
        prefill chunk a step runs), logits for max_num_seqs rows and a sort of
        their probabilities (top-p sampling's largest temporary)."""
        n, dev = self.args.max_num_batched_tokens, self.device
        vocab = int(self.source.config.get("vocab_size", 0)) or 1
        ids = torch.arange(n, device=dev) % vocab
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        hidden = self.model(ids, torch.arange(n, device=dev), None)
        logits = self.model.compute_logits(hidden[-min(n, self.args.max_num_seqs):])
        torch.sort(torch.softmax(logits, dim=-1), dim=-1, descending=True)
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) - base


    # -- sleep mode (engine/sleep_mode.py) ---------------------------------------
    def sleep(self, level: int, runner) -> int:
        """Discard the KV pool and the captured graphs; level 1 moves the
        weights to host memory (on the CPU they are there and stay), level 2
        discards them. Returns the bytes given back. runner: the ModelRunner
        whose graphs go too."""
        pools = [c.pool_tensors() for c in cache_objects(self.caches)]
        kv = sleep_mode.storages(pools + ([self.draft.pool_tensors()] if self.draft is not None else []))
        weights = sleep_mode.storages(self._models(), skip={s.data_ptr() for s in kv.values()})
        self.graphs = self.head_graphs = runner.graphs = runner.head_graphs = None
        runner.encoder_cache.clear()     # images' rows: device memory, cheap to encode again
        if level == 1 and self.device.type == "cpu":
            weights = {}
        host = {p: torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=True).copy_(sleep_mode.as_bytes(s))
                for p, s in weights.items()} if level == 1 else {}
        self.asleep = sleep_mode.Asleep(level, kv, sleep_mode.release(kv), weights, sleep_mode.release(weights),
                                        host)
        sleep_mode.give_back_memory(self.device)
        return self.asleep.freed_bytes

    def wake_up(self, tags: tuple[str, ...], runner) -> bool:
        """Take back what sleep gave ("weights", "kv_cache", or both): the
        weights from their host copies or the checkpoint, the KV pool zeroed;
        once both are back, the graphs are captured again. True: awake."""
        a = self.asleep
        if a is None:
            return True
        if "weights" in tags and a.weight_sizes:
            if a.level == 1:
                for path, s in a.weights.items():
                    s.resize_(a.weight_sizes[path])
                    sleep_mode.as_bytes(s).copy_(a.host.pop(path))
            else:
                self._reload_weights(a)
            a.weights, a.weight_sizes = {}, {}
        if "kv_cache" in tags and a.kv_sizes:
            for path, s in a.kv.items():
                s.resize_(a.kv_sizes[path])
                sleep_mode.as_bytes(s).zero_()
            a.kv, a.kv_sizes = {}, {}
        if a.weight_sizes or a.kv_sizes:
            return False
        self.asleep = None
        self._init_graphs()
        runner.graphs, runner.head_graphs = self.graphs, self.head_graphs
        return True

    def _models(self) -> list[torch.nn.Module]:
        """The target model and a speculative draft model (sleep mode walks both)."""
        return [self.model] + ([self.draft.model] if self.draft is not None else [])

    def _reload_weights(self, a: sleep_mode.Asleep) -> None:
        """Level 2: the model loaded again (as at startup), its tensors copied
        into the discarded ones by attribute path, each freed as it is
        copied (at most the weights plus one tensor at a time); what no
        checkpoint holds (LoRA slots) comes back zero, its slots empty."""
        fresh = sleep_mode.storages([self._load_model()] + ([self._load_draft().model] if self.draft else []))
        for path, s in a.weights.items():
            n = a.weight_sizes[path]
            s.resize_(n)
            f = fresh.pop(path, None)
            if f is not None and f.nbytes() == n:
                sleep_mode.as_bytes(s).copy_(sleep_mode.as_bytes(f))
                sleep_mode.release({path: f})
            else:
                sleep_mode.as_bytes(s).zero_()
        del fresh
        sleep_mode.give_back_memory(self.device)
        if self.lora is not None:
            self.lora.slots = [None] * len(self.lora.slots)
