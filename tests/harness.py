"""Rank pools for multi-rank tests: :mod:`gpudist.launch` pools, started once per
(backend, world size) and reused by every test of the session."""

from __future__ import annotations

import os
from pathlib import Path

from gpudist.launch import Cluster, RankError, RankFailure, mpiexec

ROOT = Path(__file__).resolve().parents[1]
COMM_TIMEOUT_S = float(os.environ.get("GPUDIST_TEST_COMM_TIMEOUT", "60"))


def make_cluster() -> Cluster:
    return Cluster(timeout=COMM_TIMEOUT_S)


__all__ = ["COMM_TIMEOUT_S", "Cluster", "RankError", "RankFailure", "make_cluster", "mpiexec"]
