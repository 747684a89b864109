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


# -- the converter: files, checks, refusals --------------------------------------------------------------------------

def _bad_release(tmp_path, name, *, config=None, extra_tensor=False):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / name
    shutil.copytree(FIX / "release", folder)
    if config is not None:
        cfg = json.loads((folder / "config.json").read_text())
        config(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    if extra_tensor:
        t = load_file(str(folder / "model.safetensors"))
        t["language_model.model.layers.0.decoder_layer.attention.rotary_emb.inv_freq"] = torch.ones(8)
        save_file(t, str(folder / "model.safetensors"))
    return folder


def _cli(argv, capsys) -> tuple[int, str]:
    from apps.comemo.convert import main
    from core.infra.cli import run_cli

    code = run_cli(main, [str(a) for a in argv])
    return code, capsys.readouterr().err.strip()


def test_convert_cli_writes_a_checked_folder_and_refuses_in_one_line(tmp_path, capsys):
    from apps.comemo.hf import from_hf

    out = tmp_path / "out"
    code, err = _cli([FIX / "release", out, "--no-hash"], capsys)
    assert code == 0, err
    prov = json.loads((out / "comemo_conversion.json").read_text(encoding="utf-8"))
    assert prov["round_trip"] == "every tensor equal" and prov["memory"]["layers"] == [3, 7]
    assert prov["memory"]["kv_heads"] == "full" and prov["memory"]["dhr_cells"] == "linspace"
    assert (out / "README.md").read_text(encoding="utf-8").startswith("---")
    assert not (tmp_path / "out.partial").exists()
    cases = {
        "exists": ([FIX / "release", out], "exists"),
        "same": ([FIX / "release", FIX / "release"], "also an input"),
        "internvl": ([_bad_release(tmp_path, "a", config=lambda c: c.update(model_type="internvl")), tmp_path / "o1"],
                     "found model_type 'internvl'"),
        "llama": ([_bad_release(tmp_path, "b", config=lambda c: c["llm_config"].update(architectures=["LlamaForCausalLM"])),
                   tmp_path / "o2"], "found a LlamaForCausalLM language model"),
        "v1": ([_bad_release(tmp_path, "c", config=lambda c: c.update(ps_version="v1")), tmp_path / "o3"],
               "ps_version 'v1'"),
        "extra": ([_bad_release(tmp_path, "d", extra_tensor=True), tmp_path / "o4"], "unexpected tensors"),
    }
    for name, (argv, needle) in cases.items():
        code, err = _cli(argv, capsys)
        assert code == 2 and err.count("\n") == 0 and needle in err and err.startswith("error:"), (name, err)
        if name not in ("exists", "same"):
            assert "accepted" in err and not argv[1].exists()
    with pytest.raises(ValueError, match="convert it first"):
        from_hf(FIX / "release")


def test_predict_answers_from_a_converted_folder(converted, tmp_path, capsys):
    from apps.comemo.predict import main
    from core.infra.cli import run_cli

    img = tmp_path / "a.png"
    _image((1, 2)).save(img)
    code = run_cli(main, ["--model", str(converted), "--images", str(img), "--question", "Describe the image.",
                          "--max-new-tokens", "3", "--device", "cpu"])
    out = capsys.readouterr()
    assert code == 0 and out.out.strip(), out.err
    code = run_cli(main, ["--model", str(tmp_path), "--images", str(img), "--question", "q", "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "not a model folder" in err and err.count("\n") == 0
    if not torch.cuda.is_available():  # a GPU asked for by name on a machine without one: one line, exit 2
        code = run_cli(main, ["--model", str(converted), "--images", str(img), "--question", "q", "--device", "cuda"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "no CUDA GPU" in err and err.count("\n") == 0


def test_real_size_benchmark_runs_at_toy_widths(tmp_path):
    """benchmarks/comemo_real_size.py end to end (write, convert, load, forward, 16 tokens) at toy widths."""
    from benchmarks.comemo_real_size import run

    res = run("tiny", tmp_path, device="cpu", dtype="float32", threads=1)
    assert res["grids"] == [[(2, 2), (2, 2)]] and res["image_tokens"] == 2 * 5 * 256
    assert len(res["generated"]) == 16 and res["last_logits_finite"]
    assert set(res["steps"]) == {"write", "convert", "load", "forward", "generate"}
