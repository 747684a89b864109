"""Run Decision Mixer's released model code on a tiny random model and write what it computes as test fixtures.

Usage (in an environment with a transformers 4.x that still ships the helpers the release imports; see
``tests/fixtures/rl/README.md``)::

    python tools/reference/rl/make_fixtures.py RELEASE_DIR tests/fixtures/rl

``RELEASE_DIR`` is a checkout of ruthless-man/Decision-Mixer; its ``DM`` package (``DM/DM.py``,
``DM/trajectory_gpt2.py``, ``DM/DM_decision_transformer.py``) is imported from there, nothing of it is copied. The
script builds the release's ``DecisionTransformer`` (whose GPT-2 routes every odd layer through ``DM.DM.DM``) at
tiny shapes, draws its weights from a seed, runs one forward pass in ``eval()`` (the auxiliary predictor decides)
and one in ``train()`` (top-k with the predicted capacity) on fixed inputs, and records, per routed layer, the
release's own local variables at the end of ``DM.forward`` (router ``weights``, capacity ``k_values``,
``selected_mask``, auxiliary ``logits``, ``loss_aux``) and the action predictions.

Work-arounds, all here and none in the project:

- ``DM_decision_transformer.py`` imports ``prompt_dt.trajectory_gpt2``, a module the release does not ship: the
  name is bound to the release's ``DM/trajectory_gpt2.py``.
- ``GPT2Model.forward`` (``trajectory_gpt2.py``, last lines) passes ``mask_ave=`` to transformers'
  ``BaseModelOutputWithPastAndCrossAttentions``, which has no such field (``TypeError``): that name is bound to
  ``dict`` in the release module (``DecisionTransformer`` reads the result with ``[...]``).
- ``Attention.forward`` (``trajectory_gpt2.py`` lines 189-190) applies ``c_proj`` to the per-head output
  ``(B, H, S, D / H)`` without calling the class's own ``merge_heads``: ``RuntimeError: mat1 and mat2 shapes cannot
  be multiplied`` for any ``n_head > 1`` (``main.py``'s default is 4; with one head the residual sum broadcasts to
  ``(B, B, S, D)``). The harness applies the release's ``merge_heads`` to ``_attn``'s output, as GPT-2 does.
- ``DM.__init__`` hard-wires the router's width to 256 and ``max_tokens`` to 360 (3 x 120 timesteps), so only the
  published shape runs: the tiny width and ``3 * K`` are passed instead (``TokenRouter`` is given the model's
  width; ``DM``'s default ``max_tokens`` is set to ``3 * K``). Nothing else of the routing is touched.
- ``Attention`` reads ``config.n_ctx``, which ``GPT2Config`` no longer defines: ``n_ctx = 3 * K`` is passed
  through the model's ``**kwargs`` as the release's own ``get_model_optimizer`` passes extra keys.
- dropout is 0 so that the ``train()`` pass is deterministic.

The ``train()`` pass also runs the release's in-forward step of the auxiliary predictor's Adam; it is done after
the ``eval()`` pass, and the weights saved are those before either pass.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

SEED = 0
CFG = dict(state_dim=3, act_dim=2, K=4, hidden=16, n_layer=4, n_head=2, max_ep_len=50, batch=4)


def load_release(release: Path, hidden: int, max_tokens: int):
    """Import the release's model modules with the work-arounds of the module docstring."""
    sys.path.insert(0, str(release))
    dm_mod = importlib.import_module("DM.DM")
    gpt_mod = importlib.import_module("DM.trajectory_gpt2")
    sys.modules["prompt_dt"] = type(sys)("prompt_dt")
    sys.modules["prompt_dt.trajectory_gpt2"] = gpt_mod
    gpt_mod.BaseModelOutputWithPastAndCrossAttentions = dict
    release_attn = gpt_mod.Attention._attn

    def _attn_merged(self, *args, **kwargs):  # the release's merge_heads, which its Attention.forward never calls
        outputs = release_attn(self, *args, **kwargs)
        return [self.merge_heads(outputs[0])] + list(outputs[1:])

    gpt_mod.Attention._attn = _attn_merged

    release_router = dm_mod.TokenRouter

    class _Router(release_router):  # the release's router at the model's width instead of the hard-wired 256
        def __init__(self, embed_dim, max_tokens):
            super().__init__(hidden, max_tokens)

    dm_mod.TokenRouter = _Router
    dm_mod.DM.__init__.__defaults__ = (True, max_tokens)  # (aux_loss_on, max_tokens)
    dt_mod = importlib.import_module("DM.DM_decision_transformer")
    return dm_mod, dt_mod


