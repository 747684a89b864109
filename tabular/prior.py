"""Synthetic classification tables for pretraining: a batched, vectorized prior.

Every call to :meth:`TablePrior.sample` draws ``batch_size`` tables that share a row count, a feature count and
a train/test split (so they stack into one tensor), but each has its own causal model, class count, feature
types and missing-value pattern. Two families of structural causal models (SCMs):

* **MLP-SCM** (default 70%): a few root causes (1..8) ``z ~ N(0, s²)`` or ``U(-a, a)`` pass through a random MLP of random
  depth and width (batched ``bmm`` over tables); each layer adds Gaussian noise (std 1e-4..0.3) and applies an
  activation drawn per table and per layer (tanh, relu, sin, abs, square, identity, sigmoid, step). Every
  hidden unit is a node of the causal graph; features and target are random nodes.
* **Tree-SCM** (default 30%): the same layered graph, but each layer is a sum of random *oblivious* decision
  trees (one split feature and threshold per depth level, leaf values random), so targets are piecewise
  constant in the causes, like data that gradient-boosted trees fit well.
* **Factor-SCM** (``p_factor``, default 0%): measurements of a few latent factors, as in clinical or
  morphometric tables — each node is a sparse random linear mix of the factors plus its own noise (std
  0.05..1.5, so some nodes are near-copies of others and some are noisy), and 30% of the nodes are
  exponentiated (positive, right-skewed, like sizes and counts). A target node is then a noisy linear score
  of the factors: the redundant, near-linear tables on which logistic regression is hard to beat.

The regression target is turned into ``C`` classes (50% binary, else 2..10) either **by value** (thresholds at
random target values, which gives imbalanced classes) or **by rank** (equal-frequency bins); class ids are then
permuted. 20% of features (on average) become categorical (quantile-binned into 2..10 codes with a random
code permutation), and a third of the tables get missing values (NaN, up to 20% of cells).

Outputs are float32 tensors: ``X`` (B, N, F) with NaN for missing cells, ``y`` (B, N) int64 in
``[0, n_classes[b])``, ``n_classes`` (B,), ``is_categorical`` (B, F) bool, and ``n_train``; rows
``[:n_train]`` are the labelled context and the rest the queries. Every class occurs among the train rows.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

__all__ = ["PriorConfig", "PriorBatch", "TablePrior"]

_ACTIVATIONS = ("tanh", "relu", "sin", "abs", "square", "identity", "sigmoid", "step", "leaky")


@dataclass(kw_only=True)
class PriorConfig:
    """What tables the prior draws."""

    min_features: int = 2  # fewest features per table
    max_features: int = 100  # most features per table (the published prior's upper bound)
    max_classes: int = 10  # most classes; the model's decoder emits this many logits
    p_binary: float = 0.5  # probability that a table is binary (else 2..max_classes uniformly)
    p_tree: float = 0.3  # share of tree-based SCMs (the rest are MLP-SCMs)
    p_categorical: float = 0.2  # expected share of categorical features
    p_missing_table: float = 0.3  # share of tables that get missing values
    max_missing: float = 0.2  # largest share of missing cells in such a table
    p_rank_classes: float = 0.5  # classes from equal-frequency bins (else from random value thresholds)
    min_layers: int = 1  # SCM depth range (hidden layers of the random MLP / tree stack)
    max_layers: int = 4
    min_width: int = 4  # SCM width range (nodes per layer); features need F + 1 nodes in total
    max_width: int = 130
    max_causes: int = 8  # root causes drawn from 1..max_causes; every other node is a function of them
    min_noise: float = 1e-4  # per-layer noise std range, log-uniform
    max_noise: float = 0.3
    tree_depth: int = 4  # depth of each oblivious tree in tree-SCMs
    n_trees: int = 8  # expected number of trees summed into each node of a tree-SCM
    p_factor: float = 0.0  # share of factor-SCMs (latent-factor measurements); p_tree + p_factor <= 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_features <= self.max_features:
            raise ValueError(f"need 1 <= min_features ({self.min_features}) <= max_features ({self.max_features})")
        if not 2 <= self.max_classes:
            raise ValueError(f"max_classes ({self.max_classes}) must be at least 2")
        for name in ("p_binary", "p_tree", "p_categorical", "p_missing_table", "max_missing", "p_rank_classes",
                     "p_factor"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} ({v}) must lie in [0, 1]")
        if self.p_tree + self.p_factor > 1.0:
            raise ValueError(f"p_tree + p_factor ({self.p_tree} + {self.p_factor}) must be at most 1")
        if not 1 <= self.min_layers <= self.max_layers:
            raise ValueError(f"need 1 <= min_layers ({self.min_layers}) <= max_layers ({self.max_layers})")
        if not 2 <= self.min_width <= self.max_width:
            raise ValueError(f"need 2 <= min_width ({self.min_width}) <= max_width ({self.max_width})")
        if not self.max_causes >= 1:
            raise ValueError(f"max_causes ({self.max_causes}) must be at least 1")
        if not 0 < self.min_noise <= self.max_noise:
            raise ValueError(f"need 0 < min_noise ({self.min_noise}) <= max_noise ({self.max_noise})")


@dataclass(kw_only=True)
class PriorBatch:
    """A batch of tables sharing (rows, features, split)."""

    X: torch.Tensor  # (B, N, F) float32, NaN = missing
    y: torch.Tensor  # (B, N) int64 class ids in [0, n_classes[b])
    n_classes: torch.Tensor  # (B,) int64
    is_categorical: torch.Tensor  # (B, F) bool
    n_train: int  # rows [:n_train] are labelled context, the rest are queries

    def to(self, device: torch.device | str) -> "PriorBatch":
        return PriorBatch(
            X=self.X.to(device),
            y=self.y.to(device),
            n_classes=self.n_classes.to(device),
            is_categorical=self.is_categorical.to(device),
            n_train=self.n_train,
        )


def _activate(h: torch.Tensor, act_idx: torch.Tensor) -> torch.Tensor:
    """Apply activation ``_ACTIVATIONS[act_idx[b]]`` to table ``b``; h (B, N, W), act_idx (B,)."""
    out = torch.empty_like(h)
    for i, name in enumerate(_ACTIVATIONS):
        sel = act_idx == i
        if not bool(sel.any()):
            continue
        x = h[sel]
        if name == "tanh":
            x = torch.tanh(x)
        elif name == "relu":
            x = torch.relu(x)
        elif name == "sin":
            x = torch.sin(x)
        elif name == "abs":
            x = x.abs()
        elif name == "square":
            x = x.square().clamp(max=1e3)
        elif name == "sigmoid":
            x = torch.sigmoid(x)
        elif name == "step":
            x = (x > 0).to(x.dtype)
        elif name == "leaky":
            x = torch.nn.functional.leaky_relu(x, 0.1)
        out[sel] = x
    return out


def _standardize_nodes(h: torch.Tensor) -> torch.Tensor:
    """Zero-mean unit-std per table and node, over rows; h (B, N, W)."""
    mu = h.mean(dim=1, keepdim=True)
    sd = h.std(dim=1, keepdim=True).clamp_min(1e-6)
    return (h - mu) / sd


class TablePrior:
    """Batched generator of synthetic classification tables.

    Args:
        config: what to draw (see :class:`PriorConfig`).
        seed: seed of the generator's own ``torch.Generator`` (the global RNG is never touched).
        device: where tables are generated.
    """

    def __init__(self, config: PriorConfig | None = None, *, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.config = config or PriorConfig()
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(int(seed))

    # -- random helpers on the private generator --------------------------------------------------
    def _rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=self.generator, device=self.device)

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator, device=self.device)

    def _randint(self, low: int, high: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Integers in ``[low, high]`` inclusive."""
        return torch.randint(low, high + 1, shape, generator=self.generator, device=self.device)

    def _loguniform(self, lo: float, hi: float, shape: tuple[int, ...]) -> torch.Tensor:
        u = self._rand(*shape)
        return torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))

    def get_state(self) -> torch.Tensor:
        """RNG state, for exact resumption."""
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    # -- the two SCM families -----------------------------------------------------------------------
    def _causes(self, B: int, N: int, W: int) -> torch.Tensor:
        """Root causes (B, N, W): normal or uniform per table, random scale."""
        scale = self._loguniform(0.3, 3.0, (B, 1, 1))
        normal = self._randn(B, N, W)
        uniform = (self._rand(B, N, W) * 2 - 1) * math.sqrt(3.0)
        use_uniform = (self._rand(B, 1, 1) < 0.3).float()
        return scale * (use_uniform * uniform + (1 - use_uniform) * normal)

    def _mlp_scm(self, B: int, N: int, W: int, L: int, K: int) -> torch.Tensor:
        """Nodes (B, N, K + L*W) of a random MLP causal graph over ``K`` root causes (the causes are nodes too)."""
        h = self._causes(B, N, K)
        noise_std = self._loguniform(self.config.min_noise, self.config.max_noise, (B, 1, 1))
        nodes = [h]
        for _ in range(L):
            # Sparse-ish random weights: each edge kept with prob 0.5..1 per table.
            w_in = h.shape[2]
            w = self._randn(B, w_in, W) / math.sqrt(w_in)
            keep = (self._rand(B, w_in, W) < (0.5 + 0.5 * self._rand(B, 1, 1))).float()
            b = self._randn(B, 1, W) * 0.5
            h = torch.bmm(h, w * keep * math.sqrt(2.0)) + b  # (B, N, W)
            act = self._randint(0, len(_ACTIVATIONS) - 1, (B,))
            h = _activate(h, act)
            h = _standardize_nodes(h) + noise_std * self._randn(B, N, W)
            nodes.append(h)
        return torch.cat(nodes, dim=2)

    def _tree_scm(self, B: int, N: int, W: int, L: int, K: int) -> torch.Tensor:
        """Nodes (B, N, K + L*W) over ``K`` root causes: each layer grows W random oblivious trees on the previous layer and mixes them.

        A tree of depth D picks one split feature and threshold per level (threshold = a random row's value,
        so splits land inside the data); its leaf index is the D-bit pattern of the row's split outcomes.
        Each node is then a sparse random sum of ``n_trees`` trees (gradient-boosting-like targets).
        """
        cfg = self.config
        D = cfg.tree_depth
        h = self._causes(B, N, K)
        noise_std = self._loguniform(cfg.min_noise, cfg.max_noise, (B, 1, 1))
        powers = (2 ** torch.arange(D, device=self.device)).view(1, 1, 1, D)
        nodes = [h]
        for _ in range(L):
            feat = self._randint(0, h.shape[2] - 1, (B, W * D))  # split feature per (tree, level)
            vals = torch.gather(h, 2, feat[:, None, :].expand(B, N, -1))  # (B, N, W*D)
            row = self._randint(0, N - 1, (B, 1, W * D))
            thr = torch.gather(vals, 1, row)  # (B, 1, W*D)
            bits = (vals > thr).view(B, N, W, D).long()
            leaf = (bits * powers).sum(-1)  # (B, N, W) leaf index in [0, 2^D)
            leaf_values = self._randn(B, 1, W, 2**D).expand(B, N, W, 2**D)
            trees = torch.gather(leaf_values, 3, leaf[..., None]).squeeze(3)  # (B, N, W)
            mix = self._randn(B, W, W) * (self._rand(B, W, W) < min(1.0, cfg.n_trees / W)).float()
            h = torch.bmm(trees, mix)
            h = _standardize_nodes(h) + noise_std * self._randn(B, N, W)
            nodes.append(h)
        return torch.cat(nodes, dim=2)

    def _factor_scm(self, B: int, N: int, M: int, K: int) -> torch.Tensor:
        """Nodes (B, N, K + M): ``K`` latent factors and ``M`` noisy, partly skewed linear measurements of them."""
        z = self._causes(B, N, K)
        density = 0.3 + 0.7 * self._rand(B, 1, 1)  # share of factors each measurement loads on
        load = self._randn(B, K, M) * (self._rand(B, K, M) < density).float()
        anchor = torch.nn.functional.one_hot(self._randint(0, K - 1, (B, M)), K).transpose(1, 2).float()
        load = load + anchor * self._randn(B, 1, M)  # every measurement loads on at least one factor
        x = _standardize_nodes(torch.bmm(z, load))
        x = x + self._loguniform(0.05, 1.5, (B, 1, M)) * self._randn(B, N, M)
        skewed = self._rand(B, 1, M) < 0.3
        x = torch.where(skewed, torch.exp(0.7 * x.clamp(max=8.0)), x)
        return torch.cat([z, x], dim=2)

    # -- turning nodes into a table -----------------------------------------------------------------
    def _classes_from_target(self, t: torch.Tensor, C: torch.Tensor, n_train: int) -> torch.Tensor:
        """Continuous target (B, N) -> int classes, ``C[b]`` classes each, every class present among train rows.

        Cuts are train-target values at distinct sorted positions: equally spaced (by rank) or at random
        positions (by value, imbalanced). A tiny jitter breaks ties (tree SCMs are piecewise constant), so
        distinct positions give non-empty classes in the train part.
        """
        B, N = t.shape
        Cmax = self.config.max_classes
        t = t + 1e-4 * self._randn(B, N)
        sorted_train, _ = t[:, :n_train].sort(dim=1)  # (B, n_train)
        by_rank = self._rand(B) < self.config.p_rank_classes
        j = torch.arange(1, Cmax, device=self.device)[None]  # (1, Cmax-1)
        idx_rank = torch.div(j * n_train, C[:, None], rounding_mode="floor")  # (B, Cmax-1)
        # Value mode: Cmax-1 distinct random positions in 1..n_train-1, sorted per table.
        keys = self._rand(B, n_train - 1)
        idx_val = keys.topk(Cmax - 1, dim=1, largest=False).indices + 1
        used = j < C[:, None]  # only the first C-1 cuts are live
        # Live cuts must be the smallest C-1 of the drawn positions' subset: sort the live ones only.
        idx_val = torch.where(used, idx_val, torch.full_like(idx_val, n_train)).sort(dim=1).values
        idx = torch.where(by_rank[:, None], idx_rank, idx_val).clamp(max=n_train - 1)
        cuts = torch.gather(sorted_train, 1, idx)
        cuts = torch.where(used, cuts, torch.full_like(cuts, float("inf")))  # (B, Cmax-1)
        y = (t[:, :, None] >= cuts[:, None, :]).sum(-1)  # (B, N) in [0, C-1]
        # Random relabelling of the C[b] classes of each table.
        keys = self._rand(B, Cmax) + (torch.arange(Cmax, device=self.device)[None] >= C[:, None]).float() * 2
        perm = torch.argsort(keys, dim=1)
        return torch.gather(perm, 1, y)

    def sample(self, batch_size: int, n_rows: int, n_train: int, n_features: int | None = None) -> PriorBatch:
        """Draw ``batch_size`` tables of ``n_rows`` rows (first ``n_train`` labelled) and ``n_features`` features.

        Args:
            batch_size: tables in the batch.
            n_rows: rows per table.
            n_train: labelled context rows, ``max_classes <= n_train < n_rows``.
            n_features: features per table; drawn from ``[min_features, max_features]`` when None.
        """
        cfg = self.config
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not cfg.max_classes <= n_train < n_rows:
            raise ValueError(f"need max_classes ({cfg.max_classes}) <= n_train ({n_train}) < n_rows ({n_rows})")
        B, N = batch_size, n_rows
        F = int(self._randint(cfg.min_features, cfg.max_features, (1,)).item()) if n_features is None else n_features
        if F < 1:
            raise ValueError(f"n_features must be >= 1, got {F}")
        L = int(self._randint(cfg.min_layers, cfg.max_layers, (1,)).item())
        W = int(self._randint(cfg.min_width, cfg.max_width, (1,)).item())
        K = int(self._randint(1, cfg.max_causes, (1,)).item())  # root causes: few, so nodes are related
        W = max(W, math.ceil((F + 1) / L))  # enough nodes to pick F features + 1 target
        # Split the batch into the SCM families (one vectorized pass each). With p_factor = 0 the draws are
        # exactly those of the two-family prior (same random calls), so existing runs resume unchanged.
        u = self._rand(B)
        is_tree = u < cfg.p_tree
        is_factor = (u >= cfg.p_tree) & (u < cfg.p_tree + cfg.p_factor)
        is_mlp = ~(is_tree | is_factor)
        nodes = torch.empty(B, N, K + L * W, device=self.device)
        n_tree, n_factor, n_mlp = int(is_tree.sum()), int(is_factor.sum()), int(is_mlp.sum())
        if n_tree:
            nodes[is_tree] = self._tree_scm(n_tree, N, W, L, K)
        if n_mlp:
            nodes[is_mlp] = self._mlp_scm(n_mlp, N, W, L, K)
        if n_factor:
            nodes[is_factor] = self._factor_scm(n_factor, N, L * W, K)
        # Pick F + 1 distinct nodes per table: the first is the target.
        pick = torch.argsort(self._rand(B, K + L * W), dim=1)[:, : F + 1]  # (B, F+1)
        chosen = torch.gather(nodes, 2, pick[:, None, :].expand(B, N, -1))
        t, X = chosen[:, :, 0], chosen[:, :, 1:].contiguous()
        # Class counts: 50% binary, else uniform on 2..max_classes.
        multi = self._randint(2, cfg.max_classes, (B,))
        C = torch.where(self._rand(B) < cfg.p_binary, torch.full_like(multi, 2), multi)
        y = self._classes_from_target(t, C, n_train)
        # Categorical features: quantile-bin into k codes and permute codes.
        is_cat = self._rand(B, F) < cfg.p_categorical
        if bool(is_cat.any()):
            k = self._randint(2, 10, (B, F)).float()  # codes per feature
            ranks = X.argsort(dim=1).argsort(dim=1).float() / N  # (B, N, F) in [0, 1)
            codes = torch.floor(ranks * k[:, None, :])
            code_perm = torch.argsort(self._rand(B, F, 10), dim=2).float()  # random code relabelling
            codes = torch.gather(code_perm, 2, codes.long().clamp(max=9).transpose(1, 2)).transpose(1, 2)
            X = torch.where(is_cat[:, None, :], codes, X)
        # Missing values for a share of tables.
        has_missing = self._rand(B, 1, 1) < cfg.p_missing_table
        rate = self._rand(B, 1, 1) * cfg.max_missing
        miss = (self._rand(B, N, F) < rate) & has_missing
        X = X.masked_fill(miss, float("nan"))
        # Shuffle rows within the train part and within the test part.
        order_train = torch.argsort(self._rand(B, n_train), dim=1)
        order_test = torch.argsort(self._rand(B, N - n_train), dim=1) + n_train
        order = torch.cat([order_train, order_test], dim=1)
        X = torch.gather(X, 1, order[:, :, None].expand(B, N, F))
        y = torch.gather(y, 1, order)
        return PriorBatch(X=X.float(), y=y.long(), n_classes=C.long(), is_categorical=is_cat, n_train=n_train)
