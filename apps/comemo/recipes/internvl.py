"""CoMemo's staged training on a local InternVL-family model: ``python -m apps.comemo.recipes.internvl``.

``python -m apps.comemo.recipes.internvl --model DIR --data DIR --out OUT --stage 1`` (then ``--stage 2 --model
OUT1``, ``--stage 3 --model OUT2``; each stage writes a model folder the next one reads). Under ``torchrun
--nproc_per_node=K`` it runs data-parallel (DDP; ``--fsdp`` shards every decoder layer and the rest with FSDP2's
``fully_shard`` for models that do not fit one device).

Stages (as the paper and its released scripts):

==== ========================================= =================================================
 1   ViT and LLM frozen                        projector + memory blocks (gates included)
 2   ViT, LLM and gates frozen                 projector + memory blocks without their gates
 3   full fine-tuning                          everything
==== ========================================= =================================================

Learning rate (``--lr``, default the release's scripts: 1e-4 in stages 1 and 2, 4e-5 in stage 3), AdamW weight decay
0.01 (the release's), linear warm-up then cosine to a tenth.

Architecture: a ``--model`` folder with ``comemo_memory.safetensors`` (the previous stage, or a converted release)
gives every memory setting (``every``, heads, FFN, RoPE, ``queries``, ``positions``, ...): ``--every`` that differs is
refused, ``--queries``/``--positions`` override with a warning. A plain InternVL folder gets the project's layout
(``--every`` default 4).

Data (``--data DIR``): ``DIR/data.jsonl``, one sample a line: ``{"images": ["a.png", ...], "question": "...",
"answer": "..."}`` (image paths relative to ``DIR``). Each sample is built by :func:`apps.comemo.hf_prompt.build_inputs`,
the builder ``HFCoMemo.answer`` uses: the folder's chat template (the user turn, the generation prompt, then the
answer and the template's end of turn, on which the loss is), its processor's tiling and normalisation, and each
image's tile grid. A folder with a tokenizer only is tiled with InternVL's rule (:mod:`apps.comemo.tiling`, at most
``--max-tiles``) and normalised with its ``preprocessor_config.json`` mean/std (ImageNet's without one); without a
chat template the prompt is the images then the question, and the loss is on the answer and the end token.

Sample ``i`` of the run (counted over steps, ranks and the batch) is entry ``perm_e[i mod N]`` of epoch
``e = i // N`` (``perm_e`` a permutation drawn from ``--seed`` and ``e``), so ``--resume`` continues exactly.
``OUT/last.pt`` holds the trained tensors, optimizer, scheduler, step and RNG state; ``OUT/metrics.jsonl`` one line
per step; at the end ``OUT`` is a model folder (``save_pretrained`` + ``comemo_memory.safetensors`` + tokenizer /
processor files copied from ``--model``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import re
import shutil
import time
from pathlib import Path

import torch

from core.infra.cli import (UsageError, nonempty_path_obj, nonnegative_float, positive_float, positive_int, run_cli,
                            thread_count)
from core.infra.device import add_device_options, resolve_dtype
from core.infra.distributed import agreed_stop, finish
from core.infra.distributed import setup as distributed_setup
from core.infra.fileio import torch_load, torch_save_atomic, write_text_atomic

logger = logging.getLogger(__name__)

__all__ = ["STAGES", "set_stage", "load_data", "encode_sample", "sample_index", "build_parser", "main"]

STAGES = (1, 2, 3)
#: peak learning rate of each stage in the release's scripts (shell/comemo/*pretrain.sh, *pretrain_phase2.sh, *finetune.sh)
STAGE_LR = {1: 1e-4, 2: 1e-4, 3: 4e-5}
_RECIPE_KEYS = ("stage", "lr", "warmup", "batch_size", "seed", "every", "queries", "positions", "max_tiles", "clip",
                "weight_decay")


def set_stage(wrapped, stage: int) -> list[str]:
    """``requires_grad`` for ``stage`` (see module docs); returns the trained parameters' names."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; choose one of {list(STAGES)}")
    train = {1: ("memory", "gates", "projector"), 2: ("memory", "projector"),
             3: ("memory", "gates", "projector", "vision", "llm")}[stage]
    names = []
    for part, params in wrapped.parameter_groups().items():
        for name, p in params:
            p.requires_grad_(part in train)
            if part in train:
                names.append(name)
    return names


