"""One rank of an MPI test pool: join with gpudist.init(backend="mpi"), then serve tasks."""

import os
import sys
from multiprocessing.connection import Client

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import gpudist  # noqa: E402
from tests.harness import COMM_TIMEOUT_S, serve  # noqa: E402


def main() -> None:
    host, port, key = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])
    torch.set_num_threads(1)
    w = gpudist.init(backend="mpi", device="cpu", timeout=COMM_TIMEOUT_S)
    conn = Client((host, port), authkey=key)
    conn.send(w.rank)
    serve(conn)


if __name__ == "__main__":
    main()
