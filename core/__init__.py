"""The shared attention core (pure PyTorch, CPU and GPU).

Two halves, imports pointing one way (the math may use the plumbing, never the reverse):

- **attention math** — the modules directly in ``core``: :mod:`core.attention` (one entry point, its backends and the
  ``auto`` rule) with :mod:`core.attention_inputs`, :mod:`core.attention_dispatch`, :mod:`core.attention_chunked`
  (:mod:`core.attention_blocks`, :mod:`core.attention_fused`), :mod:`core.attention_indexed`, :mod:`core.blocksparse`, :mod:`core.continuous`,
  :mod:`core.rope`, :mod:`core.mha`, :mod:`core.layers`, :mod:`core.qformer`, :mod:`core.routing`,
  :mod:`core.decoder`, :mod:`core.kv_cache`, :mod:`core.kv_compress`, :mod:`core.collapse`;
- **models and plumbing** — :mod:`core.hf` (the bridge to transformers models) and :mod:`core.infra` (atomic files,
  batch jobs, model cards, distributed training helpers, vision backbones).

``from core import attention`` imports the attention module; nothing is imported here, so ``import core`` is free.
"""
