"""NCAL classifier = text encoder (character transformer or a local HF model) + linear or fixed-ETF head.

A checkpoint is a folder:

- ``ncal.json``: classes, long-tail bins, dataset, PMTD context, loss, encoder description, metrics;
- ``model.safetensors``: the weights (the character encoder: all of them; an HF encoder: only the trainable
  ones — LoRA adapters or every weight — plus the head; the frozen base is read again from its local folder);
- ``tokenizer.json``: the character tokenizer (character encoder only).

:func:`infer` is the one ``@torch.no_grad()`` inference function the CLI, the estimator and the demo call.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from apps.ncal.encoder import EncoderConfig, TextEncoder
from apps.ncal.tokenizer import CharTokenizer
from apps.ncal.weights_io import load_safetensors, read_json, save_safetensors, write_json_atomic
from core.collapse import ETFClassifier

logger = logging.getLogger(__name__)

__all__ = ["NCALModel", "Checkpoint", "build_encoder", "save_checkpoint", "load_checkpoint", "infer",
           "predicted_labels", "record_base", "locate_base"]

#: encoder kinds whose weights are a local transformers model folder (``source: "hf:DIR"``) read again at load
BASE_KINDS = ("hf", "hf-lm")


class NCALModel(nn.Module):
    """``forward(input_ids, attention_mask) -> (feats (B, D), logits (B, K))``.

    Args:
        encoder: a module mapping ``(input_ids, attention_mask)`` to features ``(B, D)``, with ``feature_dim``.
        num_classes: K.
        head: ``"linear"`` (learned) or ``"etf"`` (fixed simplex ETF, :class:`core.collapse.ETFClassifier`).
    """

    def __init__(self, encoder: nn.Module, num_classes: int, *, head: str = "linear") -> None:
        super().__init__()
        if head not in ("linear", "etf"):
            raise ValueError(f"head must be 'linear' or 'etf', got {head!r}")
        self.encoder = encoder
        self.head_kind = head
        D = encoder.feature_dim
        self.head = nn.Linear(D, num_classes) if head == "linear" else ETFClassifier(D, num_classes)

    @property
    def etf_W_KD(self) -> torch.Tensor | None:
        return self.head.W_KD if self.head_kind == "etf" else None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feats_BD = self.encoder(input_ids, attention_mask)
        return feats_BD, self.head(feats_BD)


@dataclass(kw_only=True)
class Checkpoint:
    """A loaded checkpoint: model (eval mode), tokenizer and its ``ncal.json`` metadata."""

    model: NCALModel
    tokenizer: object  # CharTokenizer or HFTokenizer: has batch(texts)
    meta: dict

    @property
    def classes(self) -> list[str]:
        return list(self.meta["classes"])


def build_encoder(spec: dict, *, tokenizer_path: Path | None = None) -> tuple[nn.Module, object]:
    """Encoder + tokenizer from an ``ncal.json`` encoder description (weights not loaded)."""
    if spec["kind"] == "char":
        tok = CharTokenizer.load(tokenizer_path) if tokenizer_path else None
        return TextEncoder(EncoderConfig(**spec["config"])), tok
    if spec["kind"] == "hf":
        from apps.ncal.hf_encoder import HFEncoder, HFTokenizer, parse_hf_source

        path = parse_hf_source(spec["source"])
        enc = HFEncoder(path, pool=spec.get("pool", "last"), lora_r=spec.get("lora_r", 0),
                        lora_alpha=spec.get("lora_alpha", 16), lora_targets=spec.get("lora_targets"))
        return enc, HFTokenizer(path, max_length=spec.get("max_length", 256))
    raise ValueError(f"unknown encoder kind {spec['kind']!r}; known: 'char', 'hf'")


def _weights_to_save(model: NCALModel) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    if isinstance(model.encoder, TextEncoder):
        return sd
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    keep = {k: v for k, v in sd.items() if k in trainable or not k.startswith("encoder.")}
    return keep


def record_base(meta: dict, folder: str | Path) -> dict:
    """``meta`` with the base model's path also recorded relative to ``folder`` (``encoder.source_relative``), so
    an adapter moved together with its base model (or copied with the same layout) still finds it."""
    spec = meta.get("encoder") or {}
    if spec.get("kind") in BASE_KINDS and str(spec.get("source", "")).startswith("hf:"):
        base = Path(spec["source"][3:]).expanduser().resolve()
        spec = {**spec, "source_relative": os.path.relpath(base, Path(folder).resolve())}
        meta = {**meta, "encoder": spec}
    return meta


def locate_base(spec: dict, folder: str | Path, base_model: str | os.PathLike | None = None) -> dict:
    """The encoder description with ``source`` pointing at a base-model folder that exists: ``base_model`` when
    given, else the recorded path, else the recorded path relative to the adapter's ``folder``; a clear error naming
    ``ncal.json`` and ``--base-model`` when none is there."""
    if spec.get("kind") not in BASE_KINDS:
        if base_model is not None:
            raise ValueError(f"{Path(folder) / 'ncal.json'}: this model has no base model (encoder kind "
                             f"{spec.get('kind')!r}); --base-model applies to adapters of a local transformers model")
        return spec
    recorded = str(spec.get("source", ""))[3:]
    if base_model is not None:
        p = Path(base_model).expanduser()
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"--base-model {base_model}: not a transformers model folder (no config.json); "
                                    f"{Path(folder) / 'ncal.json'} was trained on {recorded}")
        return {**spec, "source": f"hf:{p}"}
    tried = [Path(recorded).expanduser()]
    if spec.get("source_relative"):
        tried.append(Path(folder) / spec["source_relative"])
    for p in tried:
        if (p / "config.json").is_file():
            return {**spec, "source": f"hf:{p}"}
    raise FileNotFoundError(
        f"{Path(folder) / 'ncal.json'}: its base model is not at {' nor '.join(str(p) for p in tried)} (moved or "
        "deleted?); pass --base-model DIR (Python: base_model=DIR) with the local folder of that model")


def save_checkpoint(folder: str | Path, model: NCALModel, tokenizer, meta: dict) -> Path:
    """Write ``model.safetensors``, ``ncal.json`` (and ``tokenizer.json`` for the character encoder) atomically."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors(folder / "model.safetensors", _weights_to_save(model))
    if isinstance(tokenizer, CharTokenizer):
        tokenizer.save(folder / "tokenizer.json")
    write_json_atomic(folder / "ncal.json", record_base(meta, folder))
    return folder


