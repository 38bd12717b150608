"""Every package directory is listed in pyproject, so a wheel ships all of it."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).parent.parent
MAP = {"expertfs": "expertfs", "formats": "expertfs.formats", "runtime": "expertfs.runtime"}


def test_every_package_is_listed():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(conf["tool"]["setuptools"]["packages"])
    found = set()
    for top, name in MAP.items():
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top).parts
            found.add(".".join((name, *rel)))
    assert found - listed == set(), f"add to pyproject packages: {sorted(found - listed)}"
