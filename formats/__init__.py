"""Pure file-format knowledge: GGUF reading and writing, the ggml type table, MoE tensor naming."""
