"""apps.emloc CLIs: compress a folder / JSONL of demo images, predict against the memory, refuse bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from apps.emloc import EMLoCHost, HostConfig
from apps.emloc.data import make_episode

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from PIL import Image

    root = tmp_path_factory.mktemp("emloc_cli")
    torch.manual_seed(0)
    host = EMLoCHost(HostConfig(dim=32, depth=2, num_heads=4, num_kv_heads=2)).eval()
    host.save(root / "host.safetensors")
    ep = make_episode(11, num_demos=12, num_queries=3, split="eval")
    lines = []
    for i, (img, lab) in enumerate(zip(ep.demo_images, ep.demo_labels)):
        d = root / "demos" / str(int(lab))
        d.mkdir(parents=True, exist_ok=True)
        arr = (img.clamp(0, 1).numpy() * 255).astype(np.uint8)
        Image.fromarray(arr).save(d / f"{i}.png")
        lines.append(json.dumps({"image": f"demos/{int(lab)}/{i}.png", "label": int(lab)}))
    (root / "demos.jsonl").write_text("\n".join(lines) + "\n")
    q = root / "queries"
    q.mkdir()
    for i, img in enumerate(ep.query_images):
        np.save(q / f"q{i}.npy", img.numpy())
    return root, ep


def test_compress_then_predict(setup, capsys):
    from apps.emloc.cli import compress_main
    from apps.emloc.cli import predict_main

    root, ep = setup
    for src in ("demos", "demos.jsonl"):
        mem = root / f"{src}.safetensors"
        assert compress_main(["--demos", str(root / src), "--out", str(mem), "--model", str(root / "host.safetensors"),
                              "--chunk-demos", "4", "--delta", "0.01"]) == 0
        info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert info["demos"] == 12 and 0 < info["kept_fraction"] <= 1
        assert predict_main(["--memory", str(mem), "--images", str(root / "queries"), "--model", str(root / "host.safetensors")]) == 0
        out = [json.loads(l) for l in capsys.readouterr().out.strip().splitlines()]
        assert len(out) == 3
        assert all(o["label"] in ep.label_ids.tolist() for o in out)
        assert all(abs(sum(o["scores"].values()) - 1) < 1e-3 for o in out)


def test_cli_refusals(setup, tmp_path):
    from apps.emloc.cli import compress_main
    from apps.emloc.cli import predict_main

    root, _ = setup
    host = str(root / "host.safetensors")
    (tmp_path / "bad" / "3").mkdir(parents=True)
    (tmp_path / "bad" / "3" / "x.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"x\.png is not a readable image file"):
        compress_main(["--demos", str(tmp_path / "bad"), "--out", str(tmp_path / "m.safetensors"), "--model", host])
    (tmp_path / "nolabel.jsonl").write_text(json.dumps({"image": "a.png"}) + "\n")
    with pytest.raises(ValueError, match="without a label"):
        compress_main(["--demos", str(tmp_path / "nolabel.jsonl"), "--out", str(tmp_path / "m.safetensors"), "--model", host])
    (tmp_path / "one" / "3").mkdir(parents=True)
    for i, p in enumerate(sorted((root / "demos").rglob("*.png"))[:3]):
        (tmp_path / "one" / "3" / f"{i}.png").write_bytes(p.read_bytes())
    with pytest.raises(ValueError, match="one class only"):
        compress_main(["--demos", str(tmp_path / "one"), "--out", str(tmp_path / "m.safetensors"), "--model", host])
    with pytest.raises(SystemExit) as e:  # refused when parsed: argparse's usage error
        compress_main(["--demos", str(root / "demos"), "--out", str(tmp_path / "m.safetensors"), "--model", host, "--delta", "0"])
    assert e.value.code == 2
    torch.manual_seed(5)
    other = EMLoCHost(HostConfig(dim=32, depth=2, num_heads=4, num_kv_heads=2))
    other.save(tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="another model"):
        predict_main(["--memory", str(root / "demos.safetensors"), "--images", str(root / "queries"), "--model", str(tmp_path / "other.safetensors")])
    with pytest.raises(FileNotFoundError, match="--model"):
        from apps.emloc.cli_common import load_host
        load_host(tmp_path / "missing.safetensors")


def test_compress_function_survives_the_cli_module(setup):
    import importlib

    import apps.emloc
    from apps.emloc.api import compress as api_compress

    importlib.import_module("apps.emloc.compress")
    from apps.emloc import compress

    root, ep = setup
    ctx = compress(EMLoCHost.load(root / "host.safetensors"), (ep.demo_images, ep.demo_labels), policy="full")
    assert ctx.num_demos == 12
    assert apps.emloc.compress is compress and (compress is api_compress or callable(compress))


def test_cli_with_the_shipped_host_reads_labels_from_the_demos(tmp_path, capsys):
    """No --model: the shipped host compresses a folder of held-out demos and labels held-out queries."""
    from apps.emloc.cli import compress_main, predict_main

    ep = make_episode(23, num_demos=40, num_queries=10, split="eval")
    for i, (img, lab) in enumerate(zip(ep.demo_images, ep.demo_labels)):
        d = tmp_path / "demos" / str(int(lab))
        d.mkdir(parents=True, exist_ok=True)
        np.save(d / f"{i}.npy", img.numpy())
    (tmp_path / "q").mkdir()
    for i, img in enumerate(ep.query_images):
        np.save(tmp_path / "q" / f"{i:02d}.npy", img.numpy())
    assert compress_main(["--demos", str(tmp_path / "demos"), "--out", str(tmp_path / "m.safetensors")]) == 0
    capsys.readouterr()
    assert predict_main(["--memory", str(tmp_path / "m.safetensors"), "--images", str(tmp_path / "q")]) == 0
    out = [json.loads(l) for l in capsys.readouterr().out.splitlines() if l.startswith("{")]
    got = np.array([o["label"] for o in sorted(out, key=lambda o: o["image"])])
    assert len(got) == 10 and (got == ep.query_labels.numpy()).mean() >= 0.7  # chance: 0.2


def test_compress_offers_every_policy_and_refuses_a_budgeted_one_without_keep(setup, capsys):
    from apps.emloc.cli import build_compress_parser, compress_main
    from core.infra.cli import run_cli
    from core.kv_compress import POLICIES

    root, _ = setup
    action = next(a for a in build_compress_parser()._actions if a.dest == "policy")
    assert sorted(action.choices) == sorted(POLICIES)
    help_text = build_compress_parser().format_help()
    assert "29-62%" in " ".join(help_text.split())
    base = ["--demos", str(root / "demos"), "--model", str(root / "host.safetensors")]
    assert run_cli(compress_main, [*base, "--out", str(root / "x.safetensors"), "--policy", "snapkv"]) == 2
    assert "needs --keep" in capsys.readouterr().err
    assert not (root / "x.safetensors").exists()
    with pytest.raises(SystemExit) as exc:  # argparse's own usage error: exit 2, one line
        run_cli(compress_main, [*base, "--out", str(root / "x.safetensors"), "--ratios", "0.1,2"])
    assert exc.value.code == 2 and "(0, 1)" in capsys.readouterr().err
    mem = root / "snap.safetensors"
    assert compress_main([*base, "--out", str(mem), "--policy", "snapkv", "--keep", "0.3", "--protect-answers"]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert abs(info["kept_fraction"] - 0.3) < 0.02
