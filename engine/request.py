"""The step data the scheduler hands down to execution: a request (it owns its KV
bookkeeping) and a step's schedule.

Data only: both sides import it (engine/core/ schedules, engine/worker/ executes), and it
imports neither, so neither imports the other.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int],
                 params: SamplingParams, eos_token_id: int | None, arrival_time: float,
                 wait_for: "Request | None" = None, priority: int = 0):
        self.request_id = request_id            # the client's id (shared by n > 1 samples)
        self.index = index                      # which sample
        self.key = f"{request_id}#{index}"      # unique inside the engine
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.eos_token_id = eos_token_id
        self.eos_token_ids: frozenset[int] = frozenset()  # set by the engine: the model's end-of-turn ids
        self.prompt_logprobs_sent = 1          # prompt tokens [1, this) already have logprobs sent
        self.arrival_time = arrival_time
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0           # tokens whose K/V are in the cache
        self.block_ids: list[int] = []         # the block table
        self.num_hashed_blocks = 0             # leading full blocks registered in the prefix cache
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = -1            # prefix-cache hit at first schedule
        self.status = RequestStatus.WAITING
        self.added_at = time.monotonic()          # arrival at this rank
        self.first_scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # Sibling samples (n > 1) wait until the first one's prompt is cached, then share it.
        self.wait_for = wait_for
        # Proposed next tokens (engine/spec_decode/) the next step verifies; set after each step.
        self.draft_token_ids: list[int] = []
        self.grammar = None  # RequestGrammar (engine/structured/grammar.py) when the output is constrained
        self.waiting_for_grammar = False  # its grammar is compiling off the step loop: not schedulable yet
        self.generator: torch.Generator | None = None
        self.priority = priority  # lower runs first under --scheduling-policy priority (engine/core/request_queue.py)
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed((params.seed + index) % 2**63)

    def record_token(self) -> None:
        """Stamp a sampled token's time (traces report prefill and decode from these)."""
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def ready(self) -> bool:
        if self.waiting_for_grammar:
            return False
        sibling = self.wait_for
        return sibling is None or sibling.is_finished or sibling.num_computed_tokens >= sibling.num_prompt_tokens

    def __repr__(self) -> str:
        return (f"Request({self.key}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_ids}, {self.status.value})")


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)
    # request key -> the draft tokens scheduled after its last token (speculative decoding):
    # they are the last len(drafts) of its scheduled tokens.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def num_reqs(self) -> int:
        return len(self.scheduled)
