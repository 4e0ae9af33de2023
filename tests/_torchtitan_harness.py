"""The test harness of ``dls.integrations.torchtitan``: a config module for torchtitan's own ``--module`` and the
CPU-only workarounds its trainer needs here (none of them belongs to the integration).

``tests/_torchtitan_worker.py`` imports it, then runs ``torchtitan.train.main()`` with ``--module
_torchtitan_harness --config debug_fp16``. What it adds to ``with_dls(llama3_debugmodel())``:

* CPU only (``DLS_TEST_DEVICE=cpu``, the default): torchtitan picks ``"cuda"`` as its device type when no
  accelerator is found, so its modules are pointed at the CPU (with a stand-in for the memory statistics its
  metrics read); ``dist.set_timeout`` (torch nightly only) is skipped; FlexAttention has no CPU backward, so the
  model uses SDPA; gloo has no ``PREMUL_SUM``, so FSDP is told to reduce with a plain sum.
* test sizes: 2 of the debug model's 6 layers, sequences of 64, batches of 2, torchtitan's ``partial_dtensor``
  backend (its default ``spmd_types`` fails under FSDP on torch 2.13);
* its assets: torchtitan's wheel ships no tokenizer nor ``c4_test``: a word-level tokenizer and a small JSON
  text data set are written to ``DLS_TT_ASSETS``;
* ``HarnessTrainer``: ``DLSTrainer`` that injects inf into ONE rank's gradient shard at the steps of
  ``DLS_TT_POISON`` (``"step:rank,..."``), after reduction and before dls unscales, and records each step (scale,
  skipped steps, whether this rank's parameters and optimizer state changed, the LR, the loss) into
  ``DLS_TT_OUT/rank{r}.json`` when torchtitan closes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

RANK = int(os.environ.get("RANK", 0))
DEVICE = torch.device(os.environ.get("DLS_TEST_DEVICE", "cpu"))


def _cpu_device_module() -> types.ModuleType:
    """``torch.cpu`` with what torchtitan's metrics and set-up call on a device module."""
    shim = types.ModuleType("cpu_device_module")
    shim.__dict__.update(vars(torch.cpu))
    shim.device_count = lambda: 1
    shim.set_device = lambda device: None
    shim.current_device = lambda: 0
    shim.synchronize = lambda *a: None
    shim.get_device_name = lambda *a: "cpu"
    shim.get_device_properties = lambda *a: types.SimpleNamespace(total_memory=24 * 2**30)
    shim.reset_peak_memory_stats = lambda *a: None
    shim.empty_cache = lambda: None
    shim.memory_stats = lambda *a: {}
    return shim


def _cpu_workarounds() -> None:
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.common.token_dispatcher as token_dispatcher
    import torchtitan.tools.utils as tools_utils

    module = _cpu_device_module()
    for m in (tools_utils, metrics, dist_utils, token_dispatcher, parallel_dims):
        m.device_type = "cpu"
        if hasattr(m, "device_module"):
            m.device_module = module
    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None  # dist.set_timeout: torch nightly only


if DEVICE.type == "cpu":
    _cpu_workarounds()

from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402

from dls.integrations.torchtitan import DLSTrainer, with_dls  # noqa: E402

WORDS = [f"w{i}" for i in range(400)]


