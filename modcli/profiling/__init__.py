"""`modcli profile`: FLOPs, latency and memory of an MoD model against its dense twin, per backend."""
