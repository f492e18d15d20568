"""Where the plan types lived before ``ssfusion_lightning/vocabulary.py``: checkpoints in engine
state format 0 pickled them under this module's name, and still load through it."""

from ssfusion_lightning.vocabulary import Buffer, Plan, Slot

__all__ = ["Buffer", "Plan", "Slot"]
