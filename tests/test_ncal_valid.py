"""NCAL model choice without the test split: the stratified validation hold-out, training with it, and
``benchmarks.ncal_select`` (every loss trained, the best validation macro-F1 chosen), on tiny models."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch

from apps.ncal.data import Example, stratified_holdout
from tests._ncal_toy import CLASSES, toy_examples, write_tiny_encoder


def _toy(n_per=(40, 12, 6), seed=0) -> list[Example]:
    return toy_examples(n_per, seed)


@pytest.fixture(scope="module")
def tiny_encoder_dir(tmp_path_factory):
    """A tiny random encoder folder, as apps.ncal.pretrain writes it."""
    return write_tiny_encoder(tmp_path_factory.mktemp("enc"), [e.text for e in _toy()])


def test_holdout_is_stratified_deterministic_and_disjoint():
    labels = ["a"] * 100 + ["b"] * 30 + ["c"] * 7 + ["d"] * 2 + ["e"]
    random.Random(1).shuffle(labels)
    keep, held = stratified_holdout(labels, 0.1)
    assert sorted(keep + held) == list(range(len(labels)))  # a partition: disjoint and complete
    assert not set(keep) & set(held)
    got = Counter(labels[i] for i in held)
    # round(0.1 n), at least 1 when n >= 2, at most n - 1; a single-item class stays in train
    assert got == Counter({"a": 10, "b": 3, "c": 1, "d": 1})
    assert "e" in {labels[i] for i in keep}
    assert stratified_holdout(labels, 0.1) == (keep, held)  # deterministic
    assert stratified_holdout(labels, 0.1, seed=5) != (keep, held)  # the seed matters
    # the draw depends on the labels only (never on a training seed): the same items for every run
    torch.manual_seed(123); random.seed(99)
    assert stratified_holdout(labels, 0.1) == (keep, held)
    big = stratified_holdout(labels, 0.5)[1]
    assert Counter(labels[i] for i in big) == Counter({"a": 50, "b": 15, "c": 4, "d": 1})


@pytest.mark.parametrize("frac", [0.0, 1.0, -0.1, 1.5])
def test_holdout_rejects_bad_fraction(frac):
    with pytest.raises(ValueError, match=r"validation fraction must be in \(0, 1\)"):
        stratified_holdout(["a", "b"], frac)


def test_train_config_rejects_bad_valid_frac():
    from apps.ncal.train import TrainConfig

    with pytest.raises(ValueError, match=r"valid_frac must be in \[0, 1\)"):
        TrainConfig(dataset="x", out="y", valid_frac=1.0)


def _cfg(out, enc_dir, **kw):
    from apps.ncal.train import TrainConfig

    base = dict(dataset="toy", out=str(out), encoder=str(enc_dir), epochs=2, batch_size=8, lr=3e-3, ckpt_every=50,
                nc_train_sample=16, device="cpu", seed=3, valid_frac=0.25)
    base.update(kw)
    return TrainConfig(**base)


def test_train_with_validation_split_records_it(tmp_path, tiny_encoder_dir):
    from apps.ncal.train import train

    tr = _toy()
    meta = train(_cfg(tmp_path / "run", tiny_encoder_dir), progress=False, examples=(tr, None, CLASSES))
    vs = meta["valid_split"]
    assert vs["n_valid"] == 10 + 3 + 2 and vs["n_train"] == len(tr) - 15 and vs["not_in_valid"] == []
    assert meta["valid"]["n"] == 15 and 0 <= meta["valid"]["macro_f1"] <= 1
    assert sum(meta["train_counts"].values()) == len(tr) - 15  # trained on the rest only
    saved = json.loads((tmp_path / "run" / "ncal.json").read_text(encoding="utf-8"))
    assert saved["valid"]["macro_f1"] == meta["valid"]["macro_f1"] and saved["test"] is None
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all("valid_macro_f1" in r and "test_macro_f1" not in r for r in lines)
    # another training seed sees the same validation items
    meta2 = train(_cfg(tmp_path / "run2", tiny_encoder_dir, seed=11, loss="ce", epochs=1), progress=False,
                  examples=(tr, None, CLASSES))
    assert meta2["valid_split"] == vs
    # a finished run is read back, not retrained
    again = train(_cfg(tmp_path / "run", tiny_encoder_dir), progress=False, examples=(tr, None, CLASSES))
    assert again["valid"] == saved["valid"]


def test_resume_of_a_checkpoint_written_before_valid_frac_existed(tmp_path, tiny_encoder_dir):
    """Older runs (no valid_frac in their settings) resume as valid_frac = 0; asking for a split is refused."""
    from apps.ncal.train import train
    from apps.ncal.weights_io import load_state, save_state

    tr = _toy()
    train(_cfg(tmp_path / "run", tiny_encoder_dir, valid_frac=0.0, epochs=1), progress=False, examples=(tr, None, CLASSES))
    st = load_state(tmp_path / "run" / "last.pt")
    del st["settings"]["valid_frac"]
    save_state(tmp_path / "run" / "last.pt", st)
    meta = train(_cfg(tmp_path / "run", tiny_encoder_dir, valid_frac=0.0, epochs=1), progress=False,
                 examples=(tr, None, CLASSES))
    assert "valid" not in meta
    with pytest.raises(ValueError, match="other settings"):
        train(_cfg(tmp_path / "run", tiny_encoder_dir, valid_frac=0.1, epochs=1), progress=False,
              examples=(tr, None, CLASSES))


def test_choose_rule():
    from benchmarks.ncal_select import choose

    assert choose({"ce": 0.4, "la": 0.6, "cb": 0.5}, ["ce", "tc", "cb", "la"]) == "la"
    assert choose({"ce": 0.5, "cb": 0.5}, ["cb", "ce"]) == "cb"  # ties: first listed
    assert choose({"ce": 0.5, "cb": 0.5}, ["ce", "cb"]) == "ce"
    with pytest.raises(ValueError, match="no validation scores"):
        choose({}, ["ce"])


def test_select_cli_trains_every_loss_on_validation_only(tmp_path, tiny_encoder_dir, monkeypatch):
    import apps.ncal.data as data
    from benchmarks import ncal_select

    tr = _toy()
    asked = []

    def fake_load_split(dataset, split, *, context="past"):
        asked.append(split)
        return tr, CLASSES

    monkeypatch.setattr(data, "load_split", fake_load_split)
    out = tmp_path / "selection.json"
    argv = ["--datasets", "toy", "--losses", "ce", "la", "--epochs", "1", "--valid-frac", "0.25",
            "--encoder", str(tiny_encoder_dir), "--runs", str(tmp_path / "runs"), "--out", str(out),
            "--log-level", "WARNING"]
    res = ncal_select.main(argv)
    assert asked == ["train"]  # the test split is never read
    saved = json.loads(out.read_text(encoding="utf-8"))
    e = saved["datasets"]["toy"]
    assert saved["complete"] and e["complete"] and set(e["losses"]) == {"ce", "la"}
    f1 = {k: v["valid"]["macro_f1"] for k, v in e["losses"].items()}
    assert e["chosen"] == max(["ce", "la"], key=lambda k: (f1[k], -["ce", "la"].index(k)))
    assert e["ship_run"].endswith(f"toy_{e['chosen']}_0") and e["valid_split"]["n_valid"] == 15
    assert res["datasets"] == saved["datasets"]
    md = (tmp_path / "selection.md").read_text(encoding="utf-8")
    bold = f"**{100 * f1[e['chosen']]:.1f} ("
    assert md.startswith("| dataset | validation items | ce | la | chosen |") and bold in md and md.count("**") == 2
    # rerun: finished runs are read back (same numbers, nothing retrained)
    mtime = (tmp_path / "runs" / "toy_ce_0" / "model.safetensors").stat().st_mtime_ns
    again = ncal_select.main(argv)
    assert again["datasets"]["toy"]["losses"]["ce"]["valid"] == e["losses"]["ce"]["valid"]
    assert (tmp_path / "runs" / "toy_ce_0" / "model.safetensors").stat().st_mtime_ns == mtime


def test_ship_with_selection_writes_the_choice_into_the_card(tmp_path, tiny_encoder_dir, monkeypatch):
    import apps.ncal.data as data
    from apps.ncal import ship
    from apps.ncal.train import train
    from benchmarks import ncal_select

    tr, te = _toy(), _toy((4, 4, 4), seed=7)
    monkeypatch.setattr(data, "load_split", lambda dataset, split, *, context="past": (tr if split == "train" else te, CLASSES))
    monkeypatch.setattr(ship, "WEIGHTS", tmp_path / "weights")
    sel_path = tmp_path / "selection.json"
    res = ncal_select.main(["--datasets", "toy", "--losses", "ce", "la", "--epochs", "1", "--valid-frac", "0.25",
                            "--encoder", str(tiny_encoder_dir), "--runs", str(tmp_path / "sel"), "--out", str(sel_path),
                            "--log-level", "WARNING"])
    chosen = res["datasets"]["toy"]["chosen"]
    other = ({"ce", "la"} - {chosen}).pop()
    for loss in ("ce", "la"):  # the full-train "benchmark" runs, with their test split
        train(_cfg(tmp_path / "bench" / f"toy_{loss}_0", tiny_encoder_dir, loss=loss, seed=0, epochs=1, valid_frac=0.0),
              progress=False, examples=(tr, te, CLASSES))
    with pytest.raises(ValueError, match=f"chose loss {chosen!r}"):
        ship.ship_run(tmp_path / "bench" / f"toy_{other}_0", "toy", selection=sel_path)
    with pytest.raises(ValueError, match="validation hold-out"):
        ship.ship_run(tmp_path / "sel" / f"toy_{chosen}_0", "toy", selection=sel_path)
    dst = ship.ship_run(tmp_path / "bench" / f"toy_{chosen}_0", "toy", selection=sel_path)
    card = (tmp_path / "weights" / "toy.md").read_text(encoding="utf-8")
    assert "## How this model was chosen" in card and f"Chosen: **{chosen}**" in card
    for loss, r in res["datasets"]["toy"]["losses"].items():
        assert f"| {loss}{' (chosen)' if loss == chosen else ''} | {100 * r['valid']['accuracy']:.1f} | " \
               f"{100 * r['valid']['macro_f1']:.1f} |" in card
    assert "the same recipe" in card and "NOT the same recipe" not in card
    assert json.loads((dst / "selection.json").read_text(encoding="utf-8"))["chosen"] == chosen
    assert "--selection" in json.loads((dst / "golden.json").read_text(encoding="utf-8"))["command"]
