"""Block geometry of the ``chunked`` backend (:mod:`core.attention_chunked`): chunk ranges, which key chunks a query
chunk can see, and the masks and bias of one ``(query chunk, key chunk)`` block.

Score blocks have shape ``(B, H_kv, G · n_q, n_k)``; row ``g · n_q + r`` is query ``i0 + r`` of query head
``h_kv · G + g`` (the ``G = H_q / H_kv`` query heads sharing a key/value head are stacked along the row axis).
``block5`` views of them are ``(B, H_kv, G, n_q, n_k)`` for masks and bias.

Mask semantics are those of :mod:`core.attention`: query ``i`` sits at key position ``p = i + S_k - S_q``
(bottom-right aligned); ``causal`` hides keys ``j > p`` except those of the query's own group (group ids ``>= 0``); a
``window`` hides keys ``j <= p - window`` (and, without ``causal``, keys ``j >= p + window``); segment ids hide keys
of another segment; padded keys are hidden.
"""

from __future__ import annotations

import torch

__all__ = ["Blocks", "bias_4d", "per_head", "kv_per_head"]


def bias_4d(bias: torch.Tensor) -> torch.Tensor:
    """View a bias broadcastable to ``(B, H, S_q, S_k)`` as a 4-d tensor (leading size-1 dims added)."""
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    return bias


def per_head(x: torch.Tensor, G: int, rows: int) -> torch.Tensor:
    """``(B, H_kv, G·rows, E)`` -> ``(B, H_q, rows, E)`` (same memory order, a view)."""
    return x.view(x.shape[0], x.shape[1] * G, rows, x.shape[-1])


def kv_per_head(x: torch.Tensor, G: int) -> torch.Tensor:
    """A key/value chunk ``(B, H_kv, m, E)`` repeated for the ``G`` query heads of its group (block-sized)."""
    B, Hkv, m, E = x.shape
    return x if G == 1 else x.unsqueeze(2).expand(B, Hkv, G, m, E).reshape(B, Hkv * G, m, E)


