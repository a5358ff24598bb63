"""A matmul followed by a scaling, pipelined over 4 chunks of M on CUDA
streams (or run in order on the CPU). Prints the lowered host program and
checks the result against eager torch.

    python examples/stream_parallel_matmul.py
"""

import torch

from hostir import FusionDefinition, ParallelType

CHUNKS, M, K, N = 4, 256, 128, 64
device = "cuda" if torch.cuda.is_available() else "cpu"

with FusionDefinition() as fd:
    a = fd.define_tensor(shape=[-1, -1, -1], dtype=torch.float32)  # [chunks, M / chunks, K]
    b = fd.define_tensor(shape=[-1, -1], dtype=torch.float32)  # [K, N]
    c = fd.ops.matmul(a, b)
    d = fd.ops.mul(c, 0.5)
    fd.add_output(d)
# Chunk i of both ops runs on stream i % number_of_streams, in one loop.
c.axis(0).parallelize(ParallelType.stream)
d.axis(0).parallelize(ParallelType.stream)

print(fd.host_ir())

a_in = torch.randn(CHUNKS, M // CHUNKS, K, device=device)
b_in = torch.randn(K, N, device=device)
(out,) = fd.execute([a_in, b_in], number_of_streams=2)
torch.testing.assert_close(out, (a_in @ b_in) * 0.5)
print(f"result on {device} matches eager torch: shape {list(out.shape)}")
