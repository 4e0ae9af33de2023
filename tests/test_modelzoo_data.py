"""Model Zoo's data formats (dls.train.modelzoo): HDF5 [N, 3, msl] and flat token streams, torchvision's MNIST
layout plain and gzip'd, resumable batches, and one clear error per missing or malformed data_dir."""

from __future__ import annotations

import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from dls.train.errors import ConfigError, MissingExtras
from dls.train.modelzoo import build_loader, check_data, main, parse_loader, read_idx, write_tiny_data

GPT, MAP, MNIST = "GptHDF5DataProcessor", "GptHDF5MapDataProcessor", "MNISTDataProcessor"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    write_tiny_data("mnist", root / "mnist", train_samples=96, val_samples=32)
    write_tiny_data("mnist", root / "mnist_gz", train_samples=96, val_samples=32, compress=True)
    write_tiny_data("gpt", root / "gpt", train_samples=50, val_samples=10, msl=16, vocab=64, files=3)
    write_tiny_data("gpt", root / "corpus", train_samples=50, val_samples=10, msl=16, vocab=64, corpus=True)
    return root


def gpt(tiny: Path, **keys: object) -> dict[str, object]:
    return {"data_dir": str(tiny / "gpt" / "train"), "batch_size": 8, "shuffle": True, **keys}


