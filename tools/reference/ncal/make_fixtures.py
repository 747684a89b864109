"""Run the released NCAL code (llm4edu/NCAL_ICML2025) on CPU on fixed inputs and write what it produces as numbers
(the fixtures of ``tests/test_ncal_reference.py``).

    python tools/reference/ncal/make_fixtures.py RELEASE_DIR tests/fixtures/ncal

``RELEASE_DIR`` is an export of the release (its ``code/`` folder is put first on the path and its modules
``config``, ``dataset``, ``trainer`` and ``inference`` are imported from there, never copied). It needs torch,
transformers (≥ 4.36, the release's pin), peft and tokenizers; the project's environment has them. Nothing is
downloaded. What it records:

- ``tokenizer_<variant>/``: tiny byte-level BPE tokenizers built here (trained on the fixed questions and class
  names), written so the tests load the very same ones: ``chat`` (a Qwen2.5-style chat template that adds its
  default system message when there is none; no added BOS, like Qwen2's tokenizer), ``chat_bos`` (the same with a
  ``<s>`` added in front of every encoding, so encoding with or without the default special tokens differs) and
  ``plain`` (no chat template: the release's fallback formats);
- ``prompts.json``: per tokenizer and question, the ids the release's ``ConversationDataset`` builds for the
  TMWPL layout of ``data/train_example.json`` (one user turn holding the question; the prompt part is where
  ``labels == -100``, then the label + EOS part), and the ids its ``ModelInference.generate_response`` passes to
  ``generate`` for the same question, with the keyword arguments of that call;
- ``tc.json``: the release's ``ETFLossTrainer.compute_etf_loss`` (``class_diff=True``, ``e_w = 1``) on fixed
  features placed at the last position of ``(B, S, D)`` hidden states, with fixed labels: the loss and its
  gradient with respect to the features;
- ``answers.json``: the answer strings ``generate_response`` returns (decode of the new tokens without special
  tokens, stripped) for fixed generated token ids. The release has no code that maps an answer to a class.

Work-arounds, all here, none in the release's code: the release's classes are built without their
constructors' model loading (``ModelInference`` gets this harness's tokenizer and a stand-in model whose
``generate`` records its arguments and returns the prompt followed by fixed ids; ``ETFLossTrainer`` gets its
four loss attributes set, not a ``transformers.Trainer`` with a model).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

#: fixed questions (TMWPL-like; one with surrounding white space, one in English, one long)
QUESTIONS = [
    "小明家今年一月份电话费83.5元，以后每个月都比上个月节约6.8元．那么他家今年四月份应付电话费多少元？",
    "  王阿姨存入银行2000元，记作+2000元；支取600元，记作____元．\n",
    "A train travels 120 km in 2 hours. What is its speed?",
    "一个梯形的面积是30平方米，高是3米，上底是80分米，下底是（　　） A．12米 B．6米 C．2米" * 3,
]
#: the release's TMWPL classes (code/config.py DataArguments.label_types), the gold labels of the questions
CLASSES = ["回忆", "识别", "选取策略", "表征建模", "分析", "推断", "过程实施"]
LABELS = ["选取策略", "识别", "过程实施", "回忆"]
#: a Qwen2.5-style chat template (its default system message when the conversation has none)
CHAT = ("{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
        "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
        "helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if not (message['role'] "
        "== 'system' and loop.first) %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' "
        "}}{%- endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
#: generated texts (before the end token) for the answer fixture; "<eos>" / "<pad>" / "<im_start>" mark special ids
ANSWERS = ["识别", " 识别 \n", "推断。", "这道题考查分析", "分析<eos><pad><pad>", "", "回忆<im_start>", "表征 建模",
           "Recall", "过程实施\n\n解释：计算", "选取策略<eos>识别"]


def build_tokenizer(out: Path, variant: str):
    """A tiny byte-level BPE tokenizer (``variant``: chat, chat_bos or plain), saved to ``out``."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(QUESTIONS + CLASSES + ["system user assistant You are Qwen, created by Alibaba Cloud."],
                           trainer=trainer)
    if variant == "chat_bos":
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                          special_tokens=[("<s>", tk.token_to_id("<s>"))])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                               bos_token="<s>" if variant == "chat_bos" else None)
    if variant != "plain":
        tok.chat_template = CHAT
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    return transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)


