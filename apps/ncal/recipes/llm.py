"""The NCAL paper's LLM recipe on a local decoder model: ``python -m apps.ncal.recipes.llm --model DIR --dataset tmwpl``.

Fine-tunes the model in ``DIR`` (a local folder: ``config.json``, weights, a tokenizer, ideally with a chat
template; nothing is downloaded) to generate the class name, with the published settings: LoRA r = 8, α = 32,
dropout 0.1 on q/k/v/o, 5 epochs, batch 8 × gradient accumulation 4, lr 2e-4, linear warm-up over 5% of the
steps then linear decay, TC (λ = 0.1) on the last real prompt token's hidden state. The release trains in fp16 on
CUDA; here ``--dtype auto`` is bf16 on CUDA and fp32 on the CPU (``--dtype float16`` for the release's). Prediction
is constrained to the class set (:mod:`apps.ncal.llm`). ``--preset reference`` switches to the released code's
choices (TC pairs within the batch only, the question alone as the prompt, random batches with the last partial
batch dropped, evaluation by sampling at T 0.7 / top-p 0.9 and matching the answer to a class name;
:mod:`apps.ncal.presets`); ``--bank-size``, ``--batching``, ``--prompt``, ``--predict`` set one switch each. Writes an ``apps.ncal.train`` run folder (resumable, test
metrics per epoch in ``metrics.jsonl``) that ``apps.ncal.evaluate`` / ``predict`` / ``NCALClassifier`` load.

``--limit-train N`` / ``--limit-test N`` (a fixed random sample) and ``--epochs`` shrink a run for a smoke test.
PMTD defaults to the previous turn + the current one (``--context window`` is the published code's three turns,
which include the next turn).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from collections.abc import Sequence
from pathlib import Path

from apps.ncal.data import CONTEXTS
from apps.ncal.presets import add_preset_options
from core.infra.cli import (add_run_options, configure_run, fraction, nonempty_path, nonnegative_float,
                            nonnegative_int, positive_float, positive_int, run_cli, seed_int)
from core.infra.device import add_device_options, device_from_args
from core.infra.guard import check_outputs

logger = logging.getLogger(__name__)

__all__ = ["build_parser", "main", "REFERENCE"]

#: the published recipe (NCAL code release: Qwen2.5-7B-Instruct, train.sh)
REFERENCE = dict(epochs=5, batch_size=8, grad_accum=4, lr=2e-4, warmup_frac=0.05, lora_r=8, lora_alpha=32,
                 lora_dropout=0.1, tc_lambda=0.1, max_prompt_tokens=2048)


def _sample(examples, n: int | None, seed: int):
    if not n or n >= len(examples):
        return examples
    return random.Random(seed).sample(examples, n)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m apps.ncal.recipes.llm", description=__doc__.split("\n\n")[0])
    r = REFERENCE
    p.add_argument("--model", type=nonempty_path, required=True, help="local decoder LLM folder")
    p.add_argument("--dataset", required=True, choices=("tmwpl", "pmtd"))
    p.add_argument("--out", type=nonempty_path, default=None, help="run folder (default runs/ncal_llm/<dataset>_<loss>_<seed>)")
    p.add_argument("--loss", default="tc", choices=("ce", "tc", "etf", "cb"))
    p.add_argument("--tc-lambda", type=nonnegative_float, default=r["tc_lambda"], help="weight of TC (or of the ETF term)")
    p.add_argument("--seed", type=seed_int, default=0)
    add_preset_options(p)
    p.add_argument("--epochs", type=positive_int, default=r["epochs"])
    p.add_argument("--batch-size", type=positive_int, default=r["batch_size"])
    p.add_argument("--grad-accum", type=positive_int, default=r["grad_accum"])
    p.add_argument("--lr", type=positive_float, default=r["lr"])
    p.add_argument("--warmup-frac", type=fraction, default=r["warmup_frac"])
    p.add_argument("--lora-r", type=nonnegative_int, default=r["lora_r"], help="0: train every weight")
    p.add_argument("--lora-alpha", type=positive_int, default=r["lora_alpha"])
    p.add_argument("--lora-dropout", type=fraction, default=r["lora_dropout"])
    p.add_argument("--max-prompt-tokens", type=positive_int, default=r["max_prompt_tokens"])
    p.add_argument("--context", default="past", choices=CONTEXTS, help="PMTD context")
    p.add_argument("--valid-frac", type=fraction, default=0.0, help="stratified hold-out of train (0: none)")
    p.add_argument("--limit-train", type=positive_int, default=None, help="train on a fixed sample of N items (smoke runs)")
    p.add_argument("--limit-test", type=positive_int, default=None, help="evaluate on a fixed sample of N test items")
    p.add_argument("--ckpt-every", type=positive_int, default=100, help="optimizer steps between checkpoints")
    p.add_argument("--max-steps", type=positive_int, default=None, help="stop after N optimizer steps (smoke runs)")
    add_device_options(p)
    add_run_options(p)
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    device, _ = device_from_args(args)  # a missing GPU is one line before any work
    configure_run(args)
    from apps.ncal.data import load_split
    from apps.ncal.train import TrainConfig, train
    from core.hf import check_model_folder

    check_outputs([("--out", args.out)], inputs=[args.model, args.dataset])
    model_dir, _ = check_model_folder(args.model)  # a bad folder is refused before anything is written
    if args.valid_frac >= 1:
        raise ValueError(f"--valid-frac must be below 1, got {args.valid_frac}")
    out = Path(args.out or f"runs/ncal_llm/{args.dataset}_{args.loss}_{args.seed}")
    recipe = {"model": str(model_dir.resolve()), "limit_train": args.limit_train, "limit_test": args.limit_test}
    if (out / "recipe.json").is_file() and json.loads((out / "recipe.json").read_text(encoding="utf-8")) != recipe:
        raise ValueError(f"{out} holds a run of another model or sample ({out / 'recipe.json'}); use a new --out")
    cfg = TrainConfig(dataset=args.dataset, out=str(out), loss=args.loss, tc_lambda=args.tc_lambda, seed=args.seed,
                      preset=args.preset, bank_size=args.bank_size, batching=args.batching, prompt=args.prompt,
                      predict=args.predict, eval_seed=args.eval_seed,
                      encoder=f"hf:{model_dir}", head="lm", lora_r=args.lora_r, lora_alpha=args.lora_alpha,
                      lora_dropout=args.lora_dropout, epochs=args.epochs, batch_size=args.batch_size,
                      grad_accum=args.grad_accum, lr=args.lr, warmup_frac=args.warmup_frac, dtype=args.dtype,
                      max_prompt_tokens=args.max_prompt_tokens, context=args.context, valid_frac=args.valid_frac,
                      ckpt_every=args.ckpt_every, device=str(device),
                      max_steps=args.max_steps)
    tr, classes = load_split(args.dataset, "train", context=args.context)
    te, _ = load_split(args.dataset, "test", context=args.context)
    tr, te = _sample(tr, args.limit_train, 0), _sample(te, args.limit_test, 1)
    out.mkdir(parents=True, exist_ok=True)
    from core.infra.fileio import write_text_atomic

    write_text_atomic(out / "recipe.json", json.dumps(recipe) + "\n")
    meta = train(cfg, examples=(tr, te, classes))
    t = meta["test"]
    print(f"{args.dataset} {args.loss}: test accuracy {t['accuracy']:.4f}, macro-F1 {t['macro_f1']:.4f} "
          f"({t['n']} items; prompt template: {meta['prompt_template']}) -> {out}")
    return meta


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
