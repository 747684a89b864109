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
        status="works, with its own CPU-trained checkpoint or the official TabICL v1, v1.1 and v2 checkpoints (predict_proba within 1e-7 of the official package); accuracy target met on the report suite (0.916 vs HistGradientBoosting 0.913), not on the reserved tables with its own checkpoint (0.798 vs 0.855); 500K × 100 tables predicted with 4.9 GB peak memory",
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
        status="working, also on local InternVL models (CoMemo.from_hf); the shipped comemo model (reference memory layout) answers the needle question about 1-8 images (0.925-0.975); RoPE-DHR beats 1-D positions beyond the trained length on tiled images (5 seeds, from a single-tile start); in the 5-seed control against the same network with its memory gates frozen at 0, middle-third retrieval at 64 images is -0.05 (95% t interval -0.30 to +0.20): the +10-point target is not met",
    ),
    AppSpec(
        key="emloc",
        title="EMLoC",
        summary="Training-free multimodal long-context compression of demonstrations under a JS-divergence bound.",
        package="apps/emloc/",
        ui_module="apps.emloc.ui",
        status="works with a small shipped host that learns in context and on local Qwen2-VL, Qwen2.5-VL and InternVL models (compress_hf); on a task recency cannot solve, EMLoC keeps 23-25% of the cache but is level with keeping only the answer tokens and 1.4-3.9 points below H2O and SnapKV given the same kept answers (targets not met)",
    ),
    AppSpec(
        key="ncal",
        title="NCAL",
        summary="Neural-collapse regularization for long-tailed educational text classification.",
        package="apps/ncal/",
        ui_module="apps.ncal.ui",
        status="works on TMWPL and PMTD with small shipped models (test macro-F1 0.631 and 0.469) and trains local decoder LLMs with LoRA (--encoder hf:DIR --head lm); TF-IDF + class-weighted logistic regression (0.715 / 0.541) beats every loss, tc at its validation-chosen lambda is level with ce (+0.04 / +0.85 points, intervals across 0; with a randomly initialised encoder +0.47 / +0.24, which is itself 10 points above the pretrained one on TMWPL), so no target is met",
    ),
)


def get_app(key: str) -> AppSpec:
    """Look an app up by key; ``ValueError`` lists the known keys."""
    for spec in REGISTRY:
        if spec.key == key:
            return spec
    raise ValueError(f"unknown app {key!r}; known apps: {[s.key for s in REGISTRY]}")
