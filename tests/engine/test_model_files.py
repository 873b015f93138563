"""What a run says about its weights: the bundled model is named for what it is, 4-bit weights widened to fp32."""

from __future__ import annotations

from pathlib import Path

from servelab.engine.model_files import describe_weights


def test_the_bundled_model_is_described_as_4_bit_weights_widened_to_fp32(tmp_path: Path) -> None:
    bundled = describe_weights("bundled:smollm2-135m-instruct")
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in bundled and "4-bit (Q4_1)" in bundled and "fp32" in bundled
    assert describe_weights(str(tmp_path)) == f"the local folder {tmp_path}"
    assert describe_weights("org/model") == "the hub model org/model"
