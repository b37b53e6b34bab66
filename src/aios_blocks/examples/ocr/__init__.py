"""A real model behind a block: text recognition (OCR) with RapidOCR — PP-OCRv4 detection,
direction and recognition ONNX models that ship inside the ``rapidocr-onnxruntime`` wheel (about
16 MB), run on CPU by onnxruntime. Nothing is fetched at run time. Install with the ``ocr`` extra
(``pip install 'aios-blocks[ocr]'``; in a checkout ``pip install -e '.[ocr]'``).

Run as an instance (the node agent does it, process runtime): ``python -m aios_blocks.examples.ocr``.

Task: ``POST /ocr`` (the component's ``componentInputProtocol.path``) with an image: raw bytes
(PNG/JPEG, any ``Content-Type`` but JSON) or JSON ``{"image_b64": "<base64>"}``.
Answer: ``{"text": "all lines, space-joined", "lines": [{"text", "score", "box"}], "elapsed_ms"}``.
Custom metrics: ``ocr_lines_total`` and ``ocr_inference_seconds``.
"""

from __future__ import annotations

import base64
import binascii
import io
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from ...instance import Context, Task, TaskError

COMPONENT_YAML = Path(__file__).resolve().parent.parent / "ocr_component.yaml"
COMPONENT_URI = "aios://examples/ocr-ppocr-v4"


def available() -> str | None:
    """None if the model can run here, else why not (the extra is missing)."""
    try:
        import rapidocr_onnxruntime  # noqa: F401
        from PIL import Image  # noqa: F401
    except ImportError as exc:
        # (an installed wheel has no '.' to install from: the package's name first)
        return f"the OCR example needs the `ocr` extra (pip install 'aios-blocks[ocr]'; in a checkout: pip install -e '.[ocr]'): {exc}"
    return None


def component(python: str = sys.executable) -> dict[str, Any]:
    """The component (``ocr_component.yaml``), its command run by ``python`` (this interpreter,
    which has the extra installed)."""
    comp: dict[str, Any] = yaml.safe_load(COMPONENT_YAML.read_text())
    comp["launch"]["command"] = [python, *comp["launch"]["command"][1:]]
    return comp


def init(ctx: Context) -> None:
    """Load the models (a plain function: it runs in a thread while /health says "starting")."""
    from rapidocr_onnxruntime import RapidOCR

    threads = int(ctx.settings.get("threads", 1))
    ctx.state["ocr"] = RapidOCR(intra_op_num_threads=threads, inter_op_num_threads=1)
    ctx.state["lines"] = ctx.metrics.counter("ocr_lines_total", "Text lines recognised")
    ctx.state["seconds"] = ctx.metrics.histogram(
        "ocr_inference_seconds", "Model time per image", buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10)
    )


def handle(task: Task, ctx: Context) -> dict[str, Any]:
    """One image -> its text (a plain function: the SDK runs it in a thread, one at a time)."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    raw = task.body
    if task.headers.get("Content-Type", "").startswith("application/json"):
        data = task.json()
        if not isinstance(data, dict) or not isinstance(data.get("image_b64"), str):
            raise TaskError(400, 'a JSON task must be {"image_b64": "<base64 of a PNG or JPEG>"}')
        try:
            raw = base64.b64decode(data["image_b64"], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise TaskError(400, f"image_b64 is not base64: {exc}") from None
    if not raw:
        raise TaskError(400, "no image: send PNG/JPEG bytes or {\"image_b64\": ...}")
    try:
        image = Image.open(io.BytesIO(raw)).convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise TaskError(400, f"not an image: {exc}") from None
    started = time.perf_counter()
    result, _ = ctx.state["ocr"](np.asarray(image))
    elapsed = time.perf_counter() - started
    lines = [{"text": text, "score": round(float(score), 4), "box": [[float(x), float(y)] for x, y in box]}
             for box, text, score in (result or [])]
    ctx.state["lines"].inc(len(lines))
    ctx.state["seconds"].observe(elapsed)
    return {"text": " ".join(line["text"] for line in lines), "lines": lines, "elapsed_ms": round(elapsed * 1000, 1)}


def sample_png(text: str = "Hello Blocks 42", size: tuple[int, int] | None = None) -> bytes:
    """A small PNG with ``text`` in black on white (Pillow's built-in font, 36 px; 360x80 for up
    to 14 characters, wider for more): an example task."""
    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("RGB", size or (max(360, 24 * len(text) + 24), 80), "white")
    try:
        font = ImageFont.load_default(size=36)
    except TypeError:  # Pillow < 10.1: one size only
        font = ImageFont.load_default()
    ImageDraw.Draw(img).text((10, 18), text, fill="black", font=font)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
