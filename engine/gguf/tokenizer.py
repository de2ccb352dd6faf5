"""A `tokenizers` tokenizer rebuilt from a GGUF file's tokenizer.ggml.* metadata.

A GGUF carries no tokenizer.json, only the vocabulary, merges, token types and special ids.
Two kinds are rebuilt, the ones llama.cpp calls:
- "gpt2": byte-level BPE (SmolLM, Llama 3, Qwen, DeepSeek); the text is split by the
  pre-tokenizer regex the vocabulary was trained with, named by tokenizer.ggml.pre;
- "llama": SentencePiece BPE with byte fallback (Llama 2, Mistral), merges from the file or
  derived from the token scores.
Tokens llama.cpp marks CONTROL become special added tokens (matched whole, skipped when
decoding with skip_special_tokens), USER_DEFINED ones plain added tokens.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from engine.gguf.hf_config import eos_token_ids
from engine.gguf.reader import GGUFFile

logger = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3_SPLITS = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
                     r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                     r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the splits llama.cpp (llama-vocab.cpp) applies before byte-level BPE,
# in order, in the spelling of the model's own tokenizer.json.
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    **{name: (r"\p{N}", _GPT2_SPLIT) for name in
       ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")},
    **{name: (_GPT2_SPLIT,) for name in ("gpt-2", "mpt", "olmo", "jais", "trillion")},
    **{name: (_LLAMA3_SPLIT,) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                                                "pixtral", "midm-2.0", "lfm2", "dbrx", "smaug-bpe")},
    **{name: (_QWEN2_SPLIT,) for name in ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan")},
    **{name: _DEEPSEEK3_SPLITS for name in ("deepseek-v3", "hunyuan-dense")},
    **{name: (_GPT4O_SPLIT,) for name in ("gpt-4o", "minimax-m2")},
    "tekken": (_TEKKEN_SPLIT,),
}


@dataclass(frozen=True)
class GGUFTokenizer:
    backend: Tokenizer
    bos_token: str | None
    eos_token: str | None
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # every id that ends a turn
    chat_template: str | None


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: byte-level BPE spells every token with it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_bpe(meta: dict[str, Any]) -> Tokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for index, token in enumerate(meta["tokenizer.ggml.tokens"]):
        if not set(token) <= alphabet:  # a token stored as raw text (e.g. with a real space)
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = index
    merges = [tuple(merge.split(" ")) for merge in meta.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS:
        logger.warning("GGUF pre-tokenizer %r is not known here; splitting text as GPT-2 does", pre)
    splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated")
              for pattern in _PRE_SPLITS.get(pre, (_GPT2_SPLIT,))]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE keeps no merge list: a pair merges when the merged piece is in the
    vocabulary, higher score first. Every split of every piece into two vocabulary pieces,
    best merged score first (ties: shorter left, then shorter right piece, then id order)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    candidates = []
    for merged, score in zip(tokens, scores):
        pairs = [(merged[:i], merged[i:]) for i in range(1, len(merged))
                 if merged[:i] in vocab and merged[i:] in vocab]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        candidates += [(left, right, score) for left, right in pairs]
    candidates.sort(key=lambda c: (c[2], len(c[0]), len(c[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _sentencepiece_bpe(meta: dict[str, Any]) -> Tokenizer:
    tokens = meta["tokenizer.ggml.tokens"]
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]
    else:
        merges = spm_merges(tokens, meta["tokenizer.ggml.scores"])
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
    add_prefix_space = meta.get("tokenizer.ggml.add_space_prefix", True)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_prefix_space else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


_BUILDERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}


def _token(meta: dict[str, Any], key: str) -> str | None:
    token_id = meta.get(f"tokenizer.ggml.{key}")
    tokens = meta["tokenizer.ggml.tokens"]
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


def _add_special_tokens(tokenizer: Tokenizer, meta: dict[str, Any]) -> None:
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    vocab = tokenizer.get_vocab()
    named = {_token(meta, key) for key in ("bos_token_id", "eos_token_id", "unknown_token_id",
                                           "padding_token_id")} - {None}
    # A CONTROL token outside the vocabulary's own spelling is a mislabel: adding it would
    # give it a new id past the model's vocabulary.
    special = [AddedToken(token, normalized=False, special=True)
               for token, kind in zip(tokens, types)
               if (kind == CONTROL or token in named) and token in vocab]
    plain = [AddedToken(token, normalized=False, special=False)
             for token, kind in zip(tokens, types) if kind == USER_DEFINED and token in vocab]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)


def _post_processor(meta: dict[str, Any], tokenizer_type: str) -> processors.TemplateProcessing:
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos = meta.get("tokenizer.ggml.add_bos_token", tokenizer_type == "llama")
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
    ends = {key: (_token(meta, key), meta.get(f"tokenizer.ggml.{key}")) for key in ("bos_token_id", "eos_token_id")}
    first = [ends["bos_token_id"]] if add_bos and ends["bos_token_id"][0] is not None else []
    last = [ends["eos_token_id"]] if add_eos and ends["eos_token_id"][0] is not None else []
    head, tail = [t for t, _ in first], [t for t, _ in last]
    return processors.TemplateProcessing(
        single=[*head, "$A", *tail], pair=[*head, "$A", *tail, *head, "$B", *tail],
        special_tokens=list(dict.fromkeys(first + last)))


def build_tokenizer(gguf: GGUFFile) -> GGUFTokenizer:
    meta = gguf.metadata
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError(f"{gguf.path}: GGUF has no tokenizer (tokenizer.ggml.tokens); pass a tokenizer directory")
    if "tokenizer.huggingface.json" in meta:  # written by some converters: the exact original
        backend = Tokenizer.from_str(meta["tokenizer.huggingface.json"])
    else:
        tokenizer_type = meta.get("tokenizer.ggml.model", "gpt2")
        if tokenizer_type not in _BUILDERS:
            raise ValueError(f"{gguf.path}: GGUF tokenizer model {tokenizer_type!r} is not supported "
                             f"(supported: {', '.join(_BUILDERS)})")
        backend = _BUILDERS[tokenizer_type](meta)
        _add_special_tokens(backend, meta)
        backend.post_processor = _post_processor(meta, tokenizer_type)
    return GGUFTokenizer(backend=backend, bos_token=_token(meta, "bos_token_id"),
                         eos_token=_token(meta, "eos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
                         eos_token_ids=eos_token_ids(gguf), chat_template=meta.get("tokenizer.chat_template"))
