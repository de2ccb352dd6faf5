"""Logprobs in the two OpenAI shapes: completions (parallel lists) and chat (objects)."""
from __future__ import annotations

import functools

from engine.messages import TokenLogprob
from engine.tokenizer import Tokenizer
from service.protocol import CompletionLogprobs, TokenLogprobOut, TopLogprob


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE token characters -> bytes."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenFormatter:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    @functools.lru_cache(maxsize=65536)
    def raw_bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.id_to_token(token_id)
        decoder = _byte_decoder()
        if piece and all(c in decoder for c in piece):
            return bytes(decoder[c] for c in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    @functools.lru_cache(maxsize=65536)
    def text(self, token_id: int) -> str:
        """The token's text; "bytes:\\xNN..." for a piece of a multi-byte character (as OpenAI does)."""
        raw = self.raw_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    @functools.lru_cache(maxsize=65536)
    def text_length(self, token_id: int) -> int:
        """Characters the token adds to the returned text (special tokens add none)."""
        return len(self.tokenizer.decode([token_id], skip_special_tokens=True))

    # -- /v1/completions ------------------------------------------------------------------------
    def completion(self, entries: list[TokenLogprob | None], token_ids: list[int],
                   text_offset: int) -> CompletionLogprobs:
        """Parallel lists; an entry of None (the first prompt token) has no logprob."""
        out = CompletionLogprobs()
        offset = text_offset
        for token_id, entry in zip(token_ids, entries):
            token = self.text(token_id)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += self.text_length(token_id)
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(entry.logprob)
            top = {token: entry.logprob}
            for other_id, value in entry.top:
                top.setdefault(self.text(other_id), value)
            out.top_logprobs.append(top)
        return out

    # -- /v1/chat/completions -------------------------------------------------------------------------
    def chat(self, entries: list[TokenLogprob]) -> list[TokenLogprobOut]:
        return [TokenLogprobOut(token=self.text(e.token_id), logprob=e.logprob,
                                bytes=list(self.raw_bytes(e.token_id)),
                                top_logprobs=[TopLogprob(token=self.text(t), logprob=v,
                                                         bytes=list(self.raw_bytes(t)))
                                              for t, v in e.top])
                for e in entries]


def merge(into: CompletionLogprobs, more: CompletionLogprobs) -> CompletionLogprobs:
    into.text_offset += more.text_offset
    into.token_logprobs += more.token_logprobs
    into.tokens += more.tokens
    into.top_logprobs += more.top_logprobs
    return into
