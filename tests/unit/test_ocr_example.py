"""The OCR example's handler with its real model, no server (skipped without the `ocr` extra)."""

from __future__ import annotations

import base64

import pytest

from aios_blocks.examples import ocr
from aios_blocks.instance import Context, InstanceApp, Task
from aios_blocks.schemas.spec import Component

pytestmark = pytest.mark.skipif(ocr.available() is not None, reason=f"{ocr.available()}")


async def test_reads_an_image_sent_raw_or_as_base64_and_refuses_what_is_not_one() -> None:
    app = InstanceApp(ocr.handle, ocr.init, Context(input_protocol={"path": "/ocr"}))
    await app.start()
    png = ocr.sample_png("Blocks 2026")
    raw = await app.call(Task(png, {"Content-Type": "image/png"}, "/ocr"))
    assert raw.status == 200 and raw.json()["text"] == "Blocks 2026"
    b64 = await app.call({"image_b64": base64.b64encode(png).decode()})
    assert b64.json()["text"] == "Blocks 2026"
    for bad, why in ((b"\x89PNG broken", "not an image"), (b"", "no image")):
        r = await app.call(Task(bad, {"Content-Type": "image/png"}, "/ocr"))
        assert r.status == 400 and why in r.json()["error"]
    r = await app.call({"image_b64": "***"})
    assert r.status == 400 and "base64" in r.json()["error"]
    metrics = app.metrics.render().decode()
    assert "ocr_lines_total 2.0" in metrics and "ocr_inference_seconds_count 2.0" in metrics


def test_the_component_is_valid_and_runs_this_interpreter() -> None:
    comp = Component.model_validate(ocr.component("/opt/py/bin/python"))
    assert comp.launch.command == ["/opt/py/bin/python", "-m", "aios_blocks.examples.ocr"]
    assert comp.componentInputProtocol["path"] == "/ocr" and comp.launch.probe.path == "/health"
