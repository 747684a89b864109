"""benchmarks.emloc_bench end to end on a tiny host: every policy gets rows, the summary is written, reruns resume."""

from __future__ import annotations

import json

import pytest
import torch

from apps.emloc import EMLoCHost, HostConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bench_tiny_run_and_resume(tmp_path, capsys):
    from benchmarks.emloc_bench import BASELINES, main

    torch.manual_seed(0)
    EMLoCHost(HostConfig(dim=32, depth=2, num_heads=4, num_kv_heads=2)).save(tmp_path / "h.safetensors")
    out = tmp_path / "b.json"
    argv = ["--model", str(tmp_path / "h.safetensors"), "--demos", "8", "--seeds", "0,1", "--episodes", "1",
            "--queries", "4", "--keep", "0.25,0.5", "--chunk-demos", "4", "--memory-demos", "8", "--out", str(out)]
    assert main(argv) == 0
    summary = json.loads(out.read_text())
    policies = {r["policy"] for r in summary["table"]}
    assert policies == {"full", "emloc", *BASELINES}
    em = next(r for r in summary["table"] if r["policy"] == "emloc")
    assert len(em["js_per_layer"]) == 2 and all(j <= 0.005 + 1e-9 for j in em["js_per_layer"])
    assert em["seeds"] == 2
    snap = [r for r in summary["table"] if r["policy"] == "snapkv" and r["keep"] == 0.25]
    assert snap and abs(snap[0]["fraction"] - 0.25) < 0.03
    t = summary["targets"][0]
    assert t["K"] == 8 and 0 < t["emloc_fraction"] <= 1
    rows = out.with_suffix(".rows.jsonl").read_text().splitlines()
    assert main(argv) == 0  # resumed: nothing recomputed
    assert out.with_suffix(".rows.jsonl").read_text().splitlines() == rows
    png = tmp_path / "curves.png"
    assert main(["--plot-from", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_refuses_rows_of_another_host_and_overwrite_restarts(tmp_path):
    from benchmarks.emloc_bench import main

    for seed, name in ((0, "a"), (1, "b")):
        torch.manual_seed(seed)
        EMLoCHost(HostConfig(dim=32, depth=2, num_heads=4, num_kv_heads=2)).save(tmp_path / f"{name}.safetensors")
    out = tmp_path / "b.json"
    common = ["--demos", "4", "--seeds", "0", "--episodes", "1", "--queries", "2", "--keep", "0.5", "--chunk-demos", "4",
              "--memory-demos", "4", "--out", str(out)]
    assert main(["--model", str(tmp_path / "a.safetensors"), *common]) == 0
    fp_a = json.loads(out.read_text())["host_fingerprint"]
    with pytest.raises(SystemExit, match="another host or settings"):
        main(["--model", str(tmp_path / "b.safetensors"), *common])
    with pytest.raises(SystemExit, match="another host or settings"):  # same host, another setting
        main(["--model", str(tmp_path / "a.safetensors"), *common, "--delta", "0.01"])
    assert main(["--model", str(tmp_path / "b.safetensors"), *common, "--overwrite"]) == 0
    rows = [json.loads(l) for l in out.with_suffix(".rows.jsonl").read_text().splitlines()]
    assert {r["run"]["host"] for r in rows} == {json.loads(out.read_text())["host_fingerprint"]} != {fp_a}


def test_memory_probe_runs_in_fresh_processes(tmp_path):
    from benchmarks.emloc_bench import MEMORY_POLICIES, main

    torch.manual_seed(0)
    EMLoCHost(HostConfig(dim=32, depth=2, num_heads=4, num_kv_heads=2)).save(tmp_path / "h.safetensors")
    out = tmp_path / "m.json"
    assert main(["--model", str(tmp_path / "h.safetensors"), "--peak-memory", "--skip-accuracy", "--memory-grid", "8,16",
                 "--memory-demos", "8", "--chunk-demos", "4", "--out", str(out)]) == 0
    pm = json.loads(out.read_text())["peak_memory"]
    assert len(pm["rows"]) == 2 * len(MEMORY_POLICIES)
    assert all("peak_mb" in r and r["peak_mb"] >= 0 for r in pm["rows"]), pm["rows"]
    full16 = next(r for r in pm["rows"] if r["K"] == 16 and r["policy"] == "full")
    assert full16["fraction"] == 1.0 and abs(next(r for r in pm["rows"] if r["K"] == 16 and r["policy"] == "snapkv")["fraction"] - 0.25) < 0.03
    assert set(pm["max_demos_within_budget"]) == set(MEMORY_POLICIES)


def test_early_rare_episodes_put_every_rare_demo_early():
    from benchmarks.emloc_recency import early_rare_episode

    ep, rare = early_rare_episode(5, 40, 30, n_way=5, rare=3, rare_demos=4, early=0.25)
    assert ep.demo_images.shape[0] == 40 and len(rare) == 3
    is_rare = torch.isin(ep.demo_labels, rare)
    where = is_rare.nonzero()[:, 0]
    assert int(is_rare.sum()) == 12 and int(where.max()) < 12  # 12 rare demos in the first max(10, 12) slots
    assert all(int((ep.demo_labels == r).sum()) == 4 for r in rare)
    assert set(ep.query_labels.tolist()) <= set(ep.label_ids.tolist())
    assert torch.isin(ep.query_labels, rare).any()


def test_recency_bench_tiny_run_resume_and_refusal(tmp_path, capsys):
    from benchmarks.emloc_recency import PEERS, main
    from core.infra.cli import run_cli

    torch.manual_seed(0)
    EMLoCHost(HostConfig(dim=32, depth=2, num_heads=4, num_kv_heads=2)).save(tmp_path / "h.safetensors")
    out = tmp_path / "r.json"
    argv = ["--model", str(tmp_path / "h.safetensors"), "--demos", "20", "--seeds", "0,1", "--episodes", "1",
            "--queries", "6", "--rare-demos", "2", "--chunk-demos", "5", "--window", "4", "--out", str(out)]
    assert main(argv) == 0
    s = json.loads(out.read_text())
    names = {r["policy"] for r in s["table"]}
    assert {"full", "emloc", "answers"} | {f"{p}+answers" for p in PEERS} <= names
    ans = next(r for r in s["table"] if r["policy"] == "answers")
    assert abs(ans["fraction"] - 0.2) < 1e-6  # the label tokens alone
    em = next(r for r in s["table"] if r["policy"] == "emloc")
    snap = next(r for r in s["table"] if r["policy"] == "snapkv+answers")
    assert abs(snap["fraction"] - em["fraction"]) < 0.02  # equal budget
    t = s["targets"][0]
    assert t["paired"]["answers"]["episodes"] == 2 and isinstance(t["target_le_25pct_kept"], bool)
    rows = out.with_suffix(".rows.jsonl").read_text().splitlines()
    assert main(argv) == 0 and out.with_suffix(".rows.jsonl").read_text().splitlines() == rows  # resumed
    assert run_cli(main, [*argv[:-2], "--rare", "2", "--out", str(out)]) == 2  # other settings: refused
    assert "other settings" in capsys.readouterr().err
