"""The bundled example workload: a small GPT and a byte-level corpus that needs no download."""
