"""Where K/V lives: the per-layer cache tensors on the device, and the tiers blocks move to.

| module | what it holds |
| --- | --- |
| ``cache_tensors`` | per-layer K/V tensors: sized from a block count or a budget; fp8 scales; block copies |
| ``swap`` | a pinned host pool that preempted sequences' blocks are copied to and back |
| ``host_tier`` | the prefix cache's host tier: cached blocks the device evicts, brought back on a hit |
| ``disk_tier`` | below the host tier: block files named by digest, checked whole when read, bounded |
| ``pitched_copy`` | block copies between host and device on the copy engines (``cudaMemcpy2DAsync``) |
| ``host_pool`` | what the host pools share: the cache-serves-manager check, the block-major host tensor |
| ``preemption`` | :func:`preempt`: give a sequence's blocks up by recompute or by swap |
"""
