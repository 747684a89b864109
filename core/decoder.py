"""Causal decoder language model on core's blocks, with a KV cache that keeps each token's position id.

Model (:class:`Decoder`, configured by :class:`DecoderConfig`): token embedding (or caller-given
``inputs_embeds``, e.g. image embeddings spliced into the text), ``depth`` pre-norm
:class:`~core.layers.SelfAttentionBlock` layers with rotary embeddings driven by **explicit position ids per
token** (RoPE-DHR ids, gaps and continued positions all work), optional tanh-gated cross-attention blocks
(:class:`~core.layers.GatedCrossAttentionBlock`) to a memory before every ``cross_every``-th layer, a final
LayerNorm and a tied or untied output head.

Layouts:
    tokens ``(B, S)`` int64; embeddings/hidden states ``(B, S, dim)``; logits ``(B, S, vocab)``.
    position ids ``(B, S)`` int64 (a ``(S,)`` tensor is broadcast over the batch).
    cache: :class:`~core.kv_cache.KVCache` (re-exported here): per layer keys/values
    ``(B, H_kv, S_l, head_dim)`` stored after RoPE, position ids ``(B, S_l)``, per-head padding mask
    ``(B, H_kv, S_l)``; see :mod:`core.kv_cache` for the per-head pruning layout.
    memory ``(B, M, memory_dim)`` with position ids ``(B, M)`` (RoPE on the memory keys, the tokens' own
    positions on the queries).

Mask semantics (as in :mod:`core.attention`: ``True`` = padded = never attended to):
    ``padding_mask`` ``(B, S)`` marks padded *input* tokens; they are stored in the cache as padded slots.
    A new token attends to every visible cached slot plus, causally, to the new tokens up to itself
    (bottom-right aligned causal mask), so "prefill after a cache" equals one long prefill.
    ``memory_padding_mask`` ``(B, M)`` marks padded memory tokens; ``memory_attn_bias`` (broadcastable to
    ``(B, H, S, M)``) can hide memory tokens from chosen queries (e.g. images that come later in the text).

Caches are immutable values: :meth:`Decoder.forward` returns a new cache (the old one is left as it was),
so a compressed prefix can be reused for many queries.

Attention probes: ``forward(..., attn_queries=idx)`` returns, per layer, the attention probabilities
``(B, H_q, Q, S_l + S)`` of the chosen new tokens over all keys of that layer (cache slots first, then the
new tokens), computed with fp32 reference math for those ``Q`` queries only; the layer's output still comes
from the configured backend. Padded or causally hidden keys get probability 0.

Weights: :meth:`Decoder.save` / :meth:`Decoder.load` write/read safetensors with the config in the header.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from core.kv_cache import KVCache, LayerKV, cached_attention, probe_attention
from core.layers import GatedCrossAttentionBlock, SelfAttentionBlock
from core.mha import ACTIVATIONS, check_backend
from core.rope import RotaryEmbedding
from core.infra.fileio import atomic_path, load_safetensors_model, open_safetensors

logger = logging.getLogger(__name__)

__all__ = [
    "DecoderConfig",
    "Decoder",
    "DecoderOutput",
    "GenerationOutput",
    "LayerKV",
    "KVCache",
    "cached_attention",
    "probe_attention",
]

MODEL_FORMAT = "longctx.decoder.v1"


@dataclass(kw_only=True)
class DecoderConfig:
    """Size and options of a :class:`Decoder`."""

    vocab_size: int = 256  # number of token ids
    dim: int = 64  # hidden size
    depth: int = 4  # decoder layers
    num_heads: int = 4  # query heads; head_dim = dim // num_heads
    num_kv_heads: int | None = None  # key/value heads (GQA); None = num_heads
    mlp_ratio: float = 4.0  # MLP hidden size as a multiple of dim
    activation: str = "gelu"  # MLP activation, one of core.mha.ACTIVATIONS
    rope_base: float = 10000.0  # RoPE frequency base (10000 for text)
    cross_every: int = 0  # gated cross-attention block before layers 0, k, 2k, ... (0 = none; CoMemo: 4)
    memory_dim: int | None = None  # features of the cross-attention memory; None = dim
    cross_gate_init: float = 0.0  # initial tanh-gate value: 0 makes the cross blocks the identity
    tie_embeddings: bool = True  # output head shares the token-embedding matrix
    bias: bool = False  # biases on attention/MLP projections (modern LMs use none)
    norm_eps: float = 1e-5  # LayerNorm epsilon
    backend: str = "auto"  # attention backend for every layer (see core.attention)
    head_dim: int = field(init=False)  # derived: dim // num_heads

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "depth", "num_heads"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.dim % self.num_heads != 0:
            raise ValueError(f"num_heads ({self.num_heads}) must divide dim ({self.dim})")
        self.head_dim = self.dim // self.num_heads
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim (dim / num_heads = {self.head_dim}) must be even for RoPE")
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if not (isinstance(self.num_kv_heads, int) and self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads == 0):
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must be a positive divisor of num_heads ({self.num_heads})")
        if not (isinstance(self.cross_every, int) and self.cross_every >= 0):
            raise ValueError(f"cross_every must be an int >= 0 (0 = no cross-attention), got {self.cross_every!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; choose one of {list(ACTIVATIONS)}")
        if not self.mlp_ratio > 0:
            raise ValueError(f"mlp_ratio must be > 0, got {self.mlp_ratio}")
        if not (isinstance(self.rope_base, (int, float)) and self.rope_base > 1):
            raise ValueError(f"rope_base must be a number > 1, got {self.rope_base!r}")
        check_backend(self.backend)
        if self.memory_dim is None:
            self.memory_dim = self.dim

    @property
    def cross_layers(self) -> list[int]:
        """Indices of the layers preceded by a gated cross-attention block."""
        return [] if self.cross_every == 0 else list(range(0, self.depth, self.cross_every))


@dataclass
class DecoderOutput:
    """Result of :meth:`Decoder.forward`.

    Attributes:
        logits: ``(B, S, vocab)`` fp32-or-model-dtype logits (``(B, Q, vocab)`` with ``logits_index``).
        cache: the cache after appending the new tokens (None when ``use_cache=False``).
        attentions: with ``attn_queries``: per layer ``(B, H_q, Q, S_l + S)`` probabilities, else None.
        hidden: with ``return_hidden``: final hidden states ``(B, S, dim)`` (after the last LayerNorm).
    """

    logits: torch.Tensor
    cache: KVCache | None = None
    attentions: list[torch.Tensor] | None = None
    hidden: torch.Tensor | None = None


@dataclass
class GenerationOutput:
    """Result of :meth:`Decoder.generate`.

    Attributes:
        tokens: ``(B, T)`` int64 new tokens, ``T <= max_new_tokens``; after a row's stop token the row is
            filled with ``pad_token_id``.
        lengths: ``(B,)`` number of generated tokens per row, the stop token included.
        cache: the cache after the last token fed to the model: the prompt and every generated token but
            the last (which was sampled, not yet fed).
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    cache: KVCache | None


