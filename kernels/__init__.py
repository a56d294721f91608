"""Triton kernels for hqlab, installed as `hqlab_kernels` (never as a top-level `kernels` module).

Submodules are imported on demand: importing Triton kernels fixes the interpreter mode (TRITON_INTERPRET must be
set before), so this package imports nothing eagerly.
"""
