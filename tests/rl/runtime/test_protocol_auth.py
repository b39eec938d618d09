"""Message authentication of the runtime's wire protocol, on an in-process store."""

from __future__ import annotations

import logging
import pickle

import pytest
import torch.distributed as dist

from nereus_rl.runtime import protocol as P


class _Touch:
    """Unpickling this creates the file ``path`` (builtins.open), as an attacker's code would."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


SECRET = bytes(range(32))


def test_round_trip_small_and_in_parts():
    store = dist.HashStore()
    P.put(store, "k", {"a": 1}, SECRET)
    assert P.take(store, "k", SECRET) == {"a": 1}
    assert not store.check(["k"])
    big = bytes(P.PART_BYTES * 2 + 5)
    P.put(store, "big", big, SECRET)
    assert P.take(store, "big", SECRET) == big
    assert not store.check(["big", "big#0"])


def test_forged_message_is_not_unpickled_and_is_left_in_place(tmp_path, caplog):
    store = dist.HashStore()
    target = tmp_path / "ran"
    forged = b"w" + pickle.dumps(_Touch(str(target)))  # the wire format, without a tag
    store.set("cmd", forged)
    with caplog.at_level(logging.WARNING, "nereus_rl.runtime"):
        with pytest.raises(P.UnauthenticatedMessageError, match="'cmd'"):
            P.take(store, "cmd", SECRET)
    assert not target.exists()
    assert "'cmd'" in caplog.text and "rejected" in caplog.text
    assert bytes(store.get("cmd")) == forged  # left for a genuine message to replace
    caplog.clear()
    with pytest.raises(P.UnauthenticatedMessageError):
        P.take(store, "cmd", SECRET, known_bad=forged)
    assert caplog.text == ""  # the same forged value is not logged twice
    P.put(store, "cmd", 7, SECRET)
    assert P.take(store, "cmd", SECRET, known_bad=forged) == 7


def test_a_genuine_message_replayed_under_another_key_is_rejected():
    store = dist.HashStore()
    P.put(store, "cmd/0/1", "run this once", SECRET)
    store.set("cmd/1/1", store.get("cmd/0/1"))
    with pytest.raises(P.UnauthenticatedMessageError):
        P.take(store, "cmd/1/1", SECRET)
    value = P.seal(SECRET, P.info_key(0), "info")
    with pytest.raises(P.UnauthenticatedMessageError):
        P.unseal(SECRET, P.info_key(1), value)
    assert P.unseal(SECRET, P.info_key(0), value) == "info"


def test_another_secret_and_tampering_are_rejected():
    store = dist.HashStore()
    P.put(store, "k", "x", SECRET)
    with pytest.raises(P.UnauthenticatedMessageError):
        P.take(store, "k", bytes(32))
    value = bytearray(store.get("k"))
    value[-1] ^= 1
    store.set("k", bytes(value))
    with pytest.raises(P.UnauthenticatedMessageError):
        P.take(store, "k", SECRET)


def test_forged_head_naming_missing_parts_is_rejected_at_once():
    store = dist.HashStore()
    store.set("k", b"p" + bytes(32) + b"1000000")  # a reader must not wait for these parts
    with pytest.raises(P.UnauthenticatedMessageError):
        P.take(store, "k", SECRET)
    store.set("k", b"w")
    with pytest.raises(P.UnauthenticatedMessageError):
        P.take(store, "k", SECRET)


def test_secret_check_and_loading(tmp_path, monkeypatch):
    store = dist.HashStore()
    P.publish_secret_check(store, SECRET)
    P.check_job_secret(store, SECRET, "here")
    with pytest.raises(P.JobSecretError, match="not the secret of the job at here"):
        P.check_job_secret(store, bytes(32), "here")
    with pytest.raises(P.JobSecretError, match="not the secret of the job at there"):
        P.check_job_secret(dist.HashStore(), SECRET, "there", timeout=0.1)  # no check value

    path = P.write_secret_file(tmp_path / "private" / "job.secret", SECRET)
    assert path.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "private").stat().st_mode & 0o777 == 0o700
    monkeypatch.delenv(P.SECRET_ENV, raising=False)
    assert P.load_secret(path) == SECRET
    with pytest.raises(P.JobSecretError, match="--secret-file"):
        P.load_secret(None)
    monkeypatch.setenv(P.SECRET_ENV, SECRET.hex())
    assert P.load_secret(None) == SECRET
    path.chmod(0o644)
    with pytest.raises(P.JobSecretError, match="chmod 600"):
        P.load_secret(path)
    bad = tmp_path / "bad"
    bad.write_text("not hex")
    bad.chmod(0o600)
    with pytest.raises(P.JobSecretError, match="does not hold a job secret"):
        P.load_secret(bad)
    with pytest.raises(P.JobSecretError, match="cannot read"):
        P.load_secret(tmp_path / "missing")
