"""A card rendered from a weights file and its JSON provenance (Hugging Face convention)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


from core.infra.model_card.discovery import provenance_path, weights_summary
from core.infra.model_card.texts import (
    _ARCH,
    _DATA,
    _DESCRIPTION,
    _EVAL,
    _METRIC_WORDS,
    _NAME,
    _NOTES,
    _SELECTION,
    _TRAIN,
    GENERATOR,
    LICENSE,
    NOT_RECORDED,
    PACKAGE_TEXT,
    REPO,
    CardText,
)

# --------------------------------------------------------------------------------------------- rendering helpers


def _num(v: float | int) -> str:
    """A number as the JSON has it (floats shortened to 4 decimals, which never adds digits)."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int):
        return str(v)
    r = round(v, 4)
    return repr(r) if r != 0 or v == 0 else f"{v:.3g}"


def _scalar(v: Any) -> str:
    if v is None:
        return f"{NOT_RECORDED} (null)"
    if isinstance(v, (int, float)):
        return _num(v)
    return str(v)


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def _inline_list(v: Any) -> bool:
    """A list short enough for one line: scalars, none of them a phrase (a string with spaces)."""
    return isinstance(v, list) and all(_is_scalar(x) and not (isinstance(x, str) and " " in x) for x in v)


def _cell(v: Any) -> str:
    return " ".join(_scalar(v).replace("|", "\\|").split())


def _is_table(v: Any) -> bool:
    """``{"columns": [...], "rows": [[...], ...]}`` with scalar cells and one cell per column in every row."""
    if not (isinstance(v, dict) and set(v) == {"columns", "rows"}):
        return False
    cols, rows = v["columns"], v["rows"]
    return (isinstance(cols, list) and bool(cols) and all(_is_scalar(c) for c in cols) and isinstance(rows, list)
            and all(isinstance(r, list) and len(r) == len(cols) and all(_is_scalar(x) for x in r) for r in rows))


def _table(v: dict[str, list]) -> list[str]:
    return [
        "| " + " | ".join(_cell(c) for c in v["columns"]) + " |",
        "|" + "---|" * len(v["columns"]),
        *("| " + " | ".join(_cell(x) for x in row) + " |" for row in v["rows"]),
    ]


def _render(value: Any, indent: int = 0) -> list[str]:
    """Markdown lines for any JSON value: a scalar inline, lists and objects as nested bullet lists.

    A list of scalars stays on one line; an object whose values are all scalars and that has at least four of
    them becomes a two-column table at the top level.
    """
    pad = "  " * indent
    if _is_scalar(value):
        return [pad + _scalar(value)]
    if _is_table(value):
        return ["", *(pad + line for line in _table(value)), ""]
    if isinstance(value, list):
        if _inline_list(value):
            return [pad + (", ".join(_scalar(v) for v in value) if value else "(empty)")]
        out = []
        for v in value:
            if isinstance(v, dict) and all(_is_scalar(x) or _inline_list(x) for x in v.values()):
                out.append(pad + "- " + "; ".join(f"{k}: {_render(x)[0].strip()}" for k, x in v.items()))
                continue
            sub = _render(v, indent + 1)
            out.append(pad + "- " + sub[0].strip())
            out.extend(sub[1:])
        return out
    if isinstance(value, dict):
        if indent == 0 and len(value) >= 4 and all(_is_scalar(v) for v in value.values()):
            return ["| field | value |", "|---|---|"] + [f"| {_cell(k)} | {_cell(v)} |" for k, v in value.items()]
        out = []
        for k, v in value.items():
            if _is_scalar(v) or _inline_list(v):
                out.append(f"{pad}- {k}: {_render(v)[0].strip()}")
            else:
                out.append(f"{pad}- {k}:")
                out.extend(_render(v, indent + 1))
        return out
    return [pad + str(value)]


def _field_lines(label: str, value: Any) -> list[str]:
    """``- **label**: value`` for a scalar or a list of scalars, a nested list below the label otherwise."""
    if _is_scalar(value) or _inline_list(value):
        return [f"- **{label}**: {_render(value)[0]}"]
    if _is_table(value):
        return [f"- **{label}**:", ""] + ["  " + line for line in _table(value)] + [""]
    if isinstance(value, dict) and len(value) >= 4 and all(_is_scalar(v) for v in value.values()):
        return [f"- **{label}**:", ""] + ["  " + line for line in _render(value)] + [""]
    return [f"- **{label}**:"] + _render(value, 1)


