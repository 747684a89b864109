"""Decision Mixer: offline RL with dynamic token selection, its datasets, training and evaluation.

``from rl import DecisionTransformer, DecisionMixer`` gives the models; the rest lives in submodules
(``rl.data``, ``rl.generate``, ``rl.train``, ``rl.evaluate``, ``rl.sac``). Importing this package loads torch
and the model classes only (no environments, no files).
"""

from rl.models import DecisionMixer, DecisionTransformer, DMConfig, DTConfig

__all__ = ["DecisionTransformer", "DecisionMixer", "DTConfig", "DMConfig"]
