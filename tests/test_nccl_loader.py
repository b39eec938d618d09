"""NCCL loader: search order, the not-found message, and (where NCCL exists) real calls."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereus_comm import nccl
from nereus_comm.errors import NcclNotFoundError

ISOLATED = {"site_dirs": [], "torch_lib_dir": None, "system": False}


def _fake_lib(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lib = folder / nccl.LIBRARY_NAME
    lib.write_bytes(b"not a shared object")
    return lib


def test_search_order_env_then_wheels_then_torch_then_system(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {nccl.ENV_VAR: str(tmp_path / "override"), "LD_LIBRARY_PATH": "/opt/a:/opt/b"}
    places = nccl.candidate_paths(env=env, site_dirs=[str(site)], torch_lib_dir="/t/lib")
    wheres = [w for w, _ in places]
    paths = [p for _, p in places]
    assert wheres[0] == f"${nccl.ENV_VAR}"
    assert paths[0] == str(tmp_path / "override")
    assert paths[1] == str(site / "nvidia" / "nccl" / "lib" / nccl.LIBRARY_NAME)
    torch_at = paths.index(f"/t/lib/{nccl.LIBRARY_NAME}")
    ld_at = paths.index(f"/opt/a/{nccl.LIBRARY_NAME}")
    assert 1 < torch_at < ld_at < paths.index(f"/opt/b/{nccl.LIBRARY_NAME}")
    assert any(w.startswith("ldconfig") for w in wheres[torch_at:ld_at])


def test_env_override_accepts_a_folder_and_wins_over_a_wheel(tmp_path: Path) -> None:
    wheel_lib = _fake_lib(tmp_path / "site" / "nvidia" / "nccl" / "lib")
    override_lib = _fake_lib(tmp_path / "mine")
    kwargs = {**ISOLATED, "site_dirs": [str(tmp_path / "site")]}
    assert nccl.find_nccl(env={}, **kwargs) == str(wheel_lib)
    env = {nccl.ENV_VAR: str(override_lib.parent)}
    assert nccl.find_nccl(env=env, **kwargs) == str(override_lib)


def test_torch_lib_folder_is_found_when_no_wheel(tmp_path: Path) -> None:
    lib = _fake_lib(tmp_path / "torch" / "lib")
    found = nccl.find_nccl(env={}, site_dirs=[], torch_lib_dir=str(lib.parent), system=False)
    assert found == str(lib)


def test_not_found_lists_every_place(tmp_path: Path) -> None:
    env = {nccl.ENV_VAR: str(tmp_path / "nothing_here.so"), "LD_LIBRARY_PATH": str(tmp_path)}
    with pytest.raises(NcclNotFoundError) as info:
        nccl.find_nccl(env=env, site_dirs=[str(tmp_path / "s")], torch_lib_dir="/t/lib")
    msg = str(info.value)
    assert str(tmp_path / "nothing_here.so") in msg
    assert str(tmp_path / "s" / "nvidia" / "nccl" / "lib") in msg
    assert f"/t/lib/{nccl.LIBRARY_NAME}" in msg
    assert "LD_LIBRARY_PATH" in msg and "ldconfig" in msg
    assert nccl.ENV_VAR in msg.splitlines()[-1]  # says what to do


def test_load_reports_why_a_present_file_failed(tmp_path: Path) -> None:
    bad = _fake_lib(tmp_path)
    with pytest.raises(NcclNotFoundError) as info:
        nccl.load_nccl(str(bad))
    assert str(bad) in str(info.value) and "dlopen" in str(info.value)


def _real_nccl() -> nccl.NcclLibrary:
    try:
        return nccl.load_nccl()
    except NcclNotFoundError:
        pytest.skip("NCCL is not installed here (pip install nvidia-nccl-cu12)")


def test_real_library_version_and_unique_id() -> None:
    # Needs only the library, not a device: ncclGetVersion and ncclGetUniqueId run on CPU.
    lib = _real_nccl()
    assert lib.version >= 21800 and lib.version_string.startswith("2.")
    uid = lib.get_unique_id()
    assert len(uid) == nccl.NCCL_UNIQUE_ID_BYTES and uid != lib.get_unique_id()
    assert lib is nccl.load_nccl()  # cached: one library per process
    with pytest.raises(ValueError, match="128 bytes"):
        lib.comm_init_rank(1, b"short", 0)


def test_real_library_without_device_raises_nccl_error() -> None:
    lib = _real_nccl()
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a device is present: nereus_comm.nccl_check covers the real calls")
    with pytest.raises(nccl.NcclError, match="ncclCommInitRank failed"):
        lib.comm_init_rank(1, lib.get_unique_id(), 0)


@pytest.mark.gpu
def test_one_rank_checks_on_device() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from nereus_comm.nccl_check import run_one_rank_checks

    report = run_one_rank_checks()
    assert report["status"] == "ok", report
    assert report["self_send_recv_equal"] is True
