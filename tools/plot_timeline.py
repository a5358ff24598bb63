"""Draw one hostir run's stream timeline as a PNG: a row per stream per rank,
ops coloured by kind (compute, communication, copy, sync, host).

    HOSTIR_TRACE=/tmp/trace mpirun -np 2 python3 examples/sequence_parallel_matmul.py
    python3 tools/plot_timeline.py /tmp/trace -o timeline.png

The drawing lives in `hostir.timeline`; matplotlib is needed
(`pip install 'hostir[plot]'`).
"""

import sys

from hostir.timeline import main

if __name__ == "__main__":
    sys.exit(main())
