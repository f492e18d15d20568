"""DataModules: each real format read from tiny files written here, synthetic data determinism and learnability."""

from __future__ import annotations

import gzip
import math
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from torch import nn
from torch.utils.data import RandomSampler, SequentialSampler

from ssfusion_lightning.data import (
    CIFAR10,
    CIFAR100,
    IGNORE_INDEX,
    MNIST,
    ImageFolder,
    MLMCollator,
    SyntheticImages,
    SyntheticTokens,
    WikiText2,
    WikiText103,
    available_datasets,
    build_datamodule,
    causal_collate,
)
from ssfusion_lightning.data.mnist import read_idx
from ssfusion_lightning.data.sequences import StreamChunks
from ssfusion_lightning.data.transforms import CIFAR10_STATS, center_crop, random_resized_crop

# --- writers for each real format ----------------------------------------------------------------


def write_cifar_batch(path: Path, count: int, label_key: bytes, seed: int) -> tuple[np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(count, 3 * 32 * 32), dtype=np.uint8)
    labels = rng.integers(0, 10, size=count).tolist()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        pickle.dump({b"data": data, label_key: labels, b"batch_label": b"test"}, handle)
    return data, labels


def write_cifar10(root: Path, per_batch: int = 3) -> tuple[np.ndarray, list[int]]:
    folder = root / "cifar-10-batches-py"
    for index in range(1, 6):
        write_cifar_batch(folder / f"data_batch_{index}", per_batch, b"labels", seed=index)
    return write_cifar_batch(folder / "test_batch", per_batch, b"labels", seed=0)


def write_idx(path: Path, array: np.ndarray, compress: bool) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        payload = gzip.compress(payload)
    path.write_bytes(payload)


def write_mnist(root: Path, compress: bool, train: int = 6, test: int = 4) -> np.ndarray:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for prefix, count in (("train", train), ("t10k", test)):
        images = rng.integers(0, 256, size=(count, 28, 28), dtype=np.uint8)
        labels = np.arange(count) % 10
        write_idx(root / f"{prefix}-images-idx3-ubyte", images, compress)
        write_idx(root / f"{prefix}-labels-idx1-ubyte", labels, compress)
    return labels


def write_image_folder(root: Path, classes: tuple[str, ...] = ("cat", "dog"), per_class: int = 3) -> None:
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for name in classes:
            folder = root / split / name
            folder.mkdir(parents=True)
            for index in range(per_class):
                height, width = 24 + 8 * index, 40 - 4 * index
                pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
                extension = ".png" if index % 2 else ".JPG"
                Image.fromarray(pixels).save(folder / f"{index}{extension}", format="PNG" if index % 2 else "JPEG")
        (root / split / "notes.txt").write_text("not a class")


WIKI_TRAIN = " = Heading = \n the cat sat on the mat . \n the dog sat . \n"
WIKI_VALID = " the cat ran . \n"
WIKI_TEST = " my dog sat on the cat . \n"


def write_wikitext(root: Path, folder: str = "wikitext-2-raw", suffix: str = ".raw") -> None:
    directory = root / folder
    directory.mkdir(parents=True)
    for name, text in (("train", WIKI_TRAIN * 4), ("valid", WIKI_VALID * 4), ("test", WIKI_TEST * 4)):
        (directory / f"wiki.{name}{suffix}").write_text(text, encoding="utf-8")


def first_batch(loader):
    return next(iter(loader))


# --- CIFAR -----------------------------------------------------------------------------------------


def test_cifar10_reads_pickle_batches(tmp_path):
    test_data, test_labels = write_cifar10(tmp_path)
    dm = CIFAR10(root=str(tmp_path), batch_size=4)
    dm.setup("fit")
    assert dm.num_classes == 10 and dm.image_shape == (3, 32, 32)
    assert len(dm.dataset("train")) == 15 and len(dm.dataset("val")) == 3

    images, labels = first_batch(dm.train_dataloader())
    assert images.shape == (4, 3, 32, 32) and images.dtype == torch.float32
    assert labels.shape == (4,) and labels.dtype == torch.int64

    images, labels = first_batch(dm.val_dataloader())
    assert labels.tolist() == test_labels
    raw = torch.from_numpy(test_data[0].reshape(3, 32, 32)).float() / 255
    mean, std = (torch.tensor(s).view(3, 1, 1) for s in CIFAR10_STATS)
    torch.testing.assert_close(images[0], (raw - mean) / std)


def test_cifar10_accepts_the_batches_folder_itself(tmp_path):
    write_cifar10(tmp_path)
    dm = CIFAR10(root=str(tmp_path / "cifar-10-batches-py"), batch_size=2)
    assert len(dm.dataset("test")) == 3


