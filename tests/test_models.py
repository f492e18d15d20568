"""Models: every size builds, paper sizes match published parameter counts (on the meta device),
tiny sizes train on CPU, and the Lightning tasks fit, validate and test."""

from __future__ import annotations

import math
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from ssfusion_lightning.data import SyntheticImages, SyntheticTokens
from ssfusion_lightning.models import (
    ImageClassifier,
    LanguageModel,
    available_models,
    available_sizes,
    build_model,
)
from ssfusion_lightning.models.tasks import build_lr_schedule, build_optimizer

IMAGE_MODELS = ("resnet18", "resnet50", "resnet152", "vgg16", "vgg19", "vit")
TOKEN_MODELS = ("gpt2", "bert", "lstm")

# Published parameter counts of the paper sizes (ImageNet-1k heads at 224px; GPT-2 and BERT with tied heads).
PAPER_COUNTS = {
    ("resnet18", "imagenet"): 11.69e6,
    ("resnet50", "imagenet"): 25.56e6,
    ("resnet152", "imagenet"): 60.19e6,
    ("vgg16", "imagenet"): 138.36e6,
    ("vgg19", "imagenet"): 143.67e6,
    ("vit", "base"): 86.6e6,
    ("vit", "large"): 304.3e6,
    ("gpt2", "small"): 124.4e6,
    ("gpt2", "medium"): 354.8e6,
    ("gpt2", "large"): 774.0e6,
    ("bert", "base"): 110e6,
    ("bert", "large"): 336e6,
}


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def all_sizes() -> list[tuple[str, str]]:
    return [(name, size) for name in available_models() for size in available_sizes(name)]


def test_registry_lists_every_model():
    assert sorted(available_models()) == sorted(IMAGE_MODELS + TOKEN_MODELS)
    assert available_sizes("gpt2") == ["tiny", "small", "medium", "large"]
    assert available_sizes("vit") == ["tiny", "small", "base", "large"]
    assert available_sizes("bert") == ["tiny", "base", "large"]
    assert all(available_sizes(name)[0] == "tiny" for name in available_models())


@pytest.mark.parametrize(("name", "size"), all_sizes(), ids=lambda value: str(value))
def test_every_size_builds_on_meta(name, size):
    with torch.device("meta"):
        model = build_model(name, size)
    assert count(model) > 0
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize(("name", "size"), sorted(PAPER_COUNTS), ids=lambda value: str(value))
def test_paper_parameter_counts(name, size):
    with torch.device("meta"):
        model = build_model(name, size)
    assert count(model) == pytest.approx(PAPER_COUNTS[name, size], rel=0.02)


# --- reference layouts: tensor count and every tensor's shape, in parameter order ------------------
# Fusion plans depend on the tensor count and shapes (the layer-wise and selective policies, ADTopk's
# rows), not only on the element count, so every size above tiny is compared, tensor by tensor, with
# the layout of its reference implementation, written here from the reference's configuration.
Shapes = list[tuple[int, ...]]


def _linear(out_features: int, in_features: int) -> Shapes:
    return [(out_features, in_features), (out_features,)]


def _norm(dim: int) -> Shapes:  # LayerNorm or BatchNorm: weight and bias
    return [(dim,), (dim,)]


def bert_reference(dim: int, depth: int, vocab: int = 30522, positions: int = 512, types: int = 2) -> Shapes:
    """Hugging Face BertForMaskedLM without the pooler, in named_parameters order:
    embeddings (word, position, token_type, LayerNorm) = 5; per layer query, key, value (weight and
    bias each) = 6, attention.output.dense + LayerNorm = 4, intermediate.dense = 2, output.dense +
    LayerNorm = 4, so 16; cls.predictions bias, transform.dense, transform.LayerNorm = 5 (the decoder
    weight is the word embedding, its bias is cls.predictions.bias). 5 + 16 * depth + 5 tensors."""
    ff = 4 * dim
    embeddings = [(vocab, dim), (positions, dim), (types, dim), *_norm(dim)]
    layer = [*_linear(dim, dim) * 3, *_linear(dim, dim), *_norm(dim), *_linear(ff, dim), *_linear(dim, ff), *_norm(dim)]
    head = [(vocab,), *_linear(dim, dim), *_norm(dim)]
    return embeddings + layer * depth + head


