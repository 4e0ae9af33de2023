"""Model Zoo's data formats: its readers (``GptHDF5DataProcessor``, ``GptHDF5MapDataProcessor``,
``MNISTDataProcessor``) as resumable batches (:func:`build_loader`), what a section's data lacks (:func:`check_data`),
and tiny generated data sets in these formats (:func:`write_tiny_data`; :func:`main` is ``dls data {mnist,gpt}
DIR``), each file created new in its directory (``dls.train.rundir.RunDir.create_all``)."""

from __future__ import annotations

import argparse
import gzip
import inspect
import io
import math
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dls.train.batches import BatchIterator, DataInfo, Dataset
from dls.train.config.zoo_keys import LoaderKeys, parse_loader
from dls.train.errors import ConfigError
from dls.train.launch import free_memory
from dls.train.modelzoo.extra import require

Batch = tuple[torch.Tensor, torch.Tensor]
IGNORE_INDEX = -100  # a label that the loss skips: where Model Zoo's attention_mask (a loss mask) is 0


def read_idx(path: Path, magic: int) -> np.ndarray:
    """An IDX file (big-endian magic and dimensions, then unsigned bytes), plain or gzip'd."""
    raw = path.read_bytes()
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:  # truncated, not gzip, corrupt
            raise ValueError(f"{path}: not a readable gzip file ({exc})") from None
    ndim = magic & 0xFF
    if len(raw) < 4 + 4 * ndim or int.from_bytes(raw[:4], "big") != magic:
        raise ValueError(f"{path}: not an IDX file with magic {magic}")
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != math.prod(dims):
        raise ValueError(f"{path}: {data.size} bytes of data for dimensions {dims}")
    return data.reshape(dims)


class MnistDataset(Dataset):
    """An images and a labels IDX file, normalised as Model Zoo does (mean 0.1307, std 0.3081)."""

    def __init__(self, images_file: Path, labels_file: Path) -> None:
        images, labels = read_idx(images_file, 2051), read_idx(labels_file, 2049)
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.x, self.y = torch.from_numpy(images.copy()), torch.from_numpy(labels.astype(np.int64))
        self.info = DataInfo(input_dim=images[0].size, output_dim=10)

    def batch(self, indices: torch.Tensor, epoch: int) -> Batch:
        return ((self.x[indices].float() / 255 - 0.1307) / 0.3081).unsqueeze(1), self.y[indices]