class _StandInModel:
    """What ``ModelInference.generate_response`` calls: ``device``, ``generate`` (records its keyword arguments,
    returns the prompt followed by fixed ids)."""

    device = torch.device("cpu")

    def __init__(self, new_ids: list[int]):
        self.new_ids, self.calls = new_ids, []

    def generate(self, input_ids, attention_mask, **kw):
        self.calls.append({"input_ids": input_ids[0].tolist(), "attention_mask": attention_mask[0].tolist(), **kw})
        return torch.cat([input_ids, torch.tensor([self.new_ids], dtype=input_ids.dtype)], 1)


def _inference(mod, tok, new_ids: list[int]):
    """A release ``ModelInference`` with this harness's tokenizer and a stand-in model (no loading)."""
    inf = mod.ModelInference.__new__(mod.ModelInference)
    inf.model_path, inf.base_model_path, inf.device = "-", None, "cpu"
    inf.tokenizer, inf.model = tok, _StandInModel(new_ids)
    # as ModelInference._load_model sets up its tokenizer
    inf.tokenizer.padding_side = "left"
    if inf.tokenizer.pad_token is None:
        inf.tokenizer.pad_token = inf.tokenizer.eos_token
    return inf


def prompts_fixture(rel, out: Path) -> dict:
    dataset_mod, config_mod, inference_mod = rel["dataset"], rel["config"], rel["inference"]
    res = {"classes": CLASSES, "questions": QUESTIONS, "labels": LABELS, "tokenizers": {}}
    for variant in ("chat", "chat_bos", "plain"):
        tok = build_tokenizer(out / f"tokenizer_{variant}", variant)
        tok.padding_side = "right"  # as code/model.py loads the training tokenizer
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "train.json"
            path.write_text(json.dumps([{"conversation": [{"role": "user", "content": q}], "label": y}
                                        for q, y in zip(QUESTIONS, LABELS)], ensure_ascii=False), encoding="utf-8")
            ds = dataset_mod.ConversationDataset(str(path), tok, config_mod.DataArguments(dataset_path=str(path)))
            items = [ds[i] for i in range(len(ds))]
        rows = []
        for q, it in zip(QUESTIONS, items):
            lab = it["labels"].tolist()
            n_prompt = sum(1 for v in lab if v == -100)
            inf = _inference(inference_mod, tok, [tok.eos_token_id])
            inf.generate_response(q)
            call = inf.model.calls[0]
            rows.append({"train_prompt_ids": it["input_ids"][:n_prompt].tolist(),
                         "train_target_ids": it["input_ids"][n_prompt:].tolist(),
                         "class_index": int(it["class_indices"]),
                         "inference_prompt_ids": call["input_ids"],
                         "generate_kwargs": {k: v for k, v in call.items() if k not in ("input_ids", "attention_mask")}})
        res["tokenizers"][variant] = rows
    return res


