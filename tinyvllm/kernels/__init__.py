"""Hand-written kernels launched inside tinygrad's graph (launcher.py), and a captured step replayed in one C call
on the CPU (cpu_graph.py). Taught in docs/phases/05-custom-kernels.md and 04-batched-forward.md, section 5.
"""
