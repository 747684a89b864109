"""kvpress beside the project's KV-cache policies, on the same model and tokens at equal budgets.

    python -m benchmarks.emloc_kvpress --out benchmarks/results/emloc_kvpress.json      # in an env with kvpress

The model is the tiny Qwen2-VL of ``tools/reference/emloc/tiny.py`` (eager attention, which kvpress's observed
attention press needs), the tokens the 8 demonstrations of its episode rendered with the chat template. Each kvpress
press runs during one prefill (``with press(model): model(...)``) at ``compression_ratio = 1 - keep``; each project
policy runs through ``compress_hf(policy=..., keep=keep)``; both keep ``int(keep * S)`` tokens per layer and KV head
(``keep`` is chosen so that the two roundings agree). Kept indices are read back by matching each kept key to the
unpruned cache of the same prefill path (exact copies). transformers 5.23 no longer passes ``cache_position`` to attention layers, which kvpress 0.5.2 reads in its hook:
a pre-hook here adds it (the prefill starts at 0). Agreement = |ours ∩ kvpress| / budget, per layer and KV
head, averaged. Settings as each library defines them unless ``--aligned``: then the project's SnapKV/PyramidKV
watch kvpress's window of 64 tokens.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time
from pathlib import Path

PAIRS = {"streaming": "StreamingLLMPress", "snapkv": "SnapKVPress", "pyramidkv": "PyramidKVPress",
         "h2o": "ObservedAttentionPress"}  # fmt: skip


def _indices(pruned, full) -> list[list[list[int]]]:
    """Per layer, per KV head: the positions in ``full`` of the keys kept in ``pruned`` (nearest key, exact copies)."""
    out = []
    for lp, lf in zip(pruned.layers, full.layers):
        kp, kf = lp.keys[0].float(), lf.keys[0].float()  # (H, K, D), (H, S, D)
        heads = []
        for h in range(kp.shape[0]):
            d = torch.cdist(kp[h], kf[h])
            heads.append(sorted(int(i) for i in d.argmin(-1)))
        out.append(heads)
    return out


def _agreement(a, b) -> float:
    num = den = 0
    for la, lb in zip(a, b):
        for ha, hb in zip(la, lb):
            num += len(set(ha) & set(hb))
            den += max(len(ha), 1)
    return num / den


def main(argv=None) -> int:
    global torch
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keep", type=float, default=0.25)
    p.add_argument("--aligned", action="store_true", help="the project's SnapKV/PyramidKV window = kvpress's (64)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/emloc_kvpress.json"))
    a = p.parse_args(argv)
    from core.infra.guard import check_outputs

    check_outputs([("--out", a.out)])
    import kvpress
    from PIL import Image
    from transformers import DynamicCache

    from apps.emloc.hf import compress_hf
    from tools.reference.emloc import tiny

    torch.set_num_threads(1)
    model = tiny.build_model(attn_implementation="eager")
    proc = tiny.build_processor()
    demos, _ = tiny.episode()
    msgs = []
    for img, label in demos:
        msgs += [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": tiny.EPISODE["prompt"]}]},
                 {"role": "assistant", "content": [{"type": "text", "text": label}]}]  # fmt: skip
    text = proc.apply_chat_template(msgs, tokenize=False)
    inputs = proc(text=[text], images=[Image.fromarray(d[0]) for d in demos], return_tensors="pt")
    S = inputs["input_ids"].shape[1]
    keep = a.keep
    while int(keep * S) != int(round(keep * S)) or int(S * (1 - (1 - keep))) != int(keep * S):
        keep = (int(keep * S) + 0.5) / S  # a keep whose rounding both libraries agree on
    budget = int(keep * S)

    def add_cache_position(module, args, kwargs):
        """transformers 5.23 no longer hands attention layers ``cache_position``; kvpress 0.5.2 reads it to tell
        prefill from decoding. Prefill here always starts at 0."""
        if "cache_position" not in kwargs:
            hs = kwargs.get("hidden_states", args[0] if args else None)
            kwargs["cache_position"] = torch.arange(hs.shape[1])
        return args, kwargs

    from apps.emloc.hf_inputs import language_model

    for layer in language_model(model).layers:
        layer.self_attn.register_forward_pre_hook(add_cache_position, with_kwargs=True)

    def kv_prefill(press):
        model.set_attn_implementation("eager")
        cache = DynamicCache(config=model.config)
        t0 = time.perf_counter()
        with torch.no_grad():
            if press is None:
                model(**inputs, past_key_values=cache, use_cache=True)
            else:
                with press(model):
                    model(**inputs, past_key_values=cache, use_cache=True, output_attentions=isinstance(
                        press, kvpress.ObservedAttentionPress))  # fmt: skip
        return cache, time.perf_counter() - t0

    kv_full, _ = kv_prefill(None)
    ours_full = compress_hf(model, demos, processor=proc, policy="full")
    assert ours_full.num_tokens == S, (ours_full.num_tokens, S)
    rows = []
    for ours_name, press_name in PAIRS.items():
        press = getattr(kvpress, press_name)(compression_ratio=1 - keep)
        row = {"policy": ours_name, "press": press_name, "tokens": S, "budget": budget}
        try:
            cache, t_kv = kv_prefill(press)
            kv_idx = _indices(cache, kv_full)
            row.update(kvpress_s=t_kv, kvpress_kept=[len(h) for h in kv_idx[0]])
        except Exception as err:  # noqa: BLE001 - a press that cannot run on this model is recorded, not fatal
            row.update(status="kvpress failed", reason=f"{type(err).__name__}: {str(err)[:300]}")
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
            continue
        window = 64 if a.aligned else 32
        t0 = time.perf_counter()
        ctx = compress_hf(model, demos, processor=proc, policy=ours_name, keep=keep, window=window)
        row["ours_s"] = time.perf_counter() - t0
        our_idx = _indices(ctx.cache, ours_full.cache)
        row.update(status="ok", agreement=_agreement(our_idx, kv_idx),
                   agreement_per_layer=[_agreement([x], [y]) for x, y in zip(our_idx, kv_idx)],
                   ours_kept=[len(h) for h in our_idx[0]], window=window)  # fmt: skip
        rows.append(row)
        print(json.dumps({k: row.get(k) for k in ("policy", "press", "agreement", "status")}), file=sys.stderr)
    import transformers

    out = {"benchmark": "emloc_kvpress", "kvpress": importlib.metadata.version("kvpress"),
           "transformers": transformers.__version__, "keep": keep, "aligned": a.aligned, "rows": rows,
           "model": "tools/reference/emloc/tiny.py TINY (eager attention)"}  # fmt: skip
    from core.infra.fileio import write_json_atomic

    write_json_atomic(a.out, out)
    for r in rows:
        print(f"| {r['policy']} | {r['press']} | {r.get('agreement', r.get('reason', ''))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
