"""The shipped examples in configs/modelzoo: the data command of each header writes what its loaders read, and its
model builds and computes a finite loss on that data."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import pytest
import transformers
import yaml

from dls.train.modelzoo import build_loader, build_model, main, parse_loader, parse_model

# transformers loads its model classes on first use: at collection, not inside the first test
assert transformers.GPT2LMHeadModel and transformers.LlamaForCausalLM

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs" / "modelzoo").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_example_builds_on_the_data_its_header_writes(path: Path, tmp_path: Path) -> None:
    text = path.read_text()
    commands = [line.split("#", 1)[1].strip() for line in text.splitlines() if line.startswith("#   dls data ")]
    assert len(commands) == 1, "the header names one command writing the data"
    argv = [arg.replace("./data", str(tmp_path)) for arg in shlex.split(commands[0])[2:]]
    assert main([*argv, "--train", "128", "--val", "64"]) == 0
    cfg = yaml.safe_load(text)
    if "trainer" in cfg:
        model, fit = cfg["trainer"]["init"]["model"], cfg["trainer"]["fit"]
        loaders = {"train": fit["train_dataloader"], "val": fit["val_dataloader"]}
    else:
        model, loaders = cfg["model"], {"train": cfg["train_input"], "val": cfg["eval_input"]}
    net = build_model(model["name"], model)
    for split, section in loaders.items():
        section = {**section, "data_dir": section["data_dir"].replace("./data", str(tmp_path))}
        batches = build_loader(section["data_processor"], section, split=split, seed=1)
        prefix = f"{'train' if split == 'train' else 'eval'}_input"
        assert set(parse_loader(section["data_processor"], section, prefix)[1]) <= {
            f"{prefix}.{key}" for key in ("num_workers", "prefetch_factor", "persistent_workers", "to_float16")
        }
        assert math.isfinite(float(net.loss(batches.next()).detach()))
    assert parse_model(model["name"], model)[1] == []
