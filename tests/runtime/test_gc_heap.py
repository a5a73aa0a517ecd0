"""The start-up heap leaves the collector's scans while a command serves, and comes back after."""

import gc
import logging

from sits.runtime.gc_heap import frozen_startup_heap


def test_frozen_heap_is_out_of_every_scan_then_back(caplog):
    survivors = [[index] for index in range(1000)]  # containers the collector tracks
    with caplog.at_level(logging.INFO, logger="sits.gc"), frozen_startup_heap("test") as frozen:
        assert frozen >= len(survivors)
        assert gc.get_freeze_count() >= len(survivors)
        scanned = {id(obj) for obj in gc.get_objects()}
        assert not scanned & {id(obj) for obj in survivors}  # a full collection no longer walks them
        made_while_serving = [[1], [2]]
        scanned = {id(obj) for obj in gc.get_objects()}
        assert {id(obj) for obj in made_while_serving} <= scanned  # new objects are collected as before
    assert gc.get_freeze_count() == 0
    assert {id(obj) for obj in survivors} <= {id(obj) for obj in gc.get_objects()}
    assert "start-up objects moved out of the garbage collector's scans" in caplog.text


def test_cyclic_garbage_made_while_frozen_is_still_collected():
    with frozen_startup_heap("test"):
        cycle: list = []
        cycle.append(cycle)
        marker = id(cycle)
        del cycle
        assert gc.collect() >= 1
        assert marker not in {id(obj) for obj in gc.get_objects()}
