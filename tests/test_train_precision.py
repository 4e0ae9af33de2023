"""precision.half_params (half-precision parameters with float32 master weights) and precision.fp8 (FP8 Linear
layers) in the trainer: what the model and optimizer are, checkpoints, bit-identical resume, old checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import dls
from dls.train import checkpoint as ckpt
from dls.train.trainer import Trainer
from test_train import assert_bit_identical, make_trainer, metrics, state_of, tiny


def split_and_straight(tmp_path: Path, raw: dict[str, Any], split: int = 6) -> tuple[Trainer, Trainer, str]:
    """The run of ``raw`` straight through, and the same run stopped at ``split`` and resumed in a new Trainer;
    the resumed trainer's log."""
    raw["runconfig"]["model_dir"] = str(tmp_path / "straight")
    straight = make_trainer(raw)[0]
    straight.train()
    steps = raw["runconfig"]["max_steps"]
    raw["runconfig"].update(model_dir=str(tmp_path / "split"), max_steps=split)
    make_trainer(raw)[0].train()
    raw["runconfig"]["max_steps"] = steps
    second, log = make_trainer(raw)
    second.train(resume=tmp_path / "split")
    return straight, second, log.getvalue()


# ---------------------------------------------------------------------- half-precision parameters
@pytest.mark.parametrize("fp16_type", ["float16", "bfloat16"])
def test_half_params_resume_bit_identically_with_their_masters(tmp_path: Path, fp16_type: str) -> None:
    raw = tiny(tmp_path, precision={"fp16_type": fp16_type, "half_params": True})
    if fp16_type == "bfloat16":  # no loss scaling: the dynamic keys would be ignored (and warned about)
        for key in ("loss_scaling_factor", "initial_loss_scale", "max_loss_scale", "steps_per_increase"):
            raw["optimizer"].pop(key)
    straight, second, _ = split_and_straight(tmp_path, raw)
    dtype = getattr(torch, fp16_type)
    assert all(p.dtype == dtype for p in second.model.parameters())
    assert isinstance(second.optimizer, dls.MasterWeights)
    saved = ckpt.load_checkpoint(tmp_path / "straight" / "checkpoint_12.mdl")
    masters = saved["optimizer"]["master_weights"]
    assert masters and all(m.dtype == torch.float32 for m in masters.values())
    assert all(p.dtype == dtype for p in saved["model"].values())
    assert_bit_identical(state_of(straight), state_of(second))
    for p in second.model.parameters():  # the model holds its masters, rounded
        assert torch.equal(p, second.optimizer.master_of(p).to(dtype))
    assert metrics(tmp_path / "straight")[-1]["loss"] == metrics(tmp_path / "split")[-1]["loss"]


def test_masters_keep_updates_that_half_parameters_round_away(tmp_path: Path) -> None:
    """SGD steps far below float16's resolution of the weights: with masters the weights move as far as in
    float32 (within 10%), the bare float16 parameters less than half as far (most updates round away)."""
    moved = {}
    for name, precision in (
        ("float32", {"mixed_precision": False}),
        ("masters", {"half_params": True}),
        ("bare", {"half_params": True, "master_weights": False}),
    ):
        raw = tiny(
            tmp_path / name,
            model={"dropout": 0.0},
            precision=precision,
            runconfig={"max_steps": 12, "checkpoint_steps": 0},
        )
        if name == "float32":
            raw["precision"].pop("fp16_type")
        raw["optimizer"] = {"optimizer_type": "SGD", "learning_rate": 2e-5}
        if name != "float32":
            raw["optimizer"]["loss_scaling_factor"] = 1024.0
        trainer = make_trainer(raw)[0]
        before = [p.detach().float().clone() for p in trainer.model.parameters()]
        trainer.train()
        after = [p.detach().float() for p in trainer.model.parameters()]
        if name == "masters":  # the float32 values the optimizer steps (the model holds them rounded)
            after = [trainer.optimizer.master_of(p).detach() for p in trainer.model.parameters()]
        moved[name] = sum(float((a - b).norm() ** 2) for a, b in zip(after, before)) ** 0.5
    assert 0.9 < moved["masters"] / moved["float32"] < 1.1, moved
    assert moved["bare"] < 0.5 * moved["float32"], moved


def test_cbfloat16_parameters_stay_on_its_grid(tmp_path: Path) -> None:
    raw = tiny(tmp_path / "run", precision={"fp16_type": "cbfloat16", "half_params": True}, runconfig={"max_steps": 3})
    trainer = make_trainer(raw)[0]
    trainer.train()
    grid = dls.formats.get("cbfloat16")
    for p in trainer.model.parameters():
        assert p.dtype == torch.float32 and torch.equal(grid.quantize(p.detach()), p.detach())


