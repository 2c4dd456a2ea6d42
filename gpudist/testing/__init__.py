"""Tools for checking distributed operators: the adjoint (dot-product) tests and the
seed paper's memory model (allocate, clear, add, copy, move) as reference operators."""

from .adjoint import adjoint_mismatch, assert_adjoint, jacobian_adjoint_mismatch

__all__ = ["adjoint_mismatch", "assert_adjoint", "jacobian_adjoint_mismatch"]
