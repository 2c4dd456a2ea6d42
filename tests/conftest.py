import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# a wait publishes what it waits in after 0.5 s, not 2 s: the tests that make ranks
# disagree on purpose find the mismatch sooner (the diagnostics compare operator numbers
# and fingerprints, not times; the default stays 2 s)
os.environ.setdefault("GPUDIST_DIAG_AFTER", "0.5")

import pytest  # noqa: E402

from tests.harness import make_cluster, mpiexec  # noqa: E402


def _has_mpi() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return mpiexec() is not None


HAS_MPI = _has_mpi()
BACKENDS = ["gloo", pytest.param("mpi", marks=pytest.mark.skipif(
    not HAS_MPI, reason="mpi4py or mpiexec not installed"))]


@pytest.fixture(scope="session")
def cluster():
    c = make_cluster()
    yield c
    c.close()


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def _mapped_shm() -> set[str]:
    """The /dev/shm files some running process maps."""
    used = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/maps") as f:
                    used.update(line.split(None, 5)[5].split(" (deleted)")[0].strip()
                                for line in f if "/dev/shm/" in line)
            except (OSError, IndexError):
                continue
    return used


@pytest.fixture(scope="session", autouse=True)
def _mpich_shared_memory():
    """Remove the MPICH shared-memory segments this session's MPI ranks left behind (an
    MPI rank killed on purpose -- a fault test, a pool after an aborted world -- leaves
    its node's segment in /dev/shm: about 50 files, 130 MiB of memory a full run). Only
    files made since the session began, owned by this user, that no process maps."""
    import time

    started = time.time()
    yield
    shm = "/dev/shm"
    if not os.path.isdir(shm):
        return
    used = _mapped_shm()
    for name in os.listdir(shm):
        path = os.path.join(shm, name)
        try:
            st = os.stat(path)
            if (name.startswith("mpich_shm_") and st.st_mtime >= started - 1
                    and st.st_uid == os.getuid() and path not in used):
                os.unlink(path)
        except OSError:
            continue
