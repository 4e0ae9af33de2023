"""The reference tables the documentation renders (docs/reference/trainer.md, through docs/hooks/generated.py): every
config key the trainer reads, generated from the schema itself (``dls.train.config.schema``'s sections and their
pydantic fields, ``dls.train.config.layouts``' tables, ``dls.train.config.zoo_keys``' key models), so that a key
added there appears here with its type, default, allowed values and help. Each command's ``--help`` as Markdown is
``dls.train.cli.commands_markdown``.

Where a key lives in the current Model Zoo layout is found by running the config reader's own tables on probe
values, not by a list kept here."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel

from dls.train.config import layouts, schema, validation, zoo_keys

# Values offered to a layout table's reader functions (whose argument shapes differ): each is tried in turn.
_PROBES: tuple[Callable[[list[str]], Any], ...] = (
    lambda keys: dict.fromkeys(keys, 0),
    lambda keys: {"Adam": dict.fromkeys(keys, 0)},
    lambda keys: [{"LinearLR": {"initial_learning_rate": 0, "end_learning_rate": 0, "total_iters": 1}}],
    lambda keys: [{"LoadCheckpointStates": {"load_checkpoint_states": "all"}}],
    lambda keys: {"backend_type": "CPU"},
    lambda keys: "CPU",
)


class _Recorder(layouts.Reader):
    """The config reader, recording where each key of dls's sections was written (``(section, key) -> paths``)."""

    def __init__(self) -> None:
        super().__init__(zoo_model=False)
        self.paths: dict[tuple[str, str], list[str]] = {}

    def put(self, section: str, key: str, value: Any, path: str) -> None:
        self.paths.setdefault((section, key), []).append(path)


def _every_key() -> list[str]:
    keys = {k for cls in schema.SECTION_CLASSES.values() for k in cls.model_fields}
    keys |= set(layouts.OPTIMIZER_ARGS)
    return sorted(keys)


def current_layout_paths() -> dict[tuple[str, str], list[str]]:
    """Each key of dls's sections -> where the current Model Zoo layout (``trainer: {init, fit}``) writes it."""
    found: dict[tuple[str, str], list[str]] = {}

    def add(paths: Mapping[tuple[str, str], list[str]]) -> None:
        for target, written in paths.items():
            for path in written:
                if path not in found.setdefault(target, []):
                    found[target].append(path)

    def visit(table: Mapping[str, Any], prefix: str) -> None:
        for key, to in table.items():
            path = f"{prefix}.{key}"
            if isinstance(to, tuple):
                add({to: [path]})
            elif isinstance(to, Mapping):
                visit(to, path)
            elif callable(to):
                for probe in _PROBES:
                    recorder = _Recorder()
                    with contextlib.suppress(Exception):
                        to(recorder, probe(_every_key()), path)
                    add(recorder.paths)

    visit(layouts.CURRENT_LAYOUT, "trainer")
    return {target: [p.replace(".Adam.", ".<optimizer>.") for p in paths] for target, paths in found.items()}


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)) and not value:
        return "[]"
    if isinstance(value, dict) and not value:
        return "{}"
    return str(list(value) if isinstance(value, tuple) else value)


def _allowed(model: type[BaseModel], key: str) -> str:
    shape = validation.SHAPES.get(key)
    if shape is not None:
        return str(shape)
    properties = model.model_json_schema()["properties"]
    return validation.schema_in_words(properties[key], big=False) if key in properties else "a mapping"


def _scaler_default(key: str) -> str:
    """A loss-scaling key's default: the scaler's (Cerebras dialect), for float16 and, where it differs, cbfloat16."""
    from dls.diagnostics.scales import pow2
    from dls.settings import ScalerSettings

    argument = schema.SCALER_KEYS[key]
    if argument in ("loss_scale", "max_gradient_norm"):
        return "null"
    f16, cb16 = (ScalerSettings.cerebras(loss_scale="dynamic", half_dtype=h) for h in ("float16", "cbfloat16"))

    def shown(value: Any) -> str:
        if value is None or isinstance(value, bool):
            return _default(value)
        return pow2(value) if argument.endswith("scale") else f"{value:g}"

    text = f"null: {shown(getattr(f16, argument))}"
    other = shown(getattr(cb16, argument))
    return text if f"null: {other}" == text else f"{text} (cbfloat16: {other})"


def _section_titles() -> dict[str, str]:
    """dls's section -> its heading: its name, and its other names in Model Zoo's legacy layout (``train_input``)."""
    titles = {section: f"`{section}`" for section in schema.SECTION_CLASSES}
    for written, section in layouts.LEGACY_SECTIONS.items():
        if section in titles and written != section and section != "eval_data":
            titles[section] += f" (`{written}` in Model Zoo's legacy layout)"
    return titles


