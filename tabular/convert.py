"""Convert an official TabICL checkpoint (``tabicl-classifier-*.ckpt``) to this project's ``.safetensors`` format.

    python -m tabular.convert tabicl-classifier-v1-20250208.ckpt tabicl_v1.safetensors

Writes ``OUT.safetensors`` (fp32 weights, the config with the architecture switches in its metadata, the card in
``extra``), ``OUT.json`` (provenance: source file and its SHA-256, version, official config) and ``OUT.md`` (the
model card), each atomically. The written file loads with ``tabular.load_model`` / ``TabICLClassifier(checkpoint=)``
and gives the same logits as the ``.ckpt`` (the conversion is checked before anything is written).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from core.infra.cli import UsageError, run_cli
from core.infra.fileio import file_sha256
from core.infra.guard import check_outputs

__all__ = ["main", "convert"]


def _card_md(out: Path, card: dict, n_params: int) -> str:
    cfg = json.dumps(card["config"], indent=1)
    if card.get("task") == "regression":
        use = (f'`TabICLRegressor(checkpoint="{out.name}")` (the official package\'s preprocessing and ensembling, '
               "needs `pip install tabicl==2.2.0`).")
    else:
        use = (f'`TabICLClassifier(checkpoint="{out.name}")` (this project\'s pipeline) or with `official=True` (the '
               "official\n  package's preprocessing and ensembling, needs `pip install tabicl==2.2.0`).")
    return f"""# {out.stem}: TabICL {card['release']} (official weights, converted)

- Source: `{card['file']}` (SHA-256 `{card['source_sha256']}`), the official TabICL release {card['release']}
  (architecture {card['version']}), converted by `{card['command']}`.
- {n_params:,} parameters, fp32. Same logits as the source file through `tabular.load_model` (checked at conversion:
  max |difference| {card['check_max_abs_diff']:.2e} on a random table).
- Use: {use}
- The weights are the official release's; its license and terms apply (see the TabICL repository). Nothing here was
  trained by this project.

Configuration (`tabular.model.TabICLConfig`):

```json
{cfg}
```
"""


def convert(src: Path, out: Path, *, command: str) -> dict:
    """Read, check and write; returns the card."""
    import torch

    from tabular.weights_io import atomic_write_text, load_model, save_model

    model = load_model(src)
    # The check: the converted model written to a temp file, read back, same logits on a random table.
    g = torch.Generator().manual_seed(0)
    X = torch.randn(1, 48, 5, generator=g)
    y = torch.arange(32).remainder(3)[None]
    card = dict(model.card, source_sha256=file_sha256(src), command=command, config=model.config.to_dict())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.check.safetensors")
    try:
        save_model(model, tmp, extra=card)
        back = load_model(tmp)
        with torch.no_grad():
            diff = float((model(X, y) - back(X, y)).abs().max())
        if not diff <= 1e-6:
            raise RuntimeError(f"the converted weights do not reproduce {src.name} (max |diff| {diff:.3g})")
        card["check_max_abs_diff"] = diff
        save_model(model, out, extra=card)
    finally:
        tmp.unlink(missing_ok=True)
    n_params = sum(p.numel() for p in model.parameters())
    atomic_write_text(out.with_suffix(".json"), json.dumps({"model": f"TabICL {card['release']} (official)",
                                                           "parameters": n_params, **card}, indent=2) + "\n")
    atomic_write_text(out.with_suffix(".md"), _card_md(out, card, n_params))
    return card


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tabular.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path, help="official checkpoint (tabicl-classifier-v1-20250208.ckpt, -v1.1-20250506, "
                   "-v2-20260212, tabicl-regressor-v2-20260212.ckpt)")
    p.add_argument("out", type=Path, help="output .safetensors (OUT.json and OUT.md are written beside it)")
    args = p.parse_args(argv)
    check_outputs([("OUT", args.out), ("OUT", args.out.with_suffix(".json")), ("OUT", args.out.with_suffix(".md"))],
                  inputs=[args.src])
    if args.out.suffix != ".safetensors":
        raise UsageError(f"OUT must end in .safetensors, got {str(args.out)!r}")
    if not args.src.is_file():
        raise UsageError(f"{str(args.src)!r} is not a file (expected an official TabICL .ckpt checkpoint)")
    if args.src.suffix != ".ckpt":
        raise UsageError(f"{str(args.src)!r} is not a .ckpt file (expected an official TabICL checkpoint)")
    if args.out.exists() and args.out.resolve() == args.src.resolve():
        raise UsageError("OUT must differ from the source checkpoint")
    try:
        card = convert(args.src, args.out, command=f"python -m tabular.convert {args.src.name} {args.out.name}")
    except ValueError as e:  # unreadable or unsupported checkpoint: one line, exit 2
        raise UsageError(str(e)) from None
    print(f"wrote {args.out} (TabICL {card['release']}, architecture {card['version']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
