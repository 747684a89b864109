"""CoMemo synthetic tasks and tokenizer: determinism, answers that match the pixels, tokenizer.json."""

from __future__ import annotations

import json

import numpy as np
import pytest

from apps.comemo.synthetic import COLOURS, TASKS, corpus_texts, main, make_sample, sample_seed
from apps.comemo.tokenizer import SPECIAL_TOKENS, CoMemoTokenizer, prompt_text, train_tokenizer


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(corpus_texts(), vocab_size=320)


def _white(arr: np.ndarray) -> np.ndarray:
    return (arr.min(axis=-1) > 150)  # digits are composited in white; shapes are saturated colours


def test_samples_are_deterministic_and_seed_dependent():
    for task in TASKS:
        a, b = make_sample(task, 3, 11), make_sample(task, 3, 11)
        assert a.question == b.question and a.answer == b.answer
        assert all(np.array_equal(x, y) for x, y in zip(a.images, b.images))
    c = make_sample("needle", 3, 12)
    assert not all(np.array_equal(x, y) for x, y in zip(make_sample("needle", 3, 11).images, c.images))
    assert sample_seed(0, 1) != sample_seed(0, 2) != sample_seed(1, 1)


@pytest.mark.parametrize("pos", [0, 3, 6])
def test_needle_answer_names_the_image_with_the_digit(pos):
    s = make_sample("needle", 7, sample_seed(3, pos), needle=pos)
    assert len(s.images) == 7 and s.needle == pos
    assert s.answer == f"image {pos + 1} shows {s.meta['digit']}"
    whites = [_white(a).sum() for a in s.images]
    assert int(np.argmax(whites)) == pos and sum(w > 0 for w in whites) == 1
    with pytest.raises(ValueError, match="needle position"):
        make_sample("needle", 3, 0, needle=3)


@pytest.mark.parametrize("grid", [(1, 3), (3, 1), (2, 3), (3, 2)])
def test_detail_digit_lies_in_the_answered_tile(grid):
    s = make_sample("detail", 1, 5, tile=32, grid=grid)
    (img,) = s.images
    rows, cols = grid
    assert img.shape == (rows * 32, cols * 32, 3)
    w = _white(img).reshape(rows, 32, cols, 32).sum(axis=(1, 3))
    r, c = np.unravel_index(int(np.argmax(w)), w.shape)
    assert s.answer.endswith(f"in row {r + 1} column {c + 1}")


def test_count_and_compare_answers_match_the_pixels():
    seen = set()
    for i in range(30):
        s = make_sample("count", 4, sample_seed(7, i))
        seen.add(s.meta["kind"])
        if s.meta["kind"] == "count":
            colour = s.question.split()[2]
            rgb = np.array(COLOURS[colour])
            # each shape has at least a few pixels of exactly its colour; count images x quadrants holding it
            n = 0
            for a in s.images:
                q = np.abs(a.astype(int) - rgb).sum(-1) == 0
                n += sum(int(q[r:r + 16, c:c + 16].sum() > 0) for r in (0, 16) for c in (0, 16))
            assert int(s.answer) == n
        else:
            i1, i2 = [int(t) for t in s.question.replace("?", "").split() if t.isdigit()]
            assert s.answer in (f"image {i1}", f"image {i2}")
    assert seen == {"count", "compare"}


def test_describe_lists_every_image_in_order():
    s = make_sample("describe", 5, 3)
    parts = [p.strip() for p in s.answer.split(".") if p.strip()]
    assert [p.split()[1] for p in parts] == [str(i) for i in range(1, 6)]


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="unknown task"):
        make_sample("nope", 1, 0)
    with pytest.raises(ValueError, match="n_images"):
        make_sample("needle", 0, 0)


def test_tokenizer_special_tokens_and_roundtrip(tok, tmp_path):
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.tok.token_to_id(name) == i
    assert tok.vocab_size <= 320
    s = make_sample("describe", 8, 1)
    prompt, ans = tok.encode_example(8, s.question, s.answer)
    assert prompt[0] == tok.bos_id and prompt.count(tok.image_id) == 8 and ans[-1] == tok.eos_id
    assert tok.unk_id not in prompt + ans
    assert tok.decode(ans) == s.answer and tok.decode(prompt) == s.question
    path = tok.save(tmp_path / "tokenizer.json")
    data = json.loads(path.read_text())
    assert {t["content"] for t in data["added_tokens"]} >= set(SPECIAL_TOKENS)
    back = CoMemoTokenizer.load(path)
    assert back.encode(prompt_text(2, "how many red shapes are there ?")) == tok.encode(prompt_text(2, "how many red shapes are there ?"))
    with pytest.raises(ValueError, match="<image>"):
        tok.encode_example(1, "what is <image> here ?")


def test_cli_writes_jsonl_and_pngs(tmp_path):
    assert main(["--out", str(tmp_path), "--samples", "2", "--images", "1", "3", "--no-progress", "--tile", "16"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert {r["task"] for r in rows} == set(TASKS)
    assert len(rows) == 2 * (2 * 3 + 1)
    assert all((tmp_path / "images" / n).is_file() for r in rows for n in r["images"])
    needles = [r["needle"] for r in rows if r["task"] == "needle" and len(r["images"]) == 3]
    assert needles == [0, 1]


@pytest.mark.parametrize("grid", [(1, 2), (2, 1), (2, 2)])
def test_high_resolution_needles_put_the_digit_in_one_tile_of_the_named_image(grid):
    rows, cols = grid
    s = make_sample("needle", 5, 21, tile=32, needle=3, image_grid=grid)
    assert all(im.shape == (rows * 32, cols * 32, 3) for im in s.images) and s.answer.startswith("image 4 shows ")
    white = [_white(im).reshape(rows, 32, cols, 32).sum(axis=(1, 3)) for im in s.images]
    assert int(np.argmax([w.max() for w in white])) == 3  # the digit is in the needle image
    r, c = np.unravel_index(int(np.argmax(white[3])), white[3].shape)
    assert r * cols + c == s.meta["tile"]


def test_image_grid_default_keeps_the_original_samples_and_bad_grids_are_refused():
    a, b = make_sample("needle", 4, 12), make_sample("needle", 4, 12, image_grid=(1, 1))
    assert a.answer == b.answer and all((x == y).all() for x, y in zip(a.images, b.images))
    with pytest.raises(ValueError, match="needle task only"):
        make_sample("count", 2, 1, image_grid=(1, 2))
    with pytest.raises(ValueError, match="positive entries"):
        make_sample("needle", 2, 1, image_grid=(0, 2))
