"""More classes than a published checkpoint's decoder has, as the official TabICL model handles them.

Two mechanisms, both inside the model (used by :meth:`tabular.model.TabICL.build_context` when the train labels
hold more than ``max_classes`` classes):

- **Mixed-radix label views** (target-aware column stage, v2): ``C`` classes are written in ``D`` digits of balanced
  bases ``k_0 .. k_{D-1}`` (each ``<= max_classes``, product ``>= C``); digit ``i`` of class ``c`` is
  ``(c // (k_{i+1} ... k_{D-1})) mod k_i``. The column blocks run once per digit with that digit as the label and
  their outputs are averaged, so each view is a coarser grouping of the classes the checkpoint can embed.
- **A hierarchy of class groups** (ICL stage): the sorted classes of a table are split into
  ``min(ceil(C / max_classes), max_classes)`` contiguous groups of near-equal size (sizes ``ceil(remaining classes /
  remaining groups)`` in order); the ICL stage classifies a test row into a group with the node's train rows as
  context, recursively, until a node holds at most ``max_classes`` classes (a leaf: its classes ranked). The
  probability of a class is the product of the softmaxes (temperature :data:`NODE_TEMPERATURE`) along its path.

Layouts: row vectors ``(n, D)`` of one table, labels ``(n,)`` int in ``[0, C)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["NODE_TEMPERATURE", "ClassTree", "mixed_radix_bases", "mixed_radix_digit", "label_views", "group_sizes",
           "fit_tree", "tree_proba"]

#: Softmax temperature at every node of the hierarchy (the official model uses its default 0.9 there, whatever
#: temperature the estimator applies to the averaged result).
NODE_TEMPERATURE = 0.9


def mixed_radix_bases(n_classes: int, max_classes: int) -> list[int]:
    """Balanced bases ``[k_0, ..., k_{D-1}]`` (each ``<= max_classes``) for ``n_classes`` classes:
    ``D = ceil(log C / log max_classes)`` digits of ``k = min(ceil(C^(1/D)), max_classes)``, then, while the product
    is below ``C``, the bases are raised by one from the first (one pass); ``[C]`` when ``C <= max_classes``."""
    if n_classes <= max_classes:
        return [n_classes]
    digits = math.ceil(math.log(n_classes) / math.log(max_classes))
    k = min(math.ceil(n_classes ** (1.0 / digits)), max_classes)
    bases, product = [k] * digits, k**digits
    for i in range(digits):
        if product >= n_classes:
            break
        if bases[i] < max_classes:
            product = product // bases[i] * (bases[i] + 1)
            bases[i] += 1
    return bases


def mixed_radix_digit(y: torch.Tensor, i: int, bases: list[int]) -> torch.Tensor:
    """Digit ``i`` of labels ``y`` in the mixed radix ``bases``: ``(y // prod(bases[i+1:])) mod bases[i]``."""
    return (y.long() // math.prod(bases[i + 1 :])) % bases[i]


def label_views(y: torch.Tensor, max_classes: int) -> list[torch.Tensor]:
    """The labels a target-aware column stage reads: ``[y]``, or its mixed-radix digits when ``max(y) + 1`` (the
    class count the official model uses here) exceeds ``max_classes``. ``y`` int, any shape."""
    n_classes = int(y.max()) + 1
    if n_classes <= max_classes:
        return [y]
    bases = mixed_radix_bases(n_classes, max_classes)
    return [mixed_radix_digit(y, i, bases) for i in range(len(bases))]


def group_sizes(n_classes: int, max_classes: int) -> list[int]:
    """Sizes of the contiguous class groups at a node of ``n_classes > max_classes`` classes."""
    n_groups = min(math.ceil(n_classes / max_classes), max_classes)
    sizes, left = [], n_classes
    for g in range(n_groups):
        size = math.ceil(left / (n_groups - g))
        sizes.append(size)
        left -= size
    return sizes


@dataclass(kw_only=True, eq=False)
class ClassTree:
    """A node of the class hierarchy of one table, with the ICL context of its train rows."""

    classes: torch.Tensor  # (k,) sorted class ids under this node
    kv: list  # the ICL keys/values of this node's train rows (ICLTransformer.context), batch of one table
    n_out: int  # outputs read at this node: groups (inner node) or classes (leaf)
    children: list = field(default_factory=list)  # ClassTree per group; empty at a leaf

    def nbytes(self) -> int:
        own = sum(t.numel() * t.element_size() for kv in self.kv for t in kv)
        return own + sum(c.nbytes() for c in self.children)


def fit_tree(icl, rows: torch.Tensor, y: torch.Tensor, max_classes: int, *, chunk: int | None = None) -> ClassTree:
    """The hierarchy over train rows ``rows (n, D)`` (the ICL stage's input, standardized if the model does) with
    labels ``y (n,)``; every node keeps the ICL context of its rows (``icl``: a :class:`tabular.stages.ICLTransformer`)."""
    classes = torch.unique(y)
    rank = torch.searchsorted(classes, y)  # labels as 0 .. k-1 in class order
    if len(classes) <= max_classes:
        kv = icl.context(rows[None], rank[None], chunk=chunk)
        return ClassTree(classes=classes, kv=kv, n_out=len(classes))
    sizes = group_sizes(len(classes), max_classes)
    group_of_class = torch.repeat_interleave(torch.arange(len(sizes), device=y.device),
                                             torch.tensor(sizes, device=y.device))
    groups = group_of_class[rank]
    node = ClassTree(classes=classes, kv=icl.context(rows[None], groups[None], chunk=chunk), n_out=len(sizes))
    for g in range(len(sizes)):
        mask = groups == g
        node.children.append(fit_tree(icl, rows[mask], y[mask], max_classes, chunk=chunk))
    return node


def tree_proba(icl, node: ClassTree, rows_test: torch.Tensor, n_classes: int,
               temperature: float = NODE_TEMPERATURE) -> torch.Tensor:
    """Class probabilities ``(m, n_classes)`` of test rows ``rows_test (m, D)``: the softmax over the node's outputs
    (temperature ``temperature``), multiplied down the hierarchy."""
    logits = icl.predict(rows_test[None], node.kv)[0, :, : node.n_out]
    p = torch.softmax(logits / temperature, dim=-1)
    out = torch.zeros(rows_test.shape[0], n_classes, device=rows_test.device, dtype=p.dtype)
    if not node.children:
        out[:, node.classes] = p
        return out
    for g, child in enumerate(node.children):
        out += tree_proba(icl, child, rows_test, n_classes, temperature) * p[:, g : g + 1]
    return out
