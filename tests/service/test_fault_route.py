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
    return EngineConfig.create(llama_path, max_model_len=64, kv_cache_memory="4MiB", dtype="float32")


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


def post_faults(config: EngineConfig, *bodies: dict) -> tuple[list[httpx.Response], list]:
    client, engine = client_for(config, enable=True)
    with client:
        responses = [client.post("/debug/faults", json=body) for body in bodies]
    return responses, engine.faults


def test_bitflip_and_stale_slot_dummy_reach_the_rank(config):
    responses, faults = post_faults(config, {"kind": "bitflip"}, {"kind": "bitflip", "block": None},
                                    {"kind": "bitflip", "layer": 1, "block": 5, "target": "v"},
                                    {"rank": 0, "kind": "stale_slot_dummy"}, {"kind": "nan"})
    assert [r.status_code for r in responses] == [200] * 5, [r.text for r in responses]
    assert responses[0].json()["detail"]["kind"] == "bitflip"
    assert [(rank, f.kind, f.layer, f.block, f.target) for rank, f in faults] == [
        (0, "bitflip", 0, -1, "k"),   # no block: the rank flips a bit of its latest sealed block
        (0, "bitflip", 0, -1, "k"),
        (0, "bitflip", 1, 5, "v"),
        (0, "stale_slot_dummy", 0, 0, "k"),
        (0, "nan", 0, 0, "k"),        # no block is block 0, as before
    ]


@pytest.mark.parametrize("body, param", [
    ({"kind": "bitflip", "block": 10**6}, "block"),
    ({"kind": "bitflip", "block": -1}, "block"),   # -1 is the Fault's "rank picks", not the API's
    ({"kind": "bitflip", "block": "3"}, "block"),
    ({"kind": "bitflip", "layer": 99}, "layer"),
    ({"kind": "nan", "block": 10**6}, "block"),
    ({"kind": "stale_slot_dummy", "rank": -1}, "rank"),
    ({"kind": "bitflp"}, "kind"),
    ({"block": 3}, "kind"),
    ({"kind": "nan", "after_steps": 5}, "after_steps"),  # only a rank fault waits for steps
    ({"kind": "kill_rank", "after_steps": -1}, "after_steps"),
], ids=["bitflip-block-too-large", "bitflip-negative-block", "bitflip-string-block", "bitflip-layer",
        "nan-block-too-large", "negative-rank", "unknown-kind", "no-kind", "after-steps-on-nan",
        "negative-after-steps"])
def test_invalid_faults_are_400_in_openai_shape(config, body, param):
    [response], faults = post_faults(config, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    assert error["param"] == param, error
    assert not faults


def test_rank_faults_carry_their_step_count(config):
    responses, faults = post_faults(config, {"kind": "kill_rank", "after_steps": 450},
                                    {"rank": 0, "kind": "hang_rank"})
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    assert [(f.kind, f.after_steps) for _, f in faults] == [("kill_rank", 450), ("hang_rank", 0)]


def test_bitflip_block_bound_is_the_cache_size(config):
    responses, faults = post_faults(config, {"kind": "bitflip", "block": config.num_blocks - 1},
                                    {"kind": "bitflip", "block": config.num_blocks})
    assert [r.status_code for r in responses] == [200, 400]
    assert f"< {config.num_blocks}" in responses[1].json()["error"]["message"]
    assert [f.block for _, f in faults] == [config.num_blocks - 1]
