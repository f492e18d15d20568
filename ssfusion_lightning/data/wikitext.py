"""WikiText-2 / WikiText-103 language modelling from the raw text files, tokenized from the training split."""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from ssfusion_lightning.data.base import Split, TokenDataModule
from ssfusion_lightning.data.factory import DATASETS
from ssfusion_lightning.data.files import locate
from ssfusion_lightning.data.sequences import StreamChunks
from ssfusion_lightning.data.tokenizers import TOKENIZERS

_SPLIT_FILES = {"train": "wiki.train", "val": "wiki.valid", "test": "wiki.test"}
MASK = "<mask>"


class _WikiText(TokenDataModule):
    """Word- or character-level WikiText; each split is one token stream cut into ``seq_len`` sequences.

    Files: ``root/<folder>/wiki.{train,valid,test}.raw`` (the ``.tokens`` files of the non-raw release,
    or files directly in ``root``, are accepted too). The vocabulary comes from the training split
    (unknown tokens elsewhere become ``<unk>``) and is built on first use of ``vocab_size`` or ``setup``,
    identically on every rank; ``<mask>`` is appended under ``objective="mlm"``.
    """

    title: ClassVar[str]
    folders: ClassVar[tuple[str, ...]]

    def __init__(
        self,
        root: str,
        level: str = "word",
        seq_len: int = 64,
        objective: str = "causal",
        mask_prob: float = 0.15,
        batch_size: int = 32,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = True,
    ) -> None:
        super().__init__(seq_len, objective, mask_prob, batch_size, num_workers, pin_memory, drop_last)
        if level not in TOKENIZERS:
            raise ValueError(f"unknown tokenization level {level!r}; valid choices: {', '.join(TOKENIZERS)}")
        self.level = level
        hint = (
            f"Download the raw release (the .tokens release works too) from the official site and unzip it into "
            f"{root}, or point paths.data_dir (or data.root) at the directory that already holds {self.folders[0]}/"
        )
        paths = locate(root, self.title, list(_SPLIT_FILES.values()), self.folders, (".raw", ".tokens"), hint)
        self.paths = dict(zip(_SPLIT_FILES, paths))
        self._streams: dict[str, Tensor] = {}
        self._vocab: list[str] = []

    @property
    def vocab(self) -> list[str]:
        """Token strings by id."""
        self._tokenize()
        return self._vocab

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def build_dataset(self, split: Split) -> StreamChunks:
        self._tokenize()
        # Causal chunks overlap by one token so that every token except the first is a target once.
        return StreamChunks(self._streams[split], self.chunk_length, stride=self.seq_len)

    def _tokenize(self) -> None:
        if self._streams:
            return
        tokenizer = TOKENIZERS[self.level]()
        self._streams["train"] = tokenizer.fit_encode(self.paths["train"])
        for split in ("val", "test"):
            self._streams[split] = tokenizer.encode(self.paths[split])
        if self.objective == "mlm":
            tokenizer.add_token(MASK)
        self._vocab = tokenizer.vocab


@DATASETS.register("wikitext2")
class WikiText2(_WikiText):
    """WikiText-2 under ``root/wikitext-2-raw/``; the ``.tokens`` release at word level has the ~33k vocabulary."""

    title = "WikiText-2"
    folders = ("wikitext-2-raw", "wikitext-2", "")


@DATASETS.register("wikitext103")
class WikiText103(_WikiText):
    """WikiText-103 under ``root/wikitext-103-raw/``; tokenizing it takes a minute or two per rank."""

    title = "WikiText-103"
    folders = ("wikitext-103-raw", "wikitext-103", "")
