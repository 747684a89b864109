"""benchmarks.rl_bench at tiny sizes: same batches and evaluation seeds for every arm, control arms, data-best
targets, held-out MSE, partial observation, paired bootstrap, settings stored per case."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = ["--dataset-steps", "300", "--steps", "6", "--warmup", "2", "--batch-size", "4", "--context", "5",
        "--embed-dim", "16", "--heads", "1", "--dt-layers", "4", "--dm-layers", "4", "--routed-layers", "1,3",
        "--eval-episodes", "2", "--holdout-frac", "0.2", "--bootstrap", "200"]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One run of every arm of ours on the partially observed dataset, 2 seeds, batches and evaluations spied."""
    import rl.evaluate
    import rl.train
    from benchmarks import rl_bench

    tmp = tmp_path_factory.mktemp("bench")
    batches, evals, heldout = [], [], []
    sample, ev, mse = rl.train.SegmentSampler.sample, rl.evaluate.evaluate_returns, rl.evaluate.heldout_action_mse

    def spy_sample(self, batch_size):
        b = sample(self, batch_size)
        h = hashlib.sha1(b"".join(v.numpy().tobytes() for v in b.values())).hexdigest()
        batches.append(h)
        return b

    def spy_eval(model, env_id, **kw):
        evals.append((type(model).__name__, env_id, kw["target_return"], kw["episodes"], kw["seed"],
                      kw["obs_transform"] is not None))
        return ev(model, env_id, **{**kw, "episodes": 1}) * 0 + np.arange(kw["episodes"])  # fast, known

    def spy_mse(model, trajs, **kw):
        heldout.append(sum(t.length for t in trajs))
        return mse(model, trajs, **kw)

    out = tmp / "res.json"
    args = TINY + ["--datasets", "hopper-random-po", "--seeds", "0,1", "--algos", "dt,dm,dt-small,dm-random,dm-fixed",
                   "--target-mode", "data-best", "--target-factors", "1.0,2.0", "--data-dir", str(tmp / "data"),
                   "--work-dir", str(tmp / "work"), "--out", str(out)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rl.train.SegmentSampler, "sample", spy_sample)
        mp.setattr(rl.evaluate, "evaluate_returns", spy_eval)
        mp.setattr(rl.evaluate, "heldout_action_mse", spy_mse)
        rl_bench.main(args)
    return {"res": json.loads(out.read_text()), "batches": batches, "evals": evals, "heldout": heldout, "args": args,
            "tmp": tmp, "out": out}


def test_every_arm_trains_on_the_same_batches_for_a_seed(full_run):
    b = full_run["batches"]
    # dm runs first (the controls take its capacity), then dt, dt-small, dm-random, dm-fixed; per arm seeds 0, 1
    assert len(b) == 5 * 2 * 6
    runs = [b[i:i + 6] for i in range(0, len(b), 6)]
    seed0, seed1 = runs[0::2], runs[1::2]
    assert all(r == seed0[0] for r in seed0) and all(r == seed1[0] for r in seed1)
    assert seed0[0] != seed1[0]


def test_every_arm_is_evaluated_on_the_same_episodes_and_masked_env(full_run):
    res = full_run["res"]
    ev = full_run["evals"]
    best = res["datasets"]["hopper-random-po"]["best_return"]
    assert res["datasets"]["hopper-random-po"]["targets"] == pytest.approx([best, 2 * best])
    assert {(round(e[2], 3), *e[3:]) for e in ev} == {(round(best, 3), 2, 10_000, True),
                                                       (round(2 * best, 3), 2, 10_000, True)}
    assert len(ev) == 5 * 2 * 2
    assert {e[0] for e in ev} == {"DecisionMixer", "DecisionTransformer"}


