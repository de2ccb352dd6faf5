"""Sampling: penalties, temperature, top-k/top-p/min-p, seeded draws, logprobs.

Greedy rows take an argmax; random rows use the exponential-race trick
(argmax(p / q), q ~ Exp(1)), drawn from the request's own generator when it
has a seed, so a seeded request samples the same tokens alone or in any batch.
Logprobs are those of the raw model distribution (before penalties and
temperature), as vLLM reports them by default.
"""
from __future__ import annotations

import torch

from engine.messages import TokenLogprob
from engine.ops import cpu_ops
from engine.request import Request
from engine.spec_decode.rejection_sampler import accept_greedy, rejection_sample
from engine.structured.grammar import apply_grammars


def apply_penalties(logits: torch.Tensor, request: Request) -> None:
    params = request.params
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(request.all_token_ids)), dtype=torch.int64, device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                   values * params.repetition_penalty)
    if params.presence_penalty or params.frequency_penalty:
        output = request.output_token_ids
        if output:
            ids = torch.tensor(output, dtype=torch.int64, device=logits.device)
            counts = torch.zeros_like(logits).index_add_(0, ids, torch.ones(len(output), device=logits.device))
            logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def _mask_for_min_tokens(logits: torch.Tensor, request: Request) -> None:
    params = request.params
    if request.num_output_tokens < params.min_tokens:
        banned = list(params.stop_token_ids)
        if not params.ignore_eos:
            banned.extend(request.eos_token_ids)
        banned = [t for t in banned if t < logits.shape[-1]]
        if banned:
            logits[banned] = float("-inf")


