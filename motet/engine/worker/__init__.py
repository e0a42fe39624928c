"""The engine's worker: one rank's step on the device. The decoder, the model runner with the step's inputs and
its forward backends (eager, native CPU, CUDA graphs), the sampler and its masks, tensor parallelism."""
