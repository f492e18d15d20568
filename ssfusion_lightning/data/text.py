"""Byte-level language modelling on one plain text file, plain or gzipped.

The tokens are the file's bytes (ids 0..255), so any text in any encoding works and no vocabulary
is fitted. The default file is the Lee corpus that gensim ships
(``gensim/test/test_data/lee_background.cor``: 300 news articles of the Australian Broadcasting
Corporation, one per line, 360 KB; Lee, Pincombe and Welsh, 2005). The last ``val_fraction`` of the
bytes is the validation split, also used as the test split; the bytes before it are training.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from ssfusion_lightning.data.base import Split, TokenDataModule
from ssfusion_lightning.data.factory import DATASETS
from ssfusion_lightning.data.files import PackagedFile, locate_file, open_binary
from ssfusion_lightning.data.sequences import StreamChunks

BYTE_VALUES = 256
PACKAGED = PackagedFile("gensim", "gensim", "test/test_data/lee_background.cor")
FORMAT = "a text file (plain or .gz)"


def read_bytes(path: Path) -> Tensor:
    """The (decompressed) bytes of ``path`` as a uint8 token stream."""
    with open_binary(path) as handle:
        data = handle.read()
    if not data:
        raise ValueError(f"{path} is empty; expected {FORMAT}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@DATASETS.register("text")
class TextFile(TokenDataModule):
    """Bytes of the text file ``path`` (None: gensim's Lee corpus) cut into ``seq_len`` sequences.

    Under ``objective="mlm"`` the mask token is id 256, after the byte values.
    """

    def __init__(
        self,
        path: str | None = None,
        val_fraction: float = 0.1,
        seq_len: int = 64,
        objective: str = "causal",
        mask_prob: float = 0.15,
        batch_size: int = 32,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = True,
    ) -> None:
        super().__init__(seq_len, objective, mask_prob, batch_size, num_workers, pin_memory, drop_last)
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.val_fraction = val_fraction
        self.path = locate_file(path, "Text corpus", PACKAGED, FORMAT)
        self._tokens: Tensor | None = None

    @property
    def vocab_size(self) -> int:
        return BYTE_VALUES + 1 if self.objective == "mlm" else BYTE_VALUES

    def build_dataset(self, split: Split) -> StreamChunks:
        if self._tokens is None:
            self._tokens = read_bytes(self.path)
        cut = len(self._tokens) - round(len(self._tokens) * self.val_fraction)
        part = self._tokens[:cut] if split == "train" else self._tokens[cut:]
        if len(part) < self.chunk_length:
            name = "train" if split == "train" else "val"
            raise ValueError(
                f"{self.path}: the {name} split holds {len(part)} bytes, fewer than one sequence of "
                f"{self.chunk_length}; use a longer file, a smaller seq_len or another val_fraction"
            )
        # Causal chunks overlap by one token so that every token except the first is a target once.
        return StreamChunks(part, self.chunk_length, stride=self.seq_len)