def test_a_run_without_loss_scaling_guards_the_model_gradients_under_masters(tmp_path: Path) -> None:
    """bfloat16 half parameters without loss scaling: the inf/NaN guard reads the model's gradients (on a step that
    is not logged nothing has copied them into the masters before the optimizer's step), so an inf is refused
    before it reaches the weights."""
    from dls.train import TrainingStopped

    raw = tiny(tmp_path / "run", precision={"fp16_type": "bfloat16", "half_params": True}, runconfig={"log_steps": 100})
    raw["optimizer"] = {"learning_rate": 1e-3}
    trainer = make_trainer(raw)[0]
    param = next(trainer.model.parameters())
    param.register_post_accumulate_grad_hook(
        lambda p: p.grad.view(-1).__setitem__(0, float("inf")) if trainer.global_step == 1 else None
    )
    with pytest.raises(TrainingStopped, match="at step 2: the gradients are inf/NaN"):
        trainer.train()
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


# ---------------------------------------------------------------------- FP8
def fp8_config(tmp_path: Path, recipe: dict[str, Any], **changes: Any) -> dict[str, Any]:
    raw = tiny(tmp_path, precision={"mixed_precision": False, "fp8": recipe}, **changes)
    raw["precision"].pop("fp16_type")
    for key in ("loss_scaling_factor", "initial_loss_scale", "max_loss_scale", "steps_per_increase"):
        raw["optimizer"].pop(key)  # float32 around the FP8 layers: no loss scaling
    return raw


def test_fp8_delayed_scaling_resumes_bit_identically(tmp_path: Path) -> None:
    raw = fp8_config(tmp_path, {"recipe": "delayed", "amax_history_len": 4})
    straight, second, _ = split_and_straight(tmp_path, raw)
    assert straight.fp8 is not None and second.fp8 is not None and not second.fp8.active  # removed after training
    assert_bit_identical(state_of(straight), state_of(second))
    assert_bit_identical(straight.fp8.state_dict(), second.fp8.state_dict())
    saved = ckpt.load_checkpoint(tmp_path / "split" / "checkpoint_6.mdl")
    history = saved["fp8"]["modules"]["net.0"]["grad_output"]["amax_history"]
    assert history.shape == (4,) and bool((history > 0).all())  # four steps recorded by step 6
    rows = metrics(tmp_path / "straight")
    assert all(0.0 <= r["fp8_grad_output_flushed"] <= 1.0 and "fp8_grad_output_saturated" in r for r in rows)


def test_a_checkpoint_without_fp8_state_loads_and_says_so(tmp_path: Path) -> None:
    plain = fp8_config(tmp_path / "plain", None, runconfig={"max_steps": 3})  # type: ignore[arg-type]
    plain["precision"].pop("fp8")
    make_trainer(plain)[0].train()
    assert "fp8" not in ckpt.load_checkpoint(tmp_path / "plain" / "checkpoint_3.mdl")
    raw = fp8_config(tmp_path / "fork", {"recipe": "delayed"}, runconfig={"max_steps": 5})
    trainer, log = make_trainer(raw)
    trainer.train(resume=tmp_path / "plain")
    assert "has no fp8 state (a run without precision.fp8 wrote it); FP8 scaling starts fresh" in log.getvalue()
    assert trainer.global_step == 5
    other = fp8_config(tmp_path / "other", {"recipe": "current"}, runconfig={"max_steps": 6})
    switched, log = make_trainer(other)
    switched.train(resume=tmp_path / "fork")
    assert "the config's recipe CurrentScaling(" in log.getvalue() and "starts fresh" in log.getvalue()


def test_per_tensor_scaling_keeps_the_gradients_that_scale_1_flushes(tmp_path: Path) -> None:
    """A loss weight of 1e-4 puts the gradients below E5M2's smallest subnormal (2^-16): cast as they are, they all
    flush to zero; scaled per tensor, none do."""
    flushed = {}
    for name in ("static", "current"):
        raw = fp8_config(tmp_path / name, {"recipe": name}, model={"loss_weight": 1e-4}, runconfig={"max_steps": 2})
        flushed[name] = make_trainer(raw)[0].train().fp8_flushed
    assert flushed["static"] is not None and flushed["static"] > 0.99
    assert flushed["current"] is not None and flushed["current"] < 0.01