def test_cifar10_augmentation_only_in_training(tmp_path):
    write_cifar10(tmp_path)
    dm = CIFAR10(root=str(tmp_path), batch_size=2)
    train, val = dm.dataset("train"), dm.dataset("val")
    assert train.transform.augment and not val.transform.augment
    torch.manual_seed(0)
    views = [train[0][0] for _ in range(8)]
    assert any(not torch.equal(views[0], view) for view in views[1:])


def test_cifar100_uses_fine_labels(tmp_path):
    folder = tmp_path / "cifar-100-python"
    write_cifar_batch(folder / "train", 5, b"fine_labels", seed=1)
    _, labels = write_cifar_batch(folder / "test", 4, b"fine_labels", seed=2)
    dm = CIFAR100(root=str(tmp_path), batch_size=4)
    assert dm.num_classes == 100
    images, got = first_batch(dm.test_dataloader())
    assert images.shape == (4, 3, 32, 32) and got.tolist() == labels


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        (CIFAR10, ["cifar-10-batches-py/data_batch_1", "data_batch_5", "test_batch"]),
        (CIFAR100, ["cifar-100-python/train", "test"]),
    ],
)
def test_cifar_missing_names_expected_files(tmp_path, module, expected):
    with pytest.raises(FileNotFoundError) as error:
        module(root=str(tmp_path))
    message = str(error.value)
    assert "not found" in message and f"data.root={tmp_path}" not in message  # no echo of the path given
    for name in expected:
        assert str(tmp_path / name) in message or name in message


# --- MNIST -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gz"])
def test_mnist_reads_idx_files(tmp_path, compress):
    write_mnist(tmp_path, compress)
    dm = MNIST(root=str(tmp_path), batch_size=3)
    assert dm.num_classes == 10 and dm.image_shape == (1, 28, 28)
    images, labels = first_batch(dm.train_dataloader())
    assert images.shape == (3, 1, 28, 28) and images.dtype == torch.float32
    assert labels.dtype == torch.int64
    assert len(dm.dataset("train")) == 6
    _, labels = first_batch(dm.test_dataloader())
    assert labels.tolist() == [0, 1, 2]


def test_mnist_torchvision_layout(tmp_path):
    write_mnist(tmp_path / "MNIST" / "raw", compress=True)
    assert len(MNIST(root=str(tmp_path)).dataset("test")) == 4


def test_mnist_missing_names_expected_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="MNIST not found") as error:
        MNIST(root=str(tmp_path))
    assert str(tmp_path / "train-images-idx3-ubyte") in str(error.value)
    assert "t10k-labels-idx1-ubyte" in str(error.value)


def test_read_idx_rejects_bad_files(tmp_path):
    path = tmp_path / "bad"
    path.write_bytes(b"\x00\x00\x0d\x01\x00\x00\x00\x02ab")  # float32 data type
    with pytest.raises(ValueError, match="unsigned bytes"):
        read_idx(path)
    path.write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x05ab")  # declares 5 bytes, holds 2
    with pytest.raises(ValueError, match="declares"):
        read_idx(path)


# --- image folder ----------------------------------------------------------------------------------


def test_image_folder_decodes_and_resizes(tmp_path):
    write_image_folder(tmp_path)
    dm = ImageFolder(root=str(tmp_path), image_size=16, batch_size=4)
    assert dm.classes == ["cat", "dog"] and dm.num_classes == 2 and dm.image_shape == (3, 16, 16)
    dm.setup("fit")
    assert len(dm.dataset("train")) == 6
    images, labels = first_batch(dm.train_dataloader())
    assert images.shape == (4, 3, 16, 16) and images.dtype == torch.float32
    assert labels.dtype == torch.int64
    images, labels = first_batch(dm.val_dataloader())
    assert labels.tolist() == [0, 0, 0, 1]
    # Evaluation crops are deterministic.
    torch.testing.assert_close(dm.dataset("val")[0][0], images[0])