def gpt2_reference(dim: int, depth: int, vocab: int = 50257, positions: int = 1024) -> Shapes:
    """Hugging Face GPT2LMHeadModel (lm_head tied to wte): wte, wpe; per block ln_1, attn.c_attn (fused
    query/key/value, as in OpenAI's release), attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj = 12; ln_f.
    4 + 12 * depth tensors. Shapes in nn.Linear's (out, in) orientation: HF's Conv1D stores the
    same matrices transposed, (in, out)."""
    block = [*_norm(dim), *_linear(3 * dim, dim), *_linear(dim, dim), *_norm(dim), *_linear(4 * dim, dim), *_linear(dim, 4 * dim)]
    return [(vocab, dim), (positions, dim), *block * depth, *_norm(dim)]


def vit_reference(dim: int, depth: int, image: int = 224, patch: int = 16, classes: int = 1000) -> Shapes:
    """timm's vit_*_patch16_224 (torchvision's vit_*_16 has the same tensors): cls_token, pos_embed,
    patch_embed.proj; per block norm1, attn.qkv (fused), attn.proj, norm2, mlp.fc1, mlp.fc2 = 12;
    norm, head. 8 + 12 * depth tensors."""
    tokens = (image // patch) ** 2 + 1
    block = [*_norm(dim), *_linear(3 * dim, dim), *_linear(dim, dim), *_norm(dim), *_linear(4 * dim, dim), *_linear(dim, 4 * dim)]
    return [(1, 1, dim), (1, tokens, dim), (dim, 3, patch, patch), (dim,), *block * depth, *_norm(dim), *_linear(classes, dim)]


def resnet_reference(bottleneck: bool, layers: tuple[int, ...], stem: str, classes: int) -> Shapes:
    """torchvision's resnet18/50/152 (v1.5; ImageNet stem: 7x7 conv1) or, with the CIFAR stem (3x3
    conv1, no max-pool), the usual CIFAR ResNet (kuangliu/pytorch-cifar) with the same tensors:
    conv1, bn1; per block its convolutions, each followed by a BatchNorm, then a 1x1 conv + BatchNorm
    shortcut where the shape changes; fc. resnet18: 3 + 8 * 6 + 3 * 3 + 2 = 62; resnet50:
    3 + 16 * 9 + 4 * 3 + 2 = 161; resnet152: 3 + 50 * 9 + 4 * 3 + 2 = 467."""
    kernel = 7 if stem == "imagenet" else 3
    shapes = [(64, 3, kernel, kernel), *_norm(64)]
    expansion = 4 if bottleneck else 1
    channels_in = 64
    for index, depth in enumerate(layers):
        width = 64 * 2**index
        for position in range(depth):
            stride = 2 if index > 0 and position == 0 else 1
            if bottleneck:
                shapes += [(width, channels_in, 1, 1), *_norm(width), (width, width, 3, 3), *_norm(width)]
                shapes += [(4 * width, width, 1, 1), *_norm(4 * width)]
            else:
                shapes += [(width, channels_in, 3, 3), *_norm(width), (width, width, 3, 3), *_norm(width)]
            if stride != 1 or channels_in != width * expansion:
                shapes += [(width * expansion, channels_in, 1, 1), *_norm(width * expansion)]
            channels_in = width * expansion
    return shapes + _linear(classes, channels_in)


VGG16_CONVS = (64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512)
VGG19_CONVS = (64, 64, 128, 128, 256, 256, 256, 256, 512, 512, 512, 512, 512, 512, 512, 512)


def vgg_reference(convs: tuple[int, ...], imagenet: bool) -> Shapes:
    """ImageNet: torchvision's vgg16/vgg19, every 3x3 conv with its bias, then the 25088-4096-4096-1000
    classifier: 2 * convs + 6 tensors (vgg16 32, vgg19 38). CIFAR: the usual CIFAR VGG
    (kuangliu/pytorch-cifar; torchvision's vgg*_bn features): conv (weight, bias) + BatchNorm per
    conv, one linear layer: 4 * convs + 2 tensors (vgg16 54, vgg19 66)."""
    shapes: Shapes = []
    channels = 3
    for out in convs:
        shapes += [(out, channels, 3, 3), (out,)] + ([] if imagenet else _norm(out))
        channels = out
    if imagenet:
        return shapes + _linear(4096, 512 * 7 * 7) + _linear(4096, 4096) + _linear(1000, 4096)
    return shapes + _linear(10, 512)


def lstm_reference(dim: int, vocab: int = 33278, layers: int = 2) -> Shapes:
    """PyTorch's word_language_model RNNModel (LSTM, Zaremba et al. sizes, WikiText-2 vocabulary):
    encoder; per layer weight_ih, weight_hh, bias_ih, bias_hh (gates stacked: 4 * hidden rows);
    decoder. 1 + 4 * layers + 2 = 11 tensors."""
    shapes = [(vocab, dim)]
    for _ in range(layers):
        shapes += [(4 * dim, dim), (4 * dim, dim), (4 * dim,), (4 * dim,)]
    return shapes + _linear(vocab, dim)


# (name, size) -> (reference layout, the reference's tensor count as published/derived above)
REFERENCE_LAYOUTS: dict[tuple[str, str], tuple[Shapes, int]] = {
    ("bert", "base"): (bert_reference(768, 12), 202),
    ("bert", "large"): (bert_reference(1024, 24), 394),
    ("gpt2", "small"): (gpt2_reference(768, 12), 148),
    ("gpt2", "medium"): (gpt2_reference(1024, 24), 292),
    ("gpt2", "large"): (gpt2_reference(1280, 36), 436),
    ("vit", "small"): (vit_reference(384, 12), 152),
    ("vit", "base"): (vit_reference(768, 12), 152),
    ("vit", "large"): (vit_reference(1024, 24), 296),
    ("resnet18", "imagenet"): (resnet_reference(False, (2, 2, 2, 2), "imagenet", 1000), 62),
    ("resnet18", "cifar"): (resnet_reference(False, (2, 2, 2, 2), "cifar", 10), 62),
    ("resnet50", "imagenet"): (resnet_reference(True, (3, 4, 6, 3), "imagenet", 1000), 161),
    ("resnet50", "cifar"): (resnet_reference(True, (3, 4, 6, 3), "cifar", 10), 161),
    ("resnet152", "imagenet"): (resnet_reference(True, (3, 8, 36, 3), "imagenet", 1000), 467),
    ("resnet152", "cifar"): (resnet_reference(True, (3, 8, 36, 3), "cifar", 10), 467),
    ("vgg16", "imagenet"): (vgg_reference(VGG16_CONVS, True), 32),
    ("vgg16", "cifar"): (vgg_reference(VGG16_CONVS, False), 54),
    ("vgg19", "imagenet"): (vgg_reference(VGG19_CONVS, True), 38),
    ("vgg19", "cifar"): (vgg_reference(VGG19_CONVS, False), 66),
    ("lstm", "medium"): (lstm_reference(650), 11),
    ("lstm", "large"): (lstm_reference(1500), 11),
}


def test_every_size_above_tiny_has_a_reference_layout():
    assert {(name, size) for name, size in all_sizes() if size != "tiny"} == set(REFERENCE_LAYOUTS)


@pytest.mark.parametrize(("name", "size"), sorted(REFERENCE_LAYOUTS), ids=lambda value: str(value))
def test_paper_size_layout_matches_the_reference(name, size):
    reference, reference_count = REFERENCE_LAYOUTS[name, size]
    assert len(reference) == reference_count  # the formula above agrees with the stated count
    with torch.device("meta"):
        model = build_model(name, size)
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert len(shapes) == reference_count, f"{name}-{size}: {len(shapes)} tensors, the reference has {reference_count}"
    mismatches = [(i, got, want) for i, (got, want) in enumerate(zip(shapes, reference)) if got != want]
    assert not mismatches, f"{name}-{size}: (position, shape, reference shape) {mismatches[:5]}"


def test_bert_projects_query_key_value_separately_and_ties_the_decoder():
    with torch.device("meta"):
        model = build_model("bert", "large")
    names = [n for n, _ in model.named_parameters()]
    layer = [n.removeprefix("blocks.0.") for n in names if n.startswith("blocks.0.")]
    assert layer[:6] == [f"attention.{p}.{t}" for p in ("query", "key", "value") for t in ("weight", "bias")]
    assert not any("qkv" in n for n in names)
    # the decoder is the word embedding: no (vocab, dim) tensor besides it
    assert [tuple(p.shape) for p in model.parameters()].count((30522, 1024)) == 1


def test_lstm_paper_size():
    with torch.device("meta"):
        model = build_model("lstm", "large")
    assert model.embedding.num_embeddings == 33278 and model.embedding.embedding_dim == 1500
    assert model.lstm.num_layers == 2 and model.lstm.hidden_size == 1500
    # The embedding table and the decoder hold ~3/4 of the parameters: the sparse-gradient case.
    assert model.embedding.weight.numel() / count(model) > 0.35


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_tiny_image_models_train_on_cpu(name):
    torch.manual_seed(0)
    model = build_model(name, "tiny")
    images, labels = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    logits = model(images)
    assert logits.shape == (4, 10)
    F.cross_entropy(logits, labels).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("name", TOKEN_MODELS)
def test_tiny_token_models_train_on_cpu(name):
    torch.manual_seed(0)
    model = build_model(name, "tiny")
    tokens = torch.randint(0, 256, (4, 64))
    logits = model(tokens)
    assert logits.shape == (4, 64, 256)
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_overrides_replace_size_arguments():
    model = build_model("resnet18", "tiny", num_classes=7, in_channels=1)
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 7)
    model = build_model("vit", "tiny", image_size=16, patch_size=8, num_classes=3)
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 3)
    model = build_model("gpt2", "tiny", vocab_size=100)
    assert model(torch.randint(0, 100, (1, 5))).shape == (1, 5, 100)


