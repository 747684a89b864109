"""apps.ncal.data and apps.ncal.tokenizer: the shipped sets, validation of bad input, PMTD context, bins."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from apps.ncal.data import (
    DATA_DIR,
    DATASETS,
    check_texts,
    format_turn,
    load_split,
    longtail_bins,
    read_jsonl,
    resolve_dataset,
)
from apps.ncal.tokenizer import SPECIALS, CharTokenizer, normalize


@pytest.mark.parametrize("name,n_train,n_test,top,bottom", [("tmwpl", 8262, 350, ("回忆", 4995), ("分析", 166)),
                                                             ("pmtd", 3894, 320, ("R-FR", 974), ("R-RR", 22))])
def test_shipped_sets(name, n_train, n_test, top, bottom):
    tr, classes = load_split(name, "train")
    te, _ = load_split(name, "test")
    assert len(tr) == n_train and len(te) == n_test
    counts = Counter(e.label for e in tr)
    assert counts.most_common(1)[0] == top and min(counts.items(), key=lambda kv: kv[1]) == bottom
    assert set(Counter(e.label for e in te).values()) == {n_test // len(classes)}  # balanced test split
    assert set(counts) == set(classes) == set(DATASETS[name].classes)


def test_longtail_bins_from_train_counts():
    tr, classes = load_split("tmwpl", "train")
    bins = longtail_bins([e.label for e in tr], classes)
    assert bins == {"回忆": "head", "识别": "medium", "表征建模": "medium", "选取策略": "medium",
                    "过程实施": "tail", "推断": "tail", "分析": "tail"}
    tr, classes = load_split("pmtd", "train")
    bins = longtail_bins([e.label for e in tr], classes)
    assert [c for c in classes if bins[c] == "tail"] == ["I-H", "R-RR"]
    assert longtail_bins(["a"] * 10 + ["b"] * 5 + ["c"], ("a", "b", "c", "d")) == {
        "a": "head", "b": "head", "c": "medium", "d": "tail"}


def _pmtd_rec(content, history, cls="I-Q"):
    return {"id": "x", "dialog_content": content, "class": cls, "dialog_history": history}


def test_pmtd_context_never_uses_the_next_turn_by_default(tmp_path):
    p = tmp_path / "d.jsonl"
    rec = _pmtd_rec("这道题你会吗？", [{"student": "老师好。"}, {"teacher": "这道题你会吗？"}, {"student": "答案是五。"}])
    p.write_text(json.dumps(rec, ensure_ascii=False) + "\n", encoding="utf-8")
    past = read_jsonl(p)[0].text
    assert past == "学生：老师好。\n老师：这道题你会吗？"
    assert "答案是五" not in past
    assert "答案是五" in read_jsonl(p, context="window")[0].text
    assert read_jsonl(p, context="none")[0].text == "老师：这道题你会吗？"


def test_shipped_pmtd_texts_end_with_their_turn():
    rows = [json.loads(line) for line in open(DATA_DIR / "PMTD_test.jsonl", encoding="utf-8")]
    ex, _ = load_split("pmtd", "test")
    for r, e in zip(rows, ex):
        lines = e.text.split("\n")
        assert len(lines) <= 2  # previous turn + the turn, never a third (future) one
        assert lines[-1].endswith(r["dialog_content"].strip())
        assert lines[-1] == format_turn(r["dialog_content"], speaker=next(iter(r["dialog_history"][1])))


def test_format_turn_refuses_unknown_speaker():
    with pytest.raises(ValueError, match="speaker must be one of"):
        format_turn("好", speaker="parent")


@pytest.mark.parametrize("content,match", [
    (b'{"id": 1, "question": "abc", "class": "\xff\xfe"}\n', "line 2: not UTF-8"),
    (b'{"id": 1, "text": "abc", "class": "x"}\n', "line 2: missing the text field"),
    (b'{"id": 1, "question": "   ", "class": "x"}\n', "line 2: field 'question' must be non-empty"),
    (b'{"id": 1, "question": "abc", "class": "nope"}\n', "line 2: label 'nope' is not one of the classes"),
    (b'{"id": 1, "question": "abc"}\n', "line 2: missing field 'class'"),
    (b'[1, 2]\n', "line 2: expected a JSON object"),
    (b'{"id": 1, "question": \n', "line 2: not valid JSON"),
])
def test_bad_lines_name_their_line(tmp_path, content, match):
    p = tmp_path / "bad.jsonl"
    p.write_bytes('{"id": 0, "question": "一加一", "class": "回忆"}\n'.encode() + content)
    with pytest.raises(ValueError, match=match):
        read_jsonl(p, classes=DATASETS["tmwpl"].classes)


def test_unlabelled_lines_allowed_when_asked(tmp_path):
    p = tmp_path / "u.jsonl"
    p.write_text('{"question": "一加一"}\n\n{"question": "二加二"}\n', encoding="utf-8")
    ex = read_jsonl(p, require_label=False)
    assert [e.label for e in ex] == [None, None] and [e.line for e in ex] == [1, 3]


def test_unknown_dataset_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset 'nope'.*pmtd.*tmwpl"):
        resolve_dataset("nope")
    with pytest.raises(FileNotFoundError):
        read_jsonl(tmp_path / "none.jsonl")


def test_check_texts():
    assert check_texts(["一", "二".encode()]) == ["一", "二"]
    with pytest.raises(ValueError, match="text 1: empty"):
        check_texts(["ok", "  \n"])
    with pytest.raises(ValueError, match="text 0: not UTF-8"):
        check_texts([b"\xff"])
    with pytest.raises(ValueError, match="single string"):
        check_texts("一个")


def test_char_tokenizer_roundtrip_and_truncation(tmp_path):
    tok = CharTokenizer.train(["小明有３个苹果", "小红有5个梨", "小明"], min_freq=1, max_length=6)
    assert tuple(tok.vocab[:5]) == SPECIALS
    assert normalize("３ Ａ\t b") == "3 a b"
    ids = tok.ids("小明有3个苹果")
    assert len(ids) == 6 and ids[0] == tok.cls_id and ids[-1] == tok.sep_id
    assert ids[1:-1] == [tok.index[c] for c in "3个苹果"]  # the end of the text is kept
    assert tok.ids("猫")[1] == tok.unk_id
    b = tok.batch(["小明", "小明有3个"])
    assert b["input_ids"].shape == (2, 6) and b["attention_mask"].sum(1).tolist() == [4, 6]
    tok.save(tmp_path / "tokenizer.json")
    tok2 = CharTokenizer.load(tmp_path / "tokenizer.json")
    assert tok2.vocab == tok.vocab and tok2.max_length == 6


def test_model_inputs_format_rows_as_training_and_name_what_is_missing(tmp_path):
    from apps.ncal.inputs import model_inputs, row_layout

    hist = [{"student": "老师好。"}, {"teacher": "这道题你会吗？"}, {"student": "答案是五。"}]
    row = _pmtd_rec("这道题你会吗？", hist)
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8")
    for context in ("past", "window", "none"):  # a row becomes the very text training read from the file
        assert model_inputs([row], layout="pmtd", context=context) == [read_jsonl(p, context=context)[0].text]
    # strings pass unchanged beside rows; one row alone is a list of one
    assert model_inputs(["老师：好", row], layout="pmtd") == ["老师：好", "学生：老师好。\n老师：这道题你会吗？"]
    assert model_inputs({"question": " 一加一 "}, layout="tmwpl") == ["一加一"]
    assert row_layout({"dataset": "pmtd"}) == "pmtd" and row_layout({"dataset": "TMWPL"}) == "tmwpl"
    assert row_layout({"dataset": "/d/own.jsonl"}) == "keys" and row_layout({"dataset": "user"}) is None
    # the shipped layout is enforced, not guessed from keys
    with pytest.raises(ValueError, match=r"row 1: missing field 'dialog_history'.*keys are \['dialog_content'\]"
                                         r".*Accepted: strings"):
        model_inputs([row, {"dialog_content": "你好"}], layout="pmtd")
    with pytest.raises(ValueError, match="row 0: missing field 'dialog_content'.*PMTD rows"):
        model_inputs([{"question": "一加一"}], layout="pmtd")
    with pytest.raises(ValueError, match="row 0: missing field 'question'.*TMWPL rows"):
        model_inputs([row], layout="tmwpl")
    assert model_inputs([{"question": "一加一"}, row], layout="keys")[0] == "一加一"  # a user file's mix
    with pytest.raises(ValueError, match="row 0: a dict was given.*fitted on texts"):
        model_inputs([row], layout=None)
    with pytest.raises(ValueError, match="item 1: expected a string or a row dict, got int"):
        model_inputs(["好", 3], layout="pmtd")
    with pytest.raises(ValueError, match="single string"):
        model_inputs("一加一", layout="tmwpl")


def test_model_inputs_take_a_dataframe_of_rows():
    pd = pytest.importorskip("pandas")
    from apps.ncal.inputs import model_inputs

    rows = [json.loads(line) for line in open(DATA_DIR / "PMTD_test.jsonl", encoding="utf-8")][:5]
    ex, _ = load_split("pmtd", "test")
    assert model_inputs(pd.DataFrame(rows), layout="pmtd") == [e.text for e in ex[:5]]
    mixed = pd.DataFrame([{"question": "一加一"}, {"dialog_content": "好", "dialog_history": []}])  # NaN cells
    assert model_inputs(mixed, layout="keys") == ["一加一", "好"]
    with pytest.raises(ValueError, match="row 0: missing field 'dialog_content'"):
        model_inputs(mixed, layout="pmtd")


def test_read_jsonl_with_a_layout_names_the_line(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"dialog_content": "好", "dialog_history": [{"teacher": "好"}]}\n{"dialog_content": "嗯"}\n',
                 encoding="utf-8")
    assert len(read_jsonl(p, require_label=False)) == 2  # by keys a PMTD line may lack its history
    with pytest.raises(ValueError, match="r.jsonl line 2: missing field 'dialog_history'"):
        read_jsonl(p, require_label=False, layout="pmtd")
    with pytest.raises(ValueError, match="layout must be one of"):
        read_jsonl(p, layout="nope")
