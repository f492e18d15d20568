"""The real-data modules (``data=digits``, ``data=text``) read files in the format of the data that
scikit-learn and gensim ship. Every test but the last two writes its own tiny files, so none needs
the ``realdata`` extra; those two read the packaged files and are skipped without it."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ssfusion_lightning.app.builders import build_datamodule as build_from_config
from ssfusion_lightning.app.config import compose_config
from ssfusion_lightning.data import Digits, TextFile, build_datamodule
from ssfusion_lightning.data import digits as digits_module
from ssfusion_lightning.data import text as text_module
from ssfusion_lightning.data.files import PackagedFile
from ssfusion_lightning.data.sequences import IGNORE_INDEX

INSTALL = 'pip install "ssfusion-lightning[realdata]"'
CORPUS = "The quick brown fox jumps over the lazy dog. Über café naïve!\n" * 8


def digit_rows(count: int = 10) -> list[list[int]]:
    """Rows of scikit-learn's digits.csv.gz (64 pixel values 0..16, then the label): row i's pixels
    are all i % 17, its label is i % 10."""
    return [[i % 17] * 64 + [i % 10] for i in range(count)]


def write_digits(path: Path, rows: list[list[int]], float_format: bool = False) -> Path:
    # float_format: the same values as np.savetxt writes them by default ("%.18e")
    fields = (lambda v: f"{v:.18e}") if float_format else str
    text = "".join(",".join(fields(v) for v in row) + "\n" for row in rows)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def items(dataset) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = zip(*(dataset[i] for i in range(len(dataset))))
    return torch.stack(images), torch.stack(labels)


# --- digits ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, float_format", [("digits.csv.gz", False), ("digits.csv", False), ("old.csv.gz", True)])
def test_digits_reads_a_csv_file_in_scikit_learns_format(tmp_path, name, float_format):
    path = write_digits(tmp_path / name, digit_rows(10), float_format)
    dm = Digits(path=str(path), val_fraction=0.3, batch_size=2)
    assert dm.num_classes == 10 and dm.image_shape == (1, 8, 8)
    train, val = dm.dataset("train"), dm.dataset("val")
    assert (len(train), len(val)) == (7, 3)
    assert dm.dataset("test") is val

    images, labels = items(train)
    assert images.shape == (7, 1, 8, 8) and images.dtype == torch.float32 and labels.dtype == torch.int64
    assert 0.0 <= images.min() and images.max() <= 1.0
    # each row's pixels are its index i % 17, scaled by the format's maximum (16), and its label i % 10
    index = (images[:, 0, 0, 0] * 16).round().long()
    assert torch.equal(labels, index % 10)
    assert torch.equal(images, (index.float() / 16).view(-1, 1, 1, 1).expand(-1, 1, 8, 8))

    batch_images, batch_labels = next(iter(dm.train_dataloader()))
    assert batch_images.shape == (2, 1, 8, 8) and batch_labels.shape == (2,)


def test_digits_split_is_seeded_disjoint_and_complete(tmp_path):
    path = write_digits(tmp_path / "digits.csv", digit_rows(17))

    def split(seed: int) -> tuple[list[int], ...]:
        """The row indices (each row's pixel value) in the training and the validation split."""
        dm = Digits(path=str(path), val_fraction=0.25, split_seed=seed)
        rows = [(items(dm.dataset(split))[0][:, 0, 0, 0] * 16).round().long() for split in ("train", "val")]
        return tuple(sorted(r.tolist()) for r in rows)

    train, val = split(0)
    assert len(val) == 4 and sorted(train + val) == list(range(17))
    assert split(0) == (train, val)  # the same on every rank and every run
    torch.manual_seed(123)  # the global seed does not move it
    assert split(0) == (train, val)
    assert split(1) != (train, val)


@pytest.mark.parametrize(
    "row, message",
    [
        ([0] * 64, r"line 2: 64 columns; expected 64 pixel values and a label"),
        ([0] * 63 + ["x", 3], r"line 2, column 64: 'x' is not a number"),
        ([0] * 10 + [17] + [0] * 53 + [3], r"line 2, column 11: pixel value '17' is outside 0\.\.16"),
        ([0] * 64 + [10], r"line 2, column 65: label '10' is not an integer in 0\.\.9"),
        ([0] * 64 + [2.5], r"line 2, column 65: label '2\.5' is not an integer in 0\.\.9"),
        ([0] * 64 + ["nan"], r"line 2, column 65: label 'nan' is not an integer"),
    ],
)
def test_digits_names_the_malformed_value(tmp_path, row, message):
    path = tmp_path / "bad.csv"
    path.write_text(",".join(["1"] * 64 + ["1"]) + "\n" + ",".join(str(v) for v in row) + "\n")
    dm = Digits(path=str(path))
    with pytest.raises(ValueError, match=f"^{path}, {message}"):
        dm.setup("fit")


def test_digits_refuses_empty_files_and_splits(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match=f"{empty} holds no rows; expected a digits CSV file"):
        Digits(path=str(empty)).setup("fit")
    one = write_digits(tmp_path / "one.csv", digit_rows(1))
    with pytest.raises(ValueError, match="leaves 0 for validation and 1 for training; both need at least one"):
        Digits(path=str(one)).setup("fit")
    with pytest.raises(ValueError, match=r"val_fraction must be in \(0, 1\), got 1.0"):
        Digits(path=str(one), val_fraction=1.0)


def test_missing_digits_file_names_the_path_and_how_to_get_it(tmp_path):
    missing = tmp_path / "nowhere" / "digits.csv.gz"
    with pytest.raises(FileNotFoundError) as caught:
        Digits(path=str(missing))
    message = str(caught.value)
    assert message.startswith(f"UCI digits not found: expected {digits_module.FORMAT} at {missing}. ")
    assert "64 pixel values 0..16 and a label 0..9 per row" in digits_module.FORMAT
    assert "data.path=null" in message and "scikit-learn" in message and INSTALL in message
    assert f"data.path={missing}" not in message  # no echo of the path given


@pytest.mark.parametrize(
    "module, datamodule, distribution", [(digits_module, Digits, "scikit-learn"), (text_module, TextFile, "gensim")]
)
def test_without_the_extra_the_default_file_says_how_to_install_it(monkeypatch, module, datamodule, distribution):
    monkeypatch.setattr(module, "PACKAGED", PackagedFile("no_such_package_for_ssfusion", distribution, "data.csv"))
    with pytest.raises(FileNotFoundError) as caught:
        datamodule()
    message = str(caught.value)
    assert f"read from the {distribution} package, which is not installed. Install it with {INSTALL}" in message
    assert f"or point data.path at {module.FORMAT}" in message


def test_a_package_without_the_file_is_named(monkeypatch):
    monkeypatch.setattr(digits_module, "PACKAGED", PackagedFile("torch", "torch", "no/such/file.csv"))
    with pytest.raises(FileNotFoundError, match=r"no/such/file\.csv, which this version of torch does not ship"):
        Digits()


# --- text ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["corpus.txt", "corpus.cor.gz"])
def test_text_is_byte_tokens_with_the_last_part_held_out(tmp_path, name):
    raw = CORPUS.encode("utf-8")
    path = tmp_path / name
    path.write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
    dm = TextFile(path=str(path), seq_len=8, val_fraction=0.25, batch_size=3)
    assert dm.vocab_size == 256 and dm.mask_token_id is None
    cut = len(raw) - round(len(raw) * 0.25)
    train, val = dm.dataset("train"), dm.dataset("val")
    assert dm.dataset("test") is not None and len(dm.dataset("test")) == len(val)
    # chunks of seq_len + 1 bytes every seq_len bytes: every byte but the first is a target once
    assert len(train) == (cut - 9) // 8 + 1 and len(val) == (len(raw) - cut - 9) // 8 + 1
    assert bytes(train[0].tolist()) == raw[:9] and bytes(train[1].tolist()) == raw[8:17]
    assert bytes(val[0].tolist()) == raw[cut : cut + 9]
    assert max(max(chunk.tolist()) for chunk in train) > 127  # UTF-8's multi-byte characters are bytes too

    inputs, targets = next(iter(dm.val_dataloader()))
    assert inputs.shape == targets.shape == (3, 8) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_text_mlm_appends_the_mask_token(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(CORPUS)
    dm = TextFile(path=str(path), seq_len=16, objective="mlm", batch_size=4)
    assert dm.vocab_size == 257 and dm.mask_token_id == 256
    inputs, targets = next(iter(dm.train_dataloader()))
    assert inputs.shape == (4, 16) and inputs.max() <= 256
    assert ((targets == IGNORE_INDEX) | ((targets >= 0) & (targets < 256))).all()


def test_text_refuses_empty_and_too_short_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=f"{empty} is empty; expected a text file"):
        TextFile(path=str(empty)).setup("fit")
    short = tmp_path / "short.txt"
    short.write_text("x" * 100)
    with pytest.raises(ValueError, match=f"{short}: the val split holds 10 bytes, fewer than one sequence of 65"):
        TextFile(path=str(short)).setup("fit")


def test_missing_text_file_names_the_path_and_how_to_get_it(tmp_path):
    missing = tmp_path / "corpus.txt"
    with pytest.raises(FileNotFoundError) as caught:
        TextFile(path=str(missing))
    message = str(caught.value)
    assert message.startswith(f"Text corpus not found: expected a text file (plain or .gz) at {missing}. ")
    assert "data.path=null" in message and "gensim" in message and INSTALL in message


# --- the configs and the command line's job -------------------------------------------------------


def test_configs_point_the_same_modules_at_a_users_files(tmp_path):
    digits_file = write_digits(tmp_path / "digits.csv", digit_rows(20))
    text_file = tmp_path / "corpus.txt"
    text_file.write_text(CORPUS)
    digits = build_from_config(compose_config(["data=digits", f"data.path={digits_file}", "paths.output_dir=x"]).data)
    text = build_from_config(compose_config(["data=text", f"data.path={text_file}", "paths.output_dir=x"]).data)
    assert isinstance(digits, Digits) and digits.path == digits_file and len(digits.dataset("val")) == 4
    assert isinstance(text, TextFile) and text.path == text_file and text.seq_len == 64
    assert isinstance(build_datamodule("digits", path=str(digits_file)), Digits)


@pytest.fixture
def leaves_no_process_group():
    """A 1-process job under the ssfusion strategy initializes a gloo group in this process, and
    Lightning leaves it: later tests in this process must find none (tests/workloads.py reads it)."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("data", ["digits", "text"])
def test_a_job_trains_on_a_users_file(tmp_path, data, leaves_no_process_group):
    """The command line's job (1 process, the ssfusion strategy) on a file of the user's."""
    from ssfusion_lightning.train import run

    if data == "digits":
        path = write_digits(tmp_path / "digits.csv.gz", digit_rows(40))
        job, metric = ["model=resnet18"], "val/acc"
    else:
        path = tmp_path / "corpus.txt"
        path.write_text(CORPUS * 4)
        job, metric = ["model=gpt2", "data.seq_len=16"], "val/ppl"
    quiet = ["logger=none", "callbacks=none", "trainer.enable_progress_bar=false", "trainer.enable_checkpointing=false"]
    steps = ["trainer=cpu", "trainer.max_steps=2", "trainer.limit_train_batches=2"]
    output = f"paths.output_dir={tmp_path / 'out'}"
    cfg = compose_config([f"data={data}", f"data.path={path}", "data.batch_size=4", *job, *steps, *quiet, output])
    results = run(cfg)
    assert results["status"] == "completed" and results["global_step"] == 2
    assert metric in results["final_metrics"]


# --- the packaged files (the realdata extra) ----------------------------------------------------


def test_scikit_learns_digits():
    pytest.importorskip("sklearn")
    dm = Digits()
    assert dm.path.name == "digits.csv.gz" and "sklearn" in dm.path.parts
    train, val = dm.dataset("train"), dm.dataset("val")
    assert (len(train), len(val)) == (1438, 359)
    images, labels = items(val)
    assert 0.0 == images.min() and images.max() == 1.0
    assert sorted(labels.unique().tolist()) == list(range(10))


def test_gensims_lee_corpus():
    pytest.importorskip("gensim")
    dm = TextFile()
    assert dm.path.name == "lee_background.cor"
    train = dm.dataset("train")
    assert len(train) * 64 > 300_000
    text = bytes(train[0].tolist()).decode("utf-8")
    assert text.startswith("Hundreds of people have been forced to vacate their homes")
