"""A wheel ships every package: setup.py discovers them under the three roots."""

from __future__ import annotations

from support import REPO

ROOT = REPO


def test_every_package_is_discovered():
    src = (ROOT / "setup.py").read_text().replace("setup(packages=packages())", "")
    ns: dict = {"__file__": str(ROOT / "setup.py")}
    exec(compile(src, str(ROOT / "setup.py"), "exec"), ns)
    found = set(ns["packages"]())
    for top, name in {"expertfs": "expertfs", "formats": "expertfs.formats",
                      "runtime": "expertfs.runtime"}.items():
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top).parts
            assert ".".join((name, *rel)) in found
    assert {"expertfs", "expertfs.cli", "expertfs.formats", "expertfs.runtime"} <= found
