"""Logits -> tokens for a batch of requests, each with its own parameters.

Everything runs on the logits' device, vectorised over the batch. The
per-request parameters are gathered on the host into a few numpy arrays that
go to the device in one copy (packed into one pinned buffer, non-blocking,
on CUDA; zero-copy views on CPU). Penalties, logit bias, min_tokens and bad
words bans and allowed_token_ids are scatters at flat (row * V + token)
positions; temperature, top-k, top-p and min-p are batched tensor ops.
Work a batch does not ask for is skipped:
a greedy batch without penalties or logprobs costs one argmax. Rows with a
grammar (structured outputs) get their token bitmask, filled on the host by
llguidance, in the same upload, and -inf at the forbidden tokens.

The step's one host sync is the transfer of the sampled tokens; the
logprobs, computed for all rows that want them in one batched op, travel in
the same transfer. sample_async stops before that sync (Sampled.result
waits), so the host can prepare the next step meanwhile.

Seeded requests draw their exponentials from their own generator on the
logits' device (Request.generator_for), one row each, so a seeded request
gives the same tokens alone or in any batch; unseeded rows draw from the
device's default generator, all in one call.

Speculative decoding verifies a request's k drafts with k + 1 rows, one per
position (DraftRow: the request as it would be with the drafts before that
row accepted, so penalties and min_tokens see them). A row with a draft d
keeps it with probability min(1, p(d) / q(d)) = p(d) (the proposers draft
deterministically: q is one-hot), else takes a sample of the residual
(p - q)+, which is p without d; greedy rows keep d when it is the argmax.
Either way a row's token equals its draft exactly when the draft is
accepted, so the caller reads acceptance off the tokens.
"""
import numpy as np
import torch

from engine.bad_words import banned_now
from engine.request import Request
from engine.structured_output import fill_bitmask


class _Upload:
    """Host arrays (int64 or float32, 1-D) sent to the device in one copy."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pack = device.type != "cpu"     # on CPU the arrays are used in place
        self.parts: list[np.ndarray] = []

    def add(self, a, dtype) -> int:
        self.parts.append(np.ascontiguousarray(a, dtype=dtype).reshape(-1))
        return len(self.parts) - 1

    def send(self) -> list[torch.Tensor]:
        if not self.parts:
            return []
        if not self.pack:
            return [torch.from_numpy(a) for a in self.parts]
        # One uint8 buffer: the int64 parts first (8-byte aligned), then float32.
        order = sorted(range(len(self.parts)), key=lambda i: self.parts[i].dtype != np.int64)
        offs, n = [0] * len(self.parts), 0
        for i in order:
            offs[i] = n
            n += self.parts[i].nbytes
        pin = self.device.type == "cuda"
        host = torch.empty(max(n, 8), dtype=torch.uint8, pin_memory=pin)
        hv = host.numpy()
        for i, a in enumerate(self.parts):
            hv[offs[i]:offs[i] + a.nbytes] = a.view(np.uint8)
        dev = host.to(self.device, non_blocking=pin)
        return [dev[o:o + a.nbytes].view(torch.int64 if a.dtype == np.int64 else torch.float32)
                for o, a in zip(offs, self.parts)]


class DraftRow:
    """A request as the sampler sees it at verification row j: its tokens
    followed by drafts[:j], counted as output."""
    __slots__ = ("req", "params", "drafts", "num_output_tokens")

    def __init__(self, req: Request, drafts: list[int]):
        self.req, self.params, self.drafts = req, req.params, drafts
        self.num_output_tokens = req.num_output_tokens + len(drafts)

    @property
    def output_array(self) -> np.ndarray:
        return np.concatenate([self.req.output_array, np.asarray(self.drafts, np.int64)])

    @property
    def grammar(self):
        """The request's grammar as it will be after the drafts (its mask)."""
        g = self.req.grammar
        return None if g is None else g.ahead(self.drafts)

    def __getattr__(self, name):          # prompt_distinct, eos / stop ids, generator_for
        return getattr(self.req, name)


def _flat(rows: list[int], ids: list[np.ndarray], V: int) -> np.ndarray:
    """row * V + id for each id of each row, filled row by row (np.repeat
    with per-row counts costs ~3x more at 64 rows of 6K ids)."""
    out = np.empty(sum(len(a) for a in ids), np.int64)
    a = 0
    for r, x in zip(rows, ids):
        np.add(x, r * V, out=out[a:a + len(x)])
        a += len(x)
    return out


