"""Model Zoo's data formats as resumable batches (``dls.train.data.BatchIterator``): ``GptHDF5DataProcessor`` /
``GptHDF5MapDataProcessor`` (``*.h5`` files with ``data`` of shape ``[N, 3, msl]``, or the map processor's flat token
stream cut into ``max_sequence_length + 1`` windows; a batch is ``(input_ids, labels)``, labels -100 where the mask is
0) and ``MNISTDataProcessor`` (torchvision's layout, normalised as Model Zoo does). Each epoch's order is drawn from
``(shuffle_seed, epoch)``."""

from __future__ import annotations

import gzip
import math
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dls.train.data import BatchIterator, DataInfo, Dataset
from dls.train.errors import ConfigError
from dls.train.modelzoo.keys import IGNORE_INDEX, LoaderKeys, parse_loader
from dls.train.modelzoo.models import Batch, CausalLM, require

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
MNIST_LAYOUT = "<data_dir>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte (plain or .gz)"
GPT_LAYOUT = "*.h5 files with a dataset 'data' of shape [N, 3, max_sequence_length]"
_WRITE_HINT = {"MNISTDataProcessor": "dls data mnist DIR", "GptHDF5DataProcessor": "dls data gpt DIR"}


def mnist_files(data_dir: str, split: str) -> tuple[list[Path], list[str]]:
    """The images and labels files of ``split`` (train or val) under ``data_dir``, or what is missing."""
    raw = Path(data_dir) / "MNIST" / "raw"
    stem = "train" if split == "train" else "t10k"
    found, missing = [], []
    for kind in ("images-idx3", "labels-idx1"):
        name = f"{stem}-{kind}-ubyte"
        path = next((p for p in (raw / name, raw / f"{name}.gz") if p.is_file()), None)
        found += [path] if path else []
        missing += [] if path else [str(raw / name)]
    return found, missing


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
    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.images = torch.from_numpy(images.copy())
        self.labels = torch.from_numpy(labels.astype(np.int64))
        self.info = DataInfo(task="classification", input_dim=images[0].size, output_dim=10)

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, indices: torch.Tensor, epoch: int) -> Batch:
        images = (self.images[indices].float() / 255 - MNIST_MEAN) / MNIST_STD
        return images.unsqueeze(1), self.labels[indices]


def gpt_files(dirs: list[str], map_style: bool, msl: int | None, first_only: bool) -> tuple[list[Any], list[str]]:
    """``[(path, data dataset)]`` of the ``*.h5`` files in ``dirs`` (each directory sorted, as Model Zoo reads
    them), or the problems found; ``first_only`` opens just the first file."""
    h5py = require("h5py")
    problems = [f"{d} is not a directory" for d in dirs if not Path(d).is_dir()]
    paths = [p for d in dirs if Path(d).is_dir() for p in sorted(Path(d).glob("*.h5"))]
    if not paths and not problems:
        problems.append(f"no *.h5 files in {', '.join(dirs)}")
    files, shape = [], None
    for path in paths[:1] if first_only else paths:
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
        elif shape is not None and data.shape[1:] != shape:
            problems.append(f"{path}: 'data' of shape {list(data.shape)} unlike {paths[0]}'s")
        shape = data.shape[1:]
        files.append((path, data))
    return files, problems


