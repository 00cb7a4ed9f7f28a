"""Streaming an answer's text as its tokens are decoded."""

from __future__ import annotations

import torch
from torch import Tensor


class Detokenizer:
    """Turns a growing list of token ids into newly printable text (multi-byte safe), incrementally.

    Each token decodes only a short window: the ids from ``prefix`` (the last printed piece, kept as
    context so a tokenizer that drops a leading space at the start of a decode sees the same start)
    to the end, minus the text of ``prefix:read``. Re-decoding the whole answer on every token
    would be quadratic in its length. A window that ends in an incomplete UTF-8 sequence (U+FFFD)
    waits for the next token.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the context window
        self.read = 0  # ids before this are printed

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        text = self.tokenizer.decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)


def letter_tokens(tokenizer, vocab: int, device: torch.device | str = "cpu") -> Tensor:
    """[vocab] bool: the tokens whose own text has a letter, or is a piece of a multi-byte character (U+FFFD).

    The repeat guard's word n-grams are those with such a token (``kvtool/core/sampling.py``): numbers,
    punctuation and spaces may repeat. Decoded once per model (one batch call); ids past the tokenizer's
    vocabulary (a padded embedding) spell nothing.
    """
    n = min(vocab, len(tokenizer))
    texts = tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=True)
    table = torch.zeros(vocab, dtype=torch.bool)
    table[:n] = torch.tensor([any(c.isalpha() or c == "\ufffd" for c in text) for text in texts], dtype=torch.bool)
    return table.to(device)
