"""Start the demo hub (or one app) as a real subprocess on a free port, for browser and API tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_hub(module: str = "apps", *, timeout: float = 240.0, log_path: Path | None = None):
    """Run ``python -m <module> --port P`` and yield its base URL once it answers HTTP."""
    port = free_port()
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"`python -m {module}` exited with code {proc.returncode} before serving (log: {log_path})")
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"`python -m {module}` did not serve {url} within {timeout:.0f} s (log: {log_path})")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log_path:
            log.close()


@contextlib.contextmanager
def served_ui(ui_module: str):
    """Build one app's UI (``<ui_module>.build_ui()``) in-process, serve it on a free port, yield its URL."""
    import importlib

    import gradio as gr

    module = importlib.import_module(ui_module)
    with gr.Blocks() as demo:
        module.build_ui()
    port = free_port()
    demo.queue().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, show_error=True)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()
