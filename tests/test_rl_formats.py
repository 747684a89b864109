"""rl.formats: D4RL-style HDF5 and local Minari datasets load with the .npz format's validation; data that stops
mid-episode ends in a timeout, with a warning, the same in both readers; rl.generate writes HDF5 or refuses a file
name in one line; rl.train takes an HDF5 file whose metadata names no environment."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest

h5py = pytest.importorskip("h5py")

from rl.data import load_dataset, save_dataset  # noqa: E402
from tests.test_rl_data import _random_dataset  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _write_d4rl(path, n=60, obs_dim=11, act_dim=3, **override):
    """A D4RL-layout file as D4RL ships it: extra next_observations and infos/*, no metadata attribute."""
    rng = np.random.default_rng()
    arrays = {"observations": rng.normal(size=(n, obs_dim)), "actions": rng.uniform(-1, 1, size=(n, act_dim)),
              "rewards": rng.normal(size=n), "terminals": np.zeros(n, bool), "timeouts": np.zeros(n, bool)}
    arrays["terminals"][n // 3] = True
    arrays["timeouts"][-1] = True
    arrays.update(override)
    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            if v is not None:
                f.create_dataset(k, data=v)
        f.create_dataset("next_observations", data=rng.normal(size=(n, obs_dim)))
        f.create_dataset("infos/qpos", data=rng.normal(size=(n, 6)))
    return {k: v for k, v in arrays.items() if v is not None}


@pytest.mark.parametrize("suffix", [".hdf5", ".h5"])
def test_hdf5_round_trip_keeps_arrays_and_metadata(tmp_path, suffix):
    ds = _random_dataset(np.random.default_rng())
    path = save_dataset(tmp_path / f"d{suffix}", ds)
    assert path.suffix == suffix and not list(tmp_path.glob("*.tmp"))
    back = load_dataset(path)
    for k, v in ds.arrays().items():
        np.testing.assert_array_equal(back.arrays()[k], v)
    assert back.metadata["env"] == "Hopper-v5" and back.metadata["format_version"] == 1
    assert len(back.trajectories()) == 4
    with h5py.File(path) as f:  # the D4RL layout: top-level arrays
        assert {"observations", "actions", "rewards", "terminals", "timeouts"} <= set(f.keys())


def test_d4rl_file_from_elsewhere_loads(tmp_path):
    arrays = _write_d4rl(tmp_path / "hopper-medium-v2.hdf5")
    ds = load_dataset(tmp_path / "hopper-medium-v2.hdf5")
    np.testing.assert_allclose(ds.observations, arrays["observations"].astype(np.float32))
    np.testing.assert_array_equal(ds.terminals, arrays["terminals"])
    assert ds.observations.dtype == np.float32 and "env" not in ds.metadata
    assert [t.terminal for t in ds.trajectories()] == [True, False]


@pytest.mark.parametrize("override, match", [
    ({"timeouts": None}, r"missing keys \['timeouts'\]"),
    ({"rewards": np.r_[np.zeros(10), np.nan, np.zeros(49)]}, "rewards contains 1 NaN/inf values"),
    ({"actions": np.zeros((59, 3))}, "actions has shape"),
])
def test_d4rl_file_gets_the_npz_validation(tmp_path, override, match):
    _write_d4rl(tmp_path / "bad.hdf5", **override)
    with pytest.raises(ValueError, match=match):
        load_dataset(tmp_path / "bad.hdf5")


def _cut_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "rl.formats" and r.levelno == logging.WARNING]


@pytest.mark.parametrize("first_end, cut_steps", [(20, 39), (None, 60)])
def test_d4rl_file_cut_mid_episode_ends_in_a_timeout_with_a_warning(tmp_path, caplog, first_end, cut_steps):
    terminals = np.zeros(60, bool)
    if first_end is not None:
        terminals[first_end] = True
    path = tmp_path / "cut.hdf5"
    arrays = _write_d4rl(path, terminals=terminals, timeouts=np.zeros(60, bool))
    with caplog.at_level(logging.WARNING, logger="rl.formats"):
        ds = load_dataset(path)
    assert ds.timeouts[-1] and not ds.terminals[-1] and not ds.timeouts[:-1].any()
    np.testing.assert_array_equal(ds.terminals, terminals)
    np.testing.assert_allclose(ds.rewards, arrays["rewards"].astype(np.float32))
    assert [t.length for t in ds.trajectories()][-1] == cut_steps
    assert ds.trajectories()[-1].terminal is False
    assert ds.metadata["episodes_marked_timeout"] == 1
    (msg,) = _cut_warnings(caplog)
    assert str(path) in msg and f"{cut_steps} steps" in msg and "timeout" in msg
    # the same data ending its last episode loads unchanged, silently
    caplog.clear()
    ended = np.zeros(60, bool)
    ended[-1] = True
    arrays = _write_d4rl(tmp_path / "ended.hdf5", terminals=terminals, timeouts=ended)
    with caplog.at_level(logging.WARNING, logger="rl.formats"):
        ds = load_dataset(tmp_path / "ended.hdf5")
    np.testing.assert_array_equal(ds.timeouts, ended)
    np.testing.assert_array_equal(ds.terminals, terminals)
    assert _cut_warnings(caplog) == [] and "episodes_marked_timeout" not in ds.metadata


def test_hdf5_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_dataset(tmp_path / "none.hdf5")
    (tmp_path / "junk.h5").write_bytes(b"not an hdf5 file at all")
    with pytest.raises(ValueError, match="not a readable HDF5 file"):
        load_dataset(tmp_path / "junk.h5")
    with h5py.File(tmp_path / "grouped.hdf5", "w") as f:
        for k in ("observations", "actions", "rewards", "terminals"):
            f.create_dataset(k, data=np.zeros(3))
        f.create_dataset("timeouts/x", data=np.zeros(3))
    with pytest.raises(ValueError, match=r"\['timeouts'\] must be datasets"):
        load_dataset(tmp_path / "grouped.hdf5")


def _minari_dataset(root, monkeypatch, lengths=(5, 7, 4), ends=("term", "trunc", None)):
    """A dataset written by Minari's own API (hdf5 format) under a temporary MINARI_DATASETS_PATH."""
    minari = pytest.importorskip("minari")
    from minari.data_collector.episode_buffer import EpisodeBuffer

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    rng = np.random.default_rng()
    bufs = []
    for i, (T, end) in enumerate(zip(lengths, ends)):
        term, trunc = [False] * T, [False] * T
        if end == "term":
            term[-1] = True
        elif end == "trunc":
            trunc[-1] = True
        bufs.append(EpisodeBuffer(id=i, seed=i, observations=rng.normal(size=(T + 1, 11)),
                                  actions=rng.uniform(-1, 1, size=(T, 3)).astype(np.float32),
                                  rewards=list(rng.normal(size=T)), terminations=term, truncations=trunc, infos={}))
    with pytest.warns(UserWarning):  # minari warns that no eval_env was given
        minari.create_dataset_from_buffers("test/hopper-tiny-v0", bufs, env="Hopper-v5", algorithm_name="random",
                                           data_format="hdf5")
    return root / "test" / "hopper-tiny-v0", bufs


def test_minari_dataset_loads_in_episode_order(tmp_path, monkeypatch):
    folder, bufs = _minari_dataset(tmp_path / "minari", monkeypatch)
    assert (folder / "data" / "main_data.hdf5").exists() and (folder / "data" / "metadata.json").exists()
    ds = load_dataset(f"minari:{folder}")
    trajs = ds.trajectories()
    assert [t.length for t in trajs] == [5, 7, 4]
    assert [t.terminal for t in trajs] == [True, False, False]
    for t, b in zip(trajs, bufs):
        np.testing.assert_allclose(t.observations, np.asarray(b.observations)[:-1].astype(np.float32))
        np.testing.assert_allclose(t.actions, b.actions)
        np.testing.assert_allclose(t.rewards, np.asarray(b.rewards, np.float32))
    assert ds.metadata["env"] == "Hopper-v5" and ds.metadata["dataset_id"] == "test/hopper-tiny-v0"
    assert ds.metadata["episodes_marked_timeout"] == 1  # the third episode ended neither way
    # Minari's own reader sees the same episodes
    import minari

    ref = minari.load_dataset("test/hopper-tiny-v0")
    for t, ep in zip(trajs, ref.iterate_episodes()):
        np.testing.assert_allclose(t.actions, ep.actions)
        assert t.terminal == bool(ep.terminations[-1])
    assert load_dataset(folder).metadata["env"] == "Hopper-v5"  # a folder without the prefix works too


def test_cut_episode_reads_the_same_from_d4rl_and_minari(tmp_path, monkeypatch, caplog):
    folder, bufs = _minari_dataset(tmp_path / "minari", monkeypatch, lengths=(5, 7, 6), ends=("term", "trunc", None))
    flags = {"terminals": [], "timeouts": []}
    for b in bufs:  # the same episodes in the D4RL layout, the last one cut
        flags["terminals"].append(np.asarray(b.terminations, bool))
        flags["timeouts"].append(np.asarray(b.truncations, bool))
    path = tmp_path / "same.hdf5"
    _write_d4rl(path, n=18, observations=np.concatenate([np.asarray(b.observations)[:-1] for b in bufs]),
                actions=np.concatenate([b.actions for b in bufs]), rewards=np.concatenate([b.rewards for b in bufs]),
                **{k: np.concatenate(v) for k, v in flags.items()})
    with caplog.at_level(logging.WARNING, logger="rl.formats"):
        from_d4rl = load_dataset(path)
        from_minari = load_dataset(f"minari:{folder}")
    for k, v in from_minari.arrays().items():
        np.testing.assert_array_equal(from_d4rl.arrays()[k], v)
    assert [t.length for t in from_d4rl.trajectories()] == [5, 7, 6]
    assert [t.terminal for t in from_d4rl.trajectories()] == [True, False, False]
    assert from_d4rl.metadata["episodes_marked_timeout"] == from_minari.metadata["episodes_marked_timeout"] == 1
    d4rl_msg, minari_msg = _cut_warnings(caplog)
    assert str(path) in d4rl_msg and "6 steps" in d4rl_msg
    assert str(folder) in minari_msg and "episode_2" in minari_msg and "6 steps" in minari_msg


def test_minari_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="Minari dataset folder not found"):
        load_dataset(f"minari:{tmp_path / 'nothing'}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="expected data/main_data.hdf5"):
        load_dataset(f"minari:{tmp_path / 'empty'}")
    folder, _ = _minari_dataset(tmp_path / "minari", monkeypatch)
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    with h5py.File(bad / "data" / "main_data.hdf5", "a") as f:
        del f["episode_1/rewards"]
    with pytest.raises(ValueError, match=r"episode_1 lacks \['rewards'\]"):
        load_dataset(f"minari:{bad}")
    meta = json.loads((folder / "data" / "metadata.json").read_text())
    shutil.rmtree(bad)
    shutil.copytree(folder, bad)
    (bad / "data" / "metadata.json").write_text(json.dumps({**meta, "total_episodes": 5}))
    with pytest.raises(ValueError, match="says 5 episodes, main_data.hdf5 holds 3"):
        load_dataset(f"minari:{bad}")
    (bad / "data" / "metadata.json").write_text(json.dumps({**meta, "data_format": "arrow"}))
    with pytest.raises(ValueError, match="data_format 'arrow' is not read here"):
        load_dataset(f"minari:{bad}")
    shutil.rmtree(bad)
    shutil.copytree(folder, bad)
    with h5py.File(bad / "data" / "main_data.hdf5", "a") as f:
        f["episode_0/rewards"][2] = np.inf
    with pytest.raises(ValueError, match="rewards contains 1 NaN/inf values"):
        load_dataset(f"minari:{bad}")


def test_generate_refuses_an_unknown_suffix_in_one_line_and_writes_hdf5(tmp_path, capsys):
    from rl.generate import main

    with pytest.raises(SystemExit, match=r"^error: cannot write a dataset to .*x\.txt.*\.npz, \.hdf5, \.h5") as e:
        main(["--env", "Hopper-v5", "--quality", "random", "--steps", "5", "--out", str(tmp_path / "x.txt")])
    assert "\n" not in str(e.value)
    main(["--env", "Hopper-v5", "--quality", "random", "--steps", "40", "--seed", "3", "--out", str(tmp_path / "x.h5")])
    ds = load_dataset(tmp_path / "x.h5")
    assert len(ds) == 40 and ds.metadata["env"] == "Hopper-v5" and ds.metadata["quality"] == "random"


def test_train_takes_an_hdf5_file_without_env_metadata(tmp_path):
    from rl.train import TrainConfig, train
    from tests.test_rl_train import TINY, _hopper_like

    ds = _hopper_like(np.random.default_rng())
    path = tmp_path / "d.hdf5"
    _write_d4rl(path, n=len(ds), observations=ds.observations, actions=ds.actions, rewards=ds.rewards,
                terminals=ds.terminals, timeouts=ds.timeouts)
    cfg = TrainConfig(algo="dt", steps=2, seed=0, batch_size=4, log_every=1, eval_episodes=0, warmup_steps=1)
    with pytest.raises(ValueError, match=r"names env None.*--env"):
        train(cfg, path, tmp_path / "run0", model_overrides=TINY, progress=False)
    train(cfg, path, tmp_path / "run", model_overrides=TINY, progress=False, env_id="Hopper-v5")
    info = json.loads((tmp_path / "run" / "config.json").read_text())
    assert info["env"] == "Hopper-v5" and info["step"] == 2
