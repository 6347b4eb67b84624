"""Device backends: CUDA (cuda.bindings.driver) and the emulated device."""
