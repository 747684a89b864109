"""CoMemo on a real InternVL-family model (transformers ``InternVLForConditionalGeneration``).

``CoMemo.from_hf(DIR)`` (or :func:`from_hf`) loads a local InternVL folder and inserts the memory path into its
language model with :func:`core.hf.insert_before`, without editing transformers' classes:

- a memory block (:class:`core.layers.GatedCrossAttentionBlock`, RMSNorm, tanh gates initialised to 0) before
  every decoder layer ``i`` with ``(i + 1) % every == 0`` (CoMemo's released placement; ``every`` = 4 by default);
  the block's one RMSNorm is shared by the text queries and the image memory, as in the reference;
- the memory: every image token of the prompt (each image's tiles, then its thumbnail), as the projector gives
  them, with keys rotated at their RoPE-DHR ids;
- queries: every token (``queries="all"``, the reference) or the text tokens only (``"text"``);
- positions: RoPE-DHR ids (:func:`dhr_position_ids`) are fed to the language model; ``positions="1d"`` keeps
  ``0, 1, 2, ...``;
- the memory's keys/values are computed once per prompt and kept through decoding (:meth:`HFCoMemo.generate`).

The blocks' architecture is a :class:`apps.comemo.hf_config.MemoryConfig`: the project's layout by default (K/V
on the language model's grouped heads, SiLU FFN, the language model's rotary embedding and norm eps), the
released checkpoints' layout (full-head K/V, SwiGLU FFN, RoPE base 1e6, eps 1e-5, the release's RoPE-DHR cells)
when the folder was converted from a release by ``python -m apps.comemo.convert`` (recorded in its
``comemo_memory.safetensors``).

Tile order: InternVL crops tiles row-major (tile ``t`` at row ``t // cols``, column ``t % cols``), and RoPE-DHR ids
are assigned in that order here (:func:`core.rope.rope_dhr_position_ids`), so a tile token's id is the thumbnail
cell it lies in (``reference=True``: the release's column-first numbering). The grid ``(rows, cols)`` of each
image is given (``image_grids``); :meth:`HFCoMemo.prompt` and :meth:`HFCoMemo.answer` derive it from the images
with the folder's processor. A tiled image without its grid is refused, not silently given 1-D-like ids.

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

from apps.comemo.hf_config import (
    POSITIONS,
    QUERIES,
    MemoryConfig,
    PlainRope,
    dhr_position_ids,
    grids_without_sizes,
    memory_layers,
)
from core.layers import GatedCrossAttentionBlock

logger = logging.getLogger(__name__)

__all__ = ["HFCoMemo", "from_hf", "dhr_position_ids", "memory_layers", "MemoryConfig", "PlainRope", "MEMORY_FILE",
           "QUERIES", "POSITIONS", "read_memory_config"]

MEMORY_FILE = "comemo_memory.safetensors"
MEMORY_FORMAT = "longctx.comemo.hf-memory.v1"


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
        processor: its processor (optional; used by :meth:`prompt`, :meth:`answer` and the recipe).
        config: the memory blocks' architecture (:class:`apps.comemo.hf_config.MemoryConfig`); default the
            project's layout. ``every``, ``queries``, ``positions`` and ``mlp_hidden_dim`` (``ffn_hidden``) override
            its fields, for the calls written before it existed.
    """

    def __init__(self, model, processor=None, *, config: MemoryConfig | None = None, every: int | None = None,
                 queries: str | None = None, positions: str | None = None, mlp_hidden_dim: int | None = None) -> None:
        super().__init__()
        import dataclasses

        from core.hf import decoder_layers, insert_before

        _check_internvl(model)
        cfg = config or MemoryConfig()
        over = {k: v for k, v in (("every", every), ("queries", queries), ("positions", positions),
                                  ("ffn_hidden", mlp_hidden_dim)) if v is not None}
        self.config = dataclasses.replace(cfg, **over) if over else cfg
        self.model = model
        self.processor = processor
        tc = model.config.text_config
        self.layers = memory_layers(len(decoder_layers(model)), self.config.every)
        lm_head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        c = self.config
        num_heads = c.num_heads or tc.num_attention_heads
        head_dim = c.head_dim or (lm_head_dim if c.num_heads is None else tc.hidden_size // num_heads)
        num_kv = num_heads if c.kv_heads == "full" else tc.num_key_value_heads
        if num_heads % num_kv:
            raise ValueError(f"memory num_heads ({num_heads}) is not a multiple of the language model's KV heads "
                             f"({num_kv}); use kv_heads='full'")
        self.block_kwargs = dict(dim=tc.hidden_size, num_heads=num_heads, num_kv_heads=num_kv, head_dim=head_dim,
                                 mlp_hidden_dim=c.ffn_hidden or tc.intermediate_size,
                                 norm_eps=c.norm_eps if c.norm_eps is not None else tc.rms_norm_eps)
        ref = next(model.parameters())
        if c.rope_base is None:
            if head_dim != lm_head_dim:
                raise ValueError(f"memory head_dim {head_dim} differs from the language model's {lm_head_dim}: its "
                                 "rotary embedding cannot serve the memory; set rope_base")
            self.memory_rope = None
        else:
            self.memory_rope = PlainRope(head_dim, c.rope_base, device=ref.device)
        self.state = _MemoryState()
        blocks = {}
        for i in self.layers:
            kw = dict(self.block_kwargs)
            blk = GatedCrossAttentionBlock(kw.pop("dim"), kw.pop("num_heads"), norm="rms", norm_context="shared",
                                           gate_init=0.0, activation=c.ffn, bias=False, **kw)
            blocks[i] = MemoryBlock(blk.to(device=ref.device, dtype=ref.dtype), self.state, i)
        # the blocks live in the model (registered once, under the decoder layers); this is a plain index of them
        object.__setattr__(self, "memory", {str(i): m for i, m in insert_before(model, blocks).items()})
        side = (model.config.vision_config.image_size[0] // model.config.vision_config.patch_size[0]
                if isinstance(model.config.vision_config.image_size, (list, tuple))
                else model.config.vision_config.image_size // model.config.vision_config.patch_size)
        self.tokens_per_side = int(round(side * model.config.downsample_ratio))
        if self.tokens_per_side ** 2 != model.config.image_seq_length:
            raise ValueError(f"image_seq_length {model.config.image_seq_length} is not {self.tokens_per_side}**2")

    # the settings that callers read and switch directly
    @property
    def every(self) -> int:
        return self.config.every

    @property
    def queries(self) -> str:
        return self.config.queries

    @queries.setter
    def queries(self, value: str) -> None:
        if value not in QUERIES:
            raise ValueError(f"queries must be one of {QUERIES}, got {value!r}")
        self.config.queries = value

    @property
    def positions(self) -> str:
        return self.config.positions

    @positions.setter
    def positions(self, value: str) -> None:
        if value not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {value!r}")
        self.config.positions = value

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
        """``(B, S)`` position ids of a prompt (RoPE-DHR with the configured cells and tile order, or 1-D)."""
        if self.positions == "1d":
            return dhr_position_ids(input_ids, self.image_token_id, [], self.tokens_per_side, mode="1d")
        grids = self._grids(input_ids, image_grids)
        return dhr_position_ids(input_ids, self.image_token_id, grids, self.tokens_per_side, mode="dhr",
                                cells=self.config.dhr_cells, tile_order=self.config.tile_order)

    def _grids(self, input_ids, image_grids):
        if image_grids is not None:
            return [[tuple(g) for g in row] for row in image_grids]
        return grids_without_sizes(input_ids, self.image_token_id, self.tokens_per_side)

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
        st.k_rope = self._rope(memory, mem_pos)
        if self.queries == "text":
            st.q_bias = torch.zeros(image_mask.shape, dtype=memory.dtype, device=memory.device).masked_fill(
                image_mask, float("-inf"))[:, None, :, None]

    def _rope(self, x, pos):
        """``(cos, sin)`` of the memory's RoPE at ``pos`` (the language model's, or its own base)."""
        if self.memory_rope is not None:
            return self.memory_rope(x, pos)
        return self.language_model.rotary_emb(x, pos)

    def _set_queries(self, x, pos) -> None:
        self.state.q_rope = self._rope(x, pos)

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
                 max_new_tokens: int = 32, stop_token_ids=(), cache_memory: bool = True, output_logits: bool = False):
        """Greedy tokens ``(B, T)`` after the prompt (a KV cache for self-attention; each new token at the next
        position after the prompt's largest id, and it queries the memory there, or at the raw sequence count with
        ``decode_query_positions="count"``, the release). ``cache_memory``: the memory's keys/values are computed
        once at the prompt and reused at every step (False: recomputed at every step). ``output_logits``: also return
        the ``(B, T, vocab)`` logits each token was chosen from."""
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
            toks, logits = [], []
            for step in range(max_new_tokens):
                if output_logits:
                    logits.append(out.logits[:, -1].float())
                tok = out.logits[:, -1].argmax(-1)
                if len(stops):
                    tok = torch.where(done, toks[-1] if toks else tok, tok)
                    done = done | torch.isin(tok, stops)
                toks.append(tok)
                if step == max_new_tokens - 1 or bool(done.all()):
                    break
                att = torch.cat([att, torch.ones(B, 1, dtype=att.dtype, device=att.device)], dim=1)
                emb = self.model.get_input_embeddings()(tok[:, None])
                if self.config.decode_query_positions == "count":  # the release: the sequence length so far
                    self._set_queries(emb, torch.full_like(nxt_pos, input_ids.shape[1] + step))
                else:
                    self._set_queries(emb, nxt_pos)
                out = self.model(inputs_embeds=emb, position_ids=nxt_pos, attention_mask=att, past_key_values=cache,
                                 use_cache=True)
                nxt_pos = nxt_pos + 1
            if output_logits:
                return torch.stack(toks, dim=1), torch.stack(logits, dim=1)
            return torch.stack(toks, dim=1)
        finally:
            self.state.clear()

    # -- answering ----------------------------------------------------------------------------------------------
    def prompt(self, images, question: str, *, answer: str | None = None, **kwargs):
        """The model's inputs for ``images`` and ``question`` built with this folder's chat template and processor,
        tile grids included (:func:`apps.comemo.hf_prompt.build_inputs`)."""
        from apps.comemo.hf_prompt import build_inputs

        return build_inputs(self, images, question, answer=answer, **kwargs)

    @torch.no_grad()
    def answer(self, images, question: str, *, max_new_tokens: int = 64) -> str:
        """Greedy answer to ``question`` about ``images`` (paths, PIL images or arrays, in prompt order)."""
        from apps.comemo.hf_prompt import stop_token_ids

        enc = self.prompt(images, question)
        ref = next(self.model.parameters())
        pv = None if enc.pixel_values is None else enc.pixel_values.to(device=ref.device, dtype=ref.dtype)
        stops = stop_token_ids(self)
        toks = self.generate(enc.input_ids.to(ref.device), pv, image_grids=enc.image_grids,
                             max_new_tokens=max_new_tokens, stop_token_ids=stops)[0].tolist()
        if stops and any(t in stops for t in toks):
            toks = toks[:min(toks.index(t) for t in stops if t in toks)]
        tok = getattr(self.processor, "tokenizer", self.processor)
        return tok.decode(toks, skip_special_tokens=True).strip()

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
        """The settings recorded beside the memory weights: :class:`MemoryConfig` and the layers it places."""
        return {**self.config.to_dict(), "layers": self.layers, "mlp_hidden_dim": self.block_kwargs["mlp_hidden_dim"]}

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


def read_memory_config(folder: str | os.PathLike) -> dict | None:
    """The settings recorded in ``folder/comemo_memory.safetensors`` (None when the folder has no memory file)."""
    from safetensors import safe_open

    mem_file = Path(folder) / MEMORY_FILE
    if not mem_file.is_file():
        return None
    with safe_open(str(mem_file), "pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != MEMORY_FORMAT:
        raise ValueError(f"{mem_file} is not a CoMemo memory file (format {meta.get('format')!r}, "
                         f"expected {MEMORY_FORMAT!r})")
    return json.loads(meta.get("config", "{}"))


def from_hf(path: str | os.PathLike, *, every: int | None = None, queries: str | None = None,
            positions: str | None = None, reference: bool | None = None, dtype=None, device=None,
            attn: str = "longctx") -> HFCoMemo:
    """Load a local InternVL-family folder and add the memory path (see module docs).

    A folder with ``comemo_memory.safetensors`` (written by :meth:`HFCoMemo.save_pretrained`, the recipe, or
    ``python -m apps.comemo.convert`` from a released checkpoint) gets its memory blocks back with the architecture
    recorded there (a converted release: full-head K/V, SwiGLU, RoPE base 1e6, ...); ``every``/``queries``/
    ``positions`` given here override the recorded ones, ``reference=True`` switches tile order and decode query
    positions to the release's (:class:`MemoryConfig`).

    Args:
        device: None/``"auto"``: CUDA when present, else the CPU; a device this machine lacks is a one-line
            :class:`~core.infra.cli.UsageError`.
        dtype: None/``"auto"``: bf16 on CUDA, fp32 on the CPU.
        attn: the attention implementation of the transformers model (``"longctx"``: :mod:`core.attention`).
    """
    from core.hf import check_model_folder, load
    from core.infra.device import resolve_device, resolve_dtype

    p, config = check_model_folder(path)
    if config.get("model_type") == "comemo_chat" or "CoMemoChatModel" in (config.get("architectures") or []):
        raise ValueError(f"{path} is a released CoMemo checkpoint (CoMemoChatModel); convert it first: "
                         f"python -m apps.comemo.convert {path} OUT_DIR, then CoMemo.from_hf(OUT_DIR)")
    if config.get("model_type") != "internvl":
        archs = config.get("architectures") or []
        raise ValueError(f"{path} holds a {config.get('model_type')!r} model ({', '.join(archs) or 'no architectures'}); "
                         "CoMemo.from_hf needs an InternVL-family model (InternVLForConditionalGeneration, "
                         "model_type 'internvl')")
    saved = read_memory_config(p)
    dev = resolve_device(device)
    loaded = load(p, dtype=resolve_dtype(dtype, dev), device=dev, attn=attn)
    cfg = MemoryConfig.from_dict(saved) if saved else MemoryConfig()
    if reference is not None:
        cfg = cfg.with_reference(reference)
    wrapped = HFCoMemo(loaded.model, loaded.processor, config=cfg, every=every, queries=queries, positions=positions)
    if saved is not None:
        wrapped.load_memory(p / MEMORY_FILE)
    return wrapped.eval()
