"""Load a checkpoint into a model: a Hugging Face directory (sharded or not) of safetensors,
or a GGUF file, dequantized into the serving dtype."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from engine import envs
from engine.config import EngineConfig
from engine.gguf.reader import is_gguf_path, read_gguf
from engine.gguf.weights import QuantRows, gguf_weights
from engine.memory.host_memory import release_freed_memory
from engine.models.block_embedding import BlockEmbedding
from engine.models.int8_linear import int8_formats
from engine.models.layers import Linear
from engine.models.registry import build_model

logger = logging.getLogger(__name__)


def checkpoint_files(path: str | Path) -> list[Path]:
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({root / name for name in weight_map.values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model directory {root} has no *.safetensors weights")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"model directory {root} is missing weight file(s): {', '.join(missing)}")
    return files


def safetensors_weights(path: str | Path, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if model.wants_weight(name):
                    yield name, f.get_tensor(name)


def load_model(config: EngineConfig) -> nn.Module:
    """Build the model for this rank and fill it; only tensors the rank wants are read."""
    start = time.perf_counter()
    model, num_tensors = _build_and_fill(config)
    # The heap's free pages go back once the loading's locals are gone (the checkpoint's copies,
    # the dense tensors a dtype change replaced): trimming inside the loading left them resident,
    # 0.54 GB of a 1B Q4_0 rank's 1.8 GB (2026-12-05, Xeon).
    release_freed_memory()
    logger.info("loaded %s (%d tensors, %s) in %.1f s on DP rank %d", Path(config.model.path).name, num_tensors,
                str(config.model.dtype).removeprefix("torch."), time.perf_counter() - start,
                config.parallel.data_parallel_rank)
    return model


def _build_and_fill(config: EngineConfig) -> tuple[nn.Module, int]:
    """The model, filled, and how many checkpoint tensors it read."""
    path = config.model.path
    # Every parameter is then filled from the checkpoint (or the load fails): initializing them
    # first would only cost time, and touch memory the int8 path never uses.
    with torch.device(config.device), uninitialized_parameters():
        model = build_model(config)
    quantized: dict[str, QuantRows] = {}
    gguf = read_gguf(path) if is_gguf_path(path) else None
    # The GGUF linears multiply with int8 activations (engine/models/int8_linear.py).
    formats = (int8_formats(config.quantized_activations, config.device, config.model.dtype,
                            gguf.layer_matrix_types())
               if gguf is not None else frozenset())
    int8 = bool(formats)
    linears = blocks_only_weights(model) if int8 else frozenset()
    if gguf is not None:
        # One bar per machine is enough: DP rank 0 draws it, on a terminal only.
        progress = sys.stderr.isatty() and config.parallel.data_parallel_rank == 0
        keep = quantized if config.device == "cpu" and (int8 or not envs.disable_quant_panels()) else None
        weights = gguf_weights(gguf, config.model.hf_config, model.wants_weight, progress, keep,
                               lambda name, ggml_type: name in linears and ggml_type in formats)
    else:
        weights = safetensors_weights(path, model)
    loaded: set[str] = set()
    for name, tensor in weights:
        model.load_weight(name, tensor)
        loaded.add(name)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, rows in quantized.items():  # its blocks are the weight: no dense copy
        if name in linears and rows.ggml_type in formats and name not in loaded:
            shape_only(params[name], config.model.dtype)
            loaded.add(name)
    missing = model.missing_weights(loaded)  # names as the checkpoint spells them
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights: {', '.join(sorted(missing)[:8])}")
    model = model.to(config.model.dtype).eval()
    attach_quant_rows(model, {name: dataclasses.replace(rows, int8_activations=rows.ggml_type in formats)
                              for name, rows in quantized.items()})
    model.prepare_for_inference()
    embedding = quantized.get("model.embed_tokens.weight")
    if embedding is not None and embedding.ggml_type in formats:
        keep_embedding_blocks(model, embedding, config.model.dtype)
    return model, len(loaded)


@contextlib.contextmanager
def uninitialized_parameters() -> Iterator[None]:
    """nn.Linear and nn.Embedding built without their random initialization: their memory stays
    untouched (not resident) until the checkpoint fills it, and a 1B model builds in no time."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def blocks_only_weights(model: nn.Module) -> frozenset[str]:
    """Weights that, on the int8 path, need nothing but their GGUF blocks: those of the Linears
    that pack them (engine/models/int8_linear.py; not one whose weight is also read directly)
    and the token embedding, which gathers from them (engine/models/block_embedding.py)."""
    names = {f"{name}.weight" for name, module in model.named_modules()
             if isinstance(module, Linear) and not module.keep_weight}
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    if isinstance(embedding, nn.Embedding):
        names.add("model.embed_tokens.weight")
    return frozenset(names)


def shape_only(param: nn.Parameter, dtype: torch.dtype) -> None:
    """Swap a parameter's storage for one element broadcast to its shape, in the serving dtype:
    packing reads only its shape, and the untouched allocation goes back. In place, so a tied
    LM head (the same Parameter) sees it too."""
    param.data = torch.zeros((), dtype=dtype, device=param.device).expand(param.shape)


def keep_embedding_blocks(model: nn.Module, rows: QuantRows | None, dtype: torch.dtype) -> None:
    """On the int8 path, the token embedding as its GGUF blocks (engine/models/block_embedding.py)
    in place of its dense table (once packed, the LM head no longer shares that table): a tied LM
    head's packed blocks where it has them, else the rows as the file stores them."""
    decoder = getattr(model, "model", None)
    embedding = getattr(decoder, "embed_tokens", None)
    if decoder is None or not BlockEmbedding.takes(rows, embedding):
        return
    # A tied LM head on the kernel holds these blocks packed: they serve the lookups too.
    head = getattr(getattr(model, "lm_head", None), "packed", None)
    int8 = getattr(head, "int8", None)
    tied = (model.config.model.tie_word_embeddings and int8 is not None and int8.kernel
            and int8.ggml_type == rows.ggml_type and int8.out_features == rows.data.shape[0])
    decoder.embed_tokens = BlockEmbedding(rows, dtype, int8.blocks if tied else None)


def attach_quant_rows(model: nn.Module, quantized: dict[str, QuantRows]) -> None:
    """Hand each Linear the GGUF blocks of its weight (a tied LM head those of the embedding it
    shares), for packing (Linear.pack, cpu_gemm.PackedLinear)."""
    if not quantized:
        return
    params = dict(model.named_parameters(remove_duplicate=False))
    by_param = {id(params[name]): rows for name, rows in quantized.items() if name in params}
    for module in model.modules():
        if isinstance(module, Linear) and id(module.weight) in by_param:
            module.gguf_rows = by_param[id(module.weight)]
