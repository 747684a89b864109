"""What a card says beyond its JSON: the project's licence, the generator's name, and per-package text (intended
use, out-of-scope use, tags)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)


REPO = Path(__file__).resolve().parents[3]  # core/infra/model_card/texts.py -> the repository
NOT_RECORDED = "not recorded"
LICENSE = "mit"  # the project's licence (pyproject.toml), which covers the weights it trains
GENERATOR = "python -m core.infra.model_card"


@dataclass(kw_only=True)
class CardText:
    """What a card says about a family of weights that the JSON does not: use, misuse, tags."""

    intended_use: str = NOT_RECORDED  # who should load these weights, for what
    out_of_scope: str = NOT_RECORDED  # uses the weights were not made or checked for
    tags: list[str] = field(default_factory=list)  # Hugging Face tags beside "longctx" and the package name
    pipeline_tag: str | None = None  # Hugging Face task id, when one fits
    datasets: list[str] = field(default_factory=list)  # data names for the YAML header (the body has the details)
    limitations: list[str] = field(default_factory=list)  # general limits of the family, before the JSON's notes
    language: str | None = None  # ISO 639-1 code of the text the model reads, when it reads text


_SYNTHETIC_SLIDES = "synthetic slides (pathology.synthetic)"

# Keyed by "<package>" or "<package>/<stem prefix>" (the longest matching key wins).
PACKAGE_TEXT: dict[str, CardText] = {
    "tabular": CardText(
        intended_use=(
            "Default checkpoint of `tabular.TabICLClassifier` (`TabICLClassifier(checkpoint=PATH)` for another file): "
            "in-context classification of tables with numeric, categorical and missing values, on CPU or GPU, "
            "without training on the table (optionally fine-tuned on it with `finetune_steps`). Also used by "
            "`python -m tabular.compare`, the hub's TabICL tab and `benchmarks.tabular_*`."
        ),
        out_of_scope=(
            "Regression targets (refused by the estimator). Decisions about people without a validation on the "
            "population concerned. Tables much wider than the pretraining tables (`pretrained_max_features`) "
            "without feature reduction. Accuracy claims on tables unlike the benchmarked ones."
        ),
        tags=["tabular-classification", "in-context-learning", "tabicl"],
        pipeline_tag="tabular-classification",
        datasets=["synthetic tables (tabular.prior.TablePrior)"],
        limitations=[
            "Pretrained on synthetic tables only; no real table was used in training or checkpoint selection.",
        ],
    ),
    "pathology": CardText(
        intended_use=(
            "Stand-in weights so the whole-slide pipeline (`pathology`) and the hub's Querent tab run out of the box "
            "on this project's synthetic slides, in tests, demos and benchmarks."
        ),
        out_of_scope=(
            "Any real histology slide, any diagnostic, clinical or research claim: the weights know only the "
            "project's synthetic slides. For real work pass a trusted encoder and train a slide model on real data."
        ),
        tags=["pathology", "whole-slide-images", "synthetic-data"],
        datasets=[_SYNTHETIC_SLIDES],
        limitations=["Trained and evaluated on synthetic slides only; the numbers above say nothing about real tissue."],
    ),
    "pathology/patch_encoder": CardText(
        tags=["pathology", "image-feature-extraction", "synthetic-data"],
        pipeline_tag="image-feature-extraction",
    ),
    "pathology/querent": CardText(
        tags=["pathology", "multiple-instance-learning", "querent", "synthetic-data"],
        pipeline_tag="image-classification",
    ),
    "video": CardText(
        intended_use=(
            "A model of `video` (∞-Video): answers the closed set of questions about this project's synthetic videos, "
            "over any video length with the continuous long-term memory."
        ),
        out_of_scope=(
            "Real videos and open-ended questions: the model was trained on small synthetic clips with a fixed set "
            "of answers."
        ),
        tags=["video-question-answering", "q-former", "continuous-memory", "synthetic-data"],
        datasets=["synthetic clips (video.synthetic)"],
        limitations=["Trained and validated on synthetic clips only."],
    ),
    "video/videoqa_tiny": CardText(
        intended_use=(
            "Default model of `video` (∞-Video): answers the closed set of questions about this project's synthetic "
            "videos in the batch CLI, the benchmarks and the hub's ∞-Video tab, over any video length with the "
            "continuous long-term memory."
        ),
    ),
    "rl": CardText(
        intended_use="Offline-RL experiments of `rl` (Decision Mixer) on the named MuJoCo environment.",
        out_of_scope=(
            "Control of real robots, and environments other than the one named. Scores come from this project's own "
            "datasets and policies: they are not D4RL results."
        ),
        tags=["reinforcement-learning", "mujoco", "offline-rl"],
        pipeline_tag="reinforcement-learning",
        limitations=["Evaluated in simulation (gymnasium MuJoCo v5) only."],
    ),
    "rl/behaviour": CardText(
        intended_use=(
            "Behaviour policies: the actor snapshots that `python -m rl.generate` runs to write this project's offline "
            "datasets (medium, expert and medium-replay qualities, chosen by the quality rule below), and the "
            "expert reference returns of `rl.references`."
        ),
        tags=["reinforcement-learning", "mujoco", "sac", "behaviour-policy"],
    ),
    "rl/dm": CardText(
        intended_use=(
            "Default Decision Mixer of the hub's Decision Mixer tab: acts in the named environment from a target "
            "return, showing the router's token selection."
        ),
        tags=["reinforcement-learning", "mujoco", "offline-rl", "decision-transformer", "decision-mixer"],
    ),
}

# JSON fields rendered in the sections below, in order of preference; whatever is left goes to "Other fields".
_DESCRIPTION = ("what_it_is", "description")
_NAME = ("name", "model")
_ARCH = ("config", "model_config")
_DATA = ("data", "dataset", "validation_set")
_COMMAND = ("command",)
_TRAIN = (
    "commands", "algorithm", "env", "algo", "train_config", "train", "steps", "step", "trained_steps", "batch",
    "batch_size", "tables_seen", "pretrained_max_features", "processes", "threads", "hardware", "wall_time_s",
    "train_seconds", "train_wall_s", "finished", "status", "input", "output_dim", "class_names", "patch_mpp",
    "patch_size", "min_tissue", "encoder", "recipe", "init_from", "aggregate", "memory_in_loop", "readout_note",
)
_EVAL = (
    "metrics", "held_out_metrics", "held_out_slides", "validation", "validation_on_held_out_prior", "benchmark",
    "finetuned_benchmark", "scaling", "eval_targets", "snapshots", "qualities", "quality_rule", "per_class",
)
_SELECTION = ("selection", "selection_candidates")  # how the shipped checkpoint was chosen among others
_NOTES = ("notes", "note")
_METRIC_WORDS = (  # leaf-key fragments -> metric ids for the YAML header
    ("balanced_accuracy", "balanced_accuracy"),
    ("auc", "roc_auc"),
    ("log_loss", "log_loss"),
    ("recall", "recall"),
    ("acc", "accuracy"),
    ("loss", "loss"),
    ("mean_return", "mean_return"),
    ("score", "normalized_score"),
    ("peak_rss", "peak_rss_mb"),
    ("cpu_s", "cpu_seconds"),
    ("f1", "f1"),
)