def load_data(folder: Path) -> list[dict]:
    """The samples of ``folder/data.jsonl`` (each checked: images that exist, a question and an answer)."""
    path = folder / "data.jsonl"
    if not path.is_file():
        raise UsageError(f"--data {folder}: no data.jsonl (one JSON sample a line: images, question, answer)")
    samples = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            s = json.loads(line)
        except json.JSONDecodeError as err:
            raise UsageError(f"{path}:{n}: not JSON ({err.msg})") from None
        if not (isinstance(s, dict) and isinstance(s.get("images"), list) and isinstance(s.get("question"), str)
                and isinstance(s.get("answer"), str) and s["answer"]):
            raise UsageError(f"{path}:{n}: need {{\"images\": [...], \"question\": str, \"answer\": non-empty str}}")
        for im in s["images"]:
            if not (folder / im).is_file():
                raise UsageError(f"{path}:{n}: image {im!r} not found in {folder}")
        samples.append(s)
    if not samples:
        raise UsageError(f"{path} holds no samples")
    return samples


def sample_index(seed: int, i: int, n: int) -> int:
    """Entry of the data for sample ``i`` of the run (a fresh permutation per pass, from ``seed``)."""
    epoch, k = divmod(i, n)
    perm = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(perm)
    return perm[k]


