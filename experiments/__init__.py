"""Experiment harnesses for ssfusion_lightning (not part of the installed package)."""
