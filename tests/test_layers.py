"""Transformer layers: shapes, backend agreement, masking, ISAB leakage, gates, Q-former hook, gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from core.attention import BACKENDS
from core.layers import (
    MLP,
    CrossAttentionBlock,
    GatedCrossAttentionBlock,
    InducedSetAttentionBlock,
    MultiHeadAttention,
    QFormerBlock,
    SelfAttentionBlock,
    set_attention_backend,
)
from core.rope import RotaryEmbedding

FAST_BACKENDS = ["sdpa", "chunked"]


def _need(backend: str) -> None:
    if backend not in BACKENDS:
        pytest.skip(f"attention backend {backend!r} is not registered in core.attention.BACKENDS")


def _rand_params(module: nn.Module) -> nn.Module:
    """Random weights everywhere (LayerNorm affine too), so no test passes because of a neutral init."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return module


# ---------------------------------------------------------------- MultiHeadAttention


@pytest.mark.parametrize("norm_first", [True, False])
def test_self_attention_block_matches_torch_encoder_layer(norm_first):
    dim, heads = 32, 4
    ours = SelfAttentionBlock(dim, heads, mlp_hidden_dim=48, norm_first=norm_first, backend="reference").eval()
    _rand_params(ours)
    theirs = nn.TransformerEncoderLayer(
        dim, heads, dim_feedforward=48, dropout=0.0, activation="gelu", batch_first=True, norm_first=norm_first
    ).eval()
    with torch.no_grad():
        a = ours.attn
        theirs.self_attn.in_proj_weight.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
        theirs.self_attn.in_proj_bias.copy_(torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))
        theirs.self_attn.out_proj.weight.copy_(a.out_proj.weight)
        theirs.self_attn.out_proj.bias.copy_(a.out_proj.bias)
        theirs.linear1.load_state_dict(ours.mlp.fc1.state_dict())
        theirs.linear2.load_state_dict(ours.mlp.fc2.state_dict())
        theirs.norm1.load_state_dict(ours.norm1.state_dict())
        theirs.norm2.load_state_dict(ours.norm2.state_dict())
    x = torch.randn(2, 9, dim)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, 6:] = True
    got = ours(x, key_padding_mask=pad)
    want = theirs(x, src_key_padding_mask=pad)
    torch.testing.assert_close(got[~pad], want[~pad], atol=1e-4, rtol=1e-4)


def test_pieces_compose_to_forward_and_cross_dims():
    attn = _rand_params(MultiHeadAttention(32, 4, kv_dim=20, backend="reference"))
    x, ctx = torch.randn(2, 5, 32), torch.randn(2, 7, 20)
    q = attn.project_q(x)
    k, v = attn.project_kv(ctx)
    assert q.shape == (2, 4, 5, 8) and k.shape == (2, 4, 7, 8) and v.shape == (2, 4, 7, 8)
    torch.testing.assert_close(attn.merge(attn.attend(q, k, v)), attn(x, ctx))
    assert attn(x, ctx).shape == (2, 5, 32)


