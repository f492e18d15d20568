"""Models written from scratch, each at named sizes from ``tiny`` to the paper size, and their tasks.

Importing an architecture module registers it with the model registry; this package imports them all.
"""

from ssfusion_lightning.models.bert import BertForMaskedLM
from ssfusion_lightning.models.factory import available_models, available_sizes, build_model
from ssfusion_lightning.models.gpt2 import GPT2
from ssfusion_lightning.models.lstm import LSTMLanguageModel
from ssfusion_lightning.models.resnet import ResNet
from ssfusion_lightning.models.tasks import ImageClassifier, LanguageModel
from ssfusion_lightning.models.vgg import VGG
from ssfusion_lightning.models.vit import VisionTransformer

__all__ = [
    "GPT2",
    "VGG",
    "BertForMaskedLM",
    "ImageClassifier",
    "LSTMLanguageModel",
    "LanguageModel",
    "ResNet",
    "VisionTransformer",
    "available_models",
    "available_sizes",
    "build_model",
]
