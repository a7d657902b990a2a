"""Options classes: attrs classes whose fields carry a default and a doc string.

A plugin declares its options like this::

    @attrs.frozen
    class MyOptions:
        ttt_length: int = option(7, "Test-time-training unroll steps.", check=positive)

and the core validates them from YAML and from ``--set section.key=value`` with errors
that name the key and the accepted form.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any, Callable, Mapping

import attrs
import yaml

from .errors import OptionError

_SCIENTIFIC = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


def option(default: Any = attrs.NOTHING, doc: str = "", *, check: Callable[[Any], str | None] | None = None,
           choices: tuple[Any, ...] | None = None, factory: Callable[[], Any] | None = None) -> Any:
    """An options field with documentation.

    ``check(value)`` returns an error text (e.g. ``"must be > 0"``) or ``None``;
    ``choices`` restricts the value to a fixed set.
    """
    metadata = {"doc": doc, "check": check, "choices": choices}
    if factory is not None:
        return attrs.field(factory=factory, metadata=metadata)
    return attrs.field(default=default, metadata=metadata)


def positive(value: Any) -> str | None:
    return None if value is None or value > 0 else "must be > 0"


def non_negative(value: Any) -> str | None:
    return None if value is None or value >= 0 else "must be >= 0"


def fraction(value: Any) -> str | None:
    return None if value is None or 0.0 <= value <= 1.0 else "must be between 0 and 1"


@attrs.frozen
class NoOptions:
    """A component without options."""


def _type_label(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_label(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        inner = _type_label(args[0]) if args else "value"
        return f"list of {inner} (e.g. [1, 2])"
    if origin is dict:
        return "mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """Convert ``value`` to the annotated type, or raise ``OptionError`` naming ``key``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except OptionError as exc:
                errors.append(str(exc))
        raise OptionError(f"option '{key}': expected {_type_label(tp)}, got {value!r}")
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise OptionError(f"option '{key}': expected {_type_label(tp)}, got {value!r}")
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        items = [_coerce(args[0], v, key) if args else v for v in value]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise OptionError(f"option '{key}': expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0", "on", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise OptionError(f"option '{key}': expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str, float)):
            raise OptionError(f"option '{key}': expected an integer, got {value!r}")
        try:
            number = float(value) if isinstance(value, str) else value
        except ValueError:
            raise OptionError(f"option '{key}': expected an integer, got {value!r}") from None
        if number != int(number):
            raise OptionError(f"option '{key}': expected an integer, got {value!r}")
        return int(number)
    if tp is float:
        if isinstance(value, bool):
            raise OptionError(f"option '{key}': expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise OptionError(f"option '{key}': expected a number (e.g. 1e-4), got {value!r}") from None
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise OptionError(f"option '{key}': expected a string, got {value!r}")
    return value


def option_fields(cls: type) -> tuple[attrs.Attribute, ...]:
    return attrs.fields(attrs.resolve_types(cls))


def build_options(cls: type, values: Mapping[str, Any] | None, *, section: str, owner: str | None = None) -> Any:
    """Instantiate options class ``cls`` from a mapping, validating every key and value.

    ``owner`` names the component the options belong to (``strategy 'x' (dist 1.0)``) in the
    message about a required option left unset.
    """
    values = dict(values or {})
    fields = {f.name: f for f in option_fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        accepted = ", ".join(sorted(fields)) or "(none)"
        raise OptionError(
            f"unknown option '{section}.{unknown[0]}'; {section} accepts: {accepted}"
        )
    required = [name for name, field in fields.items() if field.default is attrs.NOTHING and name not in values]
    if required:
        key = f"{section}.{required[0]}"
        doc = fields[required[0]].metadata.get("doc")
        raise OptionError(f"{owner or section} needs option '{key}'{f' ({doc})' if doc else ''}, which has no "
                          f"default: set it with --set {key}=VALUE or in the config file's {section} section")
    kwargs = {}
    for name, value in values.items():
        field = fields[name]
        key = f"{section}.{name}"
        coerced = _coerce(field.type, value, key)
        choices = field.metadata.get("choices")
        if choices is not None and coerced not in choices:
            raise OptionError(f"option '{key}': expected one of {', '.join(map(str, choices))}; got {value!r}")
        kwargs[name] = coerced
    try:
        instance = cls(**kwargs)
    except TypeError as exc:
        raise OptionError(f"{section}: {exc}") from None
    for field in fields.values():
        check = field.metadata.get("check")
        if check is not None:
            problem = check(getattr(instance, field.name))
            if problem:
                raise OptionError(f"option '{section}.{field.name}' {problem}; got {getattr(instance, field.name)!r}")
    return instance


def compilable(value: bool) -> str | None:
    """``check`` of a plugin's ``compile`` option: why ``torch.compile`` cannot run here, or None.

    On CPU, torch.compile's inductor backend builds C++ kernels at the first step; without a C++
    compiler it would fail there, after the target is loaded and the data read. Imports torch only
    when the option is true.
    """
    if not value:
        return None
    import torch

    if torch.cuda.is_available():
        return None
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as exc:  # noqa: BLE001 - whatever the probe raises, there is no compiler to use
        return (f"needs a C++ compiler on CPU (torch.compile builds C++ kernels there) and none was found "
                f"({type(exc).__name__}): install g++ (or point CXX at one) or set it to false")
    return None


def parse_set_value(text: str) -> Any:
    """Parse the value half of ``--set key=value`` with YAML scalars (``1e-4``, ``[1, 2]``, ``true``)."""
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text
    # YAML 1.1 reads "3e-4" as a string; people mean the number.
    if isinstance(value, str) and _SCIENTIFIC.match(value):
        return float(value)
    return value


def describe_options(cls: type) -> list[dict[str, Any]]:
    """Rows of ``name, type, default, doc`` for help output and docs."""
    rows = []
    for field in option_fields(cls):
        if field.default is attrs.NOTHING:
            default: Any = "(required)"
        elif isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
            default = field.default.factory()
        else:
            default = field.default
        rows.append({"name": field.name, "type": _type_label(field.type), "default": default,
                     "doc": field.metadata.get("doc", "")})
    return rows


def options_to_dict(options: Any) -> dict[str, Any]:
    return attrs.asdict(options, recurse=True, value_serializer=lambda _i, _f, v: list(v) if isinstance(v, tuple) else v)
