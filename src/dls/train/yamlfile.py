"""YAML text and files to plain Python data, safely: the trainer's config files and ``--override`` values.

PyYAML's ``SafeLoader`` (no objects are built from tags), with YAML 1.2 floats (``1e-3`` is a number, not a
string), merge keys that cannot multiply, and a bound on the data once aliases are expanded, so that a hostile
file (an alias bomb, a recursive alias, deep nesting, a huge or binary file) is a :class:`ConfigError` naming the
file instead of exhausting memory or recursion.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from dls.train.errors import ConfigError

__all__ = ["MAX_CONFIG_BYTES", "MAX_CONFIG_NODES", "check_size", "load_yaml", "parse_yaml_value", "read_yaml_file"]

# A config is small: the expanded YAML (aliases counted each time they are used) is bounded, so an alias bomb
# ("billion laughs") is rejected at once instead of filling the memory.
MAX_CONFIG_NODES = 100_000
MAX_CONFIG_BYTES = 1 << 20


class _Loader(yaml.SafeLoader):
    """PyYAML's SafeLoader, but ``1e-3`` and ``1e5`` are floats (YAML 1.2) rather than strings (YAML 1.1), and
    merge keys do not multiply: ``<<: [*a, *a]`` would otherwise repeat ``a``'s pairs, doubling them per level."""

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        super().flatten_mapping(node)
        # The same scalar key twice: one pair, at the first one's place, with the last one's value (as a dict
        # built from all the pairs would have).
        last: dict[Any, int] = {}
        for i, (key, _) in enumerate(node.value):
            last[(key.tag, key.value) if isinstance(key, yaml.ScalarNode) else id(key)] = i
        if len(last) < len(node.value):
            first: dict[Any, int] = {}
            for i, (key, _) in enumerate(node.value):
                first.setdefault((key.tag, key.value) if isinstance(key, yaml.ScalarNode) else id(key), i)
            node.value = [(node.value[i][0], node.value[last[k]][1]) for k, i in sorted(first.items(), key=_second)]


def _second(item: tuple[Any, int]) -> int:
    return item[1]


_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _first in list(_Loader.yaml_implicit_resolvers):
    _Loader.yaml_implicit_resolvers[_first] = [
        (tag, regexp) for tag, regexp in _Loader.yaml_implicit_resolvers[_first] if tag != "tag:yaml.org,2002:float"
    ]
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


def load_yaml(text: str, source: str = "<string>") -> Any:
    """Parse YAML text (floats like ``1e-3`` included). A syntax error, nesting too deep, a recursive alias or
    more than :data:`MAX_CONFIG_NODES` values once aliases are expanded is a :class:`ConfigError`."""
    try:
        data = yaml.load(text, Loader=_Loader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError([f"not valid YAML: {exc}"], source) from None
    except RecursionError:
        raise ConfigError(["not a config: the YAML is nested too deeply"], source) from None
    check_size(data, source)
    return data


def check_size(data: Any, source: str | None = None) -> None:
    """Raise :class:`ConfigError` if ``data`` (parsed YAML, or a checkpoint's config) has more than
    :data:`MAX_CONFIG_NODES` values when shared parts (YAML aliases) are counted at each use, or contains itself.
    Takes time in the number of distinct containers, not in the expanded size."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(value: Any) -> int:
        if not isinstance(value, (dict, list, tuple)):
            return 1
        key = id(value)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise ConfigError(
                ["a value contains itself (a recursive YAML alias); a config cannot be recursive"], source
            )
        active.add(key)
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        total = 1
        for item in items:
            total += size(item)
            if total > MAX_CONFIG_NODES:
                break
        active.discard(key)
        sizes[key] = total
        return total

    try:
        total = size(data)
    except RecursionError:
        raise ConfigError(["not a config: it is nested too deeply"], source) from None
    if total > MAX_CONFIG_NODES:
        raise ConfigError(
            [
                f"the config expands to more than {MAX_CONFIG_NODES:,} values once its YAML aliases (*name) are "
                "expanded (an alias bomb?); a training config is far smaller"
            ],
            source,
        )


def parse_yaml_value(text: str) -> Any:
    """An override value: a YAML scalar or flow collection (``dynamic``, ``1e-3``, ``null``, ``[0.9, 0.99]``)."""
    if text.strip() == "":
        return ""
    return load_yaml(text, "<override>")


def read_yaml_file(path: str | Path) -> Any:
    """The YAML file ``path`` as plain data (``None`` for an empty file). Raises :class:`ConfigError` naming the file
    when it cannot be read, is larger than 1 MiB, is not UTF-8 or not YAML."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError([f"cannot read config file: {exc.strerror or exc}"], str(p)) from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            [f"larger than {MAX_CONFIG_BYTES >> 20} MiB: not a YAML config (a checkpoint? see --resume)"], str(p)
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); save the config as UTF-8"], str(p)
        ) from None
    return load_yaml(text, str(p))
