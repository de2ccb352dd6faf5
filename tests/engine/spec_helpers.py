"""A tiny checkpoint whose next token mostly follows a fixed permutation of the vocabulary, so
prompt lookup has something to find: a prompt that walks a stretch of the cycle and then
returns to its start is continued along the cycle, as an extraction answer quotes its prompt.

The tiny-llama preset's layers stay (scaled down, so the cache and attention still shape every
logit), the final norm is one, and lm_head maps token t's embedding onto token NEXT[t]: with
`sharpness` 1 the model gives NEXT[t] ~0.75 of the mass at temperature 1, the rest spread.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from service.demo.checkpoint import write_preset

VOCAB = 512
FIRST = 5  # ids below are special (bos, eos ...): never in a cycle
NEXT = list(range(VOCAB))
_order = list(range(FIRST, VOCAB))
random.Random(7).shuffle(_order)
for _a, _b in zip(_order, _order[1:] + _order[:1]):
    NEXT[_a] = _b
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def write_cycling_checkpoint(path: str | Path, sharpness: float = 1.0, layer_scale: float = 0.05,
                             preset: str = "tiny-llama") -> str:
    """`preset`: a demo preset with a 512-token vocabulary (tiny-llama; tiny-deepseek-v3 for DP + EP)."""
    path = Path(path)
    write_preset(path, preset, init_scale=0.3)
    weights = load_file(str(path / "model.safetensors"))
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * layer_scale
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    embed = weights["model.embed_tokens.weight"]                      # [vocab, hidden]
    unit = embed / embed.norm(dim=-1, keepdim=True)
    # The token's own embedding dominates the residual stream: the layers nudge, not decide.
    weights["model.embed_tokens.weight"] = embed * 8.0
    head = torch.zeros_like(weights["lm_head.weight"])                 # [vocab, hidden]
    head[torch.tensor(NEXT)] = sharpness * unit
    head[:FIRST] = 0.0
    weights["lm_head.weight"] = head.contiguous()
    save_file(weights, str(path / "model.safetensors"))
    return str(path)


def walk(start: int, length: int) -> list[int]:
    tokens = [start]
    while len(tokens) < length:
        tokens.append(NEXT[tokens[-1]])
    return tokens


def quoting_prompt(rng: random.Random, quote: int = 12, noise: int = 6) -> list[int]:
    """Noise, a stretch of the cycle, more noise, then the stretch's first token again."""
    start = rng.randrange(FIRST, VOCAB)
    return ([rng.randrange(FIRST, VOCAB) for _ in range(noise)] + walk(start, quote)
            + [rng.randrange(FIRST, VOCAB) for _ in range(noise)] + [start])
