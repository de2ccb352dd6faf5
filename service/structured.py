"""`response_format` and vLLM's `structured_outputs` -> the grammar spec the engine enforces.

The spec is compiled here, before the request is submitted, so a schema or regex the grammar
engine cannot take is a synchronous 400 naming the field (the compiled grammar is cached, and
the rank compiles the same spec again with its own copy of the tokenizer).
"""
from __future__ import annotations

import json

import msgspec

from engine.structured.grammar import GrammarError, compiler_for_model
from engine.structured.spec import StructuredOutputs
from service.errors import bad_request
from service.protocol import SamplingFields
from service.reasoning import THINK_END
from service.state import AppState


def requested_grammar(body: SamplingFields) -> tuple[StructuredOutputs | None, str | None]:
    """The request's spec and the field that asked for it (None, None: free text)."""
    fmt, so = body.response_format, body.structured_outputs
    if fmt is not None and fmt.type != "text":
        if so is not None:
            raise bad_request("structured_outputs: cannot be combined with response_format", "structured_outputs")
        if fmt.type == "json_object":
            return StructuredOutputs(kind="json_object"), "response_format"
        if fmt.type == "structural_tag":
            if not fmt.structures or not fmt.triggers:
                raise bad_request("response_format: structural_tag needs structures and triggers", "response_format")
            tag = {"structures": [{"begin": s.begin, "schema": s.schema_ or {}, "end": s.end} for s in fmt.structures],
                   "triggers": fmt.triggers}
            return StructuredOutputs(kind="structural_tag", spec=json.dumps(tag)), "response_format"
        if fmt.json_schema is None:
            raise bad_request("response_format.json_schema: required when type is json_schema",
                              "response_format.json_schema")
        if fmt.json_schema.schema_ is None:
            return StructuredOutputs(kind="json_object"), "response_format.json_schema"
        return (StructuredOutputs(kind="json", spec=json.dumps(fmt.json_schema.schema_)),
                "response_format.json_schema.schema")
    if so is None:
        return None, None
    given = {name: value for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                             ("grammar", so.grammar), ("json_object", so.json_object or None),
                                             ("structural_tag", so.structural_tag))
             if value is not None}
    if len(given) != 1:
        raise bad_request("structured_outputs: set exactly one of json, regex, choice, grammar, json_object, "
                          "structural_tag",
                          "structured_outputs")
    (kind, value), = given.items()
    param = f"structured_outputs.{kind}"
    whitespace = not so.disable_any_whitespace
    try:
        if kind == "json":
            return StructuredOutputs(kind="json", spec=json_spec(value, param), any_whitespace=whitespace), param
        if kind == "json_object":
            return StructuredOutputs(kind="json_object", any_whitespace=whitespace), param
        if kind == "structural_tag":
            return StructuredOutputs(kind="structural_tag", spec=json_spec(value, param)), param
        if kind == "choice":
            return StructuredOutputs.choice(value), param
        return StructuredOutputs(kind=kind, spec=value), param
    except ValueError as exc:
        raise bad_request(str(exc), param) from None


def json_spec(value: str | dict, param: str) -> str:
    """A JSON field given as a document or as a string holding one, re-serialised (a 400 if the
    string is not JSON)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise bad_request(f"{param}: is not valid JSON", param) from None
    return json.dumps(value)


def compile_or_refuse(state: AppState, spec: StructuredOutputs, param: str) -> None:
    try:
        compiler_for_model(state.config.model).compile(spec)
    except GrammarError as exc:
        why = str(exc).partition(": ")[2]
        raise bad_request(f"{param}: {why}", param) from None


def request_grammar(state: AppState, body: SamplingFields) -> StructuredOutputs | None:
    spec, param = requested_grammar(body)
    if spec is not None:
        compile_or_refuse(state, spec, param)
    return spec


def after_reasoning(state: AppState, spec: StructuredOutputs) -> StructuredOutputs:
    """`spec`, applied only once the model has closed its thinking (--reasoning-parser): the
    gate is the tokenizer's encoding of the closing tag (one special token in the models that
    think, such as DeepSeek-R1 and Qwen3)."""
    gate = tuple(state.tokenizer.encode(THINK_END, add_special_tokens=False))
    return msgspec.structs.replace(spec, after_token_ids=gate)
