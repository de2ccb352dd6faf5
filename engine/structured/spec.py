"""What a request's output must match: the grammar spec that travels in SamplingParams.

Only the spec crosses the process boundary; each rank compiles it (engine/structured/grammar.py)
with the tokenizer it loads itself, so nothing compiled is ever pickled.
"""
from __future__ import annotations

import json

import msgspec

# json: a JSON schema (a JSON document); json_object: any JSON object (spec unused);
# regex: a regular expression; choice: a JSON list of strings, one of which is the output;
# grammar: an EBNF (GBNF) grammar whose root rule is `root`; structural_tag: xgrammar's structural
# tag as JSON, either {"structures": [{"begin", "schema", "end"}], "triggers": [...]} (vLLM's
# form: free text until a trigger, then a tagged JSON) or xgrammar's {"type": "structural_tag", ...}.
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class StructuredOutputs(msgspec.Struct, frozen=True, kw_only=True):
    kind: str
    spec: str = ""
    # JSON only: let the model put whitespace between tokens. Off by default, so a small model
    # cannot spend its max_tokens on runs of spaces and newlines inside the object.
    any_whitespace: bool = False
    # Reasoning models: the grammar applies only after these tokens (the end of the thinking,
    # e.g. "</think>"); before them the output is free. Empty: from the first token.
    after_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured_outputs: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "choice":
            try:
                choices = json.loads(self.spec)
            except ValueError:
                choices = None
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                raise ValueError("structured_outputs.choice: must be a non-empty list of strings")
        elif self.kind != "json_object" and not self.spec:
            raise ValueError(f"structured_outputs.{self.kind}: must not be empty")

    @classmethod
    def choice(cls, choices: list[str]) -> "StructuredOutputs":
        return cls(kind="choice", spec=json.dumps(choices))
