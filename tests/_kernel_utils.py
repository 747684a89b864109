"""Shared helpers of the Triton kernel tests (interpreter cases and GPU tests)."""

from __future__ import annotations

import math

import torch

from core.attention import attention
from core.blocksparse import block_index_to_mask


def nan_empty(shape, *, like, dtype=None):
    """Poisoned stand-in for the kernels' output allocator: unwritten elements stay NaN."""
    return torch.full(shape, float("nan"), device=like.device, dtype=dtype or like.dtype)


def inputs(B, Hq, Hkv, Sq, Sk, D, dtype, device="cpu", pad=False):
    q = torch.randn(B, Hq, Sq, D, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(B, Hkv, Sk, D, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(B, Hkv, Sk, D, dtype=dtype, device=device, requires_grad=True)
    kpm = None
    if pad:
        kpm = torch.rand(B, Sk, device=device) < 0.3
        kpm[0, :] = True  # a batch row with every key padded: its outputs must be zeros
    return q, k, v, kpm


def fwd_bwd(fn, q, k, v, do):
    """Output and (dq, dk, dv) of ``fn`` on leaf copies of q, k, v."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, do.to(out.dtype))
    return out.detach(), grads


def lowp_peer(q, k, v, *, causal, key_padding_mask, attn_bias=None):
    """Plain PyTorch attention computed in the inputs' low precision: PyTorch's own rounding error."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(Hq // Hkv, dim=1)
    v = v.repeat_interleave(Hq // Hkv, dim=1)
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(D))
    keep = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device)[None, None]
    if causal:
        keep = keep & (torch.arange(Sk, device=q.device)[None, :] <= torch.arange(Sq, device=q.device)[:, None] + Sk - Sq)
    if key_padding_mask is not None:
        keep = keep & ~key_padding_mask[:, None, None, :]
    if attn_bias is not None:
        s = s + attn_bias.to(s.dtype)
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.where(keep.any(-1, keepdim=True), p, torch.zeros_like(p))
    return p @ v


def assert_close_to_ref(got, ref, peer=None, *, what):
    """fp32: tight tolerance; low precision: within 3x PyTorch's own low-precision error (plus a floor)."""
    assert torch.isfinite(got).all(), f"{what}: non-finite values (an element was not written?)"
    err = (got.float() - ref.float()).abs().max().item()
    if peer is None:
        tol = 2e-4 * max(1.0, ref.abs().max().item())
    else:
        tol = 3 * (peer.float() - ref.float()).abs().max().item() + 2e-3
    assert err <= tol, f"{what}: max error {err:.3g} > tolerance {tol:.3g}"


def check_dense(fa, B, Hq, Hkv, Sq, Sk, D, causal, pad, dtype, device="cpu"):
    """``fa.flash_attention`` output and gradients against the fp32 reference (and the low-precision peer)."""
    q, k, v, kpm = inputs(B, Hq, Hkv, Sq, Sk, D, dtype, device=device, pad=pad)
    do = torch.randn(B, Hq, Sq, D, device=device)
    out, grads = fwd_bwd(lambda a, b, c: fa.flash_attention(a, b, c, causal=causal, key_padding_mask=kpm), q, k, v, do)
    ref, ref_grads = fwd_bwd(
        lambda a, b, c: attention(
            a.float(), b.float(), c.float(), causal=causal, key_padding_mask=kpm, backend="reference"
        ),
        q, k, v, do,
    )  # fmt: skip
    peer, peer_grads = (None, (None,) * 3)
    if dtype != torch.float32:
        peer, peer_grads = fwd_bwd(
            lambda a, b, c: lowp_peer(a, b, c, causal=causal, key_padding_mask=kpm), q, k, v, do
        )
    assert out.dtype == dtype and out.shape == (B, Hq, Sq, D)
    assert_close_to_ref(out, ref, peer, what="out")
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, peer_grads):
        assert g.dtype == dtype
        assert_close_to_ref(g, r, p, what=name)
    if kpm is not None:  # batch row 0 has every key padded
        assert (out[0] == 0).all() and (grads[0][0] == 0).all()


def all_blocks(B, H, nq, nk):
    return torch.arange(nk).expand(B, H, nq, nk).contiguous()


def random_blocks(B, H, nq, nk, k):
    """Random distinct ids per row, ascending, then -1 slots (some rows get fewer than k)."""
    scores = torch.rand(B, H, nq, nk)
    idx = scores.topk(k, dim=-1).indices
    drop = torch.rand(B, H, nq, k) < 0.25
    idx = torch.where(drop, nk, idx).sort(dim=-1).values
    return torch.where(idx >= nk, -1, idx)


def check_block_sparse(bs_mod, B, Hq, Hkv, Sq, Sk, D, block, causal, pad, dtype, index, device="cpu"):
    q, k, v, kpm = inputs(B, Hq, Hkv, Sq, Sk, D, dtype, device=device, pad=pad)
    nq, nk = math.ceil(Sq / block), math.ceil(Sk / block)
    block_index = all_blocks(B, Hq, nq, nk) if index == "all" else random_blocks(B, Hq, nq, nk, index)
    block_index = block_index.to(device)
    keep = block_index_to_mask(block_index, block_size=block, sq=Sq, sk=Sk)  # (B, Hq, Sq, Sk)
    bias = torch.zeros(keep.shape, device=device).masked_fill(~keep, float("-inf"))
    do = torch.randn(B, Hq, Sq, D, device=device)

    def kernel(a, b, c):
        return bs_mod.block_sparse_attention(a, b, c, block_index, block_size=block, causal=causal, key_padding_mask=kpm)

    def reference(a, b, c):
        return attention(
            a.float(), b.float(), c.float(), causal=causal, key_padding_mask=kpm, attn_bias=bias, backend="reference"
        )

    out, grads = fwd_bwd(kernel, q, k, v, do)
    ref, ref_grads = fwd_bwd(reference, q, k, v, do)
    peer, peer_grads = None, (None,) * 3
    if dtype != torch.float32:
        peer, peer_grads = fwd_bwd(
            lambda a, b, c: lowp_peer(a, b, c, causal=causal, key_padding_mask=kpm, attn_bias=bias), q, k, v, do
        )
    assert_close_to_ref(out, ref, peer, what="out")
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, peer_grads):
        assert_close_to_ref(g, r, p, what=name)


