"""Run the released ∞-Video long-term memory on fixed inputs and save what it computes (parity fixtures).

The release (deep-spin/Infinite-Video) is imported from the path given, never copied: its
``infty-VideoChat2/models/blip2/long_term_attention_gibbs.py`` and the ``basis_functions.py`` beside it are loaded as a
package from that folder. Run it in an environment of its own (CPU, float32); nothing in the release is edited.
What this harness changes, all from the outside:

- the sticky draws: the module's ``torch.distributions`` is replaced by a shim whose ``Categorical`` over the
  density bins draws with a fixed seed (``torch.multinomial``) and records the probabilities and the draws; the
  one-category ``Categorical`` the release uses for the place inside a bin is left as it is (it always gives 0);
- the Gaussian cases: ``add_retangular_basis_functions`` (the only basis the release wires in) is replaced by the
  release's own ``add_gaussian_basis_functions`` with one width;
- it runs in a temporary working directory.

For each case: ``C`` chunks of ``L`` frames (each frame's 14x14 tokens of width 1024, the VideoChat2 layout, all equal
to the frame's vector), new queries per chunk, the key/value projections of one Q-former layer (width 1024 -> 2 heads
of 8). Saved per chunk: the frame vectors, queries, the fit (``B_past``), the context vector (the module's output), the
Gibbs density at 1000 points per head and query, and for chunks after the first the sticky draw probabilities, the
draws, and the first 32 features of the resampled old signal (``x_past[:, :, :M]``).

    python tools/reference/video/memory_parity.py --release RELEASE_DIR --out tests/fixtures/video [--commit SHA]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import torch

REL = "infty-VideoChat2/models/blip2"
HEADS, HEAD_DIM, WIDTH, QLEN, M, KEEP_FEATURES = 2, 8, 1024, 4, 512, 32

# name: basis, num_basis, chunk length, chunks, sticky, tau, Gaussian width
CASES = {
    "box_sticky": dict(basis="box", num_basis=16, length=16, chunks=4, sticky=True, tau=0.75, width=None),
    "box_even": dict(basis="box", num_basis=16, length=8, chunks=3, sticky=False, tau=0.75, width=None),
    "box_sticky_oddlen": dict(basis="box", num_basis=8, length=7, chunks=3, sticky=True, tau=0.75, width=None),
    "gaussian_sticky": dict(basis="gaussian", num_basis=12, length=12, chunks=4, sticky=True, tau=0.75, width=0.08),
}


def load_release(release: Path) -> types.ModuleType:
    """The release's memory module, imported as a package from its own folder."""
    folder = release / REL
    pkg = types.ModuleType("infvideo_release")
    pkg.__path__ = [str(folder)]
    sys.modules["infvideo_release"] = pkg
    for name in ("basis_functions", "long_term_attention_gibbs"):
        spec = importlib.util.spec_from_file_location(f"infvideo_release.{name}", folder / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return sys.modules["infvideo_release.long_term_attention_gibbs"]


class _FixedCategorical:
    """``torch.distributions`` shim: the bin draws come from a fixed-seed generator and are recorded."""

    def __init__(self, real, log: list, seed: int) -> None:
        self.real, self.log, self.gen = real, log, torch.Generator().manual_seed(seed)

    def Categorical(self, probs):  # noqa: N802 (the release's name)
        if probs.shape[-1] == 1:
            return self.real.Categorical(probs)
        outer = self

        class _Draw:
            def sample(self, shape):
                (n,) = shape
                draws = torch.multinomial(probs, n, replacement=True, generator=outer.gen).T  # (n, B)
                outer.log.append({"probs": probs.detach().clone(), "draws": draws.clone()})
                return draws
        return _Draw()


def run_case(mod, name: str, case: dict, seed: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    log: list = []
    mod.dist = _FixedCategorical(torch.distributions, log, seed + 1)
    cls = mod.LongTermAttention
    if case["basis"] == "gaussian":
        width = case["width"]
        cls.add_retangular_basis_functions = lambda self, psi, nb, device: self.add_gaussian_basis_functions(
            psi, nb, [width], device)
    proj_key, proj_value = torch.nn.Linear(WIDTH, HEADS * HEAD_DIM), torch.nn.Linear(WIDTH, HEADS * HEAD_DIM)
    with torch.no_grad():
        for p in (*proj_key.parameters(), *proj_value.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * (WIDTH**-0.5 if p.dim() == 2 else 0.5))
    attn = cls(head_size=HEAD_DIM, length=case["length"], target_len=case["length"], attn_func="softmax",
               attn_num_basis=case["num_basis"], continuous=True, attn_drop=0.0, infinite_memory=True, n_layers=1,
               n_heads=HEADS, affines=False, mask=False, mask_type="cnn", kl_regularizer=False, proj_key=proj_key,
               proj_value=proj_value, sigma_0=None, mu_0=None, sticky_memories=case["sticky"], sigmas=[case["width"]],
               tau=case["tau"])
    L = case["length"]
    out = {"key.weight": proj_key.weight.detach().clone(), "key.bias": proj_key.bias.detach().clone(),
           "value.weight": proj_value.weight.detach().clone(), "value.bias": proj_value.bias.detach().clone()}
    with torch.no_grad():
        for c in range(case["chunks"]):
            x = torch.randn(1, L, WIDTH, generator=g) + torch.linspace(-1, 1, L)[None, :, None]  # frames
            k = x[:, :, None, None, :].expand(1, L, 14, 14, WIDTH).reshape(1, L * 196, WIDTH)
            q = torch.randn(1, QLEN, HEADS * HEAD_DIM, generator=g)
            n_log = len(log)
            ctx = attn(k, q, new_doc=c == 0, layer_n=0)
            dens = attn.compute_probability(attn.score, num_points=1000)  # (1, H, Q, 1000)
            out[f"chunk{c}.frames"] = attn.x_past[:, :, -L:].transpose(1, 2).contiguous()  # the release's frame means
            out[f"chunk{c}.queries"] = q
            out[f"chunk{c}.coef"] = attn.B_past.contiguous()  # (1, N, 1024)
            out[f"chunk{c}.context"] = ctx.contiguous()  # (1, QLEN, H * d)
            out[f"chunk{c}.density"] = dens.contiguous()
            if c > 0:
                out[f"chunk{c}.old_signal"] = attn.x_past[:, :KEEP_FEATURES, :M].transpose(1, 2).contiguous()
            if len(log) > n_log:
                out[f"chunk{c}.draw_probs"] = log[-1]["probs"].contiguous()  # (1, 127)
                out[f"chunk{c}.draws"] = log[-1]["draws"].T.contiguous()  # (1, M) indices into draw_probs
    meta = {**case, "heads": HEADS, "head_dim": HEAD_DIM, "width": WIDTH, "queries": QLEN, "num_samples": M,
            "num_bins": 128, "num_points": 1000, "ridge": 0.5, "seed": seed, "gaussian_width": case["width"]}
    return out, meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--release", type=Path, required=True, help="a checkout of deep-spin/Infinite-Video")
    ap.add_argument("--out", type=Path, required=True, help="folder for <case>.safetensors and memory_parity.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit", default=None, help="the release's commit, when RELEASE_DIR is not a git checkout")
    args = ap.parse_args(argv)
    from safetensors.torch import save_file

    release = args.release.resolve()
    if not (release / REL / "long_term_attention_gibbs.py").is_file():
        ap.error(f"{release} has no {REL}/long_term_attention_gibbs.py")
    torch.set_num_threads(1)
    out_dir = args.out.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    mod = load_release(release)
    commit = args.commit
    if commit is None:
        try:
            commit = subprocess.run(["git", "-C", str(release), "rev-parse", "HEAD"], capture_output=True, text=True,
                                    check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            ap.error(f"{release} is not a git checkout: name the release's commit with --commit")
    metas = {}
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            for i, (name, case) in enumerate(CASES.items()):
                tensors, meta = run_case(mod, name, case, args.seed + 100 * i)
                save_file(tensors, str(out_dir / f"memory_{name}.safetensors"))
                metas[name] = meta
                print(f"{name}: {len(tensors)} tensors")
        finally:
            os.chdir(cwd)
    info = {"release": "deep-spin/Infinite-Video", "commit": commit, "module": f"{REL}/long_term_attention_gibbs.py",
            "torch": torch.__version__, "cases": metas}
    (out_dir / "memory_parity.json").write_text(json.dumps(info, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
