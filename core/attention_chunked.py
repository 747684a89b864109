"""Memory-bounded exact attention in pure PyTorch: online softmax over query and key chunks.

The ``chunked`` backend of :func:`core.attention.attention`. It never materialises the ``(S_q, S_k)`` score
matrix: for each block of ``q_chunk_size`` queries it walks the keys ``k_chunk_size`` at a time, keeping the
running row maximum ``m``, the running denominator ``l`` and the unnormalised output (FlashAttention's
online softmax). Peak extra memory is one score block, ``B · H_q · q_chunk · k_chunk`` floats, plus
``O(S · D)`` for inputs, outputs and gradients, so any sequence length runs on a CPU.

Autograd recomputes the scores chunk by chunk (FlashAttention-2 backward): the forward saves only
``q, k, v, out`` and the row log-sum-exp ``L``; the backward rebuilds ``P = exp(S - L)`` block by block and
uses ``dS = P ∘ (dP - rowsum(dO ∘ O))``, so training memory is bounded the same way.

Layout and mask semantics are those of :mod:`core.attention`. Grouped-query heads are handled without
repeating keys/values: the ``G = H_q / H_kv`` query heads sharing a key/value head are stacked along the
row axis of one matmul. Key chunks that causality hides from every query of a block are skipped.
Computation runs in ``float32`` (or ``float64`` for double inputs); the output is cast back to ``q``'s dtype.

Two block engines, same chunking and results:
    fused (CPU tensors with ``D_v = D``, the default there): each block is one call of PyTorch's fused CPU
        attention kernel, which returns the block's output and log-sum-exp; blocks are merged by their
        log-sum-exp. The backward calls the fused backward kernel per block with the *global* output and
        log-sum-exp of the rows, which yields exact partial gradients. Causal blocks whose diagonal starts
        at their top-left corner use the kernel's own causal mode; other masks go in as an additive block.
    plain (every other case, and the bias gradient): scores ``q kᵀ`` per block, running max and denominator,
        ``exp`` in place, FlashAttention-2 backward as above.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

__all__ = [
    "chunked_attention",
    "default_chunks",
    "default_q_chunk",
    "fused_block_ops",
    "DEFAULT_Q_CHUNK",
    "DEFAULT_K_CHUNK",
    "MAX_BLOCK_ELEMENTS",
]

#: Default number of keys per chunk.
DEFAULT_K_CHUNK = 1024
#: Default (largest) number of queries per chunk; lowered for large ``B · H_q`` (see ``MAX_BLOCK_ELEMENTS``).
DEFAULT_Q_CHUNK = 1024
#: With the default query chunk, one score block holds at most this many elements (64 MiB in fp32).
MAX_BLOCK_ELEMENTS = 1 << 24


def default_chunks(batch_heads: int) -> int:
    """Square chunk size (power of two, 64..1024) whose ``(B·H_q, c, c)`` score block fits ``MAX_BLOCK_ELEMENTS``;
    equal query and key chunks keep causal diagonal blocks aligned."""
    c = DEFAULT_K_CHUNK
    while c > 64 and batch_heads * c * c > MAX_BLOCK_ELEMENTS:
        c //= 2
    return c


def default_q_chunk(batch_heads: int, k_chunk: int) -> int:
    """Query rows per chunk so that one ``(B·H_q, q_chunk, k_chunk)`` block fits ``MAX_BLOCK_ELEMENTS``."""
    return int(max(16, min(DEFAULT_Q_CHUNK, MAX_BLOCK_ELEMENTS // max(1, batch_heads * k_chunk))))


@functools.lru_cache(maxsize=1)
def fused_block_ops():
    """PyTorch's fused CPU attention forward/backward ops (they return/take the row log-sum-exp), or None.

    They are ATen internals behind ``scaled_dot_product_attention`` on CPU; when a PyTorch build lacks them
    the chunked backend uses its plain block math instead.
    """
    try:
        aten = torch.ops.aten
        fwd = aten._scaled_dot_product_flash_attention_for_cpu
        bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward
        return fwd, bwd
    except (AttributeError, RuntimeError):
        return None


def _bias_4d(bias: torch.Tensor) -> torch.Tensor:
    """View a bias broadcastable to ``(B, H, S_q, S_k)`` as a 4-d tensor (leading size-1 dims added)."""
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    return bias


class _Blocks:
    """Shared geometry of forward and backward: chunk ranges, masks and bias slices.

    Score blocks have shape ``(B, H_kv, G · n_q, n_k)``; row ``g · n_q + r`` is query ``i0 + r`` of query
    head ``h_kv · G + g``. ``block5`` views them as ``(B, H_kv, G, n_q, n_k)`` for masks and bias.
    """

    def __init__(self, q, k, v, key_padding_mask, bias4, scale, causal, q_chunk, k_chunk, window=None, softcap=None):
        self.B, self.Hq, self.Sq, self.D = q.shape
        self.Hkv, self.Sk, self.Dv = k.shape[1], k.shape[2], v.shape[3]
        self.G = self.Hq // self.Hkv
        self.offset = self.Sk - self.Sq  # causal: query i sees key j iff j <= i + offset
        self.kpm = key_padding_mask
        self.bias4 = bias4
        self.scale = scale
        self.causal = causal
        self.window = window  # causal only: query i sees keys i + offset - window < j <= i + offset
        self.softcap = softcap  # scores become softcap * tanh(scores / softcap) before bias and masks
        self.qc = q_chunk
        self.kc = k_chunk
        self.cdtype = torch.promote_types(q.dtype, torch.float32)
        self.device = q.device
        self._k = k
        self._kT = None
        self._buf = None  # reused score block storage: fresh large tensors per block cost page faults

    @property
    def kT(self) -> torch.Tensor:
        """Keys transposed once, ``(B, H_kv, D, S_k)``: a key chunk is then a plain strided matmul operand."""
        if self._kT is None:
            self._kT = self._k.to(self.cdtype).transpose(-1, -2).contiguous()
        return self._kT

    def block_buffer(self, rows: int, cols: int) -> torch.Tensor:
        """A reusable ``(B, H_kv, rows, cols)`` block (contents undefined)."""
        size = self.B * self.Hkv * rows * cols
        if self._buf is None or self._buf.numel() < size:
            self._buf = torch.empty(max(size, self.B * self.Hq * self.qc * self.kc), dtype=self.cdtype,
                                    device=self.device)
        return self._buf[:size].view(self.B, self.Hkv, rows, cols)

    def q_ranges(self):
        for i0 in range(0, self.Sq, self.qc):
            yield i0, min(i0 + self.qc, self.Sq)

    def k_ranges(self, i0: int, i1: int):
        """Key chunks a query block ``[i0, i1)`` can see; chunks past the causal frontier are skipped."""
        end = self.Sk
        if self.causal:
            end = max(0, min(self.Sk, i1 + self.offset))  # last visible key of the last row is i1-1+offset
        start = 0
        if self.window is not None:  # first visible key of the first row is i0+offset-window+1
            start = max(0, i0 + self.offset - self.window + 1) // self.kc * self.kc
        for j0 in range(start, end, self.kc):
            yield j0, min(j0 + self.kc, end)

    def window_hides(self, i0: int, i1: int, j0: int, j1: int) -> bool:
        """Whether the sliding window hides some key of chunk ``[j0, j1)`` from some query of ``[i0, i1)``."""
        return self.window is not None and j0 <= i1 - 1 + self.offset - self.window

    def hidden_pairs(self, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor | None:
        """Bool ``(n_q, n_k)``: True where causality or the window hides key ``j`` from query ``i`` (None: none)."""
        causal_hides = self.causal and j1 - 1 > i0 + self.offset  # some key after some query's frontier
        window_hides = self.window_hides(i0, i1, j0, j1)
        if not (causal_hides or window_hides):
            return None
        qi = torch.arange(i0 + self.offset, i1 + self.offset, device=self.device)[:, None]
        kj = torch.arange(j0, j1, device=self.device)[None, :]
        hide = kj > qi
        if window_hides:
            hide = hide | (kj <= qi - self.window)
        return hide

    def rows(self, x: torch.Tensor, i0: int, i1: int, scale: float | None = None) -> torch.Tensor:
        """``(B, H_q, S, E)`` slice ``[i0, i1)`` as ``(B, H_kv, G·n, E)`` in the compute dtype."""
        n = i1 - i0
        x = x[:, :, i0:i1]
        if scale is not None:
            x = x * scale
        return x.to(self.cdtype).reshape(self.B, self.Hkv, self.G * n, x.shape[-1])  # (B, Hkv, G*n, E)

    def scores(self, q_rows: torch.Tensor, i0: int, i1: int, j0: int, j1: int, want_dtanh: bool = False):
        """Scaled, soft-capped, biased, masked scores ``(B, H_kv, G·n_q, n_k)`` for queries ``[i0,i1)``, keys
        ``[j0,j1)``, written into the reusable block buffer (valid until the next call). With ``want_dtanh``
        also ``1 - tanh²`` of the soft cap's argument (the cap's derivative; None without a cap)."""
        n, m = i1 - i0, j1 - j0
        s = self.block_buffer(self.G * n, m)
        torch.matmul(q_rows, self.kT[:, :, :, j0:j1], out=s)  # (B, Hkv, G*n, m); q_rows is pre-scaled
        dtanh = None
        if self.softcap is not None:
            s.div_(self.softcap).tanh_()
            if want_dtanh:
                dtanh = 1.0 - s * s
            s.mul_(self.softcap)
        s5 = s.view(self.B, self.Hkv, self.G, n, m)
        if self.bias4 is not None:
            s5.add_(self.bias_block(i0, i1, j0, j1))
        hide = self.hidden_pairs(i0, i1, j0, j1)
        if hide is not None:
            s5.masked_fill_(hide, float("-inf"))
        if self.kpm is not None:
            s5.masked_fill_(self.kpm[:, j0:j1].view(self.B, 1, 1, 1, m), float("-inf"))
        return (s, dtanh) if want_dtanh else s

    def additive_mask(self, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor | None:
        """Bias plus ``-inf`` for hidden pairs as one float block broadcastable to ``(B, H_kv, G·n, m)``,
        or None when nothing applies (the fused ops take masks in this form)."""
        n, m = i1 - i0, j1 - j0
        G = self.G
        mask = None
        if self.bias4 is not None:
            b5 = self.bias_block(i0, i1, j0, j1)  # (B|1, Hkv|1, G|1, n|1, m|1)
            if b5.shape[2] == 1 and b5.shape[3] == 1:
                mask = b5.flatten(2, 3)  # (B|1, Hkv|1, 1, m|1)
            else:
                mask = b5.expand(*b5.shape[:2], G, n, b5.shape[4]).reshape(*b5.shape[:2], G * n, b5.shape[4])
        hidden = self.hidden_pairs(i0, i1, j0, j1)
        if hidden is not None:
            hide = torch.zeros(n, m, dtype=self.cdtype, device=self.device).masked_fill_(hidden, float("-inf"))
            hide = hide.repeat(G, 1) if G > 1 else hide  # (G*n, m)
            mask = hide if mask is None else mask + hide
        if self.kpm is not None:
            pad = torch.zeros(self.B, 1, 1, m, dtype=self.cdtype, device=self.device)
            pad.masked_fill_(self.kpm[:, j0:j1].view(self.B, 1, 1, m), float("-inf"))
            mask = pad if mask is None else mask + pad
        if mask is not None:
            while mask.dim() < 4:
                mask = mask.unsqueeze(0)
        return mask

    def aligned_diagonal(self, i0: int, i1: int, j0: int, j1: int) -> bool:
        """Whether the block's only mask is causal with the diagonal at its top-left corner, i.e. exactly
        the fused kernel's own ``is_causal`` (which then skips the hidden half instead of masking it)."""
        return (
            self.causal
            and self.bias4 is None
            and self.kpm is None
            and not self.window_hides(i0, i1, j0, j1)
            and i0 + self.offset == j0
            and j1 - 1 > i0 + self.offset
        )

    def bias_block(self, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
        """The bias slice for the block, 5-d ``(B|1, H_kv|1, G|1, n_q|1, n_k|1)``, never expanded."""
        b = self.bias4
        if b.shape[2] != 1:
            b = b[:, :, i0:i1]
        if b.shape[3] != 1:
            b = b[:, :, :, j0:j1]
        b = b.to(self.cdtype)
        if b.shape[1] == 1:
            return b.unsqueeze(1)  # (B|1, 1, 1, n|1, m|1)
        return b.unflatten(1, (self.Hkv, self.G))  # (B|1, Hkv, G, n|1, m|1)


def _forward(blocks: _Blocks, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """Output ``(B, H_q, S_q, D_v)`` in ``q.dtype`` and row log-sum-exp ``(B, H_q, S_q)`` (``+inf`` where a
    row sees no key, so that ``exp(s - L) = 0`` there in the backward)."""
    bl = blocks
    B, Hkv, G = bl.B, bl.Hkv, bl.G
    out = torch.empty(B, bl.Hq, bl.Sq, bl.Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, bl.Hq, bl.Sq, dtype=bl.cdtype, device=q.device)
    out5 = out.view(B, Hkv, G, bl.Sq, bl.Dv)
    lse5 = lse.view(B, Hkv, G, bl.Sq)
    neg_inf = float("-inf")
    for i0, i1 in bl.q_ranges():
        n = i1 - i0
        q_rows = bl.rows(q, i0, i1, bl.scale)  # (B, Hkv, G*n, D)
        row_max = torch.full((B, Hkv, G * n, 1), neg_inf, dtype=bl.cdtype, device=q.device)
        denom = torch.zeros((B, Hkv, G * n, 1), dtype=bl.cdtype, device=q.device)
        acc = torch.zeros((B, Hkv, G * n, bl.Dv), dtype=bl.cdtype, device=q.device)
        for j0, j1 in bl.k_ranges(i0, i1):
            s = bl.scores(q_rows, i0, i1, j0, j1)  # (B, Hkv, G*n, m)
            new_max = torch.maximum(row_max, s.amax(dim=-1, keepdim=True))
            # A row with no visible key so far keeps max -inf; shift by 0 there so exp() gives 0, not NaN.
            shift = torch.where(new_max == neg_inf, 0.0, new_max)
            p = s.sub_(shift).exp_()  # in place: s is not needed any more
            correction = torch.exp(row_max - shift)  # (B, Hkv, G*n, 1)
            denom.mul_(correction).add_(p.sum(dim=-1, keepdim=True))
            acc.mul_(correction)
            acc.view(B * Hkv, G * n, bl.Dv).baddbmm_(
                p.view(B * Hkv, G * n, j1 - j0), v[:, :, j0:j1].to(bl.cdtype).reshape(B * Hkv, j1 - j0, bl.Dv)
            )
            row_max = new_max
        seen = denom > 0
        o = torch.where(seen, acc / torch.where(seen, denom, 1.0), 0.0)  # fully masked rows -> 0
        out5[:, :, :, i0:i1] = o.view(B, Hkv, G, n, bl.Dv).to(q.dtype)
        row_lse = torch.where(seen, row_max + torch.log(torch.where(seen, denom, 1.0)), float("inf"))
        lse5[:, :, :, i0:i1] = row_lse.view(B, Hkv, G, n)
    return out, lse


def _per_head(x: torch.Tensor, G: int, rows: int) -> torch.Tensor:
    """``(B, H_kv, G·rows, E)`` -> ``(B, H_q, rows, E)`` (same memory order, a view)."""
    return x.view(x.shape[0], x.shape[1] * G, rows, x.shape[-1])


def _kv_per_head(x: torch.Tensor, G: int) -> torch.Tensor:
    """A key/value chunk ``(B, H_kv, m, E)`` repeated for the ``G`` query heads of its group (block-sized)."""
    B, Hkv, m, E = x.shape
    return x if G == 1 else x.unsqueeze(2).expand(B, Hkv, G, m, E).reshape(B, Hkv * G, m, E)


def _fused_block(bl: _Blocks, fwd, q_rows, kc, vc, i0, i1, j0, j1):
    """One block by the fused forward kernel: output ``(B, H_kv, G·n, D_v)`` and its log-sum-exp
    ``(B, H_kv, G·n, 1)``, ``-inf`` on rows that see no key of the block."""
    n = i1 - i0
    k_b, v_b = kc[:, :, j0:j1], vc[:, :, j0:j1]
    if bl.aligned_diagonal(i0, i1, j0, j1):
        # is_causal is per head and top-left aligned: give the kernel (B, Hq, n, D) queries.
        o, lse = fwd(_per_head(q_rows, bl.G, n), _kv_per_head(k_b, bl.G), _kv_per_head(v_b, bl.G),
                     is_causal=True, scale=bl.scale)
        return o.reshape(q_rows.shape[:3] + (bl.Dv,)), lse.reshape(q_rows.shape[:3] + (1,))
    mask = bl.additive_mask(i0, i1, j0, j1)
    o, lse = fwd(q_rows, k_b, v_b, attn_mask=mask, scale=bl.scale)
    lse = lse.unsqueeze(-1)
    if mask is not None:  # the kernel reports L = 0 for a row that sees no key of the block
        lse = lse.masked_fill(mask.amax(dim=-1, keepdim=True) == float("-inf"), float("-inf"))
    return o, lse


def _forward_fused(blocks: _Blocks, q, k, v, ops) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`_forward`, each block computed by PyTorch's fused CPU kernel, blocks merged by their
    log-sum-exp: ``out = Σ_j exp(L_j - L) o_j`` with ``L = log Σ_j exp(L_j)``."""
    fwd, _ = ops
    bl = blocks
    B, Hkv, G, cd = bl.B, bl.Hkv, bl.G, bl.cdtype
    out = torch.empty(B, bl.Hq, bl.Sq, bl.Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, bl.Hq, bl.Sq, dtype=cd, device=q.device)
    out5 = out.view(B, Hkv, G, bl.Sq, bl.Dv)
    lse5 = lse.view(B, Hkv, G, bl.Sq)
    neg_inf = float("-inf")
    kc, vc = k.to(cd), v.to(cd)
    for i0, i1 in bl.q_ranges():
        n = i1 - i0
        q_rows = bl.rows(q, i0, i1)  # (B, Hkv, G*n, D), unscaled: the kernel scales
        run_max = denom = acc = None
        for j0, j1 in bl.k_ranges(i0, i1):
            o_j, lse_j = _fused_block(bl, fwd, q_rows, kc, vc, i0, i1, j0, j1)  # (B,Hkv,G*n,Dv), (B,Hkv,G*n,1)
            if acc is None:  # first key block: nothing to merge with
                run_max, acc = lse_j, o_j
                denom = torch.ones_like(lse_j)
                continue
            new_max = torch.maximum(run_max, lse_j)
            shift = torch.where(new_max == neg_inf, 0.0, new_max)
            correction, weight = torch.exp(run_max - shift), torch.exp(lse_j - shift)
            denom.mul_(correction).add_(weight)
            acc.mul_(correction).add_(o_j.mul_(weight))
            run_max = new_max
        if acc is None:  # causality hides every key from this query block
            out5[:, :, :, i0:i1] = 0
            lse5[:, :, :, i0:i1] = float("inf")
            continue
        # Rows that saw no key carry run_max = -inf and acc = 0; first-block rows have denom 1 but maybe -inf.
        denom = torch.where(run_max == neg_inf, 0.0, denom)
        seen = denom > 0
        o = torch.where(seen, acc / torch.where(seen, denom, 1.0), 0.0)  # fully masked rows -> 0
        out5[:, :, :, i0:i1] = o.view(B, Hkv, G, n, bl.Dv).to(q.dtype)
        row_lse = torch.where(seen, run_max + torch.log(torch.where(seen, denom, 1.0)), float("inf"))
        lse5[:, :, :, i0:i1] = row_lse.view(B, Hkv, G, n)
    return out, lse


def _backward_fused(blocks: _Blocks, q, k, v, out, lse, dout, ops):
    """As :func:`_backward` without the bias gradient, each block by PyTorch's fused CPU backward kernel,
    given the global output and log-sum-exp of the rows (so each block yields exact partial gradients)."""
    _, bwd = ops
    bl = blocks
    B, Hkv, G, cd = bl.B, bl.Hkv, bl.G, bl.cdtype
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=cd, device=q.device)
    dv = torch.zeros(v.shape, dtype=cd, device=q.device)
    dq5 = dq.view(B, Hkv, G, bl.Sq, bl.D)
    kc, vc = k.to(cd), v.to(cd)
    for i0, i1 in bl.q_ranges():
        n = i1 - i0
        q_rows = bl.rows(q, i0, i1)  # (B, Hkv, G*n, D)
        do_rows = bl.rows(dout, i0, i1)  # (B, Hkv, G*n, Dv)
        o_rows = bl.rows(out, i0, i1)
        lse_rows = lse[:, :, i0:i1].reshape(B, Hkv, G * n)  # +inf on rows that see no key: P = 0 there
        dq_rows = torch.zeros_like(q_rows)
        for j0, j1 in bl.k_ranges(i0, i1):
            k_b, v_b = kc[:, :, j0:j1], vc[:, :, j0:j1]
            if bl.aligned_diagonal(i0, i1, j0, j1):  # per-head layout for the kernel's own causal mask
                m = j1 - j0
                dq_j, dk_j, dv_j = bwd(
                    _per_head(do_rows, G, n), _per_head(q_rows, G, n), _kv_per_head(k_b, G), _kv_per_head(v_b, G),
                    _per_head(o_rows, G, n), lse_rows.view(B, Hkv * G, n), 0.0, True, scale=bl.scale,
                )
                dq_j = dq_j.reshape(q_rows.shape)
                dk_j = dk_j.reshape(B, Hkv, G, m, bl.D).sum(dim=2)
                dv_j = dv_j.reshape(B, Hkv, G, m, bl.Dv).sum(dim=2)
            else:
                dq_j, dk_j, dv_j = bwd(
                    do_rows, q_rows, k_b, v_b, o_rows, lse_rows, 0.0, False,
                    attn_mask=bl.additive_mask(i0, i1, j0, j1), scale=bl.scale,
                )
            dq_rows += dq_j
            dk[:, :, j0:j1] += dk_j
            dv[:, :, j0:j1] += dv_j
        dq5[:, :, :, i0:i1] = dq_rows.view(B, Hkv, G, n, bl.D).to(q.dtype)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _backward(blocks: _Blocks, q, k, v, out, lse, dout, need_dbias: bool):
    """Gradients ``dq, dk, dv`` (and ``d bias`` in the bias's broadcast shape) by block recomputation."""
    bl = blocks
    B, Hkv, G = bl.B, bl.Hkv, bl.G
    cd = bl.cdtype
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=cd, device=q.device)
    dv = torch.zeros(v.shape, dtype=cd, device=q.device)
    dbias4 = torch.zeros(bl.bias4.shape, dtype=cd, device=q.device) if need_dbias else None
    dq5 = dq.view(B, Hkv, G, bl.Sq, bl.D)
    for i0, i1 in bl.q_ranges():
        n = i1 - i0
        q_rows = bl.rows(q, i0, i1, bl.scale)  # (B, Hkv, G*n, D), scaled
        do_rows = bl.rows(dout, i0, i1)  # (B, Hkv, G*n, Dv)
        o_rows = bl.rows(out, i0, i1)
        delta = (do_rows * o_rows).sum(dim=-1, keepdim=True)  # rowsum(dO ∘ O): (B, Hkv, G*n, 1)
        lse_rows = lse[:, :, i0:i1].reshape(B, Hkv, G * n, 1)
        dq_rows = torch.zeros_like(q_rows)
        for j0, j1 in bl.k_ranges(i0, i1):
            m = j1 - j0
            k_cols = k[:, :, j0:j1].to(cd)  # (B, Hkv, m, D)
            v_cols = v[:, :, j0:j1].to(cd)  # (B, Hkv, m, Dv)
            s, dtanh = bl.scores(q_rows, i0, i1, j0, j1, want_dtanh=True)
            p = s.sub_(lse_rows).exp_()  # (B, Hkv, G*n, m)
            dv[:, :, j0:j1] += torch.matmul(p.transpose(-1, -2), do_rows)  # sums over the G heads
            dp = torch.matmul(do_rows, v_cols.transpose(-1, -2))  # (B, Hkv, G*n, m)
            ds = dp.sub_(delta).mul_(p)  # dS = P ∘ (dP − Δ)
            del p
            if dbias4 is not None:
                _accumulate_bias_grad(bl, dbias4, ds.view(B, Hkv, G, n, m), i0, i1, j0, j1)
            if dtanh is not None:  # through the soft cap: d(c·tanh(x/c))/dx = 1 - tanh²
                ds.mul_(dtanh)
            dq_rows += torch.matmul(ds, k_cols)
            dk[:, :, j0:j1] += torch.matmul(ds.transpose(-1, -2), q_rows)  # q_rows carries the scale
        dq5[:, :, :, i0:i1] = (dq_rows * bl.scale).view(B, Hkv, G, n, bl.D).to(q.dtype)
    return dq, dk.to(k.dtype), dv.to(v.dtype), dbias4


def _accumulate_bias_grad(bl: _Blocks, dbias4: torch.Tensor, ds5: torch.Tensor, i0, i1, j0, j1) -> None:
    """Add a block's ``dS`` (``(B, H_kv, G, n, m)``) into the bias gradient, summed over broadcast dims."""
    bB, bH, bQ, bK = dbias4.shape
    g = ds5.flatten(1, 2)  # (B, Hq, n, m)
    dims = [d for d, size in enumerate((bB, bH, bQ, bK)) if size == 1 and g.shape[d] != 1]
    if dims:
        g = g.sum(dim=dims, keepdim=True)
    rows = slice(i0, i1) if bQ != 1 else slice(0, 1)
    cols = slice(j0, j1) if bK != 1 else slice(0, 1)
    dbias4[:, :, rows, cols] += g


class _ChunkedAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_bias, key_padding_mask, causal, scale, q_chunk, k_chunk, fused, window, softcap):
        bias4 = _bias_4d(attn_bias) if attn_bias is not None else None
        blocks = _Blocks(q, k, v, key_padding_mask, bias4, scale, causal, q_chunk, k_chunk, window, softcap)
        ops = _ops_for(q, v, fused, softcap)
        out, lse = _forward_fused(blocks, q, k, v, ops) if ops is not None else _forward(blocks, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse, attn_bias, key_padding_mask)
        ctx.options = (causal, scale, q_chunk, k_chunk, fused, window, softcap)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, attn_bias, key_padding_mask = ctx.saved_tensors
        causal, scale, q_chunk, k_chunk, fused, window, softcap = ctx.options
        bias4 = _bias_4d(attn_bias) if attn_bias is not None else None
        blocks = _Blocks(q, k, v, key_padding_mask, bias4, scale, causal, q_chunk, k_chunk, window, softcap)
        need_dbias = attn_bias is not None and ctx.needs_input_grad[3]
        ops = None if need_dbias else _ops_for(q, v, fused, softcap)  # the fused backward gives no bias gradient
        dbias = None
        if ops is not None:
            dq, dk, dv = _backward_fused(blocks, q, k, v, out, lse, dout.contiguous(), ops)
        else:
            dq, dk, dv, dbias4 = _backward(blocks, q, k, v, out, lse, dout.contiguous(), need_dbias)
            dbias = dbias4.reshape(attn_bias.shape).to(attn_bias.dtype) if dbias4 is not None else None
        return dq, dk, dv, dbias, None, None, None, None, None, None, None, None


def _ops_for(q: torch.Tensor, v: torch.Tensor, fused: bool | None, softcap: float | None = None):
    """The fused CPU ops when allowed (``fused`` not False) and applicable (CPU tensors, value head dim equal
    to the query head dim, no soft cap: the kernel cannot apply one), else None."""
    if fused is False or q.device.type != "cpu" or v.shape[-1] != q.shape[-1]:
        return None
    if softcap is not None:
        if fused:
            raise ValueError("fused=True cannot apply a softcap (PyTorch's fused kernel has none); use fused=None")
        return None
    ops = fused_block_ops()
    if ops is None and fused:
        raise ValueError("fused=True needs PyTorch's fused CPU attention ops, which this PyTorch build lacks")
    return ops


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    attn_bias: torch.Tensor | None,
    scale: float,
    q_chunk_size: int | None = None,
    k_chunk_size: int | None = None,
    fused: bool | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Exact attention on already validated inputs (see :func:`core.attention.prepare_inputs`).

    Args:
        q: ``(B, H_q, S_q, D)``; k: ``(B, H_kv, S_k, D)``; v: ``(B, H_kv, S_k, D_v)``.
        causal: bottom-right aligned causal mask.
        key_padding_mask: bool ``(B, S_k)``, True = padded key, or None.
        attn_bias: additive bias broadcastable to ``(B, H_q, S_q, S_k)``, sliced per block (never expanded);
            receives a gradient when it requires one.
        scale: score scale.
        q_chunk_size: queries per chunk. Both sizes unset: ``default_chunks(B·H_q)`` for both (1024 unless
            ``B·H_q`` is large); only ``k_chunk_size`` set: ``default_q_chunk(B·H_q, k_chunk_size)``.
        k_chunk_size: keys per chunk; 1024 when only ``q_chunk_size`` is set.
        fused: on CPU, compute each block with PyTorch's fused attention kernel (None: when available;
            False: plain PyTorch block math, the path used on other devices). The bias gradient always
            uses the plain block math.
        window: with ``causal``, each query sees only its ``window`` latest keys (itself included); key chunks
            wholly outside every query's window are skipped.
        softcap: scores become ``softcap · tanh(scores / softcap)`` before bias and masks (Gemma 2); uses the
            plain block math.

    Returns:
        ``(B, H_q, S_q, D_v)`` in ``q.dtype``; rows that see no key are zeros.
    """
    batch_heads = q.shape[0] * q.shape[1]
    if q_chunk_size is None and k_chunk_size is None:
        q_chunk = k_chunk = default_chunks(batch_heads)
    else:
        k_chunk = DEFAULT_K_CHUNK if k_chunk_size is None else int(k_chunk_size)
        q_chunk = default_q_chunk(batch_heads, k_chunk) if q_chunk_size is None else int(q_chunk_size)
    if q_chunk < 1 or k_chunk < 1:
        raise ValueError(f"chunk sizes must be positive, got q_chunk_size={q_chunk}, k_chunk_size={k_chunk}")
    return _ChunkedAttentionFn.apply(
        q, k, v, attn_bias, key_padding_mask, causal, float(scale), q_chunk, k_chunk, fused, window, softcap
    )
