"""Loading a config: the YAML file read safely (a regular file of at most 1 MiB of UTF-8, YAML 1.2 floats, aliases
expanded into independent copies within a budget, a key given twice noted), then the command line's overrides
applied at the paths as written (torchtitan's ``ConfigManager``: loading and overrides, no judgement: that is
``dls.train.config.validation``'s)."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from dls.train.errors import ConfigError

MAX_CONFIG_NODES = 100_000
MAX_CONFIG_BYTES = 1 << 20


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats (``1e-3`` is a number). A key given twice in one mapping: a section (a mapping
    value) is refused; any other value is taken from the last, as Model Zoo's loader (PyYAML's) does, and each such
    key is listed in ``repeated`` as ``(key, first line, last line)``."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.repeated: list[tuple[str, int, int]] = []

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        """Merged keys (``<<: [*a, *b]``) count once, the last value wins."""
        seen: dict[Any, tuple[int, yaml.Node]] = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                line = key.start_mark.line + 1
                if key.value in seen:
                    first, before = seen[key.value]
                    if isinstance(value, yaml.MappingNode) or isinstance(before, yaml.MappingNode):
                        raise ConfigError([f"section {key.value!r} is given twice: lines {first} and {line}"])
                    self.repeated.append((key.value, first, line))
                seen[key.value] = (line, value)
        super().flatten_mapping(node)  # the merged keys first: without de-duplication they can multiply
        index = {
            (k.tag, k.value) if isinstance(k, yaml.ScalarNode) else id(k): i for i, (k, _) in enumerate(node.value)
        }
        node.value = [node.value[i] for i in sorted(index.values())]


_FLOAT = r"^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+|\.[0-9_]+"
_FLOAT += r"(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
_Loader.yaml_implicit_resolvers = {
    k: [(t, r) for t, r in v if t != "tag:yaml.org,2002:float"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(_FLOAT), list("-+0123456789."))


class _TooMany(ValueError):
    pass


def _unshare(data: Any, budget: list[int]) -> Any:
    """``data`` with every alias expanded into a copy; at most :data:`MAX_CONFIG_NODES` values in all."""
    budget[0] -= 1
    if budget[0] < 0:
        raise _TooMany(f"more than {MAX_CONFIG_NODES:,} values once its YAML aliases are expanded (an alias bomb?)")
    if isinstance(data, dict):
        return {_unshare(k, budget): _unshare(v, budget) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_unshare(v, budget) for v in data]
    return data


def _where(exc: yaml.YAMLError, text: str) -> str:
    """Where in ``text`` PyYAML failed, as ``line:column`` (1-based), and what it found there."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None)
    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML does not allow: a position in the text
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)  # PyYAML gives its code
        return f"{line}:{column}: character U+{code:04X} ({chr(code)!r}) is not allowed in YAML"
    if mark is None or problem is None:
        return f"1:1: {str(exc).splitlines()[0]}"
    return f"{mark.line + 1}:{mark.column + 1}: {problem}"


def load_yaml(text: str, source: str = "<string>", notes: list[str] | None = None) -> Any:
    """Parse YAML text into plain data, aliases expanded into copies. Raises :class:`ConfigError`; a syntax error is
    one line, ``source:line:column: what``. A key repeated with a value that is not a section takes the last value,
    as Model Zoo's loader does: each is added to ``notes``."""
    loader = None
    try:
        loader = _Loader(text)  # its reader already refuses characters YAML does not allow (a NUL byte)
        data = _unshare(loader.get_single_data(), [MAX_CONFIG_NODES])
    except ConfigError as exc:
        raise ConfigError(exc.errors, source) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"{source}:{_where(exc, text)} (not valid YAML)"]) from None
    except RecursionError:
        raise ConfigError(["not a config: nested too deeply, or an alias contains itself"], source) from None
    except _TooMany as exc:
        raise ConfigError([f"the config expands to {exc}"], source) from None
    except ValueError as exc:  # a value PyYAML's constructors refuse: a 5,000-digit integer, a date 2001-13-45
        reason = str(exc).split(";")[0]  # Python's advice after ";" (sys.set_int_max_str_digits) is not the user's
        raise ConfigError([f"a value YAML cannot read: {reason} (not valid YAML)"], source) from None
    finally:
        if loader is not None:
            loader.dispose()
    said = [f"{source}: {key!r} is given twice (lines {a} and {b}); the value of line {b} is used, as Model Zoo's "
            "YAML loader does" for key, a, b in loader.repeated]  # fmt: skip
    if notes is not None:
        notes.extend(said)
    return data


