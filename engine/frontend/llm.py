"""Offline batch generation: `LLM(model=PATH, **engine_args).generate(prompts, params)`."""
from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

from engine.config import EngineConfig
from engine.engine_core.engine_core import EngineCore
from engine.engine_core.preparing import compile_blocking
from engine.core.validation import validate_request
from engine.messages import EngineRequest
from engine.frontend.output_processor import RequestState
from engine.frontend.outputs import CompletionOutput, RequestOutput, logprob_dict
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str, **engine_args: Any):
        self.config = EngineConfig.create(model, **engine_args)
        self.tokenizer = Tokenizer(self.config.model.tokenizer)
        if self.config.parallel.data_parallel_size > 1:
            from engine.dp.client import DPEngineClient
            self.engine = DPEngineClient(self.config)
        else:
            self.engine = EngineCore(self.config)
        self._ids = itertools.count()

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close:
            close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def validate(self, request: EngineRequest) -> None:
        validate_request(self.config, request)
        if request.params.structured_outputs is not None:  # offline, the caller waits anyway
            compile_blocking(self.config, request.params.structured_outputs)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise ValueError("prompt: must be a string or a list of token ids")

    def make_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                     priority: int = 0) -> EngineRequest:
        token_ids = self.encode_prompt(prompt)
        return EngineRequest(request_id or str(next(self._ids)), token_ids, params,
                             eos_token_id=self.tokenizer.eos_token_id, arrival_time=time.time(), priority=priority)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 rank_of: Sequence[int] | None = None, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; `rank_of` pins prompt i to DP rank rank_of[i] (DP only);
        `priority[i]` is prompt i's priority (vLLM's; needs scheduling_policy="priority")."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if not prompts:
            raise ValueError("prompts: must not be empty")
        params = params or SamplingParams()
        param_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError("params: need one SamplingParams per prompt")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError("priority: need one priority per prompt")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        requests = [self.make_request(p, sp, priority=pr) for p, sp, pr in zip(prompts, param_list, priorities)]
        for request in requests:  # all or nothing: a bad prompt must not leave others running
            self.validate(request)
        states = {}
        for i, request in enumerate(requests):
            if rank_of is not None:
                self.engine.add_request(request, rank=rank_of[i])
            else:
                self.engine.add_request(request)
            states[request.request_id] = RequestState(request.request_id, request.prompt_token_ids,
                                                      request.params, self.tokenizer)
        pending = set(states)
        while pending:
            for out in self.engine.step():
                state = states.get(out.request_id)
                if state is None:
                    continue
                if state.process(out) and state.samples[out.index].finish_reason == "stop":
                    self._abort_sample(state, out.index)
                if state.finished:
                    pending.discard(out.request_id)
        return [self._to_output(p, states[r.request_id]) for p, r in zip(prompts, requests)]

    def _abort_sample(self, state: RequestState, index: int) -> None:
        # A stop string was seen in the text: the engine must stop this sample too.
        self.engine.abort([state.request_id], index)

    @staticmethod
    def _to_output(prompt: Prompt, state: RequestState) -> RequestOutput:
        outputs = []
        for s in state.samples:
            logprobs = [logprob_dict(e) for e in s.logprobs] if state.params.logprobs is not None else None
            cumulative = sum(e.logprob for e in s.logprobs) if s.logprobs else None
            outputs.append(CompletionOutput(s.index, s.text, s.token_ids, logprobs, s.finish_reason,
                                            s.stop_reason, cumulative))
        prompt_lps = None
        if state.params.prompt_logprobs is not None:
            prompt_lps = [logprob_dict(e) for e in state.prompt_logprobs]
            prompt_lps += [None] * (len(state.prompt_token_ids) - len(prompt_lps))
        return RequestOutput(state.request_id, prompt if isinstance(prompt, str) else None,
                             state.prompt_token_ids, outputs, True, prompt_lps, state.num_cached_tokens)
