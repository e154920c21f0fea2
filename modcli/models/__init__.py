"""The models: the MoD decoder and its blocks, routers, MoE, the KV cache, FLOP counts, and each family."""
