"""Tokenizers built from a training text file; no pretrained vocabularies.

Both encode whole files into int32 token streams (half the memory of int64, which matters for
WikiText-103's ~100M words / ~540M characters); chunks are widened to int64 when read.
"""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

UNK = "<unk>"
EOS = "<eos>"
_CHUNK_CHARS = 1 << 24


def _as_tensor(ids: array) -> Tensor:
    if not ids:
        return torch.empty(0, dtype=torch.int32)
    return torch.frombuffer(ids, dtype=torch.int32)


class WordTokenizer:
    """Whitespace-separated words with ``<eos>`` closing every line.

    The vocabulary is ``<eos>``, ``<unk>``, then the training words in order of first appearance, so
    one pass over the training file both builds it and encodes the file.
    """

    def __init__(self) -> None:
        self.vocab: list[str] = [EOS, UNK]
        self._ids = {token: index for index, token in enumerate(self.vocab)}

    def fit_encode(self, path: Path) -> Tensor:
        """Encode ``path``, adding every new word to the vocabulary."""
        ids = array("i")
        eos = self._ids[EOS]
        for line in _lines(path):
            for word in line.split():
                index = self._ids.get(word)
                if index is None:
                    index = self.add_token(word)
                ids.append(index)
            ids.append(eos)
        return _as_tensor(ids)

    def encode(self, path: Path) -> Tensor:
        """Encode ``path`` with the current vocabulary; unknown words become ``<unk>``."""
        ids = array("i")
        unk, eos = self._ids[UNK], self._ids[EOS]
        for line in _lines(path):
            ids.extend(self._ids.get(word, unk) for word in line.split())
            ids.append(eos)
        return _as_tensor(ids)

    def add_token(self, token: str) -> int:
        self._ids[token] = len(self.vocab)
        self.vocab.append(token)
        return self._ids[token]


class CharTokenizer:
    """Single characters (newlines included); the vocabulary is ``<unk>`` then the training characters sorted."""

    def __init__(self) -> None:
        self.vocab: list[str] = [UNK]
        self._codepoints = torch.empty(0, dtype=torch.int32)

    def fit_encode(self, path: Path) -> Tensor:
        """Build the vocabulary from the characters of ``path``, then encode it."""
        chars: set[str] = set()
        for chunk in _chunks(path):
            chars.update(chunk)
        ordered = sorted(chars)
        self.vocab = [UNK, *ordered]
        self._codepoints = torch.tensor([ord(c) for c in ordered], dtype=torch.int32)
        return self.encode(path)

    def encode(self, path: Path) -> Tensor:
        """Encode ``path`` with the current vocabulary; unknown characters become ``<unk>`` (id 0)."""
        pieces = [self._encode_text(chunk) for chunk in _chunks(path)]
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int32)

    def add_token(self, token: str) -> int:
        self.vocab.append(token)
        return len(self.vocab) - 1

    def _encode_text(self, text: str) -> Tensor:
        # Vectorized lookup: UTF-32 gives one code point per character, found by binary search in the
        # sorted vocabulary; character ids are that position + 1 (after <unk>).
        codepoints = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32)
        if len(self._codepoints) == 0:
            return torch.zeros_like(codepoints)
        position = torch.searchsorted(self._codepoints, codepoints).clamp_(max=len(self._codepoints) - 1)
        known = self._codepoints[position] == codepoints
        return torch.where(known, position + 1, 0).to(torch.int32)


def _lines(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as handle:
        yield from handle


def _chunks(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as handle:
        while chunk := handle.read(_CHUNK_CHARS):
            yield chunk


TOKENIZERS = {"word": WordTokenizer, "char": CharTokenizer}