class GptDataset(Dataset):
    """Samples of ``[N, 3, msl]`` files, or windows of a flat token stream over all files (``msl`` tokens apart)."""

    def __init__(self, files: list[Any], msl: int | None) -> None:
        self.data = [data for _, data in files]
        lengths = [len(d) for d in self.data]
        self.starts = np.cumsum([0, *lengths])
        self.flat = self.data[0].ndim == 1
        self.msl = int(msl if self.flat else self.data[0].shape[2])  # type: ignore[arg-type]
        self.count = (int(self.starts[-1]) - 1) // self.msl if self.flat else int(self.starts[-1])
        self.info = DataInfo(task="language_model", sequence_length=self.msl)
        self.vocab: tuple[int, str] | None = None  # (vocab_size, its key): fit_to_data

    def _check_tokens(self, ids: np.ndarray) -> None:
        if self.vocab is not None and ids.size and (ids.min() < 0 or ids.max() >= self.vocab[0]):
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            size, key = self.vocab
            raise ConfigError([f"{key}: {size}, but the data holds token id {bad} (ids must be in [0, {size}))"])

    def __len__(self) -> int:
        return self.count

    def _read(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of all files together."""
        parts = []
        for data, lo in zip(self.data, self.starts[:-1]):
            a, b = max(start, lo), min(stop, lo + len(data))
            if a < b:
                parts.append(data[a - lo : b - lo])
        return np.concatenate(parts).astype(np.int64)

    def batch(self, indices: torch.Tensor, epoch: int) -> Batch:
        idx = indices.numpy()
        if self.flat:
            tokens = np.stack([self._read(i * self.msl, (i + 1) * self.msl + 1) for i in idx])
            self._check_tokens(tokens)
            return torch.from_numpy(tokens[:, :-1]), torch.from_numpy(tokens[:, 1:])
        order = np.argsort(idx)  # h5py reads increasing indices
        rows = np.empty((len(idx), 3, self.msl), dtype=np.int64)
        file_of = np.searchsorted(self.starts, idx[order], side="right") - 1
        for f in np.unique(file_of):
            take = order[file_of == f]
            rows[take] = self.data[f][idx[take] - self.starts[f]]
        labels = np.where(rows[:, 1] == 0, IGNORE_INDEX, rows[:, 2])
        self._check_tokens(rows[:, 0])
        self._check_tokens(labels[labels != IGNORE_INDEX])
        return torch.from_numpy(rows[:, 0]), torch.from_numpy(labels)


def fit_to_data(model: Any, dataset: Any, prefix: str = "model") -> None:
    """``ConfigError`` naming ``prefix``'s key when a Model Zoo language model cannot read ``dataset``'s sequences
    (longer than its positions, a larger vocabulary); a GPT data set then refuses a batch holding a token id outside
    the model's vocabulary, as it reads it (the files are not scanned up front)."""
    if not isinstance(model, CausalLM):
        return
    info = dataset.info
    if info.sequence_length > model.max_positions:
        raise ConfigError([
            f"{prefix}.max_position_embeddings: {model.max_positions}, shorter than the data's sequences of "
            f"{info.sequence_length} tokens"
        ])  # fmt: skip
    if info.vocab_size > model.vocab_size:
        raise ConfigError([f"{prefix}.vocab_size: {model.vocab_size}, smaller than the data's {info.vocab_size}"])
    if isinstance(dataset, GptDataset):
        dataset.vocab = (model.vocab_size, f"{prefix}.vocab_size")


def _problems(processor: str, keys: LoaderKeys, split: str, first_only: bool) -> tuple[Any, list[str]]:
    if processor == "MNISTDataProcessor":
        data_dir = keys.data_dir if isinstance(keys.data_dir, str) else "./"
        files, missing = mnist_files(data_dir, keys.split or split)
        return files, [f"{' and '.join(missing)} missing"] if missing else []
    map_style = processor == "GptHDF5MapDataProcessor"
    return gpt_files(keys.dirs, map_style, keys.max_sequence_length, first_only)


def _error(processor: str, keys: LoaderKeys, prefix: str, problems: list[str]) -> ConfigError:
    layout = MNIST_LAYOUT if processor == "MNISTDataProcessor" else GPT_LAYOUT
    write = _WRITE_HINT.get(processor, "dls data gpt DIR --corpus")
    where = f"{prefix}.data_dir ({keys.data_dir or './'})"
    return ConfigError([f"{where}: {p}; {processor} reads {layout} (a tiny set: {write})" for p in problems])


def check_data(processor: str, params: dict[str, Any], *, split: str = "train", prefix: str | None = None) -> list[str]:
    """What is missing or malformed in the data a loader section names (one line each, naming the path and the
    layout expected; empty when it looks right), reading only file headers; ``ConfigError`` for invalid keys."""
    prefix = prefix or ("train_input" if split == "train" else "eval_input")
    keys, _ = parse_loader(processor, params, prefix)
    _, problems = _problems(processor, keys, split, first_only=True)
    return _error(processor, keys, prefix, problems).errors if problems else []


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
    keys or data."""
    prefix = prefix or ("train_input" if split == "train" else "eval_input")
    keys, ignored = parse_loader(processor, params, prefix)
    files, problems = _problems(processor, keys, split, first_only=False)
    dataset: Dataset | None = None
    if not problems:
        try:
            if processor == "MNISTDataProcessor":
                images, labels = read_idx(files[0], 2051), read_idx(files[1], 2049)
                if len(images) != len(labels):
                    raise ValueError(f"{len(images)} images but {len(labels)} labels")
                dataset = MnistDataset(images, labels)
            else:
                dataset = GptDataset(files, keys.max_sequence_length)
        except (OSError, ValueError) as exc:
            problems.append(str(exc))
    if dataset is None:
        raise _error(processor, keys, prefix, problems)
    if len(dataset) // keys.batch_size < world_size:
        samples = f"the {len(dataset)} samples in {prefix}.data_dir ({keys.data_dir})"
        raise ConfigError([f"{prefix}.batch_size: {keys.batch_size} * {world_size} rank(s) is more than {samples}"])
    seed = keys.shuffle_seed if keys.shuffle_seed is not None else seed
    batches = BatchIterator(dataset, keys.batch_size, keys.shuffles(processor), seed, rank, world_size, keys.drops_last)
    batches.ignored_keys = ignored
    return batches
