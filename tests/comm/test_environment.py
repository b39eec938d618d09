"""The environment worker processes start with: WORKER_ENV's defaults, never over the user's."""

from __future__ import annotations

import os

from nereus_comm import WORKER_ENV, worker_env, worker_environ


def test_worker_env_adds_defaults_and_keeps_what_is_set():
    env = worker_env({"PATH": "/bin"})
    assert env == {"PATH": "/bin", **WORKER_ENV}
    mine = {key: "0" for key in WORKER_ENV}
    assert worker_env(mine) == mine


def test_worker_environ_sets_and_restores(monkeypatch):
    for key in WORKER_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NEREUS_TEST_EXTRA", "before")
    with worker_environ(NEREUS_TEST_EXTRA="during"):
        assert all(os.environ[k] == v for k, v in WORKER_ENV.items())
        assert os.environ["NEREUS_TEST_EXTRA"] == "during"
    assert not any(k in os.environ for k in WORKER_ENV)
    assert os.environ["NEREUS_TEST_EXTRA"] == "before"
