"""The presets (--preset): named starting values for the model, data and train flags."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # About a minute on 2 CPU cores with a clearly falling loss.
    "tiny": dict(d_model=128, n_layers=4, n_heads=4, seq_len=128, batch_size=16, max_steps=300, lr=3e-3,
                 warmup=20, eval_every=100),
    # A few minutes to tens of minutes on a CPU; a realistic shape for `modcli profile`.
    "small": dict(d_model=256, n_layers=8, n_heads=8, seq_len=256, batch_size=16, max_steps=500, lr=2e-3,
                  warmup=50, eval_every=100),
    # For a GPU.
    "base": dict(d_model=512, n_layers=12, n_heads=8, seq_len=1024, batch_size=32, max_steps=20000, lr=1e-3,
                 warmup=500, eval_every=1000),
}