def _filter(logits: torch.Tensor, request: Request) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, as probabilities."""
    params = request.params
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop_sorted = cumulative - sorted_probs > params.top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs


def token_logprobs(logprobs: torch.Tensor,  # [num, vocab] float32 log-softmax
                   token_ids: list[int], num_top: int) -> list[TokenLogprob]:
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logprobs.device).view(-1, 1))  # [num, 1]
    # vLLM's rank: 1 + how many tokens are strictly more likely (ties share the better rank).
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    chosen = chosen.view(-1).tolist()
    if num_top > 0:
        top_values, top_ids = torch.topk(logprobs, num_top, dim=-1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    else:
        top_values = top_ids = [[] for _ in token_ids]
    return [TokenLogprob(t, lp, list(zip(ids, values)), rank)
            for t, lp, ids, values, rank in zip(token_ids, chosen, top_ids, top_values, ranks)]


_ARGMAX_BLOCK = 256
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def row_argmax(logits: torch.Tensor) -> torch.Tensor:  # [n, vocab] -> [n] int64
    """torch.argmax(logits, -1), same answer (first maximum; a NaN wins, as in torch), fast on
    CPU: csrc's row_argmax reads each row once, in float32 or bf16; without the kernels, the
    blocked torch form below (torch's index-tracking reduction along the last dim is slow,
    1.7 ms for 32 x 32000, while amax is vectorised: take each block's max, pick the first best
    block, and argmax only inside it)."""
    num, vocab = logits.shape
    if _argmax_kernel_takes(logits):
        return cpu_ops.row_argmax(logits)[0]
    main = vocab - vocab % _ARGMAX_BLOCK
    if num == 0 or main == 0 or logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    blocks = logits[:, :main].reshape(num, main // _ARGMAX_BLOCK, _ARGMAX_BLOCK)
    best_block = blocks.amax(dim=-1).argmax(dim=-1)                          # [n]
    rows = torch.arange(num)
    best = best_block * _ARGMAX_BLOCK + blocks[rows, best_block].argmax(dim=-1)
    if main == vocab:
        return best
    tail = logits[:, main:].argmax(dim=-1) + main                            # vocab % block tokens
    pick_tail = torch.stack([logits[rows, best], logits[rows, tail]], dim=1).argmax(dim=-1) == 1
    return torch.where(pick_tail, tail, best)


def _argmax_kernel_takes(logits: torch.Tensor) -> bool:
    """Whether csrc's row_argmax reads these [n, vocab] logits: non-empty CPU float32 or bf16
    rows with a contiguous last dim, and the kernels built."""
    return (logits.numel() > 0 and logits.device.type == "cpu" and logits.dtype in _KERNEL_DTYPES
            and logits.stride(-1) == 1 and cpu_ops.available())


def _plain_greedy(request: Request) -> bool:
    """Greedy with nothing that reads or changes the logits first: its token is the argmax of
    the raw logits, in their own dtype (bf16 -> float is exact, so it is the float argmax)."""
    params = request.params
    return (params.greedy and params.logprobs is None and not params.uses_penalties
            and request.num_output_tokens >= params.min_tokens and request.grammar is None)


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def sample_step(self, logits: torch.Tensor,  # [num_reqs, vocab] the model's, in its dtype
                    requests: list[Request]) -> tuple[list[int], list[TokenLogprob | None], list[bool]]:
        """A step's tokens and logprobs, and per row whether its logits are all finite (False:
        a NaN or an infinity, which the sentinel reports). A batch of plain greedy requests on
        CPU takes one pass of csrc's row_argmax over the logits as they are (no float copy, no
        separate finiteness reduction); any other batch is converted to float32 once, checked
        by a row sum (a NaN or Inf anywhere makes it non-finite) and sampled."""
        if _argmax_kernel_takes(logits) and all(_plain_greedy(r) for r in requests):
            tokens, finite = cpu_ops.row_argmax(logits)
            return tokens.tolist(), [None] * len(requests), finite.tolist()
        logits = logits.float()
        finite = torch.isfinite(logits.sum(dim=-1)).tolist()
        tokens, logprobs = self.sample(logits, requests)
        return tokens, logprobs, finite

    def sample(self, logits: torch.Tensor,  # [num_reqs, vocab] rows of the requests that sample
               requests: list[Request]) -> tuple[list[int], list[TokenLogprob | None]]:
        logits = logits.float().cpu()
        want_logprobs = [r.params.logprobs is not None for r in requests]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        processed = logits
        special = [i for i, r in enumerate(requests)
                   if r.params.uses_penalties or r.num_output_tokens < r.params.min_tokens]
        grammars = [r.grammar for r in requests]
        constrained = any(g is not None for g in grammars)
        if special or constrained:
            processed = logits.clone()
            for i in special:
                apply_penalties(processed[i], requests[i])
                _mask_for_min_tokens(processed[i], requests[i])
            if constrained:
                apply_grammars(processed, grammars)  # only the rows that have a grammar change
        tokens = row_argmax(processed).tolist()
        for i, request in enumerate(requests):
            if request.params.greedy:
                continue
            probs = _filter(processed[i], request)
            race = torch.empty_like(probs).exponential_(generator=request.generator or self.generator)
            tokens[i] = int((probs / race).argmax())
        logprobs: list[TokenLogprob | None] = [None] * len(requests)
        if raw_logprobs is not None:
            rows = [i for i, want in enumerate(want_logprobs) if want]
            num_top = max(requests[i].params.logprobs for i in rows)
            entries = token_logprobs(raw_logprobs[rows], [tokens[i] for i in rows], num_top)
            for i, entry in zip(rows, entries):
                entry.top = entry.top[:requests[i].params.logprobs]
                logprobs[i] = entry
        return tokens, logprobs

    def verify(self, logits: torch.Tensor,  # [k + 1, vocab] the model's, at the last token and each draft
               request: Request, drafts: list[int]) -> list[int]:
        """Speculative decoding: the tokens a verify step emits (accepted drafts, then one from
        the model; engine/spec_decode/rejection_sampler.py). Position i is processed as `sample`
        would process it had drafts[:i] been sampled already (penalties, min_tokens), so the
        distribution of what is emitted is the normal sampler's."""
        if _argmax_kernel_takes(logits) and _plain_greedy(request):
            return accept_greedy(cpu_ops.row_argmax(logits)[0].tolist(), drafts)
        logits = logits.float().cpu()

        def processed(i: int) -> torch.Tensor:  # [vocab]
            row, context = logits[i].clone(), _Drafted(request, drafts[:i])
            if request.params.uses_penalties:
                apply_penalties(row, context)
            _mask_for_min_tokens(row, context)
            return row

        if request.params.greedy:
            out: list[int] = []
            for i in range(len(drafts) + 1):
                out.append(int(row_argmax(processed(i).unsqueeze(0))[0]))
                if i == len(drafts) or out[-1] != drafts[i]:
                    break
            return out
        return rejection_sample(lambda i: _filter(processed(i), request), drafts,
                                request.generator or self.generator)


class _Drafted:
    """A request as the sampler sees it once `drafts` follow its tokens (what penalties and
    min_tokens read)."""

    def __init__(self, request: Request, drafts: list[int]):
        self.params = request.params
        self.eos_token_ids = request.eos_token_ids
        self.all_token_ids = request.all_token_ids + drafts
        self.output_token_ids = request.output_token_ids + drafts
        self.num_output_tokens = request.num_output_tokens + len(drafts)
