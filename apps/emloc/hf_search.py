"""EMLoC's per-chunk search on a transformers model: importance from suffix observers, then layer-wise keep ratios
under a Jensen–Shannon bound (the equations of the reference implementation, Zehong-Ma/EMLoC).

For a chunk of ``n`` tokens prefilled after a memory of ``m_l`` tokens (per layer ``l``), each demonstration of the
chunk is re-encoded on its own as a suffix after the chunk (without the template's header). Its observed positions
(the answer span: the token before the label, the label, the end of turn) give, per layer and KV head,

    importance[j] = Σ_suffixes Σ_observed rows Σ_query heads of the group  softmax_{keys m_l..}(q·k / √d)[j]

for the chunk's tokens ``j`` (the softmax runs over the chunk and the suffix's own keys; the memory is left out),
averaged over 5 neighbouring tokens (zero padded at the chunk's ends, as ``avg_pool1d`` counts them). From the top
layer down, keep ratios ``r`` are tried: the top ``int(r · n)`` tokens per KV head; the suffixes are replayed
against the trial cache and the first ratio whose mean JS divergence over the observed positions (against the
unpruned chunk) is at most ``delta`` is taken, else the layer stays whole.

Memory: the probe reduces inside each attention call (:func:`core.hf.probes.probe` with ``reduce``): per layer and
suffix only the observed rows are scored, ``O(rows · (n + S_suffix))``; logits are computed at the observed
positions only (``logits_to_keep``), never over the whole vocabulary at every position.

:class:`SearchConfig` holds the choices; ``PRESETS["reference"]`` reproduces the reference's numerics, the default
differs where the reference's choice is a flaw, each a switch of its own:

- ``precision``: ``"bf16"`` (reference) rounds the attention scores to bf16 before their softmax and sums the
  importance in bf16 (ties and rounding decide which tokens are kept), and computes the JS divergence from bf16
  logits in bf16 (compared with the bound rounded to bf16); ``"fp32"`` (default) keeps the importance in fp32 and
  the JS divergence in fp64.
- ``always_keep``: ``"plus100"`` (reference) adds 100 to the answer span's pooled importance and keeps
  ``int(r · n)`` tokens: a span larger than that, or other tokens whose importance passes 100 (attention sinks with
  many observers), push answer tokens out; ``"strict"`` (default) ranks the span first and keeps at least all of it.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from core.kv_compress import js_divergence

logger = logging.getLogger(__name__)

__all__ = ["SearchConfig", "PRESETS", "HFChunkReport", "emloc_chunk", "suffix_logits", "js_bf16"]

PRECISIONS = ("fp32", "bf16")
ALWAYS_KEEP = ("strict", "plus100")
#: Named settings of :class:`SearchConfig` (``compress_hf(..., preset=...)``).
PRESETS = {"default": {}, "reference": {"precision": "bf16", "always_keep": "plus100"}}


@dataclass(kw_only=True)
class SearchConfig:
    """EMLoC's search settings on a transformers model."""

    delta: float = 0.005  # JS bound per chunk (nats), the published value
    ratios: tuple[float, ...] = (0.1, 0.2, 0.5)  # keep ratios tried per layer, smallest first
    smooth_kernel: int = 5  # average pooling width over neighbouring tokens (zero padded), the reference's 5
    precision: str = "fp32"  # "fp32" or "bf16" (the reference's rounding; see module docs)
    always_keep: str = "strict"  # "strict" or "plus100" (the reference's; see module docs)
    replay: str = "partial"  # trials replay the suffixes from the searched layer on ("partial", as the reference)
    # or through the whole model ("whole": the same numbers up to rounding, about twice the work)

    def __post_init__(self) -> None:
        if not (isinstance(self.delta, (int, float)) and self.delta > 0 and math.isfinite(self.delta)):
            raise ValueError(f"delta must be a number > 0 (JS divergence in nats, e.g. 0.005), got {self.delta!r}")
        if not self.ratios or any(not 0 < r < 1 for r in self.ratios):
            raise ValueError(f"ratios must be numbers in (0, 1), got {self.ratios!r}")
        self.ratios = tuple(sorted(float(r) for r in self.ratios))
        if not (isinstance(self.smooth_kernel, int) and self.smooth_kernel >= 1 and self.smooth_kernel % 2 == 1):
            raise ValueError(f"smooth_kernel must be an odd positive int, got {self.smooth_kernel!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.always_keep not in ALWAYS_KEEP:
            raise ValueError(f"always_keep must be one of {ALWAYS_KEEP}, got {self.always_keep!r}")
        if self.replay not in ("partial", "whole"):
            raise ValueError(f"replay must be 'partial' or 'whole', got {self.replay!r}")


@dataclass
class HFChunkReport:
    """What EMLoC did to one chunk: ``num_tokens``; per layer the accepted ratio (1.0 = whole), the JS divergence
    in force after that layer's decision and the chunk tokens kept per KV head; the memory length per layer before
    the chunk; ``offset`` (the chunk's first position) and ``next_position`` (its maximum + 1); per layer the trials
    ``[[ratio, k, js], ...]`` in the order tried. ``indices`` (per layer: None or the kept chunk positions per KV
    head) is not saved with a memory."""

    num_tokens: int
    ratios: list[float] = field(default_factory=list)
    js: list[float] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    memory: list[int] = field(default_factory=list)
    offset: int = 0
    next_position: int = 0
    trials: list[list[list[float]]] = field(default_factory=list)
    indices: list = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "indices"}


