"""`modcli export RUN --hf --out OUT`: a run -> a Hugging Face model folder that `transformers` loads.

- `convert`: the folder's config.json and weights. A dense model of the Llama / Mistral / Qwen2 / Qwen3 shape becomes that
  plain architecture (no remote code); every other model (Mixture-of-Depths routing, MoE, MoDE) becomes a
  `ModcliForCausalLM` whose configuration and modeling files (`remote/`, copied into the folder and named by
  config.json's `auto_map`) need only torch and transformers. Each router answers its causal rule for the folder
  itself (`Router.exported_rule`); a model the folder cannot express is refused in `convert`, with the reason.
- `tokenizer`: tokenizer.json and tokenizer_config.json (a bytes run gets one that maps byte b to id b).
- `card`: the README.md model card, filled from the run.
- `writer`: the command's orchestration, the check against modcli (when transformers is installed) and the
  folder on disk.
"""
