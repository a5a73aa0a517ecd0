"""LoRA adapters served over one base model (`--enable-lora --lora-modules name=path ...`).

`config.py` holds the flags, `adapter.py` reads a PEFT adapter directory and checks it against the
base model, `layers.py` adds each adapter's low-rank delta beside the targeted linear layers, and
`manager.py` loads every configured adapter into its slot and resolves the adapter a request names.
"""
