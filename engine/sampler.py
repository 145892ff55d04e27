"""Logits -> tokens for a batch of requests, each with its own parameters."""
import torch

from engine.request import Request


def _penalties(logits: torch.Tensor, reqs: list[Request]) -> None:
    """Repetition (HF style, over prompt + output), frequency and presence
    (OpenAI style, over output) penalties and logit_bias, in place."""
    for i, r in enumerate(reqs):
        p = r.params
        if p.repetition_penalty != 1.0:
            ids = torch.tensor(sorted(set(r.token_ids)), dtype=torch.long)
            sel = logits[i, ids]
            logits[i, ids] = torch.where(sel > 0, sel / p.repetition_penalty, sel * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and r.num_output_tokens:
            out = torch.tensor(r.output_token_ids, dtype=torch.long)
            counts = torch.bincount(out, minlength=logits.shape[1]).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long)
            ids = ids.clamp(0, logits.shape[1] - 1)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
        if r.num_output_tokens < p.min_tokens:
            banned = list((r.eos_token_ids | r.stop_token_ids) & set(range(logits.shape[1])))
            if banned:
                logits[i, banned] = float("-inf")


def _filter(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p; returns probabilities."""
    temps = torch.tensor([r.params.temperature for r in reqs], dtype=logits.dtype)
    logits = logits / temps[:, None]
    top_k = [r.params.top_k for r in reqs]
    if any(top_k):
        ks = torch.tensor([k if k > 0 else logits.shape[1] for k in top_k])
        kth = torch.sort(logits, dim=-1, descending=True).values.gather(1, (ks - 1).clamp(max=logits.shape[1] - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    top_p = torch.tensor([r.params.top_p for r in reqs], dtype=probs.dtype)
    if (top_p < 1).any():
        sp, si = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always).
        drop = (sp.cumsum(-1) - sp) >= top_p[:, None]
        sp = sp.masked_fill(drop, 0)
        probs = torch.zeros_like(probs).scatter_(1, si, sp)
    min_p = torch.tensor([r.params.min_p for r in reqs], dtype=probs.dtype)
    if (min_p > 0).any():
        thr = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        probs = probs.masked_fill(probs < thr, 0)
    return probs / probs.sum(-1, keepdim=True)


def sample(logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[dict | None]]:
    """logits: [B, V] float32 (raw model output) -> token per request and,
    where asked, logprobs {chosen: lp, top-k alternatives...} of the raw
    distribution (as vLLM reports by default)."""
    raw = logits
    logits = logits.clone()
    _penalties(logits, reqs)
    greedy = torch.tensor([r.params.greedy for r in reqs])
    tokens = logits.argmax(dim=-1)
    if not greedy.all():
        idx = (~greedy).nonzero().flatten().tolist()
        sub = [reqs[i] for i in idx]
        probs = _filter(logits[idx], sub)
        # Exponential race (Gumbel-max on probabilities): a per-request
        # generator makes seeded requests repeatable in any batch.
        q = torch.empty_like(probs)
        for j, r in enumerate(sub):
            q[j].exponential_(generator=r.generator)
        tokens[idx] = (probs / q).argmax(dim=-1)
    out_tokens = tokens.tolist()
    lps: list[dict | None] = [None] * len(reqs)
    want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    if want:
        logp = torch.log_softmax(raw[want].float(), dim=-1)
        for j, i in enumerate(want):
            lps[i] = token_logprobs(logp[j], out_tokens[i], reqs[i].params.logprobs)
    return out_tokens, lps


def token_logprobs(logp: torch.Tensor, token: int, k: int) -> dict[int, float]:
    """{token: lp} then the top-k alternatives, descending."""
    d = {token: float(logp[token])}
    if k:
        vals, ids = torch.topk(logp, k)
        for v, t in zip(vals.tolist(), ids.tolist()):
            d.setdefault(t, v)
    return d
