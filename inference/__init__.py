"""The inference engine's parts (engine.py holds the engine): the paged KV cache and its
attention, the scheduler and block allocator, the sampler, the radix prefix cache, the
static decode step."""
