"""schemathesis fuzzes the app's own OpenAPI schema in-process (ASGI), with valid and
invalid inputs: none may produce a 5xx, and every response must match its documented schema.

One test drives every operation itself (instead of `schema.parametrize()`), because the
ASGI lifespan - which owns the engine's rank process - lives exactly as long as one test.
"""
from __future__ import annotations

import time

import pytest
import schemathesis
# Imported here, at collection, on purpose: schemathesis is a pytest plugin, so pytest
# re-parses its modules for assertion rewriting, and doing that lazily inside the test --
# after hypothesis has changed the recursion limit -- trips CPython 3.11.7's "AST
# constructor recursion depth mismatch" on a fresh venv.
import schemathesis.specs.openapi.schemas  # noqa: F401
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from engine.dp.async_client import AsyncEngineClient
from engine.config import EngineConfig
from service.app import build_app
from service.state import AppState, ServeSettings
from tests.service.server_process import free_port_run

MAX_EXAMPLES = 30
MODEL_NAME = "fuzz"


@pytest.fixture(scope="module")
def app(llama_path):
    config = EngineConfig.create(llama_path, max_model_len=64, kv_cache_memory="16MiB", num_threads=1,
                                 data_parallel_rpc_port=free_port_run(), dtype="float32")
    settings = ServeSettings(served_model_names=(MODEL_NAME,), max_queued_requests=10_000)
    state = AppState(config, AsyncEngineClient(config), settings)
    return build_app(state)


def test_no_input_breaks_the_api(app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)  # starts the lifespan (and the engine)
    state: AppState = app.state.kvsentry
    deadline = time.monotonic() + 120
    while not state.client.ready:
        assert state.dead_reason is None, state.dead_reason
        assert time.monotonic() < deadline, "engine did not start"
        time.sleep(0.1)

    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize"}
    # Negative cases need something to break: only operations with a request body get them.
    plan = [(op, GenerationMode.POSITIVE) for op in operations]
    plan += [(op, GenerationMode.NEGATIVE) for op in operations if op.method.upper() == "POST" and op.body]
    for operation, mode in plan:
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case) -> None:
            case.call_and_validate(checks=[not_a_server_error, response_schema_conformance])

        check()
    assert state.dead_reason is None
    assert not state.in_flight
