"""Whether a request ends after the token it just sampled, and why: its stop rules, then its
grammar (constrained outputs)."""
from __future__ import annotations

from engine.request import Request

Finish = tuple[str | None, int | str | None]  # (finish reason, stop reason); (None, None): go on


def finish_after(request: Request, token: int, max_len: int) -> Finish:
    reason, stop_reason = _stop_rules(request, token, max_len)
    if request.grammar is not None and reason is None:
        if not request.grammar.accept(request.output_token_ids):
            return "error", "token refused by the grammar"
        if request.grammar.is_terminated:
            return "stop", None
    return reason, stop_reason


def _stop_rules(request: Request, token: int, max_len: int) -> Finish:
    params = request.params
    if request.num_output_tokens >= params.min_tokens:
        if token in request.eos_token_ids and not params.ignore_eos:
            return "stop", None
        if token in params.stop_token_ids:
            return "stop", token
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_len:
        return "length", None
    return None, None