class Decoder(nn.Module):
    """Causal decoder LM (see module docs for layouts, masks, cache and probes).

    Args:
        config: sizes and options.
        device, dtype: parameter factory arguments.

    Attributes:
        embed: token embedding ``(vocab, dim)``.
        layers: the :class:`~core.layers.SelfAttentionBlock` layers (pre-norm, used through their parts).
        cross: ``nn.ModuleDict`` layer index (str) -> :class:`~core.layers.GatedCrossAttentionBlock`.
        norm: final LayerNorm; ``lm_head``: output projection (its weight is ``embed.weight`` when tied).
    """

    def __init__(self, config: DecoderConfig, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        c = self.config = config
        self.embed = nn.Embedding(c.vocab_size, c.dim, **fk)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.rope = RotaryEmbedding(c.head_dim, base=c.rope_base, device=device)
        self.layers = nn.ModuleList(
            SelfAttentionBlock(
                c.dim, c.num_heads, mlp_ratio=c.mlp_ratio, activation=c.activation, num_kv_heads=c.num_kv_heads,
                norm_first=True, norm_eps=c.norm_eps, bias=c.bias, backend=c.backend, **fk,
            )
            for _ in range(c.depth)
        )
        self.cross = nn.ModuleDict(
            {
                str(i): GatedCrossAttentionBlock(
                    c.dim, c.num_heads, context_dim=c.memory_dim, norm_context=True, gate_init=c.cross_gate_init,
                    mlp_ratio=c.mlp_ratio, activation=c.activation, num_kv_heads=c.num_kv_heads, norm_eps=c.norm_eps,
                    bias=c.bias, backend=c.backend, **fk,
                )
                for i in c.cross_layers
            }
        )
        self.norm = nn.LayerNorm(c.dim, eps=c.norm_eps, **fk)
        self.lm_head = nn.Linear(c.dim, c.vocab_size, bias=False, **fk)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    @property
    def backend(self) -> str:
        return self.layers[0].attn.backend

    @backend.setter
    def backend(self, name: str) -> None:
        for block in [*self.layers, *self.cross.values()]:
            block.backend = name

    def _positions(self, position_ids, cache, B, S, device) -> torch.Tensor:
        if position_ids is None:
            start = torch.zeros(B, dtype=torch.long, device=device) if cache is None else cache.next_pos.to(device)
            return start[:, None] + torch.arange(S, device=device)[None]
        position_ids = torch.as_tensor(position_ids, device=device)
        if position_ids.dtype.is_floating_point:
            raise ValueError(f"position_ids must be integers, got {position_ids.dtype}")
        if position_ids.dim() == 1:
            position_ids = position_ids[None].expand(B, -1)
        if tuple(position_ids.shape) != (B, S):
            raise ValueError(f"position_ids must be (S,) or (B, S) = ({B}, {S}), got {tuple(position_ids.shape)}")
        return position_ids.long()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        use_cache: bool = True,
        padding_mask: torch.Tensor | None = None,
        memory_BMD: torch.Tensor | None = None,
        memory_position_ids: torch.Tensor | None = None,
        memory_padding_mask: torch.Tensor | None = None,
        memory_attn_bias: torch.Tensor | None = None,
        attn_queries: torch.Tensor | None = None,
        logits_index: torch.Tensor | None = None,
        return_hidden: bool = False,
    ) -> DecoderOutput:
        """Run new tokens after an optional cache.

        Args:
            input_ids: ``(B, S)`` token ids, or
            inputs_embeds: ``(B, S, dim)`` embeddings (exactly one of the two).
            position_ids: ``(S,)`` or ``(B, S)`` int position ids of the new tokens; default continues
                from ``cache.next_pos`` (or 0 without a cache).
            cache: keys/values of earlier tokens; the new tokens attend to all its visible slots.
            use_cache: return the extended cache.
            padding_mask: bool ``(B, S)``, True = padded input token (attended by nobody, kept as a
                padded cache slot; its own output is meaningless).
            memory_BMD: cross-attention memory ``(B, M, memory_dim)`` (needs ``cross_every > 0``).
            memory_position_ids: ``(M,)`` or ``(B, M)`` RoPE positions of the memory keys (default
                ``0..M-1``); the queries use the tokens' own positions.
            memory_padding_mask: bool ``(B, M)``, True = padded memory token.
            memory_attn_bias: additive bias broadcastable to ``(B, H, S, M)`` for the cross-attention
                (``-inf`` hides a memory token from a query; a query that sees no memory gets no update).
            attn_queries: ``(Q,)`` indices among the ``S`` new tokens whose attention probabilities to
                return (see module docs).
            logits_index: ``(Q,)`` indices among the new tokens for which to compute logits (default all).
            return_hidden: also return the final hidden states.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be (B, S), got shape {tuple(input_ids.shape)}")
            x_BSD = self.embed(input_ids)
        else:
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != self.config.dim:
                raise ValueError(f"inputs_embeds must be (B, S, {self.config.dim}), got {tuple(inputs_embeds.shape)}")
            x_BSD = inputs_embeds
        B, S, _ = x_BSD.shape
        if S == 0:
            raise ValueError("forward needs at least one new token")
        device = x_BSD.device
        if cache is not None and (cache.batch_size != B or cache.num_layers != self.config.depth):
            raise ValueError(
                f"cache has batch {cache.batch_size} and {cache.num_layers} layers; input has batch {B}, model depth {self.config.depth}"
            )
        pos_BS = self._positions(position_ids, cache, B, S, device)
        cos, sin = self.rope(pos_BS, dtype=x_BSD.dtype)  # (B, S, head_dim) each
        new_mask = None
        if padding_mask is not None:
            if padding_mask.dtype != torch.bool or tuple(padding_mask.shape) != (B, S):
                raise ValueError(f"padding_mask must be bool (B, S) = ({B}, {S}), got {padding_mask.dtype} {tuple(padding_mask.shape)}")
            new_mask = padding_mask.to(device)
        mem_rope = None
        if memory_BMD is not None:
            if not self.cross:
                raise ValueError("memory_BMD given but the model has no cross-attention blocks (cross_every=0)")
            M = memory_BMD.shape[1]
            mem_pos = self._positions(memory_position_ids, None, B, M, device) if memory_position_ids is not None else (
                torch.arange(M, device=device)[None].expand(B, -1)
            )
            mem_rope = self.rope(mem_pos, dtype=memory_BMD.dtype)
        if attn_queries is not None:
            attn_queries = torch.as_tensor(attn_queries, device=device).long().reshape(-1)
            if attn_queries.numel() and (int(attn_queries.min()) < 0 or int(attn_queries.max()) >= S):
                raise ValueError(f"attn_queries must index the {S} new tokens, got {attn_queries.tolist()}")
        new_layers, attentions = [], [] if attn_queries is not None else None
        for i, block in enumerate(self.layers):
            if memory_BMD is not None and str(i) in self.cross:
                x_BSD = self.cross[str(i)](
                    x_BSD, memory_BMD, context_padding_mask=memory_padding_mask, attn_bias=memory_attn_bias,
                    q_rope=(cos, sin), k_rope=mem_rope,
                )
            past = None if cache is None else cache.layers[i]
            x_BSD, layer, probs = self._layer(block, x_BSD, (cos, sin), pos_BS, new_mask, past, attn_queries)
            new_layers.append(layer)
            if attentions is not None:
                attentions.append(probs)
        h_BSD = self.norm(x_BSD)
        sel = h_BSD if logits_index is None else h_BSD[:, torch.as_tensor(logits_index, device=device).long()]
        logits = self.lm_head(sel)
        new_cache = None
        if use_cache:
            top = pos_BS.masked_fill(new_mask, -1) if new_mask is not None else pos_BS
            nxt = top.max(dim=1).values + 1
            if cache is not None:
                nxt = torch.maximum(nxt, cache.next_pos.to(device))
            new_cache = KVCache(layers=new_layers, next_pos=nxt)
        return DecoderOutput(logits=logits, cache=new_cache, attentions=attentions, hidden=h_BSD if return_hidden else None)

    def _layer(self, block: SelfAttentionBlock, x_BSD, rope, pos_BS, new_mask_BS, past: LayerKV | None, attn_queries):
        """One pre-norm decoder layer over the new tokens with the layer's cache; returns (x, LayerKV, probs)."""
        attn = block.attn
        h = block.norm1(x_BSD)
        q = attn.project_q(h, rope=rope)  # (B, H_q, S, hd)
        k, v = attn.project_kv(h, rope=rope)  # (B, H_kv, S, hd)
        B, Hkv, S, _ = k.shape
        mask = None if new_mask_BS is None else new_mask_BS[:, None, :].expand(B, Hkv, S)
        pos = pos_BS
        if past is not None:
            if past.mask is not None or mask is not None:
                pm = past.mask if past.mask is not None else torch.zeros(past.k.shape[:3], dtype=torch.bool, device=k.device)
                nm = mask if mask is not None else torch.zeros(B, Hkv, S, dtype=torch.bool, device=k.device)
                mask = torch.cat([pm, nm], dim=2)
            k = torch.cat([past.k.to(k.dtype), k], dim=2)  # (B, H_kv, S_past + S, hd)
            v = torch.cat([past.v.to(v.dtype), v], dim=2)
            pos = torch.cat([past.pos.to(pos.device), pos], dim=1)
        out = cached_attention(q, k, v, mask, backend=attn.backend, **attn.attention_options)
        x_BSD = x_BSD + attn.merge(out)
        x_BSD = x_BSD + block.mlp(block.norm2(x_BSD))
        probs = None
        if attn_queries is not None:
            probs = probe_attention(q[:, :, attn_queries], attn_queries, k, mask, S)
        return x_BSD, LayerKV(k, v, pos, mask), probs

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        padding_mask: torch.Tensor | None = None,
        max_new_tokens: int = 32,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        stop_token_ids: tuple[int, ...] | list[int] = (),
        pad_token_id: int | None = None,
        memory_BMD: torch.Tensor | None = None,
        memory_position_ids: torch.Tensor | None = None,
        memory_padding_mask: torch.Tensor | None = None,
    ) -> GenerationOutput:
        """Generate up to ``max_new_tokens`` tokens after a prompt (and an optional cache).

        The prompt (``input_ids`` or ``inputs_embeds``, with optional ``position_ids``/``padding_mask`` as in
        :meth:`forward`) is prefilled after ``cache``; each new token takes the next position
        (``cache.next_pos``). Greedy (argmax) unless ``do_sample``: then softmax of ``logits / temperature``
        over the ``top_k`` largest logits (all if None), drawn with ``generator`` (seeded for
        reproducibility). A row stops after emitting a token of ``stop_token_ids``; generation ends when
        every row stopped or ``max_new_tokens`` were made. ``memory_*`` are passed at every step (the
        memory's keys/values are recomputed each step). Batched prompts of different lengths must be
        left-padded (``padding_mask`` True on the left, positions starting at 0 after the padding): the
        first new token comes from the prompt's last column.
        """
        if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if do_sample and not temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
        if top_k is not None and not (isinstance(top_k, int) and top_k >= 1):
            raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
        stops = [int(t) for t in stop_token_ids]
        if pad_token_id is None:
            pad_token_id = stops[0] if stops else 0
        mem = {"memory_BMD": memory_BMD, "memory_position_ids": memory_position_ids, "memory_padding_mask": memory_padding_mask}
        out = self(
            input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids, cache=cache, padding_mask=padding_mask,
            logits_index=torch.tensor([-1]), **mem,
        )
        B = out.logits.shape[0]
        device = out.logits.device
        done = torch.zeros(B, dtype=torch.bool, device=device)
        lengths = torch.zeros(B, dtype=torch.long, device=device)
        stop_t = torch.tensor(stops, dtype=torch.long, device=device)
        tokens = []
        for step in range(max_new_tokens):
            logits_BV = out.logits[:, -1].float()
            if do_sample:
                logits_BV = logits_BV / temperature
                if top_k is not None and top_k < logits_BV.shape[-1]:
                    kth = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
                    logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
                probs = torch.softmax(logits_BV, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]  # generator on the logits' device
            else:
                nxt = logits_BV.argmax(dim=-1)
            nxt = torch.where(done, torch.full_like(nxt, pad_token_id), nxt)
            tokens.append(nxt)
            lengths += (~done).long()
            if stops:
                done = done | torch.isin(nxt, stop_t)
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            out = self(nxt[:, None], cache=out.cache, **mem)
        return GenerationOutput(tokens=torch.stack(tokens, dim=1), lengths=lengths, cache=out.cache)

    def config_json(self) -> str:
        """The config as JSON (e.g. for :meth:`KVCache.save` metadata); ``DecoderConfig(**json.loads(...))``
        rebuilds it."""
        d = {k: v for k, v in asdict(self.config).items() if k != "head_dim"}
        return json.dumps(d, sort_keys=True)

    def save(self, path: str | os.PathLike, *, metadata: dict[str, str] | None = None) -> Path:
        """Weights as safetensors with the config in the header (tied weights stored once), written atomically."""
        from safetensors.torch import save_model

        path = Path(path)
        with atomic_path(path) as tmp:
            save_model(self, tmp, metadata={"format": MODEL_FORMAT, "config": self.config_json(), **(metadata or {})})
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, *, device: torch.device | str = "cpu", backend: str | None = None) -> Decoder:
        """A decoder saved by :meth:`save` (strict keys), in eval mode; ``backend`` overrides the saved one."""
        path = Path(path)
        what = f"decoder weights written by Decoder.save (format {MODEL_FORMAT!r})"
        with open_safetensors(path, what=what) as f:
            meta = f.metadata() or {}
        if meta.get("format") != MODEL_FORMAT:
            raise ValueError(f"{path} is not a decoder file (format {meta.get('format')!r}, expected {MODEL_FORMAT!r})")
        cfg = json.loads(meta["config"])
        if backend is not None:
            cfg["backend"] = backend
        model = cls(DecoderConfig(**cfg), device=device)
        load_safetensors_model(model, path, what=what, device=device)
        return model.eval()
