"""gpudist benchmark harness: ``python -m bench {primitives,kernels,halo,layers,scaling,plot}``.

Every suite times gpudist side by side with the raw backend call (or the local torch
computation) doing the same work, in the same run, and reports ratios. See
``bench/RESULTS.md`` for measured numbers and the commands that produced them.
"""
