"""A released CoMemo checkpoint, converted, against the numbers the release's own code produced (memory on).

``tests/fixtures/comemo`` (see its README) holds a tiny random model in the release's format and what the release's
``CoMemoChatModel.chat`` computed with it: prompt ids, position ids, logits and 16 greedy ids on images tiled 1x2,
2x2 and 2x3 (+ thumbnail), alone and together, RoPE-DHR on and off. Here the folder goes through
``python -m apps.comemo.convert`` and ``CoMemo.from_hf``:

- ``reference=True`` (the release's tile order and decode query positions): logits within 1e-4 (fp32), the same
  ids, the same position ids;
- the project's defaults: identical where the two agree by construction (1-D positions; one row of tiles before
  decoding), different where the fixes bite (column-first tiles on 2x2 / 2x3; the memory's query positions while
  decoding under RoPE-DHR).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from apps.comemo.hf_config import dhr_position_ids  # noqa: E402

FIX = Path(__file__).parent / "fixtures" / "comemo"
META = json.loads((FIX / "cases.json").read_text(encoding="utf-8"))
CASES = list(META["cases"])
TOL = 1e-4


def _tensors():
    from safetensors.torch import load_file

    return load_file(str(FIX / "cases.safetensors"))


T = _tensors()


def _grids(case: str) -> list[list[tuple[int, int]]]:
    return [[tuple(META["grids"][n]) for n in META["cases"][case]["images"]]]


def _pixels(case: str) -> torch.Tensor:
    return torch.cat([T[f"pixels.{n}"].float() for n in META["cases"][case]["images"]])


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from apps.comemo.convert import convert

    out = tmp_path_factory.mktemp("comemo") / "converted"
    convert(FIX / "release", out)
    return out


_MODELS: dict = {}


def _model(folder, reference: bool):
    from apps.comemo.hf import from_hf

    key = (str(folder), reference)
    if key not in _MODELS:
        torch.set_num_threads(1)
        _MODELS[key] = from_hf(folder, reference=reference, device="cpu", dtype=torch.float32)
    return _MODELS[key]


def _run(w, case: str):
    """Prompt logits at the fixture's positions, the 16 ids and the logits they were chosen from."""
    w.positions = META["cases"][case]["positions"]
    ids, pv, grids = T[f"{case}.input_ids"][None], _pixels(case), _grids(case)
    with torch.no_grad():
        logits = w(ids, pv, image_grids=grids).logits[0, T[f"{case}.positions"]]
    gen, step = w.generate(ids, pv, image_grids=grids, max_new_tokens=16, output_logits=True)
    return logits, gen[0], step[0]


# -- position ids: the release's, exactly ---------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_position_ids_are_the_releases(case):
    """The language model's and the memory's position ids the release computed (tile ids not collapsed to 1-D)."""
    ids, mode = T[f"{case}.input_ids"][None], META["cases"][case]["positions"]
    img = ids[0] == META["tokens"]["<IMG_CONTEXT>"]
    pos = dhr_position_ids(ids, META["tokens"]["<IMG_CONTEXT>"], _grids(case), 16, mode=mode, cells="linspace",
                           tile_order="column")[0]
    assert torch.equal(pos, T[f"{case}.position_ids"])
    assert torch.equal(pos[img], T[f"{case}.memory_position_ids"])
    project = dhr_position_ids(ids, META["tokens"]["<IMG_CONTEXT>"], _grids(case), 16, mode=mode, cells="linspace")[0]
    transposed = mode == "dhr" and any(r > 1 and c > 1 for r, c in _grids(case)[0])
    assert torch.equal(project, pos) != transposed  # row-major ids differ exactly where rows and columns are > 1


# -- logits and ids: the release's, within 1e-4 ---------------------------------------------------------------------

FAST = ["1x2_dhr", "2x2_dhr", "2x3_1d", "multi_dhr"]


