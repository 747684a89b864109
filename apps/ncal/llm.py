"""A local decoder LLM as the classifier: the class name generated as text (the NCAL paper's recipe).

:class:`LMPrompter` formats each input with the model's chat template (a system message with the instruction,
the text as the user message, then the assistant's generation prompt); a tokenizer without a chat template gets
a plain prompt (``instruction``, the text, ``"Answer: "``), logged as a warning and recorded as
``template="plain"``. Each class name is tokenized on its own and followed by the tokenizer's end token, so
``"I-Q"`` and a longer name that starts with it are different sequences.

:class:`LMClassifier` wraps a ``transformers`` causal LM (loaded through :func:`core.hf.load`, from a local
folder only), with LoRA adapters from ``peft`` (default r = 8, α = 32, dropout 0.1 on q/k/v/o):

- **training loss**: cross-entropy on the label tokens only (the prompt and padding are never targets), mean
  over the label tokens of the batch, as the published recipe's language-model loss;
- **prediction**: constrained to the class set. Every class name (with its end token) is scored after the
  prompt; the score is the **sum** of its tokens' log-probabilities, i.e. the log-probability the model gives to
  generating exactly that name and stopping. Sum (not mean) because it is the probability of the whole string,
  so a softmax over the K scores is the model's distribution renormalised to the class set; a per-token mean is
  not a probability and favours long names whose later tokens are near-certain once the first is chosen
  (``score="mean"`` is available for comparison). Class names of different lengths are right-padded and masked.
- **feature** (for TC, the ETF loss and NC metrics): the final hidden state of the **last real prompt token**,
  the position that predicts the first label token. It has not seen the label (causal attention), and padding
  never enters it: sequences are rebuilt from each row's real tokens and position ids count real tokens only, so
  left- and right-padded batches give the same features. (The published code read position −1 of right-padded
  batches that included the label and EOS: padding for all but the longest item, and one that saw the label.)

Only the label positions go through the LM head (never the full ``(B, S, V)`` logits).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from apps.ncal.presets import PROMPTS, SAMPLING
from core.collapse import simplex_etf

logger = logging.getLogger(__name__)

__all__ = ["LoraSpec", "LMPrompter", "LMClassifier", "default_instruction", "last_real_index", "real_positions",
           "LORA_TARGETS", "match_answer"]

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")

_INSTRUCTIONS = {
    "tmwpl": "判断下面这道数学应用题考查的 TIMSS 认知水平。只回答下列类别之一的名称：{classes}。",
    "pmtd": "判断下面课堂对话中最后一句话的对话行为类别。只回答下列类别之一的代码：{classes}。",
}
_GENERIC = "Classify the following text. Answer with exactly one of these class names and nothing else: {classes}."


def default_instruction(dataset: str, classes) -> str:
    """The instruction for a shipped dataset (Chinese, lists the class names) or a generic one."""
    name = str(dataset).lower()
    if name in _INSTRUCTIONS:
        return _INSTRUCTIONS[name].format(classes="、".join(classes))
    return _GENERIC.format(classes=", ".join(classes))


def match_answer(text: str, classes) -> int:
    """Index of the class whose name equals the generated answer with surrounding white space removed, else -1.

    The released code trains the model to generate exactly ``label + EOS`` and its ``inference.py`` returns the
    decoded, stripped answer without comparing it to the classes; equality with a class name is the rule that
    scores that output. An answer that names no class (-1) counts as wrong for its true class and as no class's
    prediction.
    """
    t = str(text).strip()
    for k, c in enumerate(classes):
        if t == c:
            return k
    return -1


def last_real_index(mask_BS: torch.Tensor) -> torch.Tensor:
    """Index of the last real (True) position of each row, for left or right padding ``(B,)``."""
    S = mask_BS.shape[1]
    pos_S = torch.arange(1, S + 1, device=mask_BS.device)
    return (mask_BS.long() * pos_S).argmax(1)


def real_positions(mask_BS: torch.Tensor) -> torch.Tensor:
    """Position ids that count real tokens only (0 for padding): left padding does not shift positions."""
    return (mask_BS.long().cumsum(-1) - 1).clamp_min(0)


@dataclass(kw_only=True)
class LoraSpec:
    """LoRA adapters (``r = 0``: no adapters, every weight is trained)."""

    r: int = 8
    alpha: int = 32
    dropout: float = 0.1
    targets: tuple[str, ...] = field(default_factory=lambda: LORA_TARGETS)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["targets"] = list(self.targets)
        return d


class LMPrompter:
    """Prompts and class-name tokens for a local HF tokenizer; ``batch(texts)`` gives padded prompt ids.

    Args:
        path: local model folder (its tokenizer).
        classes: the class names, in label-index order.
        instruction: the task instruction (system message).
        max_prompt_tokens: prompts longer than this lose the end of their text (the template is kept).
        padding_side: ``"left"`` or ``"right"`` for :meth:`batch` (features do not depend on it).
        prompt: ``"instruction"`` (default: a system message with ``instruction``, then the text as the user turn,
            encoded without added special tokens since the chat template writes its own) or ``"question"``
            (the released code's: the text alone as the user turn, whatever the chat template adds, encoded
            with the tokenizer's default special tokens; no chat template: ``"user: <text>\nAssistant:"``).
    """

    def __init__(self, path: str | Path, classes, *, instruction: str, max_prompt_tokens: int = 2048,
                 padding_side: str = "left", prompt: str = "instruction") -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if self.tok.eos_token_id is None:
            raise ValueError(f"the tokenizer in {path} has no end-of-sequence token; the class name needs one to end")
        if self.tok.pad_token_id is None:
            self.tok.pad_token = self.tok.eos_token
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        if prompt not in PROMPTS:
            raise ValueError(f"prompt must be one of {PROMPTS}, got {prompt!r}")
        self.padding_side, self.prompt = padding_side, prompt
        self.classes = tuple(classes)
        self.instruction = instruction
        self.max_prompt_tokens = int(max_prompt_tokens)
        self.template = "chat" if getattr(self.tok, "chat_template", None) else "plain"
        if self.template == "plain" and prompt == "instruction":
            logger.warning("the tokenizer in %s has no chat template; using the plain prompt "
                           "'<instruction>\\n\\n<text>\\n\\nAnswer: '", path)
        self.label_ids = [self.tok.encode(c, add_special_tokens=False) + [self.tok.eos_token_id] for c in self.classes]
        if len({tuple(x) for x in self.label_ids}) != len(self.label_ids):
            raise ValueError(f"two class names tokenize to the same tokens: {self.classes}")

    @property
    def pad_id(self) -> int:
        return int(self.tok.pad_token_id)

    def prompt_text(self, text: str) -> str:
        """The prompt string for one input (chat template with the generation prompt, or the plain form)."""
        if self.prompt == "question":
            if self.template == "plain":
                return f"user: {text}\n".strip() + "\nAssistant:"
            return self.tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                add_generation_prompt=True)
        if self.template == "plain":
            return f"{self.instruction}\n\n{text}\n\nAnswer: "
        msgs = [{"role": "system", "content": self.instruction}, {"role": "user", "content": text}]
        try:
            return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # some templates refuse a system role: put the instruction in the user turn
            logger.debug("chat template refused a system message (%s); instruction goes into the user turn", err)
            msgs = [{"role": "user", "content": f"{self.instruction}\n\n{text}"}]
            return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

    def prompt_ids(self, text: str) -> list[int]:
        """Token ids of the prompt; an over-long text is cut at its end until the prompt fits."""
        # a chat template writes its own BOS; the question prompt is encoded as the release encodes it (defaults)
        special = self.template == "plain" or self.prompt == "question"
        ids = self.tok.encode(self.prompt_text(text), add_special_tokens=special)
        for _ in range(4):
            over = len(ids) - self.max_prompt_tokens
            if over <= 0:
                break
            t_ids = self.tok.encode(text, add_special_tokens=False)
            text = self.tok.decode(t_ids[: max(0, len(t_ids) - over - 1)])
            ids = self.tok.encode(self.prompt_text(text), add_special_tokens=special)
        return ids[-self.max_prompt_tokens:] if len(ids) > self.max_prompt_tokens else ids

    def batch(self, texts, *, device=None, padding_side: str | None = None) -> dict[str, torch.Tensor]:
        """``{"input_ids", "attention_mask" (bool)}`` of the prompts, padded on ``padding_side``."""
        return pad([self.prompt_ids(t) for t in texts], self.pad_id, padding_side or self.padding_side, device)


def pad(seqs: list[list[int]], pad_id: int, side: str = "right", device=None) -> dict[str, torch.Tensor]:
    """Pad id lists to ``(B, S)`` on ``side``; returns ids and a bool mask."""
    S = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), S), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), S), dtype=torch.bool)
    for i, s in enumerate(seqs):
        sl = slice(S - len(s), S) if side == "left" else slice(0, len(s))
        ids[i, sl] = torch.tensor(s, dtype=torch.long)
        mask[i, sl] = True
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)} if device is not None else \
        {"input_ids": ids, "attention_mask": mask}


class LMClassifier(nn.Module):
    """Causal LM that scores class names: ``forward(prompt ids, mask) -> (features (B, D), scores (B, K))``.

    Args:
        path: local model folder (``config.json`` + weights).
        label_ids: per class, the token ids of its name followed by the end token.
        pad_id: the padding id.
        lora: LoRA adapters, or None / ``r = 0`` to train every weight.
        dtype: the base weights' dtype (LoRA adapters stay float32).
        score: ``"sum"`` (default, log-probability of the name) or ``"mean"`` (per token) of the label tokens.
        attn: attention implementation passed to :func:`core.hf.load` (``"sdpa"``, ``"eager"``, ``"longctx"``).
        max_rows: sequences per forward when scoring (B·K rows are split into chunks of this many).
    """

    head_kind = "lm"
    #: "constrained" (class-set argmax of the scores) or "sample" (:meth:`sample_answers` + :func:`match_answer`)
    predict = "constrained"
    sampling = dict(SAMPLING)  # the release's generation settings
    eval_seed = 0  # seed of the sampling draws (``predict = "sample"``)

    def __init__(self, path: str | Path, label_ids: list[list[int]], *, pad_id: int, lora: LoraSpec | None = None,
                 dtype=None, score: str = "sum", attn: str = "sdpa", max_rows: int = 64) -> None:
        super().__init__()
        from core.hf import load

        if score not in ("sum", "mean"):
            raise ValueError(f"score must be 'sum' or 'mean', got {score!r}")
        self.score, self.pad_id, self.max_rows = score, int(pad_id), int(max_rows)
        self.label_ids = [list(map(int, x)) for x in label_ids]
        lm = load(path, kind="causal-lm", dtype=dtype or torch.float32, device="cpu", attn=attn, processor=False).model
        self.lora = lora if lora is not None and lora.r > 0 else None
        if self.lora is not None:
            try:
                import peft
            except ImportError as e:  # pragma: no cover - depends on the install
                raise ImportError("LoRA needs peft: pip install peft (or --lora-r 0)") from e
            cfg = peft.LoraConfig(r=self.lora.r, lora_alpha=self.lora.alpha, lora_dropout=self.lora.dropout,
                                  target_modules=list(self.lora.targets), task_type="CAUSAL_LM")
            lm = peft.get_peft_model(lm, cfg)
        self.lm = lm
        cfg = self._base().config
        self.feature_dim = int(getattr(cfg, "hidden_size", None) or cfg.get_text_config().hidden_size)
        K = len(self.label_ids)
        self.register_buffer("etf_W_KD", simplex_etf(K, self.feature_dim, generator=torch.Generator().manual_seed(0)),
                             persistent=False)

    def _base(self):
        return self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm

    def hidden(self, ids_BS: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
        """Final (normed) hidden states ``(B, S, D)``; position ids count real tokens only."""
        out = self._base().get_decoder()(input_ids=ids_BS, attention_mask=mask_BS.long(),
                                         position_ids=real_positions(mask_BS), use_cache=False)
        return out.last_hidden_state

    def _with_labels(self, ids_BS, mask_BS, conts: list[list[int]], rows: list[int]):
        """Right-padded sequences ``prompt(rows[i]) + conts[i]``: ids, mask, prompt lengths, continuation lengths."""
        seqs, plen = [], []
        for r, c in zip(rows, conts):
            p = ids_BS[r][mask_BS[r]].tolist()
            seqs.append(p + c)
            plen.append(len(p))
        b = pad(seqs, self.pad_id, "right", ids_BS.device)
        return b["input_ids"], b["attention_mask"], plen, [len(c) for c in conts]

    def _label_logprobs(self, h_BSD, ids_BS, plen, clen) -> tuple[torch.Tensor, torch.Tensor]:
        """``(per-token log-probs (T,), row of each token (T,))`` of the continuation tokens only."""
        rows, pos = [], []
        for i, (p, c) in enumerate(zip(plen, clen)):
            rows += [i] * c
            pos += range(p - 1, p - 1 + c)  # the hidden state at t predicts token t + 1
        rows_T = torch.tensor(rows, device=h_BSD.device)
        pos_T = torch.tensor(pos, device=h_BSD.device)
        logits_TV = self._base().get_output_embeddings()(h_BSD[rows_T, pos_T]).float()
        tgt_T = ids_BS[rows_T, pos_T + 1]
        return -F.cross_entropy(logits_TV, tgt_T, reduction="none"), rows_T

    def lm_loss(self, ids_BS: torch.Tensor, mask_BS: torch.Tensor, y_B: torch.Tensor,
                weight_B: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, features (B, D))``: cross-entropy on the gold label tokens (mean over them; per-example
        weights ``weight_B`` scale each example's tokens), features at each last real prompt token."""
        B = ids_BS.shape[0]
        conts = [self.label_ids[int(k)] for k in y_B]
        s_ids, s_mask, plen, clen = self._with_labels(ids_BS, mask_BS, conts, list(range(B)))
        h = self.hidden(s_ids, s_mask)
        feats = h[torch.arange(B, device=h.device), torch.tensor(plen, device=h.device) - 1]
        logp_T, rows_T = self._label_logprobs(h, s_ids, plen, clen)
        if weight_B is None:
            loss = -logp_T.mean()
        else:
            w_T = weight_B.to(logp_T)[rows_T]
            loss = -(w_T * logp_T).sum() / w_T.sum()
        return loss, feats.float()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features (B, D), class scores (B, K))``: the score of class k is the sum (or mean) of its name's
        token log-probabilities after the prompt; the feature is the last real prompt token's hidden state."""
        B, K = input_ids.shape[0], len(self.label_ids)
        rows_all = [b for b in range(B) for _ in range(K)]
        conts_all = [self.label_ids[k] for _ in range(B) for k in range(K)]
        scores = torch.zeros(B * K, device=input_ids.device)
        feats = [None] * B
        for s in range(0, B * K, self.max_rows):
            rows, conts = rows_all[s:s + self.max_rows], conts_all[s:s + self.max_rows]
            s_ids, s_mask, plen, clen = self._with_labels(input_ids, attention_mask, conts, rows)
            h = self.hidden(s_ids, s_mask)
            logp_T, r_T = self._label_logprobs(h, s_ids, plen, clen)
            tot = torch.zeros(len(rows), device=h.device).index_add_(0, r_T, logp_T)
            if self.score == "mean":
                tot = tot / torch.tensor(clen, device=h.device, dtype=tot.dtype)
            scores[s:s + len(rows)] = tot
            for i, r in enumerate(rows):
                if feats[r] is None:
                    feats[r] = h[i, plen[i] - 1].float()
        return torch.stack(feats), scores.view(B, K)

    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The last real prompt token's final hidden state ``(B, D)`` (float32), for either padding side."""
        h = self.hidden(input_ids, attention_mask)
        return h[torch.arange(h.shape[0], device=h.device), last_real_index(attention_mask)].float()

    @torch.no_grad()
    def sample_answers(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, tok) -> list[str]:
        """Sampled answers to left-padded prompts ``(B, S)``, as the released ``inference.py`` makes them:
        ``generate(do_sample=True)`` with :attr:`sampling` (temperature 0.7, top-k 50, top-p 0.9, up to 512 new
        tokens, stopping at the end token), the new tokens decoded without special tokens and stripped. Draws
        come from torch's global generator (seed it, e.g. in :func:`apps.ncal.model.infer`)."""
        if bool((~attention_mask[:, -1]).any()):
            raise ValueError("sample_answers needs left-padded prompts (the last position real in every row)")
        s = self.sampling
        out = self.lm.generate(input_ids=input_ids, attention_mask=attention_mask.long(), do_sample=True,
                               temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"],
                               max_new_tokens=s["max_new_tokens"], pad_token_id=self.pad_id,
                               eos_token_id=tok.eos_token_id)
        return [tok.decode(row, skip_special_tokens=True).strip() for row in out[:, input_ids.shape[1]:]]

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The weights that training changes (LoRA adapters, or every weight without LoRA)."""
        names = {n for n, p in self.named_parameters() if p.requires_grad}
        return {k: v for k, v in self.state_dict().items() if k in names}
