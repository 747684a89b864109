"""Greedy answers from a CoMemo model (the one inference function behind ``CoMemo.answer``, the predict CLI
and the benchmark).

The prompt is prefilled with the same inputs as in training (with ``memory_queries="text"`` image slots get
no memory-path update, via ``memory_attn_bias``), except its last token, which :meth:`core.decoder.Decoder.generate` feeds together
with the cache; generation then continues the positions after the prompt's largest id. The memory's keys/values are computed
once (:meth:`~apps.comemo.model.CoMemoModel.memory_kv_cache`) and reused at every step.
"""

from __future__ import annotations

import contextlib
import time

import torch

from apps.comemo.batch import build_batch
from apps.comemo.model import CoMemoModel
from apps.comemo.tokenizer import CoMemoTokenizer

__all__ = ["generate_answer"]


@torch.no_grad()
def generate_answer(model: CoMemoModel, tok: CoMemoTokenizer, images: list, question: str, *,
                    max_new_tokens: int = 64, cache_memory: bool = True) -> dict:
    """Answer one ``question`` about ``images`` greedily.

    ``cache_memory``: the memory's keys/values are computed once for the prompt and reused at every decoding
    step (False: recomputed at every step, as before; the answers are the same).

    Returns:
        ``{"answer": text, "tokens": ids without </s>, "seconds": wall time of encoding + generation}``.
    """
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    batch = build_batch([(images, question, None)], tok, model.cfg).to(device)
    room = model.cfg.max_context - batch.input_ids.shape[1]
    if room < 1:
        raise ValueError(f"the prompt fills the whole context ({model.cfg.max_context} tokens); no room for an answer")
    kw = model.decoder_inputs(batch)
    embeds, pos = kw.pop("inputs_embeds"), kw.pop("position_ids")
    kw.pop("padding_mask")
    bias = kw.pop("memory_attn_bias", None)
    with model.memory_kv_cache() if cache_memory else contextlib.nullcontext():
        gen = _generate(model, tok, embeds, pos, bias, kw, min(max_new_tokens, room))
    ids = gen.tokens[0, : int(gen.lengths[0])].tolist()
    if ids and ids[-1] == tok.eos_id:
        ids = ids[:-1]
    return {"answer": tok.decode(ids), "tokens": ids, "seconds": time.perf_counter() - t0}


def _generate(model, tok, embeds, pos, bias, kw, max_new_tokens):
    cache = None
    if embeds.shape[1] > 1:
        out = model.decoder(inputs_embeds=embeds[:, :-1], position_ids=pos[:, :-1],
                            memory_attn_bias=None if bias is None else bias[:, :, :-1], logits_index=torch.tensor([-1]), **kw)
        cache = out.cache
    return model.decoder.generate(inputs_embeds=embeds[:, -1:], position_ids=pos[:, -1:], cache=cache,
                                  max_new_tokens=max_new_tokens, stop_token_ids=[tok.eos_id],
                                  pad_token_id=tok.pad_id, **kw)
