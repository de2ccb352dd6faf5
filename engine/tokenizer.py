"""The checkpoint's tokenizer (tokenizer.json via `tokenizers`, or rebuilt from a GGUF file's
metadata) and chat template."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from engine.chat_template import ChatTemplate
from engine.gguf.reader import is_gguf_path, read_gguf
from engine.gguf.tokenizer import build_tokenizer


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config files
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, path: str | Path):
        """`path`: a directory with tokenizer.json (and tokenizer_config.json, ...) or a .gguf file."""
        root = Path(path)
        self._template: ChatTemplate | None = None
        if is_gguf_path(root):
            gguf = build_tokenizer(read_gguf(root))
            self.backend = gguf.backend
            self.bos_token, self.eos_token = gguf.bos_token, gguf.eos_token
            self.eos_token_id: int | None = gguf.eos_token_id
            self.eos_token_ids: list[int] = list(gguf.eos_token_ids)
            self.chat_template: str | None = gguf.chat_template
            return
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"model directory {root} has no tokenizer.json")
        self.backend = HFTokenizer.from_file(str(tokenizer_file))
        config = self._read_json(root / "tokenizer_config.json")
        generation = self._read_json(root / "generation_config.json")
        model_config = self._read_json(root / "config.json")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        eos_id = generation.get("eos_token_id", model_config.get("eos_token_id"))
        self.eos_token_ids = eos_id if isinstance(eos_id, list) else ([eos_id] if eos_id is not None else [])
        if isinstance(eos_id, list):
            eos_id = eos_id[0] if eos_id else None
        if eos_id is None and self.eos_token is not None:
            eos_id = self.backend.token_to_id(self.eos_token)
        self.eos_token_id = eos_id
        template_file = root / "chat_template.jinja"
        self.chat_template = (template_file.read_text() if template_file.is_file()
                              else config.get("chat_template"))

    @staticmethod
    def _read_json(path: Path) -> dict[str, Any]:
        return json.loads(path.read_text()) if path.is_file() else {}

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return self.backend.id_to_token(token_id) or ""

    @property
    def template(self) -> ChatTemplate | None:
        """The checkpoint's chat template, compiled on first use."""
        if self._template is None and self.chat_template is not None:
            self._template = ChatTemplate(self.chat_template)
        return self._template

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            template: ChatTemplate | None = None, **kwargs: Any) -> str:
        """`template`: another template than the checkpoint's (a server's or a request's)."""
        template = template or self.template
        if template is None:
            raise ValueError("messages: this model has no chat template; use /v1/completions")
        return template.render(messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
