"""UUIDv7 request ids: layout, order, and the time they carry."""

from __future__ import annotations

import threading
import uuid

import pytest

from sits.runtime.tenancy.request_ids import (
    RequestIdGenerator,
    request_id_unix_ms,
)


def test_ids_are_rfc9562_version_7():
    value = uuid.UUID(RequestIdGenerator().new())
    assert value.version == 7
    assert value.variant == uuid.RFC_4122


def test_ids_increase_within_one_millisecond_and_when_the_clock_steps_back():
    now = [1_700_000_000_000_000_000]
    generator = RequestIdGenerator(clock_ns=lambda: now[0])
    ids = [generator.new() for _ in range(5000)]  # all in one millisecond
    now[0] -= 5_000_000  # the wall clock steps back 5 ms
    ids += [generator.new() for _ in range(10)]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert all(uuid.UUID(i).version == 7 for i in ids)
    assert request_id_unix_ms(ids[0]) == 1_700_000_000_000


def test_ids_from_many_threads_are_unique_and_ordered_per_generator():
    generator = RequestIdGenerator()
    made: list[list[str]] = [[] for _ in range(4)]

    def work(out: list[str]) -> None:
        out.extend(generator.new() for _ in range(2000))

    threads = [threading.Thread(target=work, args=(out,)) for out in made]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [i for out in made for i in out]
    assert len(set(every)) == len(every)
    assert all(out == sorted(out) for out in made)


def test_time_is_read_back_from_prefixed_and_hex_forms():
    generator = RequestIdGenerator(clock_ns=lambda: 1_700_000_123_456_000_000)
    value = generator.new_uuid()
    for form in (str(value), f"chatcmpl-{value}", f"cmpl-{value.hex}", f"{value}-1"):
        assert request_id_unix_ms(form) == 1_700_000_123_456


def test_ids_without_a_timestamp_are_rejected():
    with pytest.raises(ValueError, match="not a time-ordered"):
        request_id_unix_ms(str(uuid.uuid4()))
    with pytest.raises(ValueError):
        request_id_unix_ms("my-own-request-id")


def test_the_servers_response_ids_carry_a_readable_time():
    """The eviction score reads the engine's request ids, which the server makes (`chatcmpl-<hex>`)."""
    from sits.runtime.server.request_ids import new_request_id as server_request_id
    from sits.runtime.server.request_ids import uuid7_time

    response_id = server_request_id("chatcmpl")
    assert request_id_unix_ms(response_id) / 1000.0 == pytest.approx(uuid7_time(response_id))