def test_best_return_is_that_of_the_training_split(full_run):
    from rl.data import load_dataset

    info = full_run["res"]["datasets"]["hopper-random-po"]
    ds = load_dataset(full_run["tmp"] / "data" / info["train_file"])
    assert info["best_return"] == pytest.approx(ds.episode_returns().max())
    assert (ds.observations[:, 5:] == 0).all()  # the partially observed dataset
    held = info["holdout"]
    assert held["fraction"] == 0.2 and held["seed"] == 0 and len(held["indices"]) == round(0.2 * held["episodes"])
    assert len(ds.trajectories()) == held["episodes"] - len(held["indices"])


def test_heldout_mse_and_controls_are_recorded(full_run):
    cases = full_run["res"]["cases"]
    assert len(set(full_run["heldout"])) == 1  # the same held-out episodes for every arm
    for seed in (0, 1):
        c = {a: cases[f"hopper-random-po/{a}/{seed}"] for a in ("dm", "dt", "dt-small", "dm-random", "dm-fixed")}
        assert all(v["heldout_mse"] > 0 for v in c.values())
        r = c["dm"]["routed_fraction"]
        assert c["dm-random"]["derived"]["capacity"] == pytest.approx(min(1.0, max(0.1, r)))
        assert c["dm-fixed"]["derived"]["capacity"] == pytest.approx(min(1.0, max(0.1, r)))
        assert c["dt-small"]["derived"]["num_layers"] == max(1, round(2 + 2 * r))
        assert c["dt-small"]["num_params"] < c["dt"]["num_params"] or c["dt-small"]["derived"]["num_layers"] == 4
        assert c["dm"]["scores"].keys() == c["dt"]["scores"].keys()
        assert c["dt"]["settings"]["holdout_frac"] == 0.2


def test_paired_bootstrap_in_json_and_table(full_run):
    res = full_run["res"]
    iv = res["bootstrap"]["intervals"]
    assert {"dm - dt/score", "dm - dt/heldout_mse", "dm - dm-random/score", "dt-small - dt/score"} <= set(iv)
    cases = res["cases"]
    d = [cases[f"hopper-random-po/dm/{s}"]["heldout_mse"] - cases[f"hopper-random-po/dt/{s}"]["heldout_mse"]
         for s in (0, 1)]
    per = iv["dm - dt/heldout_mse"]["hopper-random-po"]
    assert per["mean"] == pytest.approx(np.mean(d)) and per["seeds"] == 2
    assert min(d) - 1e-9 <= per["lo"] <= per["hi"] <= max(d) + 1e-9
    assert "mean over datasets" in iv["dm - dt/score"]
    assert "Paired bootstrap" in res["table"] and "dm - dt" in res["table"]


def test_paired_bootstrap_values():
    from benchmarks.rl_bench import paired_bootstrap

    out = paired_bootstrap({"a": np.full(10, 2.0), "b": np.array([0.0, 1.0, 2.0, 3.0] * 3)}, 2000, seed=0)
    assert out["a"] == {"mean": 2.0, "lo": 2.0, "hi": 2.0, "seeds": 10, "sd": 0.0}
    assert out["b"]["lo"] < 1.5 < out["b"]["hi"] and out["b"]["hi"] - out["b"]["lo"] < 1.6
    assert out["b"]["sd"] == pytest.approx(np.std([0.0, 1.0, 2.0, 3.0] * 3, ddof=1))
    m = out["mean over datasets"]
    assert m["mean"] == pytest.approx(1.75) and m["lo"] < 1.75 < m["hi"]
    assert m["hi"] - m["lo"] < out["b"]["hi"] - out["b"]["lo"]  # averaging with a constant halves the spread
    assert m["sd"] == pytest.approx(out["b"]["sd"] / 2)


