"""dls inside the distributed machinery and a framework on one GPU: FSDP2 over NCCL, DCP, TRL (issue 37, item 3).

Runs with a plain ``python3`` that has torch (the GPU machine's); dls from ``src/`` beside this directory. On CUDA
with NCCL; on the CPU (``--quick``, scripts/gpu-check's dry run) the same code under gloo at tiny sizes. Sections
(``--sections``, default all):

1. ``fsdp2`` -- FSDP2 (``fully_shard`` per block and the root, ``MixedPrecisionPolicy(param_dtype=float16,
   reduce_dtype=float32)``) at world size 1, NCCL, a small MLP language model, AdamW, ``--steps`` steps with an
   overflow injected at step 3 (the loss times 1e8): the same run with ``dls.GradScaler`` and with
   ``torch.amp.GradScaler``. Checked: the injected step is skipped and leaves parameters and optimizer state
   bit-identical; dls's parameters and scale equal torch.amp's bitwise at the end (dls is its drop-in); host syncs
   per step (``torch.cuda.set_sync_debug_mode("warn")``, every step after the second but the injected one), over
   the whole step and over ``step`` + ``update`` alone.
2. ``dcp`` (run with ``fsdp2``) -- ``torch.distributed.checkpoint`` saves the dls run's model, optimizer (their
   ``get_state_dict``) and the scaler itself (a ``Stateful``) after step 4; a fresh run (other initial weights, a
   scaler built with another scale) loads it and trains the remaining steps: its parameters equal the
   uninterrupted run's bitwise and its scaler's ``state_dict()`` equals the uninterrupted scaler's.
3. ``trl`` -- TRL's ``SFTTrainer`` with ``fp16=True`` on a small GPT-2 (random initialisation, a word-level tokenizer
   built here, random sentences), ``dls.integrations.transformers.use_dls``, an overflow injected at step 3 (a
   gradient hook): skipped steps, LR-scheduler steps (they must be the applied steps), host syncs per step (a
   ``TrainerCallback`` around each step), the last logged loss; on CUDA beside the Trainer's own float16 scaler
   (Accelerate's ``torch.amp.GradScaler``). Needs ``trl`` and ``datasets``.

4. ``sharded`` -- the scale-out branch's own FSDP2 worker (``tests/_scale_worker.py``, its scenarios ``dropin`` and
   ``offload``) at world size 1 on this device: ``dls.ShardedGradScaler`` against torch's ``ShardedGradScaler`` on
   the same float16 run, with and without clipping (bitwise equal: parameters, optimizer state, scale trace), and
   the host reads per step of each with FSDP2's ``CPUOffloadPolicy`` at 2 and 6 layers.
5. ``torchtitan`` -- torchtitan's own trainer (``tests/_torchtitan_worker.py``: ``torchtitan.train.main`` with
   ``dls.integrations.torchtitan`` and the test harness's debug llama, 2 layers) at world size 1 in float16, with
   an overflow injected at one step: the compute dtype, the skipped steps (the injected one among them), the LR
   schedule on applied steps, and the host syncs per step between torchtitan's step log lines (the worker runs
   under ``--count-syncs``, which marks each sync in the output). On the CPU the harness's CPU workarounds apply.

Each section prints a numbered table; a check cell reads ``ok`` or ``MISS``. A section that cannot run (a package
missing) says so in one line and the others still run; the exit status is 1 when a section failed.

    python3 benchmarks/integrations_gpu.py                   # on CUDA: all sections (about 90 s, estimated)
    python3 benchmarks/integrations_gpu.py --quick           # the CPU, gloo, tiny sizes (seconds)
    python3 benchmarks/integrations_gpu.py --sections trl
    python3 benchmarks/integrations_gpu.py --count-syncs SCRIPT ARGS...   # SCRIPT's syncs marked in its output
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import runpy
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import _this_tree  # noqa: F401  (first: puts this tree's src/ on the path)
import torch
import torch.distributed as dist
from bench_scaler import print_table

import dls

SECTIONS = ("fsdp2", "trl", "sharded", "torchtitan")
SYNC_WARNING = "called a synchronizing CUDA operation"
OVERFLOW_STEP, SAVE_AFTER, OVERFLOW_FACTOR = 3, 4, 1e8


def check(ok: bool) -> str:
    return "ok" if ok else "MISS"


@contextlib.contextmanager
def sync_counter(device: torch.device) -> Iterator[list[str]]:
    """The host syncs inside the block (CUDA's sync debug mode); none on the CPU."""
    found: list[str] = []
    if device.type != "cuda":
        yield found
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    found.extend(str(w.message) for w in caught if SYNC_WARNING in str(w.message))


def median_text(values: list[int], device: torch.device) -> str:
    if device.type != "cuda":
        return "n/a"
    return f"{statistics.median(values):g}" if values else "-"


# ---------------------------------------------------------------------------------------------- 1, 2. FSDP2, DCP
class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class MLPLM(torch.nn.Module):
    """A language model of residual MLP blocks (no attention: the sharding, not the model, is under test)."""

    def __init__(self, vocab: int, width: int, depth: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def init_world(device: torch.device, folder: Path) -> str:
    """A process group of one rank: NCCL on CUDA, gloo on the CPU (a file store: no port to pick)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"file://{folder / 'store'}", rank=0, world_size=1, **kwargs)
    return backend


def sharded(vocab: int, width: int, depth: int, seed: int, device: torch.device) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(seed)
    model = MLPLM(vocab, width, depth).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters and optimizer state, full tensors, cloned."""
    out = [p.detach().full_tensor().clone() for p in model.parameters()]  # type: ignore[attr-defined]
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                full = value.full_tensor() if hasattr(value, "full_tensor") else value
                out.append(full.detach().clone())
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


class FSDPRun:
    """One FSDP2 training run; ``step(i)`` trains on batch ``i`` (the loss times 1e8 at ``OVERFLOW_STEP``)."""

    def __init__(self, kind: str, sizes: dict[str, int], seed: int, device: torch.device, init_scale: float) -> None:
        self.device = device
        self.model = sharded(sizes["vocab"], sizes["width"], sizes["depth"], seed, device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.scaler: Any = (
            dls.GradScaler(device.type, init_scale=init_scale)
            if kind == "dls"
            else torch.amp.GradScaler(device.type, init_scale=init_scale)
        )
        gen = torch.Generator().manual_seed(1234)
        count = sizes["steps"] + 1
        self.batches = torch.randint(sizes["vocab"], (count, sizes["batch"], sizes["seq"] + 1), generator=gen)
        self.whole: list[int] = []
        self.calls: list[int] = []

    def step(self, i: int, count_syncs: bool = False) -> None:
        tokens = self.batches[i].to(self.device)
        with sync_counter(self.device if count_syncs else torch.device("cpu")) as whole:
            logits = self.model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            if i == OVERFLOW_STEP:
                loss = loss * OVERFLOW_FACTOR
            self.scaler.scale(loss).backward()
            with sync_counter(self.device if count_syncs else torch.device("cpu")) as calls:
                self.scaler.step(self.opt)
                self.scaler.update()
            self.opt.zero_grad(set_to_none=True)
        if count_syncs:
            self.whole.append(len(whole) + len(calls))
            self.calls.append(len(calls))


def dcp_round_trip(
    kind_sizes: dict[str, int], reference: FSDPRun, folder: Path, device: torch.device, saved: Path
) -> list[list[str]]:
    """A fresh run loads the checkpoint saved after ``SAVE_AFTER`` and trains the remaining steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    fresh = FSDPRun("dls", kind_sizes, seed=7, device=device, init_scale=2.0**3)
    before = fresh.scaler.state_dict()
    model_sd, optim_sd = get_state_dict(fresh.model, fresh.opt)
    state = {"model": model_sd, "optim": optim_sd, "scaler": fresh.scaler}
    started = time.perf_counter()
    dcp.load(state, checkpoint_id=str(saved))
    set_state_dict(fresh.model, fresh.opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    load_s = time.perf_counter() - started
    loaded_scale = fresh.scaler.get_scale()
    for i in range(SAVE_AFTER + 1, kind_sizes["steps"] + 1):
        fresh.step(i)
    params_equal = same(snapshot(fresh.model, fresh.opt), snapshot(reference.model, reference.opt))
    state_equal = fresh.scaler.state_dict() == reference.scaler.state_dict()
    return [
        ["the scaler's scale loaded (not the fresh scaler's)", f"{loaded_scale:g} (fresh: {before['scale']:g})",
         check(loaded_scale != before["scale"])],
        ["parameters + optimizer state after resuming = the uninterrupted run's", "bitwise", check(params_equal)],
        ["scaler state_dict() after resuming = the uninterrupted run's", "equal", check(state_equal)],
        ["load (model, optimizer, scaler)", f"{load_s:.2f} s", "info"],
    ]  # fmt: skip


def section_fsdp2(device: torch.device, args: argparse.Namespace, folder: Path) -> bool:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    sizes = (
        {"vocab": 128, "width": 32, "depth": 2, "batch": 4, "seq": 16, "steps": 8}
        if args.quick
        else {"vocab": 8192, "width": 1024, "depth": 4, "batch": 16, "seq": 256, "steps": args.steps}
    )
    backend = init_world(device, folder)
    ok = True
    try:
        runs: dict[str, FSDPRun] = {}
        skipped_clean: dict[str, bool] = {}
        saved = folder / "checkpoint"
        save_s = math.nan
        for kind in ("dls", "torch.amp"):
            run = runs[kind] = FSDPRun(kind, sizes, seed=0, device=device, init_scale=2.0**16)
            for i in range(1, sizes["steps"] + 1):
                if i == OVERFLOW_STEP:
                    before = snapshot(run.model, run.opt)
                    run.step(i)
                    skipped_clean[kind] = same(before, snapshot(run.model, run.opt))
                else:
                    run.step(i, count_syncs=i > 2)
                if kind == "dls" and i == SAVE_AFTER:
                    model_sd, optim_sd = get_state_dict(run.model, run.opt)
                    started = time.perf_counter()
                    dcp.save({"model": model_sd, "optim": optim_sd, "scaler": run.scaler}, checkpoint_id=str(saved))
                    save_s = time.perf_counter() - started
        bitwise = same(snapshot(runs["dls"].model, runs["dls"].opt), snapshot(runs["torch.amp"].model,
                                                                             runs["torch.amp"].opt))  # fmt: skip
        scales = {kind: run.scaler.get_scale() for kind, run in runs.items()}
        rows = [
            [kind, backend, sizes["steps"], f"step {OVERFLOW_STEP}", check(skipped_clean[kind]),
             median_text(run.whole, device), median_text(run.calls, device), f"{scales[kind]:g}"]
            for kind, run in runs.items()
        ]  # fmt: skip
        params = sum(p.numel() for p in runs["dls"].model.parameters())
        print_table(
            f"1. FSDP2 at world size 1 ({backend}): float16 parameters, float32 reduction, {params / 1e6:.1f}M "
            "parameters, an overflow injected",
            ["scaler", "backend", "steps", "overflow", "skip bit-identical", "syncs/step", "syncs in step+update",
             "final scale"],
            rows,
        )  # fmt: skip
        same_as_torch = bitwise and scales["dls"] == scales["torch.amp"]
        print(f"   dls vs torch.amp at the end: parameters and optimizer state bitwise equal and the same scale: "
              f"{check(same_as_torch)}")  # fmt: skip
        ok = ok and same_as_torch and all(skipped_clean.values())
        dcp_rows = dcp_round_trip(sizes, runs["dls"], folder, device, saved)
        dcp_rows.insert(0, ["save after step " + str(SAVE_AFTER) + " (model, optimizer, scaler)", f"{save_s:.2f} s",
                            "info"])  # fmt: skip
        print_table(
            f"2. DCP ({backend}): the dls run saved after step {SAVE_AFTER}, loaded into a fresh run that trains on",
            ["what", "measured", "check"],
            dcp_rows,
        )
        ok = ok and all(row[2] != "MISS" for row in dcp_rows)
    finally:
        dist.destroy_process_group()
    return ok


# ---------------------------------------------------------------------------------------------- 3. TRL
def word_tokenizer(words: int) -> Any:
    """A word-level tokenizer of ``w0 .. w{words-1}`` plus [PAD], [EOS] and [UNK], built here (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2, **{f"w{i}": i + 3 for i in range(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")


def trl_run(use_dls: bool, device: torch.device, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    import datasets
    from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from dls.integrations.transformers import use_dls as hand_to_dls

    datasets.disable_progress_bars()
    words, length = (64, 16) if args.quick else (4096, 128)
    tokenizer = word_tokenizer(words)
    gen = torch.Generator().manual_seed(0)
    sentences = torch.randint(words, (64, length), generator=gen).tolist()
    data = datasets.Dataset.from_dict({"text": [" ".join(f"w{i}" for i in s) for s in sentences]})
    width, layers = (32, 2) if args.quick else (512, 4)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=length + 8, n_embd=width, n_layer=layers, n_head=4,
                        bos_token_id=1, eos_token_id=1, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    steps = 8 if args.quick else args.steps
    sft = SFTConfig(
        output_dir=str(folder / f"trl-{'dls' if use_dls else 'torch'}"),
        fp16=True,
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        max_length=length + 4,
        gradient_checkpointing=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        use_cpu=device.type == "cpu",
        optim="adamw_torch",
        seed=0,
    )
    trainer = SFTTrainer(model=model, args=sft, train_dataset=data, processing_class=tokenizer)
    trainer.remove_callback(PrinterCallback)  # the Trainer's print of every step's logs: the table says enough
    scaler = hand_to_dls(trainer) if use_dls else None
    syncs: list[int] = []

    class Syncs(TrainerCallback):  # type: ignore[misc]
        """Counts the host syncs of each step after the second, the injected one left out."""

        def __init__(self) -> None:
            self.counter: Any = None
            self.found: list[str] = []

        def on_step_begin(self, args_: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step + 1 > 2 and state.global_step + 1 != OVERFLOW_STEP:
                self.counter = sync_counter(device)
                self.found = self.counter.__enter__()

        def on_step_end(self, args_: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.counter is not None:
                self.counter.__exit__(None, None, None)
                syncs.append(len(self.found))
                self.counter = None

    trainer.add_callback(Syncs())
    parameter = next(p for p in trainer.model.parameters() if p.requires_grad)

    def overflow(grad: torch.Tensor) -> torch.Tensor:
        return grad * math.inf if trainer.state.global_step + 1 == OVERFLOW_STEP else grad

    parameter.register_hook(overflow)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {
        "scaler": "dls (use_dls)" if use_dls else f"the Trainer's own ({type(trainer.accelerator.scaler).__name__})",
        "steps": trainer.state.global_step,
        "skipped": scaler.get_num_skipped_steps() if scaler is not None else "-",
        "lr_steps": trainer.lr_scheduler.last_epoch if trainer.lr_scheduler is not None else "-",
        "syncs": median_text(syncs, device),
        "loss": f"{losses[-1]:.4f}" if losses else "-",
    }


def section_trl(device: torch.device, args: argparse.Namespace, folder: Path) -> bool:
    results = [trl_run(True, device, args, folder)]
    if device.type == "cuda":  # on the CPU, Accelerate drops fp16: there is no scaler of its own to compare
        results.append(trl_run(False, device, args, folder))
    rows = []
    for r in results:
        dls_row = r["scaler"].startswith("dls")
        applied = r["steps"] - (r["skipped"] if dls_row else 0)
        lr_right = check(r["lr_steps"] == applied) if dls_row else "info"
        skipped = check(r["skipped"] >= 1) if dls_row else "info"  # the injected one (and any of its own)
        rows.append([r["scaler"], r["steps"], r["skipped"], skipped, r["lr_steps"], lr_right, r["syncs"], r["loss"]])
    print_table(
        f"3. TRL SFTTrainer, fp16=True, an overflow injected at step {OVERFLOW_STEP} ({device.type})",
        ["scaler", "steps", "skipped", "overflow skipped", "LR steps", "= applied", "syncs/step", "last loss"],
        rows,
    )
    return all("MISS" not in row for row in rows)


# ---------------------------------------------------------------------------------------------- 4, 5. workers
TESTS = Path(__file__).resolve().parents[1] / "tests"
SYNC_MARK = "[dls-sync]"
STEP_LINE = re.compile(r"step:\s*(\d+)\s")  # torchtitan's log line of each step (its colours stripped first)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def count_syncs_and_run(script: str, argv: list[str]) -> None:
    """``--count-syncs``: run ``script`` as ``__main__`` with CUDA's sync debug mode on, each sync printed as one
    ``SYNC_MARK`` line on stderr (where torchtitan logs its steps too, so the two keep their order)."""
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("warn")
    warnings.filterwarnings("always", message=".*" + SYNC_WARNING)
    shown = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if SYNC_WARNING in str(message):
            print(SYNC_MARK, file=sys.stderr, flush=True)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def one_rank(
    script: Path, args: list[str], out: Path, device: torch.device, timeout: float, count: bool = False, **env: str
) -> tuple[dict[str, Any] | None, str]:
    """Run a worker of the test suite as the one rank of a world of one (the environment torchrun would give it,
    ``DLS_TEST_DEVICE`` this device): what it wrote to ``OUT/rank0.json`` (None if nothing) and its output."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [str(TESTS), str(TESTS.parent / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    rank_env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), DLS_TEST_DEVICE=device.type,
                    OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(paths), **env)  # fmt: skip
    cmd = [sys.executable, *([__file__, "--count-syncs"] if count else []), str(script), str(out), *args]
    try:
        done = subprocess.run(cmd, env=rank_env, capture_output=True, text=True, timeout=timeout)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as stopped:
        output, code = f"{stopped.stdout or ''}{stopped.stderr or ''}\ntimed out after {timeout:.0f} s", -1
    result = out / "rank0.json"
    if code != 0 or not result.is_file():
        print(f"   {script.name} exited {code}; its output's end:\n{output[-3000:]}")
        return None, output
    return json.loads(result.read_text()), output


def section_sharded(device: torch.device, args: argparse.Namespace, folder: Path) -> bool:
    result, _ = one_rank(TESTS / "_scale_worker.py", ["dropin", "offload"], folder / "out", device, timeout=240)
    if result is None:
        return False
    dropin, offload = result["dropin"], result["offload"]
    rows = []
    for suffix, what in (("", "step"), ("_clip", "unscale_ + clip_grad_norm_ + step")):
        ours, theirs = dropin[f"dls{suffix}"], dropin[f"torch{suffix}"]
        scales = [scale for scale, _ in ours["trace"]]
        rows.append([f"drop-in, {what}", f"{len(scales)} steps, {len(set(scales))} scales, final {scales[-1]:g}",
                     check(ours == theirs)])  # fmt: skip
    for layers in (2, 6):
        ours, theirs = offload[f"dls_{layers}"], offload[f"torch_{layers}"]
        reads = f"dls {max(ours['reads'])}, torch {max(theirs['reads'])} ({ours['tensors']} tensors)"
        rows.append([f"CPU offload, {layers} layers: host reads per step (most)", reads, "info"])
    grows = max(offload["dls_6"]["reads"]) > max(offload["dls_2"]["reads"])
    rows.append(["dls's host reads with CPU offload grow with the tensors", "no" if not grows else "yes",
                 check(not grows)])  # fmt: skip
    print_table(
        f"4. dls.ShardedGradScaler vs torch's ShardedGradScaler, FSDP2 float16 at world size 1 ({device.type}), "
        f"the scale-out worker ({result['seconds']['dropin']} s + {result['seconds']['offload']} s)",
        ["what", "measured", "check"],
        rows,
    )
    return all(row[2] != "MISS" for row in rows)


def syncs_per_step(output: str) -> dict[int, int]:
    """Per step of torchtitan's log (``step: N`` lines), the ``SYNC_MARK`` lines since the previous step's line."""
    syncs: dict[int, int] = {}
    pending = 0
    for line in output.splitlines():
        if SYNC_MARK in line:
            pending += 1
        elif (found := STEP_LINE.search(ANSI.sub("", line))) is not None:
            syncs[int(found.group(1))] = pending
            pending = 0
    return syncs


def section_torchtitan(device: torch.device, args: argparse.Namespace, folder: Path) -> bool:
    steps, poisoned = (5, 5) if args.quick else (10, 7)
    # The harness's float16 start (2**40) backs off by 2**-8 to a scale that trains within three steps.
    titan = ["--loss-scaling.backoff-factor", "0.00390625", "--loss-scaling.growth-interval", "3",
             "--training.steps", str(steps), "--dump-folder", str(folder / "dump")]  # fmt: skip
    env = {"DLS_TT_ASSETS": str(folder / "assets"), "DLS_TT_POISON": f"{poisoned}:0"}
    result, output = one_rank(TESTS / "_torchtitan_worker.py", titan, folder / "out", device, 300, True, **env)
    if result is None:
        return False
    records = {r["step"]: r for r in result["records"]}
    syncs = syncs_per_step(output)
    last = records[max(records)]
    applied = sum(r["changed"] for r in records.values())
    steady = [n for step, n in syncs.items() if step > 4 and step != poisoned and records.get(step, {}).get("changed")]
    dtype = result["compute_dtype"]
    rows = [
        ["compute dtype (FSDP's param_dtype)", dtype, check(dtype == "torch.float16")],
        ["steps; skipped (float16's own overflows and the injected one)", f"{len(records)}; {last['skipped']}",
         check(last["skipped"] >= 1)],
        [f"the injected overflow at step {poisoned}: skipped", str(not records[poisoned]["changed"]),
         check(not records[poisoned]["changed"])],
        ["LR-scheduler steps = applied steps", f"{last['last_epoch']} = {applied}",
         check(last["last_epoch"] == applied)],
        ["final scale", f"{last['scale']:g}", "info"],
        ["host syncs per trained step (torchtitan's logging included)", median_text(steady, device), "info"],
    ]  # fmt: skip
    print_table(
        f"5. torchtitan {importlib.metadata.version('torchtitan')}: its trainer, the debug llama in float16 with "
        f"dls, world size 1 ({device.type})",
        ["what", "measured", "check"],
        rows,
    )
    return all(row[2] != "MISS" for row in rows)


# ---------------------------------------------------------------------------------------------- main
NEEDS = {
    "fsdp2": ("torch.distributed.fsdp", "torch.distributed.checkpoint"),
    "trl": ("trl", "datasets"),
    "sharded": ("dls.sharded",),
    "torchtitan": ("torchtitan", "dls.integrations.torchtitan"),
}
RUNNERS: dict[str, Callable[[torch.device, argparse.Namespace, Path], bool]] = {
    "fsdp2": section_fsdp2,
    "trl": section_trl,
    "sharded": section_sharded,
    "torchtitan": section_torchtitan,
}


def missing(section: str) -> list[str]:
    """The modules a section needs that cannot be found (a dls module's parent package is imported to look)."""
    out = []
    for name in NEEDS[section]:
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:  # its parent package does not import
            found = False
        if not found:
            out.append(name)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--count-syncs"]:
        count_syncs_and_run(argv[1], argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--quick", action="store_true", help="tiny sizes, gloo on the CPU: a smoke run")
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (default 20; --quick: 8)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch.cuda.is_available() is False")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # NCCL's device_id names one device
    if args.steps <= SAVE_AFTER:
        raise SystemExit(f"--steps must be more than {SAVE_AFTER} (the checkpoint is saved after that step)")
    torch.set_num_threads(1 if device.type == "cpu" else torch.get_num_threads())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"integrations_gpu: torch {torch.__version__} on {where}")
    failed = []
    for section in args.sections:
        absent = missing(section)
        if absent:
            print(f"\n{section}: not run: {', '.join(absent)} not importable")
            failed.append(section)
            continue
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"dls-{section}-") as tmp:
            try:
                ok = RUNNERS[section](device, args, Path(tmp))
            except Exception:
                traceback.print_exc()
                print(f"{section}: FAILED: {traceback.format_exc().strip().splitlines()[-1][:200]}")
                ok = False
        print(f"   {section}: {time.monotonic() - started:.1f} s, {'ok' if ok else 'FAILED'}", flush=True)
        if not ok:
            failed.append(section)
    print(f"\nintegrations_gpu: {len(args.sections) - len(failed)} of {len(args.sections)} sections ok"
          + (f"; failed or not run: {', '.join(failed)}" if failed else ""))  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