def test_imagenet_stems_downsample():
    resnet = build_model("resnet50", "tiny", stem="imagenet")
    assert resnet(torch.randn(1, 3, 64, 64)).shape == (1, 10)
    vgg = build_model("vgg16", "tiny", classifier_dim=32)
    assert vgg(torch.randn(1, 3, 32, 32)).shape == (1, 10)


def test_factory_errors_name_the_valid_choices():
    with pytest.raises(ValueError, match="unknown model 'resnet19'; valid choices: bert, gpt2, lstm, resnet152"):
        build_model("resnet19")
    with pytest.raises(ValueError, match="unknown size 'huge' for model 'gpt2'; valid choices: tiny, small, medium"):
        build_model("gpt2", "huge")
    with pytest.raises(ValueError, match="unknown option.*depthh.*'vit'.*patch_size"):
        build_model("vit", "tiny", depthh=3)


def test_gpt2_is_causal_and_tied():
    torch.manual_seed(0)
    model = build_model("gpt2", "tiny").eval()
    tokens = torch.randint(0, 256, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (tokens[0, 10] + 1) % 256
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])
    assert count(model) == count(build_model("gpt2", "tiny", vocab_size=257)) - 64  # one tied row per token
    with pytest.raises(ValueError, match="exceeds max_positions 128"):
        model(torch.zeros(1, 129, dtype=torch.long))


