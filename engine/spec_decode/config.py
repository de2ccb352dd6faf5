"""--speculative-config: vLLM's JSON shape, only its prompt-lookup (n-gram) method."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SPECULATIVE_METHODS = ("ngram",)  # proposals from the request's own tokens; no draft model
MAX_SPECULATIVE_TOKENS = 16       # a verify step runs 1 + k query tokens per request


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4   # k: draft tokens verified per step
    prompt_lookup_max: int = 4        # longest suffix n-gram looked up
    prompt_lookup_min: int = 2        # shortest suffix n-gram that may propose

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method {self.method!r} is not supported; "
                             f"supported: {', '.join(SPECULATIVE_METHODS)} (prompt lookup)")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max")


def parse_speculative_config(value: "str | dict[str, Any] | SpeculativeConfig | None") -> SpeculativeConfig | None:
    """A JSON object (the flag's text), a dict, a config or None (no speculation)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config: not a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("speculative_config: must be a JSON object")
    value = dict(value)
    if "method" not in value:
        raise ValueError('speculative_config: "method" is required (supported: ngram)')
    if value["method"] not in SPECULATIVE_METHODS:  # before the keys: a draft model's config names its own
        raise ValueError(f"speculative_config: method {value['method']!r} is not supported; "
                         f"supported: {', '.join(SPECULATIVE_METHODS)} (prompt lookup)")
    if value.get("prompt_lookup_max") is not None and value.get("prompt_lookup_min") is None:
        value["prompt_lookup_min"] = min(SpeculativeConfig.prompt_lookup_min, value["prompt_lookup_max"])
    known = set(SpeculativeConfig.__dataclass_fields__)
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config: unsupported key(s) {', '.join(unknown)}; "
                         f"supported: {', '.join(sorted(known))}")
    for key, item in value.items():
        if key != "method" and (not isinstance(item, int) or isinstance(item, bool)):
            raise ValueError(f"speculative_config: {key} must be an integer")
    return SpeculativeConfig(**{k: v for k, v in value.items() if v is not None})
