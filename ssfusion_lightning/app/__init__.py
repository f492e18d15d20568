"""The Hydra application behind ``ssfusion-train``: config composition, builders, callbacks, sweep summary.

``ssfusion_lightning.train.run(cfg)`` runs one job from a composed config; ``ssfusion_lightning.cli`` is
the command line around it.
"""

#: every job's results, in its output directory (written by app.callbacks, read by app.sweep)
RESULTS_FILE = "results.json"
