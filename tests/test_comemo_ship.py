"""apps.comemo as a user gets it: the shipped default (golden outputs, size, card, tokenizer), the attention
probes behind the tab, and the hub tab's functions with their refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from apps.comemo.api import DEFAULT_WEIGHTS, CoMemo
from apps.comemo.synthetic import make_sample

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def shipped():
    return CoMemo.load()


def test_shipped_weights_golden_size_card_and_tokenizer(shipped):
    from apps.comemo.ship import GOLDEN_PATH, golden_outputs

    assert DEFAULT_WEIGHTS.stat().st_size <= 20 * 2**20
    tok_file = DEFAULT_WEIGHTS.with_name("tokenizer.json")
    assert json.loads(tok_file.read_text())["model"]["type"] == "BPE"  # the tokenizers library's format
    stored = json.loads(GOLDEN_PATH.read_text())
    got = golden_outputs(shipped)
    for g, s in zip(got["samples"], stored["samples"], strict=True):
        assert g["answer_targets"] == s["answer_targets"]
        np.testing.assert_allclose(g["answer_logits"], s["answer_logits"], atol=1e-3, rtol=0)
        assert g["greedy_answer"] == s["greedy_answer"]
    # the stored outputs are those of a model that does the task it is shipped for
    assert all(s["greedy_answer"] == s["answer"] for s in stored["samples"])
    prov = json.loads(DEFAULT_WEIGHTS.with_suffix(".json").read_text())
    assert prov["model_config"]["variant"] == "comemo" and prov["steps"] > 0
    card = DEFAULT_WEIGHTS.with_suffix(".md").read_text()
    assert card.startswith("---\nlicense:") and prov["command"] in card


def test_predict_cli_uses_the_shipped_default(tmp_path, capsys, shipped):
    from apps.comemo.predict import main as predict_main

    s = make_sample("needle", 4, 4321, tile=32, needle=2)
    paths = []
    for i, im in enumerate(s.images):
        paths.append(tmp_path / f"{i}.png")
        Image.fromarray(im).save(paths[-1])
    assert predict_main(["--question", s.question, "--images", *map(str, paths)]) == 0
    assert capsys.readouterr().out.strip() == shipped.answer([str(p) for p in paths], s.question)


def test_memory_probe_is_uniform_when_queries_are_blind(shipped):
    """With zero query projections every memory key gets the same weight, so an image's mass is its share of
    the memory tokens: a 2x3-tile image (6 tiles + thumbnail) weighs 7 times a one-tile image."""
    from apps.comemo.model import CoMemoModel
    from apps.comemo.probe import attention_per_image

    model = CoMemoModel(shipped.model.cfg)
    model.load_state_dict(shipped.model.state_dict())
    for block in model.decoder.cross.values():
        torch.nn.init.zeros_(block.attn.q_proj.weight)
        if block.attn.q_proj.bias is not None:
            torch.nn.init.zeros_(block.attn.q_proj.bias)
    small = np.zeros((32, 32, 3), np.uint8)
    wide = make_sample("detail", 1, 7, tile=32, grid=(2, 3)).images[0]
    got = attention_per_image(model.eval(), shipped.tokenizer, [small, wide, small], "which image shows a digit ?")
    np.testing.assert_allclose(got["memory"], [1 / 9, 7 / 9, 1 / 9], atol=1e-5)
    assert 0 < sum(got["context"]) <= 1 + 1e-5 and len(got["context"]) == 3


def test_context_probe_matches_the_decoder_attention(shipped):
    from apps.comemo.batch import build_batch
    from apps.comemo.probe import attention_per_image

    s = make_sample("needle", 5, 99, tile=32, needle=3)
    got = attention_per_image(shipped.model, shipped.tokenizer, s.images, s.question)
    batch = build_batch([(s.images, s.question, None)], shipped.tokenizer, shipped.model.cfg)
    q = batch.input_ids.shape[1] - 1
    out = shipped.model.decoder(**shipped.model.decoder_inputs(batch), use_cache=False, attn_queries=torch.tensor([q]))
    per_layer = [a[0, :, 0].mean(0) for a in out.attentions]
    per_layer = [p.detach() for p in per_layer]
    want = [float(sum(p[a:b].sum() for p in per_layer) / len(per_layer)) for a, b in batch.image_spans[0]]
    np.testing.assert_allclose(got["context"], want, atol=1e-6)
    assert len(got["memory"]) == 5 and abs(sum(got["memory"]) - 1) < 1e-5


@pytest.mark.parametrize("grid", [(1, 3), (3, 1), (2, 3), (3, 2)])
def test_dhr_id_map_places_each_tile_where_it_was_cropped(grid):
    from apps.comemo.probe import dhr_id_map

    rows, cols = grid
    img = make_sample("detail", 1, 5, tile=32, grid=grid).images[0]
    m = dhr_id_map(img, 32, 4)
    assert m["grid"] == grid and m["tiles"].shape == (rows * 4, cols * 4)
    # a token's id is the thumbnail cell under its centre: rows and columns scaled separately
    R, C = np.indices(m["tiles"].shape)
    cell_r = np.floor((R + 0.5) * 4 / (rows * 4)).astype(int)
    cell_c = np.floor((C + 0.5) * 4 / (cols * 4)).astype(int)
    np.testing.assert_array_equal(m["tiles"], m["thumbnail"][cell_r, cell_c])


def test_tab_functions_and_refusals(tmp_path):
    from apps.comemo import ui

    question, answer, *imgs, status = ui.ask_sample("needle", 4, 2, 1)
    assert question == ui.NEEDLE_QUESTION and status.startswith("Done") and "**Expected:**" in answer
    for img in imgs:
        assert img.ndim == 3 and img.shape[2] == 3 and len(np.unique(img.reshape(-1, 3), axis=0)) > 2
    _, answer, *_ = ui.ask_sample("detail", 1, 1, 2)
    assert "**Answer:**" in answer
    for bad, msg in ((("needle", 4, 5, 0), "needle position must be in 1..4"), (("needle", 0, 1, 0), "number of images"),
                     (("count", 2, 1, 0), "task must be"), (("needle", "x", 1, 0), "whole numbers")):
        with pytest.raises(ValueError, match=msg):
            ui.ask_sample(*bad)
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        ui.ask(ui._load_uploads([str(empty)]), "q ?")
    with pytest.raises(ValueError, match="at least one image"):
        ui._load_uploads([])
    with pytest.raises(ValueError, match="question is empty"):
        ui.ask([np.zeros((32, 32, 3), np.uint8)], "  ")
