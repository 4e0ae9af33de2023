"""examples/self_healing_fp16.py, small: plain float16 skips every step; the audit's list and the fallback train."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import load_example


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = load_example("self_healing_fp16.py").run(steps=60)
    return out


def test_plain_float16_skips_every_step(results: dict[str, dict[str, Any]]) -> None:
    assert results["float16"]["skipped"] == 60


def test_the_audits_list_and_the_fallback_keep_the_amplifying_layer(results: dict[str, dict[str, Any]]) -> None:
    assert results["audit_list"]["kept"][0] == "amplify" and results["audit_list"]["skipped"] == 0
    fallback = results["fallback"]
    assert fallback["kept"] == ["amplify"] and fallback["skipped"] == 2
    assert fallback["state"]["kept_in_float32"] == ["amplify"]
    assert len(fallback["warnings"]) == 1 and "'amplify'" in fallback["warnings"][0]
    reference = results["float32"]["loss"]
    assert results["audit_list"]["loss"] < 2 * reference and fallback["loss"] < 2 * reference
