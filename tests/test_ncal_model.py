"""apps.ncal encoder, losses, training (resume), estimator and the hf: encoder path, on tiny models."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from apps.ncal.data import Example
from apps.ncal.encoder import EncoderConfig, TextEncoder, pool_features
from apps.ncal.losses import LOSSES, LossConfig, LongTailLoss
from apps.ncal.tokenizer import CharTokenizer
from tests._ncal_toy import CLASSES, toy_examples, write_tiny_encoder


def _toy(n_per=(24, 8, 4), seed=0) -> list[Example]:
    return toy_examples(n_per, seed)


@pytest.fixture(scope="module")
def tiny_encoder_dir(tmp_path_factory):
    """A tiny random encoder folder, as apps.ncal.pretrain writes it."""
    return write_tiny_encoder(tmp_path_factory.mktemp("enc"), [e.text for e in _toy()] + ["小明有苹果"])


@pytest.mark.parametrize("pool", ["mean", "cls", "last"])
def test_features_ignore_padding(pool):
    torch.manual_seed(0)
    tok = CharTokenizer.train(["小明有三个苹果和两个梨子", "一二三"], min_freq=1, max_length=32)
    enc = TextEncoder(EncoderConfig(vocab_size=len(tok), dim=16, num_layers=2, num_heads=2, max_length=32, pool=pool)).eval()
    short, long_ = "一二三", "小明有三个苹果和两个梨子"
    with torch.no_grad():
        alone = enc(**tok.batch([short]))
        padded = enc(**tok.batch([short, long_]))[0:1]
    torch.testing.assert_close(alone, padded, atol=1e-5, rtol=1e-5)


def test_pool_last_takes_last_real_token_with_left_or_right_padding():
    h = torch.arange(2 * 4 * 1, dtype=torch.float32).view(2, 4, 1)
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert pool_features(h, right, "last").squeeze(1).tolist() == [1.0, 7.0]
    assert pool_features(h, left, "last").squeeze(1).tolist() == [3.0, 7.0]


@pytest.mark.parametrize("name", LOSSES)
def test_each_loss_trains_a_linear_probe(name):
    from apps.ncal.model import NCALModel

    g = torch.Generator().manual_seed(1)
    K, D, N = 3, 8, 60
    y = torch.randint(0, K, (N,), generator=g)
    x = torch.randn(N, D, generator=g) + 3 * torch.nn.functional.one_hot(y, D).float()

    class Ident(torch.nn.Module):
        feature_dim = D

        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(D, D)

        def forward(self, input_ids, attention_mask):
            return self.lin(input_ids)

    torch.manual_seed(0)
    model = NCALModel(Ident(), K, head="etf" if name == "etf" else "linear")
    loss_fn = LongTailLoss(LossConfig(name=name, bank_size=16), torch.tensor([40.0, 15.0, 5.0]), D)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    first = None
    for _ in range(60):
        f, logits = model(x, None)
        loss, parts = loss_fn(f, logits, y, model.etf_W_KD)
        first = first if first is not None else loss.item()
        opt.zero_grad(); loss.backward(); opt.step()
    assert loss.item() < first
    acc = (model(x, None)[1].argmax(1) == y).float().mean().item()
    assert acc > 0.9
    if name == "tc":
        assert "tc" in parts and int(loss_fn.bank.count) == 60 * 16  # the last 16 of each batch are kept


def test_class_balanced_and_logit_adjusted_terms():
    counts = torch.tensor([100.0, 10.0, 1.0])
    lf = LongTailLoss(LossConfig(name="cb", cb_beta=0.9), counts, 4)
    w = lf.cb_weight_K
    assert w[0] < w[1] < w[2] and w.mean().item() == pytest.approx(1.0)
    la = LongTailLoss(LossConfig(name="la"), counts, 4)
    logits = torch.zeros(2, 3)
    y = torch.tensor([0, 2])
    loss, _ = la(torch.zeros(2, 4), logits, y)
    prior = counts / counts.sum()
    expect = torch.nn.functional.cross_entropy(torch.log(prior).expand(2, 3), y)
    assert loss.item() == pytest.approx(expect.item(), rel=1e-5)
    with pytest.raises(ValueError, match="loss must be one of"):
        LossConfig(name="mse")


def _train_cfg(out, enc_dir, **kw):
    from apps.ncal.train import TrainConfig

    base = dict(dataset="toy", out=str(out), encoder=str(enc_dir), epochs=2, batch_size=8, lr=3e-3, ckpt_every=1,
                nc_train_sample=32, device="cpu", seed=3)
    base.update(kw)
    return TrainConfig(**base)


def test_train_writes_checkpoint_metrics_and_learns(tmp_path, tiny_encoder_dir):
    from apps.ncal.model import infer, load_checkpoint
    from apps.ncal.train import train

    tr, te = _toy(seed=0), _toy((6, 6, 6), seed=1)
    meta = train(_train_cfg(tmp_path / "run", tiny_encoder_dir, epochs=6), progress=False, examples=(tr, te, CLASSES))
    assert meta["test"]["n"] == 18 and meta["test"]["accuracy"] > 0.6
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in lines] == list(range(1, 7))
    assert all(r["train_nc1"] is not None and r["test_nc_nc2"] is not None and r["train_tc"] > 0 for r in lines)
    ck = load_checkpoint(tmp_path / "run")
    assert ck.classes == list(CLASSES) and ck.meta["loss"]["name"] == "tc"
    probs, feats = infer(ck.model, ck.tokenizer, [e.text for e in te])
    assert probs.shape == (18, 3) and feats.shape == (18, 16)
    torch.testing.assert_close(probs.sum(1), torch.ones(18))
    acc = (probs.argmax(1) == torch.tensor([CLASSES.index(e.label) for e in te])).float().mean().item()
    assert acc == pytest.approx(meta["test"]["accuracy"])


def test_resume_after_interruption_matches_uninterrupted(tmp_path, tiny_encoder_dir, monkeypatch):
    from apps.ncal import train as train_mod
    from apps.ncal.weights_io import load_safetensors

    tr = _toy(seed=0)
    train_mod.train(_train_cfg(tmp_path / "a", tiny_encoder_dir), progress=False, examples=(tr, None, CLASSES))

    calls = {"n": 0}
    real_forward = LongTailLoss.forward

    def dying_forward(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 7:  # mid second epoch (5 steps per epoch)
            raise KeyboardInterrupt
        return real_forward(self, *a, **k)

    monkeypatch.setattr(LongTailLoss, "forward", dying_forward)
    with pytest.raises(KeyboardInterrupt):
        train_mod.train(_train_cfg(tmp_path / "b", tiny_encoder_dir), progress=False, examples=(tr, None, CLASSES))
    monkeypatch.setattr(LongTailLoss, "forward", real_forward)
    assert not (tmp_path / "b" / "model.safetensors").exists()
    train_mod.train(_train_cfg(tmp_path / "b", tiny_encoder_dir), progress=False, examples=(tr, None, CLASSES))
    a = load_safetensors(tmp_path / "a" / "model.safetensors")
    b = load_safetensors(tmp_path / "b" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0)
    # other settings in the same folder are refused
    with pytest.raises(ValueError, match="other settings"):
        train_mod.train(_train_cfg(tmp_path / "b", tiny_encoder_dir, loss="ce"), progress=False, examples=(tr, None, CLASSES))


def test_train_cli_on_a_user_jsonl(tmp_path, tiny_encoder_dir):
    from apps.ncal.train import main

    def write(path, exs):
        path.write_text("".join(json.dumps({"id": e.id, "question": e.text, "class": e.label}, ensure_ascii=False) + "\n"
                                for e in exs), encoding="utf-8")

    write(tmp_path / "tr.jsonl", _toy())
    write(tmp_path / "te.jsonl", _toy((3, 3, 3), seed=5))
    meta = main(["--dataset", str(tmp_path / "tr.jsonl"), "--test", str(tmp_path / "te.jsonl"), "--loss", "ce",
                 "--encoder", str(tiny_encoder_dir), "--epochs", "1", "--out", str(tmp_path / "run"), "--device", "cpu"])
    assert meta["classes"] == ["甲", "乙", "丙"]  # by train frequency
    assert meta["test"]["n"] == 9
    with pytest.raises(ValueError, match="unknown dataset 'nope'"):
        main(["--dataset", "nope", "--out", str(tmp_path / "x")])


def test_estimator_fit_predict_and_errors(tmp_path, tiny_encoder_dir):
    from sklearn.base import clone

    from apps.ncal import NCALClassifier

    tr = _toy()
    X = [e.text for e in tr]
    y = [{"甲": 2, "乙": 0, "丙": 1}[e.label] for e in tr]  # integer labels
    clf = NCALClassifier(loss="focal", epochs=3, batch_size=8, lr=3e-3, encoder=str(tiny_encoder_dir), device="cpu",
                         work_dir=str(tmp_path / "fit"))
    assert clone(clf).get_params()["loss"] == "focal"
    with pytest.raises(Exception, match="not fitted"):
        clf.predict(["加减"])
    clf.fit(X, y)
    assert clf.classes_.tolist() == [0, 1, 2]
    p = clf.predict_proba(X[:5])
    assert p.shape == (5, 3) and np.allclose(p.sum(1), 1)
    pred = clf.predict(X)
    assert set(pred.tolist()) <= {0, 1, 2} and (pred == np.array(y)).mean() > 0.5
    assert clf.transform(X[:2]).shape == (2, 16)
    # the column order follows classes_, not the model's frequency order
    from apps.ncal.model import infer

    model_p = infer(clf.checkpoint_.model, clf.checkpoint_.tokenizer, X[:5])[0]
    for i, c in enumerate(clf.classes_):
        assert np.allclose(p[:, i], model_p[:, clf.checkpoint_.classes.index(str(c))].numpy(), atol=1e-6)
    with pytest.raises(ValueError, match="text 1: empty"):
        clf.predict(["加", " "])
    with pytest.raises(ValueError, match="row 0: a dict was given.*fitted on texts"):  # no row layout recorded
        clf.predict([{"question": X[0]}])
    with pytest.raises(ValueError, match="has 2 texts but y has 1"):
        NCALClassifier().fit(["a", "b"], [1])


def _tiny_hf(tmp_path, arch: str):
    tf = pytest.importorskip("transformers")
    d = tmp_path / arch
    d.mkdir()
    chars = sorted({c for e in _toy() for c in e.text})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    tok = tf.BertTokenizer(vocab_file=str(d / "vocab.txt"))
    tok.save_pretrained(str(d))
    torch.manual_seed(0)
    if arch == "bert":
        cfg = tf.BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=32, max_position_embeddings=64)
        tf.BertModel(cfg).save_pretrained(str(d))
    else:
        cfg = tf.Qwen2Config(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, intermediate_size=32, max_position_embeddings=64)
        tf.Qwen2Model(cfg).save_pretrained(str(d))
    return d


@pytest.mark.parametrize("arch,pool", [("bert", "mean"), ("qwen2", "last")])
def test_hf_encoder_trains_saves_and_reloads(tmp_path, arch, pool):
    from apps.ncal.hf_encoder import HFEncoder, HFTokenizer
    from apps.ncal.model import infer, load_checkpoint
    from apps.ncal.train import train

    d = _tiny_hf(tmp_path, arch)
    enc, tok = HFEncoder(d, pool=pool).eval(), HFTokenizer(d)
    with torch.no_grad():  # padding never reaches the feature
        a = enc(**tok.batch(["加减乘"]))
        b = enc(**tok.batch(["加减乘", "面积周长速度时间加减"]))[:1]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    tr = _toy()
    cfg = _train_cfg(tmp_path / "run", "unused", encoder=f"hf:{d}", pool=pool, epochs=1)
    meta = train(cfg, progress=False, examples=(tr, None, CLASSES))
    assert meta["encoder"]["kind"] == "hf"
    ck = load_checkpoint(tmp_path / "run")
    p1, _ = infer(ck.model, ck.tokenizer, [e.text for e in tr[:4]])
    assert p1.shape == (4, 3) and torch.allclose(p1.sum(1), torch.ones(4))
    from apps.ncal.hf_encoder import parse_hf_source

    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        parse_hf_source(f"hf:{tmp_path / 'missing'}")
    with pytest.raises(ValueError, match="hf:/path/to/model"):
        parse_hf_source(str(d))


def test_hf_lora_trains_only_adapters(tmp_path):
    pytest.importorskip("peft")
    from apps.ncal.model import load_checkpoint
    from apps.ncal.train import train
    from apps.ncal.weights_io import load_safetensors

    d = _tiny_hf(tmp_path, "qwen2")
    cfg = _train_cfg(tmp_path / "run", "unused", encoder=f"hf:{d}", lora_r=2, epochs=1)
    train(cfg, progress=False, examples=(_toy(), None, CLASSES))
    saved = load_safetensors(tmp_path / "run" / "model.safetensors")
    enc_keys = [k for k in saved if k.startswith("encoder.")]
    assert enc_keys and all("lora" in k for k in enc_keys)
    load_checkpoint(tmp_path / "run")


def test_max_steps_ends_the_run_evaluated_and_saved(tmp_path, tiny_encoder_dir):
    """--max-steps: a smoke run stops inside an epoch after N optimizer steps, its schedule ends there (the learning
    rate reaches 0), it is evaluated and saved like a full run, and another N in the same folder is refused."""
    from apps.ncal.model import load_checkpoint
    from apps.ncal.train import main, train
    from apps.ncal.weights_io import load_state

    tr, te = _toy(seed=0), _toy((3, 3, 3), seed=1)  # 5 steps per epoch
    meta = train(_train_cfg(tmp_path / "run", tiny_encoder_dir, max_steps=3), progress=False,
                 examples=(tr, te, CLASSES))
    assert meta["steps"] == 3 and meta["test"]["n"] == 9
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["step"]) for r in lines] == [(1, 3)]
    st = load_state(tmp_path / "run" / "last.pt")
    assert st["step"] == 3 and st["scheduler"]["_last_lr"][0] == pytest.approx(0.0, abs=1e-12)
    assert load_checkpoint(tmp_path / "run").classes == list(CLASSES)
    with pytest.raises(ValueError, match="other settings"):
        train(_train_cfg(tmp_path / "run", tiny_encoder_dir, max_steps=4), progress=False, examples=(tr, te, CLASSES))
    with pytest.raises(ValueError, match="max_steps must be >= 1"):
        _train_cfg(tmp_path / "x", tiny_encoder_dir, max_steps=0)
    with pytest.raises(SystemExit):
        main(["--dataset", "tmwpl", "--out", str(tmp_path / "y"), "--max-steps", "0"])


@pytest.mark.parametrize("lam", [0.0, 0.1, 2.5])
def test_tc_weight_scales_the_tc_term_and_tc_on_gates_it(lam):
    """loss = task + λ·TC with the TC term on; = task with it off (the TC schedule); λ is the configured one."""
    torch.manual_seed(0)
    feats, logits, y = torch.randn(6, 8), torch.randn(6, 3), torch.tensor([0, 1, 2, 0, 1, 2])
    lf = LongTailLoss(LossConfig(name="tc", tc_lambda=lam, bank_size=0), torch.tensor([4.0, 3.0, 2.0]), 8).eval()
    loss, parts = lf(feats, logits, y, None, tc_on=True)
    assert parts["tc"] > 0
    assert float(loss) == pytest.approx(parts["task"] + lam * parts["tc"], rel=1e-5, abs=1e-6)
    off, _ = lf(feats, logits, y, None, tc_on=False)
    assert float(off) == pytest.approx(parts["task"], rel=1e-6)
