"""The rolling sweep's time budget (engine/integrity/sweep.py): what it grants, on a simulated clock."""
from __future__ import annotations

import random

from engine.paging import FIRST_USABLE_BLOCK_ID
from engine.integrity.sweep import RollingSweep, ScanBudget


def run(budget: ScanBudget, step_seconds, block_seconds: float, steps: int, seed: int = 0):
    """Steps of the given lengths, each scanning what the budget grants at block_seconds (+-20%)."""
    rng = random.Random(seed)
    now, spent, granted = 0.0, 0.0, []
    for _ in range(steps):
        now += step_seconds(rng)
        blocks = budget.blocks(now)
        cost = blocks * block_seconds * rng.uniform(0.8, 1.2)
        budget.spent(cost, blocks)
        now += cost
        spent += cost
        granted.append(blocks)
    return now, spent, granted


def test_the_sweep_stays_within_its_share_of_time():
    for step in (0.004, 0.025, 0.075):  # a tiny model's step, batch 1 and batch 64 of the default model
        budget = ScanBudget(0.004, max_blocks=16)
        elapsed, spent, granted = run(budget, lambda rng: step * rng.uniform(0.5, 1.5), 1e-4, 5000)
        # The first (measuring) block and one window of slack are all it may exceed the share by.
        assert spent <= 0.004 * elapsed + 17 * 1.2e-4, (step, spent / elapsed)
        # ...and it uses the share it is given (it is a rate, not a ceiling it never reaches).
        assert spent >= 0.5 * 0.004 * elapsed, (step, spent / elapsed)
        assert max(granted) <= 16


def test_longer_steps_sweep_more_blocks_per_step():
    rates = []
    for step in (0.005, 0.025, 0.1):
        budget = ScanBudget(0.004, max_blocks=16)
        run(budget, lambda rng: step, 1e-4, 2000)
        rates.append(budget.blocks_per_step)
    assert rates[0] < rates[1] < rates[2]
    assert abs(rates[1] - 0.004 * 0.025 / 1e-4) < 0.3  # ~1 block per 25 ms step at 0.1 ms a block


def test_idle_time_buys_at_most_one_full_window():
    budget = ScanBudget(0.004, max_blocks=16)
    budget.blocks(0.0)
    budget.spent(1e-4, 1)
    assert budget.blocks(3600.0) == 16  # an hour idle
    budget.spent(16e-4, 16)
    assert budget.blocks(3600.001) == 0  # the burst is spent: no backlog of earned time


def test_every_block_is_visited_and_coverage_is_the_current_rate():
    num_blocks = 301
    budget = ScanBudget(0.004, max_blocks=16)
    sweep = RollingSweep(num_blocks, 16, budget)
    assert sweep.coverage_steps("rolling") == -(-(num_blocks - FIRST_USABLE_BLOCK_ID) // 16)  # before measuring
    seen, now = set(), 0.0
    steps = 0
    while len(seen) < num_blocks - FIRST_USABLE_BLOCK_ID:
        now += 0.025
        window = sweep.next_window(now)
        seen.update(window)
        budget.spent(len(window) * 1e-4, len(window))
        steps += 1
        assert steps < 2000, f"{len(seen)} of {num_blocks - 1} blocks seen"
    assert FIRST_USABLE_BLOCK_ID - 1 not in seen
    assert steps <= 1.5 * sweep.coverage_steps("rolling")
    assert abs(sweep.coverage_steps("rolling") - 300) <= 40  # 1 block a step at this rate


def test_without_a_budget_the_window_is_fixed():
    sweep = RollingSweep(10, 4)
    assert [list(sweep.next_window()) for _ in range(4)] == [[1, 2, 3, 4], [5, 6, 7, 8], [9], [1, 2, 3, 4]]
    assert sweep.coverage_steps("rolling") == 3