def load_checkpoint(folder: str | Path, *, device: torch.device | str | None = None,
                    base_model: str | os.PathLike | None = None, dtype: torch.dtype | str | None = None) -> Checkpoint:
    """Load a checkpoint folder (module docs). ``FileNotFoundError`` names the missing file. ``base_model``: where
    the base model of an adapter (``hf:`` encoder, ``--head lm``) is now, when not where ``ncal.json`` says.
    ``device``: None = auto (CUDA when present); ``dtype``: an LLM adapter's base weights (None = auto: bf16 on
    CUDA, fp32 on the CPU; the character encoder always runs in fp32)."""
    from core.infra.device import resolve_device

    device = resolve_device(device)
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no NCAL checkpoint folder at {folder}")
    meta = read_json(folder / "ncal.json")
    meta = {**meta, "encoder": locate_base(meta["encoder"], folder, base_model)}
    if meta["encoder"].get("kind") == "hf-lm":  # a decoder LLM that generates the class name (apps.ncal.llm)
        from apps.ncal.llm_train import build_lm

        model, prompter = build_lm(meta["encoder"], device=device, dtype=dtype)
        sd = load_safetensors(folder / "model.safetensors", what="the NCAL weights written by apps.ncal.train")
        want = set(model.trainable_state())
        if set(sd) != want:
            raise ValueError(f"{folder}/model.safetensors does not hold this model's trainable weights "
                             f"(missing {sorted(want - set(sd))[:3]}, unexpected {sorted(set(sd) - want)[:3]})")
        model.load_state_dict(sd, strict=False)
        return Checkpoint(model=model.eval(), tokenizer=prompter, meta=meta)
    enc, tok = build_encoder(meta["encoder"], tokenizer_path=folder / "tokenizer.json")
    model = NCALModel(enc, len(meta["classes"]), head="etf" if meta["loss"]["name"] == "etf" else "linear")
    sd = load_safetensors(folder / "model.safetensors", what="the NCAL weights written by apps.ncal.train")
    own = model.state_dict()
    shapes = [f"{k} {list(v.shape)} (model {list(own[k].shape)})" for k, v in sd.items()
              if k in own and tuple(v.shape) != tuple(own[k].shape)]
    if shapes:  # weights of another size of model: one line naming the file, not load_state_dict's traceback
        raise ValueError(f"{folder}/model.safetensors does not fit the model ncal.json describes (other shapes "
                         f"({len(shapes)}): {', '.join(shapes[:3])}{', ...' if len(shapes) > 3 else ''})")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected:
        raise ValueError(f"{folder}/model.safetensors has weights the model does not: {unexpected[:5]}")
    if isinstance(enc, TextEncoder) and missing:
        raise ValueError(f"{folder}/model.safetensors lacks weights: {missing[:5]}")
    bad = [k for k in missing if not k.startswith("encoder.")]
    if bad:
        raise ValueError(f"{folder}/model.safetensors lacks head weights: {bad}")
    model.to(device).eval()
    return Checkpoint(model=model, tokenizer=tok, meta=meta)