def test_bert_is_bidirectional():
    torch.manual_seed(0)
    model = build_model("bert", "tiny").eval()
    tokens = torch.randint(0, 256, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (tokens[0, 10] + 1) % 256
    with torch.no_grad():
        assert not torch.allclose(model(tokens)[:, :10], model(changed)[:, :10])


def test_lstm_tied_weights():
    model = build_model("lstm", "tiny", tie_weights=True)
    assert model.decoder.weight is model.embedding.weight
    with pytest.raises(ValueError, match="tie_weights"):
        build_model("lstm", "tiny", embedding_dim=16, tie_weights=True)


def test_lstm_embedding_gradient_is_row_sparse():
    model = build_model("lstm", "tiny")
    tokens = torch.randint(0, 10, (2, 8))
    model(tokens).sum().backward()
    touched = model.embedding.weight.grad.abs().sum(dim=1) > 0
    assert set(touched.nonzero().flatten().tolist()) <= set(tokens.flatten().tolist())


# --- optimization ---------------------------------------------------------------------------------


def test_optimizers_leave_norms_and_biases_undecayed():
    model = build_model("resnet18", "tiny")
    for name in ("sgd", "adamw"):
        optimizer = build_optimizer(model, name, lr=0.1, weight_decay=1e-4)
        decayed, undecayed = optimizer.param_groups
        assert decayed["weight_decay"] == 1e-4 and undecayed["weight_decay"] == 0.0
        assert all(p.ndim == 1 for p in undecayed["params"])
        assert len(decayed["params"]) + len(undecayed["params"]) == len(list(model.parameters()))
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'; valid choices: sgd, adamw"):
        build_optimizer(model, "lamb", lr=0.1)


def test_adamw_runs_fused_where_torch_has_the_kernel():
    assert build_optimizer(torch.nn.Linear(4, 3), "adamw", lr=0.1).defaults["fused"] is True
    assert build_optimizer(torch.nn.Linear(4, 3), "adamw", lr=0.1, fused=False).defaults["fused"] is False
    assert build_optimizer(torch.nn.Linear(4, 3, device="meta"), "adamw", lr=0.1).defaults["fused"] is False


@pytest.mark.parametrize(
    ("precision", "clip", "fused"), [("32-true", 1.0, True), ("16-mixed", None, True), ("16-mixed", 1.0, False)]
)
def test_task_unfuses_adamw_only_where_lightning_must_clip_scaled_gradients(precision, clip, fused):
    task = ImageClassifier(torch.nn.Linear(4, 3), num_classes=3, optimizer="adamw")
    task._trainer = SimpleNamespace(precision=precision, gradient_clip_val=clip, estimated_stepping_batches=10)
    assert task.configure_optimizers()["optimizer"].defaults["fused"] is fused


def test_fused_adamw_takes_the_unfused_step_on_sparse_gradients():
    """The fused kernel is a drop-in: the same parameters after steps on gradients that are
    mostly exact zeros (the case it is chosen for)."""
    torch.manual_seed(0)
    start = torch.randn(4096)
    grads = [torch.zeros(4096).index_fill_(0, torch.randint(0, 4096, (40,)), 1.0) * torch.randn(4096) for _ in range(5)]
    params = []
    for fused in (False, True):
        param = torch.nn.Parameter(start.clone())
        optimizer = torch.optim.AdamW([param], lr=1e-2, fused=fused)
        for grad in grads:
            param.grad = grad.clone()
            optimizer.step()
        params.append(param.detach())
    torch.testing.assert_close(params[1], params[0], rtol=1e-6, atol=1e-7)
    assert not torch.equal(params[0], start)


def test_lr_schedules():
    parameter = torch.nn.Parameter(torch.zeros(1))

    def rates(name: str) -> list[float]:
        optimizer = torch.optim.SGD([parameter], lr=1.0)
        schedule = build_lr_schedule(optimizer, name, total_steps=10, warmup_steps=2)
        values = []
        for _ in range(10):
            values.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            schedule.step()
        return values

    assert rates("constant") == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    cosine = rates("cosine")
    assert cosine[:3] == [0.5, 1.0, 1.0] and cosine[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 7 / 8)))
    assert all(a >= b for a, b in zip(cosine[1:], cosine[2:]))
    with pytest.raises(ValueError, match="unknown lr schedule 'step'"):
        build_lr_schedule(torch.optim.SGD([parameter], lr=1.0), "step", total_steps=10)