def _per_row(rows: list[int], vals, B: int, fill, dtype) -> np.ndarray:
    """[B] with vals at rows, fill elsewhere."""
    out = np.full(B, fill, dtype)
    out[rows] = vals
    return out


def _plan_penalties(reqs: list[Request], V: int, up: _Upload) -> dict | None:
    """Host side of the penalties: what each request asks for, as arrays
    added to `up`. None when no request asks for any. Per token only its
    flat position (row * V + id) travels; values go per row, read on the
    device at position // V."""
    rep_rows, rep_ids, rep_vals, cnt_rows, cnt_ids, cnt_fp, cnt_pp = [], [], [], [], [], [], []
    bias_rows, bias_ids, bias_vals, ban_rows, ban_ids, allow_rows, allow_ids = [], [], [], [], [], [], []
    for i, r in enumerate(reqs):
        p = r.params
        if p.repetition_penalty != 1.0:
            # The prompt's distinct ids, then the output's (a position listed twice is harmless).
            rep_rows += (i, i)
            rep_vals += (p.repetition_penalty,) * 2
            rep_ids += (r.prompt_distinct, r.output_array)
        if (p.frequency_penalty or p.presence_penalty) and r.num_output_tokens:
            cnt_rows.append(i)
            cnt_fp.append(p.frequency_penalty)
            cnt_pp.append(p.presence_penalty)
            cnt_ids.append(r.output_array)
        if p.logit_bias:
            n = len(p.logit_bias)
            bias_rows.append(i)
            bias_ids.append(np.clip(np.fromiter(p.logit_bias.keys(), np.int64, n), 0, V - 1))
            bias_vals.append(np.fromiter(p.logit_bias.values(), np.float32, n))
        banned = []
        if r.num_output_tokens + r.num_placeholders < p.min_tokens:     # tokens in flight count
            banned = [t for t in (r.eos_token_ids | r.stop_token_ids) if 0 <= t < V]
        if r.bad_words_ids:
            banned += [t for t in banned_now(r.bad_words_ids, r.output_array) if t < V]
        if banned:
            ban_rows.append(i)
            ban_ids.append(np.asarray(banned, np.int64))
        if r.allowed_ids is not None:
            allow_rows.append(i)
            allow_ids.append(r.allowed_ids)
    B, plan = len(reqs), {}
    if rep_rows:
        plan["rep"] = (up.add(_flat(rep_rows, rep_ids, V), np.int64),
                       up.add(_per_row(rep_rows, rep_vals, B, 1.0, np.float32), np.float32))
    if cnt_rows:
        # Counts go to a compact [len(cnt_rows), V] scratch: each row's place there.
        plan["cnt"] = (up.add(_flat(cnt_rows, cnt_ids, V), np.int64),
                       up.add(_per_row(cnt_rows, range(len(cnt_rows)), B, 0, np.int64), np.int64),
                       up.add(_per_row(cnt_rows, cnt_fp, B, 0.0, np.float32), np.float32),
                       up.add(_per_row(cnt_rows, cnt_pp, B, 0.0, np.float32), np.float32),
                       len(cnt_rows))
    if bias_rows:
        plan["bias"] = (up.add(_flat(bias_rows, bias_ids, V), np.int64),
                        up.add(np.concatenate(bias_vals), np.float32))
    if ban_rows:
        plan["ban"] = up.add(_flat(ban_rows, ban_ids, V), np.int64)
    if allow_rows:
        plan["allow"] = (up.add(allow_rows, np.int64), up.add(_flat(allow_rows, allow_ids, V), np.int64))
    return plan or None


