"""core.infra.backbones: strict key matching, constructor kwargs, file formats, and the video frame encoders on it."""

from __future__ import annotations

import ast
import builtins
import logging
from pathlib import Path

import open_clip  # timm and open_clip_torch are dependencies (the backbones extra): tests run, never skip
import pytest
import timm
import torch
from safetensors.torch import save_file

from core.infra.backbones import (
    build_open_clip,
    build_timm,
    load_open_clip,
    load_state_dict_file,
    load_timm,
    load_weights,
    resolve_timm_kwargs,
)

REPO = Path(__file__).resolve().parents[1]


VIT_KW = {"img_size": 32, "depth": 2}  # a tiny ViT-Ti/16: 2 blocks on 32 px (4 patches)
# A hand-made tiny open_clip config (ViT-S-32 renamed to a 2-block, 64-wide tower on 32 px).
CLIP_KW = {"embed_dim": 32,
           "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 16, "head_width": 32},
           "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 32, "heads": 2, "layers": 1}}


def _vit(**kw):
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, **{**VIT_KW, **kw}).eval()


def _save(sd, path):
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


def test_timm_loads_safetensors_and_torch_files_identically(tmp_path):
    ref = _vit()
    x = torch.randn(2, 3, 32, 32)
    a = load_timm("vit_tiny_patch16_224", _save(ref.state_dict(), tmp_path / "w.safetensors"), model_kwargs=VIT_KW)
    torch.save({"state_dict": {"module." + k: v for k, v in ref.state_dict().items()}}, tmp_path / "w.pth")
    b = load_timm("vit_tiny_patch16_224", tmp_path / "w.pth", model_kwargs=VIT_KW)
    with torch.no_grad():
        torch.testing.assert_close(a.model(x), ref(x))
        torch.testing.assert_close(b.model(x), ref(x))
    assert (a.num_features, a.input_size, a.library) == (192, 32, "timm")
    assert a.missing == a.unexpected == a.mismatched == []


def test_timm_mismatch_is_an_error_unless_relaxed(tmp_path, caplog):
    sd = _vit().state_dict()
    path = _save({k: v for k, v in sd.items() if not k.startswith("blocks.1.")}, tmp_path / "partial.safetensors")
    with pytest.raises(ValueError, match=r"missing \d+ key\(s\): blocks\.1\..*allow-partial-weights"):
        load_timm("vit_tiny_patch16_224", path, model_kwargs=VIT_KW)
    with caplog.at_level(logging.WARNING, logger="core.infra.backbones"):
        bb = load_timm("vit_tiny_patch16_224", path, model_kwargs=VIT_KW, strict=False)
    assert bb.missing and all(k.startswith("blocks.1.") for k in bb.missing)
    assert "strict=False" in caplog.text
    # the keys that were in the file did load
    torch.testing.assert_close(bb.model.state_dict()["blocks.0.attn.qkv.weight"], sd["blocks.0.attn.qkv.weight"])

    extra = _save({**sd, "foo.bar": torch.zeros(3)}, tmp_path / "extra.safetensors")
    with pytest.raises(ValueError, match="unexpected 1 key"):
        load_timm("vit_tiny_patch16_224", extra, model_kwargs=VIT_KW)
    # the same file in a model of another depth: shape-compatible keys, but missing and unexpected ones
    with pytest.raises(ValueError, match="missing"):
        load_timm("vit_tiny_patch16_224", extra, model_kwargs={**VIT_KW, "depth": 3})


def test_shape_mismatch_is_reported_not_crashed(tmp_path):
    sd = _vit().state_dict()
    path = _save(sd, tmp_path / "w.safetensors")
    with pytest.raises(ValueError, match="shape mismatch.*pos_embed"):
        load_timm("vit_tiny_patch16_224", path, model_kwargs={**VIT_KW, "img_size": 64})
    bb = load_timm("vit_tiny_patch16_224", path, model_kwargs={**VIT_KW, "img_size": 64}, strict=False)
    assert bb.mismatched == ["pos_embed"] and bb.input_size == 64


def test_classifier_in_file_is_dropped_for_a_feature_model(tmp_path):
    torch.manual_seed(0)
    m = timm.create_model("resnet18", pretrained=False, num_classes=10)
    bb = load_timm("resnet18", _save(m.state_dict(), tmp_path / "r18.safetensors"))
    assert bb.num_features == 512 and bb.unexpected == []
    x = torch.randn(1, 3, 64, 64)
    m.eval()
    with torch.no_grad():
        torch.testing.assert_close(bb.model(x), m.forward_head(m.forward_features(x), pre_logits=True))


