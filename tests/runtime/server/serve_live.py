"""Helpers for tests against a real ``expertfs serve`` subprocess on 127.0.0.1 over a tiny synthesised store."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from expertfs.store.repack import repack
from expertfs.synth import SynthConfig, synthesize

TEMPLATES = "/root/.cache/expertfs/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates"


def template(name: str) -> str:
    """A real chat template from llama.cpp's source (the test skips without it)."""
    path = os.path.join(TEMPLATES, name)
    if not os.path.exists(path):
        pytest.skip(f"llama.cpp's template {name} is not here")
    with open(path, encoding="utf-8") as f:
        return f.read()


def build_store(d) -> str:
    """A tiny synthesised qwen3moe store under ``d``."""
    g = synthesize(SynthConfig.tiny("qwen3moe"), str(d / "m.gguf"))
    repack(g, str(d / "m.efs"))
    return str(d / "m.efs")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_server(store: str, *extra: str, lifetime: int = 300):
    """``expertfs serve`` on a free loopback port; it is stopped on exit and stops itself
    after ``lifetime`` seconds whatever happens."""
    port = _port()
    cmd = ["timeout", str(lifetime), sys.executable, "-m", "expertfs", "serve", store,
           "--port", str(port), "--ctx", "512", "--device", "cpu", "-t", "1", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise RuntimeError("serve did not come up")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