def encode_sample(sample: dict, folder: Path, wrapped, *, max_tiles: int | None, model_folder: Path | None = None) -> dict:
    """Token ids, labels (answer + end of turn), pixel values ``(tiles, 3, H, W)`` and grids of one sample, built as
    inference builds prompts (:func:`apps.comemo.hf_prompt.build_inputs`)."""
    from apps.comemo.hf_prompt import build_inputs

    images = [folder / im for im in sample["images"]]
    enc = build_inputs(wrapped, images, sample["question"], answer=sample["answer"], max_tiles=max_tiles or 12,
                       folder=model_folder)
    return {"input_ids": enc.input_ids, "labels": enc.labels, "pixel_values": enc.pixel_values,
            "image_grids": enc.image_grids}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m apps.comemo.recipes.internvl", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=nonempty_path_obj, required=True, help="local InternVL-family model folder")
    p.add_argument("--data", type=nonempty_path_obj, required=True, help="folder with data.jsonl and its images")
    p.add_argument("--out", type=nonempty_path_obj, required=True, help="run folder (becomes a model folder)")
    p.add_argument("--stage", type=int, choices=STAGES, default=1, help="1 memory + projector, 2 gates frozen too, 3 all")
    p.add_argument("--steps", type=positive_int, default=100, help="optimizer steps")
    p.add_argument("--batch-size", type=positive_int, default=1, help="samples per step and rank (accumulated)")
    p.add_argument("--lr", type=positive_float, default=None,
                   help="peak learning rate (AdamW; default the release's: 1e-4 in stages 1-2, 4e-5 in stage 3)")
    p.add_argument("--warmup", type=positive_int, default=10, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=nonnegative_float, default=0.01, help="AdamW weight decay (the release's)")
    p.add_argument("--clip", type=positive_float, default=1.0, help="gradient-norm clip")
    p.add_argument("--seed", type=int, default=0, help="seed of the new weights and of the sample order")
    p.add_argument("--every", type=positive_int, default=None,
                   help="a memory block before layer i when (i+1) %% N == 0 (default: the folder's, else 4)")
    p.add_argument("--queries", choices=("all", "text"), default=None, help="tokens that query the memory (default: "
                   "the folder's, else all)")
    p.add_argument("--positions", choices=("dhr", "1d"), default=None, help="RoPE-DHR or 1-D position ids (default: "
                   "the folder's, else dhr)")
    p.add_argument("--max-tiles", type=positive_int, default=None,
                   help="most tiles per image (default: the processor's; 12 for a folder without one)")
    p.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 (under torchrun)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out exactly where it stopped")
    p.add_argument("--ckpt-every", type=positive_int, default=50, help="write last.pt every N steps")
    p.add_argument("--max-minutes", type=positive_float, help="stop (and checkpoint) after this many minutes")
    p.add_argument("--stop-at", type=positive_int, help="stop (and checkpoint) after this step; --resume continues")
    add_device_options(p)
    p.add_argument("--attn", choices=("longctx", "sdpa", "eager"), default="longctx",
                   help="attention implementation of the model (default longctx: core.attention)")
    p.add_argument("--threads", type=thread_count, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (the log and metrics.jsonl remain)")
    return p


def _architecture(args) -> None:
    """Settings from the ``--model`` folder's memory file (the previous stage, or a converted release)."""
    from apps.comemo.hf import read_memory_config

    try:
        saved = read_memory_config(args.model)
    except ValueError as err:
        raise UsageError(f"--model {args.model}: {err}") from None
    if saved is None:
        args.every = args.every or 4
        return
    if args.every is not None and args.every != saved.get("every"):
        raise UsageError(f"--every {args.every}: the memory blocks of --model {args.model} sit before layers "
                         f"{saved.get('layers')} (every={saved.get('every')}); leave --every out to keep them")
    args.every = saved.get("every")
    for key in ("queries", "positions"):
        given = getattr(args, key)
        if given is not None and given != saved.get(key):
            logger.warning("--%s %s overrides the %s recorded in %s", key, given, saved.get(key), args.model)


def _wrap(wrapped, *, world: int, fsdp: bool, device):
    """The module the loss runs through: the model itself, DDP, or FSDP2-sharded in place."""
    if fsdp:  # the scalar tanh gates cannot be sharded: they stay whole on every rank (gradients averaged by hand)
        from torch.distributed.fsdp import fully_shard

        from core.hf import decoder_layers

        gates = {p for _, p in wrapped.parameter_groups()["gates"]}
        for layer in decoder_layers(wrapped.model):
            fully_shard(layer, ignored_params=gates)
        fully_shard(wrapped, ignored_params=gates)  # the root: embeddings and the vision tower run in its forward
        return wrapped
    if world > 1:
        return torch.nn.parallel.DistributedDataParallel(
            wrapped, device_ids=[device.index] if device.type == "cuda" else None)
    return wrapped


def _full_state(wrapped, fsdp: bool) -> dict[str, torch.Tensor]:
    """Every tensor of the model with its full value (gathered from the shards under FSDP), on the CPU."""
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k[len("model."):]: v for k, v in full.items() if k.startswith("model.")}
    return {k: v.detach().cpu() for k, v in wrapped.model.state_dict().items()}


def _lr_factor(step: int, warmup: int, steps: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, steps - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))