def test_grouped_query_attention_equals_repeated_heads():
    dim, heads, kv_heads = 32, 4, 2
    gqa = _rand_params(MultiHeadAttention(dim, heads, num_kv_heads=kv_heads, backend="reference"))
    full = MultiHeadAttention(dim, heads, backend="reference")
    hd = dim // heads
    with torch.no_grad():
        full.q_proj.load_state_dict(gqa.q_proj.state_dict())
        full.out_proj.load_state_dict(gqa.out_proj.state_dict())
        for name in ("k_proj", "v_proj"):
            src, dst = getattr(gqa, name), getattr(full, name)
            # (kv_heads*hd, dim) -> each kv head repeated for its heads // kv_heads query heads
            w = src.weight.reshape(kv_heads, 1, hd, dim).expand(kv_heads, heads // kv_heads, hd, dim)
            dst.weight.copy_(w.reshape(heads * hd, dim))
            dst.bias.copy_(src.bias.reshape(kv_heads, 1, hd).expand(kv_heads, heads // kv_heads, hd).reshape(-1))
    x = torch.randn(3, 6, dim)
    assert gqa.k_proj.weight.shape == (kv_heads * hd, dim)
    torch.testing.assert_close(gqa(x, causal=True), full(x, causal=True), atol=1e-5, rtol=1e-5)


def test_rope_makes_self_attention_translation_invariant():
    attn = _rand_params(MultiHeadAttention(32, 2, backend="reference"))
    rope = RotaryEmbedding(16)
    x = torch.randn(2, 8, 32)
    pos = torch.arange(8)
    out0 = attn(x, rope=rope(pos), causal=True)
    out1 = attn(x, rope=rope(pos + 37), causal=True)
    torch.testing.assert_close(out0, out1, atol=1e-4, rtol=1e-4)
    out_perm = attn(x, rope=rope(pos.flip(0)), causal=True)  # positions matter
    assert not torch.allclose(out0, out_perm, atol=1e-3)
    # separate q/k tables: q_rope/k_rope override rope
    torch.testing.assert_close(attn(x, q_rope=rope(pos), k_rope=rope(pos), causal=True), out0)


def test_rejects_bad_config():
    with pytest.raises(ValueError, match="must divide dim"):
        MultiHeadAttention(30, 4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        MultiHeadAttention(32, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="unknown attention backend"):
        MultiHeadAttention(32, 4, backend="nope")
    with pytest.raises(ValueError, match="activation"):
        MLP(8, 16, activation="tanhh")
    with pytest.raises(ValueError, match=r"queries must be \(B, S, 32\)"):
        MultiHeadAttention(32, 4)(torch.randn(2, 5, 31))


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "silu", "swiglu"])
def test_mlp_shapes(activation):
    mlp = MLP(12, 20, activation=activation, out_dim=5)
    assert mlp(torch.randn(2, 3, 12)).shape == (2, 3, 5)


# ---------------------------------------------------------------- blocks: shapes and backends


def _blocks_and_inputs(backend: str):
    """(name, block, call) triples covering every block, with masks where the block takes them."""
    dim, heads = 32, 4
    x = torch.randn(2, 9, dim)
    ctx = torch.randn(2, 11, 24)
    pad = torch.zeros(2, 11, dtype=torch.bool)
    pad[0, 8:] = True
    self_pad = torch.zeros(2, 9, dtype=torch.bool)
    self_pad[1, 7:] = True
    gated = GatedCrossAttentionBlock(dim, heads, context_dim=24, norm_context=True, backend=backend)
    return [
        ("self", SelfAttentionBlock(dim, heads, num_kv_heads=2, backend=backend),
         lambda m: m(x, causal=True, key_padding_mask=self_pad)),
        ("cross", CrossAttentionBlock(dim, heads, context_dim=24, backend=backend),
         lambda m: m(x, ctx, context_padding_mask=pad)),
        ("gated", gated, lambda m: m(x, ctx, context_padding_mask=pad)),
        ("isab", InducedSetAttentionBlock(dim, heads, 5, backend=backend), lambda m: m(x, n_train=6)),
        ("qformer", QFormerBlock(dim, heads, context_dim=24, backend=backend),
         lambda m: m(x[:, :4], ctx, context_padding_mask=pad)),
    ]


def test_block_shapes():
    for name, block, call in _blocks_and_inputs("reference"):
        out = call(block)
        assert out.shape == ((2, 4, 32) if name == "qformer" else (2, 9, 32)), name
        assert torch.isfinite(out).all(), name


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_blocks_agree_across_backends(backend):
    _need(backend)
    for name, block, call in _blocks_and_inputs("reference"):
        _rand_params(block)
        want = call(block)
        block.backend = backend
        assert all(m.backend == backend for m in block.modules() if isinstance(m, MultiHeadAttention))
        if backend == "chunked":  # several chunks even at these small sizes
            for m in block.modules():
                if isinstance(m, MultiHeadAttention):
                    m.attention_options = {"q_chunk_size": 4, "k_chunk_size": 3}
        got = call(block)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=lambda s: f"{name}: {s}")


def test_set_attention_backend_walks_submodules():
    model = nn.Sequential(SelfAttentionBlock(16, 2), QFormerBlock(16, 2))
    set_attention_backend(model, "reference")
    assert [m.backend for m in model.modules() if isinstance(m, MultiHeadAttention)] == ["reference"] * 3
    with pytest.raises(ValueError, match="unknown attention backend"):
        model[0].backend = "bogus"


def test_device_dtype_kwargs():
    block = QFormerBlock(16, 2, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in block.parameters())
    out = block(torch.randn(1, 3, 16, dtype=torch.float64), torch.randn(1, 5, 16, dtype=torch.float64))
    assert out.dtype == torch.float64


# ---------------------------------------------------------------- masking semantics


@pytest.mark.parametrize("backend", ["reference", *FAST_BACKENDS])
def test_causal_later_tokens_do_not_change_earlier_outputs(backend):
    _need(backend)
    block = _rand_params(SelfAttentionBlock(32, 4, backend=backend))
    x = torch.randn(2, 10, 32)
    j = 6
    x2 = x.clone()
    x2[:, j] = torch.randn(2, 32)
    out, out2 = block(x, causal=True), block(x2, causal=True)
    torch.testing.assert_close(out[:, :j], out2[:, :j])
    assert (out[:, j:] - out2[:, j:]).abs().amax(dim=-1).min() > 1e-4  # every later token changes
    # without the mask, earlier tokens do see it
    assert not torch.allclose(block(x)[:, :j], block(x2)[:, :j], atol=1e-4)


@pytest.mark.parametrize("backend", ["reference", *FAST_BACKENDS])
def test_padded_keys_do_not_affect_outputs(backend):
    _need(backend)
    block = _rand_params(SelfAttentionBlock(32, 4, backend=backend))
    x = torch.randn(2, 10, 32)
    pad = torch.zeros(2, 10, dtype=torch.bool)
    pad[0, 7:] = True
    pad[1, 4:] = True
    x2 = torch.where(pad[..., None], torch.randn_like(x) * 5, x)
    out, out2 = block(x, key_padding_mask=pad), block(x2, key_padding_mask=pad)
    torch.testing.assert_close(out[~pad], out2[~pad])
    # padding equals truncation
    torch.testing.assert_close(out[1, :4], block(x[1:, :4])[0], atol=1e-5, rtol=1e-5)

    cross = _rand_params(CrossAttentionBlock(32, 4, context_dim=12, norm_context=True, backend=backend))
    ctx = torch.randn(2, 6, 12)
    cpad = torch.tensor([[False] * 4 + [True] * 2, [False] * 6])
    ctx2 = torch.where(cpad[..., None], torch.randn_like(ctx), ctx)
    torch.testing.assert_close(cross(x, ctx, context_padding_mask=cpad), cross(x, ctx2, context_padding_mask=cpad))
    assert not torch.allclose(cross(x, ctx), cross(x, ctx2), atol=1e-4)


# ---------------------------------------------------------------- gated cross-attention


def test_gated_block_identity_at_init_then_not():
    block = GatedCrossAttentionBlock(32, 4, context_dim=24)
    x, ctx = torch.randn(2, 7, 32), torch.randn(2, 5, 24)
    assert torch.equal(block(x, ctx), x)
    with torch.no_grad():
        block.attn_gate.fill_(0.5)
    out_attn_only = block(x, ctx)
    expected = x + torch.tanh(torch.tensor(0.5)) * block.attn(block.norm1(x), ctx)
    torch.testing.assert_close(out_attn_only, expected)
    with torch.no_grad():
        block.ff_gate.fill_(-0.7)
    out = block(x, ctx)
    torch.testing.assert_close(out, expected + torch.tanh(torch.tensor(-0.7)) * block.mlp(block.norm2(expected)))


def test_gated_block_gates_get_gradient_at_init():
    block = GatedCrossAttentionBlock(16, 2)
    x, ctx = torch.randn(2, 3, 16), torch.randn(2, 4, 16)
    (block(x, ctx) * torch.randn(2, 3, 16)).sum().backward()
    assert block.attn_gate.grad.abs() > 0 and block.ff_gate.grad.abs() > 0


# ---------------------------------------------------------------- ISAB


@pytest.mark.parametrize("backend", ["reference", *FAST_BACKENDS])
def test_isab_no_test_leakage(backend):
    _need(backend)
    isab = _rand_params(InducedSetAttentionBlock(32, 4, 6, backend=backend))
    N, n_train = 12, 7
    x = torch.randn(2, N, 32)
    out, summary = isab(x, n_train=n_train), isab.induce(x, n_train=n_train)
    assert summary.shape == (2, 6, 32)

    t = 9  # a test row
    x_test = x.clone()
    x_test[:, t] = torch.randn(2, 32) * 3
    out_t = isab(x_test, n_train=n_train)
    torch.testing.assert_close(isab.induce(x_test, n_train=n_train), summary)
    others = torch.arange(N) != t
    torch.testing.assert_close(out_t[:, others], out[:, others])
    assert not torch.allclose(out_t[:, t], out[:, t], atol=1e-4)

    r = 2  # a train row
    x_train = x.clone()
    x_train[:, r] = torch.randn(2, 32) * 3
    assert not torch.allclose(isab.induce(x_train, n_train=n_train), summary, atol=1e-4)
    out_r = isab(x_train, n_train=n_train)
    assert (out_r[:, others & (torch.arange(N) != r)] - out[:, others & (torch.arange(N) != r)]).abs().amax() > 1e-4


def test_isab_train_specifications_agree():
    isab = _rand_params(InducedSetAttentionBlock(16, 2, 4, backend="reference"))
    x = torch.randn(2, 8, 16)
    n = torch.tensor([3, 6])
    by_tensor = isab(x, n_train=n)
    by_int = torch.cat([isab(x[:1], n_train=3), isab(x[1:], n_train=6)])
    mask = torch.arange(8)[None] < n[:, None]
    torch.testing.assert_close(by_tensor, by_int)
    torch.testing.assert_close(isab(x, train_mask=mask), by_int)
    # a non-contiguous (N,) mask equals moving those rows to the front
    keep = torch.tensor([False, True, False, True, True, False, False, False])
    order = torch.cat([torch.nonzero(keep).flatten(), torch.nonzero(~keep).flatten()])
    torch.testing.assert_close(isab(x, train_mask=keep)[:, order], isab(x[:, order], n_train=3))
    # no argument = every row is a training row
    torch.testing.assert_close(isab(x), isab(x, n_train=8))
    with pytest.raises(ValueError, match="either n_train or train_mask"):
        isab(x, n_train=3, train_mask=mask)
    with pytest.raises(ValueError, match="n_train"):
        isab(x, n_train=9)


# ---------------------------------------------------------------- Q-former hook


def test_qformer_hook_is_called_and_used():
    block = _rand_params(QFormerBlock(32, 4, context_dim=24, norm_context=True, backend="reference"))
    queries, ctx = torch.randn(2, 4, 32), torch.randn(2, 9, 24)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, 5:] = True
    calls = []

    def same_as_default(attn, q_BQD, ctx_BND, mask):
        calls.append((attn, q_BQD, ctx_BND, mask))
        q = attn.project_q(q_BQD)
        k, v = attn.project_kv(ctx_BND)
        return attn.merge(attn.attend(q, k, v, key_padding_mask=mask))

    default = block(queries, ctx, context_padding_mask=pad)
    hooked = block(queries, ctx, context_padding_mask=pad, cross_attn=same_as_default)
    torch.testing.assert_close(hooked, default)
    assert len(calls) == 1
    attn, q_seen, ctx_seen, mask_seen = calls[0]
    assert attn is block.cross_attn and mask_seen is pad
    after_self = queries + block.self_attn(block.norm1(queries))
    torch.testing.assert_close(q_seen, block.norm2(after_self))
    torch.testing.assert_close(ctx_seen, block.norm_context(ctx))

    memory = torch.randn(2, 4, 32)
    mixed = block(queries, ctx, cross_attn=lambda a, q, c, m: 0.75 * a(q, c, key_padding_mask=m) + 0.25 * memory,
                  context_padding_mask=pad)
    update = 0.75 * block.cross_attn(block.norm2(after_self), block.norm_context(ctx), key_padding_mask=pad) + 0.25 * memory
    expected = after_self + update
    expected = expected + block.mlp(block.norm3(expected))
    torch.testing.assert_close(mixed, expected)

    # context may be omitted when the hook supplies everything
    out = block(queries, None, cross_attn=lambda a, q, c, m: memory)
    assert out.shape == queries.shape
    with pytest.raises(ValueError, match="needs a context"):
        block(queries, None)
    with pytest.raises(ValueError, match="hook must return"):
        block(queries, ctx, cross_attn=lambda a, q, c, m: memory[:, :2])


