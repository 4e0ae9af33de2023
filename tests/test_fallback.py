"""``scaler.watch(model, fallback=True)``: a module whose float16 output overflows is found and kept in float32.

The model (``_amplify.py``) has one layer whose float16 output exceeds 65504, followed by a LayerNorm: in float32 it
trains; in float16 every step overflows in the forward pass and no loss scale can help.
"""

from __future__ import annotations

import copy
import io
import math
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dls
from _amplify import amplifying_model, batch, eval_loss, loss_fn, scaled_step, train
from conftest import OpLog, launch_ranks
from dls.keep import is_kept

pytestmark = pytest.mark.filterwarnings("ignore:dls fallback:UserWarning")  # tests that check them record them

STEPS = 600
HERE = Path(__file__).resolve().parent


def fallback(model: nn.Module, scaler: dls.GradScaler) -> Any:
    return scaler.watch(model, fallback=True)


@pytest.fixture(scope="module")
def float32_loss() -> float:
    return float(train(amplifying_model(), STEPS, half=False)["eval"])


def test_plain_float16_skips_every_step() -> None:
    run = train(amplifying_model(), 150, half=True)
    assert run["skipped"] == list(range(150))
    assert run["scaler"].get_scale() == run["scaler"].settings.min_loss_scale


def test_keep_by_hand_trains_to_float32s_loss(float32_loss: float) -> None:
    run = train(amplifying_model(), STEPS, half=True, setup=lambda m, _s: dls.keep_in_float32(m, ["amplify"]))
    assert run["skipped"] == []
    assert abs(run["eval"] - float32_loss) <= 0.02 * float32_loss


def test_fallback_keeps_exactly_the_amplifying_layer_and_reaches_float32s_loss(float32_loss: float) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = train(amplifying_model(), STEPS, half=True, setup=fallback)
    watch = run["extra"]
    assert watch.kept_in_float32 == ("amplify",)
    assert run["skipped"] == [0, 1]  # the overflow seen, then the armed pass that found where it was born
    added = [w for w in caught if "now runs in float32" in str(w.message)]
    assert len(added) == 1 and "'amplify'" in str(added[0].message)
    largest = float(str(added[0].message).split("largest |output| in float32: ")[1].split(")")[0])
    assert largest > 65504  # measured in float32: what float16 could not hold
    assert abs(run["eval"] - float32_loss) <= 0.05 * float32_loss
    watch.remove()
    assert type(watch.model.amplify) is nn.Linear  # restored


def test_a_model_that_fits_float16_trains_bit_identically_with_the_fallback() -> None:
    plain = train(amplifying_model(gain=1.0), 30, half=True)
    healed = train(amplifying_model(gain=1.0), 30, half=True, setup=fallback)
    assert healed["extra"].kept_in_float32 == ()
    assert plain["skipped"] == healed["skipped"]
    for a, b in zip(plain["scaler"].state_dict().values(), healed["scaler"].state_dict().values()):
        assert a == b
    for a, b in zip(plain["optimizer"].param_groups[0]["params"], healed["optimizer"].param_groups[0]["params"]):
        assert torch.equal(a, b)


