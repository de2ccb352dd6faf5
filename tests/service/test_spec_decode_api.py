"""`kvsentry serve --speculative-config` through the official client, on the prompt-quoting tiny
model (tests/engine/spec_helpers.py): greedy completions, streamed or not, with a stop string
inside an accepted run, equal those of an engine without speculation; /metrics exports the
acceptance counters with the integrity counters at 0; a method other than ngram is refused."""
from __future__ import annotations

import json
import random

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from service.cli import engine_args, parse_args
from tests.engine.spec_helpers import SPEC, quoting_prompt, write_cycling_checkpoint
from tests.service.server_process import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_cycling_checkpoint(tmp_path_factory.mktemp("cycling"))


@pytest.fixture(scope="module")
def spec_server(path, tmp_path_factory):
    proc = ServerProcess(path, "--threads", "1", "--max-model-len", "256", "--speculative-config", json.dumps(SPEC),
                         "--kv-checksums", "full", log_dir=tmp_path_factory.mktemp("logs"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_completions_equal_plain_decoding_and_metrics_count_acceptances(path, spec_server):
    rng = random.Random(3)
    prompts = [quoting_prompt(rng, quote=16) for _ in range(4)]
    client = spec_server.openai()
    with LLM(path, max_model_len=256) as plain:
        want = plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        # A stop string the quote reaches after a few accepted tokens.
        stop_text = plain.tokenizer.decode(want[0].outputs[0].token_ids[6:8])
        want_stop = plain.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                              stop=[stop_text]))[0].outputs[0]
    for prompt, expected in zip(prompts, want):
        out = client.completions.create(model=path, prompt=prompt, temperature=0, max_tokens=24,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.choices[0].token_ids == expected.outputs[0].token_ids
        assert out.choices[0].text == expected.outputs[0].text
    stream = client.completions.create(model=path, prompt=prompts[1], temperature=0, max_tokens=24, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == want[1].outputs[0].text
    stopped = client.completions.create(model=path, prompt=prompts[0], temperature=0, max_tokens=24, stop=[stop_text],
                                        extra_body={"ignore_eos": True})
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == (want_stop.text, "stop")
    assert stopped.usage.completion_tokens == len(want_stop.token_ids)

    spec_server.wait_idle(timeout=30)
    accepted = spec_server.metric("kvsentry_spec_decode_num_accepted_tokens_total")
    drafts = spec_server.metric("kvsentry_spec_decode_num_draft_tokens_total")
    assert accepted and accepted[0] > 0 and drafts[0] >= accepted[0]
    assert 0 < spec_server.metric("kvsentry_spec_decode_acceptance_rate")[0] <= 1
    assert spec_server.metric("kvsentry_spec_decode_mean_accepted_tokens_per_step")[0] > 1
    assert spec_server.metric("kvsentry_spec_decode_num_accepted_tokens_per_pos_total", position="0")[0] > 0
    assert spec_server.metric("kvsentry_kv_foreign_writes_total") == [0.0]
    assert spec_server.metric("kvsentry_null_block_writes_total") == [0.0]
    assert sum(spec_server.metric("kvsentry_kv_cache_checksum_mismatches_total")) == 0


def test_a_method_other_than_ngram_is_refused(path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["serve", path, "--speculative-config",
                    '{"method": "eagle", "model": "some/drafter", "num_speculative_tokens": 3}'])
    assert exit_info.value.code == 2
    assert "method 'eagle' is not supported" in capsys.readouterr().err
    args = parse_args(["serve", path, "--speculative-config", json.dumps(SPEC)])
    assert EngineConfig.create(path, **engine_args(args)).speculative_config.num_speculative_tokens == 4
