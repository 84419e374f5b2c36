"""Device memory: one backend per device kind, the caching allocator's model and torch's
memory snapshot read into it, storages counted, and a step's peaks measured."""