def test_task_rejects_unknown_optimizer():
    with pytest.raises(ValueError, match="unknown optimizer 'adam'"):
        ImageClassifier(build_model("vit", "tiny"), num_classes=10, optimizer="adam")


# --- Lightning tasks ------------------------------------------------------------------------------


def fit_and_test(task: L.LightningModule, datamodule: L.LightningDataModule) -> dict[str, float]:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=2,
        limit_test_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(task, datamodule=datamodule)
    metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
    metrics.update(trainer.test(task, datamodule=datamodule, verbose=False)[0])
    return metrics


def test_image_classifier_fits():
    L.seed_everything(0, verbose=False)
    data = SyntheticImages(train_samples=64, val_samples=16, test_samples=16, batch_size=8)
    task = ImageClassifier(
        build_model("resnet18", "tiny"), num_classes=data.num_classes, lr=0.05, lr_schedule="cosine", warmup_steps=1
    )
    metrics = fit_and_test(task, data)
    assert {"train/loss", "train/acc", "val/loss", "val/acc", "test/loss", "test/acc"} <= set(metrics)
    assert 0.0 <= metrics["val/acc"] <= 1.0 and math.isfinite(metrics["train/loss"])
    assert task.hparams["lr"] == 0.05 and "model" not in task.hparams