def test_seeds_for_halfwidth_sizes_a_run_from_a_pilot_spread():
    from benchmarks.rl_bench import paired_bootstrap, seeds_for_halfwidth

    assert seeds_for_halfwidth(5.0, 2.5) == 16 and seeds_for_halfwidth(1.0, 2.5) == 2  # (1.96 * 2)^2 = 15.4
    assert seeds_for_halfwidth(None, 2.5) is None
    # a run of that many seeds from the same spread gives about that half-width
    rng = np.random.default_rng(0)
    widths = []
    for _ in range(50):
        d = rng.normal(3.0, 5.0, size=16)
        v = paired_bootstrap({"x": d}, 2000, seed=1)["x"]
        widths.append((v["hi"] - v["lo"]) / 2)
    assert 2.0 < np.mean(widths) < 2.8


def test_finished_cases_are_reused_only_with_the_same_settings(full_run, monkeypatch):
    from benchmarks import rl_bench

    ran = []
    monkeypatch.setattr(rl_bench, "_run_ours", lambda algo, prep, seed, *a, **k: ran.append((algo, seed)) or
                        {"score": 1.0, "sec_per_1k_steps": 1.0, "cpu_sec_per_1k_steps": 1.0, "heldout_mse": 0.5})
    args = [a if a != "0,1" else "0" for a in full_run["args"]]
    i = args.index("--algos")
    args[i + 1] = "dm,dt"
    rl_bench.main(args)  # same settings: nothing reruns
    assert ran == []
    j = args.index("--lr") if "--lr" in args else None
    assert j is None
    other = args + ["--lr", "0.002"]
    with pytest.raises(SystemExit, match=r"run with other settings.*'lr': \(0\.0001, 0\.002\)"):
        rl_bench.main(other)
    assert ran == []
    rl_bench.main(other + ["--on-mismatch", "redo"])
    assert ran == [("dm", 0), ("dt", 0)]
    saved = json.loads(full_run["out"].read_text())["cases"]["hopper-random-po/dt/0"]["settings"]
    assert saved["lr"] == 0.002


def test_arm_overrides_and_bad_flags():
    from benchmarks import rl_bench

    args = rl_bench.build_parser().parse_args(["--dm-layers", "6", "--routed-layers", "1,3,5", "--dt-small-layers", "2"])
    algo, ov, der = rl_bench.arm_overrides("dt-small", args)
    assert algo == "dt" and ov["num_layers"] == 2 and der == {"num_layers": 2}
    args.dt_small_layers = "auto"
    _, ov, der = rl_bench.arm_overrides("dt-small", args, {"routed_fraction": 0.2})
    assert ov["num_layers"] == 4  # 3 plain + 3 x 0.2 = 3.6
    with pytest.raises(SystemExit, match="needs the dm case"):
        rl_bench.arm_overrides("dm-random", args, None)
    _, ov, _ = rl_bench.arm_overrides("dm-fixed", rl_bench.build_parser().parse_args(["--fixed-capacity", "0.3"]))
    assert ov["learn_capacity"] is False and ov["capacity"] == 0.3 and "random_routing" not in ov
    with pytest.raises(SystemExit, match="unknown algos"):
        rl_bench.main(["--algos", "dm,dt-large"])
    with pytest.raises(SystemExit, match="--random-capacity must be a number"):
        rl_bench.main(["--algos", "dm", "--random-capacity", "half"])


