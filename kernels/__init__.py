"""Triton kernels behind ``core``; each matches a PyTorch reference in ``core`` and is tested against it.

Modules (imported explicitly, never at package import, so that ``TRITON_INTERPRET`` is honoured and
importing ``kernels`` costs nothing):

* ``kernels.flash_attention``: ``flash_attention(q, k, v, *, causal, key_padding_mask, attn_bias, scale)``,
  FlashAttention-2 forward and backward (reference: ``core.attention.attention``).
* ``kernels.block_sparse``: ``block_sparse_attention(q, k, v, block_index, *, block_size, ...)``
  (reference: ``core.blocksparse.block_sparse_attention``).
"""
