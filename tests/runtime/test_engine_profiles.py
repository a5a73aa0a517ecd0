"""`SITS_ENGINE_PROFILE`: the engine process's threads profiled in their own CPU time, written at the end."""

from __future__ import annotations

import pstats
import threading

from sits.runtime.engine.core_process import PROFILE_ENV, ThreadProfiles


def _spin_in_python() -> int:
    return sum(i * i for i in range(200_000))


def test_each_thread_gets_its_own_profile(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "profiles"))
    profiles = ThreadProfiles.from_env()
    waiting = threading.Event()
    release = threading.Event()

    def receiver() -> None:  # still running when the profiles are written, as the engine's receiver is
        _spin_in_python()
        waiting.set()
        release.wait(30)

    thread = threading.Thread(target=profiles.wrap("receiver", receiver), daemon=True)
    thread.start()
    assert waiting.wait(30)
    profiles.wrap("loop", _spin_in_python)()
    profiles.dump()
    release.set()
    thread.join(30)
    written = sorted(path.name.rsplit("-", 1)[1] for path in (tmp_path / "profiles").iterdir())
    assert written == ["loop.prof", "receiver.prof"]
    for path in (tmp_path / "profiles").iterdir():
        functions = {name for _, _, name in pstats.Stats(str(path)).stats}
        assert "_spin_in_python" in functions


def test_without_the_variable_nothing_is_wrapped_or_written(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    profiles = ThreadProfiles.from_env()
    assert profiles.wrap("loop", _spin_in_python) is _spin_in_python
    profiles.dump()
    assert not any(tmp_path.iterdir())
