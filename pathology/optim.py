"""Optimisers of the slide-model recipes: AdamW (the default) and TransMIL's published RAdam + Lookahead.

TransMIL's release trains with ``lookahead_radam`` (lr 2e-4, weight decay 1e-5, no decay on biases and other 1-D
parameters, batch size 1 with 2 accumulated steps, no learning-rate schedule): RAdam (Liu et al. 2020,
``torch.optim.RAdam`` with decoupled weight decay) wrapped in Lookahead (Zhang et al. 2019) with the timm defaults
it uses, ``alpha = 0.5`` and ``k = 6``. :class:`Lookahead` is written here from the paper's update rule.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["Lookahead", "build_optimizer", "OPTIMIZERS"]

#: Values of ``TrainConfig.optimizer``.
OPTIMIZERS = ("adamw", "radam_lookahead")


class Lookahead:
    """Lookahead around an inner optimiser: every ``k`` inner steps the slow weights move ``alpha`` of the way to the
    fast weights and the fast weights restart from them: ``φ ← φ + α (θ − φ)``, ``θ ← φ``.

    The inner optimiser's ``param_groups`` are shared (a learning-rate schedule that sets ``lr`` on this object's
    groups reaches it).

    Args:
        base: the inner ("fast") optimiser.
        alpha: slow-weight step size in (0, 1].
        k: inner steps between two slow-weight updates (>= 1).
    """

    def __init__(self, base: torch.optim.Optimizer, *, alpha: float = 0.5, k: int = 6):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha ({alpha}) must be in (0, 1]")
        if k < 1:
            raise ValueError(f"k ({k}) must be >= 1")
        self.base, self.alpha, self.k = base, float(alpha), int(k)
        self.param_groups = base.param_groups
        self.slow: dict[nn.Parameter, torch.Tensor] = {}  # the slow weights φ, by parameter
        self._steps = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.base.step(closure)
        self._steps += 1
        if self._steps % self.k == 0:
            for group in self.param_groups:
                for p in group["params"]:
                    slow = self.slow.setdefault(p, p.detach().clone())  # a parameter added late starts here
                    slow.add_(p - slow, alpha=self.alpha)
                    p.copy_(slow)
        return loss

    def remember_start(self) -> None:
        """Store the current weights as the slow weights' starting point (call before the first step)."""
        self.slow = {p: p.detach().clone() for group in self.param_groups for p in group["params"]}


def _decay_groups(params: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: biases, norms and other 1-D parameters get none (as timm's factory does)."""
    decay, no_decay = [], []
    for _, p in params:
        if p.requires_grad:
            (no_decay if p.ndim <= 1 else decay).append(p)
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]


def build_optimizer(name: str, model: nn.Module, lr: float, weight_decay: float):
    """The optimiser ``name`` (one of :data:`OPTIMIZERS`) over ``model``'s parameters.

    ``"adamw"``: AdamW with ``weight_decay`` on every parameter (this project's recipe). ``"radam_lookahead"``:
    TransMIL's published optimiser (module docstring).
    """
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    if name == "radam_lookahead":
        inner = torch.optim.RAdam(_decay_groups(model.named_parameters(), weight_decay), lr=lr,
                                  decoupled_weight_decay=True)
        opt = Lookahead(inner, alpha=0.5, k=6)
        opt.remember_start()
        return opt
    raise ValueError(f"unknown optimizer {name!r}; accepted: {', '.join(OPTIMIZERS)}")
