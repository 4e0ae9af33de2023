"""``dls init``: list the configs shipped in the wheel, or copy one into a directory (for a Model Zoo config, with
a tiny data set in its format, its ``data_dir`` pointed there)."""

from __future__ import annotations

import argparse
import importlib.resources
import re
from pathlib import Path
from typing import Any

from dls.train.errors import MissingExtras, UsageError

_DATA_PROCESSOR = re.compile(r"^\s*data_processor:\s*[\"']?(\w+)", re.MULTILINE)
_DATA_DIR = re.compile(r"^(?P<key>[ \t]*data_dir:)[^\n]*\n(?:[ \t]*-[^\n]*\n)*", re.MULTILINE)  # a list below too


def add_parser(sub: Any) -> None:
    init = sub.add_parser("init", help="list the shipped configs, or copy one (and the data it needs) into DIR")
    init.add_argument("name", nargs="?", metavar="NAME", help="a shipped config, as listed by dls init")
    init.add_argument("directory", nargs="?", metavar="DIR", help="where to write the config (and its data)")


def shipped_configs() -> dict[str, Any]:
    """The shipped configs by name (their path below ``configs/`` without ``.yaml``)."""
    root = importlib.resources.files("dls.train") / "configs"
    found = {}
    for entry in root.iterdir():
        children = entry.iterdir() if entry.is_dir() else [entry]
        for child in children:
            if child.name.endswith(".yaml"):
                prefix = f"{entry.name}/" if entry.is_dir() else ""
                found[prefix + child.name.removesuffix(".yaml")] = child
    return dict(sorted(found.items()))


def extras(name: str, text: str) -> list[str]:
    needed = ["train"]
    if name.startswith("modelzoo/"):
        needed.append("modelzoo")
    if re.search(r"^\s*tensorboard:\s*true\b", text, re.MULTILINE):
        needed.append("tensorboard")
    return needed


def command(args: argparse.Namespace, run: Any) -> int:
    configs = shipped_configs()
    if args.name is None:
        print("Configs shipped with dls (dls init NAME DIR copies one into DIR, with the data it needs):")
        for name, path in configs.items():
            text = path.read_text()
            summary = next((line.lstrip("# ") for line in text.splitlines() if line.startswith("#")), "")
            print(f"  {name:32} dls[{','.join(extras(name, text))}]  {summary}")
        return 0
    if args.name not in configs:
        raise UsageError(f"no shipped config {args.name!r}; shipped: {', '.join(configs)}")
    if args.directory is None:
        raise UsageError(f"give the directory to write it into (dls init {args.name} DIR)")
    directory = Path(args.directory)
    target = directory / (args.name.rsplit("/", 1)[-1] + ".yaml")
    if target.exists() or target.is_symlink():
        raise UsageError(f"{target} exists; choose another directory (nothing was written)")
    text = configs[args.name].read_text()
    processor = _DATA_PROCESSOR.search(text)
    writer = _tiny_data_writer() if processor else None  # before anything is written
    directory.mkdir(parents=True, exist_ok=True)
    if writer is not None and processor is not None:
        kind = "mnist" if processor.group(1) == "MNISTDataProcessor" else "gpt"
        data_dir = directory / "data" / kind
        writer(kind, data_dir)
        text = _DATA_DIR.sub(lambda m: f"{m.group('key')} {str(_split_dir(kind, data_dir, m.group(0)))!r}\n", text)
        print(f"Wrote a tiny {processor.group(1)} data set into {data_dir}")
    with open(target, "x") as file:  # never over an existing file or through a link
        file.write(text)
    print(f"Wrote {target} (needs dls[{','.join(extras(args.name, text))}]). Next: dls train {target}")
    return 0


def _split_dir(kind: str, data_dir: Path, entry: str) -> Path:
    # MNIST reads both splits from one directory; the GPT readers read DIR/train or DIR/val (dls data gpt's layout),
    # chosen by the last directory the config named
    last = re.findall(r"[\w.-]+", entry.split(":", 1)[1])
    return data_dir if kind == "mnist" else data_dir / ("val" if last and last[-1] == "val" else "train")


def _tiny_data_writer() -> Any:
    try:
        from dls.train.modelzoo import write_tiny_data  # type: ignore[attr-defined,unused-ignore]
    except ImportError as exc:
        if exc.name in ("h5py", "transformers"):
            raise MissingExtras(
                f"Model Zoo data needs the 'modelzoo' extra: pip install 'dls[modelzoo]' ({exc})"
            ) from None
        raise UsageError(
            "this dls cannot write Model Zoo data (dls.train.modelzoo.write_tiny_data is missing); "
            "copy the config by hand and point its data_dir at your data"
        ) from None
    return write_tiny_data
