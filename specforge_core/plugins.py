"""The plugin manager: finds plugins through entry points and collects their specs.

Rules (see docs/writing-plugins.md):

* one entry-point group, ``specforge``; each entry point names a module (or object) of
  ``@hookimpl`` functions;
* a plugin that fails to import or validate is skipped with one warning line and listed
  as ``failed``; ``SPECFORGE_STRICT_PLUGINS=1`` re-raises instead;
* ``SPECFORGE_DISABLE_PLUGINS=a,b`` skips plugins (listed as ``disabled``, never imported);
  ``SPECFORGE_ALLOW_PLUGINS=a,b`` loads only those (plus nothing else, built-ins included
  unless named); names match the entry point name or the distribution name;
* two providers of one component name, or of one entry point name, are an error naming
  both distributions and versions;
* loading happens once per process (:func:`get_plugin_manager`).
"""

from __future__ import annotations

import difflib
import importlib.metadata as md
import logging
import os
import re
from typing import Any, Iterable, Mapping

import attrs
import pluggy

from . import __version__, hookspecs
from .errors import PluginConflictError, PluginError, UnknownComponentError
from .specs import FIRST_PARTY, SPEC_KINDS, ComponentSpec, Provenance

log = logging.getLogger("specforge.plugins")

GROUP = "specforge"
BUILTIN = "builtin"
CORE_DISTRIBUTION = "specforge-core"

STRICT_ENV = "SPECFORGE_STRICT_PLUGINS"
DISABLE_ENV = "SPECFORGE_DISABLE_PLUGINS"
ALLOW_ENV = "SPECFORGE_ALLOW_PLUGINS"

_HOOK_NAMES = {name for name in dir(hookspecs) if name.startswith("specforge_")}
_COLLECTION_HOOKS = {hook: kind for kind, (_cls, hook) in SPEC_KINDS.items()}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _env_list(environ: Mapping[str, str], key: str) -> set[str] | None:
    raw = environ.get(key)
    if raw is None or not raw.strip():
        return None
    return {_normalize(part.strip()) for part in raw.split(",") if part.strip()}


@attrs.define
class PluginRecord:
    """One plugin as ``specforge plugins`` lists it."""

    name: str
    distribution: str
    version: str
    entry_point: str
    status: str = "active"  # active | failed | disabled
    error: str | None = None
    provides: dict[str, list[str]] = attrs.field(factory=lambda: {kind: [] for kind in SPEC_KINDS})
    module: Any = attrs.field(default=None, repr=False)

    def provenance(self) -> Provenance:
        return Provenance(self.name, self.distribution, self.version, self.entry_point)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "entry_point": self.entry_point,
            "status": self.status,
            "error": self.error,
            "provides": {kind: sorted(names) for kind, names in self.provides.items()},
        }