def step_ops(watch_fallback: bool | None) -> list[str]:
    model = amplifying_model(gain=1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dls.GradScaler("cpu")
    if watch_fallback is not None:
        scaler.watch(model, fallback=watch_fallback)
    for step in range(2):  # the second step is the one logged: gradients exist, state is warm
        with OpLog() as log:
            loss = loss_fn(model, step, half=True)
            optimizer.zero_grad(set_to_none=False)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    return log.ops


def test_clean_steps_run_the_same_ops_as_a_plain_watch() -> None:
    plain, watched, healing = step_ops(None), step_ops(False), step_ops(True)
    assert watched and healing == watched
    assert len(watched) == len(plain) + 1  # a watch keeps the loss, detached: what it costs today


def test_gradient_overflows_never_keep_a_module() -> None:
    model = amplifying_model(gain=1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = dls.GradScaler("cpu", init_scale=2.0**16)
    watch = scaler.watch(model, fallback=True)

    def inject(_module: nn.Module, grad_output: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        g = grad_output[0].clone()
        g[0, 0] = math.inf
        return (g, *grad_output[1:])

    hook = model.norm.register_full_backward_pre_hook(inject)
    for step in range(6):
        loss = loss_fn(model, step, half=True)
        assert torch.isfinite(loss)
        scaled_step(scaler, optimizer, loss)
        assert scaler.step_was_skipped(optimizer)
        assert scaler.overflow_report() is not None and scaler.overflow_report().forward is False
        assert watch.fallback is not None and not watch.fallback.armed
    hook.remove()
    assert watch.kept_in_float32 == ()


def test_non_finite_parameters_keep_nothing_and_are_named() -> None:
    model = amplifying_model(gain=1.0)
    with torch.no_grad():
        model.norm.weight[3] = math.nan
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = dls.GradScaler("cpu")
    watch = scaler.watch(model, fallback=True)
    for step in range(4):
        loss = loss_fn(model, step, half=True)
        scaled_step(scaler, optimizer, loss)
        report = scaler.overflow_report()
        assert report is not None and report.forward and report.non_finite_parameters == ("norm.weight",)
        assert "norm.weight" in str(report)
    assert watch.kept_in_float32 == () and watch.fallback is not None and not watch.fallback.armed


def test_an_overflow_outside_any_module_disarms_after_three_armed_passes() -> None:
    model = amplifying_model(gain=1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = dls.GradScaler("cpu")
    watch = scaler.watch(model, fallback=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(10):
            x, _ = batch(step)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = (model(x) * 1e6).sum()  # the loss function overflows, outside every module
            scaled_step(scaler, optimizer, loss)
    assert watch.kept_in_float32 == ()
    assert watch.fallback is not None and watch.fallback.disarmed and not watch.fallback.armed
    assert sum("disarmed" in str(w.message) for w in caught) == 1


def test_kept_modules_survive_a_checkpoint_in_either_order() -> None:
    run = train(amplifying_model(), 5, half=True, setup=fallback)
    state = run["scaler"].state_dict()
    assert state["kept_in_float32"] == ["amplify"]
    run["extra"].remove()
    for order in ("watch_first", "load_first"):
        model = amplifying_model()
        scaler = dls.GradScaler("cpu", init_scale=2.0**16)

        def setup(m: nn.Module, s: dls.GradScaler, order: str = order) -> Any:
            if order == "watch_first":
                watch = s.watch(m, fallback=True)
                s.load_state_dict(state)
            else:
                s.load_state_dict(state)
                watch = s.watch(m, fallback=True)
            assert watch.kept_in_float32 == ("amplify",)
            return watch

        resumed = train(model, 5, half=True, setup=setup, scaler=scaler)
        assert resumed["skipped"] == [], order  # kept from the first step: no overflow again
        assert resumed["scaler"].state_dict()["kept_in_float32"] == ["amplify"]
        resumed["extra"].remove()


def test_a_pickled_scaler_keeps_its_kept_modules() -> None:
    # Its watches belong to this process; the names they keep are the scaler's state, adopted by the next watch.
    run = train(amplifying_model(), 5, half=True, setup=fallback)
    copy = pickle.loads(pickle.dumps(run["scaler"]))
    assert copy.state_dict() == run["scaler"].state_dict() and copy.state_dict()["kept_in_float32"] == ["amplify"]
    run["extra"].remove()
    assert copy.watch(amplifying_model(), fallback=True).kept_in_float32 == ("amplify",)
    loaded = dls.GradScaler("cpu")
    loaded.load_state_dict({**loaded.state_dict(), "kept_in_float32": ["amplify"]})  # no watch yet
    assert pickle.loads(pickle.dumps(loaded)).state_dict() == loaded.state_dict()


def test_an_unknown_kept_name_is_an_error_naming_it() -> None:
    state = {**dls.GradScaler("cpu").state_dict(), "kept_in_float32": ["amplify", "nowhere"]}
    scaler = dls.GradScaler("cpu")
    model = amplifying_model()
    scaler.watch(model, fallback=True)
    before = scaler.state_dict()
    with pytest.raises(ValueError, match="'nowhere'"):
        scaler.load_state_dict(state)
    assert scaler.state_dict() == before and type(model.amplify) is nn.Linear  # nothing changed
    later = dls.GradScaler("cpu")
    later.load_state_dict(state)
    with pytest.raises(ValueError, match="'nowhere'"):
        later.watch(amplifying_model(), fallback=True)
    with pytest.raises(ValueError, match="kept_in_float32"):
        dls.GradScaler("cpu").load_state_dict({**state, "kept_in_float32": "amplify"})


def test_torch_compile_recompiles_when_a_module_is_kept() -> None:
    model = amplifying_model()
    compiled_graphs: list[Any] = []

    def backend(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
        compiled_graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    scaler = dls.GradScaler("cpu", init_scale=2.0**16)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    watch = scaler.watch(compiled, fallback=True)
    skipped = []
    for step in range(6):
        scaled_step(scaler, optimizer, loss_fn(compiled, step, half=True))
        skipped.append(scaler.step_was_skipped(optimizer))
    assert watch.kept_in_float32 == ("amplify",)
    assert skipped[-1] is False and all(skipped[:2])
    graphs = len(compiled_graphs)
    assert graphs >= 2  # the class change recompiled
    watch.remove()
    with torch.autocast("cpu", dtype=torch.float16):
        assert not torch.isfinite(compiled(batch(0)[0])).all()  # released: float16 again, without a new graph
    assert len(compiled_graphs) == graphs
    torch._dynamo.reset()


def test_master_weights_and_fp8_emulation() -> None:
    # float16 parameters: the kept layer's float32 output goes on to a parameter-free LayerNorm (CPU autocast would
    # not cast it for a float16 one; CUDA's computes layer_norm in float32 anyway)
    model = amplifying_model(affine_norm=False).half()
    optimizer = dls.master_weights(torch.optim.Adam(model.parameters(), lr=1e-3))
    scaler = dls.GradScaler("cpu", init_scale=2.0**16)
    watch = scaler.watch(model, fallback=True)
    skipped = []
    for step in range(5):
        loss = loss_fn(model, step, half=True)
        scaled_step(scaler, optimizer, loss)
        skipped.append(scaler.step_was_skipped(optimizer))
    assert watch.kept_in_float32 == ("amplify",) and skipped == [True, True, False, False, False]
    assert model.amplify.weight.dtype == torch.float16  # the parameters stay half
    watch.remove()

    model = amplifying_model()
    scaler = dls.GradScaler("cpu", init_scale=2.0**16)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with dls.fp8.emulate_recipe(model, dls.fp8.CurrentScaling()), dls.emulate(model, "float16") as emulated:
        watch = scaler.watch(model, fallback=True)
        for step in range(8):
            loss = loss_fn(model, step, half=False)
            scaled_step(scaler, optimizer, loss)
        # amplify's float32 output still overflows norm's float16 input rounding: norm is kept next
        assert watch.kept_in_float32 == ("amplify", "norm")
        assert torch.isfinite(loss)
        assert emulated.active
    watch.remove()


@pytest.mark.slow
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed+gloo")
def test_ranks_keep_the_same_modules(tmp_path: Path) -> None:
    ranks = launch_ranks(HERE / "_fallback_dist_worker.py", [], tmp_path, 2, timeout=120)
    assert ranks[0] == ranks[1]
    assert ranks[0]["kept"] == ["amplify"]
    assert ranks[0]["skipped"][:2] == [True, True] and not any(ranks[0]["skipped"][2:])


def test_eval_passes_do_not_use_up_the_armed_pass() -> None:
    model = amplifying_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = dls.GradScaler("cpu", init_scale=2.0**16)
    watch = scaler.watch(model, fallback=True)
    for step in range(3):
        if step == 1:
            with torch.no_grad():
                loss_fn(model, 99, half=True)  # an evaluation between: not a training pass
        loss = loss_fn(model, step, half=True)
        scaled_step(scaler, optimizer, loss)
    assert watch.kept_in_float32 == ("amplify",)
    assert eval_loss(model) < 10


def test_a_forward_overflow_in_any_micro_batch_counts_under_gradient_accumulation() -> None:
    # Micro-batch 0 overflows in float16; micro-batch 1 runs in float32 and its loss is finite. The step is skipped
    # for micro-batch 0's forward pass: the fallback must see it although the last loss given to scale() is finite.
    model = amplifying_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = dls.GradScaler("cpu", init_scale=2.0**16)
    watch = scaler.watch(model, fallback=True)
    skipped = []
    for step in range(4):
        optimizer.zero_grad()
        for micro in range(2):
            loss = loss_fn(model, 2 * step + micro, half=micro == 0)
            assert math.isfinite(loss.item()) == (watch.kept_in_float32 != () or micro == 1)
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        skipped.append(scaler.step_was_skipped(optimizer))
    assert watch.kept_in_float32 == ("amplify",)
    assert skipped == [True, True, False, False]


def audit_list() -> list[str] | None:
    steps = iter(range(10_000, 20_000))
    result = dls.audit(amplifying_model(), lambda m: loss_fn(m, next(steps), half=False), ["float16", "bfloat16"])
    assert result.keep_in_float32["bfloat16"] == []
    assert "fits with 'amplify'" in result.to_text()
    return result.keep_in_float32["float16"]


def test_the_audits_list_trains_to_float32s_loss(float32_loss: float) -> None:
    names = audit_list()
    assert names is not None and names[0] == "amplify"
    run = train(amplifying_model(), STEPS, half=True, setup=lambda m, _s: dls.keep_in_float32(m, names))
    assert run["skipped"] == []
    assert abs(run["eval"] - float32_loss) <= 0.02 * float32_loss


def test_the_audit_says_when_nothing_fits() -> None:
    model = amplifying_model(gain=1e20)  # LayerNorm overflows in float32 too: keeping cannot help
    result = dls.audit(model, lambda m: loss_fn(m, 0, half=False), ["float16"], steps=1)
    assert result.keep_in_float32["float16"] is None
    assert "does not make the forward pass fit" in result.to_text()


def test_the_trainers_wiring_keeps_the_configs_modules() -> None:
    from dls.diagnostics.fallback import apply_precision_fallback, fallback_note

    model = amplifying_model()
    scaler = dls.GradScaler("cpu", init_scale=2.0**16)
    with pytest.raises(ValueError, match=r"precision\.keep_in_float32.*'nowhere'"):
        apply_precision_fallback(model, scaler, ["amplify", "nowhere"], fallback=True)
    assert type(model.amplify) is nn.Linear
    for fallback in (False, True):
        watch = apply_precision_fallback(model, scaler, ["amplify"], fallback=fallback)
        assert watch.kept_in_float32 == ("amplify",) and "amplify" in fallback_note(watch)
        assert ("kept_in_float32" in scaler.state_dict()) is fallback
        run = train(model, 3, half=True, scaler=scaler)
        assert run["skipped"] == []
        watch.remove()
        assert type(model.amplify) is nn.Linear


def test_the_demo_rows() -> None:
    from dls.train.demo import run_fallback_rows

    reference, plain, healed = run_fallback_rows(steps=150)
    assert reference.loss is not None and reference.skipped == 0
    assert plain.stopped is not None and plain.loss is None and plain.skipped == plain.stopped + 1
    assert healed.kept == ("amplify",) and healed.skipped == healed.skipped_before_kept == 2
    assert healed.loss is not None and healed.loss < 2 * reference.loss


def test_a_kept_module_that_overflows_float32_is_not_kept_again_and_the_fallback_gives_up() -> None:
    model = amplifying_model(gain=1e20)  # amplify's outputs ~1e20: LayerNorm's variance overflows float32 too
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = dls.GradScaler("cpu")
    watch = scaler.watch(model, fallback=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(16):
            loss = loss_fn(model, step, half=True)
            scaled_step(scaler, optimizer, loss)
    assert watch.kept_in_float32 == ("amplify", "norm")
    assert watch.fallback is not None and watch.fallback.disarmed
    assert sum("disarmed" in str(w.message) for w in caught) == 1


def test_a_model_the_fallback_kept_a_module_of_saves_whole() -> None:
    """Issue 30 B5: ``torch.save(model)`` after the fallback kept a module (its class is a kept one)."""
    run = train(amplifying_model(), 3, half=True, setup=fallback)
    model = run["extra"].model
    assert run["extra"].kept_in_float32 == ("amplify",)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert is_kept(loaded.amplify) and not is_kept(loaded.head)
    x = batch(0)[0]
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.equal(loaded(x), model(x)) and torch.isfinite(loaded(x)).all()


def test_an_armed_model_copies_whole_and_the_copy_is_not_armed() -> None:
    """Between a skipped step that armed the fallback and the next forward pass, the root has a class of the
    fallback's and hooks on every module: ``torch.save(model)`` and ``copy.deepcopy`` give a model of its own class
    whose copies of those hooks do nothing (a copy is watched by no fallback); the original stays armed."""
    model = amplifying_model()
    watch = dls.GradScaler("cpu").watch(model, fallback=True)
    assert watch.fallback is not None
    watch.fallback.after_skip(forward=True)  # as at a skipped step whose loss was inf
    assert watch.fallback.armed and type(model) is not nn.Sequential
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for copied in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        assert type(copied) is nn.Sequential
        with torch.autocast("cpu", dtype=torch.float16):
            copied(batch(0)[0])
        assert watch.fallback.armed and not watch.fallback._recording  # the copy's pass was not the original's
