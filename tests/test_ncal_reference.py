"""NCAL's ``--preset reference`` against numbers the released code (llm4edu/NCAL_ICML2025) produced on fixed inputs
(``tests/fixtures/ncal``, made by ``tools/reference/ncal/make_fixtures.py``): the prompt tokens, the TC loss and its
gradient, the answer text of the sampling evaluation; and the switches through the LLM recipe (within-batch
pairs, dropped last batch, sampled answers matched to a class, the TC schedule's first step)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests._ncal_toy import CLASSES, toy_examples

pytest.importorskip("peft")
tf = pytest.importorskip("transformers")

FIX = Path(__file__).resolve().parent / "fixtures" / "ncal"


def _load(name: str) -> dict:
    return json.loads((FIX / f"{name}.json").read_text(encoding="utf-8"))


def _prompter(variant: str, preset: str):
    from apps.ncal.llm import LMPrompter, default_instruction
    from apps.ncal.presets import PRESETS

    p = _load("prompts")
    return LMPrompter(FIX / f"tokenizer_{variant}", p["classes"], instruction=default_instruction("tmwpl", p["classes"]),
                      prompt=PRESETS[preset]["prompt"]), p


@pytest.mark.parametrize("variant", ["chat", "chat_bos", "plain"])
def test_reference_prompt_tokens_equal_the_releases(variant):
    """The question alone as the user turn, through the chat template (or the release's fallback without one),
    encoded with the tokenizer's default special tokens: the very ids the release's dataset builds."""
    pr, p = _prompter(variant, "reference")
    rows = p["tokenizers"][variant]
    for q, row in zip(p["questions"], rows):
        assert pr.prompt_ids(q) == row["train_prompt_ids"]
        if variant != "plain":  # with a chat template the release's inference prompt is the same
            assert pr.prompt_ids(q) == row["inference_prompt_ids"]
    if variant == "chat":  # label + EOS: the release's target ids (Qwen-style tokenizers add no BOS)
        for row, y in zip(rows, p["labels"]):
            assert pr.label_ids[p["classes"].index(y)] == row["train_target_ids"]


@pytest.mark.parametrize("variant", ["chat", "chat_bos", "plain"])
def test_project_prompt_differs_from_the_releases(variant):
    """The project's prompt adds a system message that lists the classes: other tokens, and the class names in it."""
    pr, p = _prompter(variant, "project")
    for q, row in zip(p["questions"], p["tokenizers"][variant]):
        ids = pr.prompt_ids(q)
        assert ids != row["train_prompt_ids"] and len(ids) > len(row["train_prompt_ids"])
        assert all(c in pr.tok.decode(ids) for c in p["classes"])


def _tc(preset: str, case: dict, calls: int = 1):
    """The TC term (before λ) of ``preset``'s loss on the fixture's batch, after ``calls - 1`` training steps on it."""
    from apps.ncal.losses import LongTailLoss, LossConfig
    from apps.ncal.train import TrainConfig

    cfg = TrainConfig(dataset="x", out="y", preset=preset)
    K = case["num_classes"]
    lf = LongTailLoss(LossConfig(name="tc", bank_size=cfg.bank_size), torch.ones(K), len(case["features"][0])).train()
    h = torch.tensor(case["features"], requires_grad=True)
    y = torch.tensor(case["labels"])
    g = torch.Generator().manual_seed(1)
    for _ in range(calls - 1):  # earlier training steps on other batches push them into the bank (if any)
        lf(torch.randn(h.shape, generator=g), torch.zeros(len(y), K), y)
    _, reg = lf.terms(h, torch.zeros(len(y), K), y)
    reg.backward()
    return reg, h.grad


def test_reference_tc_loss_and_gradient_equal_the_releases():
    for case in _load("tc")["cases"]:
        for calls in (1, 3):  # within the batch only: the same on every step
            reg, grad = _tc("reference", case, calls)
            assert float(reg.detach()) == pytest.approx(case["loss"], abs=1e-6), case["name"]
            torch.testing.assert_close(grad, torch.tensor(case["grad_features"]), atol=1e-6, rtol=0)


def test_project_tc_pairs_with_the_bank_so_differs_after_a_step():
    case = _load("tc")["cases"][0]
    first, _ = _tc("project", case, 1)  # empty bank: the batch's pairs only
    assert float(first.detach()) == pytest.approx(case["loss"], abs=1e-6)
    later, _ = _tc("project", case, 2)
    assert abs(float(later.detach()) - case["loss"]) > 1e-3


def test_tc_is_on_from_exactly_step_tc_from_and_weighted_by_lambda():
    from apps.ncal.losses import tc_on_at, with_tc

    assert tc_on_at(0, 0) and tc_on_at(5, 5) and tc_on_at(6, 5)
    assert not tc_on_at(4, 5)
    task, reg = torch.tensor(2.0), torch.tensor(3.0)
    tc_from = 5
    assert float(with_tc(task, reg, 0.25, tc_on_at(tc_from, tc_from))) == 2.75  # the term is in at step tc_from
    assert float(with_tc(task, reg, 0.25, tc_on_at(tc_from - 1, tc_from))) == 2.0
    assert float(with_tc(task, None, 0.25, True)) == 2.0


def test_batches_of_the_two_presets():
    import random

    from apps.ncal.presets import make_batches, num_batches, resolve_switches

    lengths = list(range(10))
    ref = make_batches(10, lengths, 4, random.Random(0), "random")
    assert [len(b) for b in ref] == [4, 4] and len({i for b in ref for i in b}) == 8 and num_batches(10, 4, "random") == 2
    assert make_batches(10, lengths, 4, random.Random(1), "random") != ref  # a new permutation per epoch seed
    proj = make_batches(10, lengths, 4, random.Random(0), "bucketed")
    assert sorted(len(b) for b in proj) == [2, 4, 4] and sorted(i for b in proj for i in b) == list(range(10))
    assert num_batches(10, 4, "bucketed") == 3
    with pytest.raises(ValueError, match="leave no batch"):
        num_batches(3, 4, "random")
    assert resolve_switches("reference", bank_size=16)["bank_size"] == 16
    with pytest.raises(ValueError, match="prompt must be one of"):
        resolve_switches("reference", prompt="system")


# the fixture's answers, in order, and the class each names under the exact-name rule (-1: none)
EXPECTED_MATCH = [1, 1, -1, -1, 4, -1, 0, -1, -1, -1, -1]


def test_match_answer_on_the_releases_answers():
    from apps.ncal.llm import match_answer

    a = _load("answers")
    classes = _load("prompts")["classes"]
    assert [match_answer(r["response"], classes) for r in a["answers"]] == EXPECTED_MATCH
    assert match_answer("  分析\n", classes) == 4 and match_answer("分析 ", ["分", "分析"]) == 1


def _tiny_model_dir(d: Path) -> Path:
    """A random 2-layer Qwen2 with the fixture's chat tokenizer."""
    shutil.copytree(FIX / "tokenizer_chat", d)
    tok = tf.AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    cfg = tf.Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    tf.Qwen2ForCausalLM(cfg).save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return _tiny_model_dir(tmp_path_factory.mktemp("ref") / "m")


def _lm(d, preset="reference", classes=None):
    from apps.ncal.llm_train import build_lm, lm_spec
    from apps.ncal.train import TrainConfig

    classes = classes or _load("prompts")["classes"]
    cfg = TrainConfig(dataset="tmwpl", out="y", head="lm", encoder=f"hf:{d}", lora_r=4, preset=preset)
    return build_lm(lm_spec(cfg, classes, "tmwpl"), device="cpu")


def test_sampled_answers_are_generated_and_decoded_as_the_release(tiny_dir, monkeypatch):
    """The generate call's settings and the answer text equal what the release's inference passes and returns."""
    model, pr = _lm(tiny_dir)
    assert model.predict == "sample" and pr.prompt == "question"
    a, p = _load("answers"), _load("prompts")
    rel_kw = p["tokenizers"]["chat"][0]["generate_kwargs"]
    prompt_len = len(p["tokenizers"]["chat"][0]["inference_prompt_ids"])
    seen = []
    for row in a["answers"]:
        def fake_generate(input_ids, attention_mask, **kw):
            seen.append(kw)
            return torch.cat([input_ids, torch.tensor([row["new_ids"]])], 1)

        monkeypatch.setattr(model.lm, "generate", fake_generate)
        b = pr.batch([a["question"]], padding_side="left")
        assert model.sample_answers(b["input_ids"], b["attention_mask"], pr.tok) == [row["response"]]
    kw = seen[0]
    assert kw["do_sample"] is True and rel_kw["do_sample"] is True
    for k in ("temperature", "top_p", "top_k", "pad_token_id", "eos_token_id"):
        assert kw[k] == rel_kw[k], k
    assert kw["max_new_tokens"] == rel_kw["max_length"] - prompt_len


def test_sampling_evaluation_is_seeded_and_unmatched_answers_count_as_wrong(tiny_dir, monkeypatch):
    from apps.ncal.llm import LMClassifier
    from apps.ncal.metrics import classification_metrics
    from apps.ncal.model import infer, predicted_labels

    monkeypatch.setattr(LMClassifier, "sampling", {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "max_new_tokens": 3})
    model, pr = _lm(tiny_dir)
    texts = _load("prompts")["questions"][:3]
    drawn, real = [], model.sample_answers
    monkeypatch.setattr(model, "sample_answers", lambda *a: drawn.append(real(*a)) or drawn[-1])
    p1, f1 = infer(model, pr, texts, batch_size=2)
    n = len(drawn)
    torch.manual_seed(123)  # the evaluation seeds its own draws, whatever the global generator holds
    p2, f2 = infer(model, pr, texts, batch_size=2)
    assert drawn[:n] == drawn[n:]
    torch.testing.assert_close(p1, p2)
    torch.testing.assert_close(f1, f2)
    model.predict = "constrained"  # the features do not depend on how the answer is read
    _, f_con = infer(model, pr, texts, batch_size=2)
    torch.testing.assert_close(f1, f_con, atol=1e-5, rtol=1e-5)
    model.predict = "sample"
    assert set(p1.sum(1).tolist()) <= {0.0, 1.0}
    # a random model names no class: every prediction is -1 and counts as wrong
    pred = predicted_labels(p1)
    assert pred == [-1, -1, -1]
    m = classification_metrics([0, 1, 1], pred, ["a", "b"])
    assert m["accuracy"] == 0.0 and m["unmatched"] == 3 and m["n"] == 3 and m["recall"]["b"] == 0.0
    m = classification_metrics([0, 1, 1], [0, -1, 1], ["a", "b"])
    assert m["accuracy"] == pytest.approx(2 / 3) and m["recall"]["b"] == 0.5 and m["f1"]["a"] == 1.0
    # the draws come from the seed: another eval_seed, other answers (tokens) for the same prompts
    answers = {}
    for seed in (0, 1):
        model.eval_seed = seed
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            b = pr.batch(texts, padding_side="left")
            answers[seed] = model.sample_answers(b["input_ids"], b["attention_mask"], pr.tok)
    assert answers[0] != answers[1]


def _train(out, d, preset, **kw):
    from apps.ncal.train import TrainConfig, train

    base = dict(dataset="toy", out=str(out), encoder=f"hf:{d}", head="lm", loss="tc", tc_lambda=1.0, lora_r=4,
                lora_dropout=0.0, epochs=2, batch_size=4, grad_accum=1, lr=1e-2, warmup_frac=0.1, ckpt_every=100,
                device="cpu", seed=1, grad_share_every=0, preset=preset, tc_start=0.5)
    base.update(kw)
    tr, te = toy_examples((5, 3, 2)), toy_examples((1, 1, 1), seed=1)  # 10 train examples, 3 test
    meta = train(TrainConfig(**base), progress=False, examples=(tr, te, CLASSES))
    return meta, [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _record_batching(monkeypatch) -> list[str]:
    import apps.ncal.presets as presets

    seen, real = [], presets.make_batches
    monkeypatch.setattr(presets, "make_batches", lambda *a: seen.append(a[-1]) or real(*a))
    return seen


def test_llm_recipe_reference_preset_end_to_end(tmp_path, tiny_dir, monkeypatch):
    """10 examples in batches of 4: 2 steps per epoch with drop_last (3 with the last partial batch kept); the
    TC term from step round(0.5 · total) on, exactly; within-batch pairs; sampled answers matched to a class."""
    from apps.ncal.llm import LMClassifier

    monkeypatch.setattr(LMClassifier, "sampling", {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "max_new_tokens": 3})
    batchings = _record_batching(monkeypatch)
    meta, lines = _train(tmp_path / "ref", tiny_dir, "reference", tc_lambda=0.37)
    assert batchings == ["random", "random"]
    assert [r["step"] for r in lines] == [2, 4]
    assert [r["tc_steps"] for r in lines] == [0, 2] and [r["tc_active"] for r in lines] == [False, True]
    # epoch 1 trains on the task loss alone, epoch 2 on task + λ·TC (every step)
    assert lines[0]["train_loss"] == pytest.approx(lines[0]["train_task"], abs=1e-4)
    assert lines[1]["train_tc"] > 0.01
    assert lines[1]["train_loss"] == pytest.approx(lines[1]["train_task"] + 0.37 * lines[1]["train_tc"], abs=3e-4)
    assert meta["loss"]["bank_size"] == 0
    enc = meta["encoder"]
    assert (enc["prompt"], enc["predict"]) == ("question", "sample")
    assert meta["test"]["n"] == 3 and meta["test"]["unmatched"] == 3  # a barely trained tiny model names no class
    s = meta["settings"]
    assert (s["preset"], s["bank_size"], s["batching"], s["prompt"], s["predict"]) == \
        ("reference", 0, "random", "question", "sample")


def test_llm_recipe_project_preset_keeps_the_last_batch(tmp_path, tiny_dir, monkeypatch):
    batchings = _record_batching(monkeypatch)
    meta, lines = _train(tmp_path / "proj", tiny_dir, "project", epochs=1, tc_start=0.0)
    assert batchings == ["bucketed"]
    assert [r["step"] for r in lines] == [3] and lines[0]["tc_steps"] == 3
    assert meta["loss"]["bank_size"] == 256 and meta["encoder"]["predict"] == "constrained"
    assert meta["encoder"]["prompt"] == "instruction" and "unmatched" not in meta["test"]


def test_recipe_cli_passes_the_preset(monkeypatch, tmp_path):
    """``python -m apps.ncal.recipes.llm --preset reference``: the config handed to training has its switches."""
    import apps.ncal.train as train_mod
    from apps.ncal.recipes.llm import main

    d = _tiny_model_dir(tmp_path / "m")
    got = {}

    def fake_train(cfg, examples=None, **kw):
        got["cfg"] = cfg
        return {"test": {"accuracy": 0.0, "macro_f1": 0.0, "n": 0}, "prompt_template": "chat"}

    monkeypatch.setattr(train_mod, "train", fake_train)
    main(["--model", str(d), "--dataset", "tmwpl", "--out", str(tmp_path / "o"), "--preset", "reference",
          "--limit-train", "8", "--limit-test", "4"])
    c = got["cfg"]
    assert (c.preset, c.bank_size, c.batching, c.prompt, c.predict) == ("reference", 0, "random", "question", "sample")
    main(["--model", str(d), "--dataset", "tmwpl", "--out", str(tmp_path / "o2"), "--preset", "reference",
          "--bank-size", "64", "--limit-train", "8", "--limit-test", "4"])
    assert got["cfg"].bank_size == 64 and got["cfg"].predict == "sample"
    main(["--model", str(d), "--dataset", "tmwpl", "--out", str(tmp_path / "o3"), "--limit-train", "8", "--limit-test", "4"])
    c = got["cfg"]
    assert (c.preset, c.bank_size, c.batching, c.prompt, c.predict) == ("project", 256, "bucketed", "instruction",
                                                                         "constrained")


def test_estimator_predict_gives_a_named_class_when_the_sampled_answer_names_none(tiny_dir, monkeypatch, caplog):
    """predict_proba keeps the zero row of an unmatched sample; predict falls back to the class-set argmax for it
    (not silently the first class) and leaves matched rows as the sample named them."""
    from apps.ncal import NCALClassifier
    from apps.ncal.model import Checkpoint

    model, pr = _lm(tiny_dir)
    classes = list(pr.classes)
    texts = _load("prompts")["questions"][:3]
    # the first text's answer names the last class, the others name none
    monkeypatch.setattr(model, "sample_answers", lambda ids, mask, tok: [
        classes[-1] if texts[0] in tok.decode(ids[j][mask[j].bool()]) else "?" for j in range(len(ids))])
    clf = NCALClassifier()
    clf._set_checkpoint(Checkpoint(model=model, tokenizer=pr, meta={"classes": classes}), np.asarray(sorted(classes)))
    monkeypatch.setattr(clf, "_inputs", lambda X: list(X))
    proba = clf.predict_proba(texts)
    assert proba[0].sum() == 1.0 and (proba[1:] == 0).all()
    model.predict = "constrained"
    constrained = clf.predict(texts)
    model.predict = "sample"
    with caplog.at_level("WARNING"):
        pred = clf.predict(texts)
    assert pred[0] == classes[-1] and list(pred[1:]) == list(constrained[1:])
    assert model.predict == "sample" and "2 of 3 sampled answers named no class" in caplog.text