def _yaml_scalar(v: Any) -> str:
    """A YAML scalar: numbers as they are, strings double-quoted (JSON string syntax is valid YAML)."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v), ensure_ascii=False)


def _yaml(header: dict[str, Any]) -> list[str]:
    lines = []
    for k, v in header.items():
        if isinstance(v, list):
            if not v:
                lines.append(f"{k}: []")
            else:
                lines.append(f"{k}:")
                lines.extend(f"- {_yaml_scalar(x)}" for x in v)
        else:
            lines.append(f"{k}: {_yaml_scalar(v)}")
    return lines


def _leaf_keys(value: Any, prefix: str = "") -> list[str]:
    out = []
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, (dict, list)):
                out.extend(_leaf_keys(v, str(k)))
            else:
                out.append(str(k))
                if isinstance(v, (int, float)) and prefix:
                    out.append(prefix)
    elif isinstance(value, list):
        for v in value:
            out.extend(_leaf_keys(v, prefix))
    return out


def _metric_ids(evaluation: dict[str, Any]) -> list[str]:
    """Metric ids for the YAML header, from the key names of the recorded evaluation (no values)."""
    ids = set()
    keys = [k.lower() for k in _leaf_keys(evaluation)] + [k.lower() for k in evaluation]
    for key in keys:
        for word, mid in _METRIC_WORDS:
            if word in key:
                ids.add(mid)
                break
    return sorted(ids)


def _card_text(package: str, stem: str, record: dict[str, Any]) -> CardText:
    """Package text, refined by the longest ``package/stem-prefix`` key, then by the JSON's ``model_card`` object."""
    base = PACKAGE_TEXT.get(package, CardText())
    text = CardText(
        intended_use=base.intended_use,
        out_of_scope=base.out_of_scope,
        tags=list(base.tags),
        pipeline_tag=base.pipeline_tag,
        datasets=list(base.datasets),
        limitations=list(base.limitations),
        language=base.language,
    )
    prefixes = sorted((k for k in PACKAGE_TEXT if k.startswith(package + "/") and stem.startswith(k[len(package) + 1 :])), key=len)
    for key in prefixes:
        extra = PACKAGE_TEXT[key]
        if extra.intended_use != NOT_RECORDED:
            text.intended_use = extra.intended_use
        if extra.out_of_scope != NOT_RECORDED:
            text.out_of_scope = extra.out_of_scope
        if extra.tags:
            text.tags = list(extra.tags)
        if extra.pipeline_tag:
            text.pipeline_tag = extra.pipeline_tag
        if extra.datasets:
            text.datasets = list(extra.datasets)
        if extra.language:
            text.language = extra.language
        text.limitations += extra.limitations
    for name in ("intended_use", "out_of_scope"):  # the JSON's own words win over the package's
        if isinstance(record.get(name), str) and record[name].strip():
            setattr(text, name, record[name])
    own = record.get("model_card")
    if isinstance(own, dict):
        for name in ("intended_use", "out_of_scope", "pipeline_tag", "language"):
            if own.get(name):
                setattr(text, name, str(own[name]))
        for name in ("tags", "datasets", "limitations"):
            if own.get(name):
                setattr(text, name, [str(x) for x in own[name]])
    return text


def _datasets(record: dict[str, Any], text: CardText) -> list[str]:
    names = list(text.datasets)
    ds = record.get("dataset")
    if isinstance(ds, dict) and ds.get("path"):
        names.append(f"{Path(str(ds['path'])).stem} (rl.generate)" if "metadata" in ds else Path(str(ds["path"])).stem)
    if not names and record.get("env"):
        names.append(f"{record['env']} (interaction)")
    return names or [NOT_RECORDED]


# --------------------------------------------------------------------------------------------- the card


def _not_met(value: Any, where: str = "") -> list[tuple[str, str]]:
    """Every recorded string that says a target was not met, with where it sits in the JSON."""
    if isinstance(value, str):
        return [(where, value)] if "not met" in value.lower() else []
    if isinstance(value, dict):
        return [hit for k, v in value.items() for hit in _not_met(v, f"{where}.{k}" if where else str(k))]
    if isinstance(value, list):
        return [hit for i, v in enumerate(value) for hit in _not_met(v, f"{where}[{i}]")]
    return []