@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_converted_release_reproduces_the_release(converted, case):
    logits, gen, step = _run(_model(converted, True), case)
    torch.testing.assert_close(logits, T[f"{case}.logits"], rtol=0, atol=TOL)
    torch.testing.assert_close(step[0], T[f"{case}.logits"][-1], rtol=0, atol=TOL)  # the first token's
    torch.testing.assert_close(step[1:], T[f"{case}.step_logits"], rtol=0, atol=TOL)  # each decode step's
    assert gen.tolist() == T[f"{case}.generated"].tolist()


def test_project_settings_differ_from_the_release_only_where_intended(converted):
    w = _model(converted, False)
    assert not w.config.reference and w.config.tile_order == "row" and w.config.decode_query_positions == "next"
    # 1-D positions: the fixes change nothing
    logits, gen, step = _run(w, "2x3_1d")
    torch.testing.assert_close(logits, T["2x3_1d.logits"], rtol=0, atol=TOL)
    torch.testing.assert_close(step[1:], T["2x3_1d.step_logits"], rtol=0, atol=TOL)
    # one row of tiles: the prompt is the release's; decoding queries the memory at other positions
    logits, gen, step = _run(w, "1x2_dhr")
    torch.testing.assert_close(logits, T["1x2_dhr.logits"], rtol=0, atol=TOL)
    assert (step[1:] - T["1x2_dhr.step_logits"]).abs().max() > 1e-3
    # 2x2: row-major tile ids change the prompt's logits
    logits, _, _ = _run(w, "2x2_dhr")
    assert (logits - T["2x2_dhr.logits"]).abs().max() > 1e-3


def test_each_fix_is_its_own_switch(converted):
    """Only one setting at the release's value: exactly the part of the output it governs matches the release."""
    import dataclasses

    w = _model(converted, False)
    saved = w.config
    try:
        w.config = dataclasses.replace(saved, tile_order="column")  # 2x2: the prompt is the release's again
        logits, _, step = _run(w, "2x2_dhr")
        assert (logits - T["2x2_dhr.logits"]).abs().max() <= TOL
        assert (step[1:] - T["2x2_dhr.step_logits"]).abs().max() > 1e-3  # decoding still queries at other positions
        w.config = dataclasses.replace(saved, decode_query_positions="count")  # 1x2: decoding is the release's again
        _, gen, step = _run(w, "1x2_dhr")
        assert (step[1:] - T["1x2_dhr.step_logits"]).abs().max() <= TOL
        assert gen.tolist() == T["1x2_dhr.generated"].tolist()
    finally:
        w.config = saved


# -- prompts: the folder's chat template and processor build the release's prompt -----------------------------------

def _image(grid, tile=64):
    import numpy as np
    from PIL import Image

    rows, cols = grid
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (rows * tile, cols * tile, 3), dtype=np.uint8))


@pytest.mark.parametrize("case", ["1x2_dhr", "multi_dhr"])
def test_prompt_is_the_releases_chat_prompt(converted, case):
    w = _model(converted, False)
    c = META["cases"][case]
    enc = w.prompt([_image(META["grids"][n]) for n in c["images"]], c["question"])
    assert enc.input_ids[0].tolist() == T[f"{case}.input_ids"].tolist()
    assert enc.image_grids == _grids(case)
    assert enc.pixel_values.shape[0] == _pixels(case).shape[0]


def test_answer_in_a_few_lines(converted):
    from apps.comemo import CoMemo

    model = CoMemo.from_hf(converted, device="cpu")
    assert model.config.kv_heads == "full" and model.config.ffn == "swiglu" and model.config.rope_base == 1e6
    text = model.answer([_image((2, 2))], "Describe the image in detail.", max_new_tokens=4)
    assert isinstance(text, str) and text
    enc = model.prompt([_image((2, 2))], "Describe", answer="a red square")
    n_ans = int((enc.labels[0] != -100).sum())
    assert n_ans >= 2 and enc.labels[0, -1] == META["tokens"]["<|im_end|>"]  # answer + the template's end of turn
