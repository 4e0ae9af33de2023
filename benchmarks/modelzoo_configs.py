"""Every config of the Model Zoo models dls claims (fc_mnist, gpt2, gpt3, llama), copied unchanged from public Cerebras
Model Zoo releases, run through ``dls train`` as a user would: shrunk only by ``-o`` overrides, on tiny data written by
``dls data``. Prints one line per config and the counts: trained (exit 0), refused in one line (exit 2, one ``dls:``
line) or in several (exit 2, a list of problems), and anything else (another exit status, a traceback), which the
trainer must never do.

The configs come from a clone of https://github.com/Cerebras/modelzoo (its release tags), read with ``git show`` so
that nothing in the clone changes:

    git clone https://github.com/Cerebras/modelzoo /tmp/modelzoo
    python benchmarks/modelzoo_configs.py --repo /tmp/modelzoo              # all 100 (about 15 minutes on 2 cores)
    python benchmarks/modelzoo_configs.py --repo /tmp/modelzoo -k mup       # those whose name holds "mup"

The set (issue 31): every config of the claimed models at Release 2.10.0 (42) and Release 2.3.1 (55, the last with
gpt2 and the legacy layout), plus three older ones (Release 1.8.0's gpt2_small_ws, which repeats a key, and Release
1.9.1's fc_mnist and Llama 7B). The shrink: 2 blocks of width 64 (4 heads, 2 key/value heads where the config groups
them), filter 128, vocabulary 512, 64 positions (32 before Llama 3's position scaling); batches of 4; 2 steps
(evaluation, where configured, over 2 batches); one torch thread. Keys the config does not write are not added,
except the model's name where a config names none (Model Zoo picks the model by the run.py of its directory)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

RELEASES = {
    "Release_2.10.0": r"^src/cerebras/modelzoo/models/(nlp/(gpt2|gpt3|llama)|vision/fc_mnist)/configs/.*\.yaml$",
    "Release_2.3.1": r"^src/cerebras/modelzoo/(models/nlp/(gpt2|gpt3|llama)|fc_mnist/pytorch)/configs/.*\.yaml$",
}
OLDER = {
    "Release_1.8.0": ["modelzoo/transformers/pytorch/gpt2/configs/params_gpt2_small_ws.yaml"],
    "Release_1.9.1": [
        "modelzoo/fc_mnist/pytorch/configs/params.yaml",
        "modelzoo/transformers/pytorch/llama/configs/params_llama_7b.yaml",
    ],
}
FAMILIES = ("gpt2", "gpt3", "llama", "fc_mnist")
MSL, VOCAB = 32, 512


def configs(repo: Path) -> list[tuple[str, str]]:
    """``(tag, path)`` of every config of the set, in a fixed order."""
    found = []
    for tag, pattern in RELEASES.items():
        names = subprocess.run(
            ["git", "-C", str(repo), "ls-tree", "-r", "--name-only", tag], capture_output=True, text=True, check=True
        ).stdout.split()
        found += [(tag, n) for n in sorted(names) if re.match(pattern, n)]
    return found + [(tag, path) for tag, paths in OLDER.items() for path in paths]


def family(path: str) -> str:
    return next(f for f in FAMILIES if f"/{f}/" in path)


def shrink(raw: dict[str, Any], name: str, data: Path, model_dir: Path) -> list[str]:
    """The ``-o`` overrides that shrink ``raw`` (a config of model ``name``) to a tiny run on ``data``, written into
    ``model_dir``."""
    current = "trainer" in raw
    init = raw["trainer"].get("init", {}) if current else raw
    model = init.get("model") or {}
    out: list[str] = []
    at = "trainer.init.model" if current else "model"
    if "name" not in model:  # as Model Zoo's run.py of the model's directory picks it
        out.append(f"{at}.name={name}")
    if name != "fc_mnist":
        heads = 4
        groups = (model.get("extra_attention_params") or {}).get("num_kv_groups")
        sizes = {
            "hidden_size": 64, "num_hidden_layers": 2, "num_heads": heads, "filter_size": 128,
            "vocab_size": VOCAB, "max_position_embeddings": 2 * MSL,
        }  # fmt: skip
        out += [f"{at}.{k}={v}" for k, v in sizes.items()]
        if groups is not None:
            out.append(f"{at}.extra_attention_params.num_kv_groups=2")
        if "rotary_dim" in model:
            out.append(f"{at}.rotary_dim={64 // heads}")
        if "original_max_position_embeddings" in (model.get("pos_scaling_extra_args") or {}):
            out.append(f"{at}.pos_scaling_extra_args.original_max_position_embeddings={MSL}")
    loaders = (
        [("trainer.fit.train_dataloader", raw["trainer"].get("fit", {}).get("train_dataloader"), "train"),
         ("trainer.fit.val_dataloader", raw["trainer"].get("fit", {}).get("val_dataloader"), "val")]
        if current else [("train_input", raw.get("train_input"), "train"), ("eval_input", raw.get("eval_input"), "val")]
    )  # fmt: skip
    for where, section, split in loaders:
        if not isinstance(section, dict):
            continue
        directory = data / "mnist" if name == "fc_mnist" else data / "gpt" / split
        out += [f"{where}.data_dir={directory}", f"{where}.batch_size=4"]
        if "max_sequence_length" in section:
            out.append(f"{where}.max_sequence_length={MSL}")
    if current:
        loop = init.get("loop") or {}
        out += ["trainer.init.loop.max_steps=2", f"trainer.init.model_dir={model_dir}"]
        out += ["trainer.init.loop.eval_steps=2"] * ("eval_steps" in loop)
        out += ["trainer.init.loop.num_steps=2"] * ("num_steps" in loop)
        out += ["trainer.init.num_threads=1"]
    else:
        run = raw.get("runconfig") or {}
        out += ["runconfig.max_steps=2", f"runconfig.model_dir={model_dir}", "runconfig.num_threads=1"]
        out += ["runconfig.eval_steps=2"] * ("eval_steps" in run)
        out += ["runconfig.num_steps=2"] * ("num_steps" in run)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, required=True, help="a git clone of Cerebras/modelzoo (with its tags)")
    parser.add_argument("-k", default="", help="only configs whose tag:path contains this text")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    args = parser.parse_args()
    counts = {"trained": 0, "refused": 0, "several": 0, "other": 0}
    with tempfile.TemporaryDirectory(prefix="dls-zoo-") as scratch:
        root = Path(scratch)
        dls = [sys.executable, "-m", "dls_entry"]
        for kind, extra in (("mnist", []), ("gpt", ["--msl", str(MSL), "--vocab", str(VOCAB)])):
            command = [*dls, "data", kind, str(root / "data" / kind), "--train", "256", "--val", "64", *extra]
            subprocess.run(command, check=True, capture_output=True)
        todo = [(t, p) for t, p in configs(args.repo) if args.k in f"{t}:{p}"]
        for i, (tag, path) in enumerate(todo, 1):
            text = subprocess.run(
                ["git", "-C", str(args.repo), "show", f"{tag}:{path}"], capture_output=True, text=True, check=True
            ).stdout
            work = root / f"cfg{i}"
            work.mkdir()
            (work / "params.yaml").write_text(text)
            try:
                raw = yaml.safe_load(text)  # PyYAML's loader, which takes a repeated key's last value
                overrides = shrink(raw, family(path), root / "data", work / "run")
            except Exception as exc:  # a config this script cannot shrink: said, counted as other
                print(f"{i:3} other    {tag}:{path}: cannot shrink ({exc})")
                counts["other"] += 1
                continue
            start = time.perf_counter()
            try:
                done = subprocess.run(
                    [*dls, "train", str(work / "params.yaml"), "--no_progress", "-o", *overrides],
                    capture_output=True, text=True, timeout=args.timeout, cwd=work,
                )  # fmt: skip
                status, err = done.returncode, done.stderr.strip().splitlines()
            except subprocess.TimeoutExpired:
                status, err = None, [f"timed out after {args.timeout:g} s"]
            lines = [line for line in err if line.strip()]
            if status == 0:
                kind = "trained"
            elif status == 2 and lines and lines[0].startswith("dls: ") and "Traceback" not in done.stderr:
                kind = "refused" if len(lines) == 1 else "several"
            else:
                kind = "other"
            counts[kind] += 1
            said = "" if kind == "trained" else f"  [exit {status}] {' | '.join(lines)[:400]}"
            print(f"{i:3} {kind:<8} {tag}:{path} ({time.perf_counter() - start:.0f} s){said}", flush=True)
    total = sum(counts.values())
    print(f"\n{total} configs: {counts['trained']} trained, {counts['refused']} refused in one line (exit 2), "
          f"{counts['several']} refused in several lines (exit 2), {counts['other']} other (another exit status, a "
          "timeout or a traceback)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