def read_config(path: str | Path, overrides: Sequence[str] = (), notes: list[str] | None = None) -> dict[str, Any]:
    """The YAML file ``path`` (a regular file of at most 1 MiB of UTF-8) as a dict, ``overrides`` applied; what the
    run should say about the file (a repeated key) is added to ``notes``."""
    if not str(path):
        raise ConfigError(["the config path is empty (''): give a YAML file, e.g. one `dls init` copies"])
    try:  # opened non-blocking: a FIFO without a writer must not block
        with open(path, "rb", opener=lambda name, flags: os.open(name, flags | os.O_NONBLOCK)) as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ConfigError(["not a regular file: a config is read from a plain file"], str(path))
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError([f"cannot read config file: {exc.strerror or exc}"], str(path)) from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(["larger than 1 MiB: not a YAML config (a checkpoint? see --resume)"], str(path))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        why = f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); save the config as UTF-8"
        raise ConfigError([why], str(path)) from None
    raw = load_yaml(text, str(path), notes)
    return apply_overrides({} if raw is None else raw, overrides, source=str(path), notes=notes)


def _shown(text: str, most: int = 120) -> str:
    """``text`` quoted, cut to ``most`` characters (an override echoed back in an error)."""
    return repr(text) if len(text) <= most else f"{text[:most]!r}... ({len(text):,} characters)"


def apply_overrides(
    raw: Any, overrides: Sequence[str], source: str | None = None, notes: list[str] | None = None
) -> dict[str, Any]:
    """A copy of ``raw`` with each ``"a.b.c=value"`` set at the path as written (values are YAML, read as a file
    is: a key given twice in a value is added to ``notes``)."""
    if not isinstance(raw, Mapping):
        raise ConfigError([f"the top level must be a mapping of sections; got {raw!r}"], source)
    try:
        result: dict[str, Any] = _unshare(dict(raw), [MAX_CONFIG_NODES])
    except (ValueError, RecursionError):
        raise ConfigError(["the config is too large or contains itself"], source) from None
    errors = []
    for item in overrides:
        path, sep, text = item.partition("=")
        keys = path.strip().split(".")
        if not sep or len(keys) < 2 or not all(keys):
            errors.append(f"override {_shown(item)} must look like section.key=value, e.g. runconfig.max_steps=20")
            continue
        try:
            said: list[str] = []
            value = load_yaml(text, "value", said) if text.strip() else ""
        except ConfigError as exc:
            errors.append(f"override {_shown(item)}: {exc.errors[0]}")
            continue
        if notes is not None:
            notes.extend(f"override {_shown(item)}: {note.removeprefix('value: ')}" for note in said)
        node = result
        for i, k in enumerate(keys[:-1]):
            if node.get(k) is None:
                node[k] = {}
            node = node[k]
            if not isinstance(node, dict):
                errors.append(f"override {_shown(item)}: {'.'.join(keys[: i + 1])} is not a section/mapping")
                break
        else:
            node[keys[-1]] = value
    if errors:
        raise ConfigError(errors, source)
    return result


def default_model_dir(raw: Mapping[str, Any], directory: str) -> dict[str, Any]:
    """``raw`` with ``directory`` as its model_dir where its layout keeps it (``runconfig.model_dir``; the current
    layout's ``trainer.init.model_dir``) when it names none: ``--resume DIR`` continues in DIR unless the config (or
    an override) names another model_dir."""
    out = dict(raw)
    trainer = out.get("trainer")
    if isinstance(trainer, Mapping):  # the current layout
        init: Mapping[str, Any] = trainer["init"] if isinstance(trainer.get("init"), Mapping) else {}
        if "model_dir" not in init:
            out["trainer"] = {**trainer, "init": {**init, "model_dir": directory}}
        return out
    section = out.get("runconfig")
    if not (isinstance(section, Mapping) and "model_dir" in section):
        out["runconfig"] = {**(section if isinstance(section, Mapping) else {}), "model_dir": directory}
    return out
