"""The demo hub: one Gradio Blocks app with an overview tab and a tab per registered app."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import socket
from collections.abc import Sequence

from apps import REGISTRY, AppSpec, get_app
from core.infra.cli import add_run_options, configure_run, port as port_arg

logger = logging.getLogger(__name__)

__all__ = ["build_hub", "build_single", "serve", "check_address", "build_parser", "main", "overview_markdown"]


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
    """The overview tab's text: what each app does, where its code is, and its status."""
    lines = [
        "# longctx",
        "Long-context multimodal and domain-specific applications on one shared attention core. "
        "Every app runs on this machine with its embedded default model; nothing is downloaded.",
        "",
        "| app | what it does | code | status | demo |",
        "|---|---|---|---|---|",
    ]
    for s in specs:
        demo = "tab in this hub" if s.ui_module else "not yet"
        lines.append(f"| {s.title} | {s.summary} | `{s.package}` | {s.status} | {demo} |")
    return "\n".join(lines)


def _build_app_tab(spec: AppSpec) -> None:
    module = importlib.import_module(spec.ui_module)  # type: ignore[arg-type]
    module.build_ui()


def build_hub(specs: Sequence[AppSpec] = REGISTRY):
    """Build (not launch) the hub's ``gr.Blocks``."""
    gr = _gradio()
    with gr.Blocks(title="longctx", analytics_enabled=False) as demo:
        with gr.Tabs():
            with gr.Tab("Overview", id="overview"):
                gr.Markdown(overview_markdown(specs), elem_id="overview-table")
            for spec in specs:
                if spec.ui_module is None:
                    continue
                with gr.Tab(spec.title, id=spec.key, elem_id=f"tab-{spec.key}"):
                    _build_app_tab(spec)
    return demo


def build_single(key: str):
    """Build one app's demo alone, as ``python -m apps.<key>`` serves it."""
    gr = _gradio()
    spec = get_app(key)
    if spec.ui_module is None:
        raise ValueError(f"app {key!r} has no demo yet (status: {spec.status})")
    with gr.Blocks(title=f"longctx · {spec.title}", analytics_enabled=False) as demo:
        _build_app_tab(spec)
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


def build_parser(prog: str = "python -m apps", description: str = "Serve the longctx demo hub.") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=port_arg, default=7860, help="port, 1..65535 (default 7860)")
    add_run_options(p, threads=False)
    return p


def main(argv: Sequence[str] | None = None, *, app: str | None = None) -> None:
    """Entry point of ``python -m apps`` (the hub) and of ``python -m apps.<key>`` (``app=key``)."""
    prog = "python -m apps" if app is None else f"python -m apps.{app}"
    args = build_parser(prog=prog).parse_args(argv)
    check_address(args.host, args.port)
    configure_run(args)
    demo = build_hub() if app is None else build_single(app)
    serve(demo, host=args.host, port=args.port)