@torch.no_grad()
def infer(model: NCALModel, tokenizer, texts: list[str], *, batch_size: int = 64,
          device: torch.device | str | None = None, progress: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probabilities (N, K), features (N, D))`` for texts, in input order, on CPU, in float32.

    Texts are batched by length (less padding); the model is put in eval mode. ``progress``: a tqdm bar over the
    batches on stderr (an LLM takes minutes over a test set). An LLM head with ``predict = "sample"`` (the
    released code's evaluation) gives the one-hot of the class its sampled answer names, or a row of zeros when
    the answer names none (:func:`predicted_labels` makes that -1); its draws are seeded with ``model.eval_seed``.
    """
    from tqdm.auto import tqdm

    model.eval()
    device = device or next(model.parameters()).device
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    probs, feats = [None] * len(texts), [None] * len(texts)
    starts = range(0, len(order), batch_size)
    sample = getattr(model, "predict", "constrained") == "sample"
    dev = torch.device(device)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else [], enabled=sample):
        if sample:  # the same draws on every call (each epoch's evaluation), the training generator untouched
            torch.manual_seed(int(getattr(model, "eval_seed", 0)))
        for s in tqdm(starts, desc="classify", unit="batch", disable=not progress or len(starts) < 2,
                      dynamic_ncols=True):
            idx = order[s:s + batch_size]
            if sample:  # one-hot of the class the sampled answer names; a row of zeros when it names none
                from apps.ncal.llm import match_answer

                b = tokenizer.batch([texts[i] for i in idx], device=device, padding_side="left")
                f_BD = model.features(b["input_ids"], b["attention_mask"])
                answers = model.sample_answers(b["input_ids"], b["attention_mask"], tokenizer.tok)
                p_BK = torch.zeros(len(idx), len(tokenizer.classes))
                for j, a in enumerate(answers):
                    k = match_answer(a, tokenizer.classes)
                    if k >= 0:
                        p_BK[j, k] = 1.0
            else:
                b = tokenizer.batch([texts[i] for i in idx], device=device)
                f_BD, logits_BK = model(b["input_ids"], b["attention_mask"])
                p_BK = logits_BK.float().softmax(-1).cpu()
            f_BD = f_BD.float().cpu()
            for j, i in enumerate(idx):
                probs[i], feats[i] = p_BK[j], f_BD[j]
    return torch.stack(probs), torch.stack(feats)


def predicted_labels(probs_NK: torch.Tensor) -> list[int]:
    """Argmax class per row; -1 for a row of zeros (a sampled answer that named no class)."""
    pred = probs_NK.argmax(1)
    pred[probs_NK.sum(1) <= 0] = -1
    return pred.tolist()
