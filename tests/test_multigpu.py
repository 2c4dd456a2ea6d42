"""What needs several GPUs (``make test-multigpu``, marker ``multigpu``): one rank per GPU,
device pointers straight to NCCL and (where the MPI library is CUDA-aware) to MPI. The
Slurm template ``examples/slurm/gpu_test.sbatch`` runs this file on a multi-GPU node.

Skipped with the reason on machines with fewer than two GPUs; the single-GPU suite
(test_gpu.py) and the CPU suite cover the same code with host staging."""

import pytest
import torch

from gpudist.launch import Cluster
from tests.conftest import HAS_MPI
from tests.harness import COMM_TIMEOUT_S
from tests.test_gpu import _every_layer, _lenet_cuda

N_GPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.multigpu, pytest.mark.skipif(
    N_GPU < 2, reason=f"needs 2 or more GPUs, this machine has {N_GPU}")]
TOL = 1e-10


@pytest.fixture(scope="module")
def gpus():
    c = Cluster(timeout=COMM_TIMEOUT_S, device="cuda")
    yield c
    c.close()


@pytest.mark.parametrize("n", [2, 4])
def test_every_layer_nccl_one_rank_per_gpu(gpus, n):
    if n > N_GPU:
        pytest.skip(f"needs {n} GPUs")
    for per_rank in gpus.run(n, _every_layer, backend="nccl-spawn"):
        for name, errs in per_rank.items():
            assert all(v < TOL for v in errs.values()), (name, errs)


@pytest.mark.skipif(not HAS_MPI, reason="no MPI")
def test_every_layer_mpi_one_rank_per_gpu(gpus):
    for per_rank in gpus.run(2, _every_layer, backend="mpi"):
        for name, errs in per_rank.items():
            assert all(v < TOL for v in errs.values()), (name, errs)


def test_lenet5_nccl_equals_sequential(gpus):
    n = 4 if N_GPU >= 4 else 2
    diffs = gpus.run(n, _lenet_cuda, backend="nccl-spawn")[0]
    assert max(diffs) < 1e-10, diffs
