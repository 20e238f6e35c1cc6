"""Does a host-tier load wait on the host for the forward stream? (round 46's failed CUDA
test). Queues a 50M-cycle sleep on the forward stream, then a load, three times: the
first on a fresh ``HostKV`` (its constructor launches every copy kernel once since
``HostKV._warm_up``; before, this first load launched them cold), then again. Prints,
per try, how long ``load`` took on the host and whether its batch was already done right
after (it should not be: the sleep runs ~25 ms). JSON on the last line.

    python bench/copy_stream_probe.py   (a CUDA machine)
"""

from __future__ import annotations

import json
import time

import torch

from tpserve.model.kv_offload import HostKV
from tpserve.model.kv_pool import KVPool, kv_bytes_per_block

LAYERS, BLOCKS, BS, HEADS, DIM = 3, 10, 4, 2, 8


def main() -> None:
    cuda = torch.device("cuda")
    pool = KVPool(LAYERS, BLOCKS, BS, HEADS, DIM, torch.bfloat16, cuda)
    host = HostKV(pool, 6, kv_bytes_per_block(LAYERS, BS, HEADS, DIM, torch.bfloat16))
    host.staging_blocks = 2
    host.store([1, 2, 3], [0, 1, 2])
    torch.cuda.synchronize()
    tries = []
    for batch in range(3):
        torch.cuda._sleep(50_000_000)
        start = time.perf_counter()
        host.load([0, 1, 2], [7, 8, 9], batch)
        took = time.perf_counter() - start
        done = host.done_batch()
        host.join(batch)
        torch.cuda.synchronize()
        tries.append({"batch": batch, "load_ms": round(took * 1e3, 3),
                      "done_right_after": done >= batch})
        print(tries[-1], flush=True)
    print(json.dumps({"device": torch.cuda.get_device_name(), "tries": tries}))


if __name__ == "__main__":
    main()
