"""The weights as they reach the decoder: checkpoints (safetensors, GPTQ / AWQ, MXFP4), GGUF files, the model
store that pulls the default model, and the load's progress."""
