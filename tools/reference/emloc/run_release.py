"""Run the released EMLoC pipeline (Zehong-Ma/EMLoC) on CPU on the tiny Qwen2-VL of :mod:`tiny` and write what it
chose as numbers (the fixtures of ``tests/test_emloc_reference.py``).

    python tools/reference/emloc/run_release.py RELEASE_DIR --out tests/fixtures/emloc

``RELEASE_DIR`` is a checkout of the release (its ``transformers/`` fork, ``qwen-vl-utils/`` and ``lmms-eval/``
folders); run this with a Python whose site-packages hold what the fork needs (tokenizers 0.21, huggingface-hub
< 1.0, requests) and torch, torchvision, av, pillow. The release's code is imported from ``RELEASE_DIR``, never
copied. Work-arounds, all here and none in the release's code:

- the wrapper module (``lmms_eval/models/qwen2_vl_custom.py``) is loaded from its file with stand-ins for the
  lmms-eval plumbing it imports (``decord``, ``loguru``, registry, base class: none of it is on the path we run);
  its ``process_outer_iter`` (one chunk) is called with ``device="cpu"``, chunk after chunk, as its
  ``generate_until`` does with 4 demonstrations per chunk;
- the model is built in fp32 with ``attn_implementation="sdpa"`` (the class the fork's pruning path lives in); the
  release loads bf16 on a GPU, but its importance (attention softmax) and its JS divergence are computed in bf16
  by the fork whatever the model's dtype, and those run here unchanged;
- what it chose is read by wrapping three library functions while it runs (each passes its arguments through
  unchanged): ``torch.gather`` (the kept indices of every trial), ``torch.nn.functional.avg_pool1d`` (the pooled
  importance) and ``torch.nn.functional.kl_div`` (the two halves of each trial's JS divergence, summed as the fork
  sums them);
- the answer logits of a query are those of the first token that the fork's ``generate`` produces: one forward of
  the query after the compressed memory (``custom_kv``, ``custom_kv_pos_offset``) with ``cache_position`` from 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
DELTA_L_MAX = 0.005  # the fork's fixed bound (context_organize_pre)
TOP = 200  # query logits: the TOP largest, and SAMPLE fixed ids
SAMPLE = 2000


def _stub_lmms_eval() -> None:
    """Stand-ins for the lmms-eval modules the wrapper file imports (none is used by ``process_outer_iter``)."""

    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    class _Lmms:
        def __init__(self, *a, **k):
            pass

    class _Logger:
        def __getattr__(self, _name):
            return lambda *a, **k: None

    mod("decord", VideoReader=None, cpu=None)
    mod("loguru", logger=_Logger())
    mod("lmms_eval")
    mod("lmms_eval.utils")
    mod("lmms_eval.api")
    mod("lmms_eval.api.instance", Instance=object)
    mod("lmms_eval.api.model", lmms=_Lmms)
    mod("lmms_eval.api.registry", register_model=lambda *a, **k: (lambda cls: cls))
    mod("lmms_eval.models")
    mod("lmms_eval.models.model_utils")
    mod("lmms_eval.models.model_utils.load_video", load_video_decord=None)


def _load_wrapper(release: Path):
    _stub_lmms_eval()
    path = release / "lmms-eval" / "lmms_eval" / "models" / "qwen2_vl_custom.py"
    spec = importlib.util.spec_from_file_location("release_qwen2_vl_custom", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Qwen2_VL_Custom


class _Recorder:
    """Wraps torch.gather / avg_pool1d / kl_div while the fork compresses a chunk; passes everything through."""

    def __init__(self):
        self.gathers, self.pools, self.kls = [], [], []
        self._orig = {}

    def __enter__(self):
        import torch.nn.functional as F

        self._orig = {"gather": torch.gather, "avg_pool1d": F.avg_pool1d, "kl_div": F.kl_div}

        def gather(input, dim, index, *a, **k):
            out = self._orig["gather"](input, dim, index, *a, **k)
            self.gathers.append(index[..., 0].clone() if index.dim() == 4 else index.clone())
            return out

        def avg_pool1d(*a, **k):
            out = self._orig["avg_pool1d"](*a, **k)
            self.pools.append(out.detach().clone())
            return out

        def kl_div(*a, **k):
            out = self._orig["kl_div"](*a, **k)
            self.kls.append(out.detach().clone())
            return out

        torch.gather, F.avg_pool1d, F.kl_div = gather, avg_pool1d, kl_div
        return self

    def __exit__(self, *exc):
        import torch.nn.functional as F

        torch.gather, F.avg_pool1d, F.kl_div = self._orig["gather"], self._orig["avg_pool1d"], self._orig["kl_div"]


def _messages(demos, prompt):
    from PIL import Image

    msgs = []
    for img, label in demos:
        msgs.append({"role": "user", "content": [{"type": "image", "image": Image.fromarray(img)},
                                                 {"type": "text", "text": prompt}]})  # fmt: skip
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": label}]})
    return msgs


def _chunk_record(rec: _Recorder, num_layers: int, n: int, ratios, pre_lens: list[int]) -> dict:
    """Per layer (top first, as searched): each trial's ratio, k, JS; the accepted ratio and kept indices."""
    trials = [(rec.gathers[2 * i], 0.5 * (rec.kls[2 * i] + rec.kls[2 * i + 1])) for i in range(len(rec.kls) // 2)]
    assert len(rec.gathers) == 2 * len(trials), (len(rec.gathers), len(trials))
    layers, t = [None] * num_layers, 0
    for layer in reversed(range(num_layers)):
        entry = {"layer": layer, "trials": [], "ratio": 1.0, "k": n, "kept": None}
        for r in ratios:
            idx, js = trials[t]
            t += 1
            k = int(idx.shape[-1])
            assert k == int(n * r), (k, n, r)
            entry["trials"].append({"ratio": r, "k": k, "js": float(js)})
            if bool(js <= DELTA_L_MAX):  # the fork's comparison: a bf16 tensor against the Python float
                entry.update(ratio=r, k=k, kept=[sorted(map(int, h)) for h in idx[0]])
                break
        layers[layer] = entry
    assert t == len(trials), (t, len(trials))
    pools = [p[0].float().tolist() for p in rec.pools]  # per layer (H_kv, n), bottom to top
    assert len(pools) == num_layers
    return {"num_tokens": n, "memory": pre_lens, "layers": layers, "importance": pools}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("release", type=Path, help="the release's checkout (RELEASE_DIR)")
    p.add_argument("--out", type=Path, required=True, help="folder for reference.json")
    p.add_argument("--commit", default=None, help="the release's commit (default: git rev-parse HEAD in RELEASE_DIR)")
    a = p.parse_args(argv)
    release = a.release.resolve()
    for sub in ("transformers/src", "qwen-vl-utils/src"):
        if not (release / sub).is_dir():
            p.error(f"{release} has no {sub}: pass the release's checkout")
        sys.path.insert(0, str(release / sub))
    sys.path.insert(0, str(HERE.parent.parent.parent))  # the project root, for tools.reference.emloc.tiny
    import transformers

    from tools.reference.emloc import tiny

    assert transformers.__file__.startswith(str(release)), transformers.__file__
    torch.set_num_threads(1)
    torch.manual_seed(0)
    wrapper = _load_wrapper(release)
    from qwen_vl_utils import process_vision_info

    model = tiny.build_model(attn_implementation="sdpa")
    processor = tiny.build_processor()
    e = tiny.EPISODE
    demos, queries = tiny.episode()
    msgs = _messages(demos, e["prompt"])
    per = 2 * e["chunk_demos"]
    L = model.config.num_hidden_layers
    outer_kv, offset, chunks = None, 0, []
    for c in range(0, len(msgs), per):
        context = msgs[c : c + per]
        pre = [0] * L if outer_kv is None else [int(k.shape[-2]) for k in outer_kv.key_cache]
        text = processor.apply_chat_template(context, tokenize=False, add_generation_prompt=True)
        ids = processor(text=[text[:-22] if outer_kv is None else text[58:-22]],
                        images=process_vision_info([context])[0], return_tensors="pt")["input_ids"][0]  # fmt: skip
        before = int(offset)
        with torch.no_grad(), _Recorder() as rec:
            outer_kv, offset, *_ = wrapper.process_outer_iter(None, context, model, processor, "cpu", outer_kv, offset,
                                                              0)  # fmt: skip
        entry = _chunk_record(rec, L, int(ids.numel()), list(e["ratios"]), pre)
        entry.update(input_ids=ids.tolist(), offset=before, next_position=int(offset))
        chunks.append(entry)
        print(f"chunk {len(chunks)}: ratios {[l['ratio'] for l in entry['layers']]}", file=sys.stderr)
    g = torch.Generator().manual_seed(1)
    sample = torch.randperm(tiny.VOCAB_SIZE, generator=g)[:SAMPLE].sort().values
    qs = []
    for img in queries:
        msg = _messages([(img, "")], e["prompt"])[:1]
        text = processor.apply_chat_template(msg, tokenize=False, add_generation_prompt=True)[58:]
        inputs = processor(text=[text], images=process_vision_info(msg)[0], return_tensors="pt")
        model.rope_deltas = None
        with torch.no_grad():
            out = model(**inputs, custom_kv=outer_kv, custom_kv_pos_offset=offset,
                        cache_position=torch.arange(inputs["input_ids"].shape[1]))  # fmt: skip
        lg = out.logits[0, -1].float()
        top = lg.topk(TOP)
        qs.append({"input_ids": inputs["input_ids"][0].tolist(), "top_ids": top.indices.tolist(),
                   "top_logits": top.values.tolist(), "sample_logits": lg[sample].tolist()})  # fmt: skip
    commit = a.commit or subprocess.run(["git", "-C", str(release), "rev-parse", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
    out = {
        "release": {"repository": "Zehong-Ma/EMLoC", "commit": commit or None},
        "model": {"builder": "tools.reference.emloc.tiny.build_model", "shape": "TINY", "seed": 0, "std": tiny.STD},
        "episode": {k: list(v) if isinstance(v, tuple) else v for k, v in e.items()},
        "delta": DELTA_L_MAX,
        "chunks": chunks,
        "queries": {"sample_ids": sample.tolist(), "logits": qs},
    }
    a.out.mkdir(parents=True, exist_ok=True)
    tmp = a.out / "reference.json.tmp"
    tmp.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    tmp.replace(a.out / "reference.json")
    print(f"wrote {a.out / 'reference.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