def test_image_folder_missing_names_layout(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        ImageFolder(root=str(tmp_path))
    assert f"{tmp_path}/train/<class>/<image>" in str(error.value)
    assert f"{tmp_path}/val/<class>/<image>" in str(error.value)


def test_crops_produce_requested_size():
    image = torch.randint(0, 256, (3, 30, 50), dtype=torch.uint8)
    assert random_resized_crop(image, 24).shape == (3, 24, 24)
    assert center_crop(image, 24).shape == (3, 24, 24)
    assert random_resized_crop(torch.zeros(3, 1, 200, dtype=torch.uint8), 8).shape == (3, 8, 8)


# --- WikiText ------------------------------------------------------------------------------------


def test_wikitext_word_level_causal(tmp_path):
    write_wikitext(tmp_path)
    dm = WikiText2(root=str(tmp_path), seq_len=8, batch_size=2)
    assert dm.vocab[:2] == ["<eos>", "<unk>"]
    assert dm.vocab[2:6] == ["=", "Heading", "the", "cat"]
    assert dm.vocab_size == len(set(WIKI_TRAIN.split())) + 2 and dm.mask_token_id is None
    dm.setup("fit")
    train = dm.dataset("train")
    stream_length = (len(WIKI_TRAIN.split()) + 3) * 4  # words plus one <eos> per line
    assert len(train) == (stream_length - 9) // 8 + 1

    inputs, targets = first_batch(dm.val_dataloader())
    assert inputs.shape == targets.shape == (2, 8)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(inputs[1, 0], targets[0, -1])  # consecutive chunks continue the stream
    words = [dm.vocab[i] for i in inputs[0].tolist()]
    assert words == ["the", "cat", "<unk>", ".", "<eos>", "the", "cat", "<unk>"]  # "ran" is not in train


def test_wikitext_mlm_masks_with_last_id(tmp_path):
    write_wikitext(tmp_path)
    dm = WikiText2(root=str(tmp_path), seq_len=8, batch_size=4, objective="mlm")
    assert dm.vocab[-1] == "<mask>" and dm.mask_token_id == dm.vocab_size - 1
    torch.manual_seed(0)
    inputs, targets = first_batch(dm.train_dataloader())
    assert inputs.shape == targets.shape == (4, 8)
    selected = targets != IGNORE_INDEX
    assert selected.any(dim=1).all()
    assert (inputs[~selected] != dm.mask_token_id).all()
    assert (targets[selected] < dm.mask_token_id).all()


def test_wikitext_char_level_and_tokens_release(tmp_path):
    write_wikitext(tmp_path, folder="wikitext-103", suffix=".tokens")
    dm = WikiText103(root=str(tmp_path), level="char", seq_len=16, batch_size=2)
    assert dm.vocab[0] == "<unk>" and dm.vocab[1:] == sorted(set(WIKI_TRAIN))
    inputs, targets = first_batch(dm.test_dataloader())
    assert inputs.shape == (2, 16)
    text = "".join(dm.vocab[i] for i in inputs[0].tolist())
    assert text == (WIKI_TEST * 4)[:16].replace("y", "<unk>")  # no "y" in the training text


def test_wikitext_missing_names_expected_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="WikiText-2 not found") as error:
        WikiText2(root=str(tmp_path))
    message = str(error.value)
    for name in ("wiki.train.raw", "wiki.valid.raw", "wiki.test.raw"):
        assert str(tmp_path / "wikitext-2-raw" / name) in message


def test_wikitext_rejects_unknown_level(tmp_path):
    write_wikitext(tmp_path)
    with pytest.raises(ValueError, match="'bpe'.*word, char"):
        WikiText2(root=str(tmp_path), level="bpe")


# --- sequences and masking -------------------------------------------------------------------------


def test_stream_chunks_and_causal_collate():
    chunks = StreamChunks(torch.arange(20, dtype=torch.int32), length=5, stride=4)
    assert len(chunks) == 4 and chunks[1].tolist() == [4, 5, 6, 7, 8] and chunks[1].dtype == torch.int64
    with pytest.raises(IndexError):
        chunks[4]
    inputs, targets = causal_collate([chunks[0], chunks[1]])
    assert inputs.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert targets.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(1, 6),
    length=st.integers(1, 40),
    mask_prob=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**16),
)
def test_mlm_collator_invariants(batch, length, mask_prob, seed):
    torch.manual_seed(seed)
    vocab = 50
    chunks = [torch.randint(0, vocab - 1, (length,)) for _ in range(batch)]
    tokens = torch.stack(chunks)
    inputs, targets = MLMCollator(mask_token_id=vocab - 1, mask_prob=mask_prob)(chunks)
    selected = targets != IGNORE_INDEX
    assert selected.any(dim=1).all()  # every sequence has a target
    assert torch.equal(targets[selected], tokens[selected])
    assert torch.equal(inputs[~selected], tokens[~selected])  # only selected positions change
    assert ((inputs >= 0) & (inputs < vocab)).all()


def test_mlm_collator_masking_rates():
    torch.manual_seed(0)
    chunks = [torch.randint(0, 99, (500,)) for _ in range(40)]
    inputs, targets = MLMCollator(mask_token_id=99)(chunks)
    selected = targets != IGNORE_INDEX
    assert selected.float().mean().item() == pytest.approx(0.15, abs=0.01)
    assert (inputs[selected] == 99).float().mean().item() == pytest.approx(0.8, abs=0.03)


# --- factory ---------------------------------------------------------------------------------------


def test_available_datasets():
    assert available_datasets() == sorted(
        [
            "cifar10", "cifar100", "digits", "imagenet", "mnist", "synthetic_images", "synthetic_tokens", "text",
            "wikitext2", "wikitext103",
        ]
    )


