"""core.routing: exact top-k, capacity gradient, causal auxiliary selection, routed-block semantics."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from core.attention import attention
from core.routing import (RoutedBlock, RoutingConfig, prefix_ranks, prefix_topk_mask, soft_capacity_mask,
                          token_ranks, topk_mask)


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


# ---- two-sided capacity gradient (probe tokens) and causal prefix top-k -------------------------------------


class _PushBlock(nn.Module):
    """Adds ``3 u`` (``u`` a fixed unit vector) to every token it sees; optionally takes an attention bias."""

    def __init__(self, dim: int, accepts_bias: bool):
        super().__init__()
        u = torch.randn(dim)
        self.register_buffer("u", u / u.norm())
        self.accepts_attn_bias = accepts_bias

    def forward(self, x, attn_bias=None):
        return x + 3.0 * self.u


def _capacity_after_training(m, x, loss_fn, steps=10, lr=0.5):
    opt = torch.optim.SGD(m.capacity_predictor.parameters(), lr=lr)
    with torch.no_grad():
        start = m.capacity_predictor(x).mean().item()
    for _ in range(steps):
        y, info = m(x)
        loss = loss_fn(y - x)  # zero compute cost: only the task loss moves the capacity
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        end = m.capacity_predictor(x).mean().item()
    return start, end


@pytest.mark.parametrize("accepts_bias", [False, True])
@pytest.mark.parametrize("selection", ["topk", "prefix"])
def test_capacity_rises_when_adding_tokens_would_lower_the_loss(accepts_bias, selection):
    """Each token's loss is relu(1 - <update, u>): the selected tokens' updates (3 w u, w ~ 0.95) already reach it,
    so only tokens not yet processed can lower the loss. The two-sided estimator raises capacity; the one-sided one
    (probe_tokens=0) sees no gradient at all: it cannot learn that adding a token helps."""
    dim = 8
    x = torch.randn(4, 30, dim)

    def loss_fn(upd):
        return torch.relu(1.0 - upd @ block.u).sum() / upd.shape[0]

    results = {}
    for probes in (4, 0):
        torch.manual_seed(1)
        block = _PushBlock(dim, accepts_bias)
        cfg = RoutingConfig(dim=dim, capacity=0.3, min_capacity=0.05, probe_tokens=probes, train_selection=selection)
        m = RoutedBlock(block, cfg).train()
        with torch.no_grad():
            m.router.proj.bias.fill_(3.0)  # router weights w = sigmoid(score) ~ 0.95
        results[probes] = _capacity_after_training(m, x, loss_fn)
    start, end = results[4]
    assert end > start + 0.1, results
    start0, end0 = results[0]
    assert abs(end0 - start0) < 1e-6, results


@pytest.mark.parametrize("probes", [4, 0])
@pytest.mark.parametrize("selection", ["topk", "prefix"])
def test_capacity_falls_when_processed_tokens_raise_the_loss(probes, selection):
    dim = 8
    torch.manual_seed(2)
    block = _PushBlock(dim, accepts_bias=True)
    m = RoutedBlock(block, RoutingConfig(dim=dim, capacity=0.6, min_capacity=0.05, probe_tokens=probes,
                                         train_selection=selection)).train()
    start, end = _capacity_after_training(m, torch.randn(4, 30, dim), lambda upd: (upd @ block.u).sum() / upd.shape[0])
    assert end < start - 0.1


def test_probes_change_only_the_capacity_gradient():
    """Probe tokens run the block with gate value 0: outputs, and gradients of the input, block, router and
    auxiliary predictor are those of the one-sided estimator; the capacity predictor's gradient differs."""
    torch.manual_seed(4)
    dim, B, S = 16, 3, 21
    models = []
    for probes in (0, 4):
        torch.manual_seed(5)
        models.append(RoutedBlock(_BiasBlock(dim), RoutingConfig(dim=dim, capacity=0.4, probe_tokens=probes)).train())
    x = torch.randn(B, S, dim)
    target = torch.randn(B, S, dim)
    outs = []
    for m in models:
        xi = x.clone().requires_grad_(True)
        y, info = m(xi)
        ((y - target).square().sum() + info.aux_loss).backward()
        outs.append((y.detach(), xi.grad, {n: p.grad for n, p in m.named_parameters()}))
        assert torch.equal(y[~info.mask], x[~info.mask])  # probes included: unselected tokens pass unchanged
    # the same function; with probes the block runs under a bias (another summation order)
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-6)
    for n, g0 in outs[0][2].items():
        g1 = outs[1][2][n]
        if n.startswith("capacity_predictor"):
            continue
        torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-6, msg=n)
    w0, w1 = outs[0][2]["capacity_predictor.net.2.bias"], outs[1][2]["capacity_predictor.net.2.bias"]
    assert not torch.allclose(w0, w1)


