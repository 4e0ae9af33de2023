"""A griffe extension for the API reference: a function whose implementation takes only ``*args, **kwargs`` and
whose real signatures are its ``@overload``s (``dls.GradScaler.__init__``, one per dialect) gets their parameters,
so that its docstring's Args table has types and defaults and griffe does not warn about parameters "missing" from
the signature. The page shows the overloads alone (mkdocstrings' ``overloads_only``)."""

from __future__ import annotations

import ast
from typing import Any

import griffe


class OverloadParameters(griffe.Extension):
    """Gives a ``*args, **kwargs`` implementation its overloads' parameters (see the module docstring)."""

    def on_function_instance(self, *, node: ast.AST | griffe.ObjectNode, func: griffe.Function, **kwargs: Any) -> None:
        """Merge the overloads' parameters into ``func``'s, in their order; differing defaults joined by "or"."""
        variadic = {griffe.ParameterKind.var_positional, griffe.ParameterKind.var_keyword}
        own = [p for p in func.parameters if p.name not in ("self", "cls")]
        if not func.overloads or any(p.kind not in variadic for p in own):
            return
        merged: dict[str, list[griffe.Parameter]] = {}
        for overload in func.overloads:
            for parameter in overload.parameters:
                merged.setdefault(parameter.name, []).append(parameter)
        parameters = []
        for name, variants in merged.items():
            annotation = max((p.annotation for p in variants if p.annotation is not None), key=str, default=None)
            defaults = list(dict.fromkeys(str(p.default) for p in variants if p.default is not None))
            first = variants[0]
            kind = first.kind if name in ("self", "cls") else griffe.ParameterKind.keyword_only
            parameters.append(
                griffe.Parameter(name, annotation=annotation, kind=kind, default=" or ".join(defaults) or None)
            )
        func.parameters = griffe.Parameters(*parameters)
