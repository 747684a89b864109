"""CoMemo model: the four variants' positions, the gates-at-0 twin, pixel shuffle, inputs and their errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from apps.comemo.batch import build_batch, load_image
from apps.comemo.model import CoMemoConfig, CoMemoModel, VisionConfig, pixel_shuffle
from apps.comemo.synthetic import corpus_texts, make_sample
from apps.comemo.tiling import tile_image
from apps.comemo.tokenizer import train_tokenizer
from core.rope import rope_dhr_position_ids

SMALL = dict(dim=32, depth=2, num_heads=2, cross_every=1, vision=VisionConfig(tile=16, patch=4, dim=16, depth=1, num_heads=2))


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(corpus_texts(), vocab_size=320)


def _cfg(variant, tok, **kw):
    return CoMemoConfig(variant=variant, vocab_size=tok.vocab_size, **{**SMALL, **kw})


def _examples(tile=16):
    rng = np.random.default_rng(0)
    square = rng.integers(0, 255, (tile, tile, 3), dtype=np.uint8)
    wide = rng.integers(0, 255, (tile, 3 * tile, 3), dtype=np.uint8)  # 1x3 tiles + thumbnail
    return [([square, wide], "how many red shapes are there ?", "2"),
            ([wide], "what digit is in the picture and where ?", "7 in row 1 column 2")]


def test_pixel_shuffle_folds_each_block_row_major():
    x = torch.randn(2, 16, 3)  # 4x4 grid
    y = pixel_shuffle(x, 2)
    assert y.shape == (2, 4, 12)
    grid = x.reshape(2, 4, 4, 3)
    for i in range(2):
        for j in range(2):
            block = grid[:, 2 * i:2 * i + 2, 2 * j:2 * j + 2].reshape(2, 12)  # (s1, s2, c) row-major
            torch.testing.assert_close(y[:, i * 2 + j], block, rtol=0, atol=0)
    with pytest.raises(ValueError, match="square"):
        pixel_shuffle(torch.randn(1, 12, 3), 2)


def test_positions_per_variant(tok):
    ex = _examples()
    T = 2  # 16 px tile / 4 px patch / shuffle 2
    tile_ids, thumb_ids = rope_dhr_position_ids((1, 3), thumb_grid=T, tile_grid_tokens=T, start=1 + T * T)
    b = {v: build_batch(ex[:1], tok, _cfg(v, tok)) for v in ("lvlm-1d", "lvlm-dhr", "flamingo", "comemo")}
    n_img = T * T + 4 * T * T  # one tile, then 3 tiles + thumbnail
    n_text = len(b["flamingo"].input_ids[0]) - 3  # flamingo: <s>, 2 markers, then the text
    one_d = b["lvlm-1d"].position_ids[0].tolist()
    assert one_d == list(range(1 + n_img + n_text))
    dhr = b["lvlm-dhr"].position_ids[0].tolist()
    assert dhr[0] == 0 and dhr[1:1 + T * T] == list(range(1, 1 + T * T))  # single tile: thumbnail ids
    assert dhr[1 + T * T:1 + n_img] == tile_ids.flatten().tolist() + thumb_ids.tolist()
    assert dhr[1 + n_img:] == list(range(1 + 2 * T * T, 1 + 2 * T * T + n_text))  # text continues after G^2 ids
    assert b["comemo"].position_ids.equal(b["lvlm-dhr"].position_ids)
    assert b["comemo"].memory_position_ids[0].tolist() == dhr[1:1 + n_img]
    assert b["comemo"].memory_index[0].tolist() == b["comemo"].image_slot[0, 1:1 + n_img].tolist()
    fl = b["flamingo"]
    assert fl.position_ids[0].tolist() == list(range(fl.input_ids.shape[1]))
    assert fl.input_ids[0, 1:3].tolist() == [tok.image_id, tok.image_id] and bool((fl.image_slot < 0).all())
    assert fl.memory_position_ids[0].tolist() == [1] * (T * T) + [2] * (4 * T * T)
    assert b["lvlm-1d"].memory_index is None


def test_image_slots_hold_tiles_then_thumbnail(tok):
    ex = _examples()
    cfg = _cfg("lvlm-dhr", tok)
    b = build_batch(ex, tok, cfg)
    lay = tile_image(ex[0][0][1], 16, max_tiles=cfg.max_tiles)
    assert b.tiles.shape[0] == 1 + 4 + 4  # example 0: 1 + (3 + thumb); example 1: 3 + thumb
    expected = torch.from_numpy(np.stack(lay.tiles + [lay.thumbnail])).permute(0, 3, 1, 2).float() / 255
    torch.testing.assert_close((b.tiles[1:5] * 0.25 + 0.5), expected)
    slots = b.image_slot[b.image_slot >= 0]
    assert slots.tolist() == list(range(9 * 4))  # every image token once, in tile order
    assert b.image_spans[0] == [(1, 5), (5, 21)]
    lab = b.labels[0][b.labels[0] >= 0]
    assert tok.decode(lab.tolist()) == "2" and lab[-1] == tok.eos_id


def test_zero_gates_equal_the_context_only_twin(tok):
    torch.manual_seed(0)
    comemo = CoMemoModel(_cfg("comemo", tok)).eval()
    twin = CoMemoModel(_cfg("lvlm-dhr", tok)).eval()
    missing, unexpected = twin.load_state_dict(comemo.state_dict(), strict=False)
    assert not missing and unexpected and all(k.startswith("decoder.cross.") for k in unexpected)
    for block in comemo.decoder.cross.values():  # make the memory path's own weights non-trivial
        for p in block.parameters():
            p.data.normal_()
        block.attn_gate.data.zero_()
        block.ff_gate.data.zero_()
    ex = _examples()
    with torch.no_grad():
        a = comemo(build_batch(ex, tok, comemo.cfg)).logits
        b = twin(build_batch(ex, tok, twin.cfg)).logits
        assert torch.equal(a, b)
        next(iter(comemo.decoder.cross.values())).attn_gate.data.fill_(0.5)
        c = comemo(build_batch(ex, tok, comemo.cfg)).logits
    assert not torch.allclose(a, c)
    assert comemo.gates()["layer1.attn"] == 0.0


def test_memory_path_reaches_text_only(tok):
    torch.manual_seed(0)
    m = CoMemoModel(_cfg("comemo", tok, memory_queries="text")).eval()
    for block in m.decoder.cross.values():
        block.attn_gate.data.fill_(1.0)
    b = build_batch(_examples()[:1], tok, m.cfg)
    kw = m.decoder_inputs(b)
    bias = kw["memory_attn_bias"][0, 0, :, 0]
    assert bool(torch.isinf(bias[b.image_slot[0] >= 0]).all()) and bool((bias[b.image_slot[0] < 0] == 0).all())
    loss, info = m.loss(b)
    loss.backward()
    assert all(blk.attn_gate.grad is not None and blk.attn_gate.grad != 0 for blk in m.decoder.cross.values())


@pytest.mark.parametrize("variant", ["lvlm-1d", "lvlm-dhr", "flamingo", "comemo"])
def test_every_variant_trains_a_step_and_saves(variant, tok, tmp_path):
    torch.manual_seed(0)
    m = CoMemoModel(_cfg(variant, tok))
    ex = [(s.images, s.question, s.answer) for s in (make_sample("needle", 3, 1, tile=16), make_sample("detail", 1, 2, tile=16))]
    b = build_batch(ex, tok, m.cfg)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    first = None
    for _ in range(5):
        loss, _ = m.loss(b)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first if first is not None else float(loss.detach())
    assert float(m.loss(b)[0].detach()) < first
    path = m.save(tmp_path / "m.safetensors")
    back = CoMemoModel.load(path)
    assert back.cfg.variant == variant
    with torch.no_grad():
        torch.testing.assert_close(back(b).logits, m.eval()(b).logits)


def test_bad_inputs_get_clear_errors(tok, tmp_path):
    cfg = _cfg("comemo", tok, max_images=2, max_context=40, max_pixels=64 * 64)
    with pytest.raises(ValueError, match="unknown variant"):
        _cfg("llava", tok)
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_image(empty, max_pixels=100)
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    with pytest.raises(ValueError, match="not a readable image"):
        load_image(text, max_pixels=100)
    with pytest.raises(FileNotFoundError):
        load_image(tmp_path / "missing.png", max_pixels=100)
    big = np.zeros((65, 64, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match="above the limit"):
        build_batch([([big], "q ?", None)], tok, cfg)
    img = np.zeros((16, 16, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match="at most 2"):
        build_batch([([img] * 3, "q ?", None)], tok, cfg)
    with pytest.raises(ValueError, match="context holds 40"):
        build_batch([([img], "describe every image . " * 10, None)], tok, cfg)
    with pytest.raises(ValueError, match="uint8"):
        load_image(np.full((4, 4, 3), 2.0), max_pixels=100)


def _save_state(model, path):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))


@pytest.mark.parametrize("library", ["timm", "open_clip"])
def test_pretrained_encoders_from_local_files(library, tok, tmp_path):
    torch.manual_seed(0)
    if library == "timm":
        timm = pytest.importorskip("timm")
        kwargs = {"img_size": 16, "patch_size": 4, "embed_dim": 24, "depth": 1, "num_heads": 2}
        src = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, **kwargs)
        encoder = "timm:vit_tiny_patch16_224"
    else:
        open_clip = pytest.importorskip("open_clip")
        kwargs = {"vision_cfg": {"image_size": 16, "patch_size": 4, "width": 32, "layers": 1, "head_width": 16}}
        src = open_clip.create_model("ViT-B-32", pretrained=None, **kwargs).visual
        encoder = "open_clip:ViT-B-32"
    weights = tmp_path / "enc.safetensors"
    _save_state(src, weights)
    vis = VisionConfig(tile=16, patch=4, encoder=encoder, encoder_weights=str(weights), encoder_kwargs=kwargs)
    m = CoMemoModel(_cfg("comemo", tok, vision=vis)).eval()
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        tokens = m.vision(x)
        assert tokens.shape == (3, 16, m.vision.width)
        src.eval()
        raw = (x * 0.25 + 0.5 - m.vision.mean) / m.vision.std
        if library == "timm":
            ref = src.forward_features(raw)[:, src.num_prefix_tokens:]
        else:
            src.output_tokens = True
            ref = src(raw)[1]
        torch.testing.assert_close(tokens, ref)
        b = build_batch(_examples(), tok, m.cfg)
        logits = m(b).logits
    path = m.save(tmp_path / "m.safetensors")
    weights.unlink()  # a saved CoMemo file holds the encoder: the original file is no longer needed
    back = CoMemoModel.load(path)
    with torch.no_grad():
        torch.testing.assert_close(back(b).logits, logits)
    with pytest.raises(ValueError, match="local weights file"):
        CoMemoModel(_cfg("comemo", tok, vision=VisionConfig(tile=16, patch=4, encoder=encoder, encoder_kwargs=kwargs)))
    bad = VisionConfig(tile=16, patch=2, shuffle=2, encoder=encoder, encoder_kwargs=kwargs)
    with pytest.raises(ValueError, match="expected"):
        CoMemoModel(_cfg("comemo", tok, vision=bad), load_encoder_weights=False).vision(x)
    with pytest.raises(ValueError, match="unknown vision encoder"):
        VisionConfig(encoder="hf:clip")