def errors(processor: str, params: dict[str, object], **kwargs: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        build_loader(processor, params, split="train", seed=0, **kwargs)
    return info.value.errors


@pytest.mark.parametrize("folder", ["mnist", "mnist_gz"])
def test_mnist_reads_torchvisions_layout_normalised(tiny: Path, folder: str) -> None:
    raw = tiny / folder / "MNIST" / "raw"
    suffix = ".gz" if folder == "mnist_gz" else ""
    images = read_idx(raw / f"t10k-images-idx3-ubyte{suffix}", 2051)
    labels = read_idx(raw / f"t10k-labels-idx1-ubyte{suffix}", 2049)
    assert images.shape == (32, 28, 28) and labels.shape == (32,)
    loader = build_loader(
        MNIST, {"data_dir": str(tiny / folder), "batch_size": 32, "shuffle": False}, split="val", seed=0
    )
    x, y = loader.next()
    expected = (torch.from_numpy(images.astype(np.float32)) / 255 - 0.1307) / 0.3081
    torch.testing.assert_close(x, expected.unsqueeze(1))
    assert y.dtype == torch.int64 and y.tolist() == labels.tolist()


def test_gpt_hdf5_samples_across_files_with_loss_mask(tiny: Path) -> None:
    files = sorted((tiny / "gpt" / "train").glob("*.h5"))
    rows = np.concatenate([h5py.File(f, "r")["data"][:] for f in files])
    assert rows.shape == (50, 3, 16) and len(files) == 3
    assert [h5py.File(f, "r").attrs["n_examples"] for f in files] == [17, 17, 16]
    loader = build_loader(GPT, gpt(tiny, batch_size=50, shuffle=False), split="train", seed=0)
    ids, labels = loader.next()
    assert ids.tolist() == rows[:, 0].tolist()
    assert labels.tolist() == np.where(rows[:, 1] == 0, -100, rows[:, 2]).tolist()
    assert (rows[:, 1] == 0).any()  # the tiny data has masked padding
    shuffled = build_loader(GPT, gpt(tiny, batch_size=50), split="train", seed=0).next()[0]
    assert sorted(map(tuple, shuffled.tolist())) == sorted(map(tuple, rows[:, 0].tolist()))
    assert shuffled.tolist() != ids.tolist()


def test_map_processor_reads_a_flat_token_stream(tiny: Path) -> None:
    tokens = np.concatenate([h5py.File(f, "r")["data"][:] for f in sorted((tiny / "corpus" / "train").glob("*.h5"))])
    keys = {"data_dir": str(tiny / "corpus" / "train"), "batch_size": 4, "max_sequence_length": 16}
    loader = build_loader(MAP, keys, split="train", seed=0)  # shuffle: False by default
    assert len(loader.dataset) == (len(tokens) - 1) // 16
    ids, labels = loader.next()
    windows = np.stack([tokens[16 * i : 16 * i + 17] for i in range(4)])
    assert ids.tolist() == windows[:, :-1].tolist() and labels.tolist() == windows[:, 1:].tolist()
    same = build_loader(MAP, {"data_dir": str(tiny / "gpt" / "train"), "batch_size": 4}, split="train", seed=0)
    assert same.next()[0].shape == (4, 16)  # [N, 3, msl] too


def test_batches_resume_exactly_and_keep_the_last_partial_batch(tiny: Path) -> None:
    first = build_loader(GPT, gpt(tiny, shuffle_seed=3), split="train", seed=0)
    for _ in range(8):  # 6 batches per epoch: into the second epoch
        first.next()
    state = first.state_dict()
    expected = [first.next()[0] for _ in range(5)]
    second = build_loader(GPT, gpt(tiny, shuffle_seed=3), split="train", seed=9)
    second.load_state_dict(state)
    assert all(torch.equal(a, second.next()[0]) for a in expected)
    keep = build_loader(GPT, gpt(tiny, drop_last=False, shuffle=False), split="train", seed=0)
    sizes = [len(keep.next()[0]) for _ in range(8)]
    assert sizes == [8] * 6 + [2, 8]


def test_loader_keys(tiny: Path) -> None:
    hardware_only = gpt(tiny, num_workers=8, prefetch_factor=10, persistent_workers=True)
    assert build_loader(GPT, hardware_only, split="train", seed=0).next()  # accepted
    assert parse_loader(GPT, hardware_only, "train_input")[1] == [
        "train_input.num_workers",
        "train_input.prefetch_factor",
        "train_input.persistent_workers",
    ]
    assert errors(GPT, gpt(tiny, batch_sise=8)) == ["train_input.batch_sise: unknown key (did you mean 'batch_size'?)"]
    assert errors(GPT, {"data_dir": str(tiny), "batch_size": 8}) == [
        "train_input.shuffle: required by GptHDF5DataProcessor"
    ]
    assert errors(GPT, gpt(tiny, batch_size=True))[0].startswith("train_input.batch_size: Input should be")
    assert errors(GPT, gpt(tiny, use_vsl=True))[0].startswith("train_input.use_vsl: True cannot")
    assert errors(GPT, gpt(tiny, drop_last=True, drop_last_batch=False)) == [
        "train_input.drop_last_batch: contradicts drop_last"
    ]
    prefix = "trainer.fit.train_dataloader"
    assert errors(GPT, gpt(tiny, data_processor=MNIST), prefix=prefix)[0].startswith(f"{prefix}.data_processor")
    assert errors(GPT, gpt(tiny, batch_size=51)) == [
        "train_input.batch_size (51) is larger than the data set (50 samples)"
    ]


def test_missing_or_malformed_data_dir_is_one_line(tiny: Path, tmp_path: Path) -> None:
    missing = errors(GPT, gpt(tiny, data_dir=str(tmp_path / "nope")))
    assert len(missing) == 1 and "nope is not a directory" in missing[0] and "[N, 3, max_sequence_length]" in missing[0]
    assert "no *.h5 files" in errors(GPT, gpt(tiny, data_dir=str(tmp_path)))[0]
    with h5py.File(tmp_path / "bad.h5", "w") as f:
        f.create_dataset("data", data=np.zeros((4, 2, 8), dtype=np.int32))
    assert "not integers of shape [N, 3, msl]" in errors(GPT, gpt(tiny, data_dir=str(tmp_path)))[0]
    flat = {"data_dir": str(tiny / "corpus" / "train"), "batch_size": 2, "shuffle": False}
    assert "not integers of shape" in errors(GPT, flat)[0]  # the iterable processor reads [N, 3, msl] only
    assert "needs max_sequence_length" in errors(MAP, flat)[0]
    mnist = errors(MNIST, {"data_dir": str(tmp_path), "batch_size": 2})
    assert len(mnist) == 1 and "train-images-idx3-ubyte and " in mnist[0] and "MNIST/raw/" in mnist[0]
    (tmp_path / "MNIST" / "raw").mkdir(parents=True)
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"):
        (tmp_path / "MNIST" / "raw" / name).write_bytes(b"\0\0\x08\x01" + bytes(8))
    assert "not an IDX file with magic 2051" in errors(MNIST, {"data_dir": str(tmp_path), "batch_size": 2})[0]


def test_truncated_or_corrupt_gzip_is_a_data_error(tiny: Path, tmp_path: Path) -> None:
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for path in (tiny / "mnist_gz" / "MNIST" / "raw").glob("train-*.gz"):
        (raw / path.name).write_bytes(path.read_bytes())
    images = raw / "train-images-idx3-ubyte.gz"
    whole = images.read_bytes()
    for broken in (whole[:100], whole[:10] + bytes(len(whole) - 10), b"not gzip at all"):
        images.write_bytes(broken)
        (problem,) = errors(MNIST, {"data_dir": str(tmp_path), "batch_size": 2})
        assert f"{images}: not a readable gzip file" in problem


def test_check_data_reports_without_raising(
    tiny: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    assert check_data(GPT, gpt(tiny)) == []
    assert check_data(MNIST, {"data_dir": str(tiny / "mnist_gz"), "batch_size": 2}, split="val") == []
    notes = check_data(MAP, {"data_dir": [str(tiny / "gpt" / "val"), str(tmp_path / "x")], "batch_size": 2})
    assert len(notes) == 1 and notes[0].startswith("train_input.data_dir: ") and "x is not a directory" in notes[0]
    # One note, the list not repeated (issue 31). The note's length counts three of these paths: a short folder, not
    # tmp_path (the test's name, and popen-gwN/ under pytest-xdist), keeps the bound about the note, not the path.
    short = tmp_path_factory.mktemp("m")
    many = [str(short / f"missing{i}") for i in range(10)]
    (note,) = check_data(GPT, {**gpt(tiny), "data_dir": many})
    assert note.startswith(f"train_input.data_dir: {many[0]}, {many[1]}, {many[2]} and 7 more are not directories;")
    assert len(note) < 400
    with pytest.raises(ConfigError, match="unknown key"):
        check_data(GPT, gpt(tiny, shufle=True))


def test_missing_h5py_names_the_extra(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "h5py", None)
    with pytest.raises(MissingExtras, match=r"dls\[modelzoo\]"):
        build_loader(GPT, gpt(tiny), split="train", seed=0)


def test_cli_writes_tiny_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gpt", str(tmp_path / "g"), "--msl", "8", "--vocab", "32", "--train", "12", "--val", "4"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert h5py.File(tmp_path / "g" / "val" / "data_1.h5", "r")["data"].shape == (2, 3, 8)
    assert main(["gpt", str(tmp_path / "short"), "--msl", "1", "--train", "4", "--val", "2"]) == 0  # no padding
    assert main(["mnist", str(tmp_path / "m"), "--train", "10", "--val", "5", "--gzip"]) == 0
    assert read_idx(tmp_path / "m" / "MNIST" / "raw" / "train-labels-idx1-ubyte.gz", 2049).shape == (10,)
    for bad in (["--msl", "0"], ["--seed", "-1"]):  # a usage error (exit 2), not numpy's ValueError
        with pytest.raises(SystemExit, match="2"):
            main(["gpt", str(tmp_path / "g"), *bad])


def test_a_token_id_outside_the_models_vocabulary_is_refused_as_read(tiny: Path) -> None:
    for processor, params in ((MAP, {"data_dir": str(tiny / "corpus" / "train"), "max_sequence_length": 16}),
                              (GPT, {"data_dir": str(tiny / "gpt" / "train")})):  # fmt: skip
        loader = build_loader(processor, {**params, "batch_size": 8, "shuffle": False}, split="train", seed=0)
        loader.dataset.vocab = (64, "model.vocab_size")  # what fit_to_data sets: the data's ids are below 64
        loader.next()
        loader.dataset.vocab = (4, "model.vocab_size")
        with pytest.raises(ConfigError, match=r"model.vocab_size: 4, but the data holds token id \d+"):
            loader.next()
