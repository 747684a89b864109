"""Compress many demonstrations into a reusable KV prefix and answer queries against it.

    from apps.emloc import compress, CompressedContext
    ctx = compress(model, (images_KHW, labels_K), delta=0.005)   # EMLoC, chunk by chunk
    pred_Q = ctx.predict(query_images_QHW)                       # label ids
    ctx.save("memory.safetensors"); ctx = CompressedContext.load("memory.safetensors", model)

``compress(..., policy="snapkv", keep=0.2)`` builds the same kind of context with a budgeted baseline of
:mod:`core.kv_compress` (one prefill of all demos, then ``keep`` of the tokens per layer and KV head), and
``policy="full"`` keeps everything; EMLoC itself does not care which decoder it compresses (it needs
:class:`~core.decoder.Decoder` and the host's image embedder only).

Memory files are the cache's safetensors with a header naming the model (``model_fingerprint``: a hash of the
host's config and weights) and the settings; :meth:`CompressedContext.load` refuses a file made by another
model, or with settings other than the ones asked for.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from apps.emloc.model import EMLoCHost
from core.decoder import KVCache, LayerKV
from core.infra.fileio import open_safetensors
from core.kv_compress import POLICIES, Chunk, ChunkReport, EMLoCConfig, emloc_compress, observe
from core.kv_compress import compress as compress_cache

logger = logging.getLogger(__name__)

__all__ = ["CompressedContext", "compress", "check_demos", "MEMORY_FORMAT"]

MEMORY_FORMAT = "longctx.emloc.memory.v1"


def check_demos(model: EMLoCHost, demos) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate demonstrations: ``(images (K, size, size), labels (K,))`` or a list of ``(image, label)`` pairs.

    Raises:
        ValueError: no demos, a missing label (None or NaN), a label outside ``0..num_labels-1``, fewer than two
            classes, images of the wrong size or with non-finite pixels.
    """
    c = model.config
    if isinstance(demos, (tuple, list)) and len(demos) == 2 and isinstance(demos[0], torch.Tensor) and demos[0].dim() == 3:
        images, labels = demos
    else:
        pairs = list(demos)
        if not pairs:
            raise ValueError("no demonstrations given")
        for i, p in enumerate(pairs):
            if not (isinstance(p, (tuple, list)) and len(p) == 2) or p[1] is None:
                raise ValueError(f"demonstration {i} has no label: expected (image, label) pairs, got {type(p).__name__}")
        images = torch.stack([torch.as_tensor(p[0], dtype=torch.float32) for p in pairs])
        labels = torch.as_tensor([float(p[1]) for p in pairs])
    if labels is None:
        raise ValueError("demonstrations without labels: pass (images, labels)")
    labels = torch.as_tensor(labels)
    images = torch.as_tensor(images, dtype=torch.float32)
    if images.dim() != 3 or images.shape[1:] != (c.image_size, c.image_size):
        raise ValueError(f"demo images must be (K, {c.image_size}, {c.image_size}), got {tuple(images.shape)}")
    if labels.shape != (images.shape[0],):
        raise ValueError(f"need one label per demo image: {images.shape[0]} images, labels of shape {tuple(labels.shape)}")
    if images.shape[0] == 0:
        raise ValueError("no demonstrations given")
    if labels.dtype.is_floating_point:
        if bool(torch.isnan(labels).any()):
            raise ValueError(f"demonstrations without labels (NaN) at {torch.isnan(labels).nonzero()[:, 0].tolist()[:10]}")
        if bool((labels != labels.round()).any()):
            raise ValueError("labels must be integer ids")
    labels = labels.long()
    if int(labels.min()) < 0 or int(labels.max()) >= c.num_labels:
        raise ValueError(f"labels must lie in 0..{c.num_labels - 1}, got values {sorted(set(labels.tolist()))[:10]}")
    if labels.unique().numel() < 2:
        raise ValueError(f"the demonstrations have one class only (label {int(labels[0])}); need at least two")
    if not bool(torch.isfinite(images).all()):
        raise ValueError("demo images contain NaN or infinite pixels")
    return images, labels


def _expand(cache: KVCache, B: int) -> KVCache:
    """A batch-1 cache viewed ``B`` times (no copy)."""
    return KVCache(
        layers=[
            LayerKV(l.k.expand(B, -1, -1, -1), l.v.expand(B, -1, -1, -1), l.pos.expand(B, -1),
                    None if l.mask is None else l.mask.expand(B, -1, -1))
            for l in cache.layers
        ],
        next_pos=cache.next_pos.expand(B),
    )


