"""POST /debug/faults: poison a rank's KV cache on purpose, to test the alerting end to end.

`build_app` mounts this router only with --enable-fault-injection; without it the
route does not exist at all (404 whatever the body).
"""
from __future__ import annotations

from fastapi import APIRouter, Request

from engine.messages import RANK_FAULTS, Fault
from service.errors import APIError, from_value_error
from service.protocol_routes import FaultRequest, StatusResponse
from service.responses import ERROR_RESPONSES
from service.state import AppState

router = APIRouter()
ROUTE = "/debug/faults"


@router.post(ROUTE, response_model=StatusResponse, responses=ERROR_RESPONSES)
async def inject_fault(body: FaultRequest, request: Request) -> StatusResponse:
    state: AppState = request.app.state.kvsentry
    if not state.client.ready:
        raise APIError(503, "model is still loading", None, "loading", {"Retry-After": "1"})
    config = state.config
    if body.layer >= config.model.num_layers:
        raise APIError(400, f"layer must be < {config.model.num_layers}", "layer", "invalid_value")
    if body.block is not None and body.block >= config.num_blocks:
        raise APIError(400, f"block must be < {config.num_blocks}", "block", "invalid_value")
    if body.after_steps and body.kind not in RANK_FAULTS:
        raise APIError(400, "after_steps applies to kill_rank and hang_rank only", "after_steps", "invalid_value")
    fault = Fault(kind=body.kind, layer=body.layer, block=body.fault_block(), target=body.target,
                  after_steps=body.after_steps)
    try:
        await state.client.inject_fault(body.rank, fault)
    except ValueError as exc:
        raise from_value_error(exc, "rank") from None
    return StatusResponse(status="injected", detail={"rank": body.rank, **body.model_dump()})
