"""Several sequences decoded together (continuous batching): :mod:`marspec.batch.scheduler`."""
