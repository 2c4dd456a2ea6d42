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
