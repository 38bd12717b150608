"""The house rules a machine can check: dependencies point one way, modules stay small, code
comments carry no measured figures, the README stays a newcomer's page."""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator

import pytest

from support import REPO

ROOTS = {"expertfs": "expertfs", "runtime": "expertfs.runtime", "formats": "expertfs.formats"}

#: Every unit of the package and its level: a unit imports only units of a lower level (so
#: there are no upward arrows and no cycles). Data flows formats → store → runtime → CLI;
#: inside the runtime, mechanism below model below engine below decoding and serving.
LEVELS = {
    "expertfs": 0, "expertfs.errors": 0, "expertfs.units": 0,
    "formats": 1,
    "store": 2, "synth": 2,
    "runtime": 3, "runtime.openmp": 3, "runtime.memory": 3, "runtime.sampling": 3,
    "runtime.hostsync": 3,
    "runtime.tokenizer": 3, "runtime.trace": 3, "runtime.policies": 3, "runtime.prefetch": 3,
    "runtime.kernels": 3, "runtime.io": 3, "runtime.heap": 3,
    "runtime.sim": 4, "runtime.experts": 4, "runtime.pool_spin": 4, "runtime.observer": 4,
    "runtime.cache": 5, "runtime.model": 5,
    "runtime.engine": 6,
    "runtime.mtp": 7, "runtime.plan": 7,
    "runtime.generate": 8,
    "runtime.eval": 9, "runtime.server": 9,
    "cli": 10,
    "expertfs.__main__": 11,
}

#: Imports that the levels allow but the design does not: the runtime never depends on the
#: fixture synthesiser (a tool the CLI and the tests use) or on the CLI.
FORBIDDEN = {("runtime", "synth"), ("runtime", "cli")}

#: Longest module, in lines, outside the generated tables and the C++ kernels.
MAX_LINES = 400

#: Measured figures and history have no place in code comments and docstrings: they go stale
#: (bench/README.md holds them, each with its command; history lives in commits).
FIGURE = re.compile(
    r"\d[\d.]* ?(tok/s|GB/s|MB/s|ms/token|ms per token|tokens/s)\b"
    r"|\d[\d.]* ?x (faster|slower)\b|\d[\d.]*x (faster|slower|plain|llama)"
    r"|\b20[2-9][0-9]-[01][0-9]-[0-3][0-9]\b")


def _modules() -> Iterator[tuple[str, str, bool]]:
    for folder, pkg in ROOTS.items():
        for root, dirs, files in os.walk(REPO / folder):
            dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(root, f)
                    rel = os.path.relpath(path, REPO / folder)[:-3].split(os.sep)
                    name = pkg.split(".") + rel
                    is_pkg = name[-1] == "__init__"
                    yield ".".join(name[:-1] if is_pkg else name), path, is_pkg


MODULES = {name: (path, is_pkg) for name, path, is_pkg in _modules()}


def _imports(name: str, path: str, is_pkg: bool) -> Iterator[tuple[str, int]]:
    """Every expertfs module ``name`` imports, lazily or not, with the line."""
    package = name if is_pkg else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("expertfs"):
                continue
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in MODULES]
            for target in subs or [mod]:
                yield target, node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("expertfs"):
                    yield a.name, node.lineno


def _unit(module: str) -> str:
    p = module.split(".")
    if p[:2] == ["expertfs", "runtime"]:
        return "runtime." + p[2] if len(p) > 2 else "runtime"
    if p[:2] == ["expertfs", "formats"]:
        return "formats"
    if len(p) > 1 and p[1] in ("store", "synth", "cli"):
        return p[1]
    return "expertfs." + p[1] if len(p) > 1 else "expertfs"


def test_every_unit_has_a_level():
    missing = sorted({_unit(m) for m in MODULES} - set(LEVELS))
    assert not missing, f"give these a level in LEVELS: {missing}"


def test_dependencies_point_one_way():
    bad = []
    for name, (path, is_pkg) in MODULES.items():
        src = _unit(name)
        for target, line in _imports(name, path, is_pkg):
            while target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            dst = _unit(target)
            if dst != src and (LEVELS[dst] >= LEVELS[src]
                               or (src.split(".")[0], dst) in FORBIDDEN):
                bad.append(f"{os.path.relpath(path, REPO)}:{line}: {src} imports {dst}")
    assert not bad, "upward or sideways imports:\n" + "\n".join(bad)


def test_modules_stay_small():
    long = []
    for path, _ in MODULES.values():
        n = sum(1 for _ in open(path))
        if n > MAX_LINES:
            long.append(f"{os.path.relpath(path, REPO)}: {n} lines")
    assert not long, f"one concept per module, at most {MAX_LINES} lines:\n" + "\n".join(long)


def _comments_and_docstrings(path: str) -> Iterator[tuple[int, str]]:
    src = open(path).read()
    for i, line in enumerate(src.splitlines(), 1):
        if "#" in line:
            yield i, line[line.index("#"):]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body:
                yield node.body[0].lineno, doc


def test_no_measured_figures_in_code_comments():
    hits = []
    for path, _ in MODULES.values():
        for line, text in _comments_and_docstrings(path):
            m = FIGURE.search(text)
            if m:
                hits.append(f"{os.path.relpath(path, REPO)}:{line}: {m.group(0)!r}")
    assert not hits, "figures belong in bench/README.md with their command:\n" + "\n".join(hits)


@pytest.mark.parametrize("page,limit", [("README.md", 120)])
def test_readme_is_a_newcomers_page(page, limit):
    lines = (REPO / page).read_text().splitlines()
    assert len(lines) <= limit, f"{page}: {len(lines)} lines; figures go to bench/README.md"
    head = "\n".join(lines[:12])
    assert "make demo" in head and "make test" in head