def tc_fixture(rel) -> dict:
    trainer_mod = rel["trainer"]
    tr = trainer_mod.ETFLossTrainer.__new__(trainer_mod.ETFLossTrainer)
    g = torch.Generator().manual_seed(0)
    cases = []
    specs = [("mixed", 7, [0, 0, 1, 2, 2, 2, 5, 6], 16), ("pmtd_like", 8, [0, 1, 1, 1, 1, 3, 7, 7, 7, 2], 12),
             ("one_class", 7, [3, 3, 3, 3], 16), ("two", 7, [1, 4], 8)]
    for name, K, y, D in specs:
        tr.num_classes, tr.e_w, tr.class_diff, tr.use_etf_loss = K, 1.0, True, True
        N = len(y)
        # norms from 0.3 to 3: some features under the cap, some over it
        h = torch.randn(N, D, generator=g, dtype=torch.float64)
        h = h / h.norm(dim=1, keepdim=True) * torch.linspace(0.3, 3.0, N, dtype=torch.float64)[:, None]
        h = h.float()
        hs = torch.randn(N, 3, D, generator=g)  # earlier positions: never read by the release's loss
        hs[:, -1] = h
        hs.requires_grad_(True)
        loss = tr.compute_etf_loss(hs, torch.tensor(y))
        loss.backward()
        # no pair of different classes: the release returns a new zero tensor, attached to nothing (no gradient)
        grad = hs.grad if hs.grad is not None else torch.zeros_like(hs)
        cases.append({"name": name, "num_classes": K, "labels": y, "features": h.tolist(),
                      "loss": float(loss.detach()), "grad_features": grad[:, -1].tolist(),
                      "loss_attached_to_features": hs.grad is not None,
                      "grad_elsewhere_is_zero": bool((grad[:, :-1] == 0).all())})
    return {"e_w": 1.0, "class_diff": True, "cases": cases}


def answers_fixture(rel, out: Path) -> dict:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(out / "tokenizer_chat"), local_files_only=True)
    marks = {"<eos>": tok.eos_token_id, "<pad>": tok.pad_token_id, "<im_start>": tok.convert_tokens_to_ids("<|im_start|>")}
    rows = []
    for text in ANSWERS:
        ids, rest = [], text
        while rest:
            cut = min(((rest.find(m), m) for m in marks if m in rest), default=None)
            if cut is None:
                ids += tok.encode(rest, add_special_tokens=False)
                break
            i, m = cut
            ids += tok.encode(rest[:i], add_special_tokens=False) + [marks[m]]
            rest = rest[i + len(m):]
        new_ids = ids + [tok.eos_token_id]  # generation stops at the end token
        inf = _inference(rel["inference"], tok, new_ids)
        rows.append({"generated": text, "new_ids": new_ids, "response": inf.generate_response(QUESTIONS[0])})
    return {"tokenizer": "tokenizer_chat", "question": QUESTIONS[0], "answers": rows,
            "release_matching": None,
            "note": "code/inference.py returns the decoded, stripped answer; the release has no code that maps it "
                    "to a class"}


def import_release(release: Path) -> dict:
    code = release / "code"
    if not (code / "trainer.py").is_file():
        raise SystemExit(f"error: {release} has no code/trainer.py (give the release's root folder)")
    sys.path.insert(0, str(code))
    import config, dataset, inference, trainer  # noqa: E401  (the release's modules, from RELEASE_DIR/code)

    return {"config": config, "dataset": dataset, "inference": inference, "trainer": trainer}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("release", type=Path, help="the release's root folder (RELEASE_DIR)")
    p.add_argument("out", type=Path, help="fixture folder (tests/fixtures/ncal)")
    p.add_argument("--commit", default=None, help="the release's commit, recorded in the fixtures")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    rel = import_release(a.release.resolve())
    commit = a.commit
    if commit is None:
        try:
            commit = subprocess.run(["git", "-C", str(a.release), "rev-parse", "HEAD"], capture_output=True, text=True,
                                    check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    a.out.mkdir(parents=True, exist_ok=True)
    import transformers

    env = {"release": "llm4edu/NCAL_ICML2025", "commit": commit, "torch": torch.__version__,
           "transformers": transformers.__version__}
    for name, data in (("prompts", prompts_fixture(rel, a.out)), ("tc", tc_fixture(rel)),
                       ("answers", answers_fixture(rel, a.out))):
        path = a.out / f"{name}.json"
        path.write_text(json.dumps({"made_by": env, **data}, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
