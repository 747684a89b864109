"""TabICL tab: served through Gradio, a comparison runs end to end with the shipped checkpoint."""

from __future__ import annotations

import pytest

gr = pytest.importorskip("gradio")
gradio_client = pytest.importorskip("gradio_client")

from tests._hub_server import served_ui  # noqa: E402


@pytest.fixture(scope="module")
def served():
    with served_ui("apps.tabicl.ui") as url:
        yield url


def test_compare_on_bundled_table(served, tmp_path):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(np.random.randint(0, 10_000))
    n = 80
    y = rng.integers(0, 2, n)
    df = pd.DataFrame({"x1": y * 2.5 + rng.normal(size=n), "color": np.where(y == 1, "red", "blue"),
                       "label": np.where(y == 1, "pos", "neg")})
    path = tmp_path / "t.csv"
    df.to_csv(path, index=False)
    client = gradio_client.Client(served, verbose=False)
    models, conf, proba, status = client.predict(
        "iris", gradio_client.handle_file(str(path)), "label", 0.3, 2, 0, 0, api_name="/tabicl_run"
    )
    assert "Done" in status and "2 classes" in status
    names = [row[0] for row in models["data"]]
    assert names == ["TabICL", "LogisticRegression", "RandomForest", "HistGradientBoosting", "kNN"]
    counts = np.array([row[1:] for row in conf["data"]], dtype=float)
    assert counts.sum() == 24  # 30% of 80 rows held out
    p = np.array([row[1:] for row in proba["data"]], dtype=float)
    assert np.allclose(p.sum(1), 1, atol=1e-3)


def test_unknown_target_is_a_clear_error(served):
    client = gradio_client.Client(served, verbose=False)
    with pytest.raises(Exception, match="not in the table"):
        client.predict("iris", None, "nope", 0.3, 1, 0, 0, api_name="/tabicl_run")


def test_status_reports_the_feature_reduction(monkeypatch):
    import numpy as np
    import pandas as pd

    import tabular.compare
    from apps.tabicl.ui import run_comparison

    rng = np.random.default_rng(0)
    n, f = 90, 48  # wider than the shipped checkpoint's 40-feature pretraining: "auto" tries projections
    y = rng.integers(0, 2, n)
    df = pd.DataFrame(rng.normal(size=(n, f)) + y[:, None] * 0.8, columns=[f"x{i}" for i in range(f)]).assign(label=y)
    seen = {}
    real = tabular.compare.compare_on_table

    def spy(*args, **kwargs):
        seen["out"] = real(*args, **kwargs)
        return seen["out"]

    monkeypatch.setattr(tabular.compare, "compare_on_table", spy)
    monkeypatch.setattr("apps.tabicl.ui._table", lambda dataset, csv_path: df)
    *_, status = run_comparison("iris", None, "label", 0.3, 1, 0)
    red = seen["out"]["tabicl_reduction"]
    if red is None:
        assert "principal components" not in status and "48 informative features" in status
    else:
        assert f"onto {red['components']} principal components" in status and red["numeric_columns"] == 48


def test_finetuning_through_the_tab(served, tmp_path):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(3)
    n = 90
    y = rng.integers(0, 2, n)
    df = pd.DataFrame({"x1": y * 2.0 + rng.normal(size=n), "x2": rng.normal(size=n), "label": y})
    path = tmp_path / "t.csv"
    df.to_csv(path, index=False)
    client = gradio_client.Client(served, verbose=False)
    *_, status = client.predict("iris", gradio_client.handle_file(str(path)), "label", 0.3, 1, 0, 10,
                                api_name="/tabicl_run")
    assert "fine-tuned on the train rows for 10 steps" in status
    with pytest.raises(Exception, match="300"):  # the slider's bound (Gradio checks it before the call)
        client.predict("iris", None, "target", 0.3, 1, 0, 1000, api_name="/tabicl_run")
    from apps.tabicl.ui import run_comparison

    with pytest.raises(ValueError, match="fine-tuning steps must be in"):  # called from Python
        run_comparison("iris", None, "target", 0.3, 1, 0, 1000)