def test_build_datamodule(tmp_path):
    dm = build_datamodule("synthetic_tokens", vocab_size=32, seq_len=8)
    assert isinstance(dm, SyntheticTokens) and dm.vocab_size == 32
    with pytest.raises(ValueError, match="unknown dataset 'cifar11'; valid choices: cifar10, cifar100"):
        build_datamodule("cifar11")
    with pytest.raises(ValueError, match="unknown option.*'synthetic_images'.*num_classes"):
        build_datamodule("synthetic_images", classes=3)
    with pytest.raises(FileNotFoundError, match="CIFAR-10 not found"):
        build_datamodule("cifar10", root=str(tmp_path))


def test_loaders_leave_sampling_to_lightning():
    dm = SyntheticImages(image_size=8, train_samples=10, val_samples=4, batch_size=3, num_workers=0)
    train, val = dm.train_dataloader(), dm.val_dataloader()
    assert isinstance(train.sampler, RandomSampler) and train.drop_last and train.batch_size == 3
    assert isinstance(val.sampler, SequentialSampler) and not val.drop_last
    assert len(train) == 3 and len(val) == 2


def test_token_module_rejects_unknown_objective():
    with pytest.raises(ValueError, match="unknown objective 'prefix'; valid choices: causal, mlm"):
        SyntheticTokens(objective="prefix")


# --- synthetic data --------------------------------------------------------------------------------


def test_synthetic_images_are_seeded():
    def sample(seed: int, split: str, index: int):
        return SyntheticImages(image_size=12, channels=2, num_classes=5, seed=seed).dataset(split)[index]

    image, label = sample(3, "train", 7)
    assert image.shape == (2, 12, 12) and image.dtype == torch.float32 and 0 <= label < 5
    same_image, same_label = sample(3, "train", 7)
    assert torch.equal(image, same_image) and label == same_label
    assert not torch.equal(image, sample(4, "train", 7)[0])
    assert not torch.equal(image, sample(3, "val", 7)[0])
    assert not torch.equal(image, sample(3, "train", 8)[0])


def test_synthetic_tokens_are_seeded():
    def loader_batch(seed: int):
        dm = SyntheticTokens(vocab_size=40, seq_len=12, seed=seed, batch_size=5)
        return first_batch(dm.val_dataloader())

    inputs, targets = loader_batch(1)
    assert inputs.shape == targets.shape == (5, 12) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(inputs, loader_batch(1)[0])
    assert not torch.equal(inputs, loader_batch(2)[0])
    assert int(inputs.max()) < 40


def test_synthetic_tokens_mlm_reserves_mask_id():
    dm = SyntheticTokens(vocab_size=20, seq_len=16, objective="mlm", batch_size=8)
    assert dm.mask_token_id == 19
    sequence = dm.dataset("train")[0]
    assert sequence.shape == (16,) and int(sequence.max()) < 19


def test_synthetic_images_are_learnable():
    torch.manual_seed(0)
    dm = SyntheticImages(image_size=16, train_samples=4096, val_samples=512, batch_size=32)
    net = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, dm.num_classes),
    )
    optimizer = torch.optim.Adam(net.parameters(), lr=3e-3)
    for step, (images, labels) in enumerate(dm.train_dataloader()):
        loss = F.cross_entropy(net(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 120:
            break
    with torch.no_grad():
        hits = [(net(images).argmax(1) == labels).float() for images, labels in dm.val_dataloader()]
    assert torch.cat(hits).mean().item() >= 0.9


@pytest.mark.parametrize("objective", ["causal", "mlm"])
def test_synthetic_tokens_are_learnable(objective):
    torch.manual_seed(0)
    vocab = 128
    dm = SyntheticTokens(vocab_size=vocab, seq_len=32, objective=objective, batch_size=32, train_samples=4096)
    # A first-order chain is learnable from the current token (causal) or from both neighbours (masked).
    causal = objective == "causal"
    embed, head = nn.Embedding(vocab, 64), nn.Linear(64 if causal else 128, vocab)
    optimizer = torch.optim.Adam([*embed.parameters(), *head.parameters()], lr=1e-2)

    def loss_of(inputs, targets):
        features = embed(inputs)
        if not causal:
            left = F.pad(features, (0, 0, 1, 0))[:, :-1]
            right = F.pad(features, (0, 0, 0, 1))[:, 1:]
            features = torch.cat([left, right], dim=-1)
        return F.cross_entropy(head(features).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)

    for step, (inputs, targets) in enumerate(dm.train_dataloader()):
        loss = loss_of(inputs, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 150:
            break
    with torch.no_grad():
        val_loss = torch.stack([loss_of(*batch) for batch in dm.val_dataloader()]).mean().item()
    assert val_loss < 0.5 * math.log(vocab)
