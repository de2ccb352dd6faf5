"""csrc/cpu/cpu_argmax.cpp (the row_argmax op) against torch.argmax, and the sampler's
greedy path that uses it on the raw logits. Needs the ops built (`kvsentry_ops`)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine.worker.sampler import row_argmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@given(rows=st.integers(0, 5), vocab=st.integers(1, 700), ties=st.booleans(), nans=st.integers(0, 3),
       infs=st.booleans(), seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_csrc_row_argmax_equals_torch_argmax(kvsentry_ops, dtype, rows, vocab, ties, nans, infs, seed):
    """csrc's row_argmax in the logits' own dtype: the vector body (16 per compare), the tail,
    exact ties (the first wins), NaNs (the row's first wins), -inf rows and strided rows."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, vocab + 7, generator=gen)
    if ties:
        wide = (wide * 2).round()
    if infs and rows:
        wide[0] = float("-inf")  # a row of -inf: position 0, not finite
        wide[-1, int(torch.randint(vocab, (1,), generator=gen))] = float("inf")
    for _ in range(nans):
        if rows:
            r, c = (int(torch.randint(n, (1,), generator=gen)) for n in (rows, vocab))
            wide[r, c] = float("nan")
    logits = wide.to(dtype)[:, :vocab]  # rows vocab + 7 apart
    tokens, finite = kvsentry_ops.row_argmax(logits)
    assert torch.equal(tokens, logits.float().argmax(dim=-1))
    assert torch.equal(finite, logits.float().isfinite().all(dim=-1))
    assert torch.equal(row_argmax(logits), logits.float().argmax(dim=-1))


def test_checks(kvsentry_ops):
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kvsentry_ops.row_argmax(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="contiguous last dim"):
        kvsentry_ops.row_argmax(torch.zeros(8, 2).t())
    with pytest.raises(RuntimeError, match="vocab"):
        kvsentry_ops.row_argmax(torch.zeros(2, 0))


def test_sampler_greedy_rows_take_the_raw_logits(kvsentry_ops, monkeypatch):
    """A batch of plain greedy requests is sampled from the bf16 logits as they are (no float
    copy: Tensor.float is never called), with each row's finiteness from the same pass; one
    request that wants logprobs sends the batch down the float path: the same tokens and flags."""
    from engine.request import Request
    from engine.sampling_params import SamplingParams
    from engine.worker.sampler import Sampler
    logits = (torch.randn(4, 1000, generator=torch.Generator().manual_seed(5)) * 3).bfloat16()
    logits[1, 700] = float("inf")
    logits[2, 3] = float("-inf")
    logits[3, 999] = float("nan")
    expect = logits.float().argmax(dim=-1).tolist()

    def request(name: str, **kw) -> Request:
        return Request(name, 0, [1], SamplingParams(temperature=0.0, max_tokens=4, **kw), None, 0.0)

    greedy = [request(f"g{i}") for i in range(4)]
    float_calls = []
    real_float = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda self, *a, **k: (float_calls.append(1), real_float(self))[1])
    tokens, logprobs, finite = Sampler().sample_step(logits, greedy)
    assert not float_calls
    assert tokens == expect == [tokens[0], 700, tokens[2], 999] and logprobs == [None] * 4
    assert finite == [True, False, False, False]
    tokens2, logprobs2, finite2 = Sampler().sample_step(logits, greedy[:3] + [request("lp", logprobs=2)])
    assert float_calls and tokens2 == tokens and finite2 == finite
    assert logprobs2[3] is not None and logprobs2[:3] == [None] * 3
