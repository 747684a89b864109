"""Gradio faces of longctx: one demo per app and the hub that mounts them all.

The registry below is the explicit list of apps the hub shows. Importing this package does no work:
each app's UI module is imported only when the hub (or ``python -m apps.<key>``) builds it. The registry is also
the one source of every app's status: the hub's overview and the root README's apps table are generated from it
(``python -m apps.readme_table``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AppSpec", "REGISTRY", "STATUS_MAX", "get_app"]

#: the longest status line the overview and the README table take (characters)
STATUS_MAX = 200


@dataclass(frozen=True, kw_only=True)
class AppSpec:
    """One app of the suite, as the hub and the tests see it."""

    key: str  # short id: tab id, element-id prefix (`{key}-example`, `{key}-status`), api_name prefix
    title: str  # tab label
    summary: str  # one line for the overview tab
    package: str  # where its code lives
    ui_module: str | None  # module exposing `build_ui()`; None while the app has no demo yet
    # What runs today and the headline number, in one short line (at most STATUS_MAX characters); details (numbers,
    # setups, targets met or not) belong in the package README's results. The single source of the status: the
    # hub's overview tab and the root README's apps table (written by `python -m apps.readme_table`, checked by
    # tests/test_hub.py) both show it.
    status: str
    # Where the numbers behind the status are: "<README path>#<heading>" (the hub's overview shows that section).
    results: str | None = None
    # What the tab's "your own model" field takes (a folder or file of the real architecture); None: no such field.
    # `python -m apps --app KEY --model PATH` serves the tab with that model filled in.
    own_model: str | None = None
    example_expect: str = "Done"  # text that `#{key}-status` shows after the bundled example ran


REGISTRY: tuple[AppSpec, ...] = (
    AppSpec(
        key="attention",
        title="Attention core",
        summary="One attention() entry point with reference, SDPA, chunked and Triton backends; block-sparse top-k attention.",
        package="core/, kernels/",
        ui_module="apps.attention.ui",
        status='serves any transformers model (attn_implementation="longctx": sinks, sparse indices, packed masks); padded prefill 0.12-0.57x SDPA time on CPU; Triton checked in the interpreter only',
        results="core/README.md#Benchmark (CPU)",
    ),
    AppSpec(
        key="tabicl",
        title="TabICL",
        summary="In-context classification of large tables, scikit-learn compatible.",
        package="tabular/",
        ui_module="apps.tabicl.ui",
        status="works with its own and the official checkpoints (any number of classes, regression; within 7.6e-6 of the official package); 0.916 vs HistGradientBoosting 0.913 on the report suite",
        results="tabular/README.md#Results",
        own_model="an official TabICL checkpoint (.ckpt) or a tabular.convert output (.safetensors)",
    ),
    AppSpec(
        key="querent",
        title="Querent",
        summary="Query-aware sparse attention over gigapixel whole-slide images, with the slide pipeline around it.",
        package="pathology/",
        ui_module="apps.querent.ui",
        status="works on synthetic slides; 120-slide cohorts: AUC 0.855 vs mean pooling 0.774 with 500-patch bags, at chance with 2,000-patch bags (target not met)",
        results="pathology/README.md#Results",
        own_model="a pathology.train output folder (its fold models)",
    ),
    AppSpec(
        key="infinite_video",
        title="∞-Video",
        summary="Continuous-time long-term memory for video Q-formers: any video length in bounded memory.",
        package="video/",
        ui_module="apps.infinite_video.ui",
        status="works on synthetic long videos and local InstructBLIP-Video (within 1e-5 of the released memory); sticky memory +9.8 points over uniform at 4K frames, +4.7 at 16K (+10 not met)",
        results="video/README.md#Results",
        own_model="a local InstructBLIP-Video folder, as hf:DIR",
    ),
    AppSpec(
        key="decision_mixer",
        title="Decision Mixer",
        summary="Offline RL with dynamic token selection, datasets and training runs.",
        package="rl/",
        ui_module="apps.decision_mixer.ui",
        status="works on Hopper, HalfCheetah and Walker2d; the released DM forward reproduced within 5e-7; DM − DT −1.4 [−7.2, +5.0] on three Hopper datasets (+5 not met)",
        results="rl/README.md#Results",
        own_model="an rl.train output folder or a policy .safetensors file",
    ),
    AppSpec(
        key="comemo",
        title="CoMemo",
        summary="Dual-path vision-language model (image context + gated cross-attention memory) with RoPE-DHR.",
        package="apps/comemo/",
        ui_module="apps.comemo.ui",
        status="works with its small model (exact match 0.925-0.975 on 2-8 images), local InternVL and converted CoMemo releases (within 4.1e-6 of the released code); memory-path target not met",
        results="apps/comemo/README.md#Benchmark",
        own_model="a local InternVL folder or an apps.comemo.convert output folder",
    ),
    AppSpec(
        key="emloc",
        title="EMLoC",
        summary="Training-free multimodal long-context compression of demonstrations under a JS-divergence bound.",
        package="apps/emloc/",
        ui_module="apps.emloc.ui",
        status="works with its small host and local Qwen2-VL / Qwen2.5-VL / InternVL / LLaVA-OneVision; the released search's choices exactly; peak 0.98× the full prefill at 2B shapes",
        results="apps/emloc/README.md#Real models",
        own_model="a local Qwen2-VL / Qwen2.5-VL / InternVL folder, with a demonstrations CSV",
    ),
    AppSpec(
        key="ncal",
        title="NCAL",
        summary="Neural-collapse regularization for long-tailed educational text classification.",
        package="apps/ncal/",
        ui_module="apps.ncal.ui",
        status="works on TMWPL and PMTD (test macro-F1 0.631 / 0.469) and on local LLMs with LoRA; TC is level with cross-entropy (target not met)",
        results="apps/ncal/README.md#Benchmark",
        own_model="an apps.ncal.train output folder (a LoRA adapter or a small model)",
    ),
)


def get_app(key: str) -> AppSpec:
    """Look an app up by key; ``ValueError`` lists the known keys."""
    for spec in REGISTRY:
        if spec.key == key:
            return spec
    raise ValueError(f"unknown app {key!r}; known apps: {[s.key for s in REGISTRY]}")