@dataclass
class CompressedContext:
    """A compressed demonstration prefix bound to its host model.

    Attributes:
        model: the host; cache: the (batch 1) compressed KV cache.
        label_ids: ``(C,)`` the label ids seen in the demos (predictions are restricted to them).
        num_demos, num_tokens: demonstrations and tokens before compression.
        settings: how it was compressed (policy, delta, ratios, chunk_demos or keep).
        reports: EMLoC's per-chunk decisions (empty for other policies).
    """

    model: EMLoCHost
    cache: KVCache
    label_ids: torch.Tensor
    num_demos: int
    num_tokens: int
    settings: dict
    reports: list[ChunkReport] = field(default_factory=list)

    def kept_tokens(self) -> list[float]:
        """Per layer: tokens kept, averaged over KV heads."""
        return [float(c.float().mean()) for c in self.cache.kept_counts()]

    def keep_ratios(self) -> list[float]:
        """Per layer: fraction of the demo tokens kept (mean over KV heads)."""
        return [k / self.num_tokens for k in self.kept_tokens()]

    def keep_fraction(self) -> float:
        """Fraction of all (layer, head, token) cache entries kept."""
        return sum(self.kept_tokens()) / (self.num_tokens * self.cache.num_layers)

    def kept_map(self) -> torch.Tensor:
        """Bool ``(L, H_kv, num_tokens)``: whether each layer/head still sees each original token position."""
        out = []
        for l in self.cache.layers:
            vis = l.visible()[0]  # (H, S_l)
            m = torch.zeros(vis.shape[0], self.num_tokens, dtype=torch.bool)
            pos = l.pos[0].clamp(0, self.num_tokens - 1)
            m[:, pos] = vis
            out.append(m)
        return torch.stack(out)

    @torch.no_grad()
    def logits(self, images: torch.Tensor, *, batch_size: int = 64) -> torch.Tensor:
        """``(Q, C)`` logits over :attr:`label_ids` for query images ``(Q, size, size)``."""
        images = torch.as_tensor(images, dtype=torch.float32)
        c = self.model.config
        if images.dim() == 2:
            images = images[None]
        if images.dim() != 3 or images.shape[1:] != (c.image_size, c.image_size):
            raise ValueError(f"query images must be (Q, {c.image_size}, {c.image_size}), got {tuple(images.shape)}")
        if not bool(torch.isfinite(images).all()):
            raise ValueError("query images contain NaN or infinite pixels")
        self.model.eval()
        outs = []
        for s in range(0, images.shape[0], batch_size):
            x = self.model.embed_images(images[s : s + batch_size])  # (b, P, dim)
            b = x.shape[0]
            out = self.model.decoder(inputs_embeds=x, cache=_expand(self.cache, b), use_cache=False, logits_index=torch.tensor([-1]))
            outs.append(out.logits[:, -1, self.label_ids])
        return torch.cat(outs)

    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """``(Q,)`` predicted label ids for query images ``(Q, size, size)``."""
        return self.label_ids[self.logits(images).argmax(-1)]

    def metadata(self) -> dict[str, str]:
        return {
            "emloc_format": MEMORY_FORMAT,
            "model_fingerprint": self.model.fingerprint(),
            "host_config": self.model.config.to_json(),
            "settings": json.dumps(self.settings, sort_keys=True),
            "label_ids": json.dumps(self.label_ids.tolist()),
            "num_demos": str(self.num_demos),
            "num_tokens": str(self.num_tokens),
            "reports": json.dumps([{"ratios": r.ratios, "js": r.js, "kept": r.kept, "num_tokens": r.num_tokens} for r in self.reports]),
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write the memory (safetensors + header naming the model and settings), atomically."""
        return self.cache.save(path, metadata=self.metadata())

    @classmethod
    def load(cls, path: str | os.PathLike, model: EMLoCHost, *, settings: dict | None = None) -> CompressedContext:
        """Read a memory written by :meth:`save` for ``model``.

        Raises:
            FileNotFoundError: no file. ValueError: not an EMLoC memory, made by another model, or (with
            ``settings``) made with other settings than those given.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no EMLoC memory file at {path}")
        with open_safetensors(path, what=f"an EMLoC memory written by apps.emloc.compress ({MEMORY_FORMAT!r})") as f:
            meta = dict(f.metadata() or {})
        if meta.get("emloc_format") != MEMORY_FORMAT:
            raise ValueError(f"{path} is not an EMLoC memory file (emloc_format {meta.get('emloc_format')!r}, expected {MEMORY_FORMAT!r})")
        fp = model.fingerprint()
        if meta["model_fingerprint"] != fp:
            raise ValueError(
                f"{path} was made by another model (fingerprint {meta['model_fingerprint']}, config {meta['host_config']}); "
                f"this model's fingerprint is {fp}: compress the demonstrations again with this model"
            )
        saved = json.loads(meta["settings"])
        if settings is not None:
            diff = {k: (saved.get(k), v) for k, v in settings.items() if saved.get(k) != v}
            if diff:
                raise ValueError(f"{path} was made with other settings: {', '.join(f'{k}={a!r} (asked {b!r})' for k, (a, b) in diff.items())}")
        reports = [ChunkReport(num_tokens=r["num_tokens"], num_answer=0, ratios=r["ratios"], js=r["js"], kept=r["kept"])
                   for r in json.loads(meta.get("reports", "[]"))]
        return cls(model=model, cache=KVCache.load(path), label_ids=torch.tensor(json.loads(meta["label_ids"]), dtype=torch.long),
                   num_demos=int(meta["num_demos"]), num_tokens=int(meta["num_tokens"]), settings=saved, reports=reports)


@torch.no_grad()
def compress(
    model: EMLoCHost,
    demos,
    *,
    delta: float = 0.005,
    ratios: tuple[float, ...] = (0.1, 0.2, 0.5),
    chunk_demos: int | None = None,
    policy: str = "emloc",
    keep: float | None = None,
    window: int = 8,
    seed: int = 0,
    always_keep: str = "label",
    progress: Callable[[int, int], None] | None = None,
    protect_answers: bool = False,
    observers: str = "chunk",
    processor=None,
    **hf_options,
) -> CompressedContext:
    """Compress demonstrations into a :class:`CompressedContext`.

    A transformers model (from :func:`core.hf.load`, with ``processor``) goes to :func:`apps.emloc.hf.compress_hf`
    (demonstrations are ``(image, label text)`` pairs; ``window`` defaults to 32 there, ``chunk_demos`` to 4, and
    ``hf_options`` such as ``prompt`` and ``image_size`` are passed on); it returns an
    :class:`apps.emloc.hf.HFContext`.

    Args:
        model: the host.
        demos: ``(images (K, size, size), labels (K,))`` or ``(image, label)`` pairs (see :func:`check_demos`).
        delta: EMLoC's JS-divergence bound per chunk (nats), > 0.
        ratios: keep ratios EMLoC tries per layer.
        chunk_demos: demonstrations per chunk (EMLoC; default 16 on the host).
        policy: ``"emloc"``, ``"full"`` or a budgeted policy of :data:`core.kv_compress.POLICIES`.
        keep: for budgeted policies, the fraction of demo tokens kept per layer and KV head, in (0, 1].
        window: observation window (last tokens) for snapkv/pyramidkv/fastv probes.
        seed: for ``random``.
        always_keep: EMLoC's always-kept tokens: ``"label"`` (each demo's label token: the demonstration's answer,
            as the method keeps answer tokens), ``"answer"`` (each demo's last image patch, the position whose
            output predicts the label and where the JS bound is measured) or ``"both"``. The answer positions
            score importance and carry the JS bound whichever is kept.
        progress: called with ``(chunks_done, chunks_total)``.
        observers: EMLoC's observers on the host: ``"chunk"`` (default; each chunk's own answer positions, causally)
            or ``"suffix"`` (the reference's: every demonstration of the chunk re-encoded as a suffix after it, so
            every chunk token is scored by every answer; the JS bound is measured on the suffixes).
        protect_answers: budgeted policies keep every demo's label token first (EMLoC's always-kept tokens) and
            spend the rest of the budget by their own ranking (``core.kv_compress.Observation.protect``).
    """
    if not isinstance(model, EMLoCHost):
        from apps.emloc.hf import REFERENCE_CHUNK_DEMOS, compress_hf

        opts = dict(hf_options)
        if window != 8:
            opts["window"] = window
        return compress_hf(model, demos, processor=processor, delta=delta, ratios=ratios, policy=policy, keep=keep,
                           seed=seed, progress=progress, protect_answers=protect_answers,
                           chunk_demos=REFERENCE_CHUNK_DEMOS if chunk_demos is None else chunk_demos, **opts)
    if hf_options:
        raise ValueError(f"options {sorted(hf_options)} are for transformers models; the host takes none of them")
    if chunk_demos is None:
        chunk_demos = 16
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {sorted(POLICIES)}")
    images, labels = check_demos(model, demos)
    model.eval()
    K = images.shape[0]
    n_tok = K * model.config.tokens_per_demo
    label_ids = labels.unique().sort().values
    x = model.embed_demos(images[None], labels[None])  # (1, K*(P+1), dim)
    ans = model.answer_mask(K)
    if policy == "emloc":
        if not (isinstance(delta, (int, float)) and delta > 0 and math.isfinite(delta)):
            raise ValueError(f"delta must be a number > 0 (JS divergence in nats, e.g. 0.005), got {delta!r}")
        if not (isinstance(chunk_demos, int) and chunk_demos >= 1):
            raise ValueError(f"chunk_demos must be a positive int, got {chunk_demos!r}")
        if always_keep not in ("answer", "label", "both"):
            raise ValueError(f"always_keep must be 'answer', 'label' or 'both', got {always_keep!r}")
        if observers not in ("chunk", "suffix"):
            raise ValueError(f"observers must be 'chunk' or 'suffix', got {observers!r}")
        cfg = EMLoCConfig(delta=float(delta), ratios=tuple(ratios))
        T = model.config.tokens_per_demo * chunk_demos
        lab = torch.arange(n_tok) % model.config.tokens_per_demo == model.config.tokens_per_image  # label tokens
        keep = {"answer": ans, "label": lab, "both": ans | lab}[always_keep]
        P = model.config.tokens_per_demo
        chunks = [Chunk(inputs_embeds=x[:, s : s + T], answer_mask=ans[s : s + T],
                        keep_mask=None if always_keep == "answer" else keep[s : s + T],
                        suffix_embeds=None if observers == "chunk" else x[0, s : s + T].reshape(-1, P, x.shape[-1]),
                        suffix_answer=None if observers == "chunk" else ans[:P])
                  for s in range(0, n_tok, T)]
        res = emloc_compress(model.decoder, chunks, config=cfg,
                             progress=None if progress is None else (lambda i, r: progress(i + 1, len(chunks))))
        settings = {"policy": "emloc", "delta": float(delta), "ratios": list(cfg.ratios), "chunk_demos": chunk_demos,
                    "always_keep": always_keep}
        if observers != "chunk":
            settings["observers"] = observers
        return CompressedContext(model=model, cache=res.cache, label_ids=label_ids, num_demos=K, num_tokens=n_tok,
                                 settings=settings, reports=res.reports)
    settings: dict = {"policy": policy}
    if policy == "full":
        out = model.decoder(inputs_embeds=x)
        cache = out.cache
    else:
        if keep is None or not (isinstance(keep, (int, float)) and 0 < keep <= 1):
            raise ValueError(f"policy {policy!r} needs keep, the fraction of tokens kept, in (0, 1]; got {keep!r}")
        budget = int(round(keep * n_tok))
        if budget < 1:
            raise ValueError(f"a budget of zero tokens: keep={keep} of {n_tok} demo tokens rounds to 0")
        w = min(window, budget, n_tok)
        out, obs = observe(model.decoder, inputs_embeds=x, query_index="all" if policy == "h2o" else w)
        obs.image_mask = (torch.arange(n_tok) % model.config.tokens_per_demo < model.config.tokens_per_image)[None]  # (1, S)
        if protect_answers:  # the label tokens, as EMLoC keeps them
            obs.protect = (torch.arange(n_tok) % model.config.tokens_per_demo == model.config.tokens_per_image)[None]
        opts = {"generator": torch.Generator().manual_seed(seed)} if policy == "random" else {}
        cache = compress_cache(out.cache, policy, budget, obs, **opts)
        settings.update(keep=float(keep), window=w)
        if protect_answers:
            settings["protect_answers"] = True
    if progress is not None:
        progress(1, 1)
    return CompressedContext(model=model, cache=cache, label_ids=label_ids, num_demos=K, num_tokens=n_tok, settings=settings)
