"""Bookkeeping of the pathology efficiency benchmark: ratios and skips for timed-out or out-of-memory peers."""

from benchmarks.pathology_efficiency import EAGER, _ratios, _skip_reason


def _ok(model, n, cpu, mb, mode="forward"):
    return {"status": "ok", "model": model, "n": n, "mode": mode, "cpu_s": cpu, "seconds": cpu, "peak_mb": mb}


def test_ratios_against_both_dense_peers():
    rows = [_ok("querent", 4096, 1.0, 80.0), _ok("dense", 4096, 2.0, 40.0), _ok(EAGER, 4096, 3.0, 800.0)]
    _ratios(rows, "cpu")
    q = rows[0]
    assert q["dense_over_querent_time"] == 2.0 and q["dense_over_querent_memory"] == 0.5
    assert q["eager_over_querent_time"] == 3.0 and q["eager_over_querent_memory"] == 10.0
    assert "ratio_note" not in q


def test_out_of_memory_peer_gives_a_memory_lower_bound_and_skips_larger_sizes():
    oom = {"status": "oom", "model": EAGER, "n": 65536, "mode": "forward", "peak_mb_at_oom": 300.0,
           "failed_alloc_bytes": 64 * 2**30}
    rows = [_ok("querent", 65536, 20.0, 512.0), oom]
    _ratios(rows, "cpu")
    q = rows[0]
    assert q["eager_over_querent_memory"] == 64 * 1024 / 512.0
    assert "eager_over_querent_time" not in q  # a failed run has no comparable time
    assert "out of memory" in q["ratio_note"]
    assert _skip_reason(rows, EAGER, 102400, "forward").startswith("skipped")
    assert _skip_reason(rows, EAGER, 65536, "train").startswith("skipped")
    assert _skip_reason(rows, EAGER, 16384, "train") is None
    assert _skip_reason(rows, "querent", 102400, "forward") is None
