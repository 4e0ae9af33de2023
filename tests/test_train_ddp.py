"""``dls train`` under torchrun: data-parallel (DDP) on 2 CPU ranks (gloo, 127.0.0.1 only), with float16 parameters
and float32 master weights (gradients all-reduced in float16) and FP8 delayed scaling (amaxes all-reduced).

Two launches share one run directory: (A) a fresh run through the real command line, ``torchrun -m
dls.train.cli train``; (B) ``--resume`` of that run under torchrun, through this file as the worker script (see
``_worker``): it puts an inf into ONE rank's gradients after DDP reduced them (a rank-local overflow) on some
steps, then on every step, until the scale is pinned at ``min_loss_scale`` and training stops, and each rank
dumps its final state. Every launch has a deadline, so a hang fails instead of blocking the suite.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import yaml

HERE = Path(__file__).resolve()
WORLD = 2
STEPS = 12  # launch A
CONFIG: dict[str, Any] = {
    "model": {"name": "mlp", "hidden_size": 16, "depth": 2, "dropout": 0.1},
    # 16 batches per epoch, 8 per rank: launch A crosses into epoch 1.
    "data": {"batch_size": 16, "num_samples": 256, "input_dim": 8, "output_dim": 4},
    "precision": {
        "mixed_precision": True,
        "fp16_type": "float16",
        "half_params": True,
        "fp8": {"recipe": "delayed", "amax_history_len": 4},
        "log_underflow": True,
    },
    "optimizer": {
        "optimizer_type": "AdamW",
        "learning_rate": 1e-2,
        "loss_scaling_factor": "dynamic",
        "initial_loss_scale": 2.0**8,
        "min_loss_scale": 2.0**4,
        "max_loss_scale": 2.0**24,
        "steps_per_increase": 1000,  # the scale only moves when a step overflows
        "max_gradient_norm": 5.0,
    },
    "runconfig": {
        "max_steps": STEPS,
        "log_steps": 2,
        "checkpoint_steps": 4,
        "max_overflows_at_min_loss_scale": 2,
        "seed": 3,
    },
}
# Launch B (resumes at step 12): rank 1 overflows at 14, rank 0 at 16, rank 1 from 20 on. The scale halves on each
# (2^8 -> 2^7 -> 2^6 -> 2^5 -> 2^4 = min); steps 22 and 23 overflow at min_loss_scale: stop after step 23.
OVERFLOWS = {0: [16], 1: [14, *range(20, 40)]}
SKIPPED = [14, 16, 20, 21, 22, 23]
STOP_STEP = 23


# ---------------------------------------------------------------------- launching
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with contextlib.suppress(AttributeError, OSError, StopIteration):  # else gloo picks the host name's interface
        env["GLOO_SOCKET_IFNAME"] = next(name for _, name in socket.if_nameindex() if name.startswith("lo"))
    return env


def _torchrun(*args: str, timeout: float = 90) -> tuple[int, str]:
    """Run ``torchrun --nproc_per_node=2 ARGS``; its exit status and output (both ranks')."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={WORLD}",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        *args,
    ]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers
        output, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {timeout:.0f} s\n{output.decode(errors='replace')[-4000:]}")
    return proc.returncode, output.decode(errors="replace")


