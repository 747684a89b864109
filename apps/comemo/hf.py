"""CoMemo on a real InternVL-family model (transformers ``InternVLForConditionalGeneration``).

``CoMemo.from_hf(DIR)`` (or :func:`from_hf`) loads a local InternVL folder and inserts the memory path into its
language model with :func:`core.hf.insert_before`, without editing transformers' classes:

- a memory block (:class:`core.layers.GatedCrossAttentionBlock`, RMSNorm, tanh gates initialised to 0) before
  every decoder layer ``i`` with ``(i + 1) % every == 0`` (CoMemo's released placement; ``every`` = 4 by default);
  the block's one RMSNorm is shared by the text queries and the image memory, as in the reference;
- the memory: every image token of the prompt (each image's tiles, then its thumbnail), as the projector gives
  them, with keys rotated at their RoPE-DHR ids;
- queries: every token (``queries="all"``, the reference) or the text tokens only (``"text"``);
- positions: RoPE-DHR ids (:func:`dhr_position_ids`) are fed to the language model (its own rotary embedding
  rotates queries and keys of self-attention and memory alike); ``positions="1d"`` keeps ``0, 1, 2, ...``;
- the memory's keys/values are computed once per prompt and kept through decoding (:meth:`HFCoMemo.generate`).

Tile order: InternVL crops tiles row-major (tile ``t`` at row ``t // cols``, column ``t % cols``), and RoPE-DHR ids
are assigned in that order here (:func:`core.rope.rope_dhr_position_ids`), so a tile token's id is the thumbnail
cell it lies in. The grid ``(rows, cols)`` of each image is given (``image_grids``), or read from the image
sizes with InternVL's rule (:func:`apps.comemo.tiling.closest_grid`).

With every gate at 0 the wrapped model computes exactly what the unmodified model computes at the same position
ids (tests/test_comemo_hf.py).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from torch import nn

from core.layers import GatedCrossAttentionBlock
from core.rope import rope_dhr_position_ids

logger = logging.getLogger(__name__)

__all__ = ["HFCoMemo", "from_hf", "dhr_position_ids", "memory_layers", "MEMORY_FILE", "QUERIES", "POSITIONS"]

MEMORY_FILE = "comemo_memory.safetensors"
MEMORY_FORMAT = "longctx.comemo.hf-memory.v1"
QUERIES = ("all", "text")
POSITIONS = ("dhr", "1d")


def memory_layers(num_layers: int, every: int) -> list[int]:
    """Decoder layers preceded by a memory block: ``i`` with ``(i + 1) % every == 0`` (the reference)."""
    if not (isinstance(every, int) and every >= 1):
        raise ValueError(f"every must be a positive int, got {every!r}")
    layers = [i for i in range(num_layers) if (i + 1) % every == 0]
    if not layers:
        raise ValueError(f"every={every} places no memory block in a model with {num_layers} decoder layers")
    return layers


def _image_lengths(grids: list[tuple[int, int]], tokens_per_tile: int) -> list[int]:
    return [(r * c + (1 if r * c > 1 else 0)) * tokens_per_tile for r, c in grids]


def dhr_position_ids(input_ids: torch.Tensor, image_token_id: int, grids: list[list[tuple[int, int]]],
                     tokens_per_side: int, *, mode: str = "dhr") -> torch.Tensor:
    """``(B, S)`` position ids: text tokens count up; each image (its run of image tokens: ``rows * cols`` tiles of
    ``T * T`` tokens, row-major, then a ``T * T`` thumbnail when there is more than one tile) takes RoPE-DHR ids
    starting at the next free position and uses ``T * T`` of them whatever its tile count.

    Args:
        input_ids: ``(B, S)`` ids, image tokens as ``image_token_id``.
        image_token_id: the image placeholder id.
        grids: per row, the ``(rows, cols)`` of each of its images, in order.
        tokens_per_side: ``T`` (image tokens per tile side after pixel shuffle).
        mode: ``"dhr"`` or ``"1d"`` (``0 .. S-1``).
    """
    B, S = input_ids.shape
    if mode == "1d":
        return torch.arange(S, device=input_ids.device)[None].expand(B, -1).clone()
    if mode != "dhr":
        raise ValueError(f"positions must be one of {POSITIONS}, got {mode!r}")
    if len(grids) != B:
        raise ValueError(f"image_grids has {len(grids)} rows for a batch of {B}")
    T = tokens_per_side
    out = torch.empty(B, S, dtype=torch.long)
    ids = input_ids.cpu()
    for b in range(B):
        is_img = (ids[b] == image_token_id).tolist()
        lengths = _image_lengths([tuple(g) for g in grids[b]], T * T)
        if sum(is_img) != sum(lengths):
            raise ValueError(f"row {b}: {sum(is_img)} image tokens, but its grids {grids[b]} need {sum(lengths)} "
                             f"({T * T} per tile, plus a thumbnail for more than one tile)")
        p, i, k = 0, 0, 0
        while i < S:
            if not is_img[i]:
                out[b, i] = p
                p, i = p + 1, i + 1
                continue
            rows, cols = grids[b][k]
            n = lengths[k]
            if not all(is_img[i:i + n]):
                raise ValueError(f"row {b}: image {k} ({rows}x{cols} tiles) needs {n} consecutive image tokens")
            if rows * cols == 1:
                ids_k = p + torch.arange(T * T)
            else:
                tile_ids, thumb_ids = rope_dhr_position_ids((rows, cols), T, T, start=p)
                ids_k = torch.cat([tile_ids.flatten(), thumb_ids])
            out[b, i:i + n] = ids_k
            p, i, k = p + T * T, i + n, k + 1
    return out.to(input_ids.device)


class _MemoryState:
    """What the memory blocks read during one forward (set by :class:`HFCoMemo`)."""

    def __init__(self) -> None:
        self.kv_computations = 0  # memory key/value projections so far (all prompts)
        self.clear()

    def clear(self) -> None:
        self.memory = None  # (B, M, D)
        self.padding = None  # (B, M) bool, True = padded
        self.k_rope = None
        self.q_rope = None
        self.q_bias = None  # (B, 1, S, 1) additive: -inf rows get no update (queries="text")
        self.kv: dict[int, tuple] = {}  # layer -> memory keys/values of the current prompt
        self.cache_kv = False


class MemoryBlock(nn.Module):
    """The module inserted before a decoder layer: the gated cross-attention reading the shared state."""

    def __init__(self, block: GatedCrossAttentionBlock, state: _MemoryState, layer: int) -> None:
        super().__init__()
        self.block = block
        self.layer = layer
        object.__setattr__(self, "_state", state)  # not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        st = self._state
        if st.memory is None:
            return x
        kv = st.kv.get(self.layer) if st.cache_kv else None
        if kv is None:
            kv = self.block.memory_kv(st.memory.to(x.dtype), k_rope=st.k_rope)
            st.kv_computations += 1
            if st.cache_kv:
                st.kv[self.layer] = kv
        bias = st.q_bias if st.q_bias is not None and st.q_bias.shape[2] == x.shape[1] else None
        return self.block(x, context_padding_mask=st.padding, attn_bias=bias, q_rope=st.q_rope, memory_kv=kv)


def _check_internvl(model) -> None:
    cfg = getattr(model, "config", None)
    if getattr(cfg, "model_type", None) != "internvl" or not hasattr(getattr(model, "model", None), "get_image_features"):
        kind = getattr(cfg, "model_type", type(model).__name__)
        raise ValueError(f"CoMemo.from_hf needs an InternVL-family model (transformers InternVLForConditionalGeneration, "
                         f"model_type 'internvl'); this is {kind!r}")


class HFCoMemo(nn.Module):
    """An InternVL model with the CoMemo memory path (see module docs).

    Args:
        model: an ``InternVLForConditionalGeneration``.
        processor: its processor (optional; used by the recipe and :meth:`prompt`).
        every: a memory block before layer ``i`` when ``(i + 1) % every == 0``.
        queries: ``"all"`` or ``"text"``.
        positions: ``"dhr"`` or ``"1d"``.
        mlp_hidden_dim: the memory block FFN width (default: the language model's ``intermediate_size``).
    """

    def __init__(self, model, processor=None, *, every: int = 4, queries: str = "all", positions: str = "dhr",
                 mlp_hidden_dim: int | None = None) -> None:
        super().__init__()
        from core.hf import decoder_layers, insert_before

        _check_internvl(model)
        if queries not in QUERIES:
            raise ValueError(f"queries must be one of {QUERIES}, got {queries!r}")
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")
        self.model = model
        self.processor = processor
        self.queries, self.positions, self.every = queries, positions, every
        tc = model.config.text_config
        self.layers = memory_layers(len(decoder_layers(model)), every)
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        self.block_kwargs = dict(
            dim=tc.hidden_size, num_heads=tc.num_attention_heads, num_kv_heads=tc.num_key_value_heads,
            head_dim=head_dim, mlp_hidden_dim=mlp_hidden_dim or tc.intermediate_size, norm_eps=tc.rms_norm_eps)
        self.state = _MemoryState()
        ref = next(model.parameters())
        blocks = {}
        for i in self.layers:
            kw = dict(self.block_kwargs)
            blk = GatedCrossAttentionBlock(kw.pop("dim"), kw.pop("num_heads"), norm="rms", norm_context="shared",
                                           gate_init=0.0, activation="silu", bias=False, **kw)
            blocks[i] = MemoryBlock(blk.to(dtype=ref.dtype), self.state, i)
        # the blocks live in the model (registered once, under the decoder layers); this is a plain index of them
        object.__setattr__(self, "memory", {str(i): m for i, m in insert_before(model, blocks).items()})
        side = (model.config.vision_config.image_size[0] // model.config.vision_config.patch_size[0]
                if isinstance(model.config.vision_config.image_size, (list, tuple))
                else model.config.vision_config.image_size // model.config.vision_config.patch_size)
        self.tokens_per_side = int(round(side * model.config.downsample_ratio))
        if self.tokens_per_side ** 2 != model.config.image_seq_length:
            raise ValueError(f"image_seq_length {model.config.image_seq_length} is not {self.tokens_per_side}**2")

    # -- pieces -------------------------------------------------------------------------------------------------
    @property
    def image_token_id(self) -> int:
        return int(self.model.config.image_token_id)

    @property
    def language_model(self):
        return self.model.model.language_model

    def gates(self) -> dict[str, float]:
        """tanh of every memory gate."""
        return {f"layer{i}.{g}": float(torch.tanh(getattr(m.block, g + "_gate").detach()))
                for i, m in self.memory.items() for g in ("attn", "ff")}

    def position_ids(self, input_ids: torch.Tensor, image_grids=None) -> torch.Tensor:
        grids = self._grids(input_ids, image_grids)
        return dhr_position_ids(input_ids, self.image_token_id, grids, self.tokens_per_side, mode=self.positions)

    def _grids(self, input_ids, image_grids):
        if image_grids is not None:
            return [[tuple(g) for g in row] for row in image_grids]
        T2 = self.tokens_per_side ** 2
        out = []  # no grids given: every image a single tile (runs of exactly T*T tokens)
        for row in (input_ids == self.image_token_id).cpu():
            n = int(row.sum())
            if n % T2:
                raise ValueError(f"{n} image tokens are not whole tiles of {T2}; pass image_grids")
            out.append([(1, 1)] * (n // T2))
        return out

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``(tiles, 3, H, W)`` -> ``(tiles, T*T, hidden)`` projected image tokens."""
        out = self.model.model.get_image_features(pixel_values=pixel_values, return_dict=True)
        return getattr(out, "pooler_output", out)

    def _inputs(self, input_ids, pixel_values, image_grids):
        """Embeddings with the image tokens scattered in, position ids, memory and its ids."""
        embed = self.model.get_input_embeddings()
        x = embed(input_ids)
        pos = self.position_ids(input_ids, image_grids)
        mask = input_ids == self.image_token_id
        memory = padding = mem_pos = None
        if pixel_values is not None:
            feats = self.image_features(pixel_values).to(x.dtype).reshape(-1, x.shape[-1])
            if feats.shape[0] != int(mask.sum()):
                raise ValueError(f"{feats.shape[0]} image features for {int(mask.sum())} image tokens")
            x = x.masked_scatter(mask[..., None], feats)
            counts = mask.sum(1).tolist()
            M = max(counts)
            if M > 0:
                memory = x.new_zeros(x.shape[0], M, x.shape[-1])
                padding = torch.ones(x.shape[0], M, dtype=torch.bool, device=x.device)
                mem_pos = torch.zeros(x.shape[0], M, dtype=torch.long, device=x.device)
                for b, n in enumerate(counts):
                    memory[b, :n] = x[b][mask[b]]
                    padding[b, :n] = False
                    mem_pos[b, :n] = pos[b][mask[b]]
        return x, pos, mask, memory, padding, mem_pos

    def _set_memory(self, memory, padding, mem_pos, image_mask, *, cache_kv: bool) -> None:
        st = self.state
        st.clear()
        st.cache_kv = cache_kv
        if memory is None:
            return
        st.memory, st.padding = memory, padding
        st.k_rope = self.language_model.rotary_emb(memory, mem_pos)
        if self.queries == "text":
            st.q_bias = torch.zeros(image_mask.shape, dtype=memory.dtype, device=memory.device).masked_fill(
                image_mask, float("-inf"))[:, None, :, None]

    def _set_queries(self, x, pos) -> None:
        self.state.q_rope = self.language_model.rotary_emb(x, pos)

    # -- forward / generate -------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None, *, image_grids=None,
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None, **kwargs):
        """The model's output on a whole prompt (no cache): ``.logits``, and ``.loss`` with ``labels``."""
        x, pos, mask, memory, padding, mem_pos = self._inputs(input_ids, pixel_values, image_grids)
        self._set_memory(memory, padding, mem_pos, mask, cache_kv=False)
        self._set_queries(x, pos)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        try:
            return self.model(inputs_embeds=x, position_ids=pos, attention_mask=attention_mask, labels=labels,
                              use_cache=False, **kwargs)
        finally:
            self.state.clear()

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None, *, image_grids=None,
                 max_new_tokens: int = 32, stop_token_ids=(), cache_memory: bool = True) -> torch.Tensor:
        """Greedy tokens ``(B, T)`` after the prompt (a KV cache for self-attention; each new token at the next
        position after the prompt's largest id). ``cache_memory``: the memory's keys/values are computed once
        at the prompt and reused at every step (False: recomputed at every step)."""
        from transformers import DynamicCache

        if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        x, pos, mask, memory, padding, mem_pos = self._inputs(input_ids, pixel_values, image_grids)
        self._set_memory(memory, padding, mem_pos, mask, cache_kv=cache_memory)
        B = input_ids.shape[0]
        try:
            self._set_queries(x, pos)
            cache = DynamicCache(config=self.model.config)
            att = torch.ones_like(input_ids)
            out = self.model(inputs_embeds=x, position_ids=pos, attention_mask=att, past_key_values=cache,
                             use_cache=True)
            nxt_pos = pos.amax(dim=1, keepdim=True) + 1
            done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
            stops = torch.tensor(list(stop_token_ids), dtype=torch.long, device=input_ids.device)
            self.state.q_bias = None  # new tokens are text
            toks = []
            for step in range(max_new_tokens):
                tok = out.logits[:, -1].argmax(-1)
                if len(stops):
                    tok = torch.where(done, toks[-1] if toks else tok, tok)
                    done = done | torch.isin(tok, stops)
                toks.append(tok)
                if step == max_new_tokens - 1 or bool(done.all()):
                    break
                att = torch.cat([att, torch.ones(B, 1, dtype=att.dtype, device=att.device)], dim=1)
                emb = self.model.get_input_embeddings()(tok[:, None])
                self._set_queries(emb, nxt_pos)
                out = self.model(inputs_embeds=emb, position_ids=nxt_pos, attention_mask=att, past_key_values=cache,
                                 use_cache=True)
                nxt_pos = nxt_pos + 1
            return torch.stack(toks, dim=1)
        finally:
            self.state.clear()

    # -- training helpers, files --------------------------------------------------------------------------------
    def parameter_groups(self) -> dict[str, list[tuple[str, nn.Parameter]]]:
        """Named parameters by part: ``memory``, ``gates``, ``projector``, ``vision``, ``llm``."""
        groups: dict[str, list] = {"memory": [], "gates": [], "projector": [], "vision": [], "llm": []}
        for name, p in self.model.named_parameters():
            if ".inserted." in name:
                groups["gates" if name.endswith(("attn_gate", "ff_gate")) else "memory"].append((name, p))
            elif ".multi_modal_projector." in name or name.startswith("multi_modal_projector."):
                groups["projector"].append((name, p))
            elif ".vision_tower." in name or name.startswith("vision_tower."):
                groups["vision"].append((name, p))
            else:
                groups["llm"].append((name, p))
        return groups

    def memory_state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{i}.{k}": v for i, m in self.memory.items() for k, v in m.block.state_dict().items()}

    def memory_config(self) -> dict:
        return {"every": self.every, "queries": self.queries, "positions": self.positions, "layers": self.layers,
                "mlp_hidden_dim": self.block_kwargs["mlp_hidden_dim"]}

    def save_pretrained(self, folder: str | os.PathLike) -> Path:
        """The base model (memory blocks taken out), its processor, and ``comemo_memory.safetensors``."""
        from safetensors.torch import save_file

        from core.hf import insert_before, revert
        from core.infra.fileio import atomic_path

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        removed = revert(self.model)
        try:
            self.model.save_pretrained(str(folder))
        finally:
            insert_before(self.model, removed)
        if self.processor is not None:
            self.processor.save_pretrained(str(folder))
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.memory_state_dict().items()}
        with atomic_path(folder / MEMORY_FILE) as tmp:
            save_file(tensors, str(tmp), metadata={"format": MEMORY_FORMAT, "config": json.dumps(self.memory_config())})
        return folder

    def load_memory(self, path: str | os.PathLike) -> None:
        """Memory blocks from a ``comemo_memory.safetensors`` written by :meth:`save_pretrained` (strict)."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if meta.get("format") != MEMORY_FORMAT:
            raise ValueError(f"{path} is not a CoMemo memory file (format {meta.get('format')!r})")
        cfg = json.loads(meta["config"])
        if cfg["layers"] != self.layers:
            raise ValueError(f"{path} holds memory blocks before layers {cfg['layers']}, this model places them before "
                             f"{self.layers} (every={self.every})")
        tensors = load_file(str(path))
        for i, m in self.memory.items():
            own = {k[len(i) + 1:]: v for k, v in tensors.items() if k.split(".", 1)[0] == i}
            m.block.load_state_dict(own, strict=True)


def from_hf(path: str | os.PathLike, *, every: int | None = None, queries: str | None = None,
            positions: str | None = None, dtype=None, device=None, attn: str = "eager") -> HFCoMemo:
    """Load a local InternVL-family folder and add the memory path (see module docs).

    A folder written by :meth:`HFCoMemo.save_pretrained` (with ``comemo_memory.safetensors``) gets its trained
    memory blocks back, and its recorded ``every``/``queries``/``positions`` unless given here.
    """
    from core.hf import check_model_folder, load

    p, config = check_model_folder(path)
    if config.get("model_type") != "internvl":
        archs = config.get("architectures") or []
        raise ValueError(f"{path} holds a {config.get('model_type')!r} model ({', '.join(archs) or 'no architectures'}); "
                         "CoMemo.from_hf needs an InternVL-family model (InternVLForConditionalGeneration, "
                         "model_type 'internvl')")
    saved = {}
    mem_file = p / MEMORY_FILE
    if mem_file.is_file():
        from safetensors import safe_open

        with safe_open(str(mem_file), "pt") as f:
            saved = json.loads((f.metadata() or {}).get("config", "{}"))
    loaded = load(p, dtype=dtype if dtype is not None else torch.float32, device=device or "cpu", attn=attn)
    wrapped = HFCoMemo(loaded.model, loaded.processor, every=every or saved.get("every", 4),
                       queries=queries or saved.get("queries", "all"), positions=positions or saved.get("positions", "dhr"),
                       mlp_hidden_dim=saved.get("mlp_hidden_dim"))
    if mem_file.is_file():
        wrapped.load_memory(mem_file)
    return wrapped.eval()
