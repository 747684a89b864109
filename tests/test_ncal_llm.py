"""apps.ncal's LLM recipe (``--head lm``) on tiny random Qwen2 and Llama models saved with a tiny byte-level BPE
tokenizer that has a chat template: the feature position, constrained prediction, training, resume, the recipe."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests._ncal_toy import CLASSES, toy_examples

pytest.importorskip("peft")
tf = pytest.importorskip("transformers")

CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NAMES = ("甲", "乙乙乙乙", "丙丙")  # class names of different token lengths


def make_tiny_llm(d, family: str, *, chat: bool = True, extra=()):
    """A random ``family`` causal LM (2 layers, width 32) + a byte-level BPE tokenizer trained on the toy texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([e.text for e in toy_examples()] + list(CLASSES) + list(extra) + ["system user assistant"],
                           trainer=trainer)
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if chat:
        tok.chat_template = CHAT
    tok.save_pretrained(str(d))
    cfg_cls, lm_cls = {"qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM), "llama": (tf.LlamaConfig, tf.LlamaForCausalLM)}[family]
    cfg = cfg_cls(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=tok.pad_token_id,
                  eos_token_id=tok.eos_token_id, initializer_range=0.3)
    torch.manual_seed(0)
    lm_cls(cfg).save_pretrained(str(d))
    return d


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny_llm(request, tmp_path_factory):
    return make_tiny_llm(tmp_path_factory.mktemp(request.param), request.param, extra=NAMES)


def _model(d, classes=NAMES, **kw):
    from apps.ncal.llm import LMClassifier, LMPrompter, LoraSpec

    pr = LMPrompter(d, classes, instruction="分类")
    return LMClassifier(d, pr.label_ids, pad_id=pr.pad_id, lora=LoraSpec(**kw)), pr


def test_last_real_index_for_left_and_right_padding():
    """The TC feature's position: the last real token of each row, whichever side is padded."""
    from apps.ncal.llm import last_real_index

    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 0, 0, 0]], dtype=torch.bool)
    assert last_real_index(mask).tolist() == [4, 2, 4, 1]


