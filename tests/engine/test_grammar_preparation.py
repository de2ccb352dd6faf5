"""Grammars compile off the step loop: a request waits, unschedulable, until its grammar is
ready while every other request steps; a spec over a size bound, one that cannot compile, or
one not compiled within the timeout is refused with a typed Refusal naming the field; an
abort while waiting frees everything.

A compile that must stay slow for as long as a test needs is a real compile gated on an
Event (the pool's compile callable, wrapped from test code), so nothing here depends on how
fast the machine compiles."""
from __future__ import annotations

import json
import threading
import time

import pytest

from engine.config import EngineConfig
from engine.engine_core.engine_core import EngineCore
from engine.messages import EngineRequest
from engine.sampling_params import SamplingParams
from engine.structured.compile_pool import COMPILE_TIMEOUT, CompileTimeout, GrammarPool
from engine.structured.limits import SPEC_TOO_LARGE, SpecTooLarge, check_spec_limits
from engine.structured.spec import StructuredOutputs

PROMPT = [0] + [(7 * j) % 500 + 5 for j in range(11)]


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("tiny-llama")


def make_core(ckpt, **kw) -> EngineCore:
    return EngineCore(EngineConfig.create(ckpt, num_gpu_blocks=64, max_model_len=128, **kw))


def json_spec(schema) -> StructuredOutputs:
    return StructuredOutputs(kind="json", spec=json.dumps(schema))


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def gate_compiles(core: EngineCore) -> threading.Event:
    """Hold every compile of `core` until the returned event is set."""
    release = threading.Event()
    compile_now = core.preparing._compile

    def gated(spec):
        release.wait(60)
        return compile_now(spec)

    core.preparing._compile = gated
    return release


# ------------------------------------------------------------------------------ size bounds

def test_size_bounds_name_the_field(ckpt):
    config = EngineConfig.create(ckpt, num_gpu_blocks=8, max_structured_outputs_choices=10,
                                 max_structured_outputs_depth=8, max_structured_outputs_spec_bytes=2000)
    check_spec_limits(config, json_spec({"enum": [str(i) for i in range(10)]}))
    check_spec_limits(config, json_spec(nested(7)))  # 7 arrays + the string: depth 8 in JSON
    check_spec_limits(config, StructuredOutputs.choice([str(i) for i in range(10)]))
    cases = [(json_spec({"type": "object", "properties": {"a": {"enum": list(range(11))}}}),
              "structured_outputs.json.enum", "11 enum values"),
             (StructuredOutputs.choice([str(i) for i in range(11)]), "structured_outputs.choice", "11 choices"),
             (json_spec(nested(9)), "structured_outputs.json", "nested deeper"),
             (StructuredOutputs(kind="regex", spec="a" * 2001), "structured_outputs.regex", "2001 bytes")]
    for spec, field, why in cases:
        with pytest.raises(SpecTooLarge, match=why) as info:
            check_spec_limits(config, spec)
        assert info.value.field == field and info.value.code == SPEC_TOO_LARGE
    with pytest.raises(SpecTooLarge) as info:
        check_spec_limits(config, json_spec(nested(9)), "response_format.json_schema.schema")
    assert info.value.field == "response_format.json_schema.schema"


def test_a_spec_deeper_than_the_json_parser_is_refused_not_crashed(ckpt):
    config = EngineConfig.create(ckpt, num_gpu_blocks=8, max_structured_outputs_spec_bytes=2**20)
    deep = StructuredOutputs(kind="json", spec="[" * 100_000 + "]" * 100_000)
    with pytest.raises(SpecTooLarge, match="nested deeper"):
        check_spec_limits(config, deep)


# ------------------------------------------------------------------------------ the pool

def test_pool_deadline_sharing_and_cancel():
    release = threading.Event()
    calls = []

    def compile_slowly(spec):
        calls.append(spec)
        release.wait(60)
        return f"compiled {spec.spec}"

    pool = GrammarPool(compile_slowly, workers=1, timeout=0.05)
    spec_a = StructuredOutputs(kind="regex", spec="a")
    a1, a2 = pool.submit(spec_a), pool.submit(StructuredOutputs(kind="regex", spec="a"))
    queued = pool.submit(StructuredOutputs(kind="regex", spec="b"))  # behind "a" on the one worker
    assert a1.future is a2.future  # one compile for the same spec
    assert a1.result(time.monotonic()) is None  # compiling, within the deadline
    with pytest.raises(CompileTimeout, match="structured_outputs.regex: not compiled within") as info:
        a1.result(a1.deadline + 1)
    assert info.value.code == COMPILE_TIMEOUT
    queued.release()  # its only waiter left: cancelled before it ever ran
    assert queued.future.cancelled()
    release.set()
    assert a2.future.result(10) == "compiled a"
    assert a2.result(a2.deadline + 100) == "compiled a"  # done: a result, even past the deadline
    assert [s.spec for s in calls] == ["a"]
    assert pool.num_compiling == 0
    pool.shutdown()


