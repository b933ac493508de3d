"""Hand-written kernels, launched inside tinygrad's graph, and the replay of a captured step on the CPU.

launcher.py kernels/<device>/<name>.<ext> into the graph as a program linear.py, activation.py, qlinear.py
cpu_threads.py the helper threads one CPU kernel launch uses the kernels' entry points cpu_graph.py a captured step
replayed in one C call program_cache.py, graph_cache.py: what a new process reuses Chapters:
docs/phases/04-batched-forward.md (section 5), docs/phases/05-custom-kernels.md.
"""