def config_keys_markdown() -> str:
    """Every key of dls's sections, one table per section, then Model Zoo's model and data keys (Markdown)."""
    current = current_layout_paths()
    only = schema.ONLY
    titles = _section_titles()
    parts = []
    for section, cls in schema.SECTION_CLASSES.items():
        doc = " ".join((cls.__doc__ or "").split())
        parts.append(f"### {titles[section]}\n\n{doc}\n")
        parts.append("| key | type and allowed values | default | what it does | current Model Zoo layout |")
        parts.append("|---|---|---|---|---|")
        for key, field in cls.model_fields.items():
            if section == "optimizer" and key in schema.SCALER_KEYS:
                argument = schema.SCALER_KEYS[key]
                allowed = f"as `dls.GradScaler`'s `{argument}` (judged by `dls.settings.ScalerSettings`)"
                default = _scaler_default(key)
            else:
                allowed, default = _allowed(cls, key), _default(field.default)
            what = field.description or ""
            if key in only:
                what += f" (only with {' or '.join(only[key])})"
            where = ", ".join(f"`{p}`" for p in current.get((section, key), [])) or "—"
            parts.append(f"| `{key}` | {_cell(allowed)} | `{_cell(default)}` | {_cell(what)} | {_cell(where)} |")
        parts.append("")
    moved = [
        f"`{legacy_section}.{key}` → `{to[0]}.{to[1]}`"
        for legacy_section, table in layouts.MOVED.items()
        for key, to in table.items()
        if isinstance(to, tuple) and (legacy_section, key) != to
    ]
    if moved:
        parts.append(f"In the legacy layout these keys live in another section: {', '.join(moved)}.\n")
    parts.append(_modelzoo_markdown())
    return "\n".join(parts)


def _modelzoo_markdown() -> str:
    """The keys of Model Zoo's models and data processors, as ``dls.train.config.zoo_keys`` declares them."""
    parts = ["### Model Zoo's models and data processors\n"]
    tables = {
        "`model:` of `fc_mnist`": "FcMnistKeys",
        "`model:` of `gpt2`, `gpt3` and `llama`": "GptKeys",
        "`train_input:` / `eval_input:` of a Model Zoo data processor": "LoaderKeys",
    }
    for title, name in tables.items():
        model = getattr(zoo_keys, name)
        if not isinstance(model, type) or not issubclass(model, BaseModel):
            continue
        doc = " ".join((model.__doc__ or "").split())
        parts.append(f"#### {title}\n\n{doc}\n" if doc else f"#### {title}\n")
        parts.append("| key | type and allowed values | default | what it does |")
        parts.append("|---|---|---|---|")
        properties = model.model_json_schema().get("properties", {})
        for key, field in model.model_fields.items():
            allowed = validation.schema_in_words(properties[key], big=False) if key in properties else "a mapping"
            default = "required" if field.is_required() else _default(field.default)
            what = field.description or "as in Model Zoo"
            parts.append(f"| `{key}` | {_cell(allowed)} | `{_cell(default)}` | {_cell(what)} |")
        parts.append("")
    default_only = {
        name.removeprefix("_").removesuffix("_DEFAULT_ONLY").lower(): value
        for name, value in vars(zoo_keys).items()
        if name.endswith("_DEFAULT_ONLY") and isinstance(value, dict)
    }
    for kind, keys in default_only.items():
        listed = ", ".join(f"`{k}: {_default(v)}`" for k, v in sorted(keys.items()))
        parts.append(f"Accepted only at Model Zoo's default ({kind}; another value is an error naming it): {listed}.\n")
    ignored = sorted(
        {str(k) for name, v in vars(zoo_keys).items() if name.endswith("_IGNORED") for k in v}
        | layouts.IGNORED_OFF_CEREBRAS
    )
    parts.append(
        "Accepted and listed once as ignored (they matter only on Cerebras hardware or to Model Zoo's launcher): "
        + ", ".join(f"`{k}`" for k in ignored)
        + ".\n"
    )
    return "\n".join(parts)


def keys_text(width: int = 100) -> str:
    """``dls keys``: every key of dls's sections, its default and help, in columns, the help wrapped at ``width``
    under its own column (nothing cut, whatever the width)."""
    import textwrap

    rows: list[tuple[str, str, str] | str] = []
    only = schema.ONLY
    for section, cls in schema.SECTION_CLASSES.items():
        rows.append(f"{section}:")
        for key, field in cls.model_fields.items():
            scaler = section == "optimizer" and key in schema.SCALER_KEYS
            default = _scaler_default(key) if scaler else _default(field.default)
            text = (field.description or "") + (f" [{'/'.join(only[key])} only]" if key in only else "")
            rows.append((key, default, text))
    cells = [row for row in rows if isinstance(row, tuple)]
    key_width = max(len(key) for key, _, _ in cells) + 2
    default_width = min(max(len(default) for _, default, _ in cells), 14) + 2
    column = 2 + key_width + default_width
    lines = []
    for row in rows:
        if isinstance(row, str):
            lines.append(row)
            continue
        key, default, text = row
        head = f"  {key:<{key_width}}{default:<{default_width}}"
        if len(head) > column:  # a default wider than its column: the help starts on the next line
            lines.append(head.rstrip())
            head = " " * column
        wrapped = textwrap.wrap(text, max(width - column, 30)) or [""]
        lines.append(head + wrapped[0])
        lines += [" " * column + more for more in wrapped[1:]]
    return "\n".join(line.rstrip() for line in lines)
