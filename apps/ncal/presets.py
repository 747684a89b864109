"""Two recipes for one method: this project's choices (``project``, the default) and the released code's
(``reference``, llm4edu/NCAL_ICML2025), as named switches a run can also set one by one.

| switch | ``project`` (default) | ``reference`` (the release) | applies to |
|---|---|---|---|
| ``bank_size`` | 256: TC also pairs the batch with the 256 most recent (detached) features | 0: pairs within the batch only (``code/trainer.py``) | every run with ``loss="tc"`` |
| ``batching`` | ``bucketed``: length-sorted windows of 20 batches, shuffled, last partial batch kept | ``random``: a random permutation cut into batches, last partial batch dropped (``dataloader_drop_last``, ``code/config.py``, ``code/train.sh``) | every run |
| ``prompt`` | ``instruction``: a system message that lists the class names, then the text as the user turn | ``question``: the text alone as the user turn, encoded with the tokenizer's default special tokens (``code/dataset.py``); the chat template adds what it adds | the LLM head |
| ``predict`` | ``constrained``: argmax over the class names' log-probabilities | ``sample``: sample at temperature 0.7, top-k 50, top-p 0.9, ≤ 512 new tokens (seeded), decode without special tokens, strip (``code/inference.py``); the answer counts for the class whose name it equals, else for none (the release has no matching code: :func:`apps.ncal.llm.match_answer`) | the LLM head |

Everything else (feature position, loss, optimiser, schedule, LoRA) is the same in both presets. Why the
project's choices differ is in ``apps/ncal/README.md`` ("Presets"); the release lines behind each reference value
are cited in ``docs/experiments/ncal.md``.
"""

from __future__ import annotations

import argparse
import random

__all__ = ["add_preset_options", "PRESETS", "SWITCHES", "BATCHINGS", "PROMPTS", "PREDICTS", "SAMPLING",
           "resolve_switches", "make_batches", "num_batches"]

BATCHINGS = ("bucketed", "random")
PROMPTS = ("instruction", "question")
PREDICTS = ("constrained", "sample")
SWITCHES = ("bank_size", "batching", "prompt", "predict")

PRESETS: dict[str, dict] = {
    "project": {"bank_size": 256, "batching": "bucketed", "prompt": "instruction", "predict": "constrained"},
    "reference": {"bank_size": 0, "batching": "random", "prompt": "question", "predict": "sample"},
}

#: the release's generation settings (``inference.py``: ``generate(do_sample=True, temperature=0.7, top_p=0.9,
#: top_k=50, max_length=prompt + 512)``)
SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "max_new_tokens": 512}


def resolve_switches(preset: str, **given) -> dict:
    """The four switches of ``preset`` with every ``given`` value that is not None in their place.

    Raises:
        ValueError: an unknown preset or switch value (names what is accepted).
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {tuple(PRESETS)}, got {preset!r}")
    unknown = set(given) - set(SWITCHES)
    if unknown:
        raise ValueError(f"unknown switches {sorted(unknown)}; known: {SWITCHES}")
    out = dict(PRESETS[preset])
    out.update({k: v for k, v in given.items() if v is not None})
    for name, allowed in (("batching", BATCHINGS), ("prompt", PROMPTS), ("predict", PREDICTS)):
        if out[name] not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {out[name]!r}")
    if int(out["bank_size"]) < 0:
        raise ValueError(f"bank_size must be >= 0, got {out['bank_size']}")
    return out


def num_batches(n: int, batch_size: int, batching: str) -> int:
    """Batches per epoch: ``ceil(n / b)`` (``bucketed``, last partial kept) or ``n // b`` (``random``, dropped)."""
    if batching == "random":
        if n < batch_size:
            raise ValueError(f"batching 'random' drops the last partial batch: {n} examples < batch size {batch_size} "
                             f"leave no batch")
        return n // batch_size
    return -(-n // batch_size)


def make_batches(n: int, lengths: list[int], batch_size: int, rng: random.Random, batching: str) -> list[list[int]]:
    """One epoch's batches of example indices.

    ``bucketed``: shuffle, sort each window of 20 batches by length, cut, shuffle the batches (less padding; every
    example once). ``random``: shuffle and cut; the last partial batch is dropped, as a PyTorch ``DataLoader``
    with a random sampler and ``drop_last=True`` does.
    """
    order = list(range(n))
    rng.shuffle(order)
    if batching == "random":
        return [order[k:k + batch_size] for k in range(0, num_batches(n, batch_size, batching) * batch_size, batch_size)]
    if batching != "bucketed":
        raise ValueError(f"batching must be one of {BATCHINGS}, got {batching!r}")
    window = batch_size * 20
    out = []
    for s in range(0, n, window):
        chunk = sorted(order[s:s + window], key=lambda i: lengths[i])
        out += [chunk[k:k + batch_size] for k in range(0, len(chunk), batch_size)]
    rng.shuffle(out)
    return out


def add_preset_options(p: argparse.ArgumentParser, *, lm_only: str = "") -> None:
    """``--preset`` and its switches (``--bank-size``, ``--batching``, ``--prompt``, ``--predict``,
    ``--eval-seed``), shared by ``apps.ncal.train`` and ``apps.ncal.recipes.llm``; a switch left unset takes the
    preset's value (:func:`resolve_switches`). ``lm_only``: a prefix for the help of the LLM-only switches."""
    from core.infra.cli import nonnegative_int

    p.add_argument("--preset", default="project", choices=tuple(PRESETS),
                   help="project (default): this project's choices; reference: the released code's TC pairing, "
                        "batching, prompt and sampling evaluation (each also settable below)")
    p.add_argument("--bank-size", type=nonnegative_int, default=None,
                   help="TC feature bank size (0: pairs within the batch only; default from --preset: 256 / 0)")
    p.add_argument("--batching", default=None, choices=BATCHINGS,
                   help="bucketed: length windows, last partial batch kept; random: drop_last (default from --preset)")
    p.add_argument("--prompt", default=None, choices=PROMPTS,
                   help=f"{lm_only}instruction (a system message listing the classes) or question (the text alone as "
                        "the user turn; default from --preset)")
    p.add_argument("--predict", default=None, choices=PREDICTS,
                   help=f"{lm_only}constrained (class-set argmax) or sample (T 0.7, top-p 0.9, then match the answer "
                        "to a class name; default from --preset)")
    p.add_argument("--eval-seed", type=nonnegative_int, default=0,
                   help=f"{lm_only}seed of the draws of --predict sample")
