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
2. observers: every demonstration of the chunk is re-encoded **as a suffix after the chunk** (each on its own,
   without the template's header, at the positions after the chunk), so every chunk token is scored by every
   answer. Importance per KV head = the attention the suffix's observed positions (the answer span: the token
   before the label, the label tokens, the end of turn) give each chunk token, normalised over the chunk and suffix
   keys (the memory left out), summed over observers and the head's query group, averaged over 5 neighbouring
   tokens; the answer spans are always kept;
3. from the top layer down, keep ratios ``ratios`` (0.1, 0.2, 0.5 of the chunk) are tried: the top-k tokens per KV
   head; the suffixes are replayed (from the searched layer on) against the trial cache and the smallest ratio whose
   mean Jensen–Shannon divergence at the observed positions (against the unpruned chunk) is ≤ ``delta`` is taken,
   else the layer stays whole. See :mod:`apps.emloc.hf_search` (and its ``preset="reference"``, which reproduces
   the reference's bf16 numerics and its +100 ranking of the answer spans).

Memory: attention is scored inside each attention call, per layer and for the observed rows only; logits are
computed at the positions that need them only (``logits_to_keep``), never over the vocabulary at every position.

``policy`` ``"full"`` keeps everything; any other policy of :data:`core.kv_compress.POLICIES` runs on one prefill
of all demonstrations with ``keep`` of the tokens per layer and KV head (the same budgets as on the project's own
decoder). SnapKV / PyramidKV / FastV observe the last ``window`` tokens (default 32, SnapKV's window): there is no
question at compression time, so the last demonstration stands in for it. FastV prunes from layer
``min(2, depth - 1)``. Their probes keep, per layer, the attention each key receives summed over the observing
rows (``(B, H_q, 1, S)``), computed 256 rows at a time: never an ``S × S`` matrix.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from apps.emloc.hf_inputs import (
    DEFAULT_PROMPT,
    Piece,
    answer_ids,
    demo_pieces,
    embed,
    load_image,
    positions,
    query_piece,
    suffix_pieces,
)
from apps.emloc.hf_search import PRESETS, HFChunkReport, SearchConfig, _crop, _forward, emloc_chunk, suffix_logits
from core.kv_compress import POLICIES, Observation

logger = logging.getLogger(__name__)

__all__ = ["compress_hf", "HFContext", "HF_MEMORY_FORMAT", "HFChunkReport", "SearchConfig", "PRESETS", "suffix_logits"]

HF_MEMORY_FORMAT = "longctx.emloc.hf-memory.v1"
REFERENCE_CHUNK_DEMOS = 4  # the reference's demonstrations per chunk (20 on ImageNet)


def _ensure_longctx(model) -> None:
    """Per-head pruned caches and attention probes need the ``"longctx"`` attention; switch to it (logged)."""
    if getattr(model.config, "_attn_implementation", None) != "longctx":
        from core.hf.backend import register

        register()
        logger.info("emloc: switching %s to attn_implementation='longctx'", type(model).__name__)
        model.set_attn_implementation("longctx")


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


class _Received:
    """Probe reducer for the budgeted policies: per layer, the attention each key receives from the chosen query
    rows (all for H2O, the last ``window`` for SnapKV / PyramidKV / FastV), summed as the policies sum it and kept
    as ``(B, H_q, 1, S)``: one layer's scores at a time, never the ``S × S`` matrix of every layer."""

    def __init__(self, rows: torch.Tensor):
        self.rows, self.out = rows, {}

    def __call__(self, layer, query, key, pattern):
        from core.hf.probes import received_attention

        self.out[layer] = received_attention(query, key, rows=self.rows, **pattern)[:, :, None]


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
        return _forward(model, emb, pos, None, logits_to_keep=1).past_key_values, nxt, {}
    budget = int(round(keep * S))
    if budget < 1:
        raise ValueError(f"a budget of zero tokens: keep={keep} of {S} demonstration tokens rounds to 0")
    w = min(window, budget, S)
    L = len(model_layers(model))
    qi = torch.arange(S) if policy == "h2o" else torch.arange(S - w, S)
    if policy in ("h2o", "snapkv", "pyramidkv", "fastv"):
        red = _Received(qi)
        with probe(model, layers=list(range(L)), hidden=False, reduce=red):
            cache = _forward(model, emb, pos, None, logits_to_keep=1).past_key_values
        atts = [red.out[l] for l in range(L)]
        del red
    else:
        cache, atts = _forward(model, emb, pos, None, logits_to_keep=1).past_key_values, None
    image = torch.cat([p.image for p in pieces])[None]
    obs = Observation(attentions=atts, query_index=qi, num_new=S, image_mask=image,
                      protect=torch.cat([p.observe for p in pieces])[None] if protect else None)
    opts = {}
    if policy == "random":
        opts["generator"] = torch.Generator().manual_seed(seed)
    if policy == "fastv":
        opts["k_layer"] = min(2, L - 1)
    idx = POLICIES[policy](_CacheView(cache), budget, obs, **opts)
    del atts, obs
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


def _search_config(preset: str, **overrides) -> SearchConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    opts = {**PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}}
    return SearchConfig(**opts)


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
    preset: str = "default",
    precision: str | None = None,
    always_keep: str | None = None,
    replay: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    progress_bar: bool = False,
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
        seed: for ``random``. protect_answers: budgeted policies keep the answer spans first (as EMLoC does).
        image_size: ``(width, height)`` every image is resized to; None: all must share the first one's size.
        smooth_kernel: EMLoC's pooling width.
        preset: ``"default"`` or ``"reference"`` (the reference's numerics; :data:`apps.emloc.hf_search.PRESETS`).
        precision, always_keep, replay: override the preset's switches (:class:`apps.emloc.hf_search.SearchConfig`).
        progress: called with ``(chunks_done, chunks_total)``.
        progress_bar: tqdm bars over chunks and, inside each chunk, layers.
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
    cfg = None
    if policy == "emloc":
        cfg = _search_config(preset, delta=delta, ratios=tuple(ratios) if ratios else ratios,
                             smooth_kernel=smooth_kernel, precision=precision, always_keep=always_keep,
                             replay=replay)
        if not (isinstance(chunk_demos, int) and chunk_demos >= 1):
            raise ValueError(f"chunk_demos must be a positive int, got {chunk_demos!r}")
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
        first = suffix_pieces(model, processor, images[:1], labels[:1], prompt)[0]  # without the template's header
        suffixes = [(embed(model, first), positions(model, first), first.observe)]
        suffixes += [(e, pp, p.observe) for e, pp, p in zip(embeds[1:], own_pos[1:], pieces[1:])]
        L = len(model_layers(model))
        memory, offset = None, 0
        starts = list(range(0, len(pieces), chunk_demos))
        bar = _bar(progress_bar, len(starts), "emloc chunks")
        for c, s in enumerate(starts):
            sl = slice(s, s + chunk_demos)
            keep_mask = torch.cat([p.observe for p in pieces[sl]])
            with _bar(progress_bar, L, f"chunk {c + 1} layers", leave=False) as layers_bar:
                memory, rep = emloc_chunk(model, memory, embeds[sl], own_pos[sl], keep_mask, suffixes[sl], offset, cfg,
                                          num_layers=L, progress=layers_bar)  # fmt: skip
            offset = rep.next_position
            reports.append(rep)
            logger.debug("emloc chunk %d: ratios %s js %s", c, rep.ratios, rep.js)
            bar.update(1)
            if progress is not None:
                progress(c + 1, len(starts))
        bar.close()
        cache, nxt = memory, offset
        settings.update(delta=float(cfg.delta), ratios=list(cfg.ratios), chunk_demos=chunk_demos, observers="suffix",
                        smooth_kernel=cfg.smooth_kernel, preset=preset, precision=cfg.precision,
                        always_keep=cfg.always_keep, replay=cfg.replay)  # fmt: skip
    else:
        cache, nxt, extra = _budgeted(model, pieces, embeds, own_pos, policy, keep, window, seed, protect_answers)
        settings.update(extra, protect_answers=bool(protect_answers) if policy != "full" else False)
        if progress is not None:
            progress(1, 1)
    return HFContext(model=model, processor=processor, cache=cache, next_position=nxt, num_tokens=n_tok,
                     labels=sorted(set(labels)), settings=settings, reports=reports)


def _bar(enabled: bool, total: int, desc: str, leave: bool = True):
    """A tqdm bar (or a no-op with the same face when ``enabled`` is False)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=leave, disable=not enabled)


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
                "num_tokens": self.num_tokens, "labels": self.labels, "reports": [r.to_json() for r in self.reports]}
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
