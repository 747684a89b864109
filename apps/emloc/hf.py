"""EMLoC on a transformers vision-language model (Qwen2-VL first), as the reference implementation runs it.

    from core.hf import load
    from apps.emloc import compress_hf, HFContext
    model, processor = load("path/to/Qwen2-VL-2B-Instruct")               # a local folder, attn="longctx"
    ctx = compress_hf(model, demos, processor=processor, delta=0.005)      # demos: [(image, "label text"), ...]
    ctx.predict(query_image, ["cat", "dog", ...])                          # the best-scoring label
    ctx.save("memory.safetensors"); ctx = HFContext.load("memory.safetensors", model, processor)

Demonstrations are formatted with the model's own chat template (:mod:`apps.emloc.hf_inputs`): each is a user turn
(image + ``prompt``) and an assistant turn (its label); the label text's tokens are its answer tokens. EMLoC then
goes chunk by chunk (``chunk_demos`` demonstrations, default 4 as the reference):

1. prefill the chunk after the compressed memory, its M-RoPE positions continuing from the memory's uncompressed
   maximum + 1 (kept tokens keep their positions: keys are stored rotated);
2. observers: every demonstration of the chunk is re-encoded **as a suffix after the chunk** (each on its own, at
   the positions after the chunk), so every chunk token is scored by every answer. Importance per KV head = the
   attention the suffix's observed positions (the token before the label and the label tokens) give each chunk
   token, normalised over the chunk and suffix keys (the memory left out), summed over observers and the head's
   query group, averaged over 5 neighbouring tokens; answer tokens rank first (always kept);
3. from the top layer down, keep ratios ``ratios`` (0.1, 0.2, 0.5 of the chunk) are tried: the top-k tokens per KV
   head; the suffixes are replayed against the trial cache and the smallest ratio whose mean Jensen–Shannon
   divergence at the observed positions (against the unpruned chunk) is ≤ ``delta`` is taken, else the layer stays
   whole. The replay runs the whole model (layers below the one searched are untouched, so it equals the
   reference's replay from that layer; it costs more).

``policy`` ``"full"`` keeps everything; any other policy of :data:`core.kv_compress.POLICIES` runs on one prefill
of all demonstrations with ``keep`` of the tokens per layer and KV head (the same budgets as on the project's own
decoder). SnapKV / PyramidKV / FastV observe the last ``window`` tokens (default 32, SnapKV's window): there is no
question at compression time, so the last demonstration stands in for it. FastV prunes from layer
``min(2, depth - 1)``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from apps.emloc.hf_inputs import (
    DEFAULT_PROMPT,
    Piece,
    demo_pieces,
    answer_ids,
    embed,
    load_image,
    positions,
    query_piece,
)
from core.kv_compress import POLICIES, Observation, js_divergence
from core.kv_observe import _pool, _topk_slots

logger = logging.getLogger(__name__)

__all__ = ["compress_hf", "HFContext", "HF_MEMORY_FORMAT", "HFChunkReport", "suffix_logits"]

HF_MEMORY_FORMAT = "longctx.emloc.hf-memory.v1"
REFERENCE_CHUNK_DEMOS = 4  # the reference's demonstrations per chunk (20 on ImageNet)


@dataclass
class HFChunkReport:
    """What EMLoC did to one chunk: ``num_tokens``; per layer the accepted ratio (1.0 = whole), the JS divergence
    in force after that layer's decision and the chunk tokens kept per KV head; the memory length per layer before
    the chunk; ``offset`` (the chunk's first position) and ``next_position`` (its maximum + 1)."""

    num_tokens: int
    ratios: list[float] = field(default_factory=list)
    js: list[float] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    memory: list[int] = field(default_factory=list)
    offset: int = 0
    next_position: int = 0


def _ensure_longctx(model) -> None:
    """Per-head pruned caches and attention probes need the ``"longctx"`` attention; switch to it (logged)."""
    if getattr(model.config, "_attn_implementation", None) != "longctx":
        from core.hf.backend import register

        register()
        logger.info("emloc: switching %s to attn_implementation='longctx'", type(model).__name__)
        model.set_attn_implementation("longctx")


def _forward(model, embeds: torch.Tensor, pos: torch.Tensor, cache):
    from core.hf.positions import prefill

    return prefill(model, inputs_embeds=embeds, position_ids=pos.to(embeds.device), cache=cache)


def _crop(cache, n: int) -> None:
    for layer in cache.layers:
        layer.crop(-n)


@torch.no_grad()
def suffix_logits(model, cache, suffixes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], offset: int, *,
                  record=None) -> torch.Tensor:
    """Logits ``(N, vocab)`` at the observed positions of each suffix ``(embeds (1, S, D), own positions, observe
    (S,))`` encoded on its own after ``cache`` at positions ``offset + own``; the cache is left as it was.
    ``record``: an open :func:`core.hf.probe` (its attention lists get one entry per suffix)."""
    out = []
    for emb, pos, obs in suffixes:
        o = _forward(model, emb, pos + offset, cache)
        _crop(cache, emb.shape[1])
        out.append(o.logits[0, obs.to(o.logits.device)].float())
    return torch.cat(out)


