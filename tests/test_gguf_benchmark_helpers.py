"""The pure parts of the GGUF benchmarks: perplexity.py's windows score every token once with its
context, its variants parse as engine arguments, and serve_gguf.py's agreement finds the first
divergent token and its rounds alternate the servers and report medians."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"
NAMES = ("common", "servers", "serve", "judge", "results", "perplexity", "llamacpp_peer", "serve_gguf")


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    for name in NAMES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield importlib.import_module
    for name in NAMES:
        sys.modules.pop(name, None)


@pytest.mark.parametrize("tokens,window,stride", [(20480, 1024, 1023), (3000, 1024, 512), (1024, 1024, 1023),
                                                  (1500, 256, 64)])
def test_windows_score_every_token_once_after_its_context(bench, tokens, window, stride):
    windows = bench("perplexity").windows(tokens, window, stride)
    scored = [pos for start, end, first in windows for pos in range(first, end)]
    assert scored == list(range(1, tokens))  # each position once, in order; position 0 has no context
    for start, end, first in windows:
        assert end - start <= window and start < first  # a scored token sees at least its window's first token
        if start:
            assert first - start >= min(window - stride - 1, end - start - 1)


def test_variants_parse_as_engine_arguments(bench):
    parse = bench("perplexity").parse_variant
    assert parse("exact:dtype=float32,quantized_activations=none") == (
        "exact", {"dtype": "float32", "quantized_activations": "none"})
    assert parse("x:max_num_seqs=4,nan_scan_budget=0.5,enforce_eager=true") == (
        "x", {"max_num_seqs": 4, "nan_scan_budget": 0.5, "enforce_eager": True})
    assert parse("plain") == ("plain", {})


def test_agreement_reports_the_first_divergence(bench):
    agreement = bench("serve_gguf").agreement
    got = agreement([[1, 2, 3], [1, 2, 3], [4, 5], [7, 8]], [[1, 2, 3], [1, 9, 3], [6, 5], [7, 8, 9]])
    assert got["identical"] == 1 and got["first_divergence"] == [None, 1, 0, 2]
    assert got["mean_agreeing_prefix"] == pytest.approx((3 + 1 + 0 + 2) / 4, abs=0.05)


def test_rounds_alternate_the_servers_a_b_b_a(bench):
    order = bench("serve_gguf").round_order
    assert order(0, 1) == ["kvsentry", "llama.cpp"]
    assert order(1, 1) == ["llama.cpp", "kvsentry"]
    assert order(0, 2) == ["kvsentry", "llama.cpp", "llama.cpp", "kvsentry"]
    assert order(1, 3) == ["llama.cpp", "kvsentry", "kvsentry", "llama.cpp", "llama.cpp", "kvsentry"]


def test_a_levels_ratio_is_of_the_medians_with_each_rounds_own(bench):
    ratio = bench("serve_gguf").level_ratio
    rows = [{"server": "kvsentry", "concurrency": 8, "output_tok_s": v} for v in (300.0, 100.0, 200.0)]
    rows += [{"server": "llama.cpp", "concurrency": 8, "output_tok_s": v} for v in (100.0, 100.0, 50.0)]
    rows += [{"server": "kvsentry", "concurrency": 1, "output_tok_s": 999.0}]  # another level: not counted
    rows += [{"server": "llama.cpp", "concurrency": 1, "output_tok_s": 1.0}]
    assert ratio(rows, 8) == {"concurrency": 8, "output_tok_s": 2.0, "rounds": [3.0, 1.0, 4.0]}
    two = [{"server": s, "concurrency": 4, "output_tok_s": v}
           for s, v in (("kvsentry", 10.0), ("llama.cpp", 4.0), ("llama.cpp", 6.0), ("kvsentry", 20.0))]
    assert ratio(two, 4)["output_tok_s"] == 3.0  # medians of two: 15 over 5
