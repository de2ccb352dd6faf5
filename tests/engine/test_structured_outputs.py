"""Grammar-constrained decoding on the real default model (SmolLM2-135M-Instruct): every
constrained output parses and matches its spec, greedy and sampled, and the mask touches only
its own rows (an unconstrained request gets the tokens it gets alone)."""
from __future__ import annotations

import json
import time
import re

import jsonschema
import pytest

from engine.frontend.llm import LLM
from engine.gguf.default_model import default_model_path

# The answers asserted here are the default model's with its exact dequantized weights; int8
# activations (the default on VNNI CPUs) change its greedy output (benchmarks/int8_agreement.py).
EXACT = "none"
from engine.sampling_params import SamplingParams
from engine.structured.grammar import GrammarError, compiler_for
from engine.structured.spec import StructuredOutputs
from service.demo import default_demo_path
from tests.engine.dp_helpers import free_port_block
from benchmarks.structured_schemas import SCHEMAS

MAX_TOKENS = 96


@pytest.fixture(scope="module")
def llm():
    with LLM(model=default_model_path(), num_threads=1, quantized_activations=EXACT, dtype="float32") as engine:
        yield engine


def chat_ids(llm: LLM, question: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return llm.tokenizer.encode(text, add_special_tokens=False)


def json_spec(schema: dict) -> StructuredOutputs:
    return StructuredOutputs(kind="json", spec=json.dumps(schema))


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=1234)])
def test_json_schemas_validate(llm, sampling):
    prompts = [chat_ids(llm, f"{q} Answer in JSON.") for q, _ in SCHEMAS]
    params = [SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=json_spec(s), **sampling)
              for _, s in SCHEMAS]
    outputs = llm.generate(prompts, params)
    for (question, schema), out in zip(SCHEMAS, outputs):
        sample = out.outputs[0]
        assert sample.finish_reason == "stop", (question, sample.text)
        jsonschema.validate(json.loads(sample.text), schema)


def test_json_is_compact_and_json_object(llm):
    params = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=StructuredOutputs(kind="json_object"))
    question = "Give a JSON object with the name and age of a cat."
    text = llm.generate([chat_ids(llm, question)], params)[0].outputs[0].text
    assert isinstance(json.loads(text), dict)
    assert "\n" not in text and "  " not in text


def test_choice_regex_and_grammar(llm):
    choices = ["Paris", "London", "Berlin"]
    regex = r"[A-Z][a-z]{2,8} [0-9]{1,3}"
    ebnf = 'root ::= "The answer is " ("yes" | "no") "."'
    question = chat_ids(llm, "What is the capital of France? Answer briefly.")
    specs = [StructuredOutputs.choice(choices), StructuredOutputs(kind="regex", spec=regex),
             StructuredOutputs(kind="grammar", spec=ebnf)]
    for sampling in (dict(temperature=0.0), dict(temperature=1.0, seed=7)):
        outs = llm.generate([question] * 3, [SamplingParams(max_tokens=32, n=2, structured_outputs=s, **sampling)
                                             for s in specs])
        for sample in outs[0].outputs:
            assert sample.text in choices
        for sample in outs[1].outputs:
            assert re.fullmatch(regex, sample.text), sample.text
        for sample in outs[2].outputs:
            assert re.fullmatch(r"The answer is (yes|no)\.", sample.text), sample.text
        assert all(s.finish_reason == "stop" for o in outs for s in o.outputs)


def test_mixed_batch_leaves_unconstrained_rows_alone(llm):
    free = [SamplingParams(temperature=0.0, max_tokens=24), SamplingParams(temperature=1.0, seed=5, max_tokens=24)]
    prompts = [chat_ids(llm, "Tell me about the sea."), chat_ids(llm, "Write a short poem.")]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free)]
    constrained = [SamplingParams(temperature=t, seed=3, max_tokens=24, structured_outputs=json_spec(SCHEMAS[i][1]))
                   for i, t in ((0, 0.0), (3, 1.0), (5, 0.0))]
    mixed = llm.generate(prompts + [chat_ids(llm, "JSON please.")] * 3, free + constrained)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone


