"""Admission control's bookkeeping: what a request reserves it gives back, however it ends.

The counting is checked here directly; the behaviour through a real server under load (503 with
Retry-After before the engine sees a request, every slot free afterwards) is `test_load.py`.
"""

from __future__ import annotations

import pytest

from sits.runtime.server.admission import MIN_WAITING, AdmissionControl, default_max_waiting
from sits.runtime.server.errors import OpenAIError


def test_reservations_fill_the_capacity_then_refuse_with_503_and_retry_after():
    admission = AdmissionControl(max_running=2, max_waiting=2)
    first, second, third = {}, {}, {}
    admission.reserve(first, 3)
    admission.reserve(second, 1)
    assert admission.full and admission.in_flight == 4 and admission.waiting == 2
    with pytest.raises(OpenAIError) as refused:
        admission.reserve(third, 1)
    error = refused.value
    assert error.status == 503 and error.code == "server_overloaded" and int(error.headers["Retry-After"]) >= 1
    assert admission.rejected == 1 and third == {}  # nothing reserved for the refused request
    admission.release(first)
    admission.release(first)  # idempotent: the gate may see a request end more than once
    assert admission.in_flight == 1 and not admission.full
    admission.reserve(third, 3)
    assert admission.in_flight == 4


def test_a_request_larger_than_the_capacity_is_a_400_naming_its_param():
    admission = AdmissionControl(max_running=4, max_waiting=4)
    with pytest.raises(OpenAIError) as refused:
        admission.reserve({}, 9, param="n")
    assert refused.value.status == 400 and refused.value.param == "n"
    assert refused.value.code == "too_many_sequences" and admission.in_flight == 0


def test_zero_or_negative_sequences_still_count_one():
    admission = AdmissionControl(max_running=1, max_waiting=0)
    state: dict = {}
    admission.reserve(state, -5)  # a bad `n` is refused later (400); meanwhile it holds one slot, not minus five
    assert admission.in_flight == 1
    admission.release(state)
    assert admission.in_flight == 0


def test_retry_after_grows_with_the_batches_ahead_and_stays_within_a_minute():
    admission = AdmissionControl(max_running=2, max_waiting=6)
    assert admission.retry_after() == 1  # nothing measured yet: the configured minimum
    admission.mean_duration_s = 10.0
    admission.in_flight = 8  # three batches of two wait behind the running one
    assert admission.retry_after() == 30
    admission.mean_duration_s = 1000.0
    assert admission.retry_after() == 60


def test_default_queue_is_one_batch_and_at_least_the_minimum():
    assert default_max_waiting(256) == 256
    assert default_max_waiting(1) == MIN_WAITING
    with pytest.raises(ValueError):
        AdmissionControl(max_running=0, max_waiting=1)
