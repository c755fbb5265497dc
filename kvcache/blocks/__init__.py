"""The block core: who owns which block, pure Python, no torch.

| module | what it holds |
| --- | --- |
| ``free_queue`` | the free blocks, LRU order, O(1) removal from the middle |
| ``allocator`` | the block pool: ids, reference counts, the free queue (all or nothing) |
| ``sequence`` | one sequence's block table and counts, and the table of them |
| ``tokens`` | token ids as callers pass them, checked once |
| ``rows`` | what a step schedules for one sequence (:class:`ScheduledRow`) |
| ``admission`` | what admitting a prompt takes: prefix hits and new blocks (check = act) |
| ``window`` | releasing blocks behind a sliding window |
| ``digest`` | stable BLAKE2b digests of full blocks and canonical salts (names outside the process) |
| ``prefix_cache`` | content keys of full blocks, chained over the prefix; eviction hooks |
| ``events`` | KV events: blocks stored, removed, all cleared, per tier, for routers |
| ``release`` | giving blocks back: tail first, the prefix index kept right |
| ``fork`` | sharing a table's blocks with a new owner, copying a partial last block |
| ``truncation`` | shortening a sequence (rejected draft tokens), copying a shared last block |
| ``holds`` | blocks kept alive outside any table (a copy in flight) |
| ``parking`` | ids of swapped-out sequences, reserved until attached or dropped |
| ``integrity`` | recounting every invariant from scratch |
| ``manager`` | :class:`BlockManager`: the check/act API over all of the above |
| ``groups`` | KV groups: layers of one attention type (full, a window) sharing block tables |
| ``hybrid`` | :class:`HybridBlockManager`: one manager per KV group over one pool, all or nothing |
"""
