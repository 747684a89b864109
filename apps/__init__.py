"""Gradio faces of longctx: one demo per app and the hub that mounts them all.

The registry below is the explicit list of apps the hub shows. Importing this package does no work:
each app's UI module is imported only when the hub (or ``python -m apps.<key>``) builds it. The registry is also
the one source of every app's status: the hub's overview and the root README's apps table are generated from it
(``python -m apps.readme_table``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AppSpec", "REGISTRY", "get_app"]


@dataclass(frozen=True, kw_only=True)
class AppSpec:
    """One app of the suite, as the hub and the tests see it."""

    key: str  # short id: tab id, element-id prefix (`{key}-example`, `{key}-status`), api_name prefix
    title: str  # tab label
    summary: str  # one line for the overview tab
    package: str  # where its code lives
    ui_module: str | None  # module exposing `build_ui()`; None while the app has no demo yet
    # What works today, said plainly in one sentence short enough for a table cell; details (numbers, setups)
    # belong in the package README. The single source of the status: the hub's overview tab and the root
    # README's apps table (written by `python -m apps.readme_table`, checked by tests/test_hub.py) both show it.
    status: str
    example_expect: str = "Done"  # text that `#{key}-status` shows after the bundled example ran


REGISTRY: tuple[AppSpec, ...] = (
    AppSpec(
        key="attention",
        title="Attention core",
        summary="One attention() entry point with reference, SDPA, chunked and Triton backends; block-sparse top-k attention.",
        package="core/, kernels/",
        ui_module="apps.attention.ui",
        status="works; Triton kernels verified in Triton's CPU interpreter only; a one-command GPU validation is prepared (make gpu-check) but has not run on a GPU yet",
    ),
    AppSpec(
        key="tabicl",
        title="TabICL",
        summary="In-context classification of large tables, scikit-learn compatible.",
        package="tabular/",
        ui_module="apps.tabicl.ui",
        status="works; accuracy target met on the report suite (0.916 vs HistGradientBoosting 0.913, LogisticRegression 0.916), not on the untouched reserved tables (0.798 vs 0.855 and 0.819; 3 splits each); 500K × 100 tables predicted with 4.9 GB peak memory",
    ),
    AppSpec(
        key="querent",
        title="Querent",
        summary="Query-aware sparse attention over gigapixel whole-slide images, with the slide pipeline around it.",
        package="pathology/",
        ui_module="apps.querent.ui",
        status="works on synthetic slides; 12.7× faster forward than exact dense attention at 64K patches (8.8× in the sparse-regime run); where it is sparse (~10K patches, 14% of regions per query) above dense on the co-occurrence label (+0.095 AUC [+0.039, +0.145], two seeds), while no model learns the spatial label; 64K memory target met only against materialised dense attention",
    ),
    AppSpec(
        key="infinite_video",
        title="∞-Video",
        summary="Continuous-time long-term memory for video Q-formers: any video length in bounded memory.",
        package="video/",
        ui_module="apps.infinite_video.ui",
        status="works on synthetic long-video QA in bounded memory and on local InstructBLIP-Video models (hf:DIR); on answer-balanced questions with the mean-over-chunks read-out the training-free sticky memory is within 3 points of uniform sampling and non-sticky memory at 4K-16K frames (not the +10 targeted), and MovieChat scores higher",
    ),
    AppSpec(
        key="decision_mixer",
        title="Decision Mixer",
        summary="Offline RL with dynamic token selection, datasets and training runs.",
        package="rl/",
        ui_module="apps.decision_mixer.ui",
        status=("works on Hopper, HalfCheetah and Walker2d; in the decisive run (3 wide Hopper datasets, 10 seeds) "
                "DM − DT is −1.4 [−7.2, +5.0] normalized, so the +5 target is not met"),
    ),
    AppSpec(
        key="comemo",
        title="CoMemo",
        summary="Dual-path vision-language model (image context + gated cross-attention memory) with RoPE-DHR.",
        package="apps/comemo/",
        ui_module="apps.comemo.ui",
        status="working: the shipped comemo model answers the needle question about 1-8 images (0.95-0.975); at 64 images and equal parameters, over 3 seeds, the memory path lifts retrieval of the middle third by +0.28 (95% interval +0.05 to +0.56) over the context-only model, but it names an image beyond the trained 8 only when trained with labels up to 64, and then (one seed) better than the context-only model at 32 images and worse at 64",
    ),
    AppSpec(
        key="emloc",
        title="EMLoC",
        summary="Training-free multimodal long-context compression of demonstrations under a JS-divergence bound.",
        package="apps/emloc/",
        ui_module="apps.emloc.ui",
        status="works with a small shipped host that learns in context (0.97-0.98 on held-out 5-way classes with 16-512 demonstrations); benchmark complete: at a development-chosen delta EMLoC keeps 21-24% of the cache at 64-512 demonstrations and loses at most 0.4 points (target met), but it is level with H2O at the same budget instead of 5 points above it (not met); its chunked prefill peaks at 25-35% of the full prefill memory at 256-2048 demonstrations",
    ),
    AppSpec(
        key="ncal",
        title="NCAL",
        summary="Neural-collapse regularization for long-tailed educational text classification.",
        package="apps/ncal/",
        ui_module="apps.ncal.ui",
        status="works on TMWPL and PMTD with small shipped models (loss chosen on a validation hold-out: cb on TMWPL, tc on PMTD; test macro-F1 0.631 and 0.469); benchmark complete (6 losses × 5 seeds): tc is level with ce (+0.1 and +0.0 points), logit adjustment is the best loss, and TF-IDF + class-weighted logistic regression (0.715 / 0.541) beats every loss, so no target is met",
    ),
)


def get_app(key: str) -> AppSpec:
    """Look an app up by key; ``ValueError`` lists the known keys."""
    for spec in REGISTRY:
        if spec.key == key:
            return spec
    raise ValueError(f"unknown app {key!r}; known apps: {[s.key for s in REGISTRY]}")
