"""Llama-family models: the plain `nn.Module` decoder (`llama`), its shape (`config`, `presets`), RoPE
tables (`rotary`), checkpoint loading (`loading`: HF safetensors directories, GGUF files through a
converted cache, the embedded SmolLM2) and the tokenizer with chat templates (`tokenizer`)."""