def _forward(model, embeds: torch.Tensor, pos: torch.Tensor, cache, **kw):
    from core.hf.positions import prefill

    return prefill(model, inputs_embeds=embeds, position_ids=pos.to(embeds.device), cache=cache, **kw)


def _crop(cache, n: int) -> None:
    for layer in cache.layers:
        layer.crop(-n)


@contextmanager
def _from_layer(model, start: int):
    """While open, the decoder runs its layers ``start..`` only: its stack holds those (each layer keeps its own
    ``layer_idx``, so the cache is read and written where it should be)."""
    from apps.emloc.hf_inputs import language_model

    if start == 0:
        yield
        return
    lm = language_model(model)
    whole = lm.layers
    lm.layers = torch.nn.ModuleList(list(whole)[start:])
    try:
        yield
    finally:
        lm.layers = whole


def _uniform_layers(model) -> bool:
    """Whether every decoder layer is of one attention type (a replay from a middle layer needs it: the decoder
    picks each layer's mask by its index in the stack)."""
    cfg = getattr(model.config, "text_config", None) or model.config
    types = getattr(cfg, "layer_types", None)
    return not types or len(set(types)) == 1


@torch.no_grad()
def suffix_logits(model, cache, suffixes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], offset: int, *,
                  start: int = 0, inputs: list[torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
    """Logits ``(N, vocab)`` at the observed positions of each suffix ``(embeds (1, S, D), own positions, observe
    (S,))`` encoded on its own after ``cache`` at positions ``offset + own`` (only those positions reach the
    language-model head); the cache is left as it was.

    ``start`` > 0 replays from decoder layer ``start`` on, from ``inputs`` (per suffix, the hidden states entering
    that layer, as the unpruned pass computed them): exact when the layers below are as they were in that pass."""
    out = []
    for i, (emb, pos, obs) in enumerate(suffixes):
        idx = obs.nonzero()[:, 0].to(emb.device)
        x = emb if start == 0 else inputs[i]
        with _from_layer(model, start):
            o = _forward(model, x, pos + offset, cache, logits_to_keep=idx)
        for layer in cache.layers[start:]:
            layer.crop(-emb.shape[1])
        out.append(o.logits[0])
    return torch.cat(out)


def js_bf16(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """The reference's JS divergence, a bf16 scalar: both logit tensors ``(N, vocab)`` rounded to bf16, softmax in
    bf16, ``0.5 · (KL(p‖m) + KL(q‖m))`` with ``m = (p + q) / 2``, averaged over the ``N`` rows, in bf16."""
    p = F.softmax(logits_p.to(torch.bfloat16), dim=-1, dtype=torch.bfloat16)
    q = F.softmax(logits_q.to(torch.bfloat16), dim=-1, dtype=torch.bfloat16)
    m = (0.5 * (p + q)).log()
    return 0.5 * (F.kl_div(m, p.log(), log_target=True, reduction="batchmean")
                  + F.kl_div(m, q.log(), log_target=True, reduction="batchmean"))  # fmt: skip


def _js_mean(base: torch.Tensor, logits: torch.Tensor, rows: int = 8) -> float:
    """Mean JS divergence (fp64) over the rows of two ``(N, vocab)`` logit tensors, ``rows`` at a time (the fp64
    temporaries of a whole vocabulary stay small)."""
    total = 0.0
    for i in range(0, base.shape[0], rows):
        total += float(js_divergence(base[i : i + rows], logits[i : i + rows]).double().sum())
    return total / base.shape[0]


class _Importance:
    """The probe's reducer: per layer, the attention the observed rows of each suffix give the chunk's tokens."""

    def __init__(self, mem: list[int], n: int, precision: str):
        self.mem, self.n, self.precision = mem, n, precision
        self.rows: torch.Tensor | None = None  # observed rows of the suffix being encoded
        self.parts: dict[int, list[torch.Tensor]] = {}

    def __call__(self, layer: int, query: torch.Tensor, key: torch.Tensor, pattern: dict) -> None:
        from core.hf.probes import received_attention

        m, n = self.mem[layer], self.n
        start = m  # the softmax runs over the chunk and the suffix: the memory is left out
        k = key[:, :, start:]
        bias = pattern.get("bias")
        bias = None if bias is None else bias[..., start:]
        pad = pattern.get("key_padding")
        pad = None if pad is None else pad[:, start:]
        lo = m - start  # the chunk's first key among k
        if self.precision == "fp32":
            got = received_attention(query, k, rows=self.rows, causal=pattern.get("causal", True),
                                     window=pattern.get("window"), key_padding=pad, bias=bias,
                                     scale=pattern.get("scale"), softcap=pattern.get("softcap"))[..., lo : lo + n]
            prev = self.parts.get(layer)
            self.parts[layer] = [got if prev is None else prev[0] + got]
            return
        self.parts.setdefault(layer, []).append(self._bf16_rows(query, k, bias, pad, pattern)[..., lo : lo + n])

    def _bf16_rows(self, query, k, bias, pad, pattern) -> torch.Tensor:
        """``(rows, H_q, S_k)`` bf16: scores in fp32, rounded to bf16, softmax in bf16 (the reference's)."""
        Sq, Sk, D = query.shape[2], k.shape[2], query.shape[-1]
        G = query.shape[1] // k.shape[1]
        q = query[:, :, self.rows.to(query.device)].float()
        kk = k.float().repeat_interleave(G, dim=1)
        scale = pattern.get("scale")
        if scale is None or abs(scale - D**-0.5) < 1e-12:
            s = torch.matmul(q, kk.transpose(2, 3)) / math.sqrt(D)  # as the reference divides
        else:
            s = torch.matmul(q, kk.transpose(2, 3)) * scale
        if bias is not None:
            b = bias.float()
            s = s + (b[..., self.rows.to(b.device), :] if b.shape[-2] != 1 else b)
        qi = (self.rows.to(s.device) + (Sk - Sq))[:, None]
        s = s.masked_fill(torch.arange(Sk, device=s.device)[None, :] > qi, float("-inf"))
        if pad is not None:
            s = s.masked_fill(pad[:, None, None, :], float("-inf"))
        p = F.softmax(s, dim=-1, dtype=torch.bfloat16)  # (1, H_q, rows, S_k)
        return p[0].permute(1, 0, 2)  # (rows, H_q, S_k)

    def per_kv_head(self, layer: int, num_kv: int) -> torch.Tensor:
        """``(1, H_kv, n)`` summed over observers and each KV head's query group (bf16 or fp32)."""
        parts = self.parts[layer]
        if self.precision == "fp32":
            s = parts[0]  # (1, H_q, n)
        else:
            s = torch.cat(parts, dim=0).sum(dim=0, keepdim=True)  # (1, H_q, n) bf16, summed as the reference
        return s.reshape(1, num_kv, -1, s.shape[-1]).sum(dim=-2)


def _specs(full, mem: list[int], n: int, chunk_keep: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """prune_cache specs: the memory whole, the chunk's kept tokens per head (or all)."""
    specs = []
    for layer, m, keep in zip(full.layers, mem, chunk_keep):
        if keep is None:
            specs.append(torch.arange(layer.keys.shape[2]))
            continue
        B, H = keep.shape[:2]
        prior = torch.arange(m, device=keep.device)[None, None].expand(B, H, m)
        specs.append(torch.cat([prior, keep + m], dim=-1))
    return specs


def _scores(imp: torch.Tensor, keep: torch.Tensor, cfg: SearchConfig) -> torch.Tensor:
    """Pooled importance ``(1, H_kv, n)`` with the always-kept span ranked as ``cfg.always_keep`` says."""
    pooled = F.avg_pool1d(imp, kernel_size=cfg.smooth_kernel, padding=cfg.smooth_kernel // 2, stride=1)
    keep = keep.to(pooled.device)
    if cfg.always_keep == "plus100":
        return pooled + keep[None, None].to(pooled.dtype) * 100.0
    return pooled.float().masked_fill(keep[None, None], float("inf"))


@torch.no_grad()
def emloc_chunk(model, memory, embeds: list[torch.Tensor], own_pos: list[torch.Tensor], keep: torch.Tensor,
                suffixes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], offset: int, cfg: SearchConfig, *,
                num_layers: int, progress=None):  # fmt: skip
    """Prefill one chunk after ``memory`` and search its per-layer keep ratios (see module docs).

    Args:
        model: the transformers model (``"longctx"`` attention).
        memory: the compressed cache so far (None for the first chunk); it is extended, not copied.
        embeds, own_pos: per demonstration of the chunk, its input embeddings ``(1, S_i, D)`` and its own positions
            from 0 (``(3, 1, S_i)`` M-RoPE or ``(1, S_i)``).
        keep: bool ``(n,)``: the always-kept tokens of the chunk (the answer spans).
        suffixes: per demonstration ``(embeds (1, S, D), own positions, observed bool (S,))`` as re-encoded after
            the chunk.
        offset: the chunk's first position (the uncompressed maximum so far + 1).
        cfg: the search settings. num_layers: decoder layers. progress: optional tqdm over layers.

    Returns:
        ``(new memory, HFChunkReport)``.
    """
    from core.hf.cache import prune_cache
    from core.hf.probes import probe

    n = int(keep.numel())
    parts, nxt = [], offset  # each piece continues after the previous one's maximum position
    for pp in own_pos:
        parts.append(pp + nxt)
        nxt = int((pp + nxt).max()) + 1
    pos = torch.cat(parts, dim=-1)
    emb = torch.cat(embeds, dim=1)
    L = num_layers
    mem = [0] * L if memory is None else [layer.keys.shape[2] for layer in memory.layers]
    full = _forward(model, emb, pos, memory, logits_to_keep=1).past_key_values
    H = full.layers[0].keys.shape[1]
    red = _Importance(mem, n, cfg.precision)
    partial = cfg.replay == "partial" and _uniform_layers(model)
    base, hidden = [], [[] for _ in range(L)]  # hidden[l][i]: suffix i's hidden states entering layer l
    with probe(model, layers=list(range(L)), hidden=partial, reduce=red) as rec:
        for i, s in enumerate(suffixes):
            red.rows = s[2].nonzero()[:, 0]
            base.append(suffix_logits(model, full, [s], nxt))
            if partial:
                hidden[0].append(s[0])
                for l in range(1, L):
                    hidden[l].append(rec.hidden[l - 1][i])
    if partial:
        rec.hidden.clear()
    base = torch.cat(base)
    n_keep = int(keep.sum())
    chunk_keep: list[torch.Tensor | None] = [None] * L
    report = HFChunkReport(num_tokens=n, ratios=[1.0] * L, js=[0.0] * L, kept=[n] * L, memory=mem, offset=offset,
                           next_position=nxt, trials=[[] for _ in range(L)], indices=[None] * L)  # fmt: skip
    current = 0.0
    for l in reversed(range(L)):
        score = _scores(red.per_kv_head(l, H), keep, cfg)
        for r in cfg.ratios:
            k = int(n * r)
            if cfg.always_keep == "strict":
                k = max(n_keep, k)
            if k >= n or k < 1:
                continue
            cand = score.topk(k, dim=-1).indices.sort(dim=-1).values  # (1, H_kv, k)
            trial = list(chunk_keep)
            trial[l] = cand
            start = l if partial else 0
            logits = suffix_logits(model, prune_cache(full, _specs(full, mem, n, trial)), suffixes, nxt, start=start,
                                   inputs=hidden[l] if partial else None)  # fmt: skip
            if cfg.precision == "bf16":
                js_t = js_bf16(logits, base)
                js, ok = float(js_t), bool(js_t <= cfg.delta)  # the bound rounded to bf16, as the reference compares
            else:
                js = _js_mean(base, logits)
                ok = js <= cfg.delta
            report.trials[l].append([r, k, js])
            if ok:
                chunk_keep, report.ratios[l], report.kept[l], current = trial, r, k, js
                report.indices[l] = cand[0].tolist()
                break
        report.js[l] = current
        if progress is not None:
            progress.update(1)
    return prune_cache(full, _specs(full, mem, n, chunk_keep)), report
