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
        pytest.skip("a device is present: nereus_comm.testing.nccl_check covers the real calls")
    with pytest.raises(nccl.NcclError, match="ncclCommInitRank failed"):
        lib.comm_init_rank(1, lib.get_unique_id(), 0)


def test_one_rank_checks_skip_without_a_device() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a device is present: test_one_rank_checks_on_device runs them")
    from nereus_comm.testing import nccl_check

    report = nccl_check.run_one_rank_checks()
    assert report["status"] == "skipped" and "no CUDA device" in report["reason"], report


@pytest.mark.gpu
def test_one_rank_checks_on_device() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from nereus_comm.testing.nccl_check import run_one_rank_checks

    report = run_one_rank_checks()
    assert report["status"] == "ok", report
    assert report["self_send_recv_equal"] is True


# A stand-in libnccl.so.2 built at test time: it implements the entry points the
# core calls (self send/recv copies at ncclGroupEnd), so the dlopen, symbol,
# argument, GIL and error paths of the bindings run without a device. It has no
# ncclCommShrink/Grow, like NCCL < 2.27.
FAKE_NCCL_C = r"""
#include <stdlib.h>
#include <string.h>
typedef struct { int nranks, rank; } comm_t;
typedef struct { char internal[128]; } nid_t;
static int depth = 0, nsend = 0, nrecv = 0, ids = 0;
static const void* sbuf[64]; static void* rbuf[64]; static size_t scnt[64], rcnt[64];
int fakeGroupDepth(void) { return depth; }
int ncclGetVersion(int* v) { *v = 21903; return 0; }
int ncclGetUniqueId(nid_t* u) { memset(u, 0, sizeof *u); u->internal[0] = (char)++ids; return 0; }
int ncclCommInitRank(comm_t** c, int n, nid_t id, int r) {
  if (id.internal[0] == 0) return 4;
  *c = malloc(sizeof(comm_t)); (*c)->nranks = n; (*c)->rank = r; return 0; }
int ncclCommSplit(comm_t* c, int color, int key, comm_t** out, void* cfg) {
  if (color < 0) { *out = NULL; return 0; }
  *out = malloc(sizeof(comm_t)); (*out)->nranks = 1; (*out)->rank = 0; return 0; }
int ncclCommDestroy(comm_t* c) { free(c); return 0; }
int ncclCommAbort(comm_t* c) { free(c); return 0; }
int ncclCommGetAsyncError(comm_t* c, int* e) { *e = 0; return 0; }
int ncclCommCount(comm_t* c, int* n) { *n = c->nranks; return 0; }
int ncclCommUserRank(comm_t* c, int* r) { *r = c->rank; return 0; }
int ncclGroupStart(void) { depth++; nsend = nrecv = 0; return 0; }
int ncclSend(const void* b, size_t n, int t, int peer, comm_t* c, void* s) {
  if (t != 1 || n == 13) return 4;
  sbuf[nsend] = b; scnt[nsend++] = n; return 0; }
int ncclRecv(void* b, size_t n, int t, int peer, comm_t* c, void* s) {
  rbuf[nrecv] = b; rcnt[nrecv++] = n; return 0; }
int ncclGroupEnd(void) {
  depth--;
  for (int i = 0; i < nsend && i < nrecv; i++)
    memcpy(rbuf[i], sbuf[i], scnt[i] < rcnt[i] ? scnt[i] : rcnt[i]);
  return 0; }
const char* ncclGetErrorString(int r) { return r == 4 ? "invalid argument" : "some error"; }
const char* ncclGetLastError(comm_t* c) { return "fake: count 13 is refused"; }
"""


@pytest.fixture(scope="module")
def fake_nccl(tmp_path_factory) -> Path:
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in library")
    folder = tmp_path_factory.mktemp("fake_nccl")
    (folder / "fake.c").write_text(FAKE_NCCL_C)
    lib = folder / nccl.LIBRARY_NAME
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(folder / "fake.c")], check=True
    )
    return lib


def test_bindings_against_a_stand_in_library(fake_nccl: Path) -> None:
    import ctypes

    import torch

    lib = nccl.load_nccl(str(fake_nccl))
    assert (lib.version, lib.version_string) == (21903, "2.19.3")
    assert not lib.has_shrink and not lib.has_grow
    assert "2.19.3" in repr(lib)
    uid = lib.get_unique_id()
    assert len(uid) == 128 and uid[0] != 0
    comm = lib.comm_init_rank(1, uid, 0)
    assert comm != 0 and lib.comm_count(comm) == 1 and lib.comm_user_rank(comm) == 0
    assert lib.comm_get_async_error(comm) == 0

    # Grouped self send/recv of several buffers, pointers and sizes as plain ints.
    srcs = [torch.arange(n, dtype=torch.uint8) for n in (5, 300, 64)]
    dsts = [torch.zeros_like(s) for s in srcs]
    lib.group_send_recv(
        comm,
        [(0, s.data_ptr(), s.nbytes) for s in srcs],
        [(0, d.data_ptr(), d.nbytes) for d in dsts],
        0,
    )
    assert all(torch.equal(s, d) for s, d in zip(srcs, dsts))

    # An NCCL error surfaces with NCCL's own text; the group is closed regardless.
    bad = torch.zeros(13, dtype=torch.uint8)
    with pytest.raises(nccl.NcclError, match=r"ncclSend failed: invalid argument.*count 13"):
        lib.group_send_recv(comm, [(0, bad.data_ptr(), 13)], [], 0)
    assert ctypes.CDLL(str(fake_nccl)).fakeGroupDepth() == 0
    with pytest.raises(nccl.NcclError, match="ncclCommInitRank failed: invalid argument"):
        lib.comm_init_rank(1, bytes(128), 0)

    child = lib.comm_split(comm, 0, 0)
    assert child != 0 and lib.comm_split(comm, -1, 0) == 0
    lib.comm_destroy(child)
    with pytest.raises(nccl.NcclError, match=r"no ncclCommShrink \(needs NCCL >= 2.27\)"):
        lib.comm_shrink(comm, [0])
    with pytest.raises(nccl.NcclError, match="ncclCommGrow"):
        lib.comm_grow(comm, 2, None, -1)
    lib.comm_destroy(comm)