class GptDataset(Dataset):
    """Samples of ``[N, 3, msl]`` files, or windows of ``msl + 1`` tokens of a flat token stream over all files
    (``msl`` tokens apart). A batch holding a token id outside ``vocab`` (set by :func:`fit_to_data`) is refused."""

    def __init__(self, files: list[Any], msl: int | None) -> None:
        self.data = files
        self.starts = np.cumsum([0, *(len(d) for d in self.data)])
        self.flat = self.data[0].ndim == 1
        self.msl = int(msl if self.flat else self.data[0].shape[2])  # type: ignore[arg-type]
        self.info = DataInfo(sequence_length=self.msl)
        self.vocab: tuple[int, str] | None = None  # (vocab_size, its key)

    def __len__(self) -> int:
        return (int(self.starts[-1]) - 1) // self.msl if self.flat else int(self.starts[-1])

    def batch(self, indices: torch.Tensor, epoch: int) -> Batch:
        idx = indices.numpy()
        if self.flat:
            tokens = np.stack([self._read(i * self.msl, (i + 1) * self.msl + 1) for i in idx])
            ids, labels = tokens[:, :-1], tokens[:, 1:]
        else:
            order = np.argsort(idx)  # h5py reads increasing indices
            rows = np.empty((len(idx), 3, self.msl), dtype=np.int64)
            file_of = np.searchsorted(self.starts, idx[order], side="right") - 1
            for f in np.unique(file_of):
                take = order[file_of == f]
                rows[take] = self.data[f][idx[take] - self.starts[f]]
            ids, labels = rows[:, 0], np.where(rows[:, 1] == 0, IGNORE_INDEX, rows[:, 2])
        if self.vocab is not None:
            size, key = self.vocab
            seen = np.concatenate([ids.ravel(), labels[labels != IGNORE_INDEX]])
            if (bad := seen[(seen < 0) | (seen >= size)]).size:
                raise ConfigError([f"{key}: {size}, but the data holds token id {bad[0]} (ids must be in [0, {size}))"])
        return torch.from_numpy(ids), torch.from_numpy(labels)

    def _read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``start:stop`` of the stream of all files (a slice past a file's end stops at its end)."""
        files = [(data, lo) for data, lo in zip(self.data, self.starts) if lo < stop and start < lo + len(data)]
        return np.concatenate([data[max(start - lo, 0) : stop - lo] for data, lo in files]).astype(np.int64)


def _open(processor: str, keys: LoaderKeys, split: str, prefix: str, headers_only: bool) -> tuple[Any, list[str]]:
    """The data set of a loader section and the problems found (then no data set), one line each naming the
    section's data_dir and the layout expected: MNIST's images and labels files of ``split``; each GPT ``*.h5`` file
    (each directory sorted, as Model Zoo reads them), its header checked. ``headers_only``: the first GPT file's
    header only, and no data set."""
    files: list[Any] = []  # MNIST: the images and labels paths; GPT: each file's 'data'
    problems, mnist, map_style = [], processor == "MNISTDataProcessor", processor == "GptHDF5MapDataProcessor"
    if mnist:
        raw = Path(keys.data_dir if isinstance(keys.data_dir, str) else "./") / "MNIST" / "raw"
        stem = "train" if (keys.split or split) == "train" else "t10k"
        names = [f"{stem}-{kind}-ubyte" for kind in ("images-idx3", "labels-idx1")]
        files = [next((p for p in (raw / n, raw / f"{n}.gz") if p.is_file()), None) for n in names]
        if missing := [str(raw / n) for n, path in zip(names, files) if path is None]:
            problems.append(f"{' and '.join(missing)} missing")
    else:
        h5py = require("h5py")
        msl, dirs = keys.max_sequence_length, [keys.data_dir] if isinstance(keys.data_dir, str) else keys.data_dir or []
        if missing := [str(d) for d in dirs if not Path(d).is_dir()]:  # one problem, however many directories
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            problems.append(f"{shown} {'is not a directory' if len(missing) == 1 else 'are not directories'}")
        paths = [p for d in dirs if Path(d).is_dir() for p in sorted(Path(d).glob("*.h5"))]
        if not paths and not problems:
            problems.append(f"no *.h5 files in {', '.join(dirs)}")
        for path in paths[:1] if headers_only else paths:
            try:
                data = h5py.File(path, "r")["data"]
            except (OSError, KeyError) as exc:
                problems.append(f"{path}: cannot read its dataset 'data' ({exc})")
                continue
            flat = map_style and data.ndim == 1
            if not (flat or (data.ndim == 3 and data.shape[1] == 3)) or data.dtype.kind not in "iu":
                problems.append(f"{path}: 'data' is {data.dtype}{list(data.shape)}, not integers of shape [N, 3, msl]")
            elif flat and msl is None:
                problems.append(f"{path}: a flat token stream needs max_sequence_length")
            elif not flat and msl not in (None, data.shape[2]):
                problems.append(f"{path}: sequences of {data.shape[2]} tokens, but max_sequence_length is {msl}")
            elif files and data.shape[1:] != files[0].shape[1:]:  # every file as the first read
                problems.append(f"{path}: 'data' of shape {list(data.shape)} unlike {files[0].file.filename}'s")
            files.append(data)
    dataset = None
    try:
        if not problems and not headers_only:
            dataset = MnistDataset(*files) if mnist else GptDataset(files, keys.max_sequence_length)
    except (OSError, ValueError) as exc:
        problems.append(str(exc))
    gpt_layout = "*.h5 files with a dataset 'data' of shape [N, 3, max_sequence_length]"
    layout = "<data_dir>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte (plain or .gz)" if mnist else gpt_layout
    write = "dls data " + ("mnist DIR" if mnist else "gpt DIR --corpus" if map_style else "gpt DIR")
    where = f"{prefix}.data_dir" + ("" if isinstance(keys.data_dir, list) else f" ({keys.data_dir or './'})")
    return dataset, [f"{where}: {p}; {processor} reads {layout} (a tiny set: {write})" for p in problems]


def check_data(processor: str, params: dict[str, Any], *, split: str = "train", prefix: str | None = None) -> list[str]:
    """What is missing or malformed in the data a loader section names (one line each, naming the path and the
    layout expected; empty when it looks right), reading only file headers; ``ConfigError`` for invalid keys."""
    prefix = prefix or ("train_input" if split == "train" else "eval_input")
    return _open(processor, parse_loader(processor, params, prefix)[0], split, prefix, headers_only=True)[1]


def build_loader(
    processor: str,
    params: dict[str, Any],
    *,
    split: str,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    prefix: str | None = None,
) -> BatchIterator:
    """Resumable batches of a Model Zoo loader section for ``split`` (an MNIST section's own ``split`` wins);
    ``seed`` when ``shuffle_seed`` is not set; ``prefix`` names the section in errors. ``ConfigError`` for invalid
    keys or data (the keys ignored here: :func:`parse_loader`)."""
    prefix = prefix or ("train_input" if split == "train" else "eval_input")
    keys = parse_loader(processor, params, prefix)[0]
    dataset, problems = _open(processor, keys, split, prefix, headers_only=False)
    if dataset is None:
        raise ConfigError(problems)
    shuffle = keys.shuffle if keys.shuffle is not None else processor == "MNISTDataProcessor"  # Model Zoo's defaults
    drop_last = next((v for v in (keys.drop_last, keys.drop_last_batch) if v is not None), True)
    seed = keys.shuffle_seed if keys.shuffle_seed is not None else seed
    return BatchIterator(dataset, keys.batch_size, shuffle, seed, rank, world_size, drop_last, f"{prefix}.batch_size")


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
    """Write a tiny generated data set of ``kind`` (``mnist`` or ``gpt``) into ``directory`` (created if missing,
    locked while written); the paths written. Every file is new: an existing file or link under a name it writes
    (or a link where one of its directories goes) refuses it before anything is written (``ModelDirError``, naming
    the path); nothing is replaced and no link followed.

    mnist: 28x28 seven-segment digits (random shift, stroke width and brightness, noise) and their labels in
    ``directory/MNIST/raw/{train,t10k}-*-ubyte`` (``compress``: ``.gz``), for ``MNISTDataProcessor``.
    gpt: ``directory/{train,val}/data_<i>.h5`` (``files`` files per split), each ``data`` of shape [N, 3, msl]
    (input_ids, attention_mask, labels) with the ``n_examples`` attribute Model Zoo's iterable reader reads; with
    ``corpus``, one flat token stream per file instead (for ``GptHDF5MapDataProcessor`` with
    ``max_sequence_length``)."""
    from dls.train.rundir import RunDir, resolve_model_dir

    args = dict(train_samples=train_samples, val_samples=val_samples, msl=msl, vocab=vocab, files=files)
    contents = tiny_data_files(kind, **args, corpus=corpus, compress=compress, seed=seed)
    with RunDir(resolve_model_dir(directory, "DIR"), "DIR") as target:
        return target.create_all(contents)


# What one sample of each kind costs in memory while it is generated (bytes; gpt: per token of a sequence), so that
# a data set beyond the free memory is refused before NumPy tries (or refuses an array beyond its index range).
_BYTES_PER_SAMPLE = {"mnist": 28 * 28 * 4 * 3, "gpt": 8 * 12}
MAX_VOCAB = 2**31  # token ids are stored as int32


def tiny_data_files(
    kind: str, *, train_samples: int, val_samples: int, msl: int, vocab: int, files: int, corpus: bool,
    compress: bool, seed: int,
) -> dict[str, bytes]:  # fmt: skip
    """The files of :func:`write_tiny_data`, generated in memory: relative path -> bytes. ``MemoryError`` when they
    need more memory than is free (before anything is allocated); ``ValueError`` for arguments no file can hold."""
    if kind not in ("mnist", "gpt"):
        raise ValueError(f"kind must be 'mnist' or 'gpt'; got {kind!r}")
    if kind == "gpt" and not 2 <= vocab <= MAX_VOCAB:
        raise ValueError(f"vocab must be in [2, {MAX_VOCAB}] (token ids are int32); got {vocab}")
    if kind == "gpt" and not 1 <= files <= min(train_samples, val_samples):
        raise ValueError(f"files must be in [1, {min(train_samples, val_samples)}] (each holds a sample); got {files}")
    need = max(train_samples, val_samples) * _BYTES_PER_SAMPLE[kind] * ((msl + 1) if kind == "gpt" else 1)
    if (free := free_memory()) is not None and need > free:
        raise MemoryError(f"dls data {kind} needs about {need / 2**30:,.1f} GiB; {free / 2**30:.1f} GiB are free here")
    rng = np.random.default_rng(seed)
    written: dict[str, bytes] = {}
    if kind == "mnist":  # each digit's lit segments, as on a seven-segment display
        segments = ("abcdef", "bc", "abdeg", "abcdg", "bcfg", "acdfg", "acdefg", "abc", "abcdefg", "abcdfg")
        for stem, count in (("train", train_samples), ("t10k", val_samples)):
            labels = rng.integers(0, 10, count).astype(np.uint8)
            images = rng.integers(0, 40, (count, 28, 28)).astype(np.float32)  # noise, then the lit segments
            for image, label in zip(images, labels):
                x, y, w = 8 + rng.integers(-3, 4), 4 + rng.integers(-3, 4), int(rng.integers(2, 4))
                boxes = {  # (top, height, left, width) of each segment, from the digit's top left corner (x, y)
                    "a": (0, w, 0, 12), "b": (0, 10, 12 - w, w), "c": (10, 10, 12 - w, w), "d": (20 - w, w, 0, 12),
                    "e": (10, 10, 0, w), "f": (0, 10, 0, w), "g": (10 - w // 2, w, 0, 12),
                }  # fmt: skip
                for segment in segments[label]:
                    top, height, left, width = boxes[segment]
                    image[y + top : y + top + height, x + left : x + left + width] += rng.uniform(150, 215)
            for name, array in zip(("images-idx3", "labels-idx1"), (np.clip(images, 0, 255).astype(np.uint8), labels)):
                header = (0x800 + array.ndim).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
                data = header + array.tobytes()
                written[f"MNIST/raw/{stem}-{name}-ubyte{'.gz' if compress else ''}"] = (
                    gzip.compress(data) if compress else data
                )
        return written
    h5py = require("h5py")
    for split, count in (("train", train_samples), ("val", val_samples)):
        steps = rng.choice([1, 2, 3, 5, 7], count)[:, None]  # arithmetic progressions: quickly learnt
        tokens = (rng.integers(0, vocab, count)[:, None] + steps * np.arange(msl + 1)) % vocab
        pads = rng.integers(0, max(msl // 4, 1), count) * (rng.random(count) < 0.25)  # a quarter end in padding
        mask = (np.arange(msl) < msl - pads[:, None]).astype(np.int32)  # a loss mask: 0 on the padding
        sequences = np.stack([tokens[:, :-1] * mask, mask, tokens[:, 1:] * mask], axis=1).astype(np.int32)
        for i, part in enumerate(np.array_split(sequences, files)):
            buffer = io.BytesIO()
            with h5py.File(buffer, "w") as f:  # a corpus: the sequences' tokens back to back
                f.create_dataset("data", data=part[:, 0].ravel() if corpus else part)
                if not corpus:
                    f.attrs["n_examples"] = len(part)
            written[f"{split}/data_{i}.h5"] = buffer.getvalue()
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """Write a tiny data set in a Model Zoo format, generated (nothing is downloaded): mnist, seven-segment digits in
    torchvision's MNIST layout; gpt, token sequences as HDF5 files in DIR/train and DIR/val. Prints what it wrote."""
    parser = argparse.ArgumentParser(prog="dls data", description=main.__doc__)
    parser.add_argument("kind", choices=["mnist", "gpt"])
    parser.add_argument("directory", help="where to write (created if missing)")
    options = {  # write_tiny_data's argument (its default is the option's): (option, least, help)
        "train_samples": ("train", 1, "training samples"), "val_samples": ("val", 1, "validation samples"),
        "msl": ("msl", 1, "gpt: tokens per sequence"), "vocab": ("vocab", 2, "gpt: vocabulary size"),
        "files": ("files", 1, "gpt: .h5 files per split"), "seed": ("seed", 0, "random seed"),
    }  # fmt: skip
    for name, (option, _, text) in options.items():
        default = inspect.signature(write_tiny_data).parameters[name].default
        parser.add_argument(f"--{option}", dest=name, type=int, default=default, help=f"{text} (default {default})")
    parser.add_argument("--corpus", action="store_true", help="gpt: flat token streams (GptHDF5MapDataProcessor)")
    parser.add_argument("--gzip", dest="compress", action="store_true", help="mnist: write .gz files")
    args = parser.parse_args(argv)
    for name, (option, least, _) in options.items():
        if getattr(args, name) < least:
            parser.error(f"--{option} must be at least {least}; got {getattr(args, name)}")
    if args.kind == "gpt" and args.vocab > MAX_VOCAB:
        parser.error(f"--vocab must be at most {MAX_VOCAB} (token ids are int32); got {args.vocab}")
    if args.kind == "gpt" and args.files > (most := min(args.train_samples, args.val_samples)):
        parser.error(f"--files must be at most {most}, --train's and --val's smaller (each file holds a sample)")
    print("\n".join(f"wrote {p}" for p in write_tiny_data(**vars(args))))
    return 0