def _save_model_folder(wrapped, state: dict, src: Path, out: Path) -> None:
    """``out`` as a model folder: base weights and config, the memory file, tokenizer/processor files."""
    from safetensors.torch import save_file

    from apps.comemo.hf import MEMORY_FILE, MEMORY_FORMAT
    from core.hf import insert_before, revert
    from core.infra.fileio import atomic_path

    base = {re.sub(r"(\.layers\.\d+)\.layer\.", r"\1.", k): v for k, v in state.items() if ".inserted." not in k}
    tied = getattr(wrapped.model, "_tied_weights_keys", None) or {}
    for k, origin in (tied.items() if isinstance(tied, dict) else []):  # gathered shards untie them; tie them again
        if k in base and origin in base and torch.equal(base[k], base[origin]):
            del base[k]
    removed = revert(wrapped.model)
    try:
        wrapped.model.save_pretrained(str(out), state_dict=base)
    finally:
        insert_before(wrapped.model, removed)
    memory = {}
    for k, v in state.items():
        if ".inserted." in k:
            layer = k.split(".inserted.")[0].rsplit(".", 1)[-1]
            memory[f"{layer}.{k.split('.inserted.block.', 1)[1]}"] = v.contiguous()
    with atomic_path(out / MEMORY_FILE) as tmp:
        save_file(memory, str(tmp), metadata={"format": MEMORY_FORMAT, "config": json.dumps(wrapped.memory_config())})
    for f in src.iterdir():
        if f.is_file() and f.suffix in (".json", ".txt", ".model", ".jinja") and not (out / f.name).exists() and \
                f.name not in ("config.json", "generation_config.json", "model.safetensors.index.json"):
            shutil.copy2(f, out / f.name)