def _apply_penalties(logits: torch.Tensor, plan: dict, t: list[torch.Tensor]) -> torch.Tensor:
    """Repetition (HF style, over prompt + output), frequency and presence
    (OpenAI style, over output) penalties, logit_bias, min_tokens bans of
    EOS / stop ids and bad words, then allowed_token_ids (every other token
    of the row -inf), each a gather / compute / scatter at the flat
    positions it touches (a position listed twice gets the same value
    twice). Returns new float32 logits."""
    B, V = logits.shape
    logits = torch.empty((B, V), dtype=torch.float32, device=logits.device).copy_(logits)
    flat = logits.view(-1)
    if "rep" in plan:
        pos, rp = (t[k] for k in plan["rep"])
        rp = rp.index_select(0, pos // V)
        sel = flat.index_select(0, pos)
        flat.index_copy_(0, pos, torch.where(sel > 0, sel / rp, sel * rp))
    if "cnt" in plan:
        pos, place, fp, pp = (t[k] for k in plan["cnt"][:4])
        row = pos // V
        cpos = place.index_select(0, row) * V + pos % V
        counts = torch.zeros(plan["cnt"][4] * V, dtype=torch.float32, device=logits.device)
        counts.index_add_(0, cpos, torch.ones(cpos.shape, dtype=torch.float32, device=logits.device))
        c = counts.index_select(0, cpos)
        sel = flat.index_select(0, pos)
        flat.index_copy_(0, pos, sel - (fp.index_select(0, row) * c + pp.index_select(0, row) * (c > 0).float()))
    if "bias" in plan:
        pos, vals = (t[k] for k in plan["bias"])
        flat.index_add_(0, pos, vals)
    if "ban" in plan:
        flat.index_fill_(0, t[plan["ban"]], float("-inf"))
    if "allow" in plan:         # last: an allowed token banned above stays banned
        rows, pos = (t[k] for k in plan["allow"])
        keep = flat.index_select(0, pos)
        logits.index_fill_(0, rows, float("-inf"))
        flat.index_copy_(0, pos, keep)
    return logits


def forbidden_host(mask: np.ndarray, V: int) -> torch.Tensor:
    """bool [R, V], True where a grammar forbids the token, from int32 bitmask
    rows (bit t of word t // 32 = token t allowed): numpy's unpackbits on the
    host, ~40x faster on CPU than torch's shift-and-mask."""
    bits = np.unpackbits((~mask).view(np.uint8), axis=1, bitorder="little")[:, :V]
    return torch.from_numpy(bits.view(np.bool_))


def forbidden_device(mask: torch.Tensor, V: int) -> torch.Tensor:
    """forbidden_host's result from the bitmask on the device (the mask
    travels packed: 32x fewer bytes than the bool matrix)."""
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    return ((mask.unsqueeze(-1) >> shifts) & 1).view(mask.shape[0], -1)[:, :V] == 0


def _apply_mask(work: torch.Tensor, rows: torch.Tensor, forbid: torch.Tensor) -> None:
    """-inf, in place, at the forbidden tokens of rows `rows` of work [B, V]."""
    if forbid.shape[0] == work.shape[0]:        # every row constrained: rows is 0..B-1
        work.masked_fill_(forbid, float("-inf"))
        return
    work.index_copy_(0, rows, work.index_select(0, rows).masked_fill_(forbid, float("-inf")))


def _filter(logits: torch.Tensor, tt: dict) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on float32 logits of the rows that
    sample; returns probabilities. tt: the uploaded per-row parameters."""
    logits = logits / tt["temp"][:, None]
    if "top_k" in tt:
        km1 = tt["top_k"]                      # k - 1 per row; -1 = off
        kth = torch.topk(logits, tt["kmax"], dim=-1).values.gather(1, km1.clamp(min=0)[:, None])
        kth = kth.masked_fill(km1[:, None] < 0, float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if "top_p" in tt:
        sp, si = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token
        # always); rows with top_p = 1 have an unreachable threshold (inf).
        drop = (sp.cumsum(-1) - sp) >= tt["top_p"][:, None]
        sp = sp.masked_fill(drop, 0)
        probs = torch.zeros_like(probs).scatter_(1, si, sp)
    if "min_p" in tt:
        thr = probs.max(dim=-1, keepdim=True).values * tt["min_p"][:, None]
        probs = probs.masked_fill(probs < thr, 0)
    return probs / probs.sum(-1, keepdim=True)


def residual(probs: torch.Tensor, drafts: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
    """(p - q)+ for one-hot drafts q: p with each drafted row's draft zeroed
    (unnormalised: the exponential race does not need it)."""
    return probs.scatter(1, drafts[:, None], torch.where(has[:, None], 0.0, probs.gather(1, drafts[:, None])))


class Sampled:
    """A batch's sampled tokens on the device (`tokens`) and their trip to
    the host, started when sampling ends (non-blocking into pinned memory on
    CUDA) and waited for by result(): until then the host is free, and the
    next step may read `tokens` on the device (asynchronous scheduling)."""

    def __init__(self, tokens: torch.Tensor, packed: torch.Tensor | None = None, want: list[int] = (),
                 ks: list[int] = (), kmax: int = 0):
        self.tokens, self.want, self.ks, self.kmax = tokens, list(want), list(ks), kmax
        self.packed = packed is not None        # _host_parts' float64 layout, tokens last
        src = packed if packed is not None else tokens
        self.event = None
        if src.device.type == "cuda":
            self.host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            self.host.copy_(src, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = src

    def result(self) -> tuple[list[int], list[dict | None]]:
        """(token per row, logprobs per row or None): the step's one host sync."""
        if self.event is not None:
            self.event.synchronize()
        B = len(self.tokens)
        if not self.packed:
            return self.host.tolist(), [None] * B
        host = self.host.tolist()
        out_tokens = [int(x) for x in host[-B:]]
        lps: list[dict | None] = [None] * B
        for i, d in zip(self.want, _lp_dicts(host, [out_tokens[i] for i in self.want], self.ks, self.kmax)):
            lps[i] = d
        return out_tokens, lps


def sample(logits: torch.Tensor, reqs: list, drafts: list[int] | None = None
           ) -> tuple[list[int], list[dict | None]]:
    """logits: [B, V] float32 or bf16 (raw model output, on any device) ->
    token per request and, where asked, logprobs {chosen: lp, top-k
    alternatives...} of the raw distribution (as vLLM reports by default).
    Penalties apply before the filters; greedy rows take the argmax of the
    penalised logits. drafts: per row the draft token it verifies, or -1
    (see the module docstring); reqs are Requests or DraftRows."""
    return sample_async(logits, reqs, drafts).result()


def sample_async(logits: torch.Tensor, reqs: list, drafts: list[int] | None = None) -> Sampled:
    """sample() up to the tokens on the device, their host copy under way."""
    B, V = logits.shape
    device = logits.device
    if B == 0:
        return Sampled(torch.empty(0, dtype=torch.long, device=device))
    params = [r.params for r in reqs]
    samp = [i for i, p in enumerate(params) if not p.greedy]
    want = [i for i, p in enumerate(params) if p.logprobs is not None]

    # Everything the host knows, in one upload.
    up = _Upload(device)
    plan = _plan_penalties(reqs, V, up)
    keys: dict[str, int] = {}
    kmax = 0
    if samp:
        sps = [params[i] for i in samp]
        if len(samp) < B:
            keys["rows"] = up.add(samp, np.int64)
        keys["temp"] = up.add([p.temperature for p in sps], np.float32)
        if any(p.top_k for p in sps):
            kmax = min(max(p.top_k for p in sps), V)
            keys["top_k"] = up.add([min(p.top_k, V) - 1 if p.top_k > 0 else -1 for p in sps], np.int64)
        if any(p.top_p < 1 for p in sps):
            keys["top_p"] = up.add([p.top_p if p.top_p < 1 else np.inf for p in sps], np.float32)
        if any(p.min_p > 0 for p in sps):
            keys["min_p"] = up.add([p.min_p for p in sps], np.float32)
        if drafts is not None and any(drafts[i] >= 0 for i in samp):
            keys["draft"] = up.add([drafts[i] for i in samp], np.int64)
    if want and len(want) < B:
        keys["want"] = up.add(want, np.int64)
    allowed = fill_bitmask(reqs)           # host work, overlapping the device's forward
    if allowed is not None:
        keys["mask_rows"] = up.add(allowed[0], np.int64)
        if up.pack:
            # int32 mask words travel as int64 pairs (rows are an even count of words).
            keys["mask"] = up.add(allowed[1].view(np.int64), np.int64)
    t = up.send()
    tt = {k: t[v] for k, v in keys.items()}
    tt["kmax"] = kmax

    work = logits if plan is None else _apply_penalties(logits, plan, t)
    if allowed is not None:
        if work is logits:
            work = logits.to(torch.float32, copy=True)   # raw logits stay for logprobs
        forbid = (forbidden_device(tt["mask"].view(torch.int32).view(len(allowed[0]), -1), V) if up.pack
                  else forbidden_host(allowed[1], V))
        _apply_mask(work, tt["mask_rows"], forbid)
    if len(samp) < B:
        tokens = work.argmax(dim=-1)
    if samp:
        sub = work if "rows" not in tt else work.index_select(0, tt["rows"])
        probs = _filter(sub if sub.dtype == torch.float32 else sub.float(), tt)
        # Exponential race (Gumbel-max on probabilities): a per-request
        # generator makes seeded requests repeatable in any batch.
        q = torch.empty_like(probs)
        gens = [reqs[i].generator_for(device) for i in samp]
        if any(g is None for g in gens):
            q.exponential_()                   # unseeded rows: one draw for all
        for j, g in enumerate(gens):
            if g is not None:
                q[j].exponential_(generator=g)
        if "draft" in tt:
            d = tt["draft"]
            has = d >= 0
            d = d.clamp(min=0)
            u = torch.rand(len(samp), device=device)
            for j, g in enumerate(gens):
                if g is not None:
                    u[j] = torch.rand((), generator=g, device=device)
            accept = has & (u < probs.gather(1, d[:, None]).squeeze(1))
            drawn = torch.where(accept, d, (residual(probs, d, has) / q).argmax(dim=-1))
        else:
            drawn = (probs / q).argmax(dim=-1)
        if "rows" in tt:
            tokens.index_copy_(0, tt["rows"], drawn)
        else:
            tokens = drawn

    if not want:
        return Sampled(tokens)
    rows = tt.get("want")
    raw = logits if rows is None else logits.index_select(0, rows)
    wtok = tokens if rows is None else tokens.index_select(0, rows)
    ks = [params[i].logprobs for i in want]
    logp = torch.log_softmax(raw.float(), dim=-1)
    packed, kmax = _host_parts(logp, wtok, ks, tokens)   # the logprobs travel with the tokens
    return Sampled(tokens, packed, want, ks, kmax)


def _host_parts(logp: torch.Tensor, tokens: torch.Tensor, ks: list[int],
                extra: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """Chosen-token logprobs ([N]), top-kmax values and ids ([N, kmax]) of logp
    [N, V] at tokens ([N], on logp's device), then `extra`, packed for one
    transfer as float64 (which holds float32 values and token ids exactly)."""
    kmax = min(max(ks, default=0), logp.shape[1])
    parts = [logp.gather(1, tokens[:, None].long()).flatten().double()]
    if kmax:
        vals, ids = torch.topk(logp, kmax, dim=-1)
        parts += [vals.flatten().double(), ids.flatten().double()]
    if extra is not None:
        parts.append(extra.double())
    return torch.cat(parts), kmax


def _lp_dicts(host: list[float], tokens: list[int], ks: list[int], kmax: int) -> list[dict[int, float]]:
    """The dicts {token: lp, then top-k alternatives} from _host_parts' values (a list)."""
    N = len(tokens)
    vals, ids = host[N:N + N * kmax], host[N + N * kmax:N + 2 * N * kmax]
    res = []
    for j in range(N):
        d = {tokens[j]: host[j]}
        for c in range(j * kmax, j * kmax + min(ks[j], kmax)):
            d.setdefault(int(ids[c]), vals[c])
        res.append(d)
    return res


def token_logprobs(logp: torch.Tensor, token: int, k: int) -> dict[int, float]:
    """{token: lp} then the top-k alternatives, descending (logp: one row [V])."""
    return batch_token_logprobs(logp[None], [token], k)[0]


def batch_token_logprobs(logp: torch.Tensor, tokens: list[int], ks: int | list[int]) -> list[dict[int, float]]:
    """token_logprobs for each row of logp [N, V] (tokens: N ids; ks: one k
    or one per row), with one host transfer."""
    N = logp.shape[0]
    ks = [ks] * N if isinstance(ks, int) else list(ks)
    if N == 0:
        return []
    tok = torch.tensor(tokens, dtype=torch.long)
    if logp.device.type == "cuda":
        tok = tok.pin_memory().to(logp.device, non_blocking=True)
    else:
        tok = tok.to(logp.device)
    packed, kmax = _host_parts(logp, tok, ks)
    return _lp_dicts(packed.tolist(), list(tokens), ks, kmax)
