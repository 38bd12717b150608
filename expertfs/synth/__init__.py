"""Model-shaped GGUFs with real llama.cpp architectures and random weights."""