# ---------------------------------------------------------------------- Model Zoo's semantics per backend (issue 31)
ZOO = Path(__file__).resolve().parent / "data" / "modelzoo"
GPT3 = ZOO / "gpt3_cerebras_gpt_111m.yaml"  # Release 2.10.0: bfloat16, loss_scaling_factor unset (1.0)
FLOAT16 = ["trainer.init.precision.fp16_type=float16"]


def test_bfloat16_trains_without_loss_scaling_as_model_zoo_unless_forced() -> None:
    from dls.train.config import load_config, loss_scaling_mode, parse_config, scaler_settings

    path = ZOO / "llama3p3_70b_msl_128k.yaml"  # Release 2.10.0: bfloat16 with loss_scaling_factor: dynamic
    cfg = load_config(path)
    assert cfg.precision.compute_dtype == "bfloat16" and loss_scaling_mode(cfg) == "off"
    (note,) = [n for n in cfg.notes if "no loss scaling" in n]
    assert note.startswith("trainer.init.precision.fp16_type bfloat16: no loss scaling, as Model Zoo trains bfloat16")
    assert "trainer.init.precision.loss_scaling_factor" in note and "force_loss_scaling: true" in note
    forced = load_config(path, ["trainer.init.precision.force_loss_scaling=true"])
    assert loss_scaling_mode(forced) == "dynamic" and scaler_settings(forced).half_dtype == "bfloat16"
    assert not any("no loss scaling" in n for n in load_config(GPT3).notes)  # the default 1.0: nothing unused
    own = parse_config({"model": {"name": "mlp"}, "precision": {"mixed_precision": True, "fp16_type": "bfloat16"},
                        "optimizer": {"loss_scaling_factor": "dynamic"}})  # fmt: skip
    assert loss_scaling_mode(own) == "dynamic"  # dls's own layout: as written


def test_gpu_backend_is_torch_amps_rule_as_model_zoos_gpu_path_builds_it() -> None:
    from dls.checks import FLOAT32_MAX, FLOAT32_TINY
    from dls.settings import ScalerSettings
    from dls.train.config import GPU_NEVER, load_config, scaler_settings

    gpu = [*FLOAT16, "trainer.init.backend.backend_type=GPU"]
    dynamic = load_config(GPT3, [*gpu, "trainer.init.precision.loss_scaling_factor=dynamic",
                                 "trainer.init.precision.steps_per_increase=7",
                                 "trainer.init.precision.max_loss_scale=1024"])  # fmt: skip
    assert dynamic.runconfig.device == "cuda" and dynamic.runconfig.backend == "GPU"
    s = scaler_settings(dynamic)
    assert s == ScalerSettings.torch(init_scale=65536.0, growth_interval=7, half_dtype="float16", max_gradient_norm=1.0)
    assert (s.init_scale, s.growth_interval, s.min_loss_scale, s.max_loss_scale) == (
        2.0**16,
        7,
        FLOAT32_TINY,
        FLOAT32_MAX,
    )
    assert any(n.startswith("trainer.init.precision.max_loss_scale not used: trainer.init.backend.backend_type GPU")
               for n in dynamic.notes)  # fmt: skip
    started = load_config(GPT3, [*gpu, "trainer.init.precision.loss_scaling_factor=dynamic",
                                 "trainer.init.precision.initial_loss_scale=8"])  # fmt: skip
    assert scaler_settings(started).init_scale == 8.0
    static = load_config(GPT3, gpu)  # Model Zoo's default loss_scaling_factor 1.0
    s = scaler_settings(static)
    assert (s.mode, s.init_scale, s.growth_interval, s.dialect) == ("dynamic", 1.0, GPU_NEVER, "torch")
    assert any("it backs off on overflow and never grows" in n for n in static.notes)
    csx = scaler_settings(load_config(GPT3, [*FLOAT16, "trainer.init.precision.loss_scaling_factor=dynamic"]))
    assert (csx.dialect, csx.init_scale, csx.max_loss_scale) == ("cerebras", 2.0**15, 2.0**15)  # cstorch.amp's


