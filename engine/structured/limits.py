"""Size bounds on a structured-output spec, checked before anything compiles it.

What makes xgrammar's compile slow is the size of the automaton a spec builds, not the bytes
a client sends: an enum or choice list grows a trie whose compile time rises steeply past a
few thousand entries (on a 512-token vocabulary, 2026-12-04, Xeon AMX 2 cores shared: 5,000
enum strings 0.5 s, 9,000 9 s, 20,000 62 s), and nested objects grow it with depth (200
levels 3 s, 400 levels 31 s). Repeat counts ({n}, minItems, maxLength) are cheap: xgrammar
expands them lazily (a{100000} compiles in 8 ms). So the bounds are the spec's bytes, the
entries of one enum or choice list, and the nesting depth; each check is a linear walk over
at most max_structured_outputs_spec_bytes of JSON, cheap enough for the front end's event loop.
"""
from __future__ import annotations

import json
from typing import Protocol

from engine.structured.spec import StructuredOutputs


class SpecLimits(Protocol):
    """The bounds, as EngineConfig carries them (structured/ sits below config/: no import of it)."""
    max_structured_outputs_spec_bytes: int
    max_structured_outputs_choices: int
    max_structured_outputs_depth: int


SPEC_TOO_LARGE = "structured_outputs_too_large"  # the OpenAI-style error code of every refusal here


class SpecTooLarge(ValueError):
    """Reads "field: why", like every request refusal; `field` and `code` say it typed."""

    def __init__(self, field: str, why: str, code: str = SPEC_TOO_LARGE):
        super().__init__(f"{field}: {why}")
        self.field = field
        self.code = code

_JSON_KINDS = ("json", "structural_tag")


def check_spec_limits(config: SpecLimits, spec: StructuredOutputs, field: str | None = None) -> None:
    """Refuse `spec` (SpecTooLarge naming `field`, default structured_outputs.<kind>) when it is
    over one of the config's bounds."""
    field = field or f"structured_outputs.{spec.kind}"
    size = len(spec.spec.encode())
    limit = config.max_structured_outputs_spec_bytes
    if size > limit:
        raise SpecTooLarge(field, f"{size} bytes is over this server's limit of {limit} bytes "
                                    "(--max-structured-outputs-spec-bytes)")
    if spec.kind == "choice":
        _check_entries(config, field, len(json.loads(spec.spec)), "choices")
    elif spec.kind in _JSON_KINDS:
        try:
            document = json.loads(spec.spec)
        except RecursionError:  # deeper than Python's parser goes: far past any depth bound
            raise SpecTooLarge(field, _too_deep(config)) from None
        except ValueError:
            return  # not JSON: the compile refuses it with its own reason
        _check_json(config, field, document)


def _check_entries(config: SpecLimits, field: str, count: int, what: str) -> None:
    limit = config.max_structured_outputs_choices
    if count > limit:
        raise SpecTooLarge(field, f"{count} {what} is over this server's limit of {limit} "
                                    "(--max-structured-outputs-choices)")


def _too_deep(config: SpecLimits) -> str:
    return (f"nested deeper than this server's limit of {config.max_structured_outputs_depth} levels "
            "(--max-structured-outputs-depth)")


def _check_json(config: SpecLimits, field: str, document) -> None:
    """One iterative pass (no recursion: the depth is what is being bounded) over every value."""
    max_depth = config.max_structured_outputs_depth
    stack = [(document, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > max_depth:
            raise SpecTooLarge(field, _too_deep(config))
        if isinstance(value, dict):
            enum = value.get("enum")
            if isinstance(enum, list):
                _check_entries(config, f"{field}.enum", len(enum), "enum values")
            stack.extend((child, depth + 1) for child in value.values())
        elif isinstance(value, list):
            stack.extend((child, depth + 1) for child in value)
