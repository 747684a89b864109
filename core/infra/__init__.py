"""The project's plumbing, beside the attention math of :mod:`core`: what CLIs, training scripts and shipped models
need but no attention layer does.

- :mod:`core.infra.fileio` — atomic writes (temp file + rename).
- :mod:`core.infra.jobs` — the batch-job runner (shards, locks, manifest, settings fingerprints, time limits).
- :mod:`core.infra.model_card` — model cards generated from the shipped weights and their provenance
  (``python -m core.infra.model_card [--check]``).
- :mod:`core.infra.distributed` — stopping and finishing ``torchrun`` training together.
- :mod:`core.infra.backbones` — vision backbones (timm, open_clip) built or loaded from local weights.
- :mod:`core.infra.device` — one ``--device auto`` / ``--dtype auto`` convention (a missing GPU: one line, exit 2).
- :mod:`core.infra.guard` — the output guard: nothing but ``ship`` writes into shipped ``weights/``; no output
  overwrites an input.

The bridge to transformers models is :mod:`core.hf`. Nothing here imports the attention modules of :mod:`core`.
"""