@pytest.mark.parametrize("static", [False, True])
def test_the_gpu_rule_follows_torch_amp_step_by_step(static: bool) -> None:
    """dls's scaler from the GPU settings and torch.amp.GradScaler as Model Zoo's GPU path builds it (a static factor:
    ``growth_interval=2**63 - 1``), on the same gradients with overflows: the same scale after every step."""
    from dls.train.config import load_config, scaler_settings

    overrides = [*FLOAT16, "trainer.init.backend.backend_type=GPU"]
    overrides += [] if static else ["trainer.init.precision.loss_scaling_factor=dynamic",
                                    "trainer.init.precision.steps_per_increase=3"]  # fmt: skip
    settings = scaler_settings(load_config(GPT3, overrides))
    ours = dls.GradScaler.from_settings(settings, device="cpu")
    theirs = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=2**63 - 1) if static else (
        torch.amp.GradScaler("cpu", init_scale=65536.0, growth_interval=3)
    )  # fmt: skip
    models = [torch.nn.Linear(4, 1) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in models]
    overflows = {2, 3, 9, 10, 11, 20}
    for step in range(30):
        for model, opt, scaler in zip(models, optimizers, (ours, theirs)):
            loss = model(torch.ones(2, 4)).sum() * (float("inf") if step in overflows else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert ours.get_scale() == theirs.get_scale(), step
    assert ours.get_scale() == (2.0**-6 if static else theirs.get_scale())


def test_a_static_gpu_scale_never_grows_within_the_runs_dls_allows(tmp_path: Path, monkeypatch: Any) -> None:
    from dls.train.config import GPU_NEVER

    raw = tiny(tmp_path / "run", runconfig={"backend": "GPU", "max_steps": GPU_NEVER})
    raw["optimizer"] = {"loss_scaling_factor": 4.0}
    monkeypatch.setattr("dls.train.trainer.resolve_device", lambda device: torch.device("cpu"))  # no GPU here
    with pytest.raises(ValueError, match=f"runconfig.max_steps must be below {GPU_NEVER:,} with backend_type GPU"):
        make_trainer(raw)
    raw["runconfig"]["max_steps"] = 3
    trainer = make_trainer(raw)[0]
    assert trainer.scaler.get_scale() == 4.0 and trainer.scaler.settings.growth_interval == GPU_NEVER


def test_cpu_backend_follows_csx_numerics_with_one_note() -> None:
    from dls.train.config import load_config, scaler_settings

    cfg = load_config(GPT3, [*FLOAT16, "trainer.init.backend.backend_type=CPU",
                             "trainer.init.precision.loss_scaling_factor=dynamic"])  # fmt: skip
    (note,) = [n for n in cfg.notes if "backend_type CPU" in n]
    assert note == (
        "trainer.init.backend.backend_type CPU: the run computes float16 with cstorch.amp's loss scaling, as on "
        "CSX; Model Zoo's own CPU path would compute in bfloat16 without loss scaling"
    )
    assert scaler_settings(cfg).dialect == "cerebras" and cfg.runconfig.device == "cpu"


@pytest.mark.parametrize(
    ("path", "overrides", "logged"),
    [
        (GPT3, [*FLOAT16, "trainer.init.precision.loss_scaling_factor=dynamic"], True),  # log_loss_scale: true
        (GPT3, [*FLOAT16, "trainer.init.precision.log_loss_scale=null"], False),  # unset, static: not logged
        (
            GPT3,
            [
                *FLOAT16,
                "trainer.init.precision.log_loss_scale=null",
                "trainer.init.precision.loss_scaling_factor=dynamic",
            ],
            True,
        ),  # unset, dynamic: logged
        (ZOO / "fc_mnist_legacy_params.yaml", [], False),  # legacy: with log_summaries, which it does not set
        (ZOO / "fc_mnist_legacy_params.yaml", ["optimizer.log_summaries=true"], True),
        (ZOO / "gpt3_cerebras_gpt_111m_mup_2.3.1.yaml", ["model.name=gpt3"], True),  # log_summaries: True
    ],
)
def test_log_loss_scale_means_what_it_means_in_model_zoo(path: Path, overrides: list[str], logged: bool) -> None:
    from dls.train.config import load_config

    assert load_config(path, overrides).optimizer.log_loss_scale is logged


def test_log_summaries_logs_the_norms_and_log_underflow_the_underflow(tmp_path: Path) -> None:
    raw = tiny(tmp_path / "a", runconfig={"max_steps": 2}, optimizer={"log_summaries": True})
    make_trainer(raw)[0].train()
    rows = metrics(tmp_path / "a")
    assert all(r["params_norm"] > 0 and "grad_underflow" not in r for r in rows)
    assert all(r["grad_norm"] > 0 for r in rows if not r["skipped"])
    raw = tiny(tmp_path / "b", runconfig={"max_steps": 2}, precision={"log_underflow": True})
    make_trainer(raw)[0].train()
    rows = metrics(tmp_path / "b")
    assert all("params_norm" not in r and "grad_underflow" in r for r in rows)