def test_bad_specs_are_refused_with_the_field(llm):
    model = llm.config.model
    compiler = compiler_for(model.tokenizer, model.vocab_size, tuple(model.eos_token_ids))
    with pytest.raises(GrammarError, match="structured_outputs.regex"):
        compiler.compile(StructuredOutputs(kind="regex", spec="[a-"))
    with pytest.raises(GrammarError, match="structured_outputs.json"):
        compiler.compile(StructuredOutputs(kind="json", spec='{"type": "nonsense"}'))
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputs(kind="choice", spec="[]")
    with pytest.raises(GrammarError):
        llm.generate([chat_ids(llm, "hi")], SamplingParams(structured_outputs=StructuredOutputs(kind="grammar",
                                                                                                spec="root ::= ")))


def test_preemption_and_chunked_prefill_keep_the_grammar():
    # Few blocks force preemptions (outputs recomputed); a small token budget chunks the prefill.
    with LLM(model=default_model_path(), num_threads=1, quantized_activations=EXACT, dtype="float32", num_gpu_blocks=8, block_size=16,
             max_num_batched_tokens=48) as small:
        prompts = [chat_ids(small, f"{q} Answer in JSON.") for q, _ in SCHEMAS[:8]]
        params = [SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=json_spec(s))
                  for _, s in SCHEMAS[:8]]
        outputs = small.generate(prompts, params)
        assert small.engine.scheduler.num_preemptions > 0
        for (_, schema), out in zip(SCHEMAS[:8], outputs):
            jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_compiled_grammars_are_cached_by_spec(llm):
    """Every schema compiles, and compiling the same spec again is a cache hit (the same object):
    a rank compiles each distinct spec once. Compile time is reported by the benchmarks, not asserted."""
    model = llm.config.model
    compiler = compiler_for(model.tokenizer, model.vocab_size, tuple(model.eos_token_ids))
    for _, schema in SCHEMAS:
        spec = StructuredOutputs(kind="json", spec=json.dumps(schema), any_whitespace=True)
        first = compiler.compile(spec)
        assert compiler.compile(StructuredOutputs(kind="json", spec=json.dumps(schema), any_whitespace=True)) is first
    other = compiler.compile(StructuredOutputs(kind="json", spec=json.dumps(SCHEMAS[0][1]), any_whitespace=False))
    assert other is not compiler.compile(StructuredOutputs(kind="json", spec=json.dumps(SCHEMAS[0][1]),
                                                           any_whitespace=True))


def test_dp2_grammar_lives_on_its_rank(llm):
    # Rank 1 holds the constrained requests (its matchers live there), rank 0 the free ones; every
    # output is what the single-rank engine gives. (Whether rank 1 stepped dummy batches once its
    # short requests ended is not asserted: the client's stats read 0 here.)
    prompts = [chat_ids(llm, "Tell me about the sea."), chat_ids(llm, "Pick a color. Answer in JSON.")]
    params = [SamplingParams(temperature=0.0, max_tokens=32),
              SamplingParams(temperature=0.0, max_tokens=32, structured_outputs=json_spec(SCHEMAS[2][1]))]
    single = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with LLM(model=default_model_path(), num_threads=1, quantized_activations=EXACT, dtype="float32", data_parallel_size=2,
             data_parallel_rpc_port=free_port_block(3)) as dp:
        outputs = dp.generate(prompts + prompts, params + params, rank_of=[0, 1, 0, 1])
        assert [o.outputs[0].token_ids for o in outputs] == single + single
        jsonschema.validate(json.loads(outputs[1].outputs[0].text), SCHEMAS[2][1])


