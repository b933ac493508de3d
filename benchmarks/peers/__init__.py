"""Other engines measured in the same run as tinyvllm (`--peers DIR` on every bench script)."""
