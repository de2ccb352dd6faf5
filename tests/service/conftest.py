"""Servers shared by the service tests: one tiny Llama server (DP=1) for the whole session."""
from __future__ import annotations

import pytest

from tests.service.server_process import ServerProcess

MAIN_MODEL_NAME = "tiny-llama"
MAIN_MAX_MODEL_LEN = 4096
MAIN_MAX_QUEUED = 4
# Roomy: on a loaded 2-core machine a rank can go unheard for seconds; the wedge tests run a
# server of their own with a tight one (tests/service/test_lifecycle.py).
MAIN_STALL_TIMEOUT = 60


@pytest.fixture(scope="session")
def llama_path(checkpoint) -> str:
    return checkpoint("tiny-llama", max_position_embeddings=MAIN_MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def moe_path(checkpoint) -> str:
    return checkpoint("tiny-deepseek-v3")


def main_server(llama_path: str, log_dir, stall_timeout: float = MAIN_STALL_TIMEOUT):
    """`kvsentry serve` of tiny-llama with an API key and a small in-flight limit; a generator
    for a fixture to yield from."""
    proc = ServerProcess(llama_path, "--served-model-name", MAIN_MODEL_NAME, "alias",
                         "--max-model-len", str(MAIN_MAX_MODEL_LEN),
                         "--max-queued-requests", str(MAIN_MAX_QUEUED), "--threads", "1",
                         "--health-stall-timeout", str(stall_timeout), log_dir=log_dir)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def server(llama_path, tmp_path_factory):
    yield from main_server(llama_path, tmp_path_factory.mktemp("logs"))


@pytest.fixture
def http(server):
    with server.client() as client:
        yield client


@pytest.fixture
def openai_client(server):
    return server.openai()
