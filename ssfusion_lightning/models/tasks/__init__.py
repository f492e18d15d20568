"""LightningModule tasks wrapping the plain models."""

from ssfusion_lightning.models.tasks.image import ImageClassifier
from ssfusion_lightning.models.tasks.language import LanguageModel
from ssfusion_lightning.models.tasks.optim import LR_SCHEDULES, OPTIMIZERS, build_lr_schedule, build_optimizer

__all__ = ["LR_SCHEDULES", "OPTIMIZERS", "ImageClassifier", "LanguageModel", "build_lr_schedule", "build_optimizer"]
