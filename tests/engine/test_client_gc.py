"""A client dropped without close() or shutdown() must not hang the garbage collector.

pyzmq terminates a collected context from its own __del__, and zmq_ctx_term waits for every
socket of the context to close; a socket in the same garbage cycle, not finalised yet, never
does. A suite run hung so inside an unrelated test's gc (test_sampler, minutes after the test
that dropped a client). The clients now release their sockets, context and rank processes
through a weakref finalizer, which holds them until it has closed them.

Each case runs in a subprocess with a timeout: the failure mode is a hang."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.engine.dp_helpers import free_port_block

ROOT = Path(__file__).resolve().parents[2]

# Both cases: a config of two local ranks and its output port taken, so that the client binds
# its input socket and then fails.
PRELUDE = """
import asyncio, gc, sys, zmq
from engine.config import EngineConfig
from engine.dp import client as dp_client
from engine.dp.async_client import AsyncEngineClient
from engine.dp.rank import endpoints
config = EngineConfig.create(sys.argv[1], max_model_len=64, num_gpu_blocks=8, data_parallel_size=2,
                             data_parallel_rpc_port=int(sys.argv[2]))
holder = zmq.Context()
taken = holder.socket(zmq.PULL)
taken.bind(endpoints(config)[1])
"""
EPILOGUE = """
gc.collect()
taken.close(0)
holder.term()
print("collected")
"""

# The server's client: start() fails; the client is dropped in a reference cycle without shutdown().
ASYNC_CLIENT = PRELUDE + textwrap.dedent("""
    client = AsyncEngineClient(config)
    try:
        asyncio.run(client.start())
        raise SystemExit("start() bound a taken port")
    except zmq.ZMQError:
        pass
    client.cycle = client
    del client
""") + EPILOGUE

# The offline client: its constructor fails; the half-built client (a traceback frame held it)
# is dropped.
SYNC_CLIENT = PRELUDE + textwrap.dedent("""
    made = []
    real_init = dp_client.ClientResources.__init__
    def keep(self, *args):
        real_init(self, *args)
        made.append(self)
    dp_client.ClientResources.__init__ = keep
    try:
        dp_client.DPEngineClient(config)
        raise SystemExit("the client bound a taken port")
    except zmq.ZMQError:
        pass
    assert made and made[0].sockets, "the client did not get as far as its input socket"
    made.clear()
""") + EPILOGUE


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", [ASYNC_CLIENT, SYNC_CLIENT], ids=["async", "offline"])
def test_a_dropped_client_does_not_hang_the_collector(checkpoint, script):
    port = free_port_block(3)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        done = subprocess.run([sys.executable, "-c", script, checkpoint("tiny-llama"), str(port)], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("gc.collect() hung on the dropped client's zmq context")
    assert done.returncode == 0 and "collected" in done.stdout, done.stderr[-2000:]
