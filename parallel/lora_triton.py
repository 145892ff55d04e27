"""Triton kernels for a LoRA term per row, y[t] += (x[t] A[s_t]^T) B[s_t]^T,
each row with its own adapter slot s_t (-1: none), as punica's BGMV does.

They read the slots from a device tensor and take no host value that
changes between steps, so a CUDA graph captures them: decode steps with
adapters replay (parallel/lora.py's token mode). Two launches per layer:

- shrink: one program per (row, block of ranks) reduces K in BLOCK_K tiles
  of A against the row, fp32, into s [T, R] (fp32);
- expand: one program per (row, block of output features) reduces the
  ranks against B's tile and adds the result into y in y's dtype.

Rows whose slot is -1 (the base model, pads of a captured batch) load
nothing and leave y as it is. CUDA-core FMAs (no tl.dot): a row's product is
a GEMV, and ranks are small. Compiled for sm_90 and sm_121 without spills
(tests/test_lora.py reads ptxas's report); not timed on a GPU yet.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def lora_shrink_kernel(x_ptr, a_ptr, slot_ptr, s_ptr, K, R, stride_xt, stride_as, stride_ar, stride_st,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    slot = tl.load(slot_ptr + t).to(tl.int64)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    if slot >= 0:
        a_rows = a_ptr + slot * stride_as + offs_r[:, None].to(tl.int64) * stride_ar
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(x_ptr + t.to(tl.int64) * stride_xt + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            a = tl.load(a_rows + offs_k[None, :], mask=mask_r[:, None] & mask_k[None, :], other=0.0)
            acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(s_ptr + t.to(tl.int64) * stride_st + offs_r, acc, mask=mask_r)


@triton.jit
def lora_expand_kernel(s_ptr, b_ptr, slot_ptr, y_ptr, N, R, stride_st, stride_bs, stride_bn, stride_yt,
                       BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        b_rows = b_ptr + slot * stride_bs + offs_n[:, None].to(tl.int64) * stride_bn
        for r0 in range(0, R, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            mask_r = offs_r < R
            s = tl.load(s_ptr + t.to(tl.int64) * stride_st + offs_r, mask=mask_r, other=0.0)
            b = tl.load(b_rows + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0)
            acc += tl.sum(b.to(tl.float32) * s[None, :], axis=1)
        y_row = y_ptr + t.to(tl.int64) * stride_yt + offs_n
        y = tl.load(y_row, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(y_row, (y + acc).to(y_ptr.dtype.element_ty), mask=mask_n)


def tiles(R: int, K: int, N: int) -> dict:
    """(shrink BLOCK_R, BLOCK_K; expand BLOCK_N, BLOCK_R): the ranks in one
    or a few tiles of at most 64, K and N in tiles that fit the registers."""
    br = min(64, triton.next_power_of_2(R))
    return dict(shrink_r=br, shrink_k=min(128, triton.next_power_of_2(K)), expand_n=min(64, triton.next_power_of_2(N)),
                expand_r=br)


def add(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """y [T, N] += per row t with slots[t] >= 0: (x[t] a[slots[t]]^T) b[slots[t]]^T.
    x [T, K], a [S, R, K], b [S, N, R] (last dims contiguous), slots [T] int."""
    T, K = x.shape
    R, N = a.shape[1], y.shape[1]
    c = tiles(R, K, N)
    s = torch.empty(T, R, dtype=torch.float32, device=x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    lora_shrink_kernel[(T, triton.cdiv(R, c["shrink_r"]))](
        x, a, slots, s, K, R, x.stride(0), a.stride(0), a.stride(1), s.stride(0),
        BLOCK_R=c["shrink_r"], BLOCK_K=c["shrink_k"])
    lora_expand_kernel[(T, triton.cdiv(N, c["expand_n"]))](
        s, b, slots, y, N, R, s.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_N=c["expand_n"], BLOCK_R=c["expand_r"])
    return y
