"""pathology.encoders: foundation-model presets (scaled down, random weights written here), strict loading,
constructor kwargs, the settings used for batch fingerprints."""

from __future__ import annotations

import json

import numpy as np
import pytest
import timm  # a dependency of the pathology extra (backbones): the tests run, never skip
import torch
from safetensors.torch import save_file

from core.infra.backbones import resolve_timm_kwargs
from pathology.encoders import PRESETS, build_encoder, encoder_settings


# Each preset's architecture at a size a test can build: same constructor arguments, fewer/narrower blocks.
SMALL = {
    "uni": {"depth": 2, "embed_dim": 64, "num_heads": 2, "img_size": 32},
    "uni2-h": {"depth": 2, "embed_dim": 96, "num_heads": 2, "img_size": 28},
    "virchow2": {"depth": 2, "embed_dim": 96, "num_heads": 2, "img_size": 28},
    "gigapath": {"depth": 2, "embed_dim": 96, "num_heads": 2, "img_size": 32},
}


def _write(name: str, path, **extra) -> torch.nn.Module:
    p = PRESETS[name]
    torch.manual_seed(0)
    m = timm.create_model(p.timm_name, pretrained=False, **resolve_timm_kwargs({**p.kwargs, **SMALL[name], **extra}))
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(path))
    return m.eval()


@pytest.mark.parametrize("name", sorted(SMALL))
def test_preset_loads_random_weights_strictly(name, tmp_path):
    assert set(SMALL) == set(PRESETS)
    ref = _write(name, tmp_path / "w.safetensors")
    enc = build_encoder(name, weights=tmp_path / "w.safetensors", device="cpu", encoder_kwargs=SMALL[name])
    size = SMALL[name]["img_size"]
    assert enc.input_size == size
    x = np.random.default_rng(0).integers(0, 255, (2, 40, 40, 3), dtype=np.uint8)
    f = enc.encode(x)
    width = SMALL[name]["embed_dim"]
    assert f.shape == (2, enc.dim) and torch.isfinite(f).all()
    with torch.no_grad():
        tok = ref.forward_features(enc.preprocess(torch.from_numpy(x)))
    if name == "virchow2":  # class token ⊕ mean of the patch tokens after the 4 registers
        assert enc.dim == 2 * width and ref.num_prefix_tokens == 5
        torch.testing.assert_close(f, torch.cat([tok[:, 0], tok[:, 5:].mean(1)], -1))
    else:  # the class token
        assert enc.dim == width
        torch.testing.assert_close(f, tok[:, 0])
    # the published architecture details are really in the model
    blk = enc.model.model.blocks[0] if name == "virchow2" else enc.model.blocks[0]
    assert blk.ls1.gamma.shape == (width,)  # LayerScale (init_values)
    if name in ("uni2-h", "virchow2"):
        assert isinstance(blk.mlp, timm.layers.GluMlp) and isinstance(blk.mlp.act, torch.nn.SiLU)  # SwiGLUPacked
        vit = enc.model.model if name == "virchow2" else enc.model
        assert vit.reg_token.shape[1] == PRESETS[name].kwargs["reg_tokens"]


def test_preset_refuses_weights_of_another_architecture(tmp_path):
    _write("uni", tmp_path / "uni.safetensors")
    # UNI weights into the UNI2-h layout (register tokens, SwiGLU): an error that names the keys
    with pytest.raises(ValueError, match=r"do not fit.*reg_token"):
        build_encoder("uni2-h", weights=tmp_path / "uni.safetensors", device="cpu",
                      encoder_kwargs={**SMALL["uni2-h"], "embed_dim": 64, "mlp_ratio": 4, "img_size": 32,
                                      "patch_size": 16})
    # a depth the file does not have
    with pytest.raises(ValueError, match=r"missing \d+ key\(s\): blocks\.2\."):
        build_encoder("uni", weights=tmp_path / "uni.safetensors", device="cpu",
                      encoder_kwargs={**SMALL["uni"], "depth": 3})
    enc = build_encoder("uni", weights=tmp_path / "uni.safetensors", device="cpu",
                        encoder_kwargs={**SMALL["uni"], "depth": 3}, strict=False)
    assert enc.encode(np.zeros((1, 32, 32, 3), np.uint8)).shape == (1, 64)
    with pytest.raises(ValueError, match="needs --weights"):
        build_encoder("uni", device="cpu")
    with pytest.raises(ValueError, match="must be a dict"):
        build_encoder("uni", weights=tmp_path / "uni.safetensors", device="cpu", encoder_kwargs=[1, 2])


def test_full_size_preset_kwargs_are_accepted_by_timm():
    """The published kwargs build their architecture (at depth 1, on the meta device: no memory)."""
    expect = {"uni": 1024, "uni2-h": 1536, "virchow2": 1280, "gigapath": 1536}
    for name, p in PRESETS.items():
        with torch.device("meta"):
            m = timm.create_model(p.timm_name, pretrained=False, **resolve_timm_kwargs({**p.kwargs, "depth": 1}))
        assert m.num_features == expect[name], name
        assert m.patch_embed.img_size == (224, 224)


def test_default_encoder_is_strict(tmp_path):
    from pathology.encoders import SmallPatchCNN

    m = SmallPatchCNN(dim=16, widths=(8, 16), num_classes=3)
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    meta = {"dim": "16", "input_size": "32", "widths": "8,16"}
    save_file(sd, str(tmp_path / "ok.safetensors"), metadata=meta)
    enc = build_encoder("default", weights=tmp_path / "ok.safetensors", device="cpu")  # the head is ignored
    assert enc.dim == 16
    save_file({k: v for k, v in sd.items() if k != "proj.bias"}, str(tmp_path / "bad.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match="proj.bias"):
        build_encoder("default", weights=tmp_path / "bad.safetensors", device="cpu")
    with pytest.raises(ValueError, match="no encoder_kwargs"):
        build_encoder("default", weights=tmp_path / "ok.safetensors", device="cpu", encoder_kwargs={"dim": 3})


def test_encoder_settings_identify_the_encoder(tmp_path):
    _write("uni", tmp_path / "a.safetensors")
    s = encoder_settings("uni", tmp_path / "a.safetensors", SMALL["uni"])
    assert json.loads(json.dumps(s)) == s  # JSON-serialisable
    assert s["preset"]["timm_name"] == "vit_large_patch16_224" and s["preset"]["kwargs"]["depth"] == 2
    assert s["preset"]["kwargs"]["init_values"] == 1e-5 and s["preset"]["input_size"] == 32
    assert s["weights"]["size"] == (tmp_path / "a.safetensors").stat().st_size
    # a different file, different kwargs, or another name give other settings; the same inputs the same
    _write("uni", tmp_path / "b.safetensors", init_values=1e-4)
    assert encoder_settings("uni", tmp_path / "b.safetensors", SMALL["uni"])["weights"]["sha256_first_mb"] != \
        s["weights"]["sha256_first_mb"]
    assert encoder_settings("uni", tmp_path / "a.safetensors", {**SMALL["uni"], "depth": 3}) != s
    assert encoder_settings("uni", tmp_path / "a.safetensors", dict(reversed(SMALL["uni"].items()))) == s
    d = encoder_settings("default")
    assert d["weights"]["path"].endswith("patch_encoder_small.safetensors") and d["preset"] is None
    assert encoder_settings("timm:resnet18")["weights"] is None
    with pytest.raises(ValueError, match="unknown encoder"):
        encoder_settings("resnet50")
    with pytest.raises(FileNotFoundError):
        encoder_settings("uni", tmp_path / "missing.safetensors")