class Blocks:
    """Shared geometry of forward and backward: chunk ranges, masks and bias slices (see module docs)."""

    def __init__(self, q, k, v, key_padding_mask, bias4, scale, causal, q_chunk, k_chunk, window=None, softcap=None,
                 q_segments=None, k_segments=None, q_groups=None, k_groups=None):  # fmt: skip
        self.B, self.Hq, self.Sq, self.D = q.shape
        self.Hkv, self.Sk, self.Dv = k.shape[1], k.shape[2], v.shape[3]
        self.G = self.Hq // self.Hkv
        self.offset = self.Sk - self.Sq  # query i sits at key position i + offset
        self.kpm = key_padding_mask
        self.bias4 = bias4
        self.scale = scale
        self.causal = causal
        self.window = window  # keys within distance < window of the query's position (causal: only the past)
        self.softcap = softcap  # scores become softcap * tanh(scores / softcap) before bias and masks
        self.qseg = q_segments  # (B, S_q) int or None
        self.kseg = k_segments  # (B, S_k) int or None
        self.qgrp = q_groups  # (B, S_q) int (-1: none) or None; only with causal
        self.kgrp = k_groups  # (B, S_k) int or None
        self._group_reach = None
        self.qc = q_chunk
        self.kc = k_chunk
        self.cdtype = torch.promote_types(q.dtype, torch.float32)
        self.device = q.device
        self._k = k
        self._kT = None
        self._buf = None  # reused score block storage: fresh large tensors per block cost page faults
        self._kseg_range = None

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
                                    device=self.device)  # fmt: skip
        return self._buf[:size].view(self.B, self.Hkv, rows, cols)

    def q_ranges(self):
        for i0 in range(0, self.Sq, self.qc):
            yield i0, min(i0 + self.qc, self.Sq)

    def _segments_disjoint(self, i0: int, i1: int, j0: int, j1: int) -> bool:
        """Whether no query of ``[i0, i1)`` shares a segment with any key of ``[j0, j1)``, in any batch row (tested
        on the segment ids' ranges per chunk: exact for the sorted ids of packed sequences, safe for any ids)."""
        if self.qseg is None:
            return False
        if self._kseg_range is None:  # per key chunk: (min, max) over batch rows and keys
            chunks = self.kseg.split(self.kc, dim=1)
            lo = torch.stack([c.amin() for c in chunks]).tolist()
            hi = torch.stack([c.amax() for c in chunks]).tolist()
            self._kseg_range = (lo, hi)
        if j0 % self.kc:  # a partial chunk (window start): no precomputed range
            return False
        qs = self.qseg[:, i0:i1]
        c = j0 // self.kc
        return self._kseg_range[1][c] < int(qs.min()) or self._kseg_range[0][c] > int(qs.max())

    def group_reach(self, i0: int, i1: int) -> int:
        """One past the last key any query of ``[i0, i1)`` sees through its group (0: none)."""
        if self._group_reach is None:  # per query: the last key index of its group, -1 without a group
            ids, inv = torch.unique(torch.cat([self.qgrp, self.kgrp], 1), return_inverse=True)
            q_inv, k_inv = inv[:, : self.Sq], inv[:, self.Sq :]
            last = torch.full((self.B, ids.numel()), -1, dtype=torch.long, device=self.device)
            pos = torch.arange(self.Sk, device=self.device).expand(self.B, -1)
            last.scatter_reduce_(1, k_inv, pos, reduce="amax")
            reach = last.gather(1, q_inv).masked_fill(self.qgrp < 0, -1)  # (B, S_q)
            self._group_reach = reach.amax(dim=0).tolist()
        return max(self._group_reach[i0:i1]) + 1

    def k_ranges(self, i0: int, i1: int):
        """Key chunks a query block ``[i0, i1)`` can see; chunks past the causal frontier (and every group's
        reach), outside every query's window or of other segments only are skipped."""
        end = self.Sk
        if self.causal:
            end = max(0, min(self.Sk, i1 + self.offset))  # last visible key of the last row is i1-1+offset
            if self.qgrp is not None:
                end = max(end, min(self.Sk, self.group_reach(i0, i1)))
        elif self.window is not None:  # symmetric window: last visible key of the last row is i1-1+offset+window-1
            end = max(0, min(self.Sk, i1 - 1 + self.offset + self.window))
        start = 0
        if self.window is not None:  # first visible key of the first row is i0+offset-window+1
            start = max(0, i0 + self.offset - self.window + 1) // self.kc * self.kc
        for j0 in range(start, end, self.kc):
            j1 = min(j0 + self.kc, end)
            if not self._segments_disjoint(i0, i1, j0, j1):
                yield j0, j1

    def window_hides(self, i0: int, i1: int, j0: int, j1: int) -> bool:
        """Whether the window hides some key of chunk ``[j0, j1)`` from some query of ``[i0, i1)``."""
        if self.window is None:
            return False
        past = j0 <= i1 - 1 + self.offset - self.window
        future = not self.causal and j1 - 1 >= i0 + self.offset + self.window
        return past or future

    def hidden_pairs(self, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor | None:
        """Bool ``(1|B, n_q, n_k)``: True where causality (less the query's group) or the window hides key ``j``
        from query ``i`` (None: nothing hidden)."""
        causal_hides = self.causal and j1 - 1 > i0 + self.offset  # some key after some query's frontier
        window_hides = self.window_hides(i0, i1, j0, j1)
        if not (causal_hides or window_hides):
            return None
        qi = torch.arange(i0 + self.offset, i1 + self.offset, device=self.device)[:, None]
        kj = torch.arange(j0, j1, device=self.device)[None, :]
        hide = (kj > qi)[None] if causal_hides else torch.zeros(1, i1 - i0, j1 - j0, dtype=torch.bool,
                                                                 device=self.device)  # fmt: skip
        if causal_hides and self.qgrp is not None:
            qg = self.qgrp[:, i0:i1, None]
            hide = hide & ~((qg == self.kgrp[:, None, j0:j1]) & (qg >= 0))  # (B, n, m)
        if window_hides:
            hide = hide | (kj <= qi - self.window)
            if not self.causal:
                hide = hide | (kj >= qi + self.window)
        return hide

    def segment_hides(self, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor | None:
        """Bool ``(B, n_q, n_k)``: True where query and key lie in different segments (None: no segment ids)."""
        if self.qseg is None:
            return None
        return self.qseg[:, i0:i1, None] != self.kseg[:, None, j0:j1]

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
            s5.masked_fill_(hide.view(hide.shape[0], 1, 1, n, m), float("-inf"))
        seg = self.segment_hides(i0, i1, j0, j1)
        if seg is not None:
            s5.masked_fill_(seg.view(self.B, 1, 1, n, m), float("-inf"))
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
        hidden = self.hidden_pairs(i0, i1, j0, j1)  # (1|B, n, m)
        if hidden is not None:
            hide = torch.zeros(hidden.shape, dtype=self.cdtype, device=self.device).masked_fill_(hidden, float("-inf"))
            hide = (hide.repeat(1, G, 1) if G > 1 else hide).unsqueeze(1)  # (1|B, 1, G*n, m)
            mask = hide if mask is None else mask + hide
        seg = self.segment_hides(i0, i1, j0, j1)
        if seg is not None:
            hide = torch.zeros(self.B, n, m, dtype=self.cdtype, device=self.device).masked_fill_(seg, float("-inf"))
            hide = (hide.repeat(1, G, 1) if G > 1 else hide).unsqueeze(1)  # (B, 1, G*n, m)
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
            and self.qseg is None
            and self.qgrp is None
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
