"""Discrete-event cluster simulator: simulated replicas (continuous batching, chunked prefill, a
paged prefix cache with LRU eviction, speculation whose acceptance comes from the real SuffixCache on
real tokens) behind the real `Router`, its real policies and the real speculation controllers, all
run on an asyncio event loop whose clock is virtual. Imports no torch."""
