"""Halo exchange: geometry of the halos a sliding kernel needs, and the exchange operator.

* :mod:`gpudist.halo.geometry` -- per-dimension halo/trim/padding numbers (pure, no ranks);
* :mod:`gpudist.halo.plan` -- one worker's boxes, messages and buffers for one global shape;
* :mod:`gpudist.halo.exchange` -- :class:`HaloExchange`, the primitive filling halos from
  neighbours, with its adjoint (halo contents sent back and added into the owners' bulk).

``python -m gpudist.halo --size 20 --workers 6 --kernel 2 --stride 2 --draw`` prints a
worker table and a picture of a 1-D layout.
"""

from .exchange import HaloExchange, halo_exchange
from .geometry import HaloGeometry, WorkerHalo, halo_spec, normalize_params, worker_spec
from .plan import HaloPlan

__all__ = ["HaloExchange", "HaloGeometry", "HaloPlan", "WorkerHalo", "halo_exchange",
           "halo_spec", "normalize_params", "worker_spec"]
