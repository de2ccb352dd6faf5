"""Grammar-constrained decoding with xgrammar: compile a spec, match one request's tokens.

One GrammarCompiler per tokenizer (its TokenizerInfo is built once from the vocabulary and
sized to the model's vocabulary, which may be larger than the tokenizer's: the extra rows are
never allowed); compiled grammars are cached by spec. Each sample of a request owns one
`RequestGrammar`, a GrammarMatcher that accepts exactly the request's output tokens, once each.
"""
from __future__ import annotations

import functools
import json
import re

import msgspec
import torch
import xgrammar as xgr

from engine.structured.spec import StructuredOutputs

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept per compiler (the compiler caches internally too)


class GrammarError(ValueError):
    """A spec that cannot compile; reads "field: why" like every request refusal."""


def build_compiler(backend, vocab_size: int, stop_token_ids: list[int]) -> "GrammarCompiler":
    """`backend`: a `tokenizers.Tokenizer` (engine/tokenizer.py's Tokenizer.backend)."""
    from transformers import PreTrainedTokenizerFast
    wrapped = PreTrainedTokenizerFast(tokenizer_object=backend)
    info = xgr.TokenizerInfo.from_huggingface(wrapped, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    return GrammarCompiler(info)


def choice_regex(choices: list[str]) -> str:
    return "|".join(f"({re.escape(c)})" for c in choices)


class GrammarCompiler:
    def __init__(self, info: xgr.TokenizerInfo):
        self.info = info
        self.vocab_size = info.vocab_size
        self._compiler = xgr.GrammarCompiler(info)
        self.compile = functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)(self._compile)

    def _compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        field = f"structured_outputs.{spec.kind}"
        try:
            if spec.kind == "json":
                schema = json.loads(spec.spec)
                if not isinstance(schema, (dict, bool)):
                    raise GrammarError(f"{field}: a JSON schema must be an object")
                return self._compiler.compile_json_schema(spec.spec, any_whitespace=spec.any_whitespace)
            if spec.kind == "json_object":
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=spec.any_whitespace)
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.spec)
            if spec.kind == "choice":
                return self._compiler.compile_regex(choice_regex(json.loads(spec.spec)))
            if spec.kind == "structural_tag":
                return self._structural_tag(field, json.loads(spec.spec))
            return self._compiler.compile_grammar(spec.spec)
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:
            why = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise GrammarError(f"{field}: cannot be compiled: {_strip_location(why)}") from None

    def _structural_tag(self, field: str, tag) -> xgr.CompiledGrammar:
        if not isinstance(tag, dict):
            raise GrammarError(f"{field}: must be a JSON object")
        if "structures" not in tag:  # xgrammar's own format
            return self._compiler.compile_structural_tag(json.dumps(tag))
        structures, triggers = tag.get("structures"), tag.get("triggers")
        if not (isinstance(structures, list) and structures and isinstance(triggers, list) and triggers):
            raise GrammarError(f"{field}: needs non-empty structures and triggers")
        items = []
        for s in structures:
            if not (isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)):
                raise GrammarError(f"{field}: each structure needs begin and end strings")
            items.append(xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema") or {}), end=s["end"]))
        return self._compiler.compile_structural_tag(items, triggers)

    def matcher(self, spec: StructuredOutputs) -> "RequestGrammar":
        # The grammar is keyed without the gate: the same schema compiles once for every caller.
        grammar = self.compile(msgspec.structs.replace(spec, after_token_ids=()))
        return RequestGrammar(xgr.GrammarMatcher(grammar), spec.after_token_ids)


def _strip_location(message: str) -> str:
    # xgrammar prefixes "[hh:mm:ss] /path/file.cc:line: " to its errors; the client needs the rest.
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", message)


class RequestGrammar:
    """The matcher of one sample. `num_accepted` counts the output tokens it has taken, so a
    preempted request whose outputs are recomputed is never advanced twice by the same token.

    With a gate (`after`: the token ids that end a reasoning model's thinking), the matcher
    is inactive -- no mask, no tokens fed -- until the output contains the gate; the grammar
    then constrains what follows it, the answer."""

    def __init__(self, matcher: xgr.GrammarMatcher, after: tuple[int, ...] = ()):
        self.matcher = matcher
        self.num_accepted = 0
        self.after = list(after)
        self.active = not after

    @property
    def is_terminated(self) -> bool:
        return self.active and self.matcher.is_terminated()

    def _open_gate(self, output_token_ids: list[int]) -> None:
        n = len(self.after)
        # Only the newly produced tokens (and the n - 1 before them) can complete the gate.
        for end in range(max(n, self.num_accepted + 1), len(output_token_ids) + 1):
            if output_token_ids[end - n:end] == self.after:
                self.active, self.num_accepted = True, end
                return
        self.num_accepted = len(output_token_ids)

    def accept(self, output_token_ids: list[int]) -> bool:
        """Advance over the outputs not yet accepted; False when the grammar refuses one."""
        if not self.active:
            self._open_gate(output_token_ids)
            if not self.active:
                return True
        for token in output_token_ids[self.num_accepted:]:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                return False
            self.num_accepted += 1
        return True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


def apply_grammars(logits: torch.Tensor,  # [num_reqs, vocab] float32 on CPU, masked in place
                   grammars: list[RequestGrammar | None]) -> None:
    """Mask each grammar row's disallowed tokens to -inf, in one fill over the batch."""
    rows = [i for i, g in enumerate(grammars) if g is not None and g.active]
    if not rows:
        return
    bitmask = xgr.allocate_token_bitmask(len(grammars), logits.shape[-1])  # [num_reqs, ceil(vocab/32)] int32
    for row in rows:
        grammars[row].fill(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)


def compiler_for_model(model) -> GrammarCompiler:
    """`model`: a ModelConfig; its end-of-turn ids end a grammar (the matcher's stop tokens)."""
    return compiler_for(model.tokenizer, model.vocab_size, tuple(sorted(set(model.eos_token_ids))))


@functools.lru_cache(maxsize=4)
def compiler_for(tokenizer_path: str, vocab_size: int, stop_token_ids: tuple[int, ...]) -> GrammarCompiler:
    """The process's compiler for a tokenizer (a rank and the front end each build their own)."""
    from engine.tokenizer import Tokenizer
    return build_compiler(Tokenizer(tokenizer_path).backend, vocab_size, list(stop_token_ids))