def _pick(record: dict[str, Any], keys: Sequence[str], used: set[str]) -> list[tuple[str, Any]]:
    out = []
    for k in keys:
        if k in record and k not in used:
            used.add(k)
            out.append((k, record[k]))
    return out


def render_card(weights: Path, *, root: Path = REPO) -> str:
    """The model card (Markdown with a YAML header) of ``weights``, from its JSON (:func:`provenance_path`).

    Raises ``FileNotFoundError`` when the JSON is missing and ``ValueError`` when it is not a JSON object.
    """
    weights = Path(weights)
    prov = provenance_path(weights)
    if not prov.is_file():
        where = "beside it" if prov.parent == weights.parent else f"in {prov.parent}"
        raise FileNotFoundError(f"{weights} has no provenance file {prov.name} {where}; every shipped weights file needs one")
    try:
        record = json.loads(prov.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{prov} is not valid JSON: {e}") from e
    if not isinstance(record, dict):
        raise ValueError(f"{prov} must hold a JSON object, got {type(record).__name__}")
    try:
        rel = weights.resolve().relative_to(Path(root).resolve())
    except ValueError:
        rel = Path(weights.name)
    package = rel.parts[0] if len(rel.parts) > 2 else "unknown"
    if package == "apps" and len(rel.parts) > 3:
        package = f"apps/{rel.parts[1]}"
    stem = prov.stem
    text = _card_text(package, stem, record)
    info = weights_summary(weights)
    # dm_hopper-style records keep their card fields one level down; lift them (names stay visible in the card).
    nested = record.get("card") if isinstance(record.get("card"), dict) else {}
    used: set[str] = {k for k in ("intended_use", "out_of_scope") if isinstance(record.get(k), str) and record[k].strip()}

    evaluation = {k: v for k, v in record.items() if k in _EVAL}
    for k in ("evaluate_result", "evaluations", "last_train_metrics"):
        if k in nested:
            evaluation[f"card.{k}"] = nested[k]
    header = {
        "license": LICENSE,
        **({"language": text.language} if text.language else {}),
        "library_name": "pytorch",
        "tags": ["longctx", package.split("/")[-1], *[t for t in text.tags if t != package], "safetensors"],
        "datasets": _datasets(record, text),
        "metrics": _metric_ids(evaluation) or [NOT_RECORDED],
    }
    if text.pipeline_tag:
        header["pipeline_tag"] = text.pipeline_tag
    # drop repeated tags, keep order
    seen: set[str] = set()
    header["tags"] = [t for t in header["tags"] if not (t in seen or seen.add(t))]

    lines = ["---", *_yaml(header), "---", "", f"# {stem}", ""]
    desc = _pick(record, _DESCRIPTION, used)
    name = _pick(record, _NAME, used)
    if desc:
        lines += [_scalar(desc[0][1]), ""]
    elif isinstance(nested.get("note"), str):
        lines += [nested["note"], ""]
        used.add("card.note")
    elif name and isinstance(name[0][1], str):
        lines += [f"{name[0][1]}.", ""]
    elif isinstance(record.get("algorithm"), str) and record.get("env"):
        lines += [f"{record['algorithm']}, trained on {record['env']}.", ""]
    lines += [
        f"Weights `{rel.as_posix()}`; provenance [`{prov.name}`]({prov.name}). This card is generated from that JSON "
        f"and the weights file by `{GENERATOR}`; edit the JSON (or the generator), never this file.",
        "",
        "## Model details",
        "",
    ]
    if name:
        n = name[0][1]
        lines += _field_lines("model", n) if not isinstance(n, str) else [f"- **model**: {n}"]
    elif isinstance(record.get("algorithm"), str):
        used.add("algorithm")
        lines.append(f"- **algorithm**: {record['algorithm']}")
    else:
        lines.append(f"- **model**: {NOT_RECORDED}")
    for k, v in _pick(record, _ARCH, used):
        lines += _field_lines(k, v)
    if "parameters" in record:
        used.add("parameters")
        lines.append(f"- **parameters**: {_scalar(record['parameters'])} (as recorded)")
    lines += [
        f"- **file**: {info['bytes']} bytes, {info['tensors']} tensors, {info['elements']} elements "
        f"({', '.join(info['dtypes'])}), SHA-256 `{info['sha256']}`",
        f"- **licence**: MIT (the project's licence); **library**: PyTorch, weights in safetensors",
        "- **how to use**: see [the package README](../README.md)" if (Path(root) / package / "README.md").is_file() else
        f"- **how to use**: {NOT_RECORDED}",
        "",
        "## Intended use",
        "",
        text.intended_use,
        "",
        "## Out-of-scope use",
        "",
        text.out_of_scope,
        "",
        "## Training data",
        "",
    ]
    data = _pick(record, _DATA, used)
    if data:
        for k, v in data:
            lines += _field_lines(k, v)
    elif record.get("env"):
        lines.append(f"- No dataset: the algorithm collects its own data by interacting with `{record['env']}` (see the command).")
    else:
        lines.append(f"- {NOT_RECORDED}")
    lines += ["", "## Training procedure", ""]
    command = record.get("command", nested.get("command"))
    used.add("command")
    if "command" in nested and "command" not in record:
        used.add("card.command")
    if command:
        lines += ["Command:", "", "```bash", str(command), "```", ""]
    else:
        lines += [f"Command: {NOT_RECORDED}", ""]
    train = _pick(record, _TRAIN, used)
    for k in ("steps", "train_wall_s_estimate"):
        if k in nested:
            train.append((f"card.{k}", nested[k]))
            used.add(f"card.{k}")
    if not any(k in ("steps", "step", "trained_steps", "card.steps") for k, _ in train):
        lines.append(f"- **steps**: {NOT_RECORDED}")
    if not any(k in ("wall_time_s", "train_seconds", "train_wall_s", "card.train_wall_s_estimate") for k, _ in train):
        lines.append(f"- **wall time**: {NOT_RECORDED}")
    for k, v in train:
        lines += _field_lines(k, v)
    selection = _pick(record, _SELECTION, used)
    if selection:
        lines += ["", "## How this model was chosen", ""]
        for k, v in selection:
            lines += [v, ""] if isinstance(v, str) else _field_lines(k, v)
    lines += ["", "## Evaluation", ""]
    eval_cmd = None
    for k in ("benchmark", "finetuned_benchmark", "scaling"):
        b = record.get(k)
        if isinstance(b, dict) and (b.get("command") or b.get("commands")):
            eval_cmd = eval_cmd or b.get("command") or b.get("commands")
    if eval_cmd is None and isinstance(nested.get("evaluate_result"), dict):
        eval_cmd = nested.get("command")
    if eval_cmd is None:
        lines.append(
            f"Command: {NOT_RECORDED} as a separate evaluation; the training run recorded the metrics below "
            "(each named with the set it was measured on, where the JSON names one)."
            if evaluation
            else f"Command: {NOT_RECORDED}."
        )
    elif eval_cmd == command:
        lines.append("Command: the training command above, which also evaluated the model.")
    else:
        cmds = eval_cmd if isinstance(eval_cmd, list) else [eval_cmd]
        lines += ["Command (the first recorded; each block below names its own):", "", "```bash", *map(str, cmds), "```"]
    lines.append("")
    if not evaluation:
        lines.append(f"- {NOT_RECORDED}")
    for k, v in _pick(record, _EVAL, used):
        lines += _field_lines(k, v)
    for k in ("evaluate_result", "evaluations", "last_train_metrics"):
        if k in nested:
            used.add(f"card.{k}")
            lines += _field_lines(f"card.{k}", nested[k])
    lines += ["", "## Limitations", ""]
    lims = [f"- {x}" for x in text.limitations]
    lims += [f"- Target not met (`{where}`): {line}" for where, line in _not_met(record)]
    for k, v in _pick(record, _NOTES, used):
        lims += _field_lines(k, v)
    if isinstance(nested.get("note"), str) and "card.note" not in used:
        used.add("card.note")
        lims += _field_lines("card.note", nested["note"])
    lines += lims or [f"- {NOT_RECORDED}"]
    rest = {k: v for k, v in record.items() if k not in used and k != "card" and k != "model_card"}
    rest_nested = {f"card.{k}": v for k, v in nested.items() if f"card.{k}" not in used}
    rest.update(rest_nested)
    if "model_card" in record:
        rest["model_card"] = record["model_card"]
    if rest:
        lines += ["", "## Other recorded fields", ""]
        for k, v in rest.items():
            lines += _field_lines(k, v)
    return "\n".join(line.rstrip() for line in lines).rstrip() + "\n"