def test_parts_run_in_parallel_processes_merge_only_with_the_same_settings(full_run, monkeypatch):
    from benchmarks import rl_bench

    ran = []

    def fake(algo, prep, seed, *a, **k):
        ran.append((algo, seed))
        return {"score": 10.0 * seed + (algo == "dm"), "sec_per_1k_steps": 1.0, "cpu_sec_per_1k_steps": 1.0,
                "heldout_mse": 0.5, "routed_fraction": 0.3 if algo == "dm" else None}

    monkeypatch.setattr(rl_bench, "_run_ours", fake)
    tmp = full_run["tmp"]
    base = list(full_run["args"])
    base[base.index("--algos") + 1] = "dm,dt"
    i = base.index("--out")

    def with_(seeds, out, *extra):
        a = list(base)
        a[a.index("--seeds") + 1] = seeds
        a[i + 1] = str(tmp / out)
        return a + list(extra)

    rl_bench.main(with_("0", "p0.json"))
    rl_bench.main(with_("1", "p1.json", "--lr", "0.01"))  # other settings
    rl_bench.main(with_("1", "p2.json"))
    assert ran == [("dm", 0), ("dt", 0), ("dm", 1), ("dt", 1), ("dm", 1), ("dt", 1)]
    ran.clear()
    rl_bench.main(with_("0,1", "all.json", "--merge", f"{tmp / 'p1.json'},{tmp / 'p0.json'},{tmp / 'p2.json'}"))
    assert ran == []  # p1's seed-1 cases (other lr) were replaced by p2's
    res = json.loads((tmp / "all.json").read_text())
    assert res["cases"]["hopper-random-po/dt/1"]["settings"]["lr"] == 0.0001
    assert res["bootstrap"]["intervals"]["dm - dt/score"]["hopper-random-po"] == \
        {"mean": 1.0, "lo": 1.0, "hi": 1.0, "seeds": 2, "sd": 0.0}


def test_behaviour_policy_names_the_datasets_and_the_case_settings(tmp_path, monkeypatch):
    import rl.generate
    from benchmarks import rl_bench

    pol = tmp_path / "behaviour_hopper_other.safetensors"
    pol.write_bytes(b"weights")
    sha = hashlib.sha256(b"weights").hexdigest()
    calls, real = [], rl.generate.generate

    def fake(env_id, quality, steps, seed, *, policy_path=None, progress=False):
        calls.append((quality, policy_path))
        return real(env_id, "random", steps, seed)

    monkeypatch.setattr(rl.generate, "generate", fake)
    b = rl_bench.parse_behaviour([f"hopper={pol}"])
    assert b == {"hopper": {"path": str(pol), "sha256": sha}}
    tagged = rl_bench._dataset_path(tmp_path, "hopper-medium", 300, 0, b)
    plain = rl_bench._dataset_path(tmp_path, "hopper-medium", 300, 0)
    assert tagged.name == f"hopper-medium-300-s0-b{sha[:10]}.npz" and plain.name == "hopper-medium-300-s0.npz"
    assert calls == [("medium", str(pol)), ("medium", None)]  # the default file is never reused for another policy
    args = rl_bench.build_parser().parse_args(["--behaviour", f"hopper={pol}"])
    assert rl_bench.case_settings("dt", args)["behaviour"] == {"hopper": sha}
    assert "behaviour" not in rl_bench.case_settings("dt", rl_bench.build_parser().parse_args([]))
    for bad, msg in ([f"ant={pol}"], "FAMILY=PATH"), ([str(pol)], "FAMILY=PATH"), (["hopper=nope.st"], "not a file"), \
            ([f"hopper={pol}", f"hopper={pol}"], "twice"):
        with pytest.raises(SystemExit, match=msg):
            rl_bench.parse_behaviour(bad)


def test_report_only_runs_no_missing_case(full_run, monkeypatch, tmp_path):
    import shutil

    from benchmarks import rl_bench

    monkeypatch.setattr(rl_bench, "_run_ours", lambda *a, **k: pytest.fail("--report-only ran a case"))
    out = tmp_path / "copy.json"
    shutil.copy(full_run["out"], out)
    args = list(full_run["args"])
    args[args.index("--seeds") + 1] = "0,1,2"  # seed 2 never ran
    args[args.index("--out") + 1] = str(out)
    # (--on-mismatch redo: earlier tests of this module may have rerun cases of the shared run with another --lr;
    # with --report-only such cases are left out, not rerun)
    rl_bench.main(args + ["--report-only", "--on-mismatch", "redo"])
    res = json.loads(out.read_text())
    assert not any(k.endswith("/2") for k in res["cases"]) and "hopper-random-po" in res["table"]