# ---------------------------------------------------------------- gradients


def test_gradients_reach_every_parameter():
    blocks = _blocks_and_inputs("reference")
    for name, block, call in blocks:
        if name == "gated":
            with torch.no_grad():
                block.attn_gate.fill_(0.4)
                block.ff_gate.fill_(0.4)
        out = call(block)
        (out * torch.randn_like(out)).sum().backward()
        for pname, p in block.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}.{pname} got no gradient"


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_gradients_agree_across_backends(backend):
    _need(backend)
    x, ctx = torch.randn(2, 7, 16), torch.randn(2, 5, 16)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[0, 3:] = True
    for block, call in [
        (SelfAttentionBlock(16, 2, num_kv_heads=1), lambda m, x: m(x, causal=True)),
        (QFormerBlock(16, 2), lambda m, x: m(x[:, :3], ctx, context_padding_mask=pad)),
    ]:
        _rand_params(block)
        grads = []
        for name in ("reference", backend):
            block.backend = name
            block.zero_grad()
            xi = x.clone().requires_grad_(True)
            out = call(block, xi)
            out.backward(torch.ones_like(out))
            grads.append([xi.grad] + [p.grad.clone() for p in block.parameters()])
        for g_ref, g in zip(*grads):
            torch.testing.assert_close(g, g_ref, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- in-context attention (context_len)


def test_context_len_reads_only_the_prefix():
    block = _rand_params(SelfAttentionBlock(32, 4, backend="reference"))
    x = torch.randn(2, 10, 32)
    n = 6
    out = block(x, context_len=n)
    # same as an additive -inf bias on the keys past the prefix
    bias = torch.zeros(10, 10)
    bias[:, n:] = float("-inf")
    torch.testing.assert_close(out, block(x, attn_bias=bias), atol=1e-5, rtol=1e-5)
    # a later (test) row changes only its own output
    x2 = x.clone()
    x2[:, 8] = torch.randn(2, 32)
    out2 = block(x2, context_len=n)
    keep = torch.arange(10) != 8
    torch.testing.assert_close(out2[:, keep], out[:, keep])
    # rope tables for all S positions; keys use the prefix's
    rope = RotaryEmbedding(8)(torch.arange(10))
    bias_rope = block(x, attn_bias=bias, rope=rope)
    torch.testing.assert_close(block(x, context_len=n, rope=rope), bias_rope, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="context_len"):
        block(x, context_len=11)
    with pytest.raises(ValueError, match="cannot be combined"):
        block(x, context_len=4, causal=True)


def test_isab_without_training_rows_is_row_independent():
    isab = _rand_params(InducedSetAttentionBlock(16, 2, 3, backend="reference"))
    x = torch.randn(2, 5, 16)
    s0 = isab.induce(x, n_train=0)
    torch.testing.assert_close(isab.induce(torch.randn(2, 5, 16), n_train=0), s0)
    assert torch.isfinite(isab(x, n_train=0)).all()
