"""Baseline slide models (multiple-instance learning) with the same interface as :class:`~pathology.querent.Querent`.

Every model maps ``(features (N, in_dim), coords (N, 2), patch_size_level0)`` to a :class:`MILOutput`.

- :class:`MeanMIL`: mean of the patch embeddings, then a head.
- :class:`ABMIL`: gated attention pooling (Ilse et al. 2018), O(N).
- :class:`TransMIL`: class token, two Nyström-attention layers with a PPEG positional module between
  them (Shao et al. 2021), O(N·landmarks).
- :class:`DenseMIL`: a transformer of the same depth and width as Querent with full self-attention
  (O(N²) compute), then the same gated pooling.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from core.attention import attention
from core.layers import MLP, MultiHeadAttention, SelfAttentionBlock
from pathology.querent import GatedAttentionPool, MILOutput, Querent, QuerentConfig, build_regions, sincos_2d

__all__ = ["MeanMIL", "ABMIL", "TransMIL", "DenseMIL", "NystromAttention", "build_model", "MODEL_NAMES"]

MODEL_NAMES = ("querent", "abmil", "transmil", "dense", "mean")


def _check(features_ND: torch.Tensor, in_dim: int) -> None:
    if features_ND.dim() != 2 or features_ND.shape[1] != in_dim:
        raise ValueError(f"features must be (N, {in_dim}), got {tuple(features_ND.shape)}")
    if features_ND.shape[0] == 0:
        raise ValueError("empty bag: the slide has no patches (no tissue found)")


class MeanMIL(nn.Module):
    def __init__(self, cfg: QuerentConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Sequential(nn.Linear(cfg.in_dim, cfg.dim), nn.GELU(), nn.Dropout(cfg.dropout))
        self.head = nn.Linear(cfg.dim, cfg.num_classes)

    def forward(self, features_ND, coords_N2=None, *, patch_size_level0=None, return_index=False) -> MILOutput:
        _check(features_ND, self.cfg.in_dim)
        h = self.embed(features_ND)
        n = h.shape[0]
        emb = h.mean(0, keepdim=True)
        return MILOutput(self.head(emb), torch.full((n,), 1.0 / n, device=h.device), emb)


class ABMIL(nn.Module):
    def __init__(self, cfg: QuerentConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Sequential(nn.Linear(cfg.in_dim, cfg.dim), nn.GELU(), nn.Dropout(cfg.dropout))
        self.pool = GatedAttentionPool(cfg.dim, cfg.pool_hidden, cfg.dropout)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)

    def forward(self, features_ND, coords_N2=None, *, patch_size_level0=None, return_index=False) -> MILOutput:
        _check(features_ND, self.cfg.in_dim)
        emb, a = self.pool(self.embed(features_ND))
        return MILOutput(self.head(emb), a, emb)


class NystromAttention(nn.Module):
    """Nyström self-attention with ``landmarks`` segment-mean landmarks.

    ``softmax(QKᵀ)V ≈ softmax(QK̃ᵀ) · pinv(softmax(Q̃K̃ᵀ)) · softmax(Q̃Kᵀ)V``. Both outer factors are
    attention calls through :func:`core.attention.attention`: ``softmax(Q̃Kᵀ)V = attention(Q̃, K, V)`` and
    ``softmax(QK̃ᵀ)·M = attention(Q, K̃, M)``; only the small ``m×m`` middle kernel is formed explicitly
    and inverted with the Newton–Schulz iteration. A depthwise convolution of V along the sequence is added
    as the residual term (as in the Nyströmformer).
    """

    def __init__(self, dim: int, num_heads: int, landmarks: int = 256, pinv_iters: int = 6, dropout: float = 0.0):
        super().__init__()
        self.mha = MultiHeadAttention(dim, num_heads, dropout=dropout)
        self.landmarks, self.pinv_iters = landmarks, pinv_iters
        self.res_conv = nn.Conv2d(num_heads, num_heads, (33, 1), padding=(16, 0), groups=num_heads, bias=False)

    @staticmethod
    def _pinv(a: torch.Tensor, iters: int) -> torch.Tensor:
        # Newton–Schulz iteration for the Moore–Penrose inverse (converges for this initial scaling).
        at = a.transpose(-1, -2)
        z = at / (a.abs().sum(-1).amax(-1, keepdim=True)[..., None] * a.abs().sum(-2).amax(-1, keepdim=True)[..., None])
        eye = torch.eye(a.shape[-1], device=a.device, dtype=a.dtype)
        for _ in range(iters):
            az = a @ z
            z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
        return z

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        m = min(self.landmarks, S)
        pad = (m - S % m) % m
        if pad:  # pad at the front so the sequence splits into m equal segments
            x_BSD = nn.functional.pad(x_BSD, (0, 0, pad, 0))
        q = self.mha.project_q(x_BSD)  # (B, H, S', hd)
        k, v = self.mha.project_kv(x_BSD)
        kpm = None
        if pad:
            kpm = torch.zeros(B, x_BSD.shape[1], dtype=torch.bool, device=x_BSD.device)
            kpm[:, :pad] = True
        Sp = x_BSD.shape[1]
        q_l = q.reshape(*q.shape[:2], m, Sp // m, q.shape[-1]).mean(3)  # (B, H, m, hd) landmark queries
        k_l = k.reshape(*k.shape[:2], m, Sp // m, k.shape[-1]).mean(3)
        scale = 1.0 / math.sqrt(q.shape[-1])
        kernel2 = torch.softmax((q_l @ k_l.transpose(-1, -2)) * scale, dim=-1)  # (B, H, m, m)
        right = attention(q_l, k, v, key_padding_mask=kpm, backend=self.mha.backend)  # (B, H, m, hd)
        mid = self._pinv(kernel2.float(), self.pinv_iters).to(v.dtype) @ right  # (B, H, m, hd)
        out = attention(q, k_l, mid, backend=self.mha.backend)  # (B, H, S', hd)
        out = out + self.res_conv(v)
        return self.mha.merge(out)[:, pad:]


class _TransLayer(nn.Module):
    def __init__(self, dim: int, num_heads: int, dropout: float, landmarks: int = 0):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = NystromAttention(dim, num_heads, landmarks=landmarks or dim // 2, dropout=dropout)

    def forward(self, x):
        return x + self.attn(self.norm(x))


class _PPEG(nn.Module):
    """Pyramid position encoding generator: depthwise 7/5/3 convolutions over the tokens laid on a square."""

    def __init__(self, dim: int):
        super().__init__()
        self.c7 = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.c5 = nn.Conv2d(dim, dim, 5, padding=2, groups=dim)
        self.c3 = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)

    def forward(self, x_BSD: torch.Tensor, side: int) -> torch.Tensor:
        cls, feat = x_BSD[:, :1], x_BSD[:, 1:]
        B, N, D = feat.shape
        f = feat.transpose(1, 2).reshape(B, D, side, side)  # (B, D, side, side)
        f = f + self.c7(f) + self.c5(f) + self.c3(f)
        return torch.cat([cls, f.flatten(2).transpose(1, 2)], dim=1)


class TransMIL(nn.Module):
    def __init__(self, cfg: QuerentConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Sequential(nn.Linear(cfg.in_dim, cfg.dim), nn.GELU(), nn.Dropout(cfg.dropout))
        self.cls = nn.Parameter(torch.randn(1, 1, cfg.dim) * 0.02)
        self.layer1 = _TransLayer(cfg.dim, cfg.num_heads, cfg.dropout, cfg.nystrom_landmarks)
        self.ppeg = _PPEG(cfg.dim)
        self.layer2 = _TransLayer(cfg.dim, cfg.num_heads, cfg.dropout, cfg.nystrom_landmarks)
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)

    def forward(self, features_ND, coords_N2=None, *, patch_size_level0=None, return_index=False) -> MILOutput:
        _check(features_ND, self.cfg.in_dim)
        h = self.embed(features_ND)[None]  # (1, N, dim)
        N = h.shape[1]
        side = math.ceil(math.sqrt(N))
        h = torch.cat([h, h[:, : side * side - N]], dim=1)  # wrap-pad to a square, as TransMIL does
        x = torch.cat([self.cls.expand(1, -1, -1), h], dim=1)
        x = self.layer2(self.ppeg(self.layer1(x), side))
        emb = self.norm(x[:, 0])
        # Per-patch weight: the class token's attention is implicit in Nyström; use the embedding similarity.
        tok = self.norm(x[0, 1 : N + 1])
        a = torch.softmax(tok @ emb[0] / math.sqrt(self.cfg.dim), dim=0)
        return MILOutput(self.head(emb), a.detach(), emb)


class DenseMIL(nn.Module):
    """Querent's architecture with full self-attention in every layer (the exact reference Querent approximates)."""

    def __init__(self, cfg: QuerentConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Sequential(nn.Linear(cfg.in_dim, cfg.dim), nn.GELU(), nn.Dropout(cfg.dropout))
        self.layers = nn.ModuleList([
            SelfAttentionBlock(cfg.dim, cfg.num_heads, mlp_ratio=cfg.mlp_ratio, dropout=cfg.dropout)
            for _ in range(cfg.depth)
        ])
        self.norm = nn.LayerNorm(cfg.dim)
        self.pool = GatedAttentionPool(cfg.dim, cfg.pool_hidden, cfg.dropout)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)

    def forward(self, features_ND, coords_N2, *, patch_size_level0, return_index=False) -> MILOutput:
        _check(features_ND, self.cfg.in_dim)
        layout = build_regions(coords_N2.to(features_ND.device), patch_size_level0, self.cfg.region_size)
        x = (self.embed(features_ND) + sincos_2d(layout.grid_xy, self.cfg.dim, scale=0.25).to(features_ND.dtype))[None]
        for blk in self.layers:
            x = blk(x)
        tok = self.norm(x[0])
        emb, a = self.pool(tok)
        return MILOutput(self.head(emb), a, emb)


def build_model(name: str, cfg: QuerentConfig) -> nn.Module:
    """A slide model by name: one of :data:`MODEL_NAMES`."""
    table = {"querent": Querent, "abmil": ABMIL, "transmil": TransMIL, "dense": DenseMIL, "mean": MeanMIL}
    if name not in table:
        raise ValueError(f"unknown model {name!r}; accepted: {', '.join(MODEL_NAMES)}")
    return table[name](cfg)
