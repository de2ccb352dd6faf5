"""POST /debug/faults exists only with --enable-fault-injection: without it any body gets 404."""
from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from engine.config import EngineConfig
from service.app import build_app
from service.state import AppState, ServeSettings

NAN_FAULT = {"rank": 0, "kind": "nan", "layer": 1, "block": 3}


class ReadyClient:
    """An engine client whose ranks are up; it records the faults it is asked to inject."""
    ready, dead_reason, num_unfinished = True, None, 0

    def __init__(self):
        self.last_progress = 0.0
        self.stats, self.op_implementations, self.faults = {}, {}, []

    async def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    async def inject_fault(self, rank, fault) -> None:
        self.faults.append((rank, fault))


@pytest.fixture(scope="module")
def config(llama_path) -> EngineConfig:
    return EngineConfig.create(llama_path, max_model_len=64, kv_cache_memory="4MiB")


def client_for(config: EngineConfig, enable: bool) -> tuple[TestClient, ReadyClient]:
    engine = ReadyClient()
    state = AppState(config, engine, ServeSettings(served_model_names=("m",), enable_fault_injection=enable))
    return TestClient(build_app(state)), engine


@pytest.mark.parametrize("body", [b'{"kind": ', b'{"kind": "nan"}', b"[]"], ids=["malformed", "valid", "array"])
def test_without_the_flag_the_route_does_not_exist(config, body):
    client, engine = client_for(config, enable=False)
    with client:
        response = client.post("/debug/faults", content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 404, response.text
        assert response.json()["error"]["type"] == "not_found_error"
        assert "/debug/faults" not in client.get("/openapi.json").json()["paths"]
    assert not engine.faults


def test_with_the_flag_the_route_injects(config):
    client, engine = client_for(config, enable=True)
    with client:
        response = client.post("/debug/faults", json=NAN_FAULT)
        assert response.status_code == 200, response.text
        assert response.json()["status"] == "injected"
        malformed = client.post("/debug/faults", content=b'{"kind": ', headers={"Content-Type": "application/json"})
        assert malformed.status_code == 400
        assert client.post("/debug/faults", json={**NAN_FAULT, "layer": 99}).json()["error"]["param"] == "layer"
        assert "/debug/faults" in client.get("/openapi.json").json()["paths"]
    [(rank, fault)] = engine.faults
    assert (rank, fault.kind, fault.layer, fault.block) == (0, "nan", 1, 3)


def test_a_running_server_without_the_flag_has_no_fault_route(server):
    response = httpx.post(server.url + "/debug/faults", content=b'{"kind": ', timeout=30,
                          headers={"Authorization": f"Bearer {server.api_key}", "Content-Type": "application/json"})
    assert response.status_code == 404, response.text