def main(argv: list[str] | None = None) -> int:
    from apps.comemo.hf import from_hf

    from core.infra.guard import check_output

    from core.infra.device import resolve_device

    args = build_parser().parse_args(argv)
    resolve_device(args.device)  # a missing GPU: one line, exit 2, before anything is read
    check_output(args.out, inputs=[args.model, args.data])
    samples = load_data(args.data)
    if args.lr is None:
        args.lr = STAGE_LR[args.stage]
    last = args.out / "last.pt"
    state = None
    if args.resume:
        if not last.is_file():
            raise UsageError(f"--resume given but {last} does not exist")
        state = torch_load(last, what="the training state written by apps.comemo.recipes.internvl")
        for key in _RECIPE_KEYS:
            if state["args"].get(key) is not None and state["args"][key] != getattr(args, key):
                logger.warning("--%s %s ignored: the resumed run uses %s", key.replace("_", "-"), getattr(args, key),
                               state["args"][key])
                setattr(args, key, state["args"][key])
    elif last.exists():
        raise UsageError(f"{last} exists: pass --resume to continue that run or choose another --out")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.resume:
        _architecture(args)
    rank, world, device = distributed_setup(str(resolve_device(args.device)))
    dtype = resolve_dtype(args.dtype, device)
    torch.manual_seed(args.seed)
    wrapped = from_hf(args.model, every=args.every, queries=args.queries, positions=args.positions, dtype=dtype,
                      device=device, attn=args.attn)
    if wrapped.processor is None:
        raise UsageError(f"--model {args.model}: no tokenizer in the folder")
    image_processor = getattr(wrapped.processor, "image_processor", None)
    if args.max_tiles is not None and image_processor is not None and hasattr(image_processor, "max_patches"):
        image_processor.max_patches = args.max_tiles
    wrapped.train()
    trained = set_stage(wrapped, args.stage)
    runner = _wrap(wrapped, world=world, fsdp=args.fsdp, device=device)
    named = [(n, p) for n, p in wrapped.model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in named], lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95),
                            foreach=False if args.fsdp else None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, args.warmup, args.steps))
    step, wall = 0, 0.0
    if state is not None:
        with torch.no_grad():
            params = dict(wrapped.model.named_parameters())
            for name, value in state["trained"].items():
                _assign(params[name], value)
        if args.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(wrapped, opt, state["optimizer"],
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step, wall = state["step"], state["wall_time"]
        torch.set_rng_state(state["torch_rng"])
        logger.info("resumed from %s at step %d", last, step)
    metrics = args.out / "metrics.jsonl"
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        if metrics.exists():  # records of steps after the checkpoint (a stop between checkpoints) go
            keep = [ln for ln in metrics.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
            write_text_atomic(metrics, "".join(ln + "\n" for ln in keep))
    logger.info("stage %d: %d trained tensors; memory before layers %s", args.stage, len(trained), wrapped.layers)
    t_start = t_last = time.time()
    from tqdm.auto import tqdm

    bar = tqdm(total=args.steps, initial=step, desc=f"stage {args.stage}", unit="step",
               disable=args.no_progress or rank != 0)
    while step < args.steps:
        want = args.max_minutes is not None and time.time() - t_start >= 60 * args.max_minutes
        if agreed_stop(want or (args.stop_at is not None and step >= args.stop_at), device):
            break
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for j in range(args.batch_size):
            i = (step * world + rank) * args.batch_size + j
            enc = encode_sample(samples[sample_index(args.seed, i, len(samples))], args.data, wrapped,
                                max_tiles=args.max_tiles, model_folder=args.model)
            pv = enc["pixel_values"].to(device=device, dtype=dtype)
            out = runner(enc["input_ids"].to(device), pv, image_grids=enc["image_grids"],
                         labels=enc["labels"].to(device))
            (out.loss / args.batch_size).backward()
            total += float(out.loss.detach()) / args.batch_size
        gn = _sync_and_clip(named, args.clip, world=world, fsdp=args.fsdp)
        opt.step()
        sched.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{total:.4f}")
        now = time.time()
        wall, t_last = wall + now - t_last, now
        if rank == 0:
            with open(metrics, "a") as f:
                f.write(json.dumps({"step": step, "loss": total, "grad_norm": float(gn), "lr": sched.get_last_lr()[0],
                                    "wall_time_s": round(wall, 2), "gates": wrapped.gates()}) + "\n")
        if step % args.ckpt_every == 0 or step == args.steps:
            _checkpoint(wrapped, named, opt, sched, step, wall, args, last, rank, fsdp=args.fsdp)
    bar.close()
    _checkpoint(wrapped, named, opt, sched, step, wall, args, last, rank, fsdp=args.fsdp)
    full = _full_state(wrapped, args.fsdp)
    if rank == 0:
        _save_model_folder(wrapped, full, args.model, args.out)
    finish()
    return 0


def _sync_and_clip(named, max_norm: float, *, world: int, fsdp: bool) -> float:
    """Clip the gradient norm; under FSDP also average the unsharded gates' gradients over the ranks first."""
    if not fsdp:
        return float(torch.nn.utils.clip_grad_norm_([p for _, p in named], max_norm))
    import torch.distributed as dist

    grads = [p.grad for _, p in named if p.grad is not None]
    plain = [g for g in grads if not hasattr(g, "full_tensor")]
    for g in plain:
        dist.all_reduce(g, op=dist.ReduceOp.SUM)
        g.div_(world)
    total = 0.0
    for g in grads:
        n = torch.linalg.vector_norm(g.float())
        total += float(n.full_tensor() if hasattr(n, "full_tensor") else n) ** 2
    total = math.sqrt(total)
    coef = min(1.0, max_norm / (total + 1e-6))
    for g in grads:
        g.mul_(coef)
    return total


def _assign(param, value) -> None:
    local = getattr(param, "to_local", None)
    if local is not None:  # an FSDP2 shard: take this rank's part of the full tensor
        from torch.distributed.tensor import distribute_tensor

        param.copy_(distribute_tensor(value.to(param.device), param.device_mesh, param.placements))
    else:
        param.copy_(value.to(param.device))


def _checkpoint(wrapped, named, opt, sched, step, wall, args, last, rank, *, fsdp: bool) -> None:
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = _full_state(wrapped, True)
        trained = {n: full[n] for n, _ in named if n in full}  # the full values exist on rank 0 only
        optim = get_optimizer_state_dict(wrapped, opt, options=StateDictOptions(full_state_dict=True,
                                                                                      cpu_offload=True))
    else:
        trained = {n: p.detach().cpu() for n, p in named}
        optim = opt.state_dict()
    if rank == 0:
        torch_save_atomic({"trained": trained, "optimizer": optim, "scheduler": sched.state_dict(), "step": step,
                           "wall_time": wall, "torch_rng": torch.get_rng_state(), "args": vars(args).copy()}, last)


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
