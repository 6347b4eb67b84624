"""Memory a runtime owns: the pinned pool, device memory, arrays pinned in place, the host cache."""
