"""Front-end side of a request: incremental detokenization and stop strings.

Detokenization is incremental and UTF-8 safe: a token that ends inside a
multi-byte character yields no text until the character completes. A stop
string ends the request ("stop", stop_reason = the string) and is cut from the
text unless include_stop_str_in_output.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.messages import EngineCoreOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

# How many earlier tokens are re-decoded for context (byte-level BPE needs a few).
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # A prompt that ends inside a multi-byte character keeps its dangling bytes: the
        # completion's text is what its own tokens decode to (tokenizer.decode(output_ids), and
        # vLLM's text), so a leading continuation byte shows as U+FFFD instead of borrowing
        # the prompt's bytes to finish the character.
        while context and tokenizer.decode(context, skip_special_tokens).endswith("\ufffd"):
            context.pop()
        self.token_ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def add(self, token_id: int) -> str:
        """Append a token; return the newly completed text (possibly '')."""
        self.token_ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, self.skip_special_tokens)  # noqa: E731
        prefix = decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = decode(self.token_ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new_text = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return new_text
        return ""


@dataclass
class SampleState:
    index: int
    detokenizer: IncrementalDetokenizer
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    emitted: int = 0  # characters of text already handed to a streaming client
    emitted_tokens: int = 0


class RequestState:
    """Everything the front end tracks for one client request (all n samples)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer: Tokenizer):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.samples = [SampleState(i, IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                                              params.skip_special_tokens))
                        for i in range(params.n)]
        self.prompt_logprobs: list[TokenLogprob | None] = []
        self.num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def process(self, out: EngineCoreOutput) -> bool:
        """Apply one engine output; True when a stop string ended the sample (abort it upstream)."""
        sample = self.samples[out.index]
        if out.prompt_logprobs and out.index == 0:  # every sample computes them; keep one copy
            self.prompt_logprobs.extend(out.prompt_logprobs)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if sample.finish_reason is not None:
            return False
        stopped = False
        for i, token in enumerate(out.new_token_ids):
            sample.token_ids.append(token)
            if out.new_logprobs:
                sample.logprobs.append(out.new_logprobs[i])
            before = len(sample.text)
            sample.text += sample.detokenizer.add(token)
            if self.params.stop and self._check_stop_strings(sample, before):
                stopped = True
                break
        if not stopped and out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
        return stopped

    def _check_stop_strings(self, sample: SampleState, before: int) -> bool:
        # A new match must end inside the text just added, so it starts at most
        # len(longest stop) - 1 characters before it.
        start = max(0, before - max(len(s) for s in self.params.stop) + 1)
        for stop in self.params.stop:
            position = sample.text.find(stop, start)
            if position >= 0:
                end = position + len(stop) if self.params.include_stop_str_in_output else position
                sample.text = sample.text[:end]
                sample.finish_reason, sample.stop_reason = "stop", stop
                return True
        return False

    def unsent(self, sample: SampleState) -> tuple[str, list[int], list[TokenLogprob]]:
        """Text and tokens not yet streamed. A possible partial stop string is held back."""
        limit = len(sample.text)
        if self.params.stop and sample.finish_reason is None:
            hold = max(len(s) for s in self.params.stop) - 1
            limit = max(sample.emitted, limit - hold)
        text = sample.text[sample.emitted:limit]
        tokens = sample.token_ids[sample.emitted_tokens:]
        lps = sample.logprobs[sample.emitted_tokens:]
        sample.emitted = limit
        sample.emitted_tokens = len(sample.token_ids)
        return text, tokens, lps
