"""A 1B-class GGUF to measure on: TinyLlama-1.1B's shapes (hidden 2048, 22 layers, 32 query and 4
KV heads of 64, intermediate 5632), seeded random weights, and the default model's tokenizer copied
from its GGUF metadata (SmolLM2's byte-level BPE, vocab 49152). Random weights produce noise text;
with `ignore_eos` the speed of a 1B-class decode step is real.

    python benchmarks/make_1b_gguf.py            # writes Q4_0, Q4_1, Q8_0 into the cache; prints the paths

Written with the `gguf` package's writer and its numpy quantizers (ggml's reference rounding),
one tensor at a time from the same float32 draw for all three formats: linears and the token
embedding in the file's format, the (untied) LM head in Q8_0 as llama.cpp's quantizer keeps it at
8 bits or more, norms in F32. Generated at benchmark time into <kvsentry cache>/models and reused;
never committed (about 0.6, 0.7 and 1.2 GB).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FORMATS = ("Q4_0", "Q4_1", "Q8_0")
SEED = 1_100


@dataclass(frozen=True)
class Shapes:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    context: int = 2048
    rope_base: float = 10000.0
    init_std: float = 0.02


TINYLLAMA = Shapes("tinyllama-shaped-1b", hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632)
# The same generator scaled down, for the loader test (tests/engine/test_1b_gguf_generator.py).
SMALL = Shapes("tinyllama-shaped-small", hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256)


def _tokenizer_metadata(writer, source: Path) -> int:
    """Copy every tokenizer.* key of `source` (the default model's GGUF) with its value type; the vocab size."""
    import gguf
    from engine.gguf.reader import read_gguf

    T = gguf.GGUFValueType
    meta = read_gguf(source).metadata
    for key, value in meta.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, list):
            sub = T.STRING if value and isinstance(value[0], str) else T.INT32
            writer.add_key_value(key, value, T.ARRAY, sub_type=sub)
        elif isinstance(value, bool):
            writer.add_key_value(key, value, T.BOOL)
        elif isinstance(value, int):
            writer.add_key_value(key, value, T.UINT32)
        elif isinstance(value, float):
            writer.add_key_value(key, value, T.FLOAT32)
        else:
            writer.add_key_value(key, str(value), T.STRING)
    return len(meta["tokenizer.ggml.tokens"])


def _tensors(shapes: Shapes, vocab: int, seed: int):
    """(GGUF name, float32 array [out, in] or [n]) in file order, drawn from one seeded generator."""
    rng = np.random.default_rng(seed)
    head_dim = shapes.hidden // shapes.heads

    def dense(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(shapes.init_std)

    ones = np.ones(shapes.hidden, dtype=np.float32)
    yield "token_embd.weight", dense(vocab, shapes.hidden)
    for i in range(shapes.layers):
        yield f"blk.{i}.attn_norm.weight", ones
        yield f"blk.{i}.attn_q.weight", dense(shapes.heads * head_dim, shapes.hidden)
        yield f"blk.{i}.attn_k.weight", dense(shapes.kv_heads * head_dim, shapes.hidden)
        yield f"blk.{i}.attn_v.weight", dense(shapes.kv_heads * head_dim, shapes.hidden)
        yield f"blk.{i}.attn_output.weight", dense(shapes.hidden, shapes.heads * head_dim)
        yield f"blk.{i}.ffn_norm.weight", ones
        yield f"blk.{i}.ffn_gate.weight", dense(shapes.intermediate, shapes.hidden)
        yield f"blk.{i}.ffn_up.weight", dense(shapes.intermediate, shapes.hidden)
        yield f"blk.{i}.ffn_down.weight", dense(shapes.hidden, shapes.intermediate)
    yield "output_norm.weight", ones
    yield "output.weight", dense(vocab, shapes.hidden)


def write(shapes: Shapes, paths: dict[str, Path], tokenizer_source: Path, seed: int = SEED) -> dict[str, Path]:
    """Write the model once per format in `paths` (format name -> file), all from the same weights."""
    import gguf
    from gguf.quants import quantize

    Q = gguf.GGMLQuantizationType
    writers = {}
    for fmt, path in paths.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        writer = gguf.GGUFWriter(str(path.with_suffix(".tmp")), "llama")
        writer.add_name(shapes.name)
        writer.add_file_type({"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
                              "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[fmt])
        writer.add_context_length(shapes.context)
        writer.add_embedding_length(shapes.hidden)
        writer.add_block_count(shapes.layers)
        writer.add_feed_forward_length(shapes.intermediate)
        writer.add_head_count(shapes.heads)
        writer.add_head_count_kv(shapes.kv_heads)
        writer.add_rope_dimension_count(shapes.hidden // shapes.heads)
        writer.add_rope_freq_base(shapes.rope_base)
        writer.add_layer_norm_rms_eps(1e-5)
        vocab = _tokenizer_metadata(writer, tokenizer_source)
        writer.add_vocab_size(vocab)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writers[fmt] = writer
    for name, values in _tensors(shapes, vocab, seed):
        for fmt, writer in writers.items():
            if values.ndim == 1:
                writer.add_tensor(name, values)
                continue
            qtype = Q.Q8_0 if name == "output.weight" else Q[fmt]
            writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)
    for fmt, writer in writers.items():
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        paths[fmt].with_suffix(".tmp").rename(paths[fmt])
    return paths


def model_paths(shapes: Shapes = TINYLLAMA, formats=FORMATS) -> dict[str, Path]:
    """The cached files, written (all missing formats in one pass) where absent."""
    from engine import envs
    from engine.gguf.default_model import default_model_path

    directory = envs.cache_dir() / "models"
    paths = {fmt: directory / f"{shapes.name}-seed{SEED}.{fmt}.gguf" for fmt in formats}
    missing = {fmt: path for fmt, path in paths.items() if not path.exists()}
    if missing:
        write(shapes, missing, Path(default_model_path()))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--small", action="store_true", help="the scaled-down shapes of the loader test")
    args = parser.parse_args()
    for fmt, path in model_paths(SMALL if args.small else TINYLLAMA, args.formats).items():
        print(fmt, path, f"{path.stat().st_size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
