"""Without the `ocr` extra, the OCR example (and `blocks demo`, which skips it) says how to install
it, for a wheel as for a checkout."""

from __future__ import annotations

import sys

import pytest

from aios_blocks.examples import ocr


def test_without_the_extra_it_names_the_install_for_a_wheel_and_for_a_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    # it said only "pip install -e '.[ocr]'", which an installed wheel (no '.') cannot run
    monkeypatch.setitem(sys.modules, "rapidocr_onnxruntime", None)  # import fails as when it is missing
    why = ocr.available()
    assert why is not None and "pip install 'aios-blocks[ocr]'" in why and "pip install -e '.[ocr]'" in why, why