# ------------------------------------------------------------------------------ in the engine core

def run_until(core: EngineCore, done, max_steps: int = 500) -> dict:
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
        if done(outputs):
            return outputs
        time.sleep(0.001)
    raise AssertionError(f"not done after {max_steps} steps: {outputs}")


def finished(request_id: str):
    return lambda outputs: any(o.finish_reason for o in outputs.get(request_id, []))


def test_others_step_while_a_grammar_compiles_then_it_runs(ckpt):
    core = make_core(ckpt)
    release = gate_compiles(core)
    spec = json_spec({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    core.add_request(EngineRequest("constrained", PROMPT, SamplingParams(max_tokens=20, structured_outputs=spec)))
    core.add_request(EngineRequest("free", PROMPT, SamplingParams(max_tokens=8)))
    outputs = run_until(core, finished("free"))
    assert "constrained" not in outputs  # waited, unscheduled, while "free" ran to its end
    assert core.steps >= 8 and core.stats().num_preparing == 1
    assert core.only_preparing
    release.set()
    outputs = run_until(core, finished("constrained"))
    tokens = [t for o in outputs["constrained"] for t in o.new_token_ids]
    assert tokens and outputs["constrained"][-1].refusal is None
    assert not core.has_unfinished and core.scheduler.kv.pool.num_free_blocks == 63


def test_compile_timeout_is_a_typed_refusal(ckpt):
    core = make_core(ckpt, structured_outputs_compile_timeout=0.05)
    release = gate_compiles(core)
    integer = json_spec({"type": "integer"})
    core.add_request(EngineRequest("slow", PROMPT, SamplingParams(n=2, structured_outputs=integer)))
    outputs = run_until(core, lambda o: len(o.get("slow", [])) == 2)
    release.set()
    assert {o.index for o in outputs["slow"]} == {0, 1}
    for out in outputs["slow"]:
        assert out.finish_reason == "error" and not out.new_token_ids
        assert out.refusal.code == COMPILE_TIMEOUT and out.refusal.param == "structured_outputs.json"
    assert not core.has_unfinished


def test_a_spec_that_cannot_compile_is_refused_off_the_loop(ckpt):
    core = make_core(ckpt)
    core.add_request(EngineRequest("bad", PROMPT, SamplingParams(structured_outputs=StructuredOutputs(
        kind="regex", spec="[a-"))))
    out, = run_until(core, finished("bad"))["bad"]
    assert out.refusal.param == "structured_outputs.regex" and "cannot be compiled" in out.refusal.message
    assert not core.has_unfinished


def test_over_a_bound_is_refused_when_added(ckpt):
    core = make_core(ckpt, max_structured_outputs_choices=3)
    choices = StructuredOutputs.choice(list("abcd"))
    request = EngineRequest("big", PROMPT, SamplingParams(n=3, structured_outputs=choices))
    with pytest.raises(ValueError) as info:  # the rank answers it with core.refused()
        core.add_request(request)
    outs = core.refused(request, info.value)
    assert [o.index for o in outs] == [0, 1, 2]
    assert outs[0].refusal.code == SPEC_TOO_LARGE and outs[0].refusal.param == "structured_outputs.choice"


def test_abort_while_waiting_frees_everything(ckpt):
    core = make_core(ckpt)
    release = gate_compiles(core)
    integer = json_spec({"type": "integer"})
    core.add_request(EngineRequest("gone", PROMPT, SamplingParams(n=2, structured_outputs=integer)))
    core.step()
    core.abort(["gone"])
    outputs = run_until(core, lambda o: len(o.get("gone", [])) == 2)
    assert all(o.finish_reason == "abort" for o in outputs["gone"])
    assert not core.has_unfinished and core.preparing.num_waiting == 0
    assert core.scheduler.kv.pool.num_free_blocks == 63
    release.set()


def test_a_rank_waiting_for_a_grammar_is_making_progress(ckpt):
    """The stall detector (/health: no step for --health-stall-timeout with requests in flight)
    reads a report with requests preparing as progress; a report without steps or preparing
    does not move it."""
    import msgspec

    from engine.dp.client import ClientState
    from engine.messages import EngineOutputs, StepStats

    state = ClientState(EngineConfig.create(ckpt, num_gpu_blocks=8))
    state.incarnations[0] = 0  # rank 0's live process, as its RankReady registers it

    def report(steps: int, preparing: int) -> float:
        before = state.last_progress = 0.0
        stats = StepStats(rank=0, steps=steps, dummy_batches=0, padded_tokens=0, num_running=0, num_waiting=preparing,
                          kv_usage=0.0, prefix_queries=0, prefix_hits=0, preemptions=0, num_preparing=preparing)
        state.handle(msgspec.msgpack.encode(EngineOutputs(rank=0, outputs=[], stats=stats)))
        return state.last_progress - before

    report(5, 0)
    assert report(5, 0) == 0.0  # no step since the last report
    assert report(5, 1) > 0.0   # no step, but a grammar compiling
    assert report(6, 0) > 0.0   # a step