class _RecordingModel(torch.nn.Module):
    """Passes through to ``inner`` and keeps the logits of training forwards."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.logits = inner, []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        out = self.inner(images)
        if self.training:
            self.logits.append(out.detach().clone())
        return out


def test_a_model_of_another_class_count_is_named():
    task = ImageClassifier(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 7)), num_classes=10)
    with pytest.raises(ValueError, match=r"shape \(2, 7\).*num_classes=10.*\(batch, 10\)"):
        task.training_step((torch.randn(2, 1, 4, 4), torch.zeros(2, dtype=torch.long)), 0)


def test_train_accuracy_is_each_epochs_own():
    """train/acc, logged at the epoch's end, is the accuracy of that epoch's training forwards only."""
    L.seed_everything(0, verbose=False)
    data = SyntheticImages(train_samples=48, val_samples=8, test_samples=8, batch_size=8)
    model = _RecordingModel(build_model("resnet18", "tiny"))
    task = ImageClassifier(model, num_classes=data.num_classes, lr=0.05)
    seen = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.append((model.logits[-1].argmax(1) == batch[1]).float())

    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, limit_val_batches=0, logger=False, callbacks=[Record()],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(task, datamodule=data)
    assert len(seen) == 12
    last_epoch = torch.cat(seen[6:]).mean().item()
    assert trainer.callback_metrics["train/acc"].item() == pytest.approx(last_epoch, abs=1e-6)
    assert torch.cat(seen[:6]).mean().item() != pytest.approx(last_epoch, abs=1e-6)  # so the first epoch is not in it


@pytest.mark.parametrize(("name", "objective"), [("gpt2", "causal"), ("lstm", "causal"), ("bert", "mlm")])
def test_language_model_fits(name, objective):
    L.seed_everything(0, verbose=False)
    data = SyntheticTokens(
        vocab_size=64, seq_len=16, objective=objective, train_samples=64, val_samples=16, test_samples=16, batch_size=8
    )
    task = LanguageModel(build_model(name, "tiny", vocab_size=data.vocab_size), lr=1e-3)
    metrics = fit_and_test(task, data)
    assert {"train/loss", "val/loss", "val/ppl", "test/loss", "test/ppl"} <= set(metrics)
    # An untrained model guesses near-uniformly: perplexity near the vocabulary size, and exp(loss).
    assert 1.0 < metrics["val/ppl"] < 4 * data.vocab_size
    assert metrics["test/ppl"] == pytest.approx(math.exp(metrics["test/loss"]), rel=0.05)
