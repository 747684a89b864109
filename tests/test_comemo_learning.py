"""CoMemo options that made the synthetic tasks learnable: image labels in the prompt, the image-token scale,
the image-count range of training samples, and the stage -1 vision pretraining."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from apps.comemo.batch import build_batch
from apps.comemo.model import CoMemoConfig, CoMemoModel, VisionConfig
from apps.comemo.synthetic import corpus_texts, make_sample
from apps.comemo.tokenizer import prompt_text, train_tokenizer
from apps.comemo.train import draw_examples
from apps.comemo.train import main as train_main
from apps.comemo.vision_pretrain import NO_DIGIT, NO_SHAPE, TileHeads, draw_tiles, make_tile
from apps.comemo.vision_pretrain import main as pretrain_main

TINY = ["--dim", "32", "--depth", "2", "--heads", "2", "--cross-every", "1", "--tile", "16", "--vision-dim", "16",
        "--vision-depth", "1", "--no-progress"]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(corpus_texts())


def _cfg(variant="comemo", **kw):
    return CoMemoConfig(variant=variant, dim=32, depth=2, num_heads=2, cross_every=1,
                        vision=VisionConfig(tile=16, dim=16, depth=1), **kw)


def test_prompt_labels_each_image(tok):
    assert prompt_text(2, "q ?", image_labels="before") == "<s> image 1<image> image 2<image> q ?"
    assert prompt_text(2, "q ?", image_labels="after") == "<s><image> image 1<image> image 2 q ?"
    assert prompt_text(2, "q ?") == "<s><image><image> q ?"
    with pytest.raises(ValueError, match="image_labels"):
        prompt_text(2, "q ?", image_labels="yes")
    s = make_sample("needle", 3, 4, tile=16)
    before, _ = tok.encode_example(3, s.question, s.answer, image_labels="before")
    after, _ = tok.encode_example(3, s.question, s.answer, image_labels="after")
    assert before.count(tok.image_id) == after.count(tok.image_id) == 3
    # the two tokens before (after) each <image> are the word "image" and its number
    for k, at in enumerate(i for i, t in enumerate(before) if t == tok.image_id):
        assert tok.decode(before[at - 2:at]).split() == ["image", str(k + 1)]
    for k, at in enumerate(i for i, t in enumerate(after) if t == tok.image_id):
        assert tok.decode(after[at + 1:at + 3]).split() == ["image", str(k + 1)]


@pytest.mark.parametrize("variant", ["lvlm-1d", "comemo", "flamingo"])
def test_labelled_batch_keeps_image_slots_and_adds_label_tokens(tok, variant):
    s = make_sample("needle", 3, 7, tile=16)
    ex = [(s.images, s.question, s.answer)]
    plain = build_batch(ex, tok, _cfg(variant))
    after = build_batch(ex, tok, _cfg(variant, image_labels="after"))
    for k, (_, b) in enumerate(after.image_spans[0]):  # the label follows its image
        assert tok.decode(after.input_ids[0, b:b + 2].tolist()).split() == ["image", str(k + 1)]
    lab = build_batch(ex, tok, _cfg(variant, image_labels="before"))
    assert int((lab.image_slot >= 0).sum()) == int((plain.image_slot >= 0).sum())
    assert lab.input_ids.shape[1] > plain.input_ids.shape[1]
    # labels (the loss) cover the same answer tokens
    assert lab.labels[lab.labels != -100].tolist() == plain.labels[plain.labels != -100].tolist()
    # every image span is preceded by the token of its number
    for k, (a, _) in enumerate(lab.image_spans[0]):
        assert tok.decode(lab.input_ids[0, a - 1:a].tolist()).strip() == str(k + 1)
    # positions grow by the label tokens and stay increasing over the text
    text = lab.image_slot[0] < 0
    pos = lab.position_ids[0][text & ~lab.padding_mask[0]]
    assert bool((pos[1:] > pos[:-1]).all())


def test_image_token_scale_multiplies_the_image_tokens():
    torch.manual_seed(0)
    a = CoMemoModel(_cfg())
    b = CoMemoModel(_cfg(image_token_scale=0.25))
    b.load_state_dict(a.state_dict())
    tiles = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        ta, tb = a.image_tokens(tiles), b.image_tokens(tiles)
    assert torch.allclose(tb, 0.25 * ta, atol=1e-6) and not torch.allclose(ta, tb)
    with pytest.raises(ValueError, match="image_token_scale"):
        _cfg(image_token_scale=0.0)
    # files written before the option load with factor 1 and no labels
    d = json.loads(_cfg().to_json())
    d.pop("image_token_scale"), d.pop("image_labels")
    old = CoMemoConfig.from_json(json.dumps(d))
    assert old.image_token_scale == 1.0 and old.image_labels == "none"
    assert _cfg(image_labels=True).image_labels == "before"  # the option's first form, a flag
    with pytest.raises(ValueError, match="image_labels"):
        _cfg(image_labels="yes")


def test_draw_examples_respects_the_image_range():
    ex = draw_examples(3, 0, 40, min_images=2, max_images=4, tasks=["needle", "count"], tile=16)
    assert {len(e[0]) for e in ex} == {2, 3, 4}
    same = draw_examples(3, 10, 5, min_images=2, max_images=4, tasks=["needle", "count"], tile=16)
    assert [e[1:] for e in same] == [e[1:] for e in ex[10:15]]
    with pytest.raises(ValueError, match="min_images"):
        draw_examples(3, 0, 1, min_images=5, max_images=4, tasks=["needle"], tile=16)


def test_tiles_and_their_labels_agree():
    seen_digit = seen_shape = False
    for i in range(30):
        img, digit, quads = make_tile(i, 32)
        assert img.shape == (32, 32, 3) and img.dtype.name == "uint8"
        if digit != NO_DIGIT:
            seen_digit = True
            assert quads == [NO_SHAPE] * 4 and img.max() > 200  # the white digit is drawn
        else:
            seen_shape = True
            assert 1 <= sum(q != NO_SHAPE for q in quads) <= 3
            for q, (r, c) in zip(quads, [(0, 0), (0, 16), (16, 0), (16, 16)]):
                busy = (img[r:r + 16, c:c + 16].max(-1) > 120).any()  # shapes are bright, the background dark
                assert busy == (q != NO_SHAPE)
    assert seen_digit and seen_shape
    t, d, q = draw_tiles(1, 0, 5, 32)
    assert t.shape == (5, 3, 32, 32) and d.shape == (5,) and q.shape == (5, 4)


def test_tile_heads_read_the_right_quadrant():
    heads = TileHeads(4, 4)
    feats = torch.zeros(1, 16, 4)
    feats[0, 2, 0] = 1.0  # token (row 0, col 2) lies in the top-right quadrant
    with torch.no_grad():
        heads.quadrant.weight.zero_(), heads.quadrant.bias.zero_()
        heads.quadrant.weight[0, 0] = 1.0
        _, q = heads(feats)
    assert q[0, :, 0].tolist() == [0.0, 0.25, 0.0, 0.0]
    with pytest.raises(ValueError, match="even"):
        TileHeads(4, 3)


def test_vision_pretrain_learns_and_chains_into_training(tmp_path):
    out = tmp_path / "vit"
    assert pretrain_main(["--out", str(out), "--steps", "30", "--batch-size", "16", "--lr", "3e-3", "--dim", "32",
                          "--depth", "2", "--heads", "2", "--cross-every", "1", "--tile", "16", "--vision-dim", "16",
                          "--vision-depth", "1", "--no-progress"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 30 and rows[-1]["val_quadrant_acc"] > 0.8  # most quadrants are empty: easy to beat
    assert rows[-1]["loss"] < 4.0  # ln 11 + ln 19 = 5.3 at chance
    vit = load_file(out / "model.safetensors")
    run = tmp_path / "s3"
    assert train_main([*TINY, "--variant", "lvlm-1d", "--stage", "3", "--steps", "1", "--batch-size", "2",
                       "--max-images", "2", "--val-samples", "2", "--out", str(run), "--image-labels", "after",
                       "--image-token-scale", "0.5", "--init-from", str(out / "model.safetensors")]) == 0
    m = CoMemoModel.load(run / "model.safetensors")
    assert m.cfg.image_labels == "after" and m.cfg.image_token_scale == 0.5 and m.cfg.variant == "lvlm-1d"
    assert (run / "tokenizer.json").read_text() == (out / "tokenizer.json").read_text()
    # one step moved the ViT from the pretrained weights, but only a little
    moved = (m.state_dict()["vision.pos"] - vit["vision.pos"]).abs().max()
    assert 0 < float(moved) < 0.1


def test_vision_lr_scale_slows_the_vision_encoder(tmp_path, capsys):
    base = [*TINY, "--variant", "comemo", "--stage", "3", "--steps", "1", "--batch-size", "2", "--max-images", "2",
            "--val-samples", "2", "--lr", "1e-3", "--warmup", "1", "--seed", "3"]
    assert train_main([*base, "--out", str(tmp_path / "a")]) == 0
    assert train_main([*base, "--out", str(tmp_path / "b"), "--vision-lr-scale", "0"]) == 0
    state = torch.load(tmp_path / "b" / "last.pt", weights_only=False)
    assert [g["lr"] for g in state["optimizer"]["param_groups"]] == [1e-3, 0.0]
    one = torch.load(tmp_path / "a" / "last.pt", weights_only=False)
    assert len(one["optimizer"]["param_groups"]) == 1  # the default keeps the single group of older checkpoints
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    torch.manual_seed(3)  # the trainer seeds the weights with --seed; the ViT is built first
    init = CoMemoModel(CoMemoConfig(variant="comemo", dim=32, depth=2, num_heads=2, cross_every=1,
                                    vision=VisionConfig(tile=16, dim=16, depth=1))).state_dict()
    vit = [k for k in a if k.startswith("vision.")]
    assert vit and all(torch.equal(b[k], init[k]) for k in vit)  # lr 0: the ViT did not move
    assert not all(torch.equal(a[k], init[k]) for k in vit)  # full lr: it did
    assert not torch.equal(b["projector.fc1.weight"], init["projector.fc1.weight"])  # the rest trains
    with pytest.raises(SystemExit) as refused:  # refused when parsed: argparse's one line, exit 2
        train_main([*base, "--out", str(tmp_path / "c"), "--vision-lr-scale", "-1"])
    assert refused.value.code == 2 and "--vision-lr-scale" in capsys.readouterr().err


def test_label_range_renumbers_labels_question_and_answer(tok):
    plain = draw_examples(5, 0, 30, min_images=1, max_images=4, tasks=["needle", "count"], tile=16)
    moved = draw_examples(5, 0, 30, min_images=1, max_images=4, tasks=["needle", "count"], tile=16, label_range=64)
    starts = [m[3] for m in moved]
    assert len(set(starts)) > 5 and all(1 <= s and s + len(m[0]) - 1 <= 64 for s, m in zip(starts, moved))
    for p, m in zip(plain, moved):
        assert len(p[0]) == len(m[0]) and all((a == b).all() for a, b in zip(p[0], m[0]))  # same images
        if p[2].startswith("image "):  # needle / compare answers name an image: shifted by start - 1
            k = int(p[2].split()[1])
            assert m[2].split()[1] == str(k + m[3] - 1) and m[2].split()[2:] == p[2].split()[2:]
        else:
            assert m[2] == p[2]
    # the prompt numbers its labels from the start
    cfg = _cfg("lvlm-1d", image_labels="after")
    images, q, a, start = next(m for m in moved if m[1].startswith("which image shows") and len(m[0]) >= 2)
    b = build_batch([(images, q, a, start)], tok, cfg)
    for k, (_, e) in enumerate(b.image_spans[0]):
        assert tok.decode(b.input_ids[0, e:e + 2].tolist()).split() == ["image", str(start + k)]
    with pytest.raises(ValueError, match="label_range"):
        draw_examples(5, 0, 1, max_images=8, tasks=["needle"], tile=16, label_range=4)
    with pytest.raises(SystemExit, match="label-range"):
        train_main([*TINY, "--variant", "lvlm-1d", "--stage", "3", "--out", "unused", "--label-range", "16"])


def test_image_grid_option_reaches_the_training_samples(tmp_path):
    from apps.comemo.train import draw_examples, main, parse_grid

    assert parse_grid("1x2") == (1, 2) and parse_grid("3X1") == (3, 1)
    for bad in ("2", "0x1", "axb", "1x2x3"):
        with pytest.raises(ValueError, match="RxC"):
            parse_grid(bad)
    ex = draw_examples(11, 0, 6, max_images=3, tasks=["needle", "count"], tile=16, image_grid=(1, 2))
    for images, question, _ in ex:
        wide = question.startswith("which image shows a digit")
        assert all(im.shape[:2] == ((16, 32) if wide else (16, 16)) for im in images)
    with pytest.raises(SystemExit, match="--image-grid"):
        main(["--variant", "lvlm-1d", "--stage", "3", "--out", str(tmp_path / "r"), "--image-grid", "1by2"])
