"""`modcli sweep`: isoFLOP grids, points, resume, results.jsonl."""
