"""pytest plugin entry point of the conformance kit (fixtures and the `gpu` marker)."""
