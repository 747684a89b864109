"""core.routing: exact top-k, capacity gradient, causal auxiliary selection, routed-block semantics."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from core.attention import attention
from core.routing import RoutedBlock, RoutingConfig, soft_capacity_mask, token_ranks, topk_mask


class _CausalBlock(nn.Module):
    """A small residual causal self-attention block for the tests."""

    def __init__(self, dim: int, heads: int = 2):
        super().__init__()
        self.h = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)  # 3 x (B, H, S, Dh)
        o = attention(q, k, v, causal=True).transpose(1, 2).reshape(B, S, D)
        return x + self.out(o)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: one intra-op thread (conftest)


def _routed(dim=16, **kw):
    cfg = RoutingConfig(dim=dim, **kw)
    return RoutedBlock(_CausalBlock(dim), cfg)


def test_topk_mask_keeps_exactly_k_even_with_ties():
    B, S = 7, 37
    scores = torch.randint(0, 3, (B, S)).float()  # many ties: a strict '>' rule would miss tokens
    k = torch.randint(0, S + 1, (B,))
    mask = topk_mask(scores, k)
    assert mask.sum(-1).tolist() == k.tolist()
    # every kept score is >= every dropped score
    for b in range(B):
        if 0 < k[b] < S:
            assert scores[b][mask[b]].min() >= scores[b][~mask[b]].max()


def test_topk_mask_respects_padding_and_rejects_bad_k():
    scores = torch.randn(3, 10)
    pad = torch.zeros(3, 10, dtype=torch.bool)
    pad[:, 7:] = True
    scores[:, 7:] = 100.0  # padded tokens score highest but must never be kept
    mask = topk_mask(scores, torch.tensor([7, 3, 0]), pad)
    assert mask.sum(-1).tolist() == [7, 3, 0]
    assert not (mask & pad).any()
    with pytest.raises(ValueError, match="k must lie"):
        topk_mask(scores, torch.tensor([8, 1, 1]), pad)


def test_routed_block_topk_selects_exactly_round_capacity_tokens():
    torch.manual_seed(torch.randint(0, 10_000, ()).item())
    m = _routed(learn_capacity=True, capacity=0.4, min_capacity=0.1).train()
    x = torch.randn(5, 23, 16)
    y, info = m(x)
    expected = torch.round(info.capacity.detach() * 23).long().clamp(min=1)
    assert info.mode == "topk"
    assert info.mask.sum(-1).tolist() == expected.tolist()
    # the kept tokens are the top scores
    ref = topk_mask(info.scores.detach(), expected)
    assert torch.equal(ref, info.mask)


def test_unselected_tokens_skip_and_selected_tokens_match_reference():
    m = _routed(learn_capacity=False, capacity=0.5).train()
    x = torch.randn(3, 12, 16)
    y, info = m(x)
    assert torch.equal(y[~info.mask], x[~info.mask])
    w = torch.sigmoid(info.scores)
    for b in range(3):
        idx = info.mask[b].nonzero().squeeze(-1)  # ascending time order
        xs = x[b, idx][None]
        ref = xs + w[b, idx][None, :, None] * (m.block(xs) - xs)
        torch.testing.assert_close(y[b, idx], ref[0], rtol=1e-5, atol=1e-5)


def test_capacity_predictor_receives_gradient():
    m = _routed(learn_capacity=True, capacity=0.5).train()
    x = torch.randn(4, 20, 16)
    y, info = m(x)
    (y * torch.randn_like(y)).sum().backward()
    grads = [p.grad for p in m.capacity_predictor.parameters()]
    assert all(g is not None for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0
    assert m.router.proj.weight.grad is not None and m.router.proj.weight.grad.abs().sum() > 0


def test_capacity_gradient_points_the_right_way():
    """When every routed token lowers the loss, gradient steps on the predictor raise the capacity."""
    dim = 8

    class _Push(nn.Module):  # adds a fixed direction to every token it sees
        def __init__(self):
            super().__init__()
            self.register_buffer("c", torch.randn(dim))

        def forward(self, x):
            return x + self.c

    m = RoutedBlock(_Push(), RoutingConfig(dim=dim, capacity=0.3, min_capacity=0.05)).train()
    opt = torch.optim.SGD(m.capacity_predictor.parameters(), lr=0.5)
    x = torch.randn(4, 30, dim)
    with torch.no_grad():
        start = m.capacity_predictor(x).mean().item()
    for _ in range(10):
        y, _ = m(x)
        loss = -(y * m.block.c).sum() / y.shape[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        end = m.capacity_predictor(x).mean().item()
    assert end > start + 0.05


def test_soft_mask_is_monotone_in_capacity_and_matches_hard_mask_far_from_boundary():
    scores = torch.randn(2, 40)
    ranks = token_ranks(scores)
    cap = torch.tensor([0.25, 0.75], requires_grad=True)
    soft = soft_capacity_mask(ranks, cap, 40, temperature=1.0)
    hard = ranks < torch.round(cap.detach() * 40)[:, None]
    far = (ranks.float() - cap.detach()[:, None] * 40).abs() > 8
    assert torch.equal(soft[far] > 0.5, hard[far])
    soft.sum().backward()
    assert (cap.grad > 0).all()


def test_aux_selection_is_causal():
    m = _routed(dim=16).eval()
    with torch.no_grad():  # make the aux predictor select a non-trivial fraction
        m.aux.net[2].bias.fill_(0.0)
    S = 25
    x = torch.randn(3, S, 16)
    with torch.no_grad():
        y, info = m(x)
        assert info.mode == "aux"
        assert 0 < info.mask.sum() < info.mask.numel()
        for j in (0, 7, 18):
            x2 = x.clone()
            x2[:, j + 1:] = torch.randn_like(x2[:, j + 1:]) * 3
            y2, info2 = m(x2)
            assert torch.equal(info.mask[:, : j + 1], info2.mask[:, : j + 1])
            torch.testing.assert_close(y[:, : j + 1], y2[:, : j + 1], rtol=1e-5, atol=1e-5)
            assert not torch.equal(info.mask[:, j + 1:], info2.mask[:, j + 1:]) or j + 1 == S


def test_aux_predictor_learns_topk_decision():
    dim = 8
    m = RoutedBlock(nn.Linear(dim, dim), RoutingConfig(dim=dim, learn_capacity=False, capacity=0.5)).train()
    opt = torch.optim.Adam(m.aux.parameters(), lr=3e-2)
    x = torch.randn(32, 16, dim)
    first = None
    for _ in range(60):
        _, info = m(x)
        opt.zero_grad()
        info.aux_loss.backward()
        opt.step()
        first = info.aux_loss.item() if first is None else first
    _, info = m(x)
    acc = ((torch.sigmoid(info.aux_logits) > 0.5) == info.mask).float().mean().item()
    assert info.aux_loss.item() < 0.7 * first
    assert acc > 0.8


def test_config_validation_names_values():
    with pytest.raises(ValueError, match="min_capacity"):
        RoutingConfig(dim=8, min_capacity=0.6, capacity=0.5)
    with pytest.raises(ValueError, match="dim"):
        RoutingConfig(dim=0)
    m = _routed()
    with pytest.raises(ValueError, match="mode"):
        m(torch.randn(1, 4, 16), mode="random")


class _BiasBlock(_CausalBlock):
    """The same block, also callable with an additive attention bias (the packed interface)."""

    accepts_attn_bias = True

    def forward(self, x, attn_bias=None):
        if attn_bias is None:
            return super().forward(x)
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        o = attention(q, k, v, attn_bias=attn_bias).transpose(1, 2).reshape(B, S, D)
        return x + self.out(o)


@pytest.mark.parametrize("mode", ["topk", "aux"])
def test_packed_call_equals_padded_call_in_values_and_gradients(mode):
    torch.manual_seed(3)
    dim, B, S = 16, 6, 20
    padded = RoutedBlock(_CausalBlock(dim), RoutingConfig(dim=dim, capacity=0.3, min_capacity=0.05)).train()
    packed = RoutedBlock(_BiasBlock(dim), RoutingConfig(dim=dim, capacity=0.3, min_capacity=0.05)).train()
    packed.load_state_dict(padded.state_dict())
    with torch.no_grad():  # samples keep very different numbers of tokens, so packing is chosen
        packed.capacity_predictor.net[2].weight.normal_(0, 3.0)
        padded.capacity_predictor.net[2].weight.copy_(packed.capacity_predictor.net[2].weight)
        packed.aux.net[2].weight.normal_(0, 2.0)
        packed.aux.net[2].bias.fill_(-1.0)
        padded.aux.load_state_dict(packed.aux.state_dict())
    x = torch.randn(B, S, dim)
    x[0] *= 4.0
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1:5, 6:] = True  # short samples keep few tokens, the long ones many
    outs, grads = [], []
    for m in (padded, packed):
        xi = x.clone().requires_grad_(True)
        y, info = m(xi, mode=mode, key_padding_mask=pad)
        (y.square().sum() + info.aux_loss + info.capacity_cost).backward()
        outs.append((y.detach(), info.mask))
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
    k = outs[0][1].sum(-1)
    assert int(k.sum()) <= 0.8 * B * int(k.max()), "the case must exercise the packed path"
    assert torch.equal(outs[0][1], outs[1][1])
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-5, rtol=1e-5)
    for g0, g1 in zip(*grads):
        if g0 is None:
            assert g1 is None or not g1.any()
        else:
            # fp32 sums in another order (packed rows): differences ~1e-6 of the gradient's scale (up to 209 here)
            torch.testing.assert_close(g1, g0, atol=1e-5 + 2e-6 * float(g0.abs().max()), rtol=1e-4)
