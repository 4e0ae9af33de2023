"""Tiny data sets in Model Zoo's formats, generated (nothing is downloaded): ``dls data mnist DIR`` writes
seven-segment digits in torchvision's MNIST layout, ``dls data gpt DIR`` writes token sequences (arithmetic
progressions modulo the vocabulary, so that a small model's loss falls within a few dozen steps) as HDF5 files in
``DIR/train`` and ``DIR/val``."""

from __future__ import annotations

import argparse
import gzip
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dls.train.modelzoo.models import require

_SEGMENTS = ("abcdef", "bc", "abdeg", "abcdg", "bcfg", "acdfg", "acdefg", "abc", "abcdefg", "abcdfg")


def _digits(count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``count`` 28x28 seven-segment digits (random shift, stroke width and brightness, noise) and their labels."""
    labels = rng.integers(0, 10, count).astype(np.uint8)
    images = rng.integers(0, 40, (count, 28, 28)).astype(np.float32)
    for image, label in zip(images, labels):
        x, y, w = 8 + rng.integers(-3, 4), 4 + rng.integers(-3, 4), int(rng.integers(2, 4))
        boxes = {  # (top, bottom, left, right) of each segment
            "a": (y, y + w, x, x + 12), "b": (y, y + 10, x + 12 - w, x + 12), "c": (y + 10, y + 20, x + 12 - w, x + 12),
            "d": (y + 20 - w, y + 20, x, x + 12), "e": (y + 10, y + 20, x, x + w), "f": (y, y + 10, x, x + w),
            "g": (y + 10 - w // 2, y + 10 - w // 2 + w, x, x + 12),
        }  # fmt: skip
        for segment in _SEGMENTS[label]:
            top, bottom, left, right = boxes[segment]
            image[top:bottom, left:right] += rng.uniform(150, 215)
    return np.clip(images, 0, 255).astype(np.uint8), labels


def _write_idx(path: Path, array: np.ndarray, compress: bool) -> Path:
    header = (0x800 + array.ndim).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    content = header + array.tobytes()
    path = path.with_name(path.name + ".gz") if compress else path
    path.write_bytes(gzip.compress(content) if compress else content)
    return path


def _sequences(count: int, msl: int, vocab: int, rng: np.random.Generator) -> np.ndarray:
    """``[count, 3, msl]``: input_ids, attention_mask (a loss mask: some sequences end in masked padding), labels."""
    steps = rng.choice([1, 2, 3, 5, 7], count)[:, None]
    tokens = (rng.integers(0, vocab, count)[:, None] + steps * np.arange(msl + 1)) % vocab
    mask = np.ones((count, msl), dtype=np.int32)
    for row, pad in zip(mask, rng.integers(0, msl // 4, count) * (rng.random(count) < 0.25)):
        row[msl - pad :] = 0
    ids, labels = tokens[:, :-1] * mask, tokens[:, 1:] * mask
    return np.stack([ids, mask, labels], axis=1).astype(np.int32)


def write_tiny_data(
    kind: str,
    directory: str | Path,
    *,
    train_samples: int = 2048,
    val_samples: int = 256,
    msl: int = 128,
    vocab: int = 512,
    files: int = 2,
    corpus: bool = False,
    compress: bool = False,
    seed: int = 0,
) -> list[Path]:
    """Write a tiny data set of ``kind`` (``mnist`` or ``gpt``) into ``directory``; the paths written.

    mnist: ``directory/MNIST/raw/{train,t10k}-*-ubyte`` (``compress``: ``.gz``), for ``MNISTDataProcessor``.
    gpt: ``directory/{train,val}/data_<i>.h5`` (``files`` files per split), each ``data`` of shape [N, 3, msl]
    with the ``n_examples`` attribute Model Zoo's iterable reader reads; with ``corpus``, one flat token stream
    per file instead (for ``GptHDF5MapDataProcessor`` with ``max_sequence_length``)."""
    rng = np.random.default_rng(seed)
    root, written = Path(directory), []
    if kind == "mnist":
        raw = root / "MNIST" / "raw"
        raw.mkdir(parents=True, exist_ok=True)
        for stem, count in (("train", train_samples), ("t10k", val_samples)):
            images, labels = _digits(count, rng)
            written.append(_write_idx(raw / f"{stem}-images-idx3-ubyte", images, compress))
            written.append(_write_idx(raw / f"{stem}-labels-idx1-ubyte", labels, compress))
        return written
    if kind != "gpt":
        raise ValueError(f"kind must be 'mnist' or 'gpt'; got {kind!r}")
    h5py = require("h5py")
    for split, count in (("train", train_samples), ("val", val_samples)):
        (root / split).mkdir(parents=True, exist_ok=True)
        for i, part in enumerate(np.array_split(_sequences(count, msl, vocab, rng), files)):
            path = root / split / f"data_{i}.h5"
            with h5py.File(path, "w") as f:
                if corpus:  # the sequences' tokens back to back
                    f.create_dataset("data", data=part[:, 0].ravel())
                else:
                    f.create_dataset("data", data=part)
                    f.attrs["n_examples"] = len(part)
            written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """``dls data {mnist,gpt} DIR [options]``: write a tiny data set; prints what it wrote."""
    parser = argparse.ArgumentParser(prog="dls data", description=__doc__)
    parser.add_argument("kind", choices=["mnist", "gpt"])
    parser.add_argument("directory", help="where to write (created if missing)")
    sizes = {"train": 2048, "val": 256, "msl": 128, "vocab": 512, "files": 2, "seed": 0}
    helps = ["training samples", "validation samples", "gpt: tokens per sequence", "gpt: vocabulary size",
             "gpt: .h5 files per split", "random seed"]  # fmt: skip
    for (option, default), text in zip(sizes.items(), helps):
        parser.add_argument(f"--{option}", type=int, default=default, help=f"{text} (default {default})")
    parser.add_argument("--corpus", action="store_true", help="gpt: flat token streams (GptHDF5MapDataProcessor)")
    parser.add_argument("--gzip", action="store_true", help="mnist: write .gz files")
    args = parser.parse_args(argv)
    for option in ("train", "val", "msl", "vocab", "files"):
        if getattr(args, option) < (2 if option == "vocab" else 1):
            parser.error(f"--{option} must be at least {2 if option == 'vocab' else 1}; got {getattr(args, option)}")
    paths = write_tiny_data(
        args.kind, args.directory, train_samples=args.train, val_samples=args.val, msl=args.msl, vocab=args.vocab,
        files=args.files, corpus=args.corpus, compress=args.gzip, seed=args.seed,
    )  # fmt: skip
    print("\n".join(f"wrote {p}" for p in paths))
    return 0
