"""Hand-written kernels, launched inside tinygrad's graph.

    launcher.py     read kernels/<device>/<name>.<ext>, hand it to tinygrad as a PROGRAM node (tinygrad compiles
                    and caches it); works under TinyJit and inside `function(precompile=True)`
    cpu_threads.py  the helper threads that let one CPU kernel launch use every core
    linear.py       `linear(x, w)` = x @ w.T on kernels/cpu/matmul.c, or the portable tinygrad matmul

Use `from tinyvllm.kernels.linear import linear`.
"""
