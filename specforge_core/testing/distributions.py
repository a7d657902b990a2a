"""Fake installed distributions for plugin tests.

:class:`FakeSite` writes real ``*.dist-info`` folders (METADATA, entry_points.txt, RECORD)
and plugin modules into a directory, so :mod:`importlib.metadata` finds them exactly as it
finds pip-installed distributions. Point a :class:`~specforge_core.plugins.PluginManager`
at it with ``site.manager()``, or put ``site.path`` on ``PYTHONPATH`` for a subprocess.
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
from pathlib import Path
from typing import Any, Mapping

from ..plugins import PluginManager


class FakeSite:
    """A directory of fake installed distributions."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.modules: set[str] = set()

    def add(self, name: str, version: str = "0.1.0", *, entry_points: Mapping[str, str] | None = None,
            modules: Mapping[str, str] | None = None, requires: list[str] | None = None) -> Path:
        """Install a distribution ``name`` with ``specforge`` entry points and module sources.

        ``entry_points`` maps entry point names to targets (``"pkg.mod"``); ``modules`` maps
        dotted module names to source text (dedented).
        """
        for module, source in (modules or {}).items():
            parts = module.split(".")
            target = self.path.joinpath(*parts[:-1])
            target.mkdir(parents=True, exist_ok=True)
            for depth in range(1, len(parts)):
                init = self.path.joinpath(*parts[:depth], "__init__.py")
                init.touch(exist_ok=True)
            (target / f"{parts[-1]}.py").write_text(textwrap.dedent(source), encoding="utf-8")
            self.modules.add(module)
            self.modules.add(parts[0])
        dist_dir = self.path / f"{re.sub(r'[-_.]+', '_', name)}-{version}.dist-info"
        dist_dir.mkdir(parents=True, exist_ok=True)
        metadata = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
        metadata += [f"Requires-Dist: {req}" for req in requires or []]
        (dist_dir / "METADATA").write_text("\n".join(metadata) + "\n", encoding="utf-8")
        lines = ["[specforge]"] + [f"{ep} = {target}" for ep, target in (entry_points or {}).items()]
        (dist_dir / "entry_points.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        (dist_dir / "RECORD").write_text("", encoding="utf-8")
        return dist_dir

    def manager(self, environ: Mapping[str, str] | None = None, *, strict: bool | None = None,
                builtins: bool = True) -> PluginManager:
        """A loaded plugin manager that sees only this site's distributions (plus the built-ins)."""
        if str(self.path) not in sys.path:
            sys.path.insert(0, str(self.path))
        return PluginManager(paths=[str(self.path)], environ=dict(environ or {}), strict=strict,
                             builtins=builtins).load()

    def cleanup(self) -> None:
        """Forget the modules this site defined so the next test imports fresh ones."""
        if str(self.path) in sys.path:
            sys.path.remove(str(self.path))
        for name in list(sys.modules):
            if name in self.modules or name.split(".")[0] in self.modules:
                del sys.modules[name]

    def env(self, **extra: Any) -> dict[str, str]:
        """An environment for a subprocess that sees this site first on its path."""
        environ = dict(os.environ)
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.path), environ.get("PYTHONPATH", "")]))
        environ.update({k: str(v) for k, v in extra.items()})
        return environ