def _rows(model_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Launch A (fresh, 12 steps), then B (resumed from a copy of A, with overflows, stops at step 23)."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    root = tmp_path_factory.mktemp("ddp")
    config = root / "tiny.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    run_a = root / "a"
    code_a, out_a = _torchrun("-m", "dls.train.cli", "train", str(config), "-o", f"runconfig.model_dir={run_a}")
    assert code_a == 0, out_a[-4000:]
    run_b, dumps = root / "b", root / "dumps"
    shutil.copytree(run_a, run_b)
    dumps.mkdir()
    code_b, out_b = _torchrun(
        str(HERE), str(dumps), json.dumps(OVERFLOWS), "train", "--resume", str(run_b), "--no_progress",
        "-o", f"runconfig.model_dir={run_b}", "runconfig.max_steps=40",
    )  # fmt: skip
    ranks = [
        json.loads((dumps / f"rank{r}.json").read_text()) for r in range(WORLD) if (dumps / f"rank{r}.json").exists()
    ]
    assert len(ranks) == WORLD, out_b[-4000:]
    return {"a": run_a, "out_a": out_a, "b": run_b, "code_b": code_b, "out_b": out_b, "ranks": ranks}


# ---------------------------------------------------------------------- launch A: a plain run
def test_rank0_alone_writes_and_prints(runs: dict[str, Any]) -> None:
    run, out = runs["a"], runs["out_a"]
    assert [r["step"] for r in _rows(run)] == [1, 2, 4, 6, 8, 10, 12]  # once each: rank 1 wrote nothing
    assert sorted(p.name for p in run.iterdir()) == [
        "checkpoint_12.mdl", "checkpoint_4.mdl", "checkpoint_8.mdl", "config.yaml", "metrics.jsonl", "plots.png",
        "trace.jsonl",
    ]  # fmt: skip
    assert out.count("data-parallel on 2 ranks (cpu), global batch 2 x 16") == 1
    assert out.count(f"step {STEPS}/{STEPS}") == 1 and out.count("eval loss (float32)") == 1


def test_checkpoint_loads_in_a_single_process(runs: dict[str, Any], tmp_path: Path) -> None:
    from rich.console import Console

    from dls.train import Trainer
    from dls.train import checkpoint as ckpt
    from dls.train.config import parse_config

    saved = ckpt.load_checkpoint(runs["a"] / f"checkpoint_{STEPS}.mdl")
    assert saved["global_step"] == STEPS and saved["grad_scaler"]["loss_scale"] == 2.0**8
    assert all(v.dtype == torch.float16 for v in saved["model"].values())
    assert all(m.dtype == torch.float32 for m in saved["optimizer"]["master_weights"].values())
    assert saved["fp8"]["recipe"]["recipe"] == "delayed" and saved["fp8"]["modules"].keys() == {
        "net.0",
        "net.3",
        "net.6",
    }  # the Linear layers (dropout between)
    # 12 steps x 2 ranks = 24 of the 16-batch epochs' batches: epoch 1, 8 taken by the ranks together.
    assert saved["dataloader"] == {"epoch": 1, "position": 8, "seed": 3, "batch_size": 16, "world_size": 2}
    assert len(saved["rng_ranks"]) == WORLD
    assert not torch.equal(saved["rng_ranks"][0]["torch"], saved["rng_ranks"][1]["torch"])  # own dropout streams
    assert not any(k.startswith(("module.", "model.")) for k in saved["model"])  # the unwrapped model
    cfg = parse_config({**saved["config"], "runconfig": {**saved["config"]["runconfig"], "model_dir": str(tmp_path)}})
    trainer = Trainer(cfg, console=Console(file=io.StringIO()), progress=False, summary=False, plot=False)
    assert trainer.world_size == 1
    trainer.train(resume=runs["a"])  # max_steps reached: loads the state, trains nothing, saves it again
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, saved["model"][name]), name
    assert trainer.scaler.state_dict() == saved["grad_scaler"]
    assert (trainer.batches.epoch, trainer.batches.position) == (1, 8)  # the slot the two ranks reached
    assert trainer.fp8 is not None
    for name, roles in trainer.fp8.state_dict()["modules"].items():
        for role, entry in roles.items():
            assert torch.equal(entry["amax_history"], saved["fp8"]["modules"][name][role]["amax_history"]), role


# ---------------------------------------------------------------------- launch B: resume, overflows, stop
def test_rank_local_overflows_are_skipped_by_every_rank_and_all_stop_together(runs: dict[str, Any]) -> None:
    ranks, out = runs["ranks"], runs["out_b"]
    assert runs["code_b"] != 0, out[-4000:]  # exit status 1 on both ranks: training stopped
    assert [r["exit_status"] for r in ranks] == [1, 1], out[-4000:]
    assert out.count("dls: training stopped: Stopped at step 23: the loss scale is pinned at min_loss_scale") == 1
    for r in ranks:
        assert r["global_step"] == STOP_STEP and r["skipped_steps"] == SKIPPED
    first = ranks[0]
    assert first["scaler"]["num_skipped_steps"] == len(SKIPPED) and first["scaler"]["loss_scale"] == 2.0**4
    assert all(r["scaler"] == first["scaler"] for r in ranks)  # identical scaler state ...
    assert all(r["params"] == first["params"] for r in ranks)  # ... and bit-identical parameters on every rank
    assert all(r["fp8"] == first["fp8"] for r in ranks)  # FP8 histories agree: the amaxes are reduced over ranks
    from dls.train import checkpoint as ckpt

    saved = ckpt.load_checkpoint(runs["b"] / f"checkpoint_{STOP_STEP}.mdl")  # written before stopping
    assert saved["global_step"] == STOP_STEP and saved["grad_scaler"] == first["scaler"]
    digest = hashlib.sha256(b"".join(saved["model"][k].numpy().tobytes() for k in sorted(saved["model"])))
    assert digest.hexdigest() == first["params"]


def test_resumed_metrics_are_written_once_with_the_mean_loss_over_ranks(runs: dict[str, Any]) -> None:
    rows = [r for r in _rows(runs["b"]) if r["step"] > STEPS]
    assert [r["step"] for r in rows] == [14, 16, 18, 20, 21, 22, 23]  # log_steps 2, plus every skipped step
    assert [r["step"] for r in rows if r["skipped"]] == SKIPPED
    assert [r["step"] for r in _rows(runs["b"]) if r["step"] <= STEPS] == [1, 2, 4, 6, 8, 10, 12]  # A's, kept
    local = [r["losses"] for r in runs["ranks"]]  # per step of this session, each rank's own loss
    for row in rows:
        i = row["step"] - STEPS - 1
        assert local[0][i] != local[1][i]  # each rank trains on its own batches
        assert row["loss"] == pytest.approx((local[0][i] + local[1][i]) / 2, rel=1e-12)