def write_assets(folder: Path) -> tuple[Path, Path]:
    """A word-level tokenizer (``tokenizer.json``, ``tokenizer_config.json``) and a text data set of JSON lines."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer_dir, data_dir = folder / "tokenizer", folder / "c4_test"
    if (data_dir / "data.json").exists():
        return tokenizer_dir, data_dir
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<unk>"]
    vocab = {token: i for i, token in enumerate([*specials, *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    config = {"bos_token": specials[0], "eos_token": specials[1], "add_bos_token": True}
    rng = random.Random(0)
    lines = [json.dumps({"text": " ".join(rng.choices(WORDS, k=200))}) for _ in range(200)]
    # Ranks may race: each writes the same bytes to its own temporary file, then renames it into place.
    tokenizer.save(str(tokenizer_dir / f"tokenizer.json.{RANK}"))
    os.replace(tokenizer_dir / f"tokenizer.json.{RANK}", tokenizer_dir / "tokenizer.json")
    (tokenizer_dir / f"config.{RANK}").write_text(json.dumps(config))
    os.replace(tokenizer_dir / f"config.{RANK}", tokenizer_dir / "tokenizer_config.json")
    (data_dir / f"data.{RANK}").write_text("\n".join(lines) + "\n")
    os.replace(data_dir / f"data.{RANK}", data_dir / "data.json")
    return tokenizer_dir, data_dir


def _force_sum(parallelize_fn: Any) -> Any:
    def parallelize(model: Any, **kwargs: Any) -> Any:
        from torch.distributed.fsdp import FSDPModule

        model = parallelize_fn(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        return model

    return parallelize


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        h.update(t.detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class HarnessTrainer(DLSTrainer):
    """``DLSTrainer`` with an overflow injected into one rank's shard and every step recorded (see the module)."""

    @dataclass(kw_only=True, slots=True)
    class Config(DLSTrainer.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.records: list[dict[str, Any]] = []
        self.poison = [tuple(map(int, s.split(":"))) for s in os.environ.get("DLS_TT_POISON", "").split(",") if s]
        self.resumed_scaler: dict[str, Any] | None = None

    def _local_state(self) -> str:
        params = [p for m in self.model_parts for p in m.parameters()]
        state = [v for o in self.optimizers for s in o.state.values() for v in s.values() if torch.is_tensor(v)]
        return _digest(params + state)

    def unscale_gradients(self) -> None:
        if (self.step, RANK) in self.poison:
            param = next(p for m in self.model_parts for p in m.parameters() if p.grad is not None)
            grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            grad.view(-1)[0] = float("inf")
        super().unscale_gradients()

    def train_step(self, data_iterator: Any) -> None:
        if self.resumed_scaler is None:
            self.resumed_scaler = self.scaler.state_dict()  # at the first step of this process: what was loaded
        before = self._local_state()
        super().train_step(data_iterator)
        scheduler = self.lr_schedulers.schedulers[0]
        self.records.append(
            {
                "step": self.step,
                "scale": self.scaler.get_scale(),
                "skipped": self.scaler.get_num_skipped_steps(),
                "changed": self._local_state() != before,
                "last_epoch": scheduler.last_epoch,
                "lr": scheduler.get_last_lr()[0],
                "param_dtype": str(next(iter(self.model_parts[0].parameters())).dtype),
            }
        )

    def close(self) -> None:
        out = Path(os.environ["DLS_TT_OUT"])
        compute = self._compute_dtype()
        result = {"records": self.records, "resumed_scaler": self.resumed_scaler, "compute_dtype": compute}
        (out / f"rank{RANK}.json").write_text(json.dumps(result))
        super().close()

    def _compute_dtype(self) -> str:
        """The dtype of the first attention output in a forward pass (FSDP's param_dtype at work)."""
        model = self.model_parts[0]
        seen: list[str] = []
        layer = next(iter(model.layers.values()))
        handle = layer.attention.register_forward_hook(lambda m, a, out: seen.append(str(out.dtype)))
        try:
            with torch.no_grad():
                model(torch.zeros(1, 64, dtype=torch.long, device=self.device))
        finally:
            handle.remove()
        return seen[0] if seen else "none"


def debug_fp16() -> HarnessTrainer.Config:
    """torchtitan's debug llama, float16 with dls, at test sizes on this machine."""
    tokenizer_dir, data_dir = write_assets(Path(os.environ["DLS_TT_ASSETS"]))
    base = llama3_debugmodel()
    spec = base.model_spec
    assert spec is not None
    spec.model.layers = spec.model.layers[:2]
    if DEVICE.type == "cpu":
        for _fqn, _cfg, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
            setattr(parent, attr, ScaledDotProductAttention.Config())  # FlexAttention: no backward on CPU
        spec.parallelize_fn = _force_sum(spec.parallelize_fn)
    base.hf_assets_path = str(tokenizer_dir)
    base.dataloader.dataset_path = str(data_dir)
    base.training.seq_len, base.training.local_batch_size = 64, 2
    base.parallelism.spmd_backend = "partial_dtensor"
    base.validator.enable = False
    base.metrics.log_freq = 1
    base.lr_scheduler.warmup_steps = 2
    dls_config = with_dls(base, init_scale=2.0**40, growth_interval=2)
    return HarnessTrainer.Config(**{f.name: getattr(dls_config, f.name) for f in dataclasses.fields(dls_config)})
