"""What the tests and the benchmarks share and the agent does not ship: the agent harness, the SSE server and
client, the fixture trees. A package of its own (not under tests/) so that bench/ can use it without importing the
test suite and its pytest plugins."""