def fill_weights(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Random weights at scales that make routing decisions non-trivial (distinct router scores, capacities that
    differ between samples, auxiliary predictions of both classes)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or "ln_f" in name or "embed_ln" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "k_predictor.0.weight" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif "k_predictor.2.weight" in name:
                p.copy_(2.0 * torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif "weight_predictor" in name or "aux_predictor" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / max(p.shape[-1], 1) ** 0.5)
            elif p.ndim >= 2:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen) / p.shape[0] ** 0.5)
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


class LocalsRecorder:
    """Copies chosen locals of a function at each of its returns (``sys.setprofile``), in call order."""

    def __init__(self, code, names):
        self.code, self.names, self.calls = code, names, []

    def __call__(self, frame, event, arg):
        if event == "return" and frame.f_code is self.code:
            loc = frame.f_locals
            self.calls.append({n: (loc[n].detach().clone() if torch.is_tensor(loc[n]) else loc[n])
                               for n in self.names if n in loc})

    def __enter__(self):
        sys.setprofile(self)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("release", type=Path, help="checkout of ruthless-man/Decision-Mixer")
    p.add_argument("out", type=Path, help="fixture folder to write")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    c = CFG
    S = 3 * c["K"]
    dm_mod, dt_mod = load_release(args.release.resolve(), c["hidden"], S)
    torch.manual_seed(SEED)  # the release's own init (overwritten below) and its aux optimizer
    model = dt_mod.DecisionTransformer(
        state_dim=c["state_dim"], act_dim=c["act_dim"], hidden_size=c["hidden"], max_length=c["K"],
        max_ep_len=c["max_ep_len"], n_layer=c["n_layer"], n_head=c["n_head"], n_inner=4 * c["hidden"],
        activation_function="gelu", resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0, n_ctx=S)
    gen = torch.Generator().manual_seed(SEED)
    fill_weights(model, gen)
    weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
               if not k.endswith(".attn.bias") and not k.endswith(".attn.masked_bias")}

    B, T = c["batch"], c["K"]
    inputs = {
        "states": torch.randn(B, T, c["state_dim"], generator=gen),
        "actions": torch.rand(B, T, c["act_dim"], generator=gen) * 2 - 1,
        "returns_to_go": torch.randn(B, T, 1, generator=gen),
        "timesteps": torch.randint(0, c["max_ep_len"], (B, T), generator=gen),
    }
    names = ["weights", "k_values", "selected_mask", "logits", "loss_aux"]
    out = dict(inputs)
    meta = {"config": c, "seq_len": S, "routed_layers": [i for i in range(c["n_layer"]) if i % 2 == 1],
            "seed": SEED, "passes": {}}
    for mode in ("eval", "train"):
        model.train(mode == "train")
        with LocalsRecorder(dm_mod.DM.forward.__code__, names) as rec:
            _, action_preds, _, mask_ave = model(inputs["states"], inputs["actions"], inputs["returns_to_go"],
                                                 inputs["timesteps"])
        out[f"{mode}.action_preds"] = action_preds.detach().clone()
        layer_meta = []
        for j, loc in enumerate(rec.calls):
            out[f"{mode}.layer{j}.router_scores"] = loc["weights"]
            out[f"{mode}.layer{j}.selected"] = loc["selected_mask"].to(torch.uint8)
            out[f"{mode}.layer{j}.aux_logits"] = loc["logits"].reshape(B, S, 2)
            out[f"{mode}.layer{j}.k"] = loc["k_values"]
            entry = {"k": loc["k_values"].tolist(), "selected_per_sample": loc["selected_mask"].sum(1).tolist()}
            if "loss_aux" in loc:
                out[f"{mode}.layer{j}.aux_loss"] = loc["loss_aux"].reshape(())
                entry["aux_loss"] = float(loc["loss_aux"])
            layer_meta.append(entry)
        meta["passes"][mode] = {"layers": layer_meta, "mask_ave": [float(m) for m in mask_ave]}

    from safetensors.torch import save_file

    args.out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(args.out / "dm_release_weights.safetensors"))
    save_file({k: v.contiguous() for k, v in out.items()}, str(args.out / "dm_cases.safetensors"))
    (args.out / "dm_cases.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps(meta["passes"], indent=1))


if __name__ == "__main__":
    main()