class PluginManager:
    """Loads plugins and answers "which spec is called NAME?".

    ``paths`` restricts the distribution search (default: ``sys.path``); ``environ``
    defaults to ``os.environ``. Construct one per test; the CLI uses the process-wide
    instance from :func:`get_plugin_manager`.
    """

    def __init__(self, *, paths: Iterable[str] | None = None, environ: Mapping[str, str] | None = None,
                 strict: bool | None = None, builtins: bool = True) -> None:
        environ = os.environ if environ is None else environ
        self._paths = list(paths) if paths is not None else None
        self.strict = strict if strict is not None else environ.get(STRICT_ENV, "") not in ("", "0", "false")
        self._deny = _env_list(environ, DISABLE_ENV) or set()
        self._allow = _env_list(environ, ALLOW_ENV)
        self._builtins = builtins
        self.pm = pluggy.PluginManager(GROUP)
        self.pm.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}
        self._specs: dict[str, dict[str, ComponentSpec]] = {kind: {} for kind in SPEC_KINDS}
        self._conflicts: dict[str, dict[str, list[ComponentSpec]]] = {kind: {} for kind in SPEC_KINDS}
        self._loaded = False

    # ----------------------------------------------------------------- loading
    @property
    def hook(self) -> Any:
        return self.pm.hook

    def load(self) -> PluginManager:
        """Find, import, register and collect every plugin. Calling it again does nothing."""
        if self._loaded:
            return self
        self._loaded = True
        if self._builtins:
            self._load_one(BUILTIN, CORE_DISTRIBUTION, __version__,
                           f"{BUILTIN} = specforge_core.builtin", lambda: _import("specforge_core.builtin"))
        seen_dists: set[str] = set()
        for dist in md.distributions(**({"path": self._paths} if self._paths is not None else {})):
            dist_name = dist.metadata["Name"] or "unknown"
            if _normalize(dist_name) in seen_dists:
                continue  # the same distribution found twice on the path: first one wins
            seen_dists.add(_normalize(dist_name))
            for ep in dist.entry_points:
                if ep.group != GROUP:
                    continue
                self._load_one(ep.name, dist_name, dist.version or "0", f"{ep.name} = {ep.value}", ep.load)
        for record in self.records.values():
            if record.status == "active":
                self._collect(record)
        return self

    def _is_enabled(self, name: str, dist: str) -> bool:
        keys = {_normalize(name), _normalize(dist)}
        if keys & self._deny:
            return False
        return self._allow is None or bool(keys & self._allow)

    def _fail(self, record: PluginRecord, message: str, exc: BaseException | None = None) -> None:
        record.status = "failed"
        record.error = message
        record.provides = {kind: [] for kind in SPEC_KINDS}
        if record.module is not None:
            try:
                self.pm.unregister(name=record.name)
            except ValueError:
                pass
            record.module = None
        if self.strict:
            if isinstance(exc, PluginError) or exc is None:
                raise PluginError(f"plugin '{record.name}' ({record.distribution} {record.version}): {message}") from exc
            raise exc
        log.warning("specforge: skipping plugin '%s' (%s %s): %s", record.name, record.distribution,
                    record.version, message)

    def _load_one(self, name: str, dist: str, version: str, entry_point: str, loader: Any) -> None:
        record = PluginRecord(name=name, distribution=dist, version=version, entry_point=entry_point)
        previous = self.records.get(name)
        if previous is not None:
            message = (f"entry point name '{name}' is claimed by both {previous.distribution} {previous.version} "
                       f"and {dist} {version}; uninstall one of them")
            key = f"{name}@{_normalize(dist)}"
            self.records[key] = record
            record.status = "failed"
            record.error = message
            if self.strict:
                raise PluginConflictError(message)
            log.warning("specforge: skipping plugin '%s' (%s %s): %s", name, dist, version, message)
            return
        self.records[name] = record
        if not self._is_enabled(name, dist):
            record.status = "disabled"
            return
        try:
            module = loader()
        except Exception as exc:  # noqa: BLE001 - any import error disables just this plugin
            where = ""
            if isinstance(exc, ModuleNotFoundError):  # the entry point's own module, or something it imports?
                module_name = entry_point.partition(" = ")[2].partition(":")[0].strip()
                where = (f" (the entry point '{entry_point}' names a module that is not installed)"
                         if exc.name == module_name else
                         f" (a module that {module_name!r} imports; is a dependency missing or misspelled?)")
            self._fail(record, f"import failed: {type(exc).__name__}: {exc}{where}", exc)
            return
        record.module = module
        unknown = [attr for attr in dir(module) if attr.startswith("specforge_") and attr not in _HOOK_NAMES
                   and callable(getattr(module, attr))]
        if unknown:
            hints = []
            for attr in unknown:
                close = difflib.get_close_matches(attr, sorted(_HOOK_NAMES), n=1)
                hints.append(f"'{attr}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
            record.module = None
            self._fail(record, f"implements unknown hook {', '.join(hints)}")
            return
        unmarked = [attr for attr in dir(module) if attr in _HOOK_NAMES and callable(getattr(module, attr))
                    and not hasattr(getattr(module, attr), "specforge_impl")]
        if unmarked:
            record.module = None
            self._fail(record, f"defines {', '.join(repr(attr) for attr in unmarked)} without @hookimpl (from "
                               "specforge_core import hookimpl), so specforge would never call "
                               f"{'it' if len(unmarked) == 1 else 'them'}")
            return
        try:
            self.pm.register(module, name=name)
            self.pm.check_pending()
        except Exception as exc:  # noqa: BLE001 - pluggy validation errors
            self._fail(record, f"invalid hook implementation: {self._one_line(exc)}", exc)

    def _one_line(self, exc: BaseException) -> str:
        """pluggy's validation message on one line, with the arguments the hook passes."""
        message = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        hook = re.search(r"for hook '(\w+)'", message)
        caller = getattr(self.pm.hook, hook.group(1), None) if hook else None
        if caller is not None and caller.spec is not None:
            message += (f"; {hook.group(1)} passes ({', '.join(caller.spec.argnames)}), and an implementation takes "
                        "any of those by name")
        return message

    def _collect(self, record: PluginRecord) -> None:
        collected: list[ComponentSpec] = []
        for hook_name, kind in _COLLECTION_HOOKS.items():
            spec_cls = SPEC_KINDS[kind][0]
            caller = getattr(self.pm.hook, hook_name)
            for impl in caller.get_hookimpls():
                if impl.plugin_name != record.name:
                    continue
                try:
                    result = impl.function()
                    items = list(result or [])
                except Exception as exc:  # noqa: BLE001
                    self._fail(record, f"{hook_name}() raised {type(exc).__name__}: {exc}", exc)
                    return
                for item in items:
                    if not isinstance(item, spec_cls):
                        self._fail(record, f"{hook_name}() returned {type(item).__name__}; expected {spec_cls.__name__}")
                        return
                    if not (isinstance(item.options, type) and attrs.has(item.options)):
                        options = getattr(item.options, "__name__", repr(item.options))
                        self._fail(record, f"{hook_name}() returned {kind} '{item.name}' whose options class "
                                           f"{options} is not an attrs class: decorate it with @attrs.frozen and "
                                           "declare its fields with specforge_core.options.option")
                        return
                    collected.append(attrs.evolve(item, provenance=record.provenance()))
        for spec in collected:
            registry = self._specs[spec.kind]
            existing = registry.get(spec.name)
            if existing is not None:
                self._conflicts[spec.kind].setdefault(spec.name, [existing]).append(spec)
                log.warning("specforge: %s", self._conflict_message(spec.kind, spec.name))
            else:
                registry[spec.name] = spec
            record.provides[spec.kind].append(spec.name)

    # ----------------------------------------------------------------- queries
    def _conflict_message(self, kind: str, name: str) -> str:
        providers = " and ".join(
            f"{s.provenance.distribution} {s.provenance.version} (plugin '{s.provenance.plugin}')"
            for s in self._conflicts[kind][name] if s.provenance
        )
        return f"{kind} '{name}' is provided by both {providers}; uninstall or disable one of them"

    def conflicts(self) -> list[str]:
        self.load()
        return [self._conflict_message(kind, name) for kind in SPEC_KINDS for name in self._conflicts[kind]]

    def specs(self, kind: str) -> dict[str, ComponentSpec]:
        """All specs of one kind, by name. Raises if two plugins claim one name."""
        self.load()
        if kind not in SPEC_KINDS:
            raise UnknownComponentError(f"unknown component kind {kind!r}; kinds: {', '.join(SPEC_KINDS)}")
        if self._conflicts[kind]:
            name = sorted(self._conflicts[kind])[0]
            raise PluginConflictError(self._conflict_message(kind, name))
        return dict(self._specs[kind])

    def get(self, kind: str, name: str) -> Any:
        """The spec called ``name``, or an error that lists the choices and how to get ``name``."""
        self.load()
        if kind not in SPEC_KINDS:
            raise UnknownComponentError(f"unknown component kind {kind!r}; kinds: {', '.join(SPEC_KINDS)}")
        if name in self._conflicts[kind]:  # only a clash over this very name stops it: others do not concern it
            raise PluginConflictError(self._conflict_message(kind, name))
        specs = {other: spec for other, spec in self._specs[kind].items() if other not in self._conflicts[kind]}
        if name in specs:
            return specs[name]
        raise UnknownComponentError(self._unknown_message(kind, name, specs))

    def _unknown_message(self, kind: str, name: str, specs: Mapping[str, ComponentSpec]) -> str:
        label = kind.replace("_", " ")
        lines = [f"unknown {label} '{name}'. Available: {', '.join(sorted(specs)) or '(none)'}."]
        close = difflib.get_close_matches(name, sorted(specs), n=1)
        if close:
            lines.append(f"Did you mean '{close[0]}'?")
        dist = FIRST_PARTY.get((kind, name))
        wanted = {_normalize(name), _normalize(f"specforge-plugin-{name}")} | ({_normalize(dist)} if dist else set())
        for record in self.records.values():
            if {_normalize(record.name), _normalize(record.distribution)} & wanted:
                if record.status == "failed":
                    lines.append(f"The plugin '{record.name}' ({record.distribution} {record.version}) "
                                 f"failed to load: {record.error}")
                    break
                if record.status == "disabled":
                    lines.append(f"The plugin '{record.name}' ({record.distribution} {record.version}) is disabled "
                                 f"by {DISABLE_ENV} / {ALLOW_ENV}.")
                    break
        else:
            if dist:
                lines.append(f"It is provided by {dist}: pip install {dist}")
            failed = [record for record in self.records.values() if record.status == "failed"]
            if failed:  # one of them may be what provides it
                lines.append("Plugins that failed to load: " + "; ".join(
                    f"'{record.name}' ({record.distribution} {record.version}): {record.error}" for record in failed)
                    + " (`specforge plugins` lists them).")
        return " ".join(lines)

    def plugin_list(self) -> list[dict[str, Any]]:
        self.load()
        return [record.to_dict() for record in self.records.values()]

    def plugin_set(self) -> list[tuple[str, str, str, str]]:
        """(name, distribution, version, status) of every plugin; equal on every rank of a run."""
        self.load()
        return sorted((r.name, r.distribution, r.version, r.status) for r in self.records.values())


def _import(module: str) -> Any:
    import importlib

    return importlib.import_module(module)


_PROCESS_MANAGER: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, loaded on first use and never reloaded."""
    global _PROCESS_MANAGER
    if _PROCESS_MANAGER is None:
        _PROCESS_MANAGER = PluginManager().load()
    return _PROCESS_MANAGER


def set_plugin_manager(manager: PluginManager | None) -> PluginManager | None:
    """Swap the process-wide manager (tests); returns the previous one."""
    global _PROCESS_MANAGER
    previous, _PROCESS_MANAGER = _PROCESS_MANAGER, manager
    return previous
