"""``@triton.jit`` kernels only; launchers live in :mod:`moelora_lab.op.face`.

Importing :mod:`moelora_lab` first decides between the GPU and the Triton interpreter
(see ``moelora_lab._backend``); the kernels below must be defined after that.
"""
