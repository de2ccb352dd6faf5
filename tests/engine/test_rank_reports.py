"""When a DP rank sends its stats (engine/dp/rank.py): on an integrity finding at once, on a
timer while busy, when asked (idle, wave over) -- not with every step; a step with nothing to
tell sends nothing."""
from __future__ import annotations

import msgspec
import pytest

from engine.dp import rank as rank_module
from engine.dp.rank import STATS_SECONDS, RankLoop
from engine.integrity.stats import IntegrityStats
from engine.messages import EngineCoreOutput, EngineMessage, StepStats


class FakeIntegrity:
    findings = 0


class FakeCore:
    """What RankLoop reads of an EngineCore for its reports; counts the stats it builds."""
    rank = 0

    def __init__(self):
        self.integrity = FakeIntegrity()
        self.built = 0

    def stats(self) -> StepStats:
        self.built += 1
        return StepStats(0, self.built, 0, 0, 0, 0, 0.0, 0, 0, 0, integrity=IntegrityStats(heals=self.built))


class Socket:
    def __init__(self):
        self.sent: list = []

    def send(self, payload, copy=True):
        self.sent.append(msgspec.msgpack.decode(payload, type=EngineMessage))


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(rank_module.time, "monotonic", lambda: now[0])
    return now


def test_stats_go_on_a_finding_a_timer_or_when_asked_not_every_step(clock):
    core = FakeCore()
    loop = RankLoop(core, inputs=None, outputs=Socket(), lockstep=False)
    assert loop.stats_due() is not None  # the first report
    for _ in range(100):  # a hundred steps within the period: nothing built, no device counter read
        clock[0] += STATS_SECONDS / 1000
        assert loop.stats_due() is None
    assert core.built == 1
    core.integrity.findings += 1  # a NaN found, a mismatch, a heal: reported at once
    assert loop.stats_due() is not None and loop.stats_due() is None
    clock[0] += STATS_SECONDS
    assert loop.stats_due() is not None  # the timer
    assert loop.stats_due(now=True) is not None  # going idle, a wave over
    assert core.built == 4


def test_a_step_with_nothing_to_tell_sends_nothing():
    outputs = Socket()
    loop = RankLoop(FakeCore(), inputs=None, outputs=outputs, lockstep=True)
    loop.send(outputs=[], stats=None)
    assert outputs.sent == []
    loop.send(outputs=[EngineCoreOutput("r", 0, [7])], stats=None)
    loop.send(stats=None, wave_complete=3)
    loop.send(stats=FakeCore().stats())
    assert [(len(m.outputs), m.stats is not None, m.wave_complete) for m in outputs.sent] == [
        (1, False, None), (0, False, 3), (0, True, None)]
    assert outputs.sent[2].stats.integrity.heals == 1  # the integrity struct crosses intact