# ------------------------------------------------------------------------------ offsets past 2**31 elements

INT32_SPAN = 2**31


class FarBuffer:
    """Views whose batch entries lie more than 2**31 elements apart, in one buffer touched only where viewed.

    Each view has layout ``(B, H, S, D)`` with a batch stride of ``BATCH_STRIDE`` (just over 2**30 elements,
    so the stride itself is an int32 argument) and starts ``2**31`` elements into the buffer: with ``B = 3``
    the last batch entry lies ``2 * BATCH_STRIDE > 2**31`` elements from the view's start, so a kernel that
    computes ``b * stride`` in int32 wraps around to an address ~``2**32`` elements earlier, which is still
    inside this buffer (untouched, reading zeros) instead of outside it: the wrong result is a clean assertion
    failure, not a crash. The buffer is ``~2**32`` elements of virtual memory (8 GiB in fp16); only the
    viewed elements (a few KiB) are ever written or read, so almost none of it becomes resident.
    """

    BATCH_STRIDE = 2**30 + 2**20
    START = 2**31
    SLOT = 2**16  # elements reserved per view and batch entry

    def __init__(self, dtype: torch.dtype, slots: int = 8) -> None:
        self.slots, self.used = slots, 0
        numel = self.START + 2 * self.BATCH_STRIDE + slots * self.SLOT
        try:
            self.buf = torch.empty(numel, dtype=dtype)
        except RuntimeError as e:  # the OS refused the address space (strict overcommit)
            raise MemoryError(f"cannot reserve {numel * dtype.itemsize / 2**30:.1f} GiB of address space: {e}") from e

    def view(self, shape, *, fill: float | None = None, like: torch.Tensor | None = None) -> torch.Tensor:
        """A fresh ``(B <= 3, H, S, D)`` view in the next slot, filled with ``like``'s values or ``fill``."""
        B, H, S, D = shape
        if B > 3 or H * S * D > self.SLOT or self.used == self.slots:
            raise ValueError(f"FarBuffer holds {self.slots} views of B <= 3 and H*S*D <= {self.SLOT}, got {shape}")
        t = self.buf.as_strided(shape, (self.BATCH_STRIDE, S * D, D, 1), self.START + self.used * self.SLOT)
        self.used += 1
        if like is not None:
            t.copy_(like)
        elif fill is not None:
            t.fill_(fill)
        return t

    def last_batch_offset(self, t: torch.Tensor) -> int:
        """Elements from ``t``'s first element to its last batch entry's first element."""
        return (t.shape[0] - 1) * t.stride(0)


def check_dense_extras(fa, B, Hq, Hkv, Sq, Sk, D, dtype, *, causal, pad, window=None, softcap=None, sinks=None,
                       device="cpu"):
    """``fa.flash_attention`` with a window / soft cap / sinks against ``core``'s fp32 reference with the same
    arguments: output and gradients of q, k, v and the sinks (``sinks``: ``"head"`` ``(H_q,)`` or ``"row"``
    ``(B, H_q, S_q)``)."""
    q, k, v, kpm = inputs(B, Hq, Hkv, Sq, Sk, D, dtype, device=device, pad=pad)
    if softcap is not None:
        q = (q.detach() * 3).requires_grad_(True)  # large scores: the cap bites
    s = None
    if sinks is not None:
        s = torch.randn(Hq if sinks == "head" else (B, Hq, Sq), device=device).mul(2).requires_grad_(True)
    do = torch.randn(B, Hq, Sq, D, device=device)
    kw = dict(causal=causal, key_padding_mask=kpm, window=window, softcap=softcap)

    def run(fn, cast):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        sl = None if s is None else s.detach().clone().requires_grad_(True)
        out = fn(*(cast(t) for t in leaves), sl)
        grads = torch.autograd.grad(out, leaves + ([sl] if sl is not None else []), do.to(out.dtype))
        return out.detach(), grads

    out, grads = run(lambda a, b, c, sl: fa.flash_attention(a, b, c, sinks=sl, **kw), lambda t: t)
    ref, ref_grads = run(lambda a, b, c, sl: attention(a, b, c, sinks=sl, backend="reference", **kw),
                         lambda t: t.float())  # fmt: skip
    assert out.dtype == dtype and out.shape == (B, Hq, Sq, D)
    for name, g, r in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *grads), (ref, *ref_grads)):
        if dtype == torch.float32:
            assert_close_to_ref(g, r, what=name)
        else:  # fp16: P is rounded to fp16 before its dots (as in every flash kernel)
            err, tol = (g.float() - r.float()).abs().max().item(), 1e-2 * max(1.0, r.abs().max().item())
            assert torch.isfinite(g).all() and err <= tol, f"{name}: max error {err:.3g} > tolerance {tol:.3g}"
    return out
