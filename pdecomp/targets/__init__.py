"""The models decomposed and their data: the Llama family and its checkpoints (HF,
GGUF, the hub), the toy models, token streams and corpora. Imports `core` and `spd`."""
