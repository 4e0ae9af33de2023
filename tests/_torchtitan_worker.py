"""One rank of ``tests/test_integration_torchtitan.py``: torchtitan's own trainer (``torchtitan.train.main``) with
``--module _torchtitan_harness --config debug_fp16`` and the torchtitan arguments given::

    python tests/_torchtitan_worker.py OUT [TORCHTITAN ARGS ...]

Started like torchrun's workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_*``); ``DLS_TEST_DEVICE`` (cpu
by default, or cuda: then ``nccl``) and ``DLS_TEST_BACKEND`` choose where it runs. The harness writes
``OUT/rank{r}.json``.
"""

from __future__ import annotations

import datetime
import importlib
import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    out, args = sys.argv[1], sys.argv[2:]
    os.environ["DLS_TT_OUT"] = out
    os.environ.setdefault("DLS_TT_ASSETS", os.path.join(out, "assets"))
    torch.set_num_threads(1)
    device = torch.device(os.environ.get("DLS_TEST_DEVICE", "cpu"))
    importlib.import_module("_torchtitan_harness")  # the CPU workarounds, before torchtitan builds anything
    torchtitan_main = importlib.import_module("torchtitan.train").main

    backend = os.environ.get("DLS_TEST_BACKEND", "nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # Joined here so that torchtitan (which then skips its own init) runs on gloo on the CPU.
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    sys.argv = ["torchtitan.train", "--module", "_torchtitan_harness", "--config", "debug_fp16", *args]
    torchtitan_main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
