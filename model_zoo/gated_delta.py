"""The gated delta rule (Gated DeltaNet linear attention, Qwen3-Next /
Qwen3.5) and its causal depthwise convolution, in torch, fp32 as
transformers' reference computes them.

Per value head, with a state S [dk, dv], decay g_t <= 0 (log space) and
write strength beta_t in (0, 1), for each token:
    S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
with q, k L2-normalised and q scaled by dk^-0.5. `recurrent_step` does one
token for a batch of sequences (decode); `chunked` does a whole span of one
sequence in chunks of 64 (prefill): within a chunk the updates are solved at
once (a unit lower-triangular system, the WY / UT form), between chunks the
state carries. Both start from a given state, so a prompt prefilled in
pieces gives the state of one whole prefill. `span` is `chunked` that also
returns the states after each of a span's last few tokens (the checkpoints a
speculative step may roll back to): the head chunked, the tail one token at
a time.
"""
import torch
import torch.nn.functional as F

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, num_v_heads: int):
    """L2-normalised fp32 q (scaled) and k, each query/key head repeated over its value heads."""
    rep = num_v_heads // q.shape[-2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k


def recurrent_step(q, k, v, g, beta, state):
    """One token of B sequences: q/k [B, Hk, dk], v [B, Hv, dv], g/beta [B, Hv],
    state [B, Hv, dk, dv] fp32 (updated in place) -> o [B, Hv, dv] fp32."""
    q, k = _prepare(q, k, v.shape[-2])
    state.mul_(g.float().exp()[..., None, None])
    remembered = (state * k[..., None]).sum(-2)
    delta = (v.float() - remembered) * beta.float()[..., None]
    state.add_(k[..., None] * delta[..., None, :])
    return (state * q[..., None]).sum(-2)


def chunked(q, k, v, g, beta, state):
    """T tokens of one sequence: q/k [T, Hk, dk], v [T, Hv, dv], g/beta [T, Hv],
    state [Hv, dk, dv] fp32 -> (o [T, Hv, dv] fp32, the state after them)."""
    T, H, dv = v.shape
    q, k = _prepare(q, k, H)
    q, k, v = (x.transpose(0, 1) for x in (q, k, v.float()))       # [H, T, d]
    g, beta = g.float().t(), beta.float().t()                       # [H, T]
    pad = -T % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (T + pad) // CHUNK
    kb, vb = k * beta[..., None], v * beta[..., None]
    q, k, kb, vb = (x.reshape(H, n, CHUNK, -1) for x in (q, k, kb, vb))
    cum = g.reshape(H, n, CHUNK).cumsum(-1)                         # log decay since the chunk's start
    future = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(future, float("-inf")).exp()
    system = (kb @ k.transpose(-1, -2)) * decay                     # its strict lower part; unit diagonal
    intra = (q @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(u)
    s = state.float()
    for i in range(n):
        fresh = u[:, i] - w[:, i] @ s                               # what the state does not predict yet
        out[:, i] = q[:, i] @ s + intra[:, i] @ fresh
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ fresh
    return out.reshape(H, -1, dv)[:, :T].transpose(0, 1), s


def span(q, k, v, g, beta, state, keep: int = 1):
    """`chunked` over T tokens -> (o [T, Hv, dv] fp32, states [keep, Hv, dk, dv]:
    the state after each of the last keep tokens, 1 <= keep <= T)."""
    head = q.shape[0] - keep + 1
    out, s = chunked(q[:head], k[:head], v[:head], g[:head], beta[:head], state)
    outs, states = [out], [s]
    for t in range(head, q.shape[0]):
        s = s.clone()[None]
        outs.append(recurrent_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s))
        s = s[0]
        states.append(s)
    return torch.cat(outs), torch.stack(states)


def conv_span(x, weight, state, keep: int = 1):
    """Causal depthwise conv + SiLU over T new inputs of one sequence.
    x [T, C]; weight [C, K]; state [C, K-1] (the previous K-1 inputs; zeros
    at the start) -> (y [T, C], states [keep, C, K-1]: the state after each
    of the last keep inputs)."""
    full = torch.cat((state.to(x.dtype), x.t()), dim=1)            # [C, K-1+T]
    y = F.conv1d(full[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[0]
    windows = full.unfold(1, state.shape[1], 1)                    # [C, T+1, K-1]: after 0..T inputs
    return F.silu(y).t().to(x.dtype), windows[:, windows.shape[1] - keep:].transpose(0, 1)


def conv_step(x, weight, state):
    """One new input of B sequences: x [B, C], state [B, C, K-1] (updated in place) -> y [B, C]."""
    full = torch.cat((state.to(x.dtype), x[..., None]), dim=-1)    # [B, C, K]
    state.copy_(full[..., 1:])
    return F.silu((full.to(weight.dtype) * weight).sum(-1)).to(x.dtype)