@pytest.mark.parametrize("selection", ["topk", "prefix"])
def test_probe_paths_agree_padded_bias_packed_and_prefix_rows(selection, monkeypatch):
    """The three ways to run probes (per-row bias, packed bias, one prefix row per probe for a block without a bias)
    give the same outputs and gradients."""
    import core.routing as routing

    torch.manual_seed(6)
    dim, B, S = 16, 4, 18
    cfg = dict(dim=dim, capacity=0.5, min_capacity=0.05, probe_tokens=3, train_selection=selection)
    plain = RoutedBlock(_CausalBlock(dim), RoutingConfig(**cfg)).train()
    biased = RoutedBlock(_BiasBlock(dim), RoutingConfig(**cfg)).train()
    biased.load_state_dict(plain.state_dict())
    x = torch.randn(B, S, dim)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[2, 14:] = True
    results = []
    # prefix rows (no bias); per-row bias (packing off); packed (packing forced)
    for m, pack_limit, saving in ((plain, 2048, 0.2), (biased, 0, 0.2), (biased, 10_000, -1.0)):
        monkeypatch.setattr(routing, "_PACK_MAX_TOKENS", pack_limit)
        monkeypatch.setattr(routing, "_PACK_MIN_SAVING", saving)
        m.zero_grad()
        xi = x.clone().requires_grad_(True)
        y, info = m(xi, key_padding_mask=pad)
        (y.square().sum() + info.capacity_cost + info.aux_loss).backward()
        results.append((y.detach(), info.mask, xi.grad, [p.grad.clone() for p in m.parameters()]))
    assert results[0][1].any() and not results[0][1].all()
    for y, mask, gx, gp in results[1:]:
        assert torch.equal(mask, results[0][1])
        torch.testing.assert_close(y, results[0][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gx, results[0][2], rtol=1e-4, atol=1e-5)
        for g, g0 in zip(gp, results[0][3]):
            torch.testing.assert_close(g, g0, rtol=1e-4, atol=1e-5 + 1e-5 * float(g0.abs().max()))


def test_prefix_topk_mask_matches_brute_force():
    B, S = 5, 17
    scores = torch.randint(0, 4, (B, S)).float() + 0.1 * torch.randn(B, S).round()  # ties
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, 12:] = True
    cap = torch.rand(B) * 0.8 + 0.1
    mask = prefix_topk_mask(scores, cap, pad)
    for b in range(B):
        for i in range(S):
            if pad[b, i]:
                assert not mask[b, i]
                continue
            rank = sum(1 for j in range(i) if not pad[b, j] and scores[b, j] >= scores[b, i])
            n = sum(1 for j in range(i + 1) if not pad[b, j])
            assert bool(mask[b, i]) == (rank < cap[b].item() * n - 0.5), (b, i)


def test_prefix_selection_is_causal_in_training_and_topk_is_not():
    torch.manual_seed(7)
    dim, S = 16, 24
    m = _routed(dim=dim, capacity=0.4, train_selection="prefix").train()
    with torch.no_grad():
        m.capacity_predictor.net[2].weight.normal_(0, 1.0)  # capacity depends on the tokens seen so far
    x = torch.randn(3, S, dim)
    y, info = m(x)
    assert info.mode == "prefix"
    frac = info.mask.float().mean().item()
    assert 0.1 < frac < 0.9
    topk_changed = False
    for j in (3, 11, 19):
        x2 = x.clone()
        x2[:, j + 1:] = torch.randn_like(x2[:, j + 1:]) * 3
        y2, info2 = m(x2)
        assert torch.equal(info.mask[:, : j + 1], info2.mask[:, : j + 1])
        torch.testing.assert_close(y[:, : j + 1], y2[:, : j + 1], rtol=1e-5, atol=1e-5)
        _, t1 = m(x, mode="topk")
        _, t2 = m(x2, mode="topk")
        topk_changed |= not torch.equal(t1.mask[:, : j + 1], t2.mask[:, : j + 1])
    assert topk_changed, "top-k over the whole sequence should depend on later tokens"


def test_prefix_selection_follows_the_predicted_capacity():
    torch.manual_seed(3)
    dim, S = 16, 24
    m = _routed(dim=dim, capacity=0.4, train_selection="prefix").train()
    with torch.no_grad():
        m.capacity_predictor.net[2].weight.normal_(0, 1.0)  # capacity varies with the prefix
    x = torch.randn(4, S, dim)
    _, info = m(x, mode="prefix")
    with torch.no_grad():
        c_BS = m.capacity_predictor.prefix(x)
    rank_BS, n_BS = prefix_ranks(info.scores)
    assert torch.equal(info.mask, rank_BS < c_BS * n_BS - 0.5)  # position i's cut: its own predicted capacity
    fixed = prefix_topk_mask(info.scores, m.config.capacity)
    assert not torch.equal(info.mask, fixed)  # the predicted capacity changes the selection here


def test_new_config_fields_are_validated():
    with pytest.raises(ValueError, match="probe_tokens"):
        RoutingConfig(dim=8, probe_tokens=-1)
    with pytest.raises(ValueError, match="train_selection.*'causal'"):
        RoutingConfig(dim=8, train_selection="causal")