# ---------------------------------------------------------------------- data sharding (in process)
def test_ranks_take_disjoint_strided_batches_and_the_state_moves_between_world_sizes() -> None:
    from dls.train.config import parse_config
    from dls.train.data import BatchIterator, build_dataset

    dataset = build_dataset(parse_config({"model": {"name": "mlp"}, "data": {"num_samples": 50, "batch_size": 8}}).data)
    single = BatchIterator(dataset, 8, True, seed=1)
    ranks = [BatchIterator(dataset, 8, True, seed=1, rank=r, world_size=2) for r in range(2)]
    order = [single.next()[0] for _ in range(6)]  # one epoch: 6 batches, 3 per rank
    for step in range(3):
        for r, it in enumerate(ranks):
            assert torch.equal(it.next()[0], order[2 * step + r])
    assert ranks[0].state_dict() == {"epoch": 0, "position": 6, "seed": 1, "batch_size": 8, "world_size": 2}
    one = BatchIterator(dataset, 8, True, seed=1)
    one.load_state_dict({"epoch": 0, "position": 3, "seed": 1, "batch_size": 8})
    two = BatchIterator(dataset, 8, True, seed=1, rank=1, world_size=2)
    two.load_state_dict(one.state_dict())  # 3 batches taken: rank 1 goes on at slot 2 * 2 + 1
    assert two.position == 2 and torch.equal(two.next()[0], order[5])
    with pytest.raises(ValueError, match="per rank"):
        BatchIterator(dataset, 8, True, seed=1, world_size=7)


# ---------------------------------------------------------------------- the worker (launch B)
def _worker(argv: list[str]) -> int:
    """One rank of launch B: ``python test_train_ddp.py DUMP_DIR OVERFLOWS_JSON DLS_ARGS...`` under torchrun.

    Runs ``dls train`` (``dls.train.cli.main``) with patches: an inf goes into this rank's first model gradient
    after DDP reduced it (before the scaler's overflow check) on the steps ``OVERFLOWS_JSON`` lists for it; each step's
    rank-local loss is recorded as the trainer hands it to ``dls.optimizer_step``; and before the trainer closes, it
    dumps its global step, skipped steps, scaler state, own losses and a parameter digest.
    """
    import dls
    from dls.train import cli
    from dls.train.trainer import Trainer

    dump_dir, overflows, args = Path(argv[0]), json.loads(argv[1]), argv[2:]
    rank = int(os.environ["RANK"])
    mine = set(overflows.get(str(rank), []))
    current: dict[str, Any] = {"step": 0, "skipped": [], "losses": []}
    result: dict[str, Any] = {}

    original_step, original_close = Trainer._step, Trainer.close
    original_check, original_optimizer_step = dls.GradScaler.clip_gradients_and_return_isfinite, dls.optimizer_step

    def step(self: Trainer, *a: Any, **k: Any) -> Any:
        current["step"], current["model"] = self.global_step + 1, self.model
        try:
            return original_step(self, *a, **k)
        finally:  # also a step that stops the run (its floor check is part of the step)
            if self.scaler.step_was_skipped(self.optimizer):
                current["skipped"].append(self.global_step)

    def check(self: Any, optimizers: Any, **kwargs: Any) -> Any:
        if current["step"] in mine:  # the model's (float16) gradient, which the master gradients are taken from
            grad = next(p.grad for p in current["model"].parameters() if p.grad is not None)
            grad.view(-1)[0] = float("inf")
        return original_check(self, optimizers, **kwargs)

    def optimizer_step(loss: torch.Tensor, *a: Any, **k: Any) -> Any:
        current["losses"].append(float(loss.detach()))
        return original_optimizer_step(loss, *a, **k)

    def close(self: Trainer) -> None:
        state = self.model.state_dict()
        digest = hashlib.sha256(b"".join(state[k].detach().cpu().numpy().tobytes() for k in sorted(state)))
        assert self.fp8 is not None
        fp8 = self.fp8.state_dict()["modules"]
        fp8_digest = hashlib.sha256(
            b"".join(
                fp8[m][r][k].numpy().tobytes() for m in sorted(fp8) for r in sorted(fp8[m]) for k in sorted(fp8[m][r])
            )
        )
        result.update(
            global_step=self.global_step,
            skipped_steps=current["skipped"],
            scaler=self.scaler.state_dict(),
            losses=current["losses"],
            params=digest.hexdigest(),
            fp8=fp8_digest.hexdigest(),
        )
        original_close(self)

    Trainer._step = step  # type: ignore[method-assign]
    dls.GradScaler.clip_gradients_and_return_isfinite = check  # type: ignore[method-assign]
    dls.optimizer_step = optimizer_step
    Trainer.close = close  # type: ignore[method-assign]
    status = cli.main(args)
    (dump_dir / f"rank{rank}.json").write_text(json.dumps({**result, "exit_status": status}))
    return status


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
