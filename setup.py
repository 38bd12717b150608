"""Package discovery for the one import root: ``formats/`` and ``runtime/`` install as
``expertfs.formats`` and ``expertfs.runtime`` (``package-dir`` in pyproject.toml). Every folder
with an ``__init__.py`` under the three roots is a package, so none can be left out of a wheel.
"""

import os

from setuptools import setup

ROOTS = {"expertfs": "expertfs", "formats": "expertfs.formats", "runtime": "expertfs.runtime"}


def packages() -> list[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    out = []
    for folder, name in ROOTS.items():
        for root, dirs, files in os.walk(os.path.join(here, folder)):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
            if "__init__.py" in files:
                rel = os.path.relpath(root, os.path.join(here, folder))
                out.append(name if rel == "." else name + "." + rel.replace(os.sep, "."))
    return sorted(out)


setup(packages=packages())
