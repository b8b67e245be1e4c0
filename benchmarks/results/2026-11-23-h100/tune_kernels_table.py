# Tuned on NVIDIA H100 80GB HBM3: kernel, dtype class, shape class -> fastest tiles (median ms).
    ('ffn_bwd', 'bf16', 'few_rows'): TileConfig(64, 128, 64, num_warps=8, num_stages=3),  # 0.649 ms
    ('ffn_bwd', 'bf16', 'many_rows'): TileConfig(128, 128, 32, num_warps=8, num_stages=4),  # 1.698 ms
    ('ffn_in', 'bf16', 'few_rows'): TileConfig(128, 64, 32, num_warps=4, num_stages=3),  # 0.446 ms
    ('ffn_in', 'bf16', 'many_rows'): TileConfig(128, 128, 32, num_warps=8, num_stages=4),  # 1.056 ms
    ('gmm', 'bf16', 'few_rows'): TileConfig(128, 128, 32, num_warps=4, num_stages=3),  # 0.254 ms
    ('gmm', 'bf16', 'many_rows'): TileConfig(128, 256, 64, num_warps=8, num_stages=3),  # 0.556 ms
    ('tgmm', 'bf16', 'few_rows'): TileConfig(64, 128, 64, num_warps=8, num_stages=3),  # 0.475 ms
    ('tgmm', 'bf16', 'many_rows'): TileConfig(64, 256, 64, num_warps=8, num_stages=3),  # 0.879 ms
