"""The key directory ``trainguard keys`` manages (:class:`KeyAdmin`): rotation keeps old keys
valid, retirement removes them from what verifies, ``init`` refuses an initialised directory,
and the agent bundle holds every live public key and the current event key. The command line
itself is tested in ``tests/service/daemon/test_keys_admin.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.agent.keys._keystore import (
    KeyStore,
    KeyStoreError,
    load_event_key,
    load_public_keys,
)
from trainguard.daemon.admin._keys import KeyAdmin


def test_rotation_keeps_old_keys_and_retirement_drops_them(tmp_path: Path) -> None:
    admin = KeyAdmin(tmp_path / "k")
    first_signing, first_data = admin.init()
    store = KeyStore(admin.path)
    second = admin.rotate("signing")
    keys = store.load_daemon_keys()
    assert keys.signing_kid == second.kid
    assert set(keys.verify) == {first_signing.kid, second.kid}
    new_data = admin.rotate("data")
    keys = store.load_daemon_keys()
    assert (keys.data_kid, set(keys.data)) == (new_data.kid, {first_data.kid, new_data.kid})

    with pytest.raises(KeyStoreError, match="is current"):
        admin.retire(second.kid)
    retired = admin.retire(first_signing.kid)
    assert retired.retired_at is not None
    assert set(store.load_daemon_keys().verify) == {second.kid}
    assert set(store.public_keys(retired=True)) == {first_signing.kid}
    with pytest.raises(KeyStoreError, match="no live key"):
        admin.retire(first_signing.kid)

    listed = {(i.kind, i.kid): i for i in admin.all_keys()}
    assert listed["signing", first_signing.kid].retired_at == retired.retired_at
    assert listed["signing", second.kid].current
    assert not listed["data", first_data.kid].current


def test_init_refuses_an_initialised_directory_and_jobs_need_init(tmp_path: Path) -> None:
    admin = KeyAdmin(tmp_path / "k")
    with pytest.raises(KeyStoreError, match="not initialised"):
        admin.add_job("j")
    admin.init()
    with pytest.raises(KeyStoreError, match="initialised already"):
        admin.init()
    admin.add_job("j")
    with pytest.raises(KeyStoreError, match="has an event key already"):
        admin.add_job("j")
    with pytest.raises(KeyStoreError, match="no event key to rotate"):
        admin.rotate("event", "other")
    with pytest.raises(KeyStoreError, match="not a job id"):
        admin.add_job("../signing")


def test_the_agent_bundle_holds_every_live_public_key_and_the_current_event_key(
    tmp_path: Path,
) -> None:
    admin = KeyAdmin(tmp_path / "k")
    admin.init(["j"])
    admin.rotate("signing")
    bundle = admin.agent_bundle("j")
    keys = KeyStore(admin.path).load_daemon_keys()
    assert set(load_public_keys(bundle.public_keys)) == set(keys.verify)
    event = load_event_key(bundle.event_key)
    assert keys.current_event_key("j") == (event.kid, event.secret)
    manifest = bundle.secret_manifest()
    assert manifest["kind"] == "Secret"
    files = manifest["stringData"]
    assert isinstance(files, dict)
    assert set(files) == {"daemon-public-keys.pem", "event-key"}