def test_constructor_kwargs_by_layer_name(tmp_path):
    kw = {"img_size": 28, "depth": 1, "embed_dim": 96, "num_heads": 2, "reg_tokens": 4, "init_values": 1e-5,
          "mlp_ratio": 5.3375, "mlp_layer": "SwiGLUPacked", "act_layer": "silu", "global_pool": ""}
    resolved = resolve_timm_kwargs(kw)
    assert resolved["mlp_layer"] is timm.layers.SwiGLUPacked and resolved["act_layer"] == "silu"
    torch.manual_seed(0)
    ref = timm.create_model("vit_huge_patch14_224", pretrained=False, num_classes=0, **resolved)
    bb = load_timm("vit_huge_patch14_224", _save(ref.state_dict(), tmp_path / "v.safetensors"), model_kwargs=kw)
    assert bb.model.num_prefix_tokens == 5 and bb.model.blocks[0].ls1.gamma.shape == (96,)
    with pytest.raises(ValueError, match="not a class in timm.layers"):
        resolve_timm_kwargs({"mlp_layer": "NoSuchMlp"})
    with pytest.raises(ValueError, match="cannot be built"):
        load_timm("vit_tiny_patch16_224", tmp_path / "v.safetensors", model_kwargs={"no_such_arg": 1})
    with pytest.raises(ValueError, match="unknown timm model"):
        load_timm("no_such_model_xyz", tmp_path / "v.safetensors")


def test_weights_required_and_files_checked(tmp_path):
    with pytest.raises(ValueError, match="nothing is downloaded"):
        load_timm("resnet18", None)
    with pytest.raises(FileNotFoundError):
        load_timm("resnet18", tmp_path / "missing.safetensors")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"junk\.pt is not a readable PyTorch checkpoint file .*a torch state dict"):
        load_state_dict_file(tmp_path / "junk.pt")
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="expected a dict of tensors"):
        load_state_dict_file(tmp_path / "list.pt")


def test_missing_package_names_the_install_command(monkeypatch, tmp_path):
    real_import = builtins.__import__

    def fake(name, *a, **k):
        if name in ("timm", "open_clip"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *a, **k)

    path = _save(_vit().state_dict(), tmp_path / "w.safetensors")
    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ImportError, match=r"pip install 'longctx-suite\[backbones\]'"):
        load_timm("vit_tiny_patch16_224", path)
    with pytest.raises(ImportError, match="open_clip_torch"):
        load_open_clip("ViT-S-32", path)


def test_open_clip_tower_from_full_or_visual_checkpoint(tmp_path):
    torch.manual_seed(0)
    full = open_clip.create_model("ViT-S-32", pretrained=None, **CLIP_KW).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = full.visual(x)
    a = load_open_clip("ViT-S-32", _save(full.state_dict(), tmp_path / "clip.safetensors"), model_kwargs=CLIP_KW)
    b = load_open_clip("ViT-S-32", _save(full.visual.state_dict(), tmp_path / "vis.safetensors"), model_kwargs=CLIP_KW)
    with torch.no_grad():
        torch.testing.assert_close(a.model(x), ref)
        torch.testing.assert_close(b.model(x), ref)
    assert (a.num_features, a.input_size) == (32, 32)
    # only the image size changed: the config is merged, not replaced
    with pytest.raises(ValueError, match="shape mismatch"):
        load_open_clip("ViT-S-32", tmp_path / "vis.safetensors",
                       model_kwargs={**CLIP_KW, "vision_cfg": {"image_size": 64}})
    with pytest.raises(ValueError, match="unknown open_clip model"):
        load_open_clip("No-Such-Clip", tmp_path / "vis.safetensors")


def test_build_without_weights_is_the_loaders_architecture(tmp_path):
    """build_timm / build_open_clip: the same model, kwargs and normalisation as the loaders, no file needed."""
    kw = {**VIT_KW, "reg_tokens": 2, "mlp_layer": "SwiGLUPacked", "act_layer": "silu", "mlp_ratio": 2.0}
    torch.manual_seed(0)
    built = build_timm("vit_tiny_patch16_224", model_kwargs=kw)
    assert not built.model.training and built.missing == built.unexpected == built.mismatched == []
    assert isinstance(built.model.blocks[0].mlp, timm.layers.GluMlp) and built.model.num_prefix_tokens == 3
    assert (built.library, built.num_features, built.input_size) == ("timm", 192, 32)
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, **resolve_timm_kwargs(kw))
    assert {k: v.shape for k, v in built.model.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    loaded = load_timm("vit_tiny_patch16_224", _save(built.model.state_dict(), tmp_path / "b.safetensors"), model_kwargs=kw)
    assert (loaded.mean, loaded.std, loaded.input_size) == (built.mean, built.std, built.input_size)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x), built.model(x))
    with pytest.raises(ValueError, match="unknown timm model"):
        build_timm("no_such_model_xyz")
    with pytest.raises(ValueError, match="cannot be built"):
        build_timm("vit_tiny_patch16_224", model_kwargs={"no_such_arg": 1})

    torch.manual_seed(0)
    tower = build_open_clip("ViT-S-32", model_kwargs=CLIP_KW)
    assert not tower.model.training and (tower.library, tower.num_features, tower.input_size) == ("open_clip", 32, 32)
    full = open_clip.create_model("ViT-S-32", pretrained=None, **CLIP_KW)
    assert tower.model.state_dict().keys() == full.visual.state_dict().keys()
    clip = load_open_clip("ViT-S-32", _save(tower.model.state_dict(), tmp_path / "t.safetensors"), model_kwargs=CLIP_KW)
    assert (clip.mean, clip.std) == (tower.mean, tower.std) != (built.mean, built.std)  # CLIP's, not ImageNet's
    with torch.no_grad():
        torch.testing.assert_close(clip.model(x), tower.model(x))
    with pytest.raises(ValueError, match="unknown open_clip model"):
        build_open_clip("No-Such-Clip")


