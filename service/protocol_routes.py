"""The wire format of the routes besides generation: models, tokenizer, version, health and
fault injection (service/protocol.py holds the completion and chat requests)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from service.protocol import ChatMessage, StrictRequest


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvsentry"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(StrictRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictRequest):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class StatusResponse(BaseModel):
    status: str
    detail: dict[str, Any] | None = None


class FaultRequest(StrictRequest):
    """nan | inf: poison one value of `block`; legacy_dummy: the next dummy batch writes the
    null block; bitflip: flip one bit of sealed `block` (finite corruption, no NaN);
    stale_slot_dummy: the next dummy batch reuses the previous real step's slots; kill_rank: SIGKILL
    to the rank; hang_rank: the rank stops stepping and reporting (the wedge detector replaces it)."""
    rank: int = Field(0, ge=0)
    kind: Literal["nan", "inf", "legacy_dummy", "bitflip", "stale_slot_dummy", "kill_rank", "hang_rank"]
    layer: int = Field(0, ge=0)
    block: int | None = Field(None, ge=0)  # None: 0, or for bitflip the rank's latest sealed block
    target: Literal["k", "v", "latent"] = "k"
    # kill_rank | hang_rank only: act once the rank has run this many steps with requests of its
    # own after the fault arrives (0: at once), so a death lands mid-load whatever the timing.
    after_steps: int = Field(0, ge=0, le=1_000_000)

    def fault_block(self) -> int:
        """`Fault.block`: -1 asks the rank to pick a sealed block for a bitflip."""
        if self.block is None:
            return -1 if self.kind == "bitflip" else 0
        return self.block
