"""Model Zoo's own keys on real configs (tests/data/modelzoo): every key of Model Zoo's runconfig schema (Releases
2.3.1 and 2.10.0, the schema files copied) known and said once; keys repeated inside Model Zoo's files; an optimizer
learning rate equal to its constant schedule; other model families and the sparsity section refused in one line;
YAML syntax errors in one line; a run continued from another run's checkpoint into a new model_dir, in both
layouts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from dls.train import config as C
from dls.train.cli import main
from dls.train.config import CEREBRAS, NOT_DONE, ZOO_RUNCONFIG, load_config, parse_config
from dls.train.errors import ConfigError
from dls.train.modelzoo import write_tiny_data

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "tests" / "data" / "modelzoo"
SCHEMAS = {release: ZOO / f"runconfig_schema_{release}.yaml" for release in ("1.8.0", "1.9.1", "2.3.1", "2.10.0")}


def schema_keys(release: str) -> set[str]:
    return set(yaml.safe_load(SCHEMAS[release].read_text())["properties"])


def test_the_runconfig_table_is_the_schemas_key_list() -> None:
    assert len(schema_keys("2.3.1")) == 68 and schema_keys("2.3.1") <= schema_keys("2.10.0")
    assert set(ZOO_RUNCONFIG) == set().union(*map(schema_keys, SCHEMAS))
    run_keys = set(C.RunConfig.model_fields)
    assert {v for v in ZOO_RUNCONFIG.values() if v not in (CEREBRAS, NOT_DONE)} <= run_keys
    assert ZOO_RUNCONFIG["max_checkpoints"] == "keep_checkpoint_max" and ZOO_RUNCONFIG["target_device"] == "backend"
    assert "execute_crd_memory_gb" not in C.IGNORED_OFF_CEREBRAS  # a name no release has


# A value of each honoured key that this test's config accepts; the others, a value of the schema's type.
HONOURED = {
    "autoload_last_checkpoint": False, "checkpoint_path": "c.mdl", "checkpoint_steps": 5,
    "disable_strict_checkpoint_loading": True, "eval_frequency": 4, "eval_steps": 2,
    "load_checkpoint_states": "model", "log_steps": 3, "max_steps": 7, "model_dir": "runs/x", "num_epochs": 2,
    "num_steps": 6, "save_initial_checkpoint": True, "seed": 9, "steps_per_epoch": 8, "max_checkpoints": 4,
    "target_device": "CPU", "keep_checkpoint_max": 4,
}  # fmt: skip
BY_TYPE = {"boolean": True, "integer": 3, "string": "x", "object": {}, "array": [], "number": 1.5}


def a_value(key: str, schema: dict[str, Any]) -> Any:
    if key in HONOURED:
        return HONOURED[key]
    kinds = schema.get("type", "object")
    kind = next(k for k in ([kinds] if isinstance(kinds, str) else kinds) if k != "null")
    return BY_TYPE[kind]


@pytest.mark.parametrize("release", sorted(SCHEMAS))
def test_every_runconfig_key_of_model_zoos_schema_is_known_and_said_once(release: str) -> None:
    properties = yaml.safe_load(SCHEMAS[release].read_text())["properties"]
    raw = yaml.safe_load((ZOO / "fc_mnist_legacy_params.yaml").read_text())
    raw["runconfig"] = {key: a_value(key, schema) for key, schema in properties.items()}
    if "keep_checkpoint_max" in properties:  # Release 1.9 has both names: give it once
        raw["runconfig"].pop("max_checkpoints", None)
    cfg = parse_config(raw)
    rc = cfg.runconfig
    for key, to in ZOO_RUNCONFIG.items():
        if key in properties and to not in (CEREBRAS, NOT_DONE, "backend"):
            assert getattr(rc, to) == (("model",) if key == "load_checkpoint_states" else HONOURED[key]), key
    assert (rc.backend, rc.device, rc.keep_checkpoint_max) == ("CPU", "cpu", 4)
    for kind, start in ((CEREBRAS, "ignored on this hardware (Cerebras only): "), (NOT_DONE, "not done by dls")):
        (note,) = [n for n in cfg.notes if n.startswith(start)]
        listed = re.findall(r"runconfig\.(\w+)", note)
        assert sorted(listed) == sorted(k for k, v in ZOO_RUNCONFIG.items() if v == kind and k in properties), kind


def test_the_trainer_guide_says_what_each_runconfig_key_means_and_does() -> None:
    guide = (ROOT / "docs" / "guides" / "trainer.md").read_text()
    section = guide[guide.index("### Model Zoo's keys") :]
    table = section[: section.index("\n\n", section.index("| Model Zoo key"))]
    rows = [line for line in table.splitlines() if line.startswith("| ")][2:]
    named = {k for row in rows for k in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert set(ZOO_RUNCONFIG) <= named, set(ZOO_RUNCONFIG) - named
    assert all(len(row.split("|")) == 5 for row in rows)  # key, Model Zoo's meaning, what dls does


def test_real_runconfig_keys_are_honoured_or_noted() -> None:
    raw = C.read_config(ZOO / "gpt3_20b_2.3.1.yaml", ["model.name=gpt3"])
    del raw["optimizer"]["ws_summary"]  # a key of no Model Zoo code (refused, naming it)
    assert parse_config(raw).runconfig.keep_checkpoint_max == 21  # max_checkpoints: KeepNCheckpoints
    llama = load_config(ZOO / "llama3p1_70b_msl_8k_2.3.1.yaml", ["model.name=llama"])
    (ignored,) = [n for n in llama.notes if n.startswith("ignored on this hardware")]
    assert "runconfig.execute_crd_memory_gi" in ignored and "runconfig.compile_crd_memory_gi" in ignored


def test_a_key_repeated_in_model_zoos_own_files_takes_the_last_value_with_a_note() -> None:
    path = ZOO / "gpt3_cerebras_gpt_256m_mup_2.3.1.yaml"
    cfg = load_config(path, ["model.name=gpt3"])
    (note,) = [n for n in cfg.notes if "given twice" in n]
    said = "the value of line 66 is used, as Model Zoo's YAML loader does"
    assert note == f"{path}: 'a' is given twice (lines 65 and 66); {said}"
    assert cfg.model.params["embedding_initializer"]["a"] == -0.16
    old = ZOO / "gpt2_small_ws_1.8.0.yaml"  # 'steps' twice in a schedule piece: the same note
    said = "the value of line 94 is used, as Model Zoo's YAML loader does"
    assert f"{old}: 'steps' is given twice (lines 93 and 94); {said}" in load_config(old, ["model.name=gpt2"]).notes
    notes: list[str] = []
    C.read_config(old, (), notes)
    assert notes == [f"{old}: 'steps' is given twice (lines 93 and 94); the value of line 94 is used, as Model Zoo's "
                     "YAML loader does"]  # fmt: skip


def test_an_optimizer_rate_equal_to_its_constant_schedule_agrees() -> None:
    cfg = load_config(ZOO / "fc_mnist_cszoov2.yaml")  # SGD learning_rate 0.001 and schedulers [ConstantLR 0.001]
    assert cfg.optimizer.learning_rate == (C.SchedulePiece(scheduler="Constant", learning_rate=0.001),) or (
        cfg.optimizer.learning_rate == 0.001
    )
    with pytest.raises(ConfigError, match=r"\(0\.001\) and trainer\.init\.schedulers .* disagree"):
        load_config(ZOO / "fc_mnist_cszoov2.yaml", ["trainer.init.schedulers=[{ConstantLR: {learning_rate: 0.002}}]"])


@pytest.mark.parametrize(
    ("path", "override", "family"),
    [
        ("gpt3_cerebras_gpt_111m.yaml", "trainer.init.model.name=bert", "bert"),
        ("gpt2_small_2.3.1.yaml", "model.name=t5", "t5"),
    ],
)
def test_another_model_family_is_one_line(path: str, override: str, family: str, capsys: Any) -> None:
    assert main(["validate", str(ZOO / path), "-o", override]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    key = override.split("=")[0]
    assert line.endswith(f"{key}: fc_mnist, gpt2, gpt3, llama are supported (and dls's own mlp, transformer_lm); this "
                         f"config is {family}")  # fmt: skip


def test_a_model_feature_dls_does_not_build_is_one_line(capsys: Any) -> None:
    """Release 2.10.0's Llama 3.1 with sliding-window attention and attention sinks: one line naming the features,
    not one per key (the sink tokens' data transform would add an unknown-key error that follows from them)."""
    assert main(["validate", str(ZOO / "llama3p1_8b_msl_32k_swa_8k_sink_512.yaml")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    said = "dls's Model Zoo models do not implement sliding-window attention and attention sink tokens"
    assert f"trainer.init.model.attention_sliding_window_length: {said}" in line
    override = "trainer.init.model.attention_sliding_window_length=null"
    assert main(["validate", str(ZOO / "llama3p1_8b_msl_32k_swa_8k_sink_512.yaml"), "-o", override]) == 2
    assert (
        "trainer.init.model.attention_sink_tokens: dls's Model Zoo models do not implement attention sink tokens"
        in capsys.readouterr().err
    )


def test_the_sparsity_section_is_one_line_and_null_removes_it(capsys: Any) -> None:
    path = str(ZOO / "gpt3_125m_rigl75.yaml")
    assert main(["validate", path]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith("trainer.init.sparsity: Model Zoo's sparsity is not implemented in dls (to train the model "
                         "dense, remove the section: -o trainer.init.sparsity=null)")  # fmt: skip
    assert main(["validate", path, "-o", "trainer.init.sparsity=null"]) == 0
    legacy = {"model": {"name": "gpt2", "vocab_size": 8}, "sparsity": {"type": "static"}}
    with pytest.raises(ConfigError, match=r"sparsity: Model Zoo's sparsity is not implemented .* -o sparsity=null"):
        parse_config(legacy)


def test_a_yaml_syntax_error_is_one_line_naming_the_file_line_and_column(tmp_path: Path, capsys: Any) -> None:
    bad = tmp_path / "params.yaml"
    bad.write_text("model:\n  name: gpt2\n  hidden_size: [64\nrunconfig: {}\n")
    assert main(["validate", str(bad)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(rf"dls: error: invalid config: {re.escape(str(bad))}:4:10: .* \(not valid YAML\)", line), line
    assert "<unicode string>" not in line
    bad.write_text("model:\n  name: mlp\n\tdepth: 2\n")  # a tab: a character YAML does not allow there
    assert main(["validate", str(bad)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"{bad}:3:1: " in line


def test_an_override_is_echoed_cut(capsys: Any) -> None:
    long = "runconfig.max_steps=[" + "1, " * 2000
    assert main(["validate", str(ZOO / "fc_mnist_legacy_params.yaml"), "-o", long]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert len(line) < 400 and "(6,021 characters)" in line and "not valid YAML" in line, line


def run_dir_args(data: Path, layout: str, model_dir: Path) -> list[str]:
    if layout == "current":
        loaders = [f"trainer.fit.{s}_dataloader.data_dir={data}" for s in ("train", "val")]
        return [*loaders, "trainer.init.loop.max_steps=2", f"trainer.init.model_dir={model_dir}"]
    loaders = [f"{s}.{k}" for s in ("train_input", "eval_input") for k in (f"data_dir={data}", "batch_size=16")]
    return [*loaders, "runconfig.max_steps=2", f"runconfig.model_dir={model_dir}"]


@pytest.mark.parametrize(
    ("name", "layout"), [("fc_mnist_cszoov2.yaml", "current"), ("fc_mnist_legacy_params.yaml", "legacy")]
)
def test_a_run_continues_from_another_runs_checkpoint_in_a_new_model_dir(
    name: str, layout: str, tmp_path: Path, capsys: Any
) -> None:
    write_tiny_data("mnist", tmp_path / "mnist", train_samples=64, val_samples=16)
    config, old, new = str(ZOO / name), tmp_path / "old", tmp_path / "new"
    assert main(["train", config, "--no_progress", "-o", *run_dir_args(tmp_path / "mnist", layout, old)]) == 0
    more = [*run_dir_args(tmp_path / "mnist", layout, new)]
    more = [m.replace("max_steps=2", "max_steps=4") for m in more]
    assert main(["train", config, "--no_progress", "--resume", str(old), "-o", *more]) == 0, capsys.readouterr().err
    assert (new / "checkpoint_4.mdl").is_file() and not (old / "checkpoint_4.mdl").exists()
    assert f"Loading {old / 'checkpoint_2.mdl'}" in capsys.readouterr().out


def test_release_1_key_names_mean_what_release_1_code_read(capsys: Any) -> None:
    """Release 1.9.1's Llama 7B and 1.8.0's GPT-2 small (real files): beta1/beta2 are betas, a schedule piece's
    steps/decay_steps its total_iters, use_rms_norm the RMS norm; epsilon and use_bias_correction were never read by
    those releases' PyTorch optimizers (eps 1e-6), nor alpha by the Linear schedule; each translation is noted."""
    llama = load_config(ZOO / "llama_7b_1.9.1.yaml", ["model.name=llama"])
    assert llama.optimizer.betas == (0.9, 0.95) and llama.optimizer.eps == 1e-6 and llama.optimizer.correct_bias
    assert llama.optimizer.weight_decay == 0.01
    pieces = llama.optimizer.learning_rate
    assert isinstance(pieces, tuple)
    assert [(p.scheduler, p.total_iters) for p in pieces] == [("Linear", 2000), ("CosineDecay", 999998000)]
    assert llama.model.params["norm_type"] == "rmsnorm" and llama.model.params["position_embedding_type"] == "rotary"
    assert "use_rms_norm" not in llama.model.params and "use_position_embedding" not in llama.model.params
    for note in ("optimizer.beta1, beta2 (Release 1.x): betas [0.9, 0.95]",
                 "optimizer.learning_rate[0].steps (Release 1.x): total_iters 2000",
                 "optimizer.learning_rate[1].decay_steps (Release 1.x): total_iters 999998000",
                 "model.use_rms_norm (Release 1.x): norm_type rmsnorm"):  # fmt: skip
        assert note in llama.notes
    assert not any(n.startswith("optimizer.correct_bias: true, Release 2's default") for n in llama.notes)  # given

    gpt2 = load_config(ZOO / "gpt2_small_ws_1.8.0.yaml", ["model.name=gpt2"])
    assert gpt2.optimizer.betas == (0.9, 0.95) and gpt2.optimizer.eps == 1e-6  # epsilon: 1e-8 was not read
    assert gpt2.optimizer.correct_bias  # Release 1.8 defaulted to false, 1.9 to true: noted, set it to choose
    assert [p.total_iters for p in gpt2.optimizer.learning_rate] == [1600, 150000]  # type: ignore[union-attr]
    joined = "\n".join(gpt2.notes)
    assert "optimizer.epsilon, optimizer.use_bias_correction: not used, as in Release 1.x's PyTorch" in joined
    assert "optimizer.learning_rate[1].alpha: not used, as in Release 1.x's Linear schedule" in joined
    assert "optimizer.correct_bias: true, Release 2's default (Release 1.8's was false, 1.9's true" in joined
    assert gpt2.model.params["position_embedding_type"] == "learned"
    with pytest.raises(ConfigError, match=r"model\.position_embedding_type: None cannot be built by Hugging Face"):
        load_config(ZOO / "gpt2_small_ws_1.8.0.yaml", ["model.name=gpt2", "model.use_position_embedding=false"])

    cfg = load_config(ZOO / "fc_mnist_1.9.1.yaml", ["model.name=fc_mnist"])  # show_debug_metrics, csconfig
    (ignored,) = [n for n in cfg.notes if n.startswith("ignored on this hardware")]
    assert "runconfig.save_losses" in ignored and cfg.precision.fp16_type == "float16"  # use_cbfloat16: False
    assert any("runconfig.show_debug_metrics" in n for n in cfg.notes if n.startswith("not done by dls"))
    with pytest.raises(ConfigError, match=r"csconfig\.use_cbfloat16: write it as Release 2 does"):
        load_config(ZOO / "fc_mnist_1.9.1.yaml", ["model.name=fc_mnist", "csconfig.use_cbfloat16=true"])


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "optimizer.betas=[0.9,0.99]",
            "optimizer.betas and optimizer.beta1/beta2 (Release 1.x's names) are both given",
        ),
        ("optimizer.disable_lr_steps_reset=true", "optimizer.disable_lr_steps_reset: only false"),
        ("model.norm_type=layernorm", "model.norm_type and model.use_rms_norm (Release 1.x's name) are both given"),
        (
            "optimizer.learning_rate=[{scheduler: Linear, initial_learning_rate: 0, end_learning_rate: 1, steps: 5, "
            "total_iters: 5}]",
            "optimizer.learning_rate[0]: steps and total_iters are both given",
        ),
        ("model.use_rms_norm=2", "model.use_rms_norm must be true or false; got 2"),
    ],
)
def test_release_1_keys_that_disagree_are_refused_naming_them(override: str, message: str, capsys: Any) -> None:
    assert main(["validate", str(ZOO / "llama_7b_1.9.1.yaml"), "-o", "model.name=llama", override]) == 2
    assert message in capsys.readouterr().err


def test_a_model_zoo_config_without_a_model_name_is_one_line(tmp_path: Path, capsys: Any) -> None:
    raw = yaml.safe_load((ZOO / "llama3p2_1b_msl_8k.yaml").read_text())
    del raw["trainer"]["init"]["model"]["name"]  # as Release 2.3.1's params_llama3_8b_v2.yaml
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["validate", str(path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "trainer.init.model.name is required (Model Zoo picks it by its run.py: name it, e.g. -o " in line
    assert main(["validate", str(path), "-o", "trainer.init.model.name=llama"]) == 0