def test_building_without_weights_names_the_install_command(monkeypatch):
    real_import = builtins.__import__

    def fake(name, *a, **k):
        if name in ("timm", "open_clip"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ImportError, match=r"pip install 'longctx-suite\[backbones\]'"):
        build_timm("vit_tiny_patch16_224")
    with pytest.raises(ImportError, match="open_clip_torch"):
        build_open_clip("ViT-S-32")


def _model_constructor_calls(path: Path) -> list[str]:
    """``timm.create_model`` / ``open_clip.create_model*`` uses in a source file (calls, attributes, imports)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("create_model"):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("timm", "open_clip"):
            found += [f"{path.relative_to(REPO)}:{node.lineno}: from {node.module} import {a.name}"
                      for a in node.names if a.name.startswith("create_model")]
    return found


def test_only_core_backbones_builds_timm_and_open_clip_models():
    """One backbone loader: outside core/infra/backbones.py no package calls timm/open_clip's model constructors
    (tests may, to make reference models)."""
    skip = {REPO / "core" / "infra" / "backbones.py"}
    sources = [p for p in REPO.rglob("*.py") if p not in skip
               and not any(part.startswith(".") or part == "tests" or part.endswith(".egg-info")
                           for part in p.relative_to(REPO).parts)]
    assert REPO / "apps" / "comemo" / "encoders.py" in sources and len(sources) > 50
    calls = [c for p in sorted(sources) for c in _model_constructor_calls(p)]
    assert calls == [], "build through core.infra.backbones (build_timm / load_timm / build_open_clip / load_open_clip):\n" + "\n".join(calls)
    # the check sees the forms it forbids
    probe = REPO / "core" / "infra" / "backbones.py"
    assert any(".create_model" in c for c in _model_constructor_calls(probe))


def test_load_weights_on_a_plain_module():
    m = torch.nn.Linear(3, 2)
    sd = {"weight": torch.randn(2, 3)}
    with pytest.raises(ValueError, match="missing 1 key"):
        load_weights(m, sd)
    missing, unexpected, mismatched = load_weights(m, sd, strict=False)
    assert missing == ["bias"] and unexpected == mismatched == []
    torch.testing.assert_close(m.weight.detach(), sd["weight"])


# ---------------------------------------------------------------------------------------------- video


def test_video_frame_encoders_on_the_core_loader(tmp_path):
    from video.encoders import build_frame_encoder

    ref = _vit()
    path = _save(ref.state_dict(), tmp_path / "vit.safetensors")
    enc = build_frame_encoder("timm:vit_tiny_patch16_224", weights=path, encoder_kwargs=VIT_KW)
    frames = torch.randint(0, 255, (3, 3, 40, 48), dtype=torch.uint8)
    out = enc(frames)
    assert out.shape == (3, 5, 192) and enc.dim == 192  # class token + 4 patch tokens at 32 px
    partial = _save({k: v for k, v in ref.state_dict().items() if k != "norm.weight"}, tmp_path / "p.safetensors")
    with pytest.raises(ValueError, match="norm.weight"):
        build_frame_encoder("timm:vit_tiny_patch16_224", weights=partial, encoder_kwargs=VIT_KW)
    relaxed = build_frame_encoder("timm:vit_tiny_patch16_224", weights=partial, encoder_kwargs=VIT_KW, strict=False)
    assert relaxed.dim == 192

    torch.manual_seed(0)
    full = open_clip.create_model("ViT-S-32", pretrained=None, **CLIP_KW)
    clip = build_frame_encoder("open_clip:ViT-S-32", weights=_save(full.state_dict(), tmp_path / "c.safetensors"),
                               encoder_kwargs=CLIP_KW)
    assert clip(frames).shape == (3, 1, 32) and clip.input_size == 32
    with pytest.raises(ValueError, match="takes input_size and encoder_kwargs"):
        build_frame_encoder("timm:vit_tiny_patch16_224", weights=path, dim=8)

    tiny = build_frame_encoder("tiny", encoder_kwargs={"dim": 16, "input_size": 32, "width": 8})
    sd = {k: v for k, v in tiny.state_dict().items() if not k.startswith("proj.")}
    with pytest.raises(ValueError, match="proj.weight"):
        build_frame_encoder("tiny", weights=_save(sd, tmp_path / "t.safetensors"), dim=16, input_size=32, width=8)
