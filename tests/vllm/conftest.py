from __future__ import annotations

import pathlib

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The tiny random Llama (``python -m replica.tinymodel``), built once per session."""
    from tests.support.vllm import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny"))