def test_feature_is_the_last_real_prompt_token_for_any_padding(tiny_llm):
    m, pr = _model(tiny_llm)
    m.eval()
    texts = ["加减", "面积周长速度时间加减乘除", "速度"]
    with torch.no_grad():
        f_left, s_left = m(**pr.batch(texts, padding_side="left"))
        f_right, s_right = m(**pr.batch(texts, padding_side="right"))
        alone = [m(**pr.batch([t]))[0][0] for t in texts]
        # the prompt-only forward of the base model: hidden state at the last prompt token
        for i, t in enumerate(texts):
            ids = torch.tensor([pr.prompt_ids(t)])
            h = m._base()(input_ids=ids, output_hidden_states=True).hidden_states[-1][0, -1]
            torch.testing.assert_close(alone[i], h, atol=1e-5, rtol=1e-5)
        # the training forward (prompt + gold label) gives the same feature: it has not seen the label
        y = torch.tensor([0, 1, 2])
        _, f_train = m.lm_loss(*pr.batch(texts, padding_side="right").values(), y)
    torch.testing.assert_close(f_left, f_right, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_left, s_right, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(f_left, torch.stack(alone), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(f_train, f_left, atol=1e-5, rtol=1e-5)
    # the published feature (last position of right-padded prompt + label + EOS) is another vector
    seqs = [pr.prompt_ids(t) + pr.label_ids[k] for t, k in zip(texts, y.tolist())]
    from apps.ncal.llm import pad

    b = pad(seqs, pr.pad_id, "right")
    with torch.no_grad():
        naive = m._base()(input_ids=b["input_ids"], attention_mask=b["attention_mask"].long(),
                          output_hidden_states=True).hidden_states[-1][:, -1]
    assert not torch.allclose(naive[0], f_left[0], atol=1e-3)


def test_scores_are_class_name_log_likelihoods(tiny_llm):
    m, pr = _model(tiny_llm)
    m.eval()
    lens = [len(x) for x in pr.label_ids]
    assert len(set(lens)) > 1, lens  # names of different token lengths
    texts = ["加减乘", "面积"]
    with torch.no_grad():
        _, scores = m(**pr.batch(texts))
        for i, t in enumerate(texts):
            p = pr.prompt_ids(t)
            for k, lab in enumerate(pr.label_ids):
                ids = torch.tensor([p + lab])
                logp = m._base()(input_ids=ids).logits[0].float().log_softmax(-1)
                want = sum(float(logp[len(p) - 1 + j, tok]) for j, tok in enumerate(lab))
                assert scores[i, k].item() == pytest.approx(want, abs=1e-4)
    m.score = "mean"
    with torch.no_grad():
        _, mean_scores = m(**pr.batch(texts))
    torch.testing.assert_close(mean_scores, scores / torch.tensor(lens, dtype=torch.float32), atol=1e-5, rtol=1e-5)


def test_a_few_steps_lower_the_label_loss_and_only_adapters_train(tiny_llm):
    m, pr = _model(tiny_llm, dropout=0.0)
    ex = toy_examples()[:8]
    y = torch.tensor([k % 3 for k in range(8)])
    b = pr.batch([e.text for e in ex])
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    m.train()
    losses = []
    for _ in range(12):
        loss, feats = m.lm_loss(b["input_ids"], b["attention_mask"], y)
        opt.zero_grad(); loss.backward(); opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 2.0 and losses[-1] < min(losses[:6]), losses
    assert feats.shape == (8, 32)
    trainable = list(m.trainable_state())
    assert trainable and all("lora_" in k for k in trainable)
    assert {t for k in trainable for t in ("q_proj", "k_proj", "v_proj", "o_proj") if t in k} == {
        "q_proj", "k_proj", "v_proj", "o_proj"}


def test_plain_prompt_when_the_tokenizer_has_no_chat_template(tmp_path, caplog):
    from apps.ncal.llm import LMPrompter

    d = make_tiny_llm(tmp_path, "qwen2", chat=False)
    with caplog.at_level("WARNING"):
        pr = LMPrompter(d, CLASSES, instruction="分类")
    assert pr.template == "plain" and "no chat template" in caplog.text
    assert pr.prompt_text("加减").endswith("加减\n\nAnswer: ")
    chat = LMPrompter(make_tiny_llm(tmp_path / "c", "qwen2"), CLASSES, instruction="分类")
    assert chat.template == "chat" and chat.prompt_text("加减").endswith("<|im_start|>assistant\n")


def _cfg(out, d, **kw):
    from apps.ncal.train import TrainConfig

    base = dict(dataset="toy", out=str(out), encoder=f"hf:{d}", head="lm", loss="tc", tc_lambda=1.0, lora_r=4,
                lora_dropout=0.0, epochs=2, batch_size=4, grad_accum=2, lr=1e-2, warmup_frac=0.1, ckpt_every=1,
                device="cpu", seed=1, grad_share_every=1)
    base.update(kw)
    return TrainConfig(**base)


def test_train_resume_load_and_predict_over_the_class_set(tmp_path, tiny_llm, monkeypatch):
    from apps.ncal import NCALClassifier
    from apps.ncal import llm as llm_mod
    from apps.ncal.model import infer, load_checkpoint
    from apps.ncal.train import train
    from apps.ncal.weights_io import load_safetensors

    tr, te = toy_examples((10, 5, 3)), toy_examples((3, 3, 3), seed=1)
    meta = train(_cfg(tmp_path / "a", tiny_llm), progress=False, examples=(tr, te, CLASSES))
    assert meta["head"] == "lm" and meta["prompt_template"] == "chat" and meta["test"]["n"] == 9
    lines = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in lines] == [1, 2] and all(r["train_tc"] > 0 and r["tc_grad_share"] > 0 for r in lines)
    assert all(r["test_nc_nc1"] is not None for r in lines)

    calls = {"n": 0}
    real = llm_mod.LMClassifier.lm_loss

    def dying(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 9:  # the second epoch (3 steps of 2 micro-batches per epoch)
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(llm_mod.LMClassifier, "lm_loss", dying)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(tmp_path / "b", tiny_llm), progress=False, examples=(tr, te, CLASSES))
    monkeypatch.setattr(llm_mod.LMClassifier, "lm_loss", real)
    assert (tmp_path / "b" / "last.pt").exists() and not (tmp_path / "b" / "model.safetensors").exists()
    train(_cfg(tmp_path / "b", tiny_llm), progress=False, examples=(tr, te, CLASSES))
    a, b = load_safetensors(tmp_path / "a" / "model.safetensors"), load_safetensors(tmp_path / "b" / "model.safetensors")
    assert set(a) == set(b) and all("lora_" in k for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="other settings"):
        train(_cfg(tmp_path / "b", tiny_llm, loss="ce"), progress=False, examples=(tr, te, CLASSES))

    ck = load_checkpoint(tmp_path / "a")
    probs, feats = infer(ck.model, ck.tokenizer, [e.text for e in te])
    assert probs.shape == (9, 3) and feats.shape == (9, 32)
    torch.testing.assert_close(probs.sum(1), torch.ones(9))
    y = torch.tensor([CLASSES.index(e.label) for e in te])
    assert (probs.argmax(1) == y).float().mean().item() == pytest.approx(meta["test"]["accuracy"])
    clf = NCALClassifier.load(tmp_path / "a")
    assert set(clf.predict([e.text for e in te[:4]])) <= set(CLASSES)


def test_lm_head_refuses_what_it_cannot_do(tmp_path):
    from apps.ncal.train import TrainConfig, main

    with pytest.raises(ValueError, match="hf:/path"):
        TrainConfig(dataset="x", out="y", head="lm")
    with pytest.raises(ValueError, match="lm head trains with"):
        TrainConfig(dataset="x", out="y", head="lm", encoder="hf:/m", loss="focal")
    from core.infra.cli import run_cli

    assert run_cli(main, ["--dataset", "tmwpl", "--out", str(tmp_path / "o"), "--head", "lm"]) == 2
    assert not (tmp_path / "o").exists()


def test_lm_head_max_steps_and_base_weight_dtype(tmp_path):
    """--max-steps stops the lm head's run after N optimizer steps (evaluated and saved); the base weights follow
    --dtype (auto: fp32 on the CPU; bf16 as asked) with float32 adapters; a description written before --dtype
    existed (fp16 flag) loads in fp32 on the CPU; full fine-tuning refuses half-precision weights."""
    from apps.ncal.llm_train import build_lm, lm_spec
    from apps.ncal.model import load_checkpoint
    from apps.ncal.train import train

    d = make_tiny_llm(tmp_path / "m", "qwen2")
    tr, te = toy_examples((10, 5, 3)), toy_examples((2, 2, 2), seed=1)  # 3 steps per epoch
    meta = train(_cfg(tmp_path / "a", d, max_steps=2, grad_share_every=0), progress=False, examples=(tr, te, CLASSES))
    assert meta["steps"] == 2 and meta["test"]["n"] == 6 and meta["encoder"]["dtype"] == "auto"
    lines = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["step"]) for r in lines] == [(1, 2)]
    ck = load_checkpoint(tmp_path / "a", dtype="bfloat16")
    base = {p.dtype for n, p in ck.model.named_parameters() if "lora_" not in n}
    adapters = {p.dtype for n, p in ck.model.named_parameters() if "lora_" in n}
    assert base == {torch.bfloat16} and adapters == {torch.float32}
    spec = lm_spec(_cfg(tmp_path / "b", d), CLASSES, "toy")
    model, _ = build_lm(spec, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    legacy = {k: v for k, v in spec.items() if k != "dtype"} | {"fp16": True}
    model, _ = build_lm(legacy, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with pytest.raises(ValueError, match="full fine-tuning"):
        train(_cfg(tmp_path / "c", d, lora_r=0, dtype="bfloat16"), progress=False, examples=(tr, te, CLASSES))


def test_llm_recipe_runs_end_to_end_on_a_tiny_model(tmp_path, capsys):
    from apps.ncal.data import DATASETS
    from apps.ncal.recipes.llm import main
    from core.infra.cli import run_cli

    d = make_tiny_llm(tmp_path / "m", "qwen2", extra=DATASETS["pmtd"].classes)
    out = tmp_path / "run"
    argv = ["--model", str(d), "--dataset", "pmtd", "--out", str(out), "--limit-train", "16", "--limit-test", "8",
            "--epochs", "1", "--batch-size", "4", "--grad-accum", "2", "--max-prompt-tokens", "96", "--threads", "1"]
    assert run_cli(main, argv) == 0
    meta = json.loads((out / "ncal.json").read_text())
    s = meta["settings"]
    assert (s["lora_r"], s["lora_alpha"], s["lora_dropout"], s["lr"], s["warmup_frac"]) == (8, 32, 0.1, 2e-4, 0.05)
    assert meta["steps"] == 2 and meta["test"]["n"] == 8 and meta["encoder"]["kind"] == "hf-lm"
    assert "test accuracy" in capsys.readouterr().out
    assert run_cli(main, argv[:-2] + ["--limit-train", "12"]) == 2  # another sample in the same folder is refused
    assert run_cli(main, ["--model", str(tmp_path / "none"), "--dataset", "pmtd", "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


def test_an_adapter_finds_its_base_model_after_a_move(tmp_path, capsys):
    """An adapter records its base model absolutely and relative to itself: moved together they still load; the
    base moved alone is an error naming ncal.json and --base-model, and --base-model (CLI and Python) finds it."""
    import shutil

    from apps.ncal import NCALClassifier
    from apps.ncal.model import load_checkpoint
    from apps.ncal.predict import main as predict_main
    from apps.ncal.train import train
    from core.infra.cli import run_cli

    base = make_tiny_llm(tmp_path / "proj" / "base", "qwen2")
    tr, te = toy_examples((6, 4, 3)), toy_examples((2, 2, 2), seed=1)
    train(_cfg(tmp_path / "proj" / "adapter", base, epochs=1, grad_share_every=0), progress=False,
          examples=(tr, te, CLASSES))
    meta = json.loads((tmp_path / "proj" / "adapter" / "ncal.json").read_text())
    assert meta["encoder"]["source_relative"] == "../base"
    texts = [e.text for e in te]
    before = load_checkpoint(tmp_path / "proj" / "adapter")
    p0 = NCALClassifier.load(tmp_path / "proj" / "adapter").predict_proba(texts)

    shutil.move(tmp_path / "proj", tmp_path / "moved")  # both together: the relative path finds the base
    p1 = NCALClassifier.load(tmp_path / "moved" / "adapter").predict_proba(texts)
    np.testing.assert_allclose(p1, p0, atol=1e-6)
    del before

    shutil.move(tmp_path / "moved" / "base", tmp_path / "elsewhere")  # the base alone
    with pytest.raises(FileNotFoundError, match=r"ncal\.json: its base model is not at .*--base-model"):
        load_checkpoint(tmp_path / "moved" / "adapter")
    p2 = NCALClassifier.load(tmp_path / "moved" / "adapter", base_model=tmp_path / "elsewhere").predict_proba(texts)
    np.testing.assert_allclose(p2, p0, atol=1e-6)
    argv = ["--checkpoint", str(tmp_path / "moved" / "adapter"), "--text", texts[0], "--json"]
    assert run_cli(predict_main, argv) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "ncal.json" in err[0] and "--base-model" in err[0], err
    assert run_cli(predict_main, [*argv, "--base-model", str(tmp_path / "elsewhere")]) == 0
