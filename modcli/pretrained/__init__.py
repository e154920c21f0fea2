"""Pretrained models: `modcli import` reads a Hugging Face model folder (Llama, Mistral, Qwen2) through one adapter
per model family (`adapters`) and writes a modcli run folder (`importer`)."""