def test_dp2_moe_mixed_batches_with_dummy_batches_running():
    # The MoE demo at DP=2 steps in lockstep: rank 0's constrained and free requests end early,
    # and it keeps stepping dummy batches (no grammar, no matcher) while rank 1 finishes a long
    # free request. Every free request gets the tokens it gets without the constrained ones.
    free_prompts = [[5, 6, 7, 8, 9], [9, 10, 11]]
    free = [SamplingParams(temperature=0.0, max_tokens=10), SamplingParams(temperature=1.0, seed=9, max_tokens=48)]
    regex, choices = "(yes|no)-[0-9]{3}", ["alpha", "beta", "gamma"]
    constrained = [SamplingParams(temperature=0.0, max_tokens=12,
                                  structured_outputs=StructuredOutputs(kind="regex", spec=regex)),
                   SamplingParams(temperature=1.0, seed=4, max_tokens=12,
                                  structured_outputs=StructuredOutputs(kind="choice", spec=json.dumps(choices)))]
    with LLM(model=str(default_demo_path()), num_threads=1, data_parallel_size=2, dtype="float32",
             data_parallel_rpc_port=free_port_block(3)) as dp:
        alone = [o.outputs[0].token_ids for o in dp.generate(free_prompts, free, rank_of=[0, 1])]
        dummies_before = dp.engine.stats[0].dummy_batches
        mixed = dp.generate(free_prompts + [[12, 13, 14], [15, 16]], free + constrained, rank_of=[0, 1, 0, 0])
        # Rank 0 reports its stats when its wave ends, which may reach us just after rank 1's last
        # output: read them once that report is in (or after a generous bound).
        deadline = time.monotonic() + 30
        while dp.engine.stats[0].dummy_batches - dummies_before < 20 and time.monotonic() < deadline:
            dp.engine.step(0.1)
        dummies = dp.engine.stats[0].dummy_batches - dummies_before
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    assert re.fullmatch(regex, mixed[2].outputs[0].text), mixed[2].outputs[0].text
    assert mixed[3].outputs[0].text in choices
    assert dummies >= 20, f"rank 0 stepped {dummies} dummy batches while rank 1 finished"


def test_a_gated_grammar_constrains_only_what_follows_the_gate(llm):
    # A reasoning model's grammar waits for the end of its thinking. Here the "end of thinking"
    # is a token the free greedy output emits anyway (its 4th): up to and including it the
    # gated output is the free one; after it, the regex holds.
    prompt = chat_ids(llm, "Tell me a story about a cat.")
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].token_ids
    gate = free[3]
    assert gate not in free[:3]
    spec = StructuredOutputs(kind="regex", spec="[0-9]{3}", after_token_ids=(gate,))
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec))[0].outputs[0]
    assert out.token_ids[:4] == free[:4]
    assert re.fullmatch("[0-9]{3}", llm.tokenizer.decode(out.token_ids[4:])), out.text
    assert out.finish_reason == "stop"
    # A gate that never comes leaves the whole output free.
    never = StructuredOutputs(kind="regex", spec="[0-9]{3}", after_token_ids=(llm.config.model.vocab_size - 1,))
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=never))[0]
    assert out.outputs[0].token_ids == free


def test_a_two_token_gate_split_across_steps_opens_once(llm):
    compiler = compiler_for(llm.config.model.tokenizer, llm.config.model.vocab_size,
                            tuple(sorted(set(llm.config.model.eos_token_ids))))
    a, b = llm.tokenizer.encode("</think>", add_special_tokens=False)[:2]
    digit = llm.tokenizer.encode("7", add_special_tokens=False)[0]
    grammar = compiler.matcher(StructuredOutputs(kind="regex", spec="[0-9]", after_token_ids=(a, b)))
    outputs = [b, a]  # b before a is not the gate
    assert grammar.accept(outputs) and not grammar.active
    outputs.append(b)  # ... a, b: open; nothing after it yet
    assert grammar.accept(outputs) and grammar.active and not grammar.is_terminated
    assert not grammar.accept(outputs + [a])  # the regex refuses a non-digit
    grammar = compiler.matcher(StructuredOutputs(kind="regex", spec="[0-9]", after_token_ids=(a, b)))
    assert grammar.accept([a, b, digit]) and grammar.active


def test_structural_tag_is_free_until_a_trigger_then_enforces_the_structure(llm):
    compiler = compiler_for(llm.config.model.tokenizer, llm.config.model.vocab_size,
                            tuple(sorted(set(llm.config.model.eos_token_ids))))
    tag = {"structures": [{"begin": "<function=get_weather>", "end": "</function>",
                           "schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                      "required": ["city"]}}], "triggers": ["<function="]}
    spec = StructuredOutputs(kind="structural_tag", spec=json.dumps(tag))

    def accepts(text: str) -> bool:
        return compiler.matcher(spec).accept(llm.tokenizer.encode(text, add_special_tokens=False))

    assert accepts('Sure, let me check. <function=get_weather>{"city": "Paris"}</function> Done.')
    assert not accepts('Sure. <function=get_weather>{"town": "Paris"}</function>')
    assert not accepts("Sure. <function=get_time>")  # a trigger must open one of the structures
    with pytest.raises(GrammarError, match="structured_outputs.structural_tag: needs non-empty"):
        compiler.compile(StructuredOutputs(kind="structural_tag", spec=json.dumps({"structures": []})))