def _js(p: torch.Tensor, q: torch.Tensor) -> float:
    return float(js_divergence(p, q).mean())


def _importance(rec, L: int, H: int, mem: list[int], n: int, suffixes) -> list[torch.Tensor]:
    """Per layer ``(1, H_kv, n)``: attention of the suffixes' observed positions to the chunk's tokens."""
    out = []
    for l in range(L):
        total = None
        for a, (_, _, obs) in zip(rec.attention[l], suffixes):
            p = a[0][:, obs.to(a.device)]  # (H_q, n_obs, S_k)
            m = mem[l]
            chunk = p[..., m : m + n] / p[..., m:].sum(-1, keepdim=True).clamp_min(1e-30)  # memory left out
            s = chunk.sum(1)  # (H_q, n)
            s = s.view(H, -1, n).sum(1)  # (H_kv, n): the head's query group
            total = s if total is None else total + s
        out.append(total[None])
    return out


def _specs(full, mem: list[int], n: int, chunk_keep: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """prune_cache specs: the memory whole, the chunk's kept tokens per head (or all)."""
    specs = []
    for (layer, m, keep) in zip(full.layers, mem, chunk_keep):
        S = layer.keys.shape[2]
        if keep is None:
            specs.append(torch.arange(S))
            continue
        B, H = keep.shape[:2]
        prior = torch.arange(m, device=keep.device)[None, None].expand(B, H, m)
        specs.append(torch.cat([prior, keep + m], dim=-1))
    return specs


@torch.no_grad()
def _emloc_chunk(model, memory, chunk: list[Piece], offset: int, *, delta: float, ratios: Sequence[float],
                 smooth_kernel: int, embeds: list[torch.Tensor], own_pos: list[torch.Tensor]):
    """Prefill one chunk after ``memory``, search per-layer keep ratios under the JS bound; the new memory and a report."""
    from core.hf.cache import prune_cache
    from core.hf.probes import probe

    n = sum(p.input_ids.numel() for p in chunk)
    answer = torch.cat([p.answer for p in chunk])
    parts, nxt = [], offset  # each piece continues after the previous one's maximum position
    for pp in own_pos:
        parts.append(pp + nxt)
        nxt = int((pp + nxt).max()) + 1
    pos = torch.cat(parts, dim=-1)
    emb = torch.cat(embeds, dim=1)
    mem = [0] * len(model_layers(model)) if memory is None else [l.keys.shape[2] for l in memory.layers]
    full = _forward(model, emb, pos, memory).past_key_values
    L = len(full.layers)
    H = full.layers[0].keys.shape[1]
    suffixes = [(e, pp, p.observe) for e, pp, p in zip(embeds, own_pos, chunk)]
    with probe(model, layers=list(range(L)), last_queries=None, hidden=False) as rec:
        base = suffix_logits(model, full, suffixes, nxt, record=rec)
    imp = _importance(rec, L, H, mem, n, suffixes)
    del rec
    n_ans = int(answer.sum())
    chunk_keep: list[torch.Tensor | None] = [None] * L
    report = HFChunkReport(num_tokens=n, ratios=[1.0] * L, js=[0.0] * L, kept=[n] * L, memory=mem, offset=offset,
                           next_position=nxt)
    current = 0.0
    for l in reversed(range(L)):
        score = _pool(imp[l], smooth_kernel, "avg").masked_fill(answer[None, None].to(imp[l].device), float("inf"))
        vis = torch.ones_like(score, dtype=torch.bool)
        for r in sorted(ratios):
            k = max(n_ans, int(r * n))
            if k >= n:
                break
            cand = _topk_slots(score, vis, k)
            trial = list(chunk_keep)
            trial[l] = cand
            js = _js(base, suffix_logits(model, prune_cache(full, _specs(full, mem, n, trial)), suffixes, nxt))
            if js <= delta:
                chunk_keep, report.ratios[l], report.kept[l], current = trial, r, k, js
                break
        report.js[l] = current
    return prune_cache(full, _specs(full, mem, n, chunk_keep)), report


def model_layers(model) -> torch.nn.ModuleList:
    from core.hf.insert import decoder_layers

    return decoder_layers(model)


class _CacheView:
    """The face of :class:`core.decoder.KVCache` the budgeted policies read, over a transformers cache."""

    class _Layer:
        def __init__(self, k):
            self.k = k

        def visible(self):
            B, H, S = self.k.shape[:3]
            return torch.ones(B, H, S, dtype=torch.bool, device=self.k.device)

        def __len__(self):
            return self.k.shape[2]

    def __init__(self, cache):
        self.layers = [self._Layer(l.keys) for l in cache.layers]
        self.num_layers = len(self.layers)
        self.batch_size = self.layers[0].k.shape[0]


def _budgeted(model, pieces: list[Piece], embeds, own_pos, policy: str, keep: float, window: int, seed: int,
              protect: bool):
    """One prefill of every demonstration, then ``policy`` at ``keep`` of the tokens per layer and KV head."""
    from core.hf.cache import prune_cache
    from core.hf.probes import probe

    parts, nxt = [], 0
    for pp in own_pos:
        parts.append(pp + nxt)
        nxt = int((pp + nxt).max()) + 1
    pos, emb = torch.cat(parts, dim=-1), torch.cat(embeds, dim=1)
    S = emb.shape[1]
    if policy == "full":
        return _forward(model, emb, pos, None).past_key_values, nxt, {}
    budget = int(round(keep * S))
    if budget < 1:
        raise ValueError(f"a budget of zero tokens: keep={keep} of {S} demonstration tokens rounds to 0")
    w = min(window, budget, S)
    L = len(model_layers(model))
    needs_probe = policy in ("h2o", "snapkv", "pyramidkv", "fastv")
    if needs_probe:
        with probe(model, layers=list(range(L)), last_queries=None if policy == "h2o" else w, hidden=False) as rec:
            cache = _forward(model, emb, pos, None).past_key_values
        atts = [rec.attention[l][0] for l in range(L)]
    else:
        cache, atts = _forward(model, emb, pos, None).past_key_values, None
    qi = torch.arange(S) if policy == "h2o" else torch.arange(S - w, S)
    image = torch.cat([p.image for p in pieces])[None]
    obs = Observation(attentions=atts, query_index=qi, num_new=S, image_mask=image,
                      protect=torch.cat([p.answer for p in pieces])[None] if protect else None)
    opts = {}
    if policy == "random":
        opts["generator"] = torch.Generator().manual_seed(seed)
    if policy == "fastv":
        opts["k_layer"] = min(2, L - 1)
    idx = POLICIES[policy](_CacheView(cache), budget, obs, **opts)
    specs = [torch.arange(l.keys.shape[2]) if i is None else i for l, i in zip(cache.layers, idx)]
    return prune_cache(cache, specs), nxt, {"keep": float(keep), "budget": budget, "window": w}


def _load_all(items, what: str, image_size):
    imgs = []
    for i, x in enumerate(items):
        imgs.append(load_image(x, f"{what} {i}", image_size))
    return imgs


def _check_sizes(images, image_size, what: str) -> tuple[int, int]:
    if image_size is not None:
        return tuple(int(v) for v in image_size)
    size = images[0].size
    for i, im in enumerate(images):
        if im.size != size:
            raise ValueError(f"{what} {i} is {im.size[0]}x{im.size[1]}, the first is {size[0]}x{size[1]}: every image "
                             "must have one size (pass image_size=(width, height) to resize them all)")
    return size


@torch.no_grad()
def compress_hf(
    model,
    demos,
    *,
    processor=None,
    prompt: str = DEFAULT_PROMPT,
    delta: float = 0.005,
    ratios: Sequence[float] = (0.1, 0.2, 0.5),
    chunk_demos: int = REFERENCE_CHUNK_DEMOS,
    policy: str = "emloc",
    keep: float | None = None,
    window: int = 32,
    seed: int = 0,
    protect_answers: bool = False,
    image_size: tuple[int, int] | None = None,
    smooth_kernel: int = 5,
    progress: Callable[[int, int], None] | None = None,
) -> HFContext:
    """Compress ``(image, label text)`` demonstrations for a transformers VLM into an :class:`HFContext`.

    Args:
        model: a model from :func:`core.hf.load` (or a :class:`core.hf.Loaded`, then ``processor`` may be omitted).
        demos: ``(image, label)`` pairs; an image is a path, a PIL image or an ``(H, W, 3)`` uint8 array.
        processor: the model's processor (chat template, tokenizer, image processor).
        prompt: the question of every demonstration and query.
        delta: JS bound per chunk (nats), > 0; ratios: keep ratios tried per layer, in (0, 1).
        chunk_demos: demonstrations per chunk (the reference: 4).
        policy: ``"emloc"``, ``"full"`` or a budgeted policy of :data:`core.kv_compress.POLICIES` (needs ``keep``).
        keep: for budgeted policies, the fraction of tokens kept per layer and KV head, in (0, 1].
        window: SnapKV/PyramidKV/FastV observation window (last tokens).
        seed: for ``random``. protect_answers: budgeted policies keep the answer tokens first (as EMLoC does).
        image_size: ``(width, height)`` every image is resized to; None: all must share the first one's size.
        progress: called with ``(chunks_done, chunks_total)``.
    """
    from core.hf.loading import Loaded

    if isinstance(model, Loaded):
        processor = processor if processor is not None else model.processor
        model = model.model
    if processor is None:
        raise ValueError("compress_hf needs the model's processor (core.hf.load returns it with the model)")
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {sorted(POLICIES)}")
    pairs = list(demos)
    if len(pairs) < 1:
        raise ValueError("no demonstrations given")
    for i, p in enumerate(pairs):
        if not (isinstance(p, (tuple, list)) and len(p) == 2) or p[1] is None:
            raise ValueError(f"demonstration {i} is not an (image, label text) pair")
    if policy == "emloc":
        if not (isinstance(delta, (int, float)) and delta > 0 and math.isfinite(delta)):
            raise ValueError(f"delta must be a number > 0 (JS divergence in nats, e.g. 0.005), got {delta!r}")
        if not (isinstance(chunk_demos, int) and chunk_demos >= 1):
            raise ValueError(f"chunk_demos must be a positive int, got {chunk_demos!r}")
        if not ratios or any(not 0 < r < 1 for r in ratios):
            raise ValueError(f"ratios must be numbers in (0, 1), got {ratios!r}")
    elif policy != "full" and (keep is None or not (isinstance(keep, (int, float)) and 0 < keep <= 1)):
        raise ValueError(f"policy {policy!r} needs keep, the fraction of tokens kept, in (0, 1]; got {keep!r}")
    images = _load_all([p[0] for p in pairs], "demonstration", image_size)
    size = _check_sizes(images, image_size, "demonstration")
    labels = [p[1] for p in pairs]
    _ensure_longctx(model)
    model.eval()
    pieces = demo_pieces(model, processor, images, labels, prompt)
    embeds = [embed(model, p) for p in pieces]
    own_pos = [positions(model, p) for p in pieces]
    n_tok = sum(p.input_ids.numel() for p in pieces)
    settings = {"policy": policy, "prompt": prompt, "image_size": list(size), "resize": image_size is not None}
    reports: list[HFChunkReport] = []
    if policy == "emloc":
        memory, offset = None, 0
        starts = list(range(0, len(pieces), chunk_demos))
        for c, s in enumerate(starts):
            sl = slice(s, s + chunk_demos)
            memory, rep = _emloc_chunk(model, memory, pieces[sl], offset, delta=float(delta), ratios=ratios,
                                       smooth_kernel=smooth_kernel, embeds=embeds[sl], own_pos=own_pos[sl])
            offset = rep.next_position
            reports.append(rep)
            logger.debug("emloc chunk %d: ratios %s js %s", c, rep.ratios, rep.js)
            if progress is not None:
                progress(c + 1, len(starts))
        cache, nxt = memory, offset
        settings.update(delta=float(delta), ratios=sorted(float(r) for r in ratios), chunk_demos=chunk_demos,
                        observers="suffix", smooth_kernel=smooth_kernel)
    else:
        cache, nxt, extra = _budgeted(model, pieces, embeds, own_pos, policy, keep, window, seed, protect_answers)
        settings.update(extra, protect_answers=bool(protect_answers) if policy != "full" else False)
        if progress is not None:
            progress(1, 1)
    return HFContext(model=model, processor=processor, cache=cache, next_position=nxt, num_tokens=n_tok,
                     labels=sorted(set(labels)), settings=settings, reports=reports)


@dataclass
class HFContext:
    """A compressed demonstration prefix for a transformers VLM; answer queries against it (the cache is left as
    it was after each query).

    Attributes:
        model, processor: what made it. cache: the transformers cache (per layer, kept tokens).
        next_position: the first position after the uncompressed demonstrations (queries start there).
        num_tokens: demonstration tokens before compression. labels: the demonstrations' label texts.
        settings: how it was made. reports: one :class:`HFChunkReport` per chunk (EMLoC).
    """

    model: torch.nn.Module
    processor: object
    cache: object
    next_position: int
    num_tokens: int
    labels: list[str]
    settings: dict
    reports: list[HFChunkReport] = field(default_factory=list)

    def kept_counts(self) -> list[torch.Tensor]:
        """Per layer ``(B, H_kv)`` tokens each head sees."""
        out = []
        for layer in self.cache.layers:
            B, H, S = layer.keys.shape[:3]
            hidden = getattr(layer, "hidden", None)
            out.append(torch.full((B, H), S) if hidden is None else (~hidden).sum(-1).cpu())
        return out

    def keep_ratios(self) -> list[float]:
        """Per layer, the fraction of demonstration tokens kept (mean over heads)."""
        return [float(c.float().mean()) / self.num_tokens for c in self.kept_counts()]

    def keep_fraction(self) -> float:
        """Kept (layer, head, token) entries over the uncompressed cache's."""
        r = self.keep_ratios()
        return sum(r) / len(r)

    def _query(self, image):
        size = tuple(self.settings["image_size"])
        img = load_image(image, "query", size if self.settings.get("resize") else None)
        if img.size != size:
            raise ValueError(f"the query image is {img.size[0]}x{img.size[1]}; this memory was made with "
                             f"{size[0]}x{size[1]} images (compress with image_size=... to resize every image)")
        q = query_piece(self.model, self.processor, img, self.labels[0], self.settings["prompt"])
        return embed(self.model, q), positions(self.model, q) + self.next_position

    @torch.no_grad()
    def query_logits(self, image) -> torch.Tensor:
        """``(S_q, vocab)`` logits of the query's tokens (the last one predicts the answer's first token)."""
        emb, pos = self._query(image)
        out = _forward(self.model, emb, pos, self.cache)
        _crop(self.cache, emb.shape[1])
        return out.logits[0].float()

    @torch.no_grad()
    def label_scores(self, image, labels: Sequence[str] | None = None) -> torch.Tensor:
        """``(N,)`` log-probabilities of each label's tokens (and the end of the answer) after the query."""
        labels = list(labels) if labels is not None else self.labels
        emb, pos = self._query(image)
        out = _forward(self.model, emb, pos, self.cache)
        first = torch.log_softmax(out.logits[0, -1].float(), -1)
        nxt = int(pos.max()) + 1
        scores = []
        emb_layer = self.model.get_input_embeddings()
        for label in labels:
            ids = answer_ids(self.processor, self.settings["prompt"], label)
            s = float(first[ids[0]])
            if ids.numel() > 1:
                lp = ids[:-1].to(emb.device)
                p = torch.arange(nxt, nxt + lp.numel())[None]
                p = p.expand(3, 1, -1) if pos.dim() == 3 else p
                o = _forward(self.model, emb_layer(lp)[None], p, self.cache)
                _crop(self.cache, lp.numel())
                lps = torch.log_softmax(o.logits[0].float(), -1)
                s += float(lps[torch.arange(lp.numel()), ids[1:].to(lps.device)].sum())
            scores.append(s)
        _crop(self.cache, emb.shape[1])
        return torch.tensor(scores)

    def predict(self, image, labels: Sequence[str] | None = None) -> str:
        """The label (of ``labels``, default the demonstrations') with the highest score."""
        labels = list(labels) if labels is not None else self.labels
        return labels[int(self.label_scores(image, labels).argmax())]

    def save(self, path: str | os.PathLike) -> None:
        """Write the cache (safetensors, atomically) with the model's fingerprint, settings and reports."""
        from core.hf.cache import save_cache

        meta = {"emloc_format": HF_MEMORY_FORMAT, "settings": self.settings, "next_position": self.next_position,
                "num_tokens": self.num_tokens, "labels": self.labels, "reports": [r.__dict__ for r in self.reports]}
        save_cache(self.cache, path, self.model, metadata=meta)

    @classmethod
    def load(cls, path: str | os.PathLike, model, processor) -> HFContext:
        """Read a memory written by :meth:`save`. Raises ``core.hf.CacheMismatchError`` (a ValueError) for a memory
        made by another model, ValueError for a file that is not an EMLoC memory, FileNotFoundError."""
        from core.hf.cache import load_cache

        _ensure_longctx(model)
        dev = next(model.parameters()).device
        cache, meta = load_cache(path, model, device=str(dev))
        if meta.get("emloc_format") != HF_MEMORY_FORMAT:
            raise ValueError(f"{path} is a saved cache but not an EMLoC memory (emloc_format "
                             f"{meta.get('emloc_format')!r}, expected {HF_MEMORY_FORMAT!r})")
        return cls(model=model, processor=processor, cache=cache, next_position=int(meta["next_position"]),
                   num_tokens=int(meta["num_tokens"]), labels=list(meta["labels"]), settings=dict(meta["settings"]),
                   reports=[HFChunkReport(**r) for r in meta.get("reports", [])])

    def summary(self) -> dict:
        return {"policy": self.settings["policy"], "tokens": self.num_tokens, "kept_fraction": round(self.keep_fraction(), 4),
                "keep_per_layer": [round(r, 4) for r in self.keep_ratios()], "settings": json.loads(json.dumps(self.settings))}
