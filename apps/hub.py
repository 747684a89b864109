"""The demo hub: one Gradio Blocks app with an overview tab and a tab per registered app.

``python -m apps`` (or ``python -m apps.hub``) serves the hub; ``python -m apps --app KEY`` one app's tab alone, and
``--model PATH`` with it fills that tab's "your own model" field (a folder or file of the app's real architecture,
see ``AppSpec.own_model``).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import os
import socket
from collections.abc import Sequence
from pathlib import Path

from apps import REGISTRY, AppSpec, get_app
from core.infra.cli import UsageError, add_run_options, configure_run, port as port_arg, run_cli

logger = logging.getLogger(__name__)

__all__ = ["build_hub", "build_single", "serve", "check_address", "build_parser", "main", "overview_markdown",
           "results_section", "check_model_option", "REPO"]

REPO = Path(__file__).resolve().parents[1]


def _gradio():
    # Analytics off before gradio is imported; no network from the demo.
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import gradio as gr
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("the demos need gradio: pip install 'longctx-suite[apps]'") from e
    return gr


def overview_markdown(specs: Sequence[AppSpec] = REGISTRY) -> str:
    """The overview tab's text: per app, what it does, one short status line and where its results are."""
    lines = [
        "# longctx",
        "Long-context multimodal and domain-specific applications on one shared attention core. "
        "Every app runs on this machine with its embedded default model, and the apps with a real-model path take "
        "your own model in their tab; nothing is downloaded.",
        "",
    ]
    for s in specs:
        where = f"Results: `{s.results.split('#')[0]}`, section {s.results.split('#', 1)[1]!r} (open it below)." if s.results else ""
        lines.append(f"- **{s.title}** — {s.summary}  ")
        lines.append(f"  *Status:* {s.status}. {where}".rstrip())
    return "\n".join(lines)


def results_section(spec: AppSpec, *, root: Path = REPO) -> str | None:
    """The README section that ``spec.results`` names (``"path#Heading"``: the first heading starting with that
    text, down to the next heading of the same or a higher level), or None when the file or heading is missing."""
    if not spec.results:
        return None
    rel, _, heading = spec.results.partition("#")
    path = root / rel
    if not path.is_file():
        return None
    out: list[str] = []
    level = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        hashes = len(line) - len(line.lstrip("#"))
        is_heading = 0 < hashes <= 6 and line[hashes:hashes + 1] == " "
        if level:
            if is_heading and hashes <= level:
                break
            out.append(line)
        elif is_heading and line[hashes:].strip().startswith(heading):
            level = hashes
            out.append("#" * min(hashes + 1, 6) + line[hashes:])
    return "\n".join(out).strip() or None


def _build_app_tab(spec: AppSpec, model: str | None = None) -> None:
    module = importlib.import_module(spec.ui_module)  # type: ignore[arg-type]
    if model is not None:
        module.build_ui(model=model)
    else:
        module.build_ui()


def build_hub(specs: Sequence[AppSpec] = REGISTRY):
    """Build (not launch) the hub's ``gr.Blocks``."""
    gr = _gradio()
    with gr.Blocks(title="longctx", analytics_enabled=False) as demo:
        with gr.Tabs():
            with gr.Tab("Overview", id="overview"):
                gr.Markdown(overview_markdown(specs), elem_id="overview-table")
                for spec in specs:
                    section = results_section(spec)
                    if section:
                        with gr.Accordion(f"{spec.title}: results ({spec.results.split('#')[0]})", open=False):
                            gr.Markdown(section, elem_id=f"overview-results-{spec.key}")
            for spec in specs:
                if spec.ui_module is None:
                    continue
                with gr.Tab(spec.title, id=spec.key, elem_id=f"tab-{spec.key}"):
                    _build_app_tab(spec)
    return demo


def check_model_option(key: str | None, model: str | None) -> None:
    """Refuse ``--model`` without ``--app``, for an app with no real-model path, or naming a path that does not
    exist (``UsageError``, one line)."""
    if model is None:
        return
    if key is None:
        raise UsageError("--model needs --app NAME: it fills one tab's own-model field "
                         f"(apps with one: {', '.join(s.key for s in REGISTRY if s.own_model)})")
    spec = get_app(key)
    if not spec.own_model:
        raise UsageError(f"--model: the {spec.title} tab takes no model of your own "
                         f"(apps that do: {', '.join(s.key for s in REGISTRY if s.own_model)})")
    path = model[3:] if model.startswith("hf:") else model
    if not Path(path).expanduser().exists():
        raise UsageError(f"--model {model}: no such file or folder (the {spec.title} tab takes {spec.own_model})")
    module = importlib.import_module(spec.ui_module)  # type: ignore[arg-type]
    if "model" not in inspect.signature(module.build_ui).parameters:  # pragma: no cover - a registry/UI mismatch
        raise UsageError(f"--model: the {spec.title} tab has no own-model field yet")


def build_single(key: str, model: str | None = None):
    """Build one app's demo alone, as ``python -m apps.<key>`` (or ``python -m apps --app KEY``) serves it;
    ``model`` fills its own-model field."""
    gr = _gradio()
    spec = get_app(key)
    if spec.ui_module is None:
        raise ValueError(f"app {key!r} has no demo yet (status: {spec.status})")
    with gr.Blocks(title=f"longctx · {spec.title}", analytics_enabled=False) as demo:
        _build_app_tab(spec, model)
    return demo


def serve(demo, *, host: str = "127.0.0.1", port: int = 7860, share: bool = False) -> None:
    """Launch a built Blocks app on ``host:port`` (blocking)."""
    demo.queue(default_concurrency_limit=2)
    demo.launch(server_name=host, server_port=port, share=share, show_error=True)


def check_address(host: str, port: int) -> None:
    """Refuse, before anything is built, a port outside 1..65535 or a host name that does not resolve
    (``ValueError`` naming it; otherwise the server only fails later with a misleading "Cannot find empty port")."""
    if not 1 <= port <= 65535:
        raise ValueError(f"--port must be in 1..65535, got {port}")
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise ValueError(f"--host {host!r} does not resolve to an address ({why}); give an interface of this "
                         "machine, e.g. 127.0.0.1 or 0.0.0.0") from None


def build_parser(prog: str = "python -m apps", description: str = "Serve the longctx demo hub.", *,
                 app: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=port_arg, default=7860, help="port, 1..65535 (default 7860)")
    if app is None:
        p.add_argument("--app", choices=[s.key for s in REGISTRY if s.ui_module], default=None,
                       help="serve this app's tab alone (default: the hub with every app)")
    own = [f"{s.key}: {s.own_model}" for s in REGISTRY if s.own_model]
    p.add_argument("--model", default=None, metavar="PATH",
                   help="your own model for the served tab (needs --app unless the command is one app's); "
                        + "; ".join(own))
    add_run_options(p, threads=False)
    return p


def main(argv: Sequence[str] | None = None, *, app: str | None = None) -> None:
    """Entry point of ``python -m apps`` (the hub) and of ``python -m apps.<key>`` (``app=key``)."""
    prog = "python -m apps" if app is None else f"python -m apps.{app}"
    args = build_parser(prog=prog, app=app).parse_args(argv)
    key = app if app is not None else args.app
    check_address(args.host, args.port)
    check_model_option(key, args.model)
    configure_run(args)
    demo = build_hub() if key is None else build_single(key, args.model)
    serve(demo, host=args.host, port=args.port)


if __name__ == "__main__":  # python -m apps.hub is python -m apps
    raise SystemExit(run_cli(main))
