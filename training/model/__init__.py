"""The model a run trains. Setup's one call: trainable.load_policy(cfg, device, path) -> policy.Policy.

load.py        a causal LM and its tokenizer by name: an alias, a directory, a GGUF file, the hub
trainable.py   the device, the precision, the optimizer for it: the policy as setup loads it
lora.py        peft's LoRA adapters on the frozen base (--lora-rank)
quantize.py    the frozen base's linears in 4 bits under the adapters (--load-in-4bit, QLoRA)
pretrained.py  a save_pretrained directory or a hub name, each failure one line
gguf.py        the embedded SmolLM2-135M's GGUF file, read once into a plain cached copy"""
