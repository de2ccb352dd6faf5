"""`response_format` and vLLM's `structured_outputs` -> the grammar spec the engine enforces.

Only the cheap size bounds are checked here (engine/structured/limits.py), before the request
is submitted: compiling a spec can take seconds, so it never runs on this event loop. The rank
compiles it off its step loop; a spec it cannot compile, or not within the compile timeout,
comes back as a typed refusal that service/generate.py answers with a 400 naming the field.
"""
from __future__ import annotations

import json

import msgspec

from engine.structured.limits import SPEC_TOO_LARGE, SpecTooLarge, check_spec_limits
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
            return StructuredOutputs(kind="structural_tag", spec=json_spec(tag, "response_format")), "response_format"
        if fmt.json_schema is None:
            raise bad_request("response_format.json_schema: required when type is json_schema",
                              "response_format.json_schema")
        if fmt.json_schema.schema_ is None:
            return StructuredOutputs(kind="json_object"), "response_format.json_schema"
        param = "response_format.json_schema.schema"
        return StructuredOutputs(kind="json", spec=json_spec(fmt.json_schema.schema_, param)), param
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
        except RecursionError:
            raise bad_request(f"{param}: nested too deeply", param, SPEC_TOO_LARGE) from None
    try:
        return json.dumps(value)
    except RecursionError:  # deeper than any --max-structured-outputs-depth
        raise bad_request(f"{param}: nested too deeply", param, SPEC_TOO_LARGE) from None


def check_limits_or_refuse(state: AppState, spec: StructuredOutputs, param: str) -> None:
    """A 400 naming `param` when `spec` is over a size bound (the rank checks them again)."""
    try:
        check_spec_limits(state.config, spec, param)
    except SpecTooLarge as exc:
        raise bad_request(str(exc), exc.field, exc.code) from None


def request_grammar(state: AppState, body: SamplingFields) -> tuple[StructuredOutputs | None, str | None]:
    """The request's spec, bounds checked, and the field that asked for it."""
    spec, param = requested_grammar(body)
    if spec is not None:
        check_limits_or_refuse(state, spec, param)
    return spec, param


def after_reasoning(state: AppState, spec: StructuredOutputs) -> StructuredOutputs:
    """`spec`, applied only once the model has closed its thinking (--reasoning-parser): the
    gate is the tokenizer's encoding of the closing tag (one special token in the models that
    think, such as DeepSeek-R1 and Qwen3)."""
    gate = tuple(state.tokenizer.encode(THINK_END, add_special_tokens=False))
    return msgspec.structs.replace(spec, after_token_ids=gate)
