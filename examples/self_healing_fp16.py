"""float16 that heals itself: a layer whose float16 output overflows is found and kept in float32, automatically.

The model (that of ``dls demo``'s fallback rows) has one amplifying layer (``amplify``) whose
outputs reach about 5e5, beyond float16's largest value (65504), followed by a LayerNorm that brings them back to
order 1: in float32 it trains normally. Under ``torch.autocast(dtype=torch.float16)`` every forward pass overflows,
every step is skipped, and the loss scale falls to its floor: loss scaling rescues gradients, not a forward pass.

Four runs from identical weights and batches:

* float32, the reference;
* float16 + ``dls.GradScaler``: every step skipped;
* float16 with ``dls.keep_in_float32(model, names)``, the names found by ``dls.audit`` (which re-audits with the
  modules found so far kept until the forward pass fits);
* float16 with ``scaler.watch(model, fallback=True)``: the first overflow arms the watch, the next forward pass
  finds the layer where the overflow was born, and it runs in float32 from then on (two skipped steps in all).
  ``watch.kept_in_float32`` lists it, and ``scaler.state_dict()`` carries it, so a resumed run keeps it too.

    python examples/self_healing_fp16.py [--steps 600] [--seed 0]
"""

from __future__ import annotations

import argparse
import warnings
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

import dls

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_model(seed: int) -> nn.Sequential:
    """``dls demo``'s (``dls.train.demo.amplifying_net``): embed, amplify (weights x3e5), LayerNorm, Tanh, head."""
    torch.manual_seed(seed)
    embed, amplify = nn.Linear(16, 64), nn.Linear(64, 64)
    with torch.no_grad():
        amplify.weight.mul_(3e5)
    layers = OrderedDict(embed=embed, amplify=amplify, norm=nn.LayerNorm(64), act=nn.Tanh(), head=nn.Linear(64, 1))
    return nn.Sequential(layers).to(DEVICE)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(64, 16, generator=g)
    return x.to(DEVICE), torch.tanh(x[:, :1] * x[:, 1:2]).to(DEVICE)


def loss_of(model: nn.Module, step: int, half: bool) -> torch.Tensor:
    x, y = batch(step)
    with torch.autocast(DEVICE, dtype=torch.float16, enabled=half):
        out = model(x)
    return nn.functional.mse_loss(out.float(), y)


def train(model: nn.Module, steps: int, half: bool, fallback: bool = False) -> dict[str, Any]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = dls.GradScaler(DEVICE, init_scale=2.0**16, enabled=half)
    schedule = dls.skip_aware(torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.99), scaler)
    watch = scaler.watch(model, fallback=True) if fallback else None
    skipped = 0
    for step in range(steps):
        loss = loss_of(model, step, half)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        schedule.step()  # skip_aware: only after applied steps
        skipped += half and scaler.step_was_skipped(optimizer)
    with torch.no_grad():
        final = sum(loss_of(model, 10_000 + i, half=False).item() for i in range(8)) / 8
    return {
        "loss": final,
        "skipped": int(skipped),
        "scale": scaler.get_scale(),
        "kept": list(watch.kept_in_float32) if watch is not None else [],
        "state": scaler.state_dict(),
    }


def run(steps: int = 600, seed: int = 0) -> dict[str, dict[str, Any]]:
    results = {"float32": train(make_model(seed), steps, half=False)}
    results["float16"] = train(make_model(seed), steps, half=True)

    # What to keep, found by the audit (on fresh batches from the loss function, nothing of the model changes).
    audit_steps = iter(range(20_000, 30_000))
    audit = dls.audit(make_model(seed), lambda m: loss_of(m, next(audit_steps), half=False), formats=["float16"])
    names = audit.keep_in_float32["float16"] or []
    model = make_model(seed)
    with dls.keep_in_float32(model, names):
        results["audit_list"] = {**train(model, steps, half=True), "kept": names}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results["fallback"] = train(make_model(seed), steps, half=True, fallback=True)
    results["fallback"]["warnings"] = [str(w.message) for w in caught if "dls fallback" in str(w.message)]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = run(args.steps, args.seed)
    reference = results["float32"]["loss"]
    print(f"{'run':<34} {'loss':>10} {'vs fp32':>8} {'skipped':>8}  kept in float32")
    labels = {
        "float32": "float32",
        "float16": "float16 + DLS",
        "audit_list": "float16, dls.audit's list kept",
        "fallback": "float16 + DLS, watch(fallback=True)",
    }
    for key, label in labels.items():
        r = results[key]
        ratio = f"{r['loss'] / reference:.2f}x"
        print(f"{label:<34} {r['loss']:>10.4g} {ratio:>8} {r['skipped']:>8}  {', '.join(r['kept']) or '-'}")
    for message in results["fallback"]["warnings"]:
        print(f"warning: {message}")
    print(f"The fallback's kept modules travel in the scaler's state dict: {results['fallback']['state']}")


if __name__ == "__main__":
    main()
