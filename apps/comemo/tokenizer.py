"""CoMemo's tokenizer: a small BPE trained here with the ``tokenizers`` package, saved as ``tokenizer.json``.

Special tokens (fixed ids, in this order): ``<pad>`` 0, ``<s>`` 1, ``</s>`` 2, ``<unk>`` 3, ``<image>`` 4
(one per image in the prompt: where the image goes), ``<img_ctx>`` 5 (the id written at each image-token
slot of the context path, so id tensors say which slots hold image embeddings). Words are split on spaces
with the Metaspace pre-tokenizer (``▁`` marks a word start), so ``decode(encode(text)) == text`` for text
with single spaces.

Prompt layout (:func:`prompt_text`): ``<s>`` + one ``<image>`` per image + `` question``; the target is
`` answer</s>``. With ``image_labels="before"`` each image is preceded by its text label, as in InternVL's
multi-image prompts (``Image-1: <image>``): ``<s> image 1<image> image 2<image> question``; with
``"after"`` the label follows its image: ``<s><image> image 1<image> image 2 question``. Either way an
answer that names an image ("image 3 shows 1") can copy a label instead of counting images; "after" lets the
label tokens see their own image (attention is causal), so the answer finds the right label in one hop.
Prompt and target are encoded separately and concatenated.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["SPECIAL_TOKENS", "IMAGE_LABELS", "CoMemoTokenizer", "train_tokenizer", "prompt_text"]

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>", "<image>", "<img_ctx>")
PAD, BOS, EOS, UNK, IMAGE, IMG_CTX = range(len(SPECIAL_TOKENS))


IMAGE_LABELS = ("none", "before", "after")


def prompt_text(n_images: int, question: str, *, image_labels: str = "none", label_start: int = 1) -> str:
    """``<s><image>...<image> question`` (one ``<image>`` per image); ``image_labels`` (one of
    :data:`IMAGE_LABELS`) puts the text label ``image K`` before or after image K, numbered from
    ``label_start`` (1 at inference; training may shift it so that large numbers are seen)."""
    if image_labels == "before":
        return "<s>" + "".join(f" image {i + label_start}<image>" for i in range(n_images)) + " " + question.strip()
    if image_labels == "after":
        return "<s>" + "".join(f"<image> image {i + label_start}" for i in range(n_images)) + " " + question.strip()
    if image_labels != "none":
        raise ValueError(f"unknown image_labels {image_labels!r}; choose one of {list(IMAGE_LABELS)}")
    return "<s>" + "<image>" * n_images + " " + question.strip()


class CoMemoTokenizer:
    """Thin wrapper over a ``tokenizers.Tokenizer`` with CoMemo's special tokens at fixed ids."""

    pad_id, bos_id, eos_id, unk_id, image_id, img_ctx_id = PAD, BOS, EOS, UNK, IMAGE, IMG_CTX

    def __init__(self, tokenizer) -> None:
        for i, name in enumerate(SPECIAL_TOKENS):
            got = tokenizer.token_to_id(name)
            if got != i:
                raise ValueError(f"tokenizer must map {name!r} to id {i}, got {got!r}")
        self.tok = tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` without special tokens."""
        return self.tok.decode(list(int(i) for i in ids), skip_special_tokens=True)

    def encode_example(self, n_images: int, question: str, answer: str | None = None, *,
                       image_labels: str = "none", label_start: int = 1) -> tuple[list[int], list[int]]:
        """``(prompt_ids, answer_ids)``; ``answer_ids`` ends with ``</s>`` (empty when ``answer`` is None).
        ``image_labels``, ``label_start``: text labels ``image K`` next to the images (see :func:`prompt_text`)."""
        prompt = self.encode(prompt_text(n_images, question, image_labels=image_labels, label_start=label_start))
        if prompt.count(IMAGE) != n_images:
            raise ValueError(f"the question must not contain '<image>' (found {prompt.count(IMAGE) - n_images} extra)")
        ans = [] if answer is None else self.encode(" " + answer.strip()) + [EOS]
        return prompt, ans

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``tokenizer.json`` atomically."""
        from core.infra.fileio import write_text_atomic

        return write_text_atomic(path, self.tok.to_str(pretty=True))

    @classmethod
    def load(cls, path: str | os.PathLike) -> CoMemoTokenizer:
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as err:  # noqa: BLE001 - the tokenizers library raises its own type for a half-written file
            raise ValueError(f"{path} is not a readable tokenizer file ({' '.join(str(err).split())[:200]}); expected "
                             "the tokenizer.json written with the CoMemo weights") from None
        return cls(tok)


def train_tokenizer(texts: Iterable[str], *, vocab_size: int = 320) -> CoMemoTokenizer:
    """Train the BPE on ``texts`` (deterministic for the same texts and ``vocab_size``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not (isinstance(vocab_size, int) and vocab_size > len(SPECIAL_TOKENS)):
        raise ValueError(f"vocab_size must be an int > {len(SPECIAL_TOKENS)}, got {vocab_size!r}")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    logger.info("trained a BPE tokenizer with %d tokens", tok.get_vocab_size())
    return CoMemoTokenizer(tok)
